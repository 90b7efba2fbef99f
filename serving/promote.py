"""Promotion gate and rollback: `flywheel promote [--auto]`, `flywheel rollback`, the serving part of `flywheel status`.

The gate compares the challenger with the champion on their production sessions served at the
same time (the router's arms, logged on every llm_call), mature and stratified by task type, with
a sequential test (the rule and why it is valid: serving/decision.py), and on guardrails, each a
non-inferiority test at its margin (serving/guardrails.py): errors, malformed tool calls, tail
latency, tokens, the judge's score, and the offline task set run through vLLM when `guardrails`
names it (otherwise the offline scores are a report in the decision, not a veto). One rule:
promote iff the split is the router's AND the challenger is better AND every guardrail is within
its margin, each test at alpha (docs/serving.md).
Outcomes:
  promote  better, and every guardrail shown within its margin: it becomes champion;
  reject   significantly worse, or a guardrail breached beyond its margin: the challenger alias is cleared;
  expire   the last look (or max_sessions) without a decision: cleared too, tagged expire;
  hold     not decided yet: nothing changes, the next round looks again (which the test allows);
  halt     the arms' split is not the router's (sample ratio mismatch): the test is void, the challenger is
           cleared as on expire (not evidence that it is worse), and the gate alerts.
With `stream` lord or daily each challenger's alpha comes from the stream of challengers
(`stream_alpha`), so error is controlled over hundreds of challengers a day, not per challenger.
Each round (with auto_rollback, the default) it also rolls back a champion that is significantly
worse than the concurrent control arm (same test, on sessions since it became champion). With
--auto it loops, and each round first makes sure the champion and the control are served. Every decision, its
statistic, threshold and sample sizes go to MLflow (a run in experiment "flywheel-promotion" and
tags on the challenger's model version) and to stdout.

Serving: champion, challenger and control are served at the same time. LoRA versions are
adapters on every server; a full-weight version takes a server of its own (the publisher never
replaces a live version's weights), so a promotion or rejection only moves aliases. A rollback to
a version no server holds any more loads it onto a free server first, and moves the alias after.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import logging
import math
import re
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flywheel.base import defaults
from flywheel.base.config import setting
from flywheel.base.metrics import Metrics
from flywheel.base.stop import stop_on_signals
from flywheel.serving import evaluate, guardrails, publisher, vllm_client
from flywheel.serving.decision import GateRule, Verdict, concurrent
from flywheel.serving.decision import decide as decide_online
from flywheel.serving.decision import decide_rollback as decide_online_rollback
from flywheel.serving.registry import CHALLENGER, CHAMPION, RegisteredVersion, Registry
from flywheel.serving.sessions import SessionRecord, read_sessions
from flywheel.serving.stats import daily_alpha, lord_alpha, mean_ci
from flywheel.serving.tier import TierConfig

log = logging.getLogger(__name__)


@dataclass
class PromoteConfig(TierConfig, GateRule):
    """Champion/challenger gate over concurrent production sessions (lake) and an offline eval set (vLLM)."""

    lake_root: str = setting(defaults.LAKE_ROOT, "trajectory lake root (sessions are read from <root>/events "
                                                 "and /outcomes)")
    eval_tasks: str = setting("flywheel.serving.evaluate:arithmetic_tasks", "offline eval set: module:function "
                                                                            "returning EvalTasks")
    require_offline_eval: bool = setting(True, "with the offline guardrail on: hold the promotion when a side has no "
                                               "offline score")
    experiment: str = setting("flywheel-promotion", "MLflow experiment receiving one run per decision")
    auto: bool = setting(False, "loop: gate every interval_s and roll back a regressed champion")
    auto_rollback: bool = setting(True, "with --auto, roll back a champion significantly worse than the control arm")
    interval_s: float = setting(30.0, "seconds between rounds with --auto")
    rounds: int = setting(0, "with --auto, stop after this many rounds (0: until SIGTERM)")
    var_dir: str = setting(defaults.VAR_DIR, "local state folder; the heartbeat goes to "
                                             "<var_dir>/run/status/promote.json")
    metrics_port: int = setting(0, "Prometheus endpoint http://0.0.0.0:<port>/metrics (0: off; e.g. 9104)")

    def check(self) -> None:
        TierConfig.check(self)
        self.check_rule()


@dataclass
class Decision:
    action: str  # promote | reject | expire | hold | rollback | keep | none
    reason: str
    champion: int
    challenger: int | None
    numbers: dict[str, float] = field(default_factory=dict)
    ts: str = field(default_factory=lambda: _dt.datetime.now(_dt.timezone.utc).isoformat())


# ---------------------------------------------------------------------------------------------
# Offline scores (cached on the model version; version 0 on the registered model)
# ---------------------------------------------------------------------------------------------
def _tag_key(task_set: str) -> str:
    return "offline_eval." + re.sub(r"[^\w.\-/ ]", "_", task_set)


def _cached_score(registry: Registry, version: int, task_set: str) -> evaluate.EvalScore | None:
    key = _tag_key(task_set)
    if version == 0:
        from mlflow.exceptions import MlflowException

        try:
            tags = registry.client.get_registered_model(registry.name).tags or {}
        except MlflowException:
            return None
        text = tags.get(key + ".v0")
    else:
        found = registry.find(version)
        text = found.tags.get(key) if found else None
    return evaluate.EvalScore.from_tag(task_set, text) if text else None


def _store_score(registry: Registry, version: int, score: evaluate.EvalScore) -> None:
    key = _tag_key(score.task_set)
    if version == 0:
        registry.ensure_model()
        registry.client.set_registered_model_tag(registry.name, key + ".v0", score.to_tag())
    else:
        registry.tag_version(version, {key: score.to_tag()})


def where_served(version: int, kind: str, tier: TierConfig) -> tuple[str, str] | None:
    """(server, model name) that serves this version right now, or None."""
    for server in tier.servers:
        server = server.rstrip("/")
        try:
            if kind == "lora" and version != 0:
                if publisher.lora_name(version) in vllm_client.served_models(server, tier.http_timeout_s):
                    return server, publisher.lora_name(version)
            elif vllm_client.weight_version(server, tier.http_timeout_s) == version:
                return server, tier.base_served_name
        except vllm_client.ServerError:
            continue
    return None


def offline_score(registry: Registry, version: int, kind: str, cfg: PromoteConfig,
                  tasks: list[evaluate.EvalTask]) -> evaluate.EvalScore:
    """The version's score on the task set: cached, or run now where it is served (then cached)."""
    cached = _cached_score(registry, version, cfg.eval_tasks)
    if cached is not None:
        return cached
    place = where_served(version, kind, cfg)
    if place is None:
        raise evaluate.EvalUnavailable(f"policy-v{version} ({kind}) is not served by any server and has no "
                                       "cached score")
    score = evaluate.run_eval(tasks, place[0], place[1], cfg.eval_tasks, timeout=cfg.http_timeout_s)
    _store_score(registry, version, score)
    return score


# ---------------------------------------------------------------------------------------------
# Decisions
# ---------------------------------------------------------------------------------------------
def _offline(offline: tuple[evaluate.EvalScore, evaluate.EvalScore] | str | None, cfg: PromoteConfig, alpha: float,
             numbers: dict[str, float]) -> tuple[str, str] | None:
    """The offline task set: a guardrail when `guardrails` names it (a fixed-sample non-inferiority test at its
    margin; no score: hold when require_offline_eval), otherwise a report in the decision's numbers only.
    (action, reason) when it stops a promotion, else None."""
    guarded = "offline" in cfg.guardrails
    if isinstance(offline, tuple):
        champ_s, chal_s = offline
        numbers.update({"offline_champion": champ_s.rate, "offline_challenger": chal_s.rate,
                        "offline_n_champion": champ_s.n, "offline_n_challenger": chal_s.n})
        if not guarded:
            return None
        check = guardrails.check_offline(cfg.guardrails["offline"], champ_s.successes, champ_s.n, chal_s.successes,
                                         chal_s.n, alpha)
        numbers.update(check.numbers())
        if check.breach:
            return "reject", f"offline guardrail breached: {check.describe()}"
        if not check.ok:
            # greedy scores do not change between rounds: waiting would not show it
            return "expire", f"better online, but the offline guardrail is not shown: {check.describe()}"
        return None
    if guarded and cfg.require_offline_eval:
        return "hold", f"better online, but no offline eval for the offline guardrail: {offline}"
    return None


def expected_challenger_share(cfg: TierConfig) -> float | None:
    """The challenger's share of the champion's and the challenger's sessions under the router's split."""
    champion = 1.0 - cfg.control_share - cfg.challenger_share
    total = champion + cfg.challenger_share
    return cfg.challenger_share / total if total > 0 and 0 < cfg.challenger_share < total else None


def gate_round(champion: int, challenger: int | None, records: list[SessionRecord],
               offline: tuple[evaluate.EvalScore, evaluate.EvalScore] | str | None, cfg: PromoteConfig,
               now: float | None = None, champion_since: float | None = None, alpha: float | None = None) -> Decision:
    """The gate as a pure function of the sessions: `offline` is (champion score, challenger score), or why there is
    none; `champion_since`: when the champion became champion (only sessions from then on are concurrent with it);
    `alpha`: this challenger's level in the stream of challengers (None: the rule's alpha)."""
    if challenger is None or challenger == champion:
        return Decision("none", "no challenger", champion, None)
    rule = cfg if alpha is None else dataclasses.replace(cfg, alpha=alpha)
    ev = concurrent(records, (champion, "champion"), (challenger, "challenger"), time.time() if now is None else now,
                    rule, since=champion_since, expected_b=expected_challenger_share(cfg))
    verdict: Verdict = decide_online(ev, rule)
    numbers = {("online_" + k): v for k, v in verdict.numbers.items()}
    stop = _offline(offline, cfg, rule.alpha, numbers)
    if verdict.action == "promote" and stop is not None:
        return Decision(stop[0], stop[1], champion, challenger, numbers)
    return Decision(verdict.action, verdict.reason, champion, challenger, numbers)


def rollback_round(champion: int, records: list[SessionRecord], cfg: PromoteConfig, champion_since: float | None,
                   now: float | None = None) -> Decision:
    """Roll back a champion significantly worse than the concurrent control arm (sessions since its promotion)."""
    if cfg.control_share <= 0:
        return Decision("keep", "no control arm: nothing concurrent to judge the champion against", champion, None)
    if champion == cfg.control_version:
        return Decision("keep", "the champion is the control version", champion, None)
    ev = concurrent(records, (cfg.control_version, "control"), (champion, "champion"),
                    time.time() if now is None else now, cfg, since=champion_since)
    verdict = decide_online_rollback(ev, cfg)
    numbers = {("online_" + k): v for k, v in verdict.numbers.items()}
    return Decision(verdict.action, verdict.reason, champion, None, numbers)


# ---------------------------------------------------------------------------------------------
# Applying and recording decisions
# ---------------------------------------------------------------------------------------------
def _source(version: int, registry: Registry, tier: TierConfig) -> tuple[str, str] | None:
    """(kind, weights directory) of a version; None when it is not registered."""
    if version == 0:
        return "full", str(Path(tier.base_model).resolve())
    found = registry.find(version)
    if found is None:
        log.warning("promote: policy-v%d is not registered; cannot make the tier serve it", version)
        return None
    return found.kind, publisher.local_source(found.source)


def ensure_serving(version: int, registry: Registry, tier: TierConfig, live: set[int]) -> bool:
    """Make the tier serve a version (before a rollback moves the alias, and every round): a LoRA adapter on every
    server that lost it, full weights onto one free server when no server holds them. `live`: the versions that
    keep their servers. True when the version is served afterwards."""
    place = _source(version, registry, tier)
    if place is None:
        return False
    kind, source = place
    try:
        if kind == "lora":
            for server in tier.servers:
                server = server.rstrip("/")
                if publisher.lora_name(version) not in vllm_client.served_models(server, tier.http_timeout_s):
                    vllm_client.load_lora_adapter(server, publisher.lora_name(version), source, tier.http_timeout_s)
                    log.info("promote: %s serves policy-v%d (lora) again", server, version)
            return True
        held = publisher.held_versions(tier)
        if version in held.values():
            return True
        free = publisher.full_targets(held, live - {version}, version)
        if not free:
            log.error("promote: no free server for policy-v%d (servers hold %s, live %s)", version, held, sorted(live))
            return False
        server = free[0]
        before = held[server]
        restore = _source(before, registry, tier) if before is not None else None
        publisher.push_full_http(server, publisher.PolicyVersion(Path(source), version, "full", {}), tier,
                                 restore_dir=Path(restore[1]) if restore else None)
        log.info("promote: %s serves policy-v%d (full) again, in place of policy-v%s", server, version, before)
        return True
    except vllm_client.ServerError as exc:
        log.error("promote: could not make the tier serve policy-v%d: %s", version, exc)
        return False


def repair_serving(registry: Registry, tier: TierConfig) -> None:
    """Every round: the champion and the control are served. A gate killed between moving an alias and loading
    weights, or a publish that raced a promotion onto the new champion's server, leaves one on no server; the
    next round puts it back on a free server."""
    aliases = registry.aliases()
    champion, challenger = aliases.get(CHAMPION, 0), aliases.get(CHALLENGER)
    live = tier.live_versions(champion, challenger)
    for version in sorted(live - ({challenger} if challenger is not None else set())):
        ensure_serving(version, registry, tier, live)


def record(decision: Decision, cfg: PromoteConfig, registry: Registry) -> str | None:
    """One MLflow run per decision (params, metrics, reason) plus tags on the challenger's model version."""
    from flywheel.base import tracking

    if decision.action == "none":
        return None
    client = registry.client
    run = client.create_run(tracking.experiment_id(cfg.experiment, cfg.mlflow_tracking_uri),
                            run_name=f"{decision.action}-v{decision.challenger}-over-v{decision.champion}",
                            tags={"decision": decision.action, "reason": decision.reason[:4000],
                                  "registered_model": registry.name, "test": f"{cfg.test}-stratified"})
    run_id = run.info.run_id
    client.log_param(run_id, "champion", decision.champion)
    client.log_param(run_id, "challenger", decision.challenger)
    client.log_param(run_id, "alpha", decision.numbers.get("online_alpha", cfg.alpha))  # the stream's level, if any
    for key in ("test", "looks", "spending", "tau", "margin", "min_sessions", "max_sessions", "maturity_s",
                "outcome_kind", "eval_tasks", "control_share", "control_version", "challenger_share", "srm_alpha",
                "stream"):
        client.log_param(run_id, key, getattr(cfg, key))
    client.log_param(run_id, "guardrails", json.dumps(cfg.guardrails, sort_keys=True))
    for key, value in decision.numbers.items():
        if value is not None and math.isfinite(float(value)):
            client.log_metric(run_id, key, float(value))
    client.set_terminated(run_id)
    if decision.challenger is not None and decision.action in ("promote", "reject", "expire", "hold", "halt"):
        registry.tag_version(decision.challenger, {"gate_decision": decision.action,
                                                   "gate_reason": decision.reason[:4000],
                                                   "gate_ts": decision.ts, "gate_run_id": run_id})
    elif decision.action == "rollback":
        registry.tag_version(decision.champion, {"gate_rollback_run_id": run_id, "gate_rollback_ts": decision.ts})
    return run_id


def apply(decision: Decision, registry: Registry, tier: TierConfig) -> None:
    """Move the aliases; only a rollback can need weights loaded (its target may be on no server any more)."""
    if decision.action == "promote" and decision.challenger is not None:
        registry.make_champion(decision.challenger)
        now = f"{time.time():.3f}"
        registry.tag_version(decision.challenger, {"promoted_ts": now, "champion_since_ts": now})
    elif decision.action in ("reject", "expire", "halt"):  # halt: a void test ends like an expired one
        registry.clear_alias(CHALLENGER)
    elif decision.action == "rollback":
        rollback_to_served(registry, tier)


def rollback_to_served(registry: Registry, tier: TierConfig) -> int | None:
    """Roll the champion alias back only once the target is served: the router must never follow an alias to a
    version no server holds. With no free server the challenger's test is dropped and its server used: a champion
    worse than the control matters more. Returns the new champion, or None when the alias did not move."""
    aliases = registry.aliases()
    current, challenger = aliases.get(CHAMPION), aliases.get(CHALLENGER)
    target = registry.previous_champion()
    target = 0 if target is None else target
    keep = tier.live_versions(current if current is not None else 0, challenger) | {target}
    if not ensure_serving(target, registry, tier, keep):
        if challenger is None or not ensure_serving(target, registry, tier, keep - {challenger}):
            log.error("promote: rollback to policy-v%d not done: it could not be served; policy-v%s stays champion",
                      target, current)
            return None
        registry.clear_alias(CHALLENGER)
    _, target = registry.rollback()
    if target:
        registry.tag_version(target, {"champion_since_ts": f"{time.time():.3f}"})
    return target


def show(decision: Decision, console: Any) -> None:
    from rich.table import Table

    colour = {"promote": "green", "reject": "red", "expire": "red", "rollback": "red", "halt": "red",
              "hold": "yellow"}.get(decision.action, "white")
    table = Table(title=f"gate: [{colour}]{decision.action}[/{colour}]  champion policy-v{decision.champion}"
                        + (f", challenger policy-v{decision.challenger}" if decision.challenger is not None else ""))
    table.add_column("measure")
    table.add_column("value", justify="right")
    for key, value in decision.numbers.items():
        table.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value))
    console.print(table)
    console.print(f"{decision.action}: {decision.reason}")


def _champion_since(registry: Registry, champion: int) -> float | None:
    """When this version last became champion (a promotion or a rollback to it); None: set by hand, or the base."""
    found = registry.find(champion) if champion else None
    text = (found.tags.get("champion_since_ts") or found.tags.get("promoted_ts")) if found else None
    return float(text) if text else None


def _offline_scores(cfg: PromoteConfig, registry: Registry, sides: list[tuple[int, str]],
                    tasks: list[evaluate.EvalTask]) -> tuple[dict[int, evaluate.EvalScore], list[str]]:
    scores: dict[int, evaluate.EvalScore] = {}
    missing: list[str] = []
    for version, kind in sides:
        try:
            scores[version] = offline_score(registry, version, kind, cfg, tasks)
        except evaluate.EvalUnavailable as exc:
            missing.append(str(exc))
    return scores, missing


def stream_alpha(cfg: PromoteConfig, registry: Registry, challenger: int) -> float | None:
    """This challenger's level in the stream of challengers (None: per-challenger, the rule's alpha).

    Fixed the first time the gate sees the challenger and kept as tags on its model version (gate_stream_index,
    gate_alpha): a test's level must not move while it runs, and a gate restarted mid-test reads it back.
    lord: LORD++ over every challenger the gate has tested, in order, with the promoted ones as its discoveries
    (serving/stats.py lord_alpha: the false discovery rate among promotions stays <= alpha). daily: the day's
    i-th challenger gets alpha 6 / (pi^2 i^2) (any false promotion in a UTC day: <= alpha)."""
    if cfg.stream == "per-challenger":
        return None
    versions = registry.versions()
    mine = next((v for v in versions if v.policy_version == challenger), None)
    if mine is not None and "gate_alpha" in mine.tags:
        return float(mine.tags["gate_alpha"])
    tested = [v for v in versions if "gate_stream_index" in v.tags and v.policy_version != challenger]
    index = 1 + max((int(v.tags["gate_stream_index"]) for v in tested), default=0)
    day = _dt.datetime.now(_dt.timezone.utc).date().isoformat()
    if cfg.stream == "lord":
        discoveries = [int(v.tags["gate_stream_index"]) for v in tested if v.tags.get("gate_decision") == "promote"]
        level = lord_alpha(index, discoveries, cfg.alpha)
    else:
        level = daily_alpha(1 + sum(v.tags.get("gate_stream_day") == day for v in tested), cfg.alpha)
    registry.tag_version(challenger, {"gate_stream_index": index, "gate_stream_day": day, "gate_alpha": repr(level),
                                      "gate_stream": cfg.stream})
    log.info("promote: policy-v%d is challenger %d of the stream (%s): tested at alpha %.3g", challenger, index,
             cfg.stream, level)
    return level


def complete_recorded_promotion(registry: Registry, slots: dict[str, RegisteredVersion] | None = None) -> int | None:
    """Finish a promotion the gate recorded but did not apply (it was stopped in between): the challenger tagged
    gate_decision=promote becomes champion. `slots`: the aliases as just read (default: read them). Returns the
    version when it moved an alias, or None when there was nothing to finish."""
    slots = registry.alias_versions() if slots is None else slots
    challenger, champion = slots.get(CHALLENGER), slots.get(CHAMPION)
    if challenger is None or challenger.tags.get("gate_decision") != "promote":
        return None
    if champion is not None and champion.policy_version == challenger.policy_version:
        registry.clear_alias(CHALLENGER)
        return challenger.policy_version
    log.warning("promote: policy-v%d was recorded as promoted but not made champion (the gate stopped in between); "
                "completing it", challenger.policy_version)
    registry.make_champion(challenger.policy_version)
    now = f"{time.time():.3f}"
    registry.tag_version(challenger.policy_version, {"promoted_ts": now, "champion_since_ts": now})
    return challenger.policy_version


def gate_once(cfg: PromoteConfig, registry: Registry, tasks: list[evaluate.EvalTask] | None = None,
              records: list[SessionRecord] | None = None, now: float | None = None) -> list[Decision]:
    """One round: the challenger gate, then (with auto_rollback) the champion against the control."""
    records = (read_sessions(cfg.lake_root, cfg.outcome_kind, cfg.maturity_s, judge="judge" in cfg.guardrails)
               if records is None else records)
    slots = registry.alias_versions()
    if complete_recorded_promotion(registry, slots) is not None:
        slots = registry.alias_versions()
    champion = slots[CHAMPION].policy_version if CHAMPION in slots else 0
    champion_kind = slots[CHAMPION].kind if CHAMPION in slots else "full"
    challenger = slots.get(CHALLENGER)
    tasks = tasks if tasks is not None else evaluate.load_tasks(cfg.eval_tasks)
    sides = [(champion, champion_kind)]
    if challenger is not None and challenger.policy_version != champion:
        sides.append((challenger.policy_version, challenger.kind))
    # scored while served (cached once per version), so a version keeps its score after it stops being served
    scores, missing = _offline_scores(cfg, registry, sides, tasks)
    offline: tuple[evaluate.EvalScore, evaluate.EvalScore] | str | None = "; ".join(missing) or None
    if challenger is not None and not missing and len(scores) == 2:
        offline = (scores[champion], scores[challenger.policy_version])
    since = _champion_since(registry, champion)
    level = (stream_alpha(cfg, registry, challenger.policy_version)
             if challenger is not None and challenger.policy_version != champion else None)
    decision = gate_round(champion, challenger.policy_version if challenger else None,
                          records, offline, cfg, now, since, level)
    if decision.action == "promote":
        # recorded first, then applied: a gate stopped in between leaves a recorded promotion that the next round
        # completes (complete_recorded_promotion), not a moved alias with no record of why (run 8's demo)
        record(decision, cfg, registry)
        apply(decision, registry, cfg)
    else:
        apply(decision, registry, cfg)
        record(decision, cfg, registry)
    decisions = [decision]
    if cfg.auto_rollback and decision.action != "promote" and CHAMPION in slots:
        back = rollback_round(champion, records, cfg, since, now)
        if back.action == "rollback":
            apply(back, registry, cfg)
            record(back, cfg, registry)
        decisions.append(back)
    return decisions

ACTIONS = ("promote", "reject", "expire", "hold", "halt", "rollback", "keep", "none")
ROUND_BUCKETS_S = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# decisions[0] tests the challenger against the champion, decisions[1] (auto_rollback) the champion against control
_TESTS = (("challenger", "champion", "challenger"), ("rollback", "control", "champion"))


class GateMetrics:
    """flywheel_promote_*: decisions by action, the sessions each test compared, rounds and how long they took."""

    def __init__(self) -> None:
        self.metrics = m = Metrics("promote")
        self.decisions = m.counter("gate", "decisions", "decisions by action: promote, reject, expire, hold "
                                   "(challenger test), rollback, keep (champion vs control), none (no challenger, "
                                   "failed round)",
                                   labels=("action",))
        for action in ACTIONS:  # present at 0 from the start, so rate() sees the first one
            self.decisions.labels(action)
        self.compared = m.gauge("compared", "sessions", "mature concurrent sessions of each arm in the last round's "
                                "tests", labels=("test", "arm"))
        self.failed = m.counter("failed", "rounds", "rounds that raised (MLflow or a server down); retried next round")
        self.round_seconds = m.histogram("round_duration", "seconds", "one gate round, lake read to MLflow record",
                                         ROUND_BUCKETS_S)
        self.champion = m.gauge("champion", "version", "the champion's policy version after the last round")
        self.srm = m.gauge("srm", "log_lr", "the sample-ratio check's evidence of a split unlike the router's "
                           "(the challenger test; the decision halts at log(1 / srm_alpha))")

    def observe_round(self, decisions: list[Decision], seconds: float, failed: bool) -> None:
        self.round_seconds.observe(seconds)
        if failed:
            self.failed.inc()
        for d in decisions:
            self.decisions.labels(d.action).inc()
        for (test, arm_a, arm_b), d in zip(_TESTS, decisions):
            if "online_n_a" in d.numbers:
                self.compared.labels(test, arm_a).set(d.numbers["online_n_a"])
                self.compared.labels(test, arm_b).set(d.numbers["online_n_b"])
        if decisions[0].champion >= 0:
            self.champion.set(decisions[0].champion)
        if "online_srm_log_lr" in decisions[0].numbers:
            self.srm.set(decisions[0].numbers["online_srm_log_lr"])


def run(cfg: PromoteConfig) -> int:
    from rich.console import Console

    console = Console()
    if cfg.auto:  # a daemon: keep the resolved config so this run can be reproduced with --config
        from flywheel.base.config import write_resolved

        log.info("promote: resolved config in %s", write_resolved(cfg, Path(cfg.var_dir) / "run" / "promote.toml"))
    registry = Registry(cfg.mlflow_tracking_uri, cfg.registered_model)
    log.info("promote: registry %s at %s, lake %s, eval set %s", cfg.registered_model, cfg.mlflow_tracking_uri,
             cfg.lake_root, cfg.eval_tasks)
    stop = threading.Event()
    if cfg.auto:
        stop_on_signals("finishing the current round, then exiting", stop, signals=(signal.SIGTERM,))
    metrics = GateMetrics()
    metrics.metrics.serve(cfg.metrics_port)
    try:
        return _rounds(cfg, registry, stop, metrics, console)
    finally:
        metrics.metrics.close()


def _rounds(cfg: PromoteConfig, registry: Registry, stop: threading.Event, metrics: GateMetrics, console: Any) -> int:
    """Gate rounds until the last one (one without --auto; --rounds or SIGTERM with it)."""
    from flywheel.base.heartbeat import write_status

    rounds = 0
    while True:
        started, failed = time.monotonic(), False
        try:
            repair_serving(registry, cfg)
            decisions = gate_once(cfg, registry)
        except Exception as exc:  # MLflow or a server hiccup: no decision this round, the next one tries again
            if not cfg.auto:
                raise
            log.error("promote: round failed (%s: %s); retrying in %.0f s", type(exc).__name__, exc, cfg.interval_s)
            decisions, failed = [Decision("none", f"round failed: {exc}", -1, None)], True
        metrics.observe_round(decisions, time.monotonic() - started, failed)
        for d in decisions:
            show(d, console)
        rounds += 1
        first = decisions[0]
        if first.action == "halt":
            log.error("promote: ALERT %s", first.reason)
        write_status("promote", {"round": rounds, "champion": first.champion, "challenger": first.challenger,
                                 "last": first.action, "reason": first.reason[:500],
                                 "srm": {k[len("online_srm_"):]: v for k, v in first.numbers.items()
                                         if k.startswith("online_srm_")}}, cfg.var_dir)
        if not cfg.auto or (cfg.rounds and rounds >= cfg.rounds) or stop.wait(cfg.interval_s):
            return 0


def main(argv: list[str] | None = None) -> int:
    from flywheel.base.config import load_config, setup_logging

    cfg = load_config(PromoteConfig, argv, "flywheel promote")
    setup_logging()
    return run(cfg)


def rollback_main(argv: list[str] | None = None) -> int:
    """`flywheel rollback`: move the champion alias back to the previous champion now."""
    from rich.console import Console

    from flywheel.base.config import load_config, setup_logging

    cfg = load_config(PromoteConfig, argv, "flywheel rollback")
    setup_logging()
    registry = Registry(cfg.mlflow_tracking_uri, cfg.registered_model)
    current = registry.aliases().get(CHAMPION)
    if current is None and not registry.champion_history():
        log.error("rollback: %s: no champion to roll back", registry.name)
        return 1
    target = rollback_to_served(registry, cfg)
    if target is None:
        return 1
    decision = Decision("rollback", "manual rollback (flywheel rollback)", current if current is not None else 0,
                        target)
    record(decision, cfg, registry)
    Console().print(f"rollback: champion policy-v{current} -> policy-v{target}; the router follows within "
                    f"{cfg.alias_refresh_s:.0f} s")
    return 0


# ---------------------------------------------------------------------------------------------
# flywheel status
# ---------------------------------------------------------------------------------------------
def running_config(var_dir: str = defaults.VAR_DIR) -> PromoteConfig:
    """The rule of the gate running from this state folder (`flywheel promote --auto` writes its resolved config
    to <var_dir>/run/promote.toml), so that status tests the split and the looks as that gate does; the defaults
    (with the environment) when none ran here."""
    from flywheel.base.config import load_config

    path = Path(var_dir) / "run" / "promote.toml"
    return load_config(PromoteConfig, ["--config", str(path)] if path.is_file() else [], "flywheel status")


def print_status(console: Any, cfg: PromoteConfig | None = None) -> None:
    """Versions, aliases, traffic shares and per-version success with 95% intervals (mature sessions)."""
    from rich.table import Table

    from flywheel.serving.router import shares as arm_shares
    from flywheel.serving.sessions import mature

    cfg = cfg or running_config()
    registry = Registry(cfg.mlflow_tracking_uri, cfg.registered_model)
    aliases = registry.aliases()
    champion = aliases.get(CHAMPION, 0)
    shares = arm_shares(cfg, champion, aliases.get(CHALLENGER))
    try:  # as the gate reads them: an outcome counts when it came within the maturity window
        records = read_sessions(cfg.lake_root, cfg.outcome_kind, cfg.maturity_s, judge="judge" in cfg.guardrails)
    except Exception as exc:  # an empty or unreadable lake must not break the status view
        log.warning("status: lake %s unreadable (%s)", cfg.lake_root, exc)
        records = []
    counted = mature(records, time.time(), cfg.maturity_s, cfg.error_statuses).counted
    rewards: dict[int, list[float]] = {}
    for r in counted:
        if r.version is not None:
            rewards.setdefault(r.version, []).append(float(r.outcome))  # type: ignore[arg-type]
    versions = {v.policy_version: v for v in registry.versions()}
    table = Table(title=f"policy versions ({cfg.registered_model}; history {registry.champion_history()})")
    for column in ("version", "kind", "alias", "share", "sessions", cfg.outcome_kind, "95% CI", "gate"):
        table.add_column(column, justify="right" if column in ("share", "sessions", cfg.outcome_kind) else "left")
    for version in sorted(set(versions) | set(rewards) | {champion}):
        rv = versions.get(version)
        alias = (",".join(a for a, v in aliases.items() if v == version)
                 or ("champion (base)" if version == champion else ""))
        if cfg.control_share > 0 and version == cfg.control_version:
            alias = ",".join(x for x in (alias, "control") if x)
        mean, low, high = mean_ci(rewards.get(version, []))
        table.add_row(f"policy-v{version}", rv.kind if rv else ("full" if version == 0 else "?"), alias,
                      f"{shares[version]:.0%}" if version in shares else "",
                      str(len(rewards.get(version, []))), "" if math.isnan(mean) else f"{mean:.3f}",
                      "" if math.isnan(low) else f"[{low:.3f}, {high:.3f}]",
                      (rv.tags.get("gate_decision", "") if rv else "")
                      + (" rolled back" if rv and rv.tags.get("rolled_back") else ""))
    console.print(table)
    challenger = aliases.get(CHALLENGER)
    if challenger is not None and challenger != champion:
        level = versions[challenger].tags.get("gate_alpha") if challenger in versions else None
        rule = dataclasses.replace(cfg, alpha=float(level)) if level else cfg  # the level its test runs at
        print_looks(console, rule, records, champion, challenger, _champion_since(registry, champion))


def print_looks(console: Any, cfg: PromoteConfig, records: list[SessionRecord], champion: int, challenger: int,
                since: float | None) -> None:
    """The current challenger's test as the gate sees it now: each planned look reached (the primary's z against
    its boundary, each guardrail's statistic), the sample-ratio check, and what the rule says."""
    from rich.table import Table

    from flywheel.serving.decision import looks

    ev = concurrent(records, (champion, "champion"), (challenger, "challenger"), time.time(), cfg, since=since,
                    expected_b=expected_challenger_share(cfg))
    verdict = decide_online(ev, cfg)
    table = Table(title=f"policy-v{challenger} against policy-v{champion}: {cfg.test}, looks at "
                        f"{cfg.look_sizes() if cfg.test == 'group-sequential' else 'every round'} sessions a side "
                        f"(now {ev.n_a} / {ev.n_b})")
    names = sorted(cfg.guardrails)
    for column in ("look", "sessions", "diff", "z better", "z worse", "bound", *names):
        table.add_column(column, justify="right")
    for row in looks(ev, cfg):
        guards = row["guards"]
        assert isinstance(guards, dict)
        table.add_row(str(row["look"]), str(row["sessions"]), f"{row['diff']:+.3f}", f"{row['z_better']:.2f}",
                      f"{row['z_worse']:.2f}", f"{row['bound']:.2f}", *(str(guards.get(n, "")) for n in names))
    console.print(table)
    if verdict.srm is not None:
        console.print(f"sample ratio: challenger {verdict.srm.n_b} of {verdict.srm.n_a + verdict.srm.n_b} "
                      f"({verdict.srm.observed_b:.1%}, expected {verdict.srm.expected_b:.1%}), always-valid p "
                      f"{verdict.srm.p_value:.3g}{' MISMATCH' if verdict.srm.mismatch else ''}")
    for g in verdict.guards:
        console.print(f"  {g.describe()}")
    console.print(f"gate now: {verdict.action}: {verdict.reason}")


def as_dict(decision: Decision) -> dict[str, Any]:
    return json.loads(json.dumps(dataclasses.asdict(decision), default=str))
