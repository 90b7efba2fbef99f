"""Pure logic of the demo's report statistics and of the simulated outcome sources."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from flywheel.demo import outcome_sim, report, tasks
from flywheel.serving import stats


def test_wilson_interval_contains_the_rate_and_narrows_with_n() -> None:
    lo, hi = stats.wilson(30, 100)
    assert lo < 0.3 < hi
    lo2, hi2 = stats.wilson(300, 1000)
    assert hi2 - lo2 < hi - lo
    assert stats.wilson(0, 0) == (0.0, 1.0)
    assert stats.wilson(0, 50)[0] == 0.0


def test_one_sided_test_detects_a_real_gain_and_not_noise() -> None:
    assert stats.p_better(100, 400, 150, 400) < 0.01  # 37.5% vs 25%
    assert stats.p_better(100, 400, 100, 400) == pytest.approx(0.5)
    assert stats.p_better(100, 400, 90, 400) > 0.5  # worse is never significant
    assert stats.p_better(1, 10, 5, 0) == 1.0


def test_p95_is_a_value_of_the_sample() -> None:
    values = [float(i) for i in range(1, 101)]
    assert report.p95(values) == 95.0
    assert report.p95([]) is None


def test_summary_compares_the_champion_with_the_base() -> None:
    facts = report.Facts(by_version={0: report.VersionStats(0, 400, 100), 3: report.VersionStats(3, 350, 140)},
                         versions_published=[1, 2, 3], promotions=[3], champion=3,
                         session_to_lake_s=[1.0, 2.0, 3.0])
    summary = report.summarize(facts)
    assert (summary["n_base"], summary["n_champion"], summary["champion_version"]) == (400, 350, 3)
    assert summary["base_success"] == 0.25 and summary["champion_success"] == 0.4
    assert summary["success_ratio"] == 1.6 and summary["significant"], summary
    assert summary["versions_published"] == 3 and summary["promotions"] == 1
    # too few sessions: never significant, whatever the p-value
    facts.by_version[3] = report.VersionStats(3, 100, 60)
    assert not report.summarize(facts)["significant"]


def _record(spec: tasks.TaskSpec, answers: list, ended: float = 100.0) -> dict:
    return {"session_id": "s1", "task": spec.to_json(), "answers": answers, "ended": ended}


def test_verifier_recomputes_the_truth_instead_of_trusting_the_agent() -> None:
    spec = tasks.make_task(random.Random(3), multi_share=1.0)
    right = [tasks.truth(p) for p in spec.parts]
    assert outcome_sim.verdict(_record(spec, right))
    assert not outcome_sim.verdict(_record(spec, right[:1] + ["nonsense"]))
    assert not outcome_sim.verdict(_record(spec, [None, None]))
    with pytest.raises(ValueError):
        outcome_sim.verdict(_record(spec, "95"))


def test_schedule_reports_the_verifier_soon_and_the_user_later_for_a_share() -> None:
    cfg = outcome_sim.OutcomeSimConfig(verifier_delay_s=2.0, user_share=0.5, user_delay_s_min=20, user_delay_s_max=40,
                                       user_noise=0.0)
    spec = tasks.make_task(random.Random(4), multi_share=0.0)
    rng = random.Random(0)
    plans = [outcome_sim.schedule(_record(spec, [tasks.truth(spec.parts[0])]), cfg, rng) for _ in range(400)]
    assert all(p[0].kind == "task_success" and p[0].value == 1.0 and p[0].at == 102.0 for p in plans)
    users = [p[1] for p in plans if len(p) > 1]
    assert 150 < len(users) < 250, len(users)
    assert all(u.kind == "accepted" and u.value == 1.0 and 120.0 <= u.at <= 140.0 for u in users)


def test_handoff_reader_returns_whole_lines_only_and_resumes_from_its_offset(tmp_path: Path) -> None:
    path = tmp_path / "sessions.jsonl"
    reader = outcome_sim.HandoffReader(path, 0)
    assert reader.read() == []  # no file yet: nothing, no error
    path.write_text(json.dumps({"a": 1}) + "\n" + '{"half": ')
    lines = reader.read()
    assert [line for _, line in lines] == ['{"a": 1}']
    reader.offset = lines[-1][0]
    assert reader.read() == []  # the half-written line waits
    with open(path, "a") as fh:
        fh.write('2}\n')
    assert [line for _, line in reader.read()] == ['{"half": 2}']
    outcome_sim.save_offset(tmp_path / "c.json", 17)
    assert outcome_sim.load_offset(tmp_path / "c.json") == 17
    assert outcome_sim.load_offset(tmp_path / "missing.json") == 0


@pytest.mark.parametrize("successes, n", [(0, 658), (658, 658), (0, 3), (1, 1)])
def test_wilson_interval_contains_its_estimate_at_the_edges(successes, n):
    # the demo report's error bars are rate - lo and hi - rate: they must never be negative
    from flywheel.serving.stats import wilson

    lo, hi = wilson(successes, n)
    rate = successes / n
    assert lo <= rate <= hi, f"{successes}/{n}: interval ({lo!r}, {hi!r}) does not contain {rate}"
