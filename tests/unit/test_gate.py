"""The promotion gate as pure decisions, and the online reward reader over a tmp lake (DuckDB, no services)."""

from __future__ import annotations

import random
from pathlib import Path

from bench.fixtures.episodes import episode_row, write_sessions
from flywheel.serving.evaluate import EvalScore, arithmetic_tasks
from flywheel.serving.promote import (
    PromoteConfig,
    decide,
    decide_rollback,
    online_rewards,
)

CFG = PromoteConfig(min_sessions=30, alpha=0.05)


def _binary(rate: float, n: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [float(rng.random() < rate) for _ in range(n)]


def _scores(champ: int, chal: int, n: int = 64) -> tuple[EvalScore, EvalScore]:
    return EvalScore("t", n, champ), EvalScore("t", n, chal)


def test_clearly_better_challenger_is_promoted() -> None:
    rewards = {1: _binary(0.3, 80, 1), 2: _binary(0.7, 80, 2)}
    d = decide(1, 2, rewards, _scores(20, 30), CFG)
    assert d.action == "promote", d.reason
    assert d.numbers["online_p_better"] < 0.001, d.numbers


def test_worse_challenger_is_rejected_online() -> None:
    d = decide(1, 2, {1: _binary(0.7, 80, 3), 2: _binary(0.3, 80, 4)}, _scores(30, 30), CFG)
    assert d.action == "reject" and "online" in d.reason, d.reason


def test_a_drop_beyond_max_drop_is_rejected_though_not_significant() -> None:
    champ, chal = [1.0] * 35 + [0.0] * 65, [1.0] * 28 + [0.0] * 72  # 0.35 -> 0.28 over 100 sessions each
    d = decide(1, 2, {1: champ, 2: chal}, _scores(30, 30), CFG)
    assert d.action == "promote" and d.numbers["online_p_worse"] > 0.05, "not significant: the default promotes it"
    strict = PromoteConfig(min_sessions=30, alpha=0.05, max_drop=0.02)
    d = decide(1, 2, {1: champ, 2: chal}, _scores(30, 30), strict)
    assert d.action == "reject" and "max_drop" in d.reason, d.reason
    d = decide(1, 2, {1: champ, 2: [1.0] * 34 + [0.0] * 66}, _scores(30, 30), strict)
    assert d.action == "promote", "a drop within max_drop still passes"


def test_offline_regression_rejects_even_with_good_online_reward() -> None:
    d = decide(1, 2, {1: _binary(0.5, 80, 5), 2: _binary(0.55, 80, 6)}, _scores(50, 20), CFG)
    assert d.action == "reject" and "offline" in d.reason, d.reason


def test_too_few_sessions_holds() -> None:
    d = decide(1, 2, {1: _binary(0.3, 80, 7), 2: _binary(0.9, 29, 8)}, _scores(20, 30), CFG)
    assert d.action == "hold" and "too few" in d.reason, d.reason


def test_missing_offline_score_holds_unless_not_required() -> None:
    rewards = {1: _binary(0.3, 80, 9), 2: _binary(0.7, 80, 10)}
    assert decide(1, 2, rewards, "not served", CFG).action == "hold"
    lenient = PromoteConfig(require_offline_eval=False)
    assert decide(1, 2, rewards, "not served", lenient).action == "promote"


def test_no_challenger() -> None:
    assert decide(3, None, {}, None, CFG).action == "none"
    assert decide(3, 3, {}, None, CFG).action == "none"


def test_rollback_only_on_significant_regression_with_enough_sessions() -> None:
    assert decide_rollback(2, 1, {1: _binary(0.7, 80, 11), 2: _binary(0.3, 80, 12)}, CFG).action == "rollback"
    assert decide_rollback(2, 1, {1: _binary(0.5, 80, 13), 2: _binary(0.5, 80, 14)}, CFG).action == "keep"
    assert decide_rollback(2, 1, {1: _binary(0.7, 80, 15), 2: _binary(0.1, 10, 16)}, CFG).action == "keep"
    assert decide_rollback(2, None, {}, CFG).action == "keep"


def test_online_rewards_per_session_use_the_latest_label(tmp_path: Path) -> None:
    import datetime as dt

    import pyarrow as pa

    from flywheel.ingest import lake
    from flywheel.ingest.schema import episode_arrow_schema

    root = str(tmp_path / "lake")
    assert online_rewards(root) == {}
    write_sessions(root, 4, [1.0, 0.0, 0.5], calls_per_session=3)
    # a relabel: the same episode with label 2 replaces label 1's reward
    relabel = {"session_id": "s-relabel", "policy_version": 5}
    rows = [episode_row(**relabel, reward=0.0, label_version=1, episode_id="ep-1"),
            episode_row(**relabel, reward=1.0, label_version=2, episode_id="ep-1"),
            episode_row(**relabel, reward=0.5, label_version=1, episode_id="ep-2")]
    lake.write_file(root, "episodes", dt.date.today().isoformat(), "other", 0, 0, 2,
                    pa.Table.from_pylist(rows, schema=episode_arrow_schema()))
    got = online_rewards(root)
    assert sorted(got[4]) == [0.0, 0.5, 1.0], got
    assert got[5] == [0.75], f"latest labels 1.0 and 0.5 average to 0.75, got {got[5]}"


def test_default_eval_tasks_are_deterministic_and_checkable() -> None:
    a, b = arithmetic_tasks(), arithmetic_tasks()
    assert [t.messages for t in a] == [t.messages for t in b] and len(a) == 64
    task = a[0]
    x, y = task.messages[0]["content"].rstrip("=").split("+")
    assert task.check(f" {int(x) + int(y)} ") and not task.check("nothing")


def test_eval_task_sets_load_from_a_module_or_a_file(tmp_path: Path) -> None:
    import pytest

    from flywheel.serving.evaluate import load_tasks

    assert len(load_tasks("flywheel.serving.evaluate:arithmetic_tasks")) == 64
    family = tmp_path / "family.py"
    family.write_text("from flywheel.serving.evaluate import arithmetic_tasks\n\ndef tasks():\n    return arithmetic_tasks(n=3)\n")
    assert len(load_tasks(f"{family}:tasks")) == 3
    with pytest.raises(ValueError, match="module:function"):
        load_tasks("flywheel.serving.evaluate")


def test_start_up_finds_servers_stranded_on_a_version_no_alias_names() -> None:
    from flywheel.serving.promote import stranded

    # killed between clearing the challenger alias and reloading: the server still holds refused v5
    assert stranded({"http://a": 5, "http://b": 3}, champion=3, registered={3, 5}) == ["http://a"]
    # a full-weight push whose registration has not happened yet is a publish in flight: left alone
    assert stranded({"http://a": 6}, champion=3, registered={3, 5}) == []
    # the base is always known; a server on it while the champion is v3 is stranded
    assert stranded({"http://a": 0}, champion=3, registered={3}) == ["http://a"]
    assert stranded({"http://a": 0, "http://b": 0}, champion=0, registered=set()) == []
