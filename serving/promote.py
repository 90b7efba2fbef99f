"""Promotion gate and rollback: `flywheel promote [--auto]`, `flywheel rollback`, the serving part of `flywheel status`.

The gate compares the challenger with the champion on
  (a) online outcome rewards of their own production sessions, read from the lake's episodes
      (latest label of each episode, averaged per session, grouped by the policy_version that
      served it) with a one-sided Welch t-test and a minimum number of sessions per side, and
  (b) an offline set of verifiable tasks run through vLLM against both (two-proportion z-test;
      the task set is pluggable, see serving/evaluate.py).
It promotes only when neither shows a significant regression. Outcomes:
  promote  the challenger becomes champion (the old one stays in the champion history);
  reject   a significant regression: the challenger alias is cleared, so it stops getting traffic;
  hold     too few sessions yet, or no offline score: nothing changes, the next round decides.
With --auto it loops, and also rolls back a champion whose online reward has dropped significantly
below the previous champion's. Every decision, its numbers and its reason go to MLflow (a run in
experiment "flywheel-promotion" and tags on the challenger's model version) and to stdout.

Rollback (`flywheel rollback`, or automatic) moves `champion` back to the previous champion; the
router re-reads aliases every few seconds, and full-weight servers are reloaded with the restored
champion's weights, since an alias alone cannot change what a server holds.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flywheel.base import defaults
from flywheel.base.config import ConfigError, setting
from flywheel.base.stop import stop_on_signals
from flywheel.serving import evaluate, publisher, vllm_client
from flywheel.serving.registry import CHALLENGER, CHAMPION, Registry
from flywheel.serving.stats import Comparison, mean_ci, two_proportions, welch
from flywheel.serving.tier import TierConfig

log = logging.getLogger(__name__)


@dataclass
class PromoteConfig(TierConfig):
    """Champion/challenger gate over online rewards (lake) and an offline eval set (vLLM)."""

    lake_root: str = setting(defaults.LAKE_ROOT, "trajectory lake root (episodes are read from <root>/episodes)")
    min_sessions: int = setting(30, "sessions each side needs before the online test may decide")
    alpha: float = setting(0.05, "one-sided significance level for a regression (online and offline)")
    max_drop: float = setting(float("inf"), "largest drop of the challenger's mean online reward below the champion's that may "
                                            "still be promoted; a larger one is rejected even when not significant (inf: "
                                            "only significant regressions are rejected)")
    eval_tasks: str = setting("flywheel.serving.evaluate:arithmetic_tasks", "offline eval set: module:function returning EvalTasks")
    require_offline_eval: bool = setting(True, "hold the promotion when a side has no offline score")
    experiment: str = setting("flywheel-promotion", "MLflow experiment receiving one run per decision")
    auto: bool = setting(False, "loop: gate every interval_s and roll back a regressed champion")
    auto_rollback: bool = setting(True, "with --auto, roll back when the champion is significantly worse than the previous")
    interval_s: float = setting(30.0, "seconds between rounds with --auto")
    rounds: int = setting(0, "with --auto, stop after this many rounds (0: until SIGTERM)")
    var_dir: str = setting(defaults.VAR_DIR, "local state folder; the heartbeat goes to <var_dir>/run/status/promote.json")

    def check(self) -> None:
        super().check()
        if self.min_sessions < 2:
            raise ConfigError(f"min_sessions: {self.min_sessions} < 2; a t-test needs two sessions per side")
        if not 0.0 < self.alpha < 0.5:
            raise ConfigError(f"alpha: {self.alpha} is not within (0, 0.5)")
        if not self.max_drop >= 0.0:
            raise ConfigError(f"max_drop: {self.max_drop} must be >= 0 (inf turns it off)")


@dataclass
class Decision:
    action: str  # promote | reject | hold | rollback | keep | none
    reason: str
    champion: int
    challenger: int | None
    numbers: dict[str, float] = field(default_factory=dict)
    ts: str = field(default_factory=lambda: _dt.datetime.now(_dt.timezone.utc).isoformat())


# ---------------------------------------------------------------------------------------------
# Online rewards from the lake
# ---------------------------------------------------------------------------------------------
def online_rewards(lake_root: str) -> dict[int, list[float]]:
    """policy_version -> one reward per session it served (mean over the session's latest-labelled episodes)."""
    import duckdb

    from flywheel.ingest import lake

    files = [f.path for f in lake.list_files(lake_root, "episodes")]
    if not files:
        return {}
    if "://" not in lake_root:
        files = [str(Path(p)) for p in files]
    con = duckdb.connect()
    try:
        rows = con.execute(
            """
            WITH latest AS (
                SELECT session_id, policy_version, reward
                FROM read_parquet(?, union_by_name = true)
                -- a later outcome appends a new label of the same episode: only the newest one counts
                QUALIFY row_number() OVER (PARTITION BY episode_id ORDER BY label_version DESC) = 1
            )
            SELECT policy_version, avg(reward) FROM latest GROUP BY policy_version, session_id
            """, [files]).fetchall()
    finally:
        con.close()
    out: dict[int, list[float]] = {}
    for version, reward in rows:
        if reward is not None and math.isfinite(reward):
            out.setdefault(int(version), []).append(float(reward))
    return out


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
        raise evaluate.EvalUnavailable(f"policy-v{version} ({kind}) is not served by any server and has no cached score")
    score = evaluate.run_eval(tasks, place[0], place[1], cfg.eval_tasks, timeout=cfg.http_timeout_s)
    _store_score(registry, version, score)
    return score


# ---------------------------------------------------------------------------------------------
# Decisions
# ---------------------------------------------------------------------------------------------
def _numbers(prefix: str, c: Comparison) -> dict[str, float]:
    return {f"{prefix}_n_champion": c.n_a, f"{prefix}_n_challenger": c.n_b, f"{prefix}_champion": c.mean_a,
            f"{prefix}_challenger": c.mean_b, f"{prefix}_diff": c.diff, f"{prefix}_p_worse": c.p_worse,
            f"{prefix}_p_better": c.p_better}


def decide(champion: int, challenger: int | None, rewards: dict[int, list[float]],
           offline: tuple[evaluate.EvalScore, evaluate.EvalScore] | str | None, cfg: PromoteConfig) -> Decision:
    """The gate as a pure function: `offline` is (champion score, challenger score), or why there is none."""
    if challenger is None or challenger == champion:
        return Decision("none", "no challenger", champion, None)
    champ_r, chal_r = rewards.get(champion, []), rewards.get(challenger, [])
    numbers: dict[str, float] = {"online_n_champion": len(champ_r), "online_n_challenger": len(chal_r)}
    if len(champ_r) < cfg.min_sessions or len(chal_r) < cfg.min_sessions:
        return Decision("hold", f"too few sessions: champion policy-v{champion} {len(champ_r)}, challenger "
                        f"policy-v{challenger} {len(chal_r)}, need {cfg.min_sessions} each", champion, challenger, numbers)
    online = welch(champ_r, chal_r)
    numbers.update(_numbers("online", online))
    if online.p_worse < cfg.alpha:
        return Decision("reject", f"online reward regressed: {online.mean_b:.3f} vs {online.mean_a:.3f} "
                        f"(p={online.p_worse:.4f} < {cfg.alpha})", champion, challenger, numbers)
    if online.diff < -cfg.max_drop:
        # "not significantly worse" is not "as good": with 100-300 sessions a side the gate promoted
        # versions 6-9 points of success below their champion (p_worse 0.055-0.17), and the champion
        # line drifted down from its best. Rejecting costs little: the learner continues from the champion.
        return Decision("reject", f"online reward dropped {-online.diff:.4f} > max_drop {cfg.max_drop} "
                        f"({online.mean_b:.3f} vs {online.mean_a:.3f}, p_worse={online.p_worse:.3f})",
                        champion, challenger, numbers)
    if isinstance(offline, tuple):
        champ_s, chal_s = offline
        off = two_proportions(champ_s.successes, champ_s.n, chal_s.successes, chal_s.n)
        numbers.update(_numbers("offline", off))
        if off.p_worse < cfg.alpha:
            return Decision("reject", f"offline eval regressed: {chal_s.successes}/{chal_s.n} vs "
                            f"{champ_s.successes}/{champ_s.n} (p={off.p_worse:.4f} < {cfg.alpha})",
                            champion, challenger, numbers)
        offline_text = f"offline {chal_s.successes}/{chal_s.n} vs {champ_s.successes}/{champ_s.n} (p_worse={off.p_worse:.3f})"
    elif cfg.require_offline_eval:
        return Decision("hold", f"no offline eval: {offline}", champion, challenger, numbers)
    else:
        offline_text = f"offline eval skipped ({offline})"
    return Decision("promote", f"no significant regression: online {online.mean_b:.3f} vs {online.mean_a:.3f} "
                    f"(p_worse={online.p_worse:.3f}), {offline_text}", champion, challenger, numbers)


def decide_rollback(champion: int, previous: int | None, rewards: dict[int, list[float]],
                    cfg: PromoteConfig) -> Decision:
    """Roll back when the champion's sessions are significantly worse than the previous champion's."""
    if previous is None:
        return Decision("keep", "no previous champion", champion, None)
    now, before = rewards.get(champion, []), rewards.get(previous, [])
    numbers: dict[str, float] = {"online_n_champion": len(now), "online_n_previous": len(before)}
    if len(now) < cfg.min_sessions or len(before) < cfg.min_sessions:
        return Decision("keep", f"too few sessions to judge the champion ({len(now)} vs {len(before)}, need "
                        f"{cfg.min_sessions})", champion, None, numbers)
    c = welch(before, now)
    numbers.update({"online_previous": c.mean_a, "online_champion": c.mean_b, "online_diff": c.diff,
                    "online_p_worse": c.p_worse})
    if c.p_worse < cfg.alpha:
        return Decision("rollback", f"champion policy-v{champion} regressed below policy-v{previous}: "
                        f"{c.mean_b:.3f} vs {c.mean_a:.3f} (p={c.p_worse:.4f} < {cfg.alpha})", champion, previous,
                        numbers)
    return Decision("keep", f"champion holds: {c.mean_b:.3f} vs previous {c.mean_a:.3f} (p_worse={c.p_worse:.3f})",
                    champion, None, numbers)


# ---------------------------------------------------------------------------------------------
# Applying and recording decisions
# ---------------------------------------------------------------------------------------------
def ensure_serving(version: int, registry: Registry, tier: TierConfig) -> None:
    """Make the tier serve a version again (after a rollback or reject): reload full weights, re-load an evicted adapter."""
    if version == 0:
        kind, source = "full", str(Path(tier.base_model).resolve())
    else:
        found = registry.find(version)
        if found is None:
            log.warning("promote: policy-v%d is not registered; cannot make the tier serve it", version)
            return
        kind, source = found.kind, found.source
    if where_served(version, kind, tier) is not None and kind == "lora":
        return
    for server in tier.servers:
        server = server.rstrip("/")
        try:
            if kind == "lora":
                if publisher.lora_name(version) not in vllm_client.served_models(server, tier.http_timeout_s):
                    vllm_client.load_lora_adapter(server, publisher.lora_name(version), source, tier.http_timeout_s)
            else:
                held = vllm_client.weight_version(server, tier.http_timeout_s)
                if held == version:
                    continue
                held_found = registry.find(held) if held != 0 else None  # where to go back to if the reload fails
                pv = publisher.PolicyVersion(Path(source), version, "full", {})
                publisher.push_full_http(server, pv, tier, restore_dir=Path(held_found.source) if held_found else None)
            log.info("promote: %s serves policy-v%d (%s) again", server, version, kind)
        except vllm_client.ServerError as exc:
            log.error("promote: could not restore policy-v%d on %s: %s", version, server, exc)


def stranded(held: dict[str, int], champion: int, registered: set[int]) -> list[str]:
    """Full-weight servers left on a version no alias names: a gate killed between moving an alias
    (reject, rollback) and reloading the servers leaves them there, and no later round repairs it.

    `held`: server -> the full-weight version it holds; `registered`: the versions in the registry.
    A held version that is not registered is a publish in flight (the publisher pushes, then
    registers), so it is left alone; version 0 (the base) is always known.
    """
    return [server for server, version in sorted(held.items())
            if version != champion and (version == 0 or version in registered)]


def repair_serving(registry: Registry, tier: TierConfig) -> None:
    """At start-up, with no challenger pending: put full-weight servers stranded on a refused version back on the champion."""
    slots = registry.alias_versions()
    if CHALLENGER in slots:
        return  # the next round decides, and its apply() reloads what it must
    champion = slots[CHAMPION].policy_version if CHAMPION in slots else 0
    if champion != 0 and slots[CHAMPION].kind != "full":
        return  # adapters are served by name: the router follows the aliases, nothing is stranded
    held: dict[str, int] = {}
    for server in tier.servers:
        try:
            held[server] = vllm_client.weight_version(server.rstrip("/"), tier.http_timeout_s)
        except vllm_client.ServerError as exc:
            log.warning("promote: start-up check of %s skipped (%s)", server, exc)
    registered = {v for v in set(held.values()) if v != 0 and registry.find(v) is not None}
    servers = stranded(held, champion, registered)
    for server in servers:
        log.warning("promote: %s holds policy-v%d, which no alias names (a gate stopped mid-decision); "
                    "serving the champion policy-v%d again", server, held[server], champion)
    if servers:
        ensure_serving(champion, registry, tier)


def record(decision: Decision, cfg: PromoteConfig, registry: Registry) -> str | None:
    """One MLflow run per decision (params, metrics, reason) plus tags on the challenger's model version."""
    from flywheel.base import tracking

    if decision.action == "none":
        return None
    client = registry.client
    run = client.create_run(tracking.experiment_id(cfg.experiment, cfg.mlflow_tracking_uri),
                            run_name=f"{decision.action}-v{decision.challenger}-over-v{decision.champion}",
                            tags={"decision": decision.action, "reason": decision.reason[:4000],
                                  "registered_model": registry.name})
    run_id = run.info.run_id
    client.log_param(run_id, "champion", decision.champion)
    client.log_param(run_id, "challenger", decision.challenger)
    for key in ("min_sessions", "alpha", "eval_tasks"):
        client.log_param(run_id, key, getattr(cfg, key))
    for key, value in decision.numbers.items():
        if value is not None and math.isfinite(float(value)):
            client.log_metric(run_id, key, float(value))
    client.set_terminated(run_id)
    if decision.challenger is not None and decision.action in ("promote", "reject", "hold"):
        registry.tag_version(decision.challenger, {"gate_decision": decision.action, "gate_reason": decision.reason[:4000],
                                                   "gate_ts": decision.ts, "gate_run_id": run_id})
    return run_id


def apply(decision: Decision, registry: Registry, tier: TierConfig) -> None:
    if decision.action == "promote" and decision.challenger is not None:
        registry.make_champion(decision.challenger)
    elif decision.action == "reject":
        registry.clear_alias(CHALLENGER)
        ensure_serving(decision.champion, registry, tier)  # a full-weight challenger still sits on the servers
    elif decision.action == "rollback":
        _, target = registry.rollback()
        ensure_serving(target, registry, tier)


def show(decision: Decision, console: Any) -> None:
    from rich.table import Table

    colour = {"promote": "green", "reject": "red", "rollback": "red", "hold": "yellow"}.get(decision.action, "white")
    table = Table(title=f"gate: [{colour}]{decision.action}[/{colour}]  champion policy-v{decision.champion}"
                        + (f", challenger policy-v{decision.challenger}" if decision.challenger is not None else ""))
    table.add_column("measure")
    table.add_column("value", justify="right")
    for key, value in decision.numbers.items():
        table.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value))
    console.print(table)
    console.print(f"{decision.action}: {decision.reason}")


def gate_once(cfg: PromoteConfig, registry: Registry, tasks: list[evaluate.EvalTask] | None = None,
              rewards: dict[int, list[float]] | None = None) -> list[Decision]:
    """One round: the challenger gate, then (with auto_rollback) the champion's regression check."""
    rewards = online_rewards(cfg.lake_root) if rewards is None else rewards
    slots = registry.alias_versions()
    champion = slots[CHAMPION].policy_version if CHAMPION in slots else 0
    champion_kind = slots[CHAMPION].kind if CHAMPION in slots else "full"
    decisions: list[Decision] = []
    challenger = slots.get(CHALLENGER)
    # Score both sides every round while they are served (cached once per version): a full-weight
    # champion stops being served the moment a full-weight challenger is pushed, and its score from
    # before is the only one the gate can ever compare against.
    tasks = tasks if tasks is not None else evaluate.load_tasks(cfg.eval_tasks)
    sides = [(champion, champion_kind)]
    if challenger is not None and challenger.policy_version != champion:
        sides.append((challenger.policy_version, challenger.kind))
    scores: dict[int, evaluate.EvalScore] = {}
    missing: list[str] = []
    for version, kind in sides:
        try:
            scores[version] = offline_score(registry, version, kind, cfg, tasks)
        except evaluate.EvalUnavailable as exc:
            missing.append(str(exc))
    offline: tuple[evaluate.EvalScore, evaluate.EvalScore] | str | None = "; ".join(missing) or None
    if challenger is not None and not missing and len(scores) == 2:
        offline = (scores[champion], scores[challenger.policy_version])
    decision = decide(champion, challenger.policy_version if challenger else None, rewards, offline, cfg)
    apply(decision, registry, cfg)
    record(decision, cfg, registry)
    decisions.append(decision)
    if cfg.auto_rollback and decision.action != "promote" and CHAMPION in slots:
        back = decide_rollback(champion, registry.previous_champion(), rewards, cfg)
        if back.action == "rollback":
            apply(back, registry, cfg)
            record(back, cfg, registry)
        decisions.append(back)
    return decisions


def run(cfg: PromoteConfig) -> int:
    from rich.console import Console

    from flywheel.base.heartbeat import write_status

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
    repair_serving(registry, cfg)
    rounds = 0
    while True:
        decisions = gate_once(cfg, registry)
        for d in decisions:
            show(d, console)
        rounds += 1
        write_status("promote", {"round": rounds, "champion": decisions[0].champion,
                                 "challenger": decisions[0].challenger, "last": decisions[0].action}, cfg.var_dir)
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
    try:
        current, target = registry.rollback()
    except LookupError as exc:
        log.error("rollback: %s", exc)
        return 1
    ensure_serving(target, registry, cfg)
    decision = Decision("rollback", "manual rollback (flywheel rollback)", current if current is not None else 0, target)
    record(decision, cfg, registry)
    Console().print(f"rollback: champion policy-v{current} -> policy-v{target}; the router follows within "
                    f"{cfg.alias_refresh_s:.0f} s")
    return 0


# ---------------------------------------------------------------------------------------------
# flywheel status
# ---------------------------------------------------------------------------------------------
def print_status(console: Any, cfg: PromoteConfig | None = None) -> None:
    """Versions, aliases, traffic shares and per-version online reward with 95% intervals."""
    from rich.table import Table

    cfg = cfg or PromoteConfig()
    registry = Registry(cfg.mlflow_tracking_uri, cfg.registered_model)
    aliases = registry.aliases()
    champion = aliases.get(CHAMPION, 0)
    challenger = aliases.get(CHALLENGER)
    shares = {champion: 1.0} if challenger in (None, champion) else {
        champion: 1.0 - cfg.challenger_share, challenger: cfg.challenger_share}
    try:
        rewards = online_rewards(cfg.lake_root)
    except Exception as exc:  # an empty or unreadable lake must not break the status view
        log.warning("status: lake %s unreadable (%s)", cfg.lake_root, exc)
        rewards = {}
    versions = {v.policy_version: v for v in registry.versions()}
    table = Table(title=f"policy versions ({cfg.registered_model}; history {registry.champion_history()})")
    for column in ("version", "kind", "alias", "share", "sessions", "reward", "95% CI", "gate"):
        table.add_column(column, justify="right" if column in ("share", "sessions", "reward") else "left")
    for version in sorted(set(versions) | set(rewards) | {champion}):
        rv = versions.get(version)
        alias = ",".join(a for a, v in aliases.items() if v == version) or ("champion (base)" if version == champion else "")
        mean, low, high = mean_ci(rewards.get(version, []))
        table.add_row(f"policy-v{version}", rv.kind if rv else ("full" if version == 0 else "?"), alias,
                      f"{shares[version]:.0%}" if version in shares else "",
                      str(len(rewards.get(version, []))), "" if math.isnan(mean) else f"{mean:.3f}",
                      "" if math.isnan(low) else f"[{low:.3f}, {high:.3f}]",
                      (rv.tags.get("gate_decision", "") if rv else "") + (" rolled back" if rv and rv.tags.get("rolled_back") else ""))
    console.print(table)


def as_dict(decision: Decision) -> dict[str, Any]:
    return json.loads(json.dumps(dataclasses.asdict(decision), default=str))
