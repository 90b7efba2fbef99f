"""The LLM judge against the real local vLLM (the tiny random model): structured output always parses.

A judge that does not answer (a socket that accepts connections and never replies) is recorded
as a timeout and the episode is still emitted, without r_judge.
"""

from __future__ import annotations

import datetime as dt
import json
import socket
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pytest

from bench.fixtures import sessions as synthetic
from flywheel.ingest import lake
from flywheel.rewards import builder as episodes
from flywheel.rewards import config, judge

RUBRIC = config.Rubric("t", "1", "Rate how well the answer solves the task: 1 bad, 5 perfect.")
TOML = """
[task_types.default]
judge = true
[judge]
model = "policy-v0"
timeout_s = {timeout}
"""


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """A TCP endpoint that accepts and never answers (a hung judge server)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


def test_every_score_parses_and_is_cached(vllm_url: str, tmp_path: Path) -> None:
    j = judge.Judge(vllm_url, "policy-v0", timeout_s=30, cache_dir=tmp_path / "cache")
    texts = [f"TASK: add {i} and {i + 1}\nANSWER: {2 * i + 1}" for i in range(8)] + ["", "x" * 1500]
    results = [j.score(t, RUBRIC) for t in texts]
    bad = [(t[:30], r) for t, r in zip(texts, results) if r.status != "ok" or r.score not in range(1, 6)]
    assert not bad, f"unparsed judge answers: {bad}"
    again = [j.score(t, RUBRIC) for t in texts]
    assert [r.status for r in again] == ["cached"] * len(texts)
    assert [r.score for r in again] == [r.score for r in results]
    assert j.calls == len(texts) and j.cache_hits == len(texts)
    bumped = config.Rubric("t", "2", RUBRIC.text)
    assert j.score(texts[0], bumped).status == "ok", "a new rubric version must not hit the old cache entry"


def test_timeout_is_recorded(silent_endpoint: str, tmp_path: Path) -> None:
    j = judge.Judge(silent_endpoint, "policy-v0", timeout_s=0.5, cache_dir=tmp_path / "cache")
    result = j.score("TASK: x", RUBRIC)
    assert result.status == "timeout" and result.score is None, result
    assert 0.4 < result.latency_s < 5, result
    assert result.r_judge(0.5) is None


def build_with_judge(tmp_path: Path, url: str, timeout: float) -> list[dict]:
    root = str(tmp_path / "lake")
    feed = synthetic.LakeFeeder(root)
    start = dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=1)
    for i in range(3):
        b = synthetic.SessionBuilder(f"judge-{i}", start, task_type="default").begin()
        b.llm_call(text=f"what is {i} + {i}?")
        b.end()
        feed.write("events", b.events)
    cfg = episodes.EpisodesConfig(lake_root=root, state_dir=str(tmp_path / "state"), var_dir=str(tmp_path / "var"),
                                  judge_url=url)
    builder = episodes.Builder(cfg, config.parse(TOML.format(timeout=timeout)))
    builder.run_pass()
    files = lake.list_files(root, "episodes")
    return pa.concat_tables([lake.read_file(root, f) for f in files]).to_pylist()


def test_builder_scores_episodes_with_the_real_judge(vllm_url: str, tmp_path: Path) -> None:
    rows = build_with_judge(tmp_path, vllm_url, timeout=30)
    assert len(rows) == 3
    for r in rows:
        detail = json.loads(r["reward_detail"])["judge"]
        assert detail["status"] == "ok" and detail["score"] in range(1, 6), detail
        assert r["r_judge"] == pytest.approx(0.5 * (detail["score"] - 3) / 2)
        assert r["reward"] == pytest.approx(r["r_judge"] + r["r_outcome"] + r["r_parallel"] + r["r_finish"] + r["r_penalty"])


def test_builder_emits_despite_a_hung_judge(silent_endpoint: str, tmp_path: Path) -> None:
    rows = build_with_judge(tmp_path, silent_endpoint, timeout=0.3)
    assert len(rows) == 3, "a hung judge must not hold episodes back"
    assert all(r["r_judge"] is None for r in rows)
    assert {json.loads(r["reward_detail"])["judge"]["status"] for r in rows} == {"timeout"}
