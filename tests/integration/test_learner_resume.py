"""Crash safety of the learner process: SIGKILL mid-training then restart, and graceful SIGTERM.

The daemon runs as a real process (`python -m flywheel.learner.daemon`) on a tmp lake, a tiny random model
and the real MLflow store, checkpointing every CHECKPOINT_EVERY steps (and at each version). The kill
sends the learner back to its last checkpoint: the steps logged after it appear twice in trained.jsonl
(the first time into weights the kill lost), and along the weights' lineage the killed-and-restarted
run trains exactly the episodes a clean run trains, in the same steps, each once.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

from bench.fixtures.episodes import random_rows, write_episodes
from bench.fixtures.models import tiny_model
from flywheel.base.config import write_resolved
from flywheel.learner import checkpoint
from flywheel.learner.config import LearnerConfig

REPO = Path(__file__).resolve().parents[2]
FILES, ROWS = 10, 8
CHECKPOINT_EVERY = 3  # with publish_every_steps 5: checkpoints at steps 3, 5, 8 and 10


@pytest.fixture(scope="module")
def workload(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, set[str]]:
    root = tmp_path_factory.mktemp("learner-resume")
    model = tiny_model(root / "model")
    ids: set[str] = set()
    for i in range(FILES):
        rows = random_rows(ROWS, seed=100 + i, prompt_len=48, completion_len=48)
        ids |= {r["episode_id"] for r in rows}
        write_episodes(root / "lake", rows, seq=i)
    return root / "lake", model, ids


def _config(tmp: Path, lake_root: Path, model: Path, mlflow_uri: str, name: str,
            checkpoint_every: int = CHECKPOINT_EVERY) -> Path:
    cfg = LearnerConfig(lake_root=str(lake_root), base_model=str(model), run_dir=str(tmp / name),
                        policies_dir=str(tmp / f"{name}-policies"), var_dir=str(tmp / "var"), device="cpu",
                        mlflow_tracking_uri=mlflow_uri, experiment=f"test-learner-resume-{uuid.uuid4().hex[:8]}",
                        publish=False, batch_size=ROWS, min_batch=ROWS, micro_batch=4, lora_rank=4, lr=1e-3,
                        publish_every_steps=5, checkpoint_every_steps=checkpoint_every, idle_exit_s=2.0, poll_s=0.5)
    cfg.check()
    return write_resolved(cfg, tmp / f"{name}.toml")


def _start(config: Path, log_path: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "flywheel.learner.daemon", "--config", str(config)], cwd=REPO, env=env,
                            stdout=open(log_path, "ab"), stderr=subprocess.STDOUT)


def _wait_steps(run_dir: Path, n: int, proc: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while len(checkpoint.read_trained(run_dir)) < n:
        assert proc.poll() is None, f"learner exited early with {proc.returncode}"
        assert time.monotonic() < deadline, f"fewer than {n} steps within {timeout} s"
        time.sleep(0.05)


def _by_step(log: list[dict]) -> dict[int, list[str]]:
    return {line["step"]: sorted(line["episode_ids"]) for line in log}


def test_sigkill_then_restart_trains_each_episode_once_into_the_weights(
        tmp_path: Path, workload: tuple[Path, Path, set[str]], mlflow_uri: str) -> None:
    lake_root, model, ids = workload
    clean_cfg = _config(tmp_path, lake_root, model, mlflow_uri, "clean")
    clean = _start(clean_cfg, tmp_path / "clean.log")
    assert clean.wait(timeout=300) == 0, (tmp_path / "clean.log").read_text()[-3000:]
    clean_log = checkpoint.read_trained(tmp_path / "clean")
    assert {i for line in clean_log for i in line["episode_ids"]} == ids

    cfg = _config(tmp_path, lake_root, model, mlflow_uri, "killed")
    first = _start(cfg, tmp_path / "killed.log")
    _wait_steps(tmp_path / "killed", 4, first)
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=30)
    before = checkpoint.read_trained(tmp_path / "killed")  # what the killed process logged
    second = _start(cfg, tmp_path / "killed.log")
    assert second.wait(timeout=300) == 0, (tmp_path / "killed.log").read_text()[-3000:]
    text = (tmp_path / "killed.log").read_text()
    resumed = re.search(r"checkpoint: resuming from \S+ \(step (\d+)", text)
    assert resumed, text[-3000:]
    resumed_at = int(resumed.group(1))

    # the kill lost the steps logged after the checkpoint it resumed from: at most CHECKPOINT_EVERY of them
    lost = [line for line in before if line["step"] > resumed_at]
    assert [line["step"] for line in lost] == list(range(resumed_at + 1, before[-1]["step"] + 1)), (resumed_at, before)
    assert len(lost) <= CHECKPOINT_EVERY, f"resumed from step {resumed_at}, {len(lost)} logged steps after it lost"
    log = checkpoint.read_trained(tmp_path / "killed")
    assert log[:len(before)] == before and [line["step"] for line in log[len(before):]] == \
        list(range(resumed_at + 1, FILES + 1)), "the restart logs every step after its checkpoint, once"
    # in the log, exactly the lost steps' episodes appear twice: once into the lost weights, once into the kept
    counts = Counter(i for line in log for i in line["episode_ids"])
    assert set(counts) == ids, f"{len(ids - set(counts))} episodes never trained after the restart"
    assert {i for i, c in counts.items() if c > 1} == {i for line in lost for i in line["episode_ids"]}
    assert max(counts.values()) <= 2
    # along the weights' lineage: each episode once, the same steps with the same episodes as the clean run
    state = checkpoint.latest_state(tmp_path / "killed")[1]  # type: ignore[index]
    along = checkpoint.trained_lineage(log, upto=state.step)
    assert sorted(Counter(i for line in along for i in line["episode_ids"]).values()) == [1] * len(ids)
    assert _by_step(along) == _by_step(clean_log), f"killed after {len(before)} logged steps; batches differ"


def test_sigterm_finishes_the_step_checkpoints_and_exits_zero(
        tmp_path: Path, workload: tuple[Path, Path, set[str]], mlflow_uri: str) -> None:
    lake_root, model, _ = workload
    # no checkpoint by count: before the version at step 5 only the stop's own checkpoint holds the steps
    cfg = _config(tmp_path, lake_root, model, mlflow_uri, "term", checkpoint_every=100)
    proc = _start(cfg, tmp_path / "term.log")
    _wait_steps(tmp_path / "term", 2, proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, (tmp_path / "term.log").read_text()[-3000:]
    log = checkpoint.read_trained(tmp_path / "term")
    state, _ = checkpoint.load_latest(tmp_path / "term")  # type: ignore[misc]
    assert state.step == log[-1]["step"], f"checkpoint at step {state.step}, last trained step {log[-1]['step']}"
    assert state.step < FILES, "it stopped early instead of training the whole lake"
    text = (tmp_path / "term.log").read_text()
    assert "signal SIGTERM" in text
    stop_saved = f"checkpoint: stopping at step {state.step}" in text
    assert stop_saved == (state.step != 5), f"step {state.step}: the stop checkpoints the steps since the last " \
                                            "checkpoint (the version at step 5 has its own)\n" + text[-3000:]
