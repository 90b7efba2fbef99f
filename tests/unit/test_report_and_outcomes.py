"""Pure logic of the demo's report statistics and of the simulated outcome sources."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Callable

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


def test_the_verifier_checks_every_call_and_each_sub_agents_part() -> None:
    spec = tasks.make_task(random.Random(3), multi_share=1.0)
    a, b = spec.parts
    parts = [{"agent_id": "sub-a", "calls": [{"call_id": "c1", "tool": a.tool, "arguments": {"x": "nonsense"}},
                                             {"call_id": "c2", "tool": a.tool, "arguments": a.args}]},
             {"agent_id": "sub-b", "calls": [{"call_id": "c3", "tool": b.tool, "arguments": b.args}]}]
    record = _record(spec, [tasks.truth(a), "wrong"]) | {"parts": parts}
    checks = outcome_sim.part_checks(record, at=50.0)
    calls = {d.call_id: (d.kind, d.value, d.agent_id) for d in checks if d.call_id}
    assert calls == {"c1": ("call_correct", 0.0, "sub-a"), "c2": ("call_correct", 1.0, "sub-a"),
                     "c3": ("call_correct", 1.0, "sub-b")}, "a right call is right even when the answer after it is wrong"
    per_part = {d.agent_id: d.value for d in checks if d.call_id is None}
    assert per_part == {"sub-a": 1.0, "sub-b": 0.0} and all(d.kind == "task_success" for d in checks if d.call_id is None)
    assert len({d.outcome_id for d in checks}) == len(checks), "every check has its own stable id"
    assert [d.outcome_id for d in outcome_sim.part_checks(record, at=50.0)] == [d.outcome_id for d in checks]
    assert outcome_sim.part_checks(_record(spec, ["x", "y"]), at=50.0) == [], "an old hand-off line without parts"
    again = [{"agent_id": "sub-a", "calls": [{"call_id": "c1", "tool": a.tool, "arguments": a.args},
                                             {"call_id": "c2", "tool": a.tool, "arguments": a.args}]}, parts[1]]
    repeat = {d.call_id: d.value for d in outcome_sim.part_checks(record | {"parts": again}, at=50.0) if d.call_id}
    assert repeat["c1"] == 1.0 and repeat["c2"] == 0.0, "repeating a right call after its result is no progress"
    plan = outcome_sim.schedule(record, outcome_sim.OutcomeSimConfig(user_share=0.0), random.Random(0))
    assert plan[-1].kind == "task_success" and plan[-1].agent_id is None
    assert all(d.at < plan[-1].at for d in plan[:-1]), "the checks below the session land before its verdict"
    wrong_tool = {"agent_id": "sub-a", "calls": [{"call_id": "c9", "tool": "weather" if a.tool != "weather" else "add",
                                                  "arguments": a.args}]}
    assert outcome_sim.part_checks(record | {"parts": [wrong_tool, parts[1]]}, at=50.0)[0].value == 0.0


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


# --- the outcome simulator's crash safety: send, confirm, then commit ---------------------------------------------


def test_cursor_passes_only_the_leading_lines_whose_outcomes_are_all_confirmed() -> None:
    assert outcome_sim.committable(0, []) == 0
    assert outcome_sim.committable(10, [(20, 0), (30, 0)]) == 30
    # the line ending at 30 still owes a user signal: the lines after it wait, whatever they owe
    assert outcome_sim.committable(10, [(20, 0), (30, 1), (40, 0)]) == 20
    assert outcome_sim.committable(10, [(20, 2), (30, 0)]) == 10


class Killed(BaseException):
    """SIGKILL, raised at a chosen point inside a poll."""


class FakeReporter:
    """An OutcomeReporter stand-in: `report` queues in memory, a successful `flush` delivers (Kafka has it).

    `kill(point)` is called inside report and flush; a test makes it raise Killed to kill the simulator there.
    """

    def __init__(self) -> None:
        self.queued: list[str] = []
        self.delivered: list[str] = []
        self.down = False
        self.kill: Callable[[str], None] = lambda point: None

    def report(self, session_id: str, kind: str, value: float, agent_id: str | None = None, source: str | None = None,
               ts: str | None = None, outcome_id: str | None = None, call_id: str | None = None) -> str:
        assert outcome_id, "the simulator must pass its own outcome_id"
        self.kill("report")
        self.queued.append(outcome_id)
        return outcome_id

    def flush(self, timeout: float = 10.0) -> bool:
        self.kill("flush")
        if self.down:
            return False
        self.delivered += self.queued
        self.queued = []
        self.kill("flushed")  # delivered, killed before the simulator heard of it
        return True

    def metrics(self) -> dict:
        return {"dropped": 0}

    def crash(self, rng: random.Random) -> None:
        """SIGKILL: records in flight may or may not have reached Kafka; the rest of the queue is gone."""
        self.delivered += [i for i in self.queued if rng.random() < 0.5]
        self.queued = []


def _sim_cfg(tmp_path: Path) -> outcome_sim.OutcomeSimConfig:
    return outcome_sim.OutcomeSimConfig(handoff=tmp_path / "sessions.jsonl", cursor=tmp_path / "cursor.json",
                                        verifier_delay_s=1.0, user_share=0.5, user_delay_s_min=5.0,
                                        user_delay_s_max=15.0, seed=11)


def _append_session(cfg: outcome_sim.OutcomeSimConfig, sid: str, ended: float, rng: random.Random) -> None:
    spec = tasks.make_task(rng, multi_share=0.3)
    answers = [tasks.truth(p) if rng.random() < 0.5 else "nonsense" for p in spec.parts]
    with open(cfg.handoff, "a") as fh:
        fh.write(json.dumps({"session_id": sid, "task": spec.to_json(), "answers": answers, "ended": ended}) + "\n")


def test_a_restart_after_confirmed_sends_does_not_send_them_again(tmp_path: Path) -> None:
    cfg = _sim_cfg(tmp_path)
    cfg.user_share, cfg.user_delay_s_min, cfg.user_delay_s_max = 1.0, 30.0, 30.0
    rng = random.Random(1)
    _append_session(cfg, "a", 0.0, rng)
    _append_session(cfg, "b", 1.0, rng)
    reporter = FakeReporter()
    sim = outcome_sim.OutcomeSim(cfg, reporter)
    sim.step(now=5.0)  # both verdicts sent and confirmed; both user signals due at 30 and 31
    assert len(reporter.delivered) == 2 and sim.progress.offset == 0, (reporter.delivered, sim.progress.offset)
    reporter.down = True
    sim.step(now=30.5)  # a's user signal sent, Kafka does not confirm it: the cursor stays before line a
    assert sim.progress.offset == 0 and len(sim.unconfirmed) == 1, sim.status()
    reporter.crash(random.Random(0))  # lost in flight (the rng says which)
    reporter.down = False
    restarted = outcome_sim.OutcomeSim(cfg, reporter)
    assert restarted.seed == 11 and len(restarted.progress.sent_before) == 2, restarted.progress.sent_before
    restarted.step(now=40.0)
    owed = {outcome_sim.outcome_id(s, k, src) for s in "ab" for k, src in (("task_success", "verifier"), ("accepted", "user"))}
    assert set(reporter.delivered) == owed, sorted(reporter.delivered)
    assert len(reporter.delivered) <= 5, f"only the one unconfirmed outcome may be sent twice: {reporter.delivered}"
    assert restarted.progress.offset == cfg.handoff.stat().st_size and outcome_sim.load_cursor(cfg.cursor)[2] == []


def test_kills_at_any_point_of_a_poll_lose_no_outcome(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Killed inside report, flush or the cursor write (before or after it), Kafka down at times: nothing owed is lost."""
    cfg = _sim_cfg(tmp_path)
    rng = random.Random(5)
    reporter = FakeReporter()
    real_save = outcome_sim.save_offset
    odds = {"report": 0.03, "flush": 0.1, "flushed": 0.1, "save": 0.1, "saved": 0.1}

    def kill(point: str) -> None:
        if rng.random() < odds[point]:
            raise Killed(point)

    def save(*args: object, **kwargs: object) -> None:
        kill("save")
        real_save(*args, **kwargs)
        kill("saved")

    reporter.kill = kill
    monkeypatch.setattr(outcome_sim, "save_offset", save)
    sim = outcome_sim.OutcomeSim(cfg, reporter)
    kills, sessions, now = 0, 0, 0.0
    for tick in range(400):
        now = float(tick)
        if tick < 300 and rng.random() < 0.4:
            _append_session(cfg, f"s{sessions}", now, rng)
            sessions += 1
        if tick % 3 == 0:
            with open(cfg.handoff, "a") as fh:
                fh.write("not json\n" if tick % 2 else "\n")  # bad and empty lines owe nothing
        reporter.down = 100 <= tick < 130  # an outage: flush fails, the cursor must hold
        try:
            sim.step(now)
        except Killed:
            reporter.crash(rng)
            sim = outcome_sim.OutcomeSim(cfg, reporter)
            kills += 1
    reporter.kill = lambda point: None
    monkeypatch.setattr(outcome_sim, "save_offset", real_save)
    sim = outcome_sim.OutcomeSim(cfg, reporter)  # the last restart catches up, with no kill
    sim.step(now + 60)
    expected = set()
    for line in cfg.handoff.read_text().splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            expected |= {d.outcome_id for d in outcome_sim.schedule(record, cfg, outcome_sim.session_rng(11, record["session_id"]))}
    missing = expected - set(reporter.delivered)
    assert kills >= 40 and sessions >= 100, (kills, sessions)
    assert not missing, f"{len(missing)} of {len(expected)} outcomes never reached Kafka after {kills} kills"
    assert set(reporter.delivered) <= expected, "an outcome nobody scheduled was sent"
    resent = len(reporter.delivered) - len(set(reporter.delivered))
    assert resent <= kills * 3, f"{resent} re-sends for {kills} kills: confirmed outcomes are being sent again"
    assert sim.progress.offset == cfg.handoff.stat().st_size, (sim.progress.offset, cfg.handoff.stat().st_size)
