"""The judge inside the episode builder: shadow mode never changes what the learner trains on, and a failed
judge call is retried on a later pass (after a restart too) and lands as a new label.

The judge's endpoint is replaced by a script (no network in unit tests); the real endpoint is exercised in
tests/integration/test_judge.py.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pyarrow as pa

from bench.fixtures import sessions as synthetic
from flywheel.ingest import lake
from flywheel.learner import data as learner_data
from flywheel.learner import loss
from flywheel.rewards import builder as episodes
from flywheel.rewards import config, judge

T0 = dt.datetime(2026, 1, 1, 12, tzinfo=dt.timezone.utc)
TOML = """
[outcomes.task_success]
window_s = 600
missing = 0.0
lo = 0.0
hi = 1.0
[task_types.tool_use]
wait_for = ["task_success"]
{judge}
[penalties]
malformed_tool_call = -0.5
[judge]
retry_after_s = 30
"""


class Scripted(judge.Judge):
    """Our Judge with the endpoint replaced: answers `script` in turn, then a score from the transcript's length."""

    def __init__(self, rewards: config.RewardConfig, script: list[judge.JudgeResult] | None = None) -> None:
        super().__init__("http://unused", "judge-m", rewards.judge, None)
        self.script = list(script or [])

    def score(self, text: str, rubric: config.Rubric, deadline: float | None = None) -> judge.JudgeResult:
        self._count(calls=1)
        return self.script.pop(0) if self.script else judge.JudgeResult(len(text) % 5 + 1, "ok")


def _builder(tmp: Path, judge_toml: str, script: list[judge.JudgeResult] | None = None) -> episodes.Builder:
    cfg = episodes.EpisodesConfig(lake_root=str(tmp / "lake"), state_dir=str(tmp / "state"), var_dir=str(tmp / "var"))
    rewards = config.parse(TOML.format(judge=judge_toml))
    b = episodes.Builder(cfg, rewards)
    b.judge = Scripted(rewards, script)
    return b


def _sessions(n: int) -> tuple[list[tuple[list[dict], dict]], dt.datetime]:
    """n sessions (events, outcome) of two task types, some with a malformed call, a third succeeded; and the last end."""
    out, end = [], T0
    for i in range(n):
        b = synthetic.SessionBuilder(f"s{i}", T0, task_type=f"tool_use.{'add' if i % 2 else 'mul'}").begin()
        for k in range(1 + i % 3):
            b.llm_call(text=f"request {i} turn {k}" + " pad" * i)
            b.tool(malformed=(i % 4 == 1 and k == 0))
        end = max(end, b.end())
        out.append((b.events, synthetic.outcome(f"s{i}", "task_success", float(i % 3 == 0), end)))
    return out, end


def _feed(root: str, sessions: list[tuple[list[dict], dict]]) -> None:
    feed = synthetic.LakeFeeder(root)
    for events, outcome in sessions:
        feed.write("events", events)
        feed.write("outcomes", [outcome])


def _rows(root: str) -> list[dict]:
    return pa.concat_tables([lake.read_file(root, f) for f in lake.list_files(root, "episodes")]).to_pylist()


def _advantages(rows: list[dict]) -> dict[str, list[float]]:
    eps = [learner_data.parse_row(r, vocab_size=512, max_seq_len=4096) for r in sorted(rows, key=lambda r: r["episode_id"])]
    assert all(isinstance(e, learner_data.Episode) for e in eps), [e for e in eps if isinstance(e, str)]
    args = ([e.reward for e in eps], [e.task_type for e in eps], [e.group_id for e in eps])
    pen = [e.r_penalty for e in eps]
    return {"batch": loss.advantages(*args, None, group_relative=True, normalize=True, batch_baseline=True, penalties=pen),
            "positive": loss.advantages(*args, None, group_relative=False, normalize=False, batch_baseline=True,
                                        positive_only=True, penalties=pen),
            "running": loss.advantages(*args, loss.Baseline(0.9, {}), group_relative=False, normalize=True, penalties=pen)}


def test_a_shadow_judge_score_never_changes_an_advantage(tmp_path: Path) -> None:
    runs = {}
    sessions, end = _sessions(12)  # one set of events (ids included) for both lakes
    for name, judge_toml in (("off", "judge = false"), ("shadow", "judge = true\njudge_weight = 0.0")):
        root = str(tmp_path / name / "lake")
        _feed(root, sessions)
        with _builder(tmp_path / name, judge_toml) as b:
            b.run_pass(now=end + dt.timedelta(seconds=60))
        runs[name] = _rows(root)
    off, shadow = runs["off"], runs["shadow"]
    assert len(off) == len(shadow) > 12
    scores = {r["judge_score"] for r in shadow}
    assert None not in scores and len(scores) > 1, f"every shadow row carries a score, and they differ: {scores}"
    assert {r["judge_score"] for r in off} == {None}
    assert {r["r_judge"] for r in shadow} == {0.0}
    details = [json.loads(r["reward_detail"])["judge"] for r in shadow]
    assert {(d["shadow"], d["weight"], d["version"]) for d in details} == {(True, 0.0, "judge-m/default@1")}, details[0]
    by_id = {r["episode_id"]: r["reward"] for r in off}
    assert {r["episode_id"]: r["reward"] for r in shadow} == by_id, "a shadow score changed a reward"
    assert _advantages(shadow) == _advantages(off), "a shadow score changed an advantage"


def test_a_failed_judge_call_is_retried_on_a_later_pass_after_a_restart(tmp_path: Path) -> None:
    root = str(tmp_path / "lake")
    sessions, end = _sessions(1)
    _feed(root, sessions)
    timeout = judge.JudgeResult(None, "timeout")
    b = _builder(tmp_path, "judge = true\njudge_weight = 0.5", script=[timeout])
    b.run_pass(now=end + dt.timedelta(seconds=60))
    first = _rows(root)
    assert {r["label_version"] for r in first} == {1} and {r["judge_score"] for r in first} == {None}
    assert json.loads(first[0]["reward_detail"])["judge"]["status"] == "timeout"
    assert [q["session_id"] for q in b.state.judge_retry] == ["s0"] and b.state.judge_retry[0]["attempts"] == 1
    b.close()
    b = _builder(tmp_path, "judge = true\njudge_weight = 0.5", script=[judge.JudgeResult(5, "ok")])
    assert b.run_pass(now=end + dt.timedelta(seconds=70)).idle, "retried only retry_after_s after the failure"
    res = b.run_pass(now=end + dt.timedelta(seconds=100))
    assert res.relabels == 1 and b.state.judge_retry == [], res
    rows = _rows(root)
    second = [r for r in rows if r["label_version"] == 2]
    assert len(second) == len(first) and {r["judge_score"] for r in second} == {5}
    detail = json.loads(second[0]["reward_detail"])
    assert detail["label_reason"] == "judge_retry" and detail["judge"]["status"] == "ok", detail
    by_id = {r["episode_id"]: r["reward"] for r in first}
    assert all(r["reward"] == by_id[r["episode_id"]] + 0.5 for r in second), "weight 0.5 * (5 - 3) / 2 added to each row"
    b.close()
