"""The learner's parts as pure functions: trainer row selection and warm-up, the gate's rulings,
version numbers and the publish clock, a step's metrics, the advantage helpers (no model)."""

from __future__ import annotations

import datetime
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from flywheel.learner.checkpoint import TrainerState, append_trained, read_trained, trained_lineage
from flywheel.learner.config import LearnerConfig
from flywheel.learner.data import iso_ts
from flywheel.learner.gate import abandoned_above, gate_ruled
from flywheel.learner.loss import (
    Baseline,
    key_sums,
    row_baselines,
    std_scale,
    task_means,
)
from flywheel.learner.metrics import MAX_METRICS_PER_CALL, Tracker, step_metrics
from flywheel.learner.trainer import StepResult, rows_worth_running, warmup_factor_at
from flywheel.learner.versions import (
    Versions,
    episode_range,
    next_version,
    version_meta,
)


def test_warmup_is_linear_then_flat_and_off_at_zero_steps() -> None:
    assert [warmup_factor_at(s, 4) for s in range(6)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])
    assert warmup_factor_at(0, 0) == 1.0


def test_rows_of_advantage_zero_are_left_out_but_every_rank_gets_one() -> None:
    plan = [("a", 0.0), ("b", 1.0), ("c", 0.0), ("d", -0.5)]
    assert rows_worth_running(plan, kl_coef=0.0, world_size=1) == [("b", 1.0), ("d", -0.5)]
    assert rows_worth_running(plan, kl_coef=0.0, world_size=3) == [("b", 1.0), ("d", -0.5), ("a", 0.0)]
    zeros = [("a", 0.0), ("c", 0.0)]
    assert rows_worth_running(zeros, kl_coef=0.0, world_size=1) == [("a", 0.0)], "DDP needs a backward on every rank"
    assert rows_worth_running(plan, kl_coef=0.1, world_size=1) == plan, "a KL term gives every row a gradient"


def test_the_gate_has_ruled_unless_our_newest_version_is_the_challenger() -> None:
    assert gate_ruled([1, 2], None), "registry unreadable: publishing must not stop"
    assert gate_ruled([], {"challenger": 1}), "nothing published: nothing to wait for"
    assert not gate_ruled([1, 2], {"champion": 1, "challenger": 2})
    assert gate_ruled([1, 2], {"champion": 2}), "promoted"
    assert gate_ruled([1, 2], {"champion": 1}), "rejected (challenger alias cleared)"


def test_a_rebase_abandons_only_the_newer_versions_not_abandoned_before() -> None:
    assert abandoned_above([1, 2, 3], [], 1) == [2, 3]
    assert abandoned_above([1, 2, 3, 4], [2, 3], 1) == [4]
    assert abandoned_above([1, 2], [], 2) == []


def test_version_numbers_pass_both_the_state_and_the_directories(tmp_path: Path) -> None:
    assert next_version(tmp_path / "none", 4) == 5
    for name in ("policy-v2", "policy-v7", "notes"):
        (tmp_path / name).mkdir()
    assert next_version(tmp_path, 4) == 8, "a crash may have left policy-v7 unrecorded"
    assert next_version(tmp_path, 9) == 10
    state = TrainerState(step=12, policy_version=4, since_parent={"count": 16, "steps": 2})
    meta = version_meta(8, "lora", str(tmp_path), state, {"files": 3}, learner_run_id="run-1")
    assert (meta["policy_version"], meta["parent_version"], meta["learner_step"]) == (8, 4, 12)
    assert meta["base_model"] == str(tmp_path.resolve()) and meta["learner_run_id"] == "run-1"
    assert meta["data_window"] == {"files": 3, "since_parent": {"count": 16, "steps": 2}}, meta["data_window"]
    assert version_meta(8, "lora", str(tmp_path), TrainerState(), {})["learner_run_id"] is None, "tracking off"


def test_the_episode_range_since_the_parent_keeps_running_bounds() -> None:
    def ep(version: int, ts: str | None) -> SimpleNamespace:
        return SimpleNamespace(policy_version=version, call_ts=ts)

    window = episode_range({}, [ep(3, "2026-01-01T00:00:05.000000Z"), ep(2, None)], step=7)  # type: ignore[list-item]
    assert window == {"count": 2, "steps": 1, "first_step": 7, "last_step": 7,
                      "first_call_ts": "2026-01-01T00:00:05.000000Z", "last_call_ts": "2026-01-01T00:00:05.000000Z",
                      "min_policy_version": 2, "max_policy_version": 3}, window
    window = episode_range(window, [ep(4, "2026-01-01T00:00:09.000000Z"), ep(3, "2026-01-01T00:00:01.000000Z")],
                           step=8)  # type: ignore[list-item]
    assert (window["count"], window["steps"], window["first_step"], window["last_step"]) == (4, 2, 7, 8), window
    assert (window["first_call_ts"], window["last_call_ts"]) == ("2026-01-01T00:00:01.000000Z",
                                                                 "2026-01-01T00:00:09.000000Z"), window
    assert (window["min_policy_version"], window["max_policy_version"]) == (2, 4), window
    assert episode_range(window, [], step=9) == window, "an empty batch changes nothing"
    no_stamps = episode_range({}, [ep(1, None)], step=1)  # type: ignore[list-item]
    assert (no_stamps["first_call_ts"], no_stamps["last_call_ts"]) == (None, None), no_stamps


def test_lake_timestamps_become_utc_text_that_sorts_in_time_order() -> None:
    paris = datetime.timezone(datetime.timedelta(hours=1))
    assert iso_ts(datetime.datetime(2026, 3, 1, 12, 0, 0, 5, tzinfo=paris)) == "2026-03-01T11:00:00.000005Z"
    assert iso_ts(datetime.datetime(2026, 3, 1, 9, 30)) == "2026-03-01T09:30:00.000000Z", "naive means UTC"
    assert iso_ts(None) is None and iso_ts("2026-03-01T09:30:00Z") == "2026-03-01T09:30:00Z"


def test_the_publish_clock_counts_steps_and_seconds_and_can_wait_for_the_gate() -> None:
    cfg = LearnerConfig(publish_every_steps=3, publish_every_s=60.0, publish_wait_for_gate=True)
    state = TrainerState(step=5, policy_version=1, last_published_step=3)
    versions = Versions(cfg, state, policy=None, stream=None)  # type: ignore[arg-type]
    assert not versions.due(gate_ruled=True), "2 steps of 3, 0 s of 60"
    state.step = 6
    assert versions.due(gate_ruled=True)
    assert not versions.due(gate_ruled=False), "the step count waits for the gate's verdict"
    versions.last_publish_time = time.monotonic() - 61.0
    assert versions.due(gate_ruled=False), "the time trigger publishes without a verdict"
    versions.trained([SimpleNamespace(policy_version=1, call_ts=None)])  # type: ignore[list-item]
    assert state.since_parent["count"] == 1 and state.since_parent["first_step"] == 6, state.since_parent
    versions.adopt(4)
    assert (state.policy_version, state.last_published_step) == (4, 6) and not versions.due(gate_ruled=True)
    assert state.since_parent == {}, "the new version's range starts empty (after a publish or a rebase)"


def test_an_undecided_challenger_is_superseded_after_publish_supersede_s() -> None:
    cfg = LearnerConfig(publish_every_steps=3, publish_wait_for_gate=True, publish_supersede_s=300.0)
    state = TrainerState(step=6, policy_version=1, last_published_step=3)
    versions = Versions(cfg, state, policy=None, stream=None)  # type: ignore[arg-type]
    versions.last_publish_time = time.monotonic() - 299.0
    assert not versions.due(gate_ruled=False), "the gate still has time to judge the newest version"
    versions.last_publish_time = time.monotonic() - 301.0
    assert versions.due(gate_ruled=False), "undecided after 300 s: the next version replaces it"
    state.step = 5
    assert not versions.due(gate_ruled=False), "superseding never publishes before the step count is reached"
    cfg.publish_supersede_s = 0.0
    state.step = 6
    assert not versions.due(gate_ruled=False), "0: wait for the verdict however long it takes"


def test_step_metrics_report_reward_lag_and_drops() -> None:
    batch = [SimpleNamespace(reward=r, opens_session=r > 0) for r in (0.0, 1.0, 1.0, 0.0)]
    result = StepResult(episodes=4, tokens=400, trained_tokens=100, loss=0.5, ratio_mean=1.0, ratio_max=1.2,
                        clip_frac=0.1, kl=0.01, grad_norm=2.0, seconds=2.0, behaviour_gap_mean=1e-4,
                        behaviour_gap_max=3e-4, kl_coef=0.4)
    state = TrainerState(step=3, policy_version=2, abandoned=[5])
    m = step_metrics(batch, Counter({0: 3, 2: 1}), result, state,  # type: ignore[arg-type]
                     Counter(stale=7, corrupt=1), max_staleness=2)
    assert m["reward_mean"] == 0.5 and m["reward_std"] == pytest.approx(0.57735, abs=1e-5)
    assert m["policy_lag_mean"] == 0.5 and m["policy_lag_max"] == 2.0, m
    assert (m["staleness_lag_0"], m["staleness_lag_1"], m["staleness_lag_2"]) == (3.0, 0.0, 1.0)
    assert m["tokens_per_s"] == 200.0 and m["dropped_stale_total"] == 7 and m["relabel_after_train_total"] == 0
    assert m["abandoned_versions_total"] == 1.0 and m["mismatch_behaviour_max"] == 3e-4
    assert (m["kl"], m["kl_coef"], m["session_openings"]) == (0.01, 0.4, 2.0)


def test_a_line_torn_by_a_kill_does_not_take_the_next_one_with_it(tmp_path: Path) -> None:
    append_trained(tmp_path, 1, 0, ["a"])
    with open(tmp_path / "trained.jsonl", "a") as fh:
        fh.write('{"step": 2, "policy_ver')  # the kill came mid-write
    append_trained(tmp_path, 2, 0, ["b"])
    assert [(x["step"], x["episode_ids"]) for x in read_trained(tmp_path)] == [(1, ["a"]), (2, ["b"])]


def test_trained_lineage_keeps_the_lines_of_the_weights_that_went_on() -> None:
    steps = [1, 2, 3, 4, 5, 4, 5, 6, 7, 8, 7]  # resumed from step 3's checkpoint, later from step 6's
    lines = [{"step": s, "episode_ids": [f"{s}.{n}"]} for n, s in enumerate(steps)]
    kept = [x["episode_ids"][0] for x in trained_lineage(lines)]
    assert kept == ["1.0", "2.1", "3.2", "4.5", "5.6", "6.7", "7.10"], kept
    assert [x["step"] for x in trained_lineage(lines[:10], upto=6)] == [1, 2, 3, 4, 5, 6], \
        "stopped at step 6's checkpoint: steps 7-8 trained weights no checkpoint kept"
    assert trained_lineage([]) == []
    assert [x["step"] for x in trained_lineage(lines[:3] + lines[:2])] == [1, 2], "a fresh start: a new lineage"


class _Store:
    """An MLflow client's log_batch that records each call, and refuses while `down`."""

    def __init__(self) -> None:
        self.calls: list[list] = []
        self.down = False

    def log_batch(self, run_id: str, metrics: list) -> None:
        if self.down:
            raise ConnectionError("store down")
        self.calls.append(list(metrics))

    def set_terminated(self, run_id: str, status: str) -> None:
        self.status = status


def _tracker(**kw: object) -> tuple[Tracker, _Store]:
    tracker = Tracker(LearnerConfig(mlflow_tracking_uri="", **kw))  # type: ignore[arg-type]
    store = _Store()
    tracker.client, tracker.run_id = store, "run"
    return tracker, store


def test_tracker_sends_the_steps_metrics_in_one_call_every_k_steps_at_a_version_and_at_the_end() -> None:
    tracker, store = _tracker(mlflow_flush_every_steps=3, mlflow_flush_every_s=0.0)
    for step in (1, 2):
        tracker.log(step, {"loss": 0.5, "nan": float("nan")})
    assert store.calls == [], "kept until the third step"
    tracker.log(3, {"loss": 0.25})
    assert [[(m.key, m.step) for m in call] for call in store.calls] == [[("loss", 1), ("loss", 2), ("loss", 3)]], \
        "one call, each metric with its own step (a NaN left out)"
    tracker.log(4, {"loss": 0.1}, flush=True)  # a version: sent at once
    assert len(store.calls) == 2 and store.calls[1][0].step == 4
    tracker.log(5, {"loss": 0.2})
    tracker.end("FINISHED")
    assert [m.step for m in store.calls[2]] == [5] and store.status == "FINISHED", "a stop sends what is kept"


def test_tracker_keeps_what_the_store_refused_and_splits_at_the_batch_limit() -> None:
    tracker, store = _tracker(mlflow_flush_every_steps=1)
    store.down = True
    tracker.log(1, {"a": 1.0})
    tracker.log(2, {"a": 2.0})
    assert store.calls == [] and len(tracker.kept) == 2, "a refused send is kept for the next flush"
    store.down = False
    tracker.log(3, {f"k{i}": float(i) for i in range(MAX_METRICS_PER_CALL)})
    assert [len(c) for c in store.calls] == [MAX_METRICS_PER_CALL, 2], "1002 metrics: two calls within the limit"
    assert [m.step for m in store.calls[0][:2]] == [1, 2] and tracker.kept == []
    timed, timed_store = _tracker(mlflow_flush_every_steps=100, mlflow_flush_every_s=5.0)
    timed.flushed_at -= 6.0
    timed.log(1, {"a": 1.0})
    assert len(timed_store.calls) == 1, "mlflow_flush_every_s passed: sent without waiting for the count"


def test_advantage_helpers() -> None:
    assert task_means([1.0, 0.0, 0.5], ["a", "a", "b"]) == {"a": 0.5, "b": 0.5}
    assert key_sums([1.0, 0.0, 0.7, 0.2], ["g", "g", "h", None]) == {"g": (1.0, 2), "h": (0.7, 1)}, "None is no key"
    base = row_baselines([1.0, 0.0, 0.7, 0.2], ["a"] * 4, ["g", "g", "h", None], None, group_relative=True,
                         batch_baseline=True)
    assert base == pytest.approx([0.0, 1.0, 1.2 / 3, 1.7 / 3]), "a lone row is no group: the others of its type"
    assert std_scale([1.0, -1.0]) == pytest.approx(1.4142, abs=1e-4)
    assert std_scale([0.0, 0.0]) == 1.0 and std_scale([3.0]) == 1.0, "equal advantages are not blown up"
    baseline = Baseline(0.9, {"a": 1.0})
    baseline.update({"a": 0.0, "b": 0.4})
    assert baseline.means == pytest.approx({"a": 0.9, "b": 0.4})


def test_lag_counts_learner_steps_along_the_line_and_a_rebase_puts_the_champion_at_0() -> None:
    state = TrainerState(step=0, policy_version=0)
    assert state.lineage == {0: 0}, "a fresh learner's line starts at its start version"
    versions = Versions(LearnerConfig(), state, policy=None, stream=None)  # type: ignore[arg-type]
    for step, version in ((3, 1), (6, 2), (9, 3)):  # published every 3 steps
        state.step = step
        state.published.append(version)
        versions.adopt(version)
    state.step = 11
    assert state.lags() == {0: 11, 1: 8, 2: 5, 3: 2}
    state.rebase_line(1)  # the gate refused v2 and v3: back on the champion v1 (gate.rebase_onto, then adopt)
    versions.adopt(1)
    assert state.lags() == {0: 3, 1: 0}, "the champion at lag 0, v0 as far behind it as before, v2 and v3 off the line"
    state.step = 14
    state.published.append(4)
    versions.adopt(4)
    state.step = 15
    assert state.lags() == {0: 7, 1: 4, 4: 1}, "a child published: the champion's rows are 4 steps old, not 3 versions"
    state.rebase_line(7)  # a champion this learner never had on its line
    assert state.lineage == {7: 15}


def test_a_checkpoint_without_lineage_starts_one_at_its_current_version() -> None:
    import json
    from dataclasses import asdict

    state = TrainerState(step=9, policy_version=4, last_published_step=6, published=[2, 4], lineage={2: 1, 4: 6})
    again = TrainerState(**json.loads(json.dumps(asdict(state))))
    assert again == state and again.lags() == {2: 8, 4: 3}, "JSON's text keys come back as versions"
    old = asdict(state)
    del old["lineage"]
    assert TrainerState(**json.loads(json.dumps(old))).lags() == {4: 3}, \
        "best effort: the current version at its publish step; older steps were never kept"


def test_rows_may_not_go_stale_before_the_next_version_is_due() -> None:
    from flywheel.base.config import ConfigError

    with pytest.raises(ConfigError, match="max_staleness_steps"):
        LearnerConfig(publish_every_steps=10, max_staleness_steps=8).check()
    LearnerConfig(publish_every_steps=10, max_staleness_steps=10).check()
    LearnerConfig(publish_every_steps=0, max_staleness_steps=0).check()

