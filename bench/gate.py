"""`flywheel bench gate`: the promotion gate's error rates, measured on simulated session streams fed to the gate's
own decision code (flywheel.serving.decision.decide, what `flywheel promote` calls).

    flywheel bench gate [--recipe tool_use] [--challengers 2000] [--seed 0] [--gate.alpha 0.05 ...]
                        [--challenger-per-look 15 --champion-ratio 1.0] [--no-compare] [--out-dir var/bench/gate]

The rule is the recipe's [gate] (the demo's by default), flags over it; nothing here re-declares it. Sections:

1. The primary test alone (sessions without guardrail metrics): the false-promotion rate under the null at
   several base rates and task mixes (the worst is reported), the power curve on the demo-like mix, and with
   --compare the other test (msprt <-> group-sequential) side by side.
2. The whole rule, with guardrail metrics and a random split (serving/gate_sim.py Guards at the demo's levels):
   the false-promotion rate with the challenger at the null on success AND exactly at every guardrail's margin;
   a challenger +10 points better but 5 points worse on malformed calls (beyond the margin); the power at +10
   points with every guardrail equal, each guardrail's own share of it, and the power at larger planned sizes.
3. The sample-ratio check: a challenger arm that loses a third of its sessions (its share of the two arms 10
   points below the router's 50%) and one that loses 10%, detected before the last look; false alarms.
4. A stream of challengers: false promotions per day under the null at the demo's cadence, a version an hour and
   a version every 5 minutes (a challenger replaced before its last look is cut short), per error-control mode
   (per-challenger, lord, daily); and a mixed stream (10% of challengers +10 points) for what each mode costs.

Prints a table, writes power_vs_lift.png and the resolved config.toml under --out-dir, and prints as its last
line one JSON object. Pure CPU, about ten minutes at 2,000 challengers.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from flywheel.base import defaults
from flywheel.base.config import ConfigError, from_recipe, load_config, setting, write_resolved
from flywheel.serving.decision import GateRule
from flywheel.serving.gate_sim import (
    Guards,
    Scenario,
    SimResult,
    StreamResult,
    at_null,
    binomial_se,
    simulate,
    simulate_stream,
)

DEFAULT_RECIPE = "tool_use"


@dataclass
class GateBenchConfig:
    """The promotion gate's error rates on simulated session streams."""

    RECIPE_SECTION: ClassVar[str] = ""  # --recipe: its [gate] is the rule measured

    challengers: int = setting(2000, "simulated challengers per scenario")
    seed: int = setting(0, "random seed (the same for every scenario: common random numbers smooth the power curve)")
    compare: bool = setting(True, "also run the other test (msprt <-> group-sequential) at the same traffic on the "
                                  "demo-like null and at +5 and +10 points, side by side")
    challenger_per_look: int = setting(15, "challenger sessions that mature between two looks (the demo's traffic)")
    champion_ratio: float = setting(1.0, "champion sessions per challenger session (the demo's traffic)")
    challenger_sessions_per_s: float = setting(1.5, "a stream's challenger sessions per second (the demo's: 1.49 "
                                                    "in run 2 of issue 38, docs/runs/*-d148516-2.json "
                                                    "gate_sim_basis; 0.8 before its two-turn lookups)")
    demo_cadence_s: float = setting(420.0, "seconds between the demo's versions (its publish_supersede_s)")
    stream_days: float = setting(3.0, "simulated days of each stream, and at least min(200, challengers) "
                                      "challengers (more days at a cadence that gives fewer)")
    out_dir: str = setting(f"{defaults.VAR_DIR}/bench/gate", "where the plot and the resolved config go")
    gate: GateRule = field(default_factory=lambda: from_recipe(GateRule, DEFAULT_RECIPE),
                           metadata={"help": "the rule measured: the recipe's [gate] (flywheel promote --help)"})

    def rule(self) -> GateRule:
        return self.gate

    def other_rule(self) -> GateRule:
        """The same rule with the other test: the side-by-side comparison."""
        other = "msprt" if self.gate.test == "group-sequential" else "group-sequential"
        return dataclasses.replace(self.gate, test=other)

    def check(self) -> None:
        if self.challengers < 1:
            raise ConfigError(f"challengers: {self.challengers} must be >= 1")
        if self.challenger_per_look < 1 or self.champion_ratio <= 0:
            raise ConfigError(f"challenger_per_look ({self.challenger_per_look}) must be >= 1 and champion_ratio "
                              f"({self.champion_ratio}) > 0")
        if self.challenger_sessions_per_s <= 0 or self.demo_cadence_s <= 0 or self.stream_days <= 0:
            raise ConfigError("challenger_sessions_per_s, demo_cadence_s and stream_days must be > 0")
        self.gate.check_rule()


# The demo's task types at its mix and the control arm's success per type (issue 38's demo: run 2 of session 24,
# d148516, 3,185 control sessions of policy-v0), plus a rare sixth type (5%): a stratum that stays below two
# sessions a side for the first looks, which the stratified estimate must leave out, not break on.
DEMO_LIKE = "demo-like, 6 types"
DEMO_RATES = {"tool_use.weather": 0.295, "tool_use.country": 0.310, "tool_use.timezone": 0.337,
              "tool_use.add": 0.006, "tool_use.mul": 0.011, "tool_use.multi": 0.064, "tool_use.rare": 0.25}
DEMO_MIX = {"tool_use.weather": 0.223, "tool_use.country": 0.236, "tool_use.timezone": 0.225, "tool_use.add": 0.093,
            "tool_use.mul": 0.080, "tool_use.multi": 0.093, "tool_use.rare": 0.05}
# The guardrail metrics of the same control arm: 0.86% of 3,495 tool calls malformed, 1.10 calls a session, no
# infrastructure error in 3,185 sessions, latency median 0.36 s (log sd 0.58), 128 tokens a session (cv 0.28).
DEMO_GUARDS = Guards(malformed=0.0086, extra_calls=0.1, errors=0.0, latency_median_s=0.36, latency_sigma=0.58,
                     tokens_mean=128.0, tokens_cv=0.28)
# The levels of the demo before issue 38 (malformed calls on 6.5-10% of sessions, errors 0.5%): the guardrails'
# cost in power where a policy breaks more of its calls, kept as one row beside the headline.
EARLIER_GUARDS = Guards()
NULL_SCENARIOS: dict[str, tuple[dict[str, float], dict[str, float]]] = {
    "one type, 0.10": ({"t": 0.10}, {"t": 1.0}),
    "one type, 0.25": ({"t": 0.25}, {"t": 1.0}),
    "one type, 0.50": ({"t": 0.50}, {"t": 1.0}),
    "two types 0.1/0.4, 50/50": ({"easy": 0.4, "hard": 0.1}, {"easy": 0.5, "hard": 0.5}),
    "two types 0.1/0.4, 20/80": ({"easy": 0.4, "hard": 0.1}, {"easy": 0.2, "hard": 0.8}),
    DEMO_LIKE: (DEMO_RATES, DEMO_MIX),
}
POWER_LIFTS_PT = [0, 2, 5, 7, 10, 15]  # points of success added to the challenger, on the demo-like mix
COMPARE_LIFTS_PT = [0, 5, 10]  # the other test, demo-like mix: its null, and the two powers the summary names
PLANNED_SIZES = [480, 720]  # the whole rule's power at +10 points at larger planned sizes (sessions a side)
SRM_LOSSES = {"srm_10pt": 1 / 3, "srm_loss_10pct": 0.10}  # the challenger's lost share of its sessions
MIXED_SHARE = 0.10  # the mixed stream: this share of challengers is +10 points better


@dataclass(frozen=True)
class Row:
    section: str
    name: str
    scenario: Scenario
    result: SimResult
    rule: GateRule


def _scenario(cfg: GateBenchConfig, name: str, lift: float, guards: Guards | None = None,
              loss: float = 0.0) -> Scenario:
    rates, mix = NULL_SCENARIOS[name]
    return Scenario(rates=rates, mix=mix, lift=lift, challenger_per_look=cfg.challenger_per_look,
                    champion_ratio=cfg.champion_ratio, guards=guards, challenger_loss=loss)


def _primary_only(rule: GateRule) -> GateRule:
    return dataclasses.replace(rule, guardrails={})


def _plan(cfg: GateBenchConfig) -> list[tuple[str, str, Scenario, GateRule]]:
    """Every (section, name, scenario, rule) the bench simulates, in table order."""
    rule, other = cfg.rule(), cfg.other_rule()
    plan = [("null", name, at_null(rule, _scenario(cfg, name, 0.0)), _primary_only(rule)) for name in NULL_SCENARIOS]
    plan += [("power", f"{DEMO_LIKE}, {pt:+d} pt", _scenario(cfg, DEMO_LIKE, pt / 100.0), _primary_only(rule))
             for pt in POWER_LIFTS_PT if pt > 0]
    if cfg.compare:
        plan += [(f"side by side: {other.test}", f"{DEMO_LIKE}, {pt:+d} pt",
                  at_null(other, _scenario(cfg, DEMO_LIKE, 0.0)) if pt == 0 else _scenario(cfg, DEMO_LIKE, pt / 100),
                  _primary_only(other)) for pt in COMPARE_LIFTS_PT]
    g = DEMO_GUARDS
    demo = functools.partial(_scenario, cfg, DEMO_LIKE)
    plan += [
        ("guardrails", "null, every guardrail at its margin", at_null(rule, demo(0.0, g)), rule),
        ("guardrails", "+10 pt, malformed +5 pt", demo(0.10, dataclasses.replace(g, malformed_shift=0.05)), rule),
        ("guardrails", "+10 pt, guardrails equal", demo(0.10, g), rule),
        ("guardrails", "+5 pt, guardrails equal", demo(0.05, g), rule),
        ("guardrails", "+10 pt, guardrails equal, the earlier demo's levels", demo(0.10, EARLIER_GUARDS), rule),
    ]
    plan += [("guardrails", f"+10 pt, only {name} ({margin:g})", demo(0.10, g),
              dataclasses.replace(rule, guardrails={name: margin}))
             for name, margin in sorted(rule.guardrails.items()) if name in ("errors", "malformed", "slow", "tokens")]
    plan += [("guardrails", f"+10 pt, guardrails equal, {size} a side", demo(0.10, g),
              dataclasses.replace(rule, max_sessions=size)) for size in PLANNED_SIZES if size > rule.max_sessions]
    plan += [("srm", name, demo(0.0, g, loss), rule) for name, loss in SRM_LOSSES.items()]
    plan += [("srm", "no loss (false alarms)", demo(0.0, g), rule)]
    return plan


def run_all(cfg: GateBenchConfig) -> list[Row]:
    from rich.console import Console
    from rich.progress import Progress

    rows = []
    with Progress(console=Console(stderr=True), transient=True) as progress:
        for section, name, scenario, rule in _plan(cfg):
            task = progress.add_task(f"{section}: {name}", total=cfg.challengers)
            result = simulate(rule, scenario, cfg.challengers, cfg.seed, functools.partial(progress.advance, task))
            rows.append(Row(section, name, scenario, result, rule))
    return rows


def cadences(cfg: GateBenchConfig) -> dict[str, float]:
    return {"demo": cfg.demo_cadence_s, "hourly": 3600.0, "every_5_min": 300.0}


def run_streams(cfg: GateBenchConfig) -> list[StreamResult]:
    """Null streams at each cadence and mode, then the mixed stream at the 5-minute cadence per mode."""
    from rich.console import Console
    from rich.progress import Progress

    rule = cfg.rule()
    null = _scenario(cfg, DEMO_LIKE, 0.0, DEMO_GUARDS)
    better = _scenario(cfg, DEMO_LIKE, 0.10, DEMO_GUARDS)
    out = []
    with Progress(console=Console(stderr=True), transient=True) as progress:
        runs: list[tuple[float, str, Scenario | None, float]] = [
            (cadence, mode, None, 0.0) for cadence in cadences(cfg).values()
            for mode in ("per-challenger", "lord", "daily")]
        runs += [(300.0, mode, better, MIXED_SHARE) for mode in ("per-challenger", "lord", "daily")]
        for cadence, mode, alt, share in runs:
            days = max(cfg.stream_days, min(200, cfg.challengers) * cadence / 86400.0)
            n = round(86400.0 / cadence * days)
            task = progress.add_task(f"stream: every {cadence:.0f} s, {mode}{', mixed' if alt else ''}", total=n)
            out.append(simulate_stream(rule, null, cadence, cfg.challenger_sessions_per_s, days, mode, alt, share,
                                       cfg.seed, functools.partial(progress.advance, task)))
    return out


def print_tables(rows: list[Row], streams: list[StreamResult], cfg: GateBenchConfig) -> None:
    from rich.console import Console
    from rich.table import Table

    rule = cfg.rule()
    console = Console(width=170)
    table = Table(title=f"promotion gate on simulated streams: {rule.test}"
                        f"{f' ({rule.looks} looks, {rule.spending} spending)' if rule.test == 'group-sequential' else ''}"
                        f", alpha {rule.alpha}, margin {rule.margin}, sessions {rule.min_sessions}-{rule.max_sessions}, "
                        f"guardrails {rule.guardrails}, srm_alpha {rule.srm_alpha}, {cfg.challenger_per_look} "
                        f"challenger sessions/look, champion ratio {cfg.champion_ratio}, {cfg.challengers} "
                        "challengers each")
    for col in ("section", "scenario", "champion rate", "lift (pt)", "promote ± se", "reject", "expire", "halt",
                "median sessions"):
        table.add_column(col, justify="left" if col in ("section", "scenario") else "right")
    for row in rows:
        r, s = row.result, row.scenario
        table.add_row(row.section, row.name, f"{s.overall_rate():.3f}", f"{s.lift * 100:+.0f}",
                      f"{r.promote_rate:.4f} ± {r.promote_se:.4f}", f"{r.reject_rate:.4f}", f"{r.expire_rate:.4f}",
                      f"{r.halt_rate:.4f}", f"{r.median_sessions:.0f}")
    console.print(table)
    st = Table(title=f"a stream of challengers ({cfg.challenger_sessions_per_s} challenger sessions/s): promotions "
                     "per day")
    for col in ("cadence", "mode", "stream", "challengers/day", "days", "promotions/day", "false promotions/day",
                "false share of promotions", "first alpha"):
        st.add_column(col, justify="left" if col in ("mode", "stream") else "right")
    for s in streams:
        st.add_row(f"{s.cadence_s:.0f} s", s.mode, "10% +10 pt" if s.true_challengers else "null",
                   f"{s.per_day:.0f}", f"{s.days:.1f}", f"{s.promoted / s.days:.3f}", f"{s.false_per_day:.3f}",
                   f"{s.fdr:.3f}", f"{s.levels[0]:.3g}")
    console.print(st)


def plot(rows: list[Row], cfg: GateBenchConfig, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display on a server
    import matplotlib.pyplot as plt

    power = [r for r in rows if r.section == "power"]
    other = [r for r in rows if r.section.startswith("side by side")]
    rule = cfg.rule()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    lifts = [r.scenario.lift * 100 for r in power]
    ax.errorbar(lifts, [r.result.promote_rate for r in power], yerr=[1.96 * r.result.promote_se for r in power],
                marker="o", capsize=3, label=f"{rule.test}, primary alone (95% sim. interval)")
    guarded = [r for r in rows if r.section == "guardrails" and r.name.endswith("guardrails equal")]
    ax.plot([r.scenario.lift * 100 for r in guarded], [r.result.promote_rate for r in guarded], marker="^",
            linestyle="", label="the whole rule, guardrails equal")
    if other:
        ax.plot([r.scenario.lift * 100 for r in other], [r.result.promote_rate for r in other], marker="s",
                linestyle="--", label=f"{cfg.other_rule().test}, same traffic")
    ax.axhline(rule.alpha, color="red", linestyle="--", label=f"alpha {rule.alpha}")
    ax.axhline(0.8, color="grey", linestyle=":", label="power 0.8")
    ax.set(xlabel="true lift (points of success)", ylabel="share of challengers promoted", ylim=(0, 1.02),
           title=f"power, {DEMO_LIKE} ({cfg.challengers} challengers per point)")
    ax.legend(loc="upper left", fontsize=7)
    ax2.plot(lifts, [r.result.median_sessions for r in power], marker="o")
    ax2.set(xlabel="true lift (points of success)", ylabel="challenger sessions",
            title=f"median sessions to a decision (max {rule.max_sessions})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _find(rows: list[Row], section: str, name: str) -> SimResult:
    return next(r.result for r in rows if r.section == section and r.name == name)


def summary(rows: list[Row], streams: list[StreamResult], cfg: GateBenchConfig, png: Path,
            seconds: float) -> dict[str, object]:
    rule = cfg.rule()
    n = cfg.challengers
    # "alpha + simulation error": two standard errors of a rate equal to alpha at this many challengers
    allowed = rule.alpha + 2.0 * binomial_se(rule.alpha, n)
    nulls = [r for r in rows if r.section == "null"]
    guarded_null = _find(rows, "guardrails", "null, every guardrail at its margin")
    worst = max(nulls, key=lambda r: r.result.promote_rate)
    worst_rate = max(worst.result.promote_rate, guarded_null.promote_rate)
    by_pt = {round(r.scenario.lift * 100): r.result for r in rows if r.section == "power"}
    breach = _find(rows, "guardrails", "+10 pt, malformed +5 pt")
    power10 = _find(rows, "guardrails", "+10 pt, guardrails equal")
    srm = _find(rows, "srm", "srm_10pt")
    out: dict[str, Any] = {
        "false_promotion_rate": worst_rate, "false_promotion_se": round(binomial_se(worst_rate, n), 5),
        "false_promotion_scenario": worst.name if worst.result.promote_rate >= guarded_null.promote_rate
        else "null, every guardrail at its margin",
        "false_promotion_rate_guardrails_at_margin": guarded_null.promote_rate,
        "false_promotion_allowed": round(allowed, 5), "false_promotion_ok": worst_rate <= allowed,
        "alpha": rule.alpha,
        "malformed_breach_promote_rate": breach.promote_rate, "malformed_breach_ok": breach.promote_rate <= rule.alpha,
        "power_10pt": power10.promote_rate, "power_10pt_se": round(power10.promote_se, 5),
        "power_10pt_ok": power10.promote_rate >= 0.8,
        "power_5pt": _find(rows, "guardrails", "+5 pt, guardrails equal").promote_rate,
        "power_10pt_earlier_levels": _find(rows, "guardrails",
                                           "+10 pt, guardrails equal, the earlier demo's levels").promote_rate,
        "power_10pt_primary_only": by_pt[10].promote_rate, "power_5pt_primary_only": by_pt[5].promote_rate,
        "power_10pt_each_guardrail_alone": {r.name.split("only ")[1].split(" ")[0]: r.result.promote_rate
                                            for r in rows if r.section == "guardrails" and " only " in r.name},
        "power_10pt_by_sessions_a_side": {str(rule.max_sessions): power10.promote_rate,
                                          **{r.name.rsplit(", ", 1)[1].split(" ")[0]: r.result.promote_rate
                                             for r in rows if r.name.endswith(" a side")}},
        "median_sessions_to_decision": power10.median_sessions,
        "false_rejection_10pt": power10.reject_rate,
        "srm_detected_before_last_look": srm.halted_before_last_look / n,
        "srm_ok": srm.halted_before_last_look / n >= 0.9,
        "srm_loss_10pct_detected_before_last_look": _find(rows, "srm", "srm_loss_10pct").halted_before_last_look / n,
        "srm_false_alarm_rate": _find(rows, "srm", "no loss (false alarms)").halt_rate,
        "challengers": n, "seed": cfg.seed, "tau": rule.tau, "margin": rule.margin,
        "min_sessions": rule.min_sessions, "max_sessions": rule.max_sessions, "guardrails": rule.guardrails,
        "srm_alpha": rule.srm_alpha, "challenger_per_look": cfg.challenger_per_look,
        "champion_ratio": cfg.champion_ratio, "test": rule.test, "looks": rule.looks, "spending": rule.spending,
        "plot": str(png), "seconds": round(seconds, 1),
    }
    names = {v: k for k, v in cadences(cfg).items()}
    for s in streams:
        key = f"{names.get(s.cadence_s, int(s.cadence_s))}_{s.mode.replace('-', '_')}"
        if s.true_challengers:
            out[f"mixed_{key}"] = {"promotions_per_day": round(s.promoted / s.days, 3),
                                   "false_per_day": round(s.false_per_day, 3), "fdr": round(s.fdr, 4)}
        else:
            out[f"false_promotions_per_day_{key}"] = round(s.false_per_day, 4)
    other = [r for r in rows if r.section.startswith("side by side")]
    if other:
        name = cfg.other_rule().test.replace("-", "_")
        by = {round(r.scenario.lift * 100): r.result for r in other}
        out.update({f"{name}_false_promotion_rate": by[0].promote_rate, f"{name}_power_5pt": by[5].promote_rate,
                    f"{name}_power_10pt": by[10].promote_rate,
                    f"power_10pt_ratio_over_{name}": round(by_pt[10].promote_rate / max(by[10].promote_rate, 1e-9),
                                                           3)})
    return out


def main(argv: list[str] | None = None) -> int:
    cfg = load_config(GateBenchConfig, argv, "flywheel bench gate")
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_resolved(cfg, out / "config.toml")
    t0 = time.perf_counter()
    rows = run_all(cfg)
    streams = run_streams(cfg)
    seconds = time.perf_counter() - t0
    print_tables(rows, streams, cfg)
    png = plot(rows, cfg, out / "power_vs_lift.png")
    print(json.dumps(summary(rows, streams, cfg, png, seconds)))
    return 0
