"""The demo report's honest numbers, on a small synthetic lake: the final window (the final champion against the
concurrent control, on sessions the gate never saw), exclusions, the lift with its interval, the gate's simulated
false-promotion rate at the run's traffic, and the champion named after a rollback."""

from __future__ import annotations

import datetime as dt
import json
import math
from pathlib import Path
from typing import Any

import pytest

from bench.fixtures.sessions import LakeFeeder, SessionBuilder, outcome
from flywheel.demo import report
from flywheel.serving import gate_sim, stats
from flywheel.serving.decision import GateRule
from flywheel.serving.registry import Registry

T0 = 1_700_000_000.0  # epoch seconds of the synthetic run's start
FINAL_SINCE = T0 + 300.0
PROMOTED = T0 + 500.0


class SyntheticLake:
    """Sessions with one llm_call each (or one per version given), published as the lake writer would."""

    def __init__(self, root: Path) -> None:
        self.root = str(root)
        self.events: list[dict[str, Any]] = []
        self.outcomes: list[dict[str, Any]] = []
        self.n = 0

    def add(self, start_s: float, versions: int | tuple[int, ...], arm: str, successes: list[float | None],
            status: str = "ok", task_type: str = "tool_use.add", every_s: float = 1.0,
            calls: tuple[str, ...] = ()) -> None:
        """One session per entry of `successes` (None: no task_success arrives), starting `every_s` apart.

        A session's `started` is start_s after T0 (the builder dates session_start one second after its start)."""
        for i, success in enumerate(successes):
            self.n += 1
            sid = f"s{self.n:04d}-{arm}"
            start = dt.datetime.fromtimestamp(T0 + start_s + i * every_s - 1.0, dt.timezone.utc)
            b = SessionBuilder(sid, start, task_type=task_type).begin()
            for version in (versions if isinstance(versions, tuple) else (versions,)):
                b.llm_call(version=version, arm=arm)
            for name in calls:  # the session's tool calls by name; "!" a malformed one
                b.tool(name=name, malformed=name == "!")
            end = b.end(status)
            self.events += b.events
            if success is not None:
                self.outcomes.append(outcome(sid, "task_success", success, end + dt.timedelta(seconds=1)))

    def publish(self) -> str:
        feeder = LakeFeeder(self.root)
        feeder.write("events", self.events)
        if self.outcomes:
            feeder.write("outcomes", self.outcomes)
        return self.root


def ones(k: int, n: int) -> list[float | None]:
    """n sessions, the first k of them successes."""
    return [1.0] * k + [0.0] * (n - k)


def final_window_lake(root: Path) -> SyntheticLake:
    """Champion policy-v2 (promoted at PROMOTED, inside the final window) against control policy-v0."""
    lake = SyntheticLake(root)
    lake.add(10, 0, "control", ones(5, 20), every_s=10)  # before the final window: whole run only
    lake.add(100, 2, "challenger", ones(20, 20), every_s=5)  # the sessions the gate chose v2 on: never in the headline
    lake.add(400, 2, "champion", ones(10, 10), every_s=9)  # final window, before the promotion: excluded
    lake.add(PROMOTED - T0 - 1, 2, "champion", [0.0])  # started one second before the promotion: excluded
    lake.add(PROMOTED - T0, 2, "champion", ones(30, 40))  # the first starts exactly at the promotion: counted
    lake.add(600, 2, "champion", [0.0, 0.0, 0.0], status="error")  # infrastructure errors, labelled 0 by the verifier
    lake.add(650, 2, "champion", [None, None])  # no task_success: unlabelled, not failures
    lake.add(660, (1, 2), "champion", [0.0])  # straddled a weight push: counts for no version
    lake.add(670, 1, "champion", [0.0])  # another version in the champion arm: not the final champion
    lake.add(PROMOTED - T0, 0, "control", ones(16, 40))
    lake.add(700, 0, "control", [0.0, 0.0], status="error")
    return lake


def facts_of(lake: SyntheticLake, champion: int | None, promoted_at: float | None) -> report.Facts:
    facts = report.lake_facts(lake.publish(), since=T0)
    facts.champion, facts.champion_promoted_at = champion, promoted_at
    return facts


def test_the_final_window_counts_the_champion_and_the_control_after_the_promotion_only(tmp_path: Path) -> None:
    facts = facts_of(final_window_lake(tmp_path / "lake"), champion=2, promoted_at=PROMOTED)
    m = report.measurement(facts, FINAL_SINCE, control_version=0)
    assert m["final_window_start"] == PROMOTED, m
    got = (m["n_champion_final"], m["champion_final_success"], m["n_control_final"], m["control_final_success"])
    assert got == (40, 0.75, 40, 0.4), f"(n, success) champion / control in the final window: {got}"
    excluded = (m["n_champion_final_errored"], m["n_champion_final_unlabelled"], m["n_control_final_errored"])
    assert excluded == (3, 2, 2), f"errored / unlabelled champion, errored control: {excluded}"
    # the control over the whole run, arm control, served by v0: 20 before the window and 40 in it
    assert (m["n_control"], m["control_success"], m["n_control_errored"]) == (60, round(21 / 60, 4), 2), m
    assert m["lift_points"] == 35.0 and m["lift_ci_method"] == "newcombe-wilson", m
    lo, hi = m["lift_ci95"]
    assert 0 < lo < 35.0 < hi < 100, f"the interval must hold the lift and exclude 0 at n = 40 each: {m['lift_ci95']}"
    assert m["p_value_final"] == pytest.approx(stats.p_better(16, 40, 30, 40)) and m["p_value_final"] < 0.01, m


def test_the_final_window_starts_at_final_since_when_the_promotion_came_before(tmp_path: Path) -> None:
    facts = facts_of(final_window_lake(tmp_path / "lake"), champion=2, promoted_at=T0 + 50.0)
    m = report.measurement(facts, FINAL_SINCE)
    # now the 10 champion sessions from 400 s and the one just before PROMOTED count too
    assert (m["final_window_start"], m["n_champion_final"]) == (FINAL_SINCE, 51), m
    assert m["champion_final_success"] == round(40 / 51, 4), m


def test_errored_and_unlabelled_sessions_are_excluded_per_version_and_counted_per_arm(tmp_path: Path) -> None:
    facts = facts_of(final_window_lake(tmp_path / "lake"), champion=2, promoted_at=PROMOTED)
    s = report.summarize(facts)
    v2 = s["per_version"]["2"]
    assert (v2["sessions"], v2["errored"], v2["unlabelled"]) == (71, 3, 2), v2
    assert s["champion_success"] == round(60 / 71, 4) and s["n_champion"] == 71, s
    assert s["mixed_version_sessions"] == 1, s
    arms = s["per_arm"]
    assert (arms["champion"]["n_errored"], arms["champion"]["n_unlabelled"], arms["control"]["n_errored"],
            arms["challenger"]["n_errored"]) == (3, 2, 2, 0), arms


def test_without_a_final_window_the_final_fields_are_null_and_the_report_says_so(tmp_path: Path) -> None:
    facts = facts_of(final_window_lake(tmp_path / "lake"), champion=2, promoted_at=PROMOTED)
    summary = report.summarize(facts) | report.measurement(facts, None) | {"gate_alpha": None, "gate_interval_s": 10.0}
    assert all(summary[k] is None for k in report.FINAL_FIELDS), {k: summary[k] for k in report.FINAL_FIELDS}
    assert summary["n_control"] == 60, summary  # the whole-run control does not need a final window
    text = report.markdown(summary, [], {})
    assert "no final window in this run" in text, text


def test_lift_interval_matches_newcombes_published_example() -> None:
    # Newcombe (1998), Stat Med 17:873, table II example (a): 56/70 vs 48/80, method 10 gives 0.0524 to 0.3339
    lo, hi = report.lift_ci(56, 70, 48, 80)
    assert (round(lo, 4), round(hi, 4)) == (0.0524, 0.3339), (lo, hi)
    assert report.lift_ci(3, 0, 1, 10) is None


def test_promotion_time_prefers_promoted_ts_then_the_gate_decision_time() -> None:
    assert report.promotion_time({"promoted_ts": "1700000500.250", "gate_ts": "2020-01-01T00:00:00+00:00"}) == 1700000500.25
    iso = dt.datetime.fromtimestamp(PROMOTED, dt.timezone.utc).isoformat()
    assert report.promotion_time({"gate_ts": iso}) == PROMOTED
    assert report.promotion_time({}) is None


def test_the_gate_simulation_is_fed_this_runs_traffic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lake = SyntheticLake(tmp_path / "lake")
    lake.add(0, 0, "control", ones(5, 20), task_type="add", every_s=3)
    lake.add(1, 0, "control", ones(8, 10), task_type="weather", every_s=3)
    lake.add(0, 0, "control", [0.0, 0.0], task_type="add", status="error")  # not in the rates
    lake.add(10, 1, "challenger", ones(5, 11), every_s=10)  # 11 sessions over 100 s
    lake.add(200, 2, "challenger", ones(3, 6), every_s=10)  # 6 over 50 s
    lake.add(300, 2, "challenger", [None])  # unlabelled: never mature evidence for the gate
    facts = facts_of(lake, champion=0, promoted_at=None)
    calls: list[tuple[GateRule, gate_sim.Scenario, int, int]] = []

    def stand_in(rule: GateRule, scenario: gate_sim.Scenario, challengers: int = 2000, seed: int = 0) -> float:
        scenario.check()
        calls.append((rule, scenario, challengers, seed))
        return 0.031

    monkeypatch.setattr(gate_sim, "false_promotion_rate", stand_in)
    rule = GateRule(alpha=0.05)
    out = report.gate_simulation(facts, rule, 0, 30.0, {"control": 0.2, "challenger": 0.3})
    assert out["gate_false_promotion_rate"] == 0.031 and len(calls) == 1, out
    _, scenario, challengers, seed = calls[0]
    assert (challengers, seed) == (2000, 0)
    assert scenario.rates == {"add": 0.25, "weather": 0.8} and scenario.mix == {"add": 0.6667, "weather": 0.3333}, scenario
    # 17 challenger sessions over 150 s of live challengers, times a 30 s interval: 3.4 per look
    assert (scenario.challenger_per_look, scenario.lift) == (3, 0.0), scenario
    assert scenario.champion_ratio == pytest.approx(0.5 / 0.3, abs=1e-4), scenario
    assert out["gate_sim_scenario"]["challenger_per_look"] == 3 and out["gate_sim_basis"]["n_challenger"] == 17, out
    assert report.gate_simulation(facts, None, 0, 30.0, None)["gate_false_promotion_rate"] is None
    assert len(calls) == 1, "no rule: nothing to simulate"


def test_the_champion_after_a_rollback_to_v0_is_v0_not_the_last_promotion() -> None:
    facts = report.Facts(by_version={0: report.VersionStats(0, 400, 100), 2: report.VersionStats(2, 300, 120)},
                         versions_published=[1, 2], promotions=[1, 2], champion=0)
    summary = report.summarize(facts)
    assert summary["champion_version"] == 0, f"rolled back to v0, the report names policy-v{summary['champion_version']}"
    assert (summary["champion_success"], summary["n_champion"]) == (0.25, 400), summary


@pytest.fixture
def registry(tmp_path: Path) -> Registry:
    """A real MLflow registry in a sqlite file (no server)."""
    return Registry(f"sqlite:///{tmp_path}/mlflow.db", "report-test")


def test_report_names_v0_after_the_gate_rolled_back_its_only_promotion(
        tmp_path: Path, registry: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    registry.register(1, "file:///nowhere/policy-v1", {"kind": "full"})
    registry.make_champion(1)
    registry.tag_version(1, {"gate_decision": "promote", "promoted_ts": f"{T0 + 100:.3f}"})
    assert registry.rollback() == (1, 0) and registry.aliases() == {}, registry.aliases()
    lake = SyntheticLake(tmp_path / "lake")
    lake.add(PROMOTED - T0, 0, "champion", ones(12, 30))
    lake.add(PROMOTED - T0, 1, "champion", ones(30, 30), every_s=0.1)  # v1 before its rollback: not the champion
    lake.add(PROMOTED - T0, 0, "control", ones(10, 30))
    monkeypatch.setattr(gate_sim, "false_promotion_rate", lambda rule, scenario, challengers=2000, seed=0: 0.02)
    summary = report.write_report(tmp_path / "out", lake.publish(), T0, None, str(tmp_path / "policies"), registry.uri,
                                  registry.name, final_since=FINAL_SINCE, gate_rule=GateRule(),
                                  shares={"control": 0.2, "challenger": 0.4})
    assert summary["promoted_versions"] == [1], summary
    assert summary["champion_version"] == 0, f"the report names policy-v{summary['champion_version']} after a rollback to v0"
    assert (summary["n_champion_final"], summary["champion_final_success"]) == (30, 0.4), summary
    assert summary["final_window_start"] == FINAL_SINCE, summary  # v0 has no promotion time: the window's start


def test_a_promotion_whose_gate_was_killed_before_recording_it_still_counts(
        tmp_path: Path, registry: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    """serving/promote.py moves the alias (and tags promoted_ts), then records the decision: run 8's demo killed the
    gate between the two, and its report said 0 promotions with v1 the champion."""
    registry.register(1, "file:///nowhere/policy-v1", {"kind": "full"})
    registry.make_champion(1)
    registry.tag_version(1, {"promoted_ts": f"{PROMOTED:.3f}", "champion_since_ts": f"{PROMOTED:.3f}"})
    monkeypatch.setattr(gate_sim, "false_promotion_rate", lambda rule, scenario, challengers=2000, seed=0: 0.02)
    summary = report.write_report(tmp_path / "out", final_window_lake(tmp_path / "lake").publish(), T0, None,
                                  str(tmp_path / "p"), registry.uri, registry.name, final_since=FINAL_SINCE,
                                  gate_rule=GateRule(), shares={"control": 0.2, "challenger": 0.4})
    assert (summary["promoted_versions"], summary["champion_version"]) == ([1], 1), summary


def test_write_report_adds_the_honest_fields_and_puts_the_design_first(
        tmp_path: Path, registry: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    for version in (1, 2):
        registry.register(version, f"file:///nowhere/policy-v{version}", {"kind": "full"})
    registry.make_champion(2)
    registry.tag_version(2, {"gate_decision": "promote", "promoted_ts": f"{PROMOTED:.3f}"})
    registry.tag_version(1, {"gate_decision": "reject"})
    monkeypatch.setattr(gate_sim, "false_promotion_rate", lambda rule, scenario, challengers=2000, seed=0: 0.04)
    out = tmp_path / "out"
    summary = report.write_report(out, final_window_lake(tmp_path / "lake").publish(), T0, None, str(tmp_path / "p"),
                                  registry.uri, registry.name, context={"minutes": 12}, final_since=FINAL_SINCE,
                                  gate_rule=GateRule(alpha=0.05), gate_interval_s=10.0,
                                  shares={"control": 0.2, "challenger": 0.4})
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk == json.loads(json.dumps(summary))
    assert (on_disk["champion_version"], on_disk["champion_promoted_ts"]) == (2, PROMOTED), on_disk
    assert (on_disk["n_champion_final"], on_disk["n_control_final"], on_disk["lift_points"]) == (40, 40, 35.0), on_disk
    assert on_disk["gate_false_promotion_rate"] == 0.04 and on_disk["gate_sim_scenario"]["champion_ratio"] == 1.0, on_disk
    for key in ("base_success", "n_base", "champion_success", "n_champion", "p_value", "per_version", "minutes",
                "p95_session_to_lake_s", "control_version", "control_success", "n_control", "p_value_final"):
        assert key in on_disk, f"summary.json lost or lacks {key}"
    text = (out / "report.md").read_text()
    assert text.startswith("# agent-flywheel demo report")
    design, headline, whole = (text.index(h) for h in ("## Measurement design", "## Headline", "## Whole run"))
    assert design < headline < whole, "the measurement design comes first, then the headline"
    assert "n = 40 sessions" in text[headline:whole] and "+35.0 points" in text[headline:whole], text[headline:whole]
    assert "false-promotion rate **0.040**" in text[design:headline], text[design:headline]
    assert not math.isnan(on_disk["p_value_final"])
    assert all((out / name).stat().st_size > 0 for name in ("arms.png", "success_by_version.png", "freshness.png"))


def test_per_tool_rows_give_the_share_of_first_calls_in_productions_name_and_success(tmp_path: Path) -> None:
    lake = SyntheticLake(tmp_path / "lake")
    # the control names weather by an older generation's name 3 times in 4; the champion takes production's
    lake.add(PROMOTED - T0, 0, "control", ones(1, 4), task_type="tool_use.weather", every_s=2,
             calls=("sky",))
    lake.add(PROMOTED - T0 + 1, 0, "control", ones(2, 4), task_type="tool_use.weather", every_s=2,
             calls=("weather",))  # right name first: 4 of 8 control sessions
    lake.add(PROMOTED - T0, 2, "champion", ones(5, 6), task_type="tool_use.weather", every_s=2,
             calls=("weather", "weather"))
    lake.add(PROMOTED - T0, 2, "champion", [0.0], task_type="tool_use.add", calls=("!", "add"))  # malformed first
    lake.add(PROMOTED - T0, 2, "champion", [1.0], task_type="tool_use.multi", calls=("add", "weather"))  # not a tool row
    facts = facts_of(lake, champion=2, promoted_at=PROMOTED)
    tools = report.per_tool(facts, PROMOTED, control_version=0)
    control, champion = tools["final"]["control"], tools["final"]["champion"]
    assert (control["weather"]["sessions"], control["weather"]["production_name"], control["weather"]["older_name"],
            control["weather"]["success"]) == (8, 0.5, 0.5, 0.375), control["weather"]
    assert (champion["weather"]["production_name"], champion["weather"]["success"]) == (1.0, round(5 / 6, 4))
    assert (champion["add"]["first_calls"], champion["add"]["production_name"]) == (1, 0.0), "a malformed first call"
    assert champion["mul"]["production_name"] is None and champion["mul"]["sessions"] == 0
    assert set(tools["by_version"]) == {"0", "2"} and tools["by_version"]["0"]["weather"]["sessions"] == 8
    md = "\n".join(report.tool_section({"per_tool": tools}))
    assert "| weather | 8 | 50.0% | 37.5% | 6 | 100.0% | 83.3% |" in md, md


def test_a_smoke_run_says_first_that_it_makes_no_learning_claim(tmp_path: Path) -> None:
    facts = facts_of(final_window_lake(tmp_path / "lake"), champion=2, promoted_at=PROMOTED)
    summary = report.summarize(facts) | report.measurement(facts, None) | {"gate_alpha": None, "gate_interval_s": 10.0}
    smoke = report.markdown(summary, [], {"learning_claim": False, "base_model": "var/models/smollm2-135m-instruct"})
    first = smoke.split("## ")[0]
    assert "this report makes no learning claim" in first and "smollm2-135m-instruct" in first, first
    assert "no learning claim" not in report.markdown(summary, [], {"learning_claim": True})
    assert "no learning claim" not in report.markdown(summary, [], {})
    early = report.markdown(summary, [], {"learning_claim": False, "minutes": 3.0,
                                          "final_early": {"version": 1, "sessions": 14}})
    assert "(3.0 min of traffic at most: the final window started early, once policy-v1 had 14 sessions" in early
    assert "started early" not in smoke, "a run whose final window came on the clock says nothing about it"
