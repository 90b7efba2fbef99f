"""`flywheel bench gate`: the promotion gate's false-promotion rate under the null and its power under a
true lift, measured on simulated session streams fed to the gate's own decision code.

    flywheel bench gate [--challengers 2000] [--seed 0] [--test group-sequential --looks 3 --spending obf]
                        [--alpha 0.05 --tau 0.1 --margin 0.0 --min-sessions 30 --max-sessions 240
                         --challenger-per-look 15 --champion-ratio 1.0] [--no-compare] [--out-dir var/bench/gate]

flywheel.serving.gate_sim runs each simulated challenger look by look through
flywheel.serving.decision.decide, the function `flywheel promote` calls, until it promotes,
rejects or expires. Under the null (the challenger exactly `margin` worse than the champion)
at several base rates and task mixes the promote rate is the false-promotion rate, which the
test bounds by alpha (the mSPRT at every look, the group-sequential test over its planned
looks); the worst scenario is reported. Under true lifts on the demo-like mix the promote rate
is the power. With --compare (the default) the other test runs at the same traffic and seed on
the demo-like mix, side by side, and the summary gives the power ratio. The defaults are the
demo's rule and traffic, fixed in advance: they are what is measured, not tuned to what is measured.

Prints a table, writes power_vs_lift.png and the resolved config.toml under --out-dir, and
prints as its last line one JSON object. Pure CPU, a few minutes at 2,000 challengers.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from dataclasses import dataclass
from pathlib import Path

from flywheel.base import defaults
from flywheel.base.config import ConfigError, load_config, setting, write_resolved
from flywheel.serving.decision import GateRule
from flywheel.serving.gate_sim import (
    Scenario,
    SimResult,
    at_null,
    binomial_se,
    simulate,
)


@dataclass
class GateBenchConfig:
    """The promotion gate's error rates on simulated session streams."""

    challengers: int = setting(2000, "simulated challengers per scenario")
    seed: int = setting(0, "random seed (the same for every scenario: common random numbers smooth the power curve)")
    alpha: float = setting(0.05, "the gate's alpha (the demo's rule)")
    tau: float = setting(0.1, "the mSPRT's mixture scale (the demo's rule)")
    margin: float = setting(0.0, "non-inferiority margin (the demo's rule)")
    min_sessions: int = setting(30, "sessions each side needs before the first look (the demo's rule)")
    max_sessions: int = setting(240, "challenger sessions after which an undecided challenger expires; group-sequential: "
                                     "the last look's sessions a side (the demo's rule)")
    test: str = setting("group-sequential", "the promotion test, msprt or group-sequential (the demo's rule)")
    looks: int = setting(3, "group-sequential: planned looks (the demo's rule)")
    spending: str = setting("obf", "group-sequential: alpha-spending function, obf or pocock (the demo's rule)")
    compare: bool = setting(True, "also run the other test (msprt <-> group-sequential) at the same traffic on the "
                                  "demo-like null and at +5 and +10 points, side by side")
    challenger_per_look: int = setting(15, "challenger sessions that mature between two looks (the demo's traffic)")
    champion_ratio: float = setting(1.0, "champion sessions per challenger session (the demo's traffic)")
    out_dir: str = setting(f"{defaults.VAR_DIR}/bench/gate", "where the plot and the resolved config go")

    def rule(self) -> GateRule:
        return GateRule(alpha=self.alpha, tau=self.tau, margin=self.margin, min_sessions=self.min_sessions,
                        max_sessions=self.max_sessions, test=self.test, looks=self.looks, spending=self.spending)

    def other_rule(self) -> GateRule:
        """The same rule with the other test: the side-by-side comparison."""
        other = "msprt" if self.test == "group-sequential" else "group-sequential"
        return dataclasses.replace(self.rule(), test=other)

    def check(self) -> None:
        if self.challengers < 1:
            raise ConfigError(f"challengers: {self.challengers} must be >= 1")
        if self.challenger_per_look < 1 or self.champion_ratio <= 0:
            raise ConfigError(f"challenger_per_look ({self.challenger_per_look}) must be >= 1 and champion_ratio "
                              f"({self.champion_ratio}) > 0")
        self.rule().check_rule()


# The demo's four task types at its mix (a third each of add/mul/weather, multi_share 0.1) at
# success rates like the warm start's, plus a rare fifth type (5%): a stratum that stays below
# two sessions a side for the first looks, which the stratified estimate must leave out, not break on.
DEMO_LIKE = "demo-like, 5 types"
DEMO_RATES = {"tool_use.add": 0.10, "tool_use.mul": 0.03, "tool_use.weather": 0.50, "tool_use.multi": 0.05,
              "tool_use.rare": 0.25}
DEMO_MIX = {"tool_use.add": 0.285, "tool_use.mul": 0.285, "tool_use.weather": 0.285, "tool_use.multi": 0.095,
            "tool_use.rare": 0.05}
NULL_SCENARIOS: dict[str, tuple[dict[str, float], dict[str, float]]] = {
    "one type, 0.10": ({"t": 0.10}, {"t": 1.0}),
    "one type, 0.25": ({"t": 0.25}, {"t": 1.0}),
    "one type, 0.50": ({"t": 0.50}, {"t": 1.0}),
    "two types 0.1/0.4, 50/50": ({"easy": 0.4, "hard": 0.1}, {"easy": 0.5, "hard": 0.5}),
    "two types 0.1/0.4, 20/80": ({"easy": 0.4, "hard": 0.1}, {"easy": 0.2, "hard": 0.8}),
    DEMO_LIKE: (DEMO_RATES, DEMO_MIX),
}
POWER_LIFTS_PT = [0, 2, 5, 7, 10, 15]  # points of success added to the challenger, on the demo-like mix


@dataclass(frozen=True)
class Row:
    name: str
    scenario: Scenario
    result: SimResult


def _scenario(cfg: GateBenchConfig, name: str, lift: float) -> Scenario:
    rates, mix = NULL_SCENARIOS[name]
    return Scenario(rates=rates, mix=mix, lift=lift, challenger_per_look=cfg.challenger_per_look,
                    champion_ratio=cfg.champion_ratio)


def run_all(cfg: GateBenchConfig) -> tuple[list[Row], list[Row]]:
    """(null rows, power rows on the demo-like mix); a (scenario, lift) is simulated once."""
    from rich.console import Console
    from rich.progress import Progress

    rule = cfg.rule()
    wanted = [(name, at_null(rule, _scenario(cfg, name, 0.0)).lift) for name in NULL_SCENARIOS]
    wanted += [(DEMO_LIKE, pt / 100.0) for pt in POWER_LIFTS_PT]
    done: dict[tuple[str, float], Row] = {}
    with Progress(console=Console(stderr=True), transient=True) as progress:
        for name, lift in wanted:
            if (name, lift) in done:  # margin 0: the demo-like null is the power curve's lift 0
                continue
            task = progress.add_task(f"{name}, lift {lift * 100:+.0f} pt", total=cfg.challengers)
            scenario = _scenario(cfg, name, lift)
            result = simulate(rule, scenario, cfg.challengers, cfg.seed, functools.partial(progress.advance, task))
            done[(name, lift)] = Row(name, scenario, result)
    n_null = len(NULL_SCENARIOS)
    return [done[k] for k in wanted[:n_null]], [done[k] for k in wanted[n_null:]]


COMPARE_LIFTS_PT = [0, 5, 10]  # the other test, demo-like mix: its null, and the two powers the summary names


def run_other(cfg: GateBenchConfig) -> list[Row]:
    """The other test on the demo-like mix at COMPARE_LIFTS_PT, same traffic and seed (common random numbers)."""
    from rich.console import Console
    from rich.progress import Progress

    rule = cfg.other_rule()
    rows = []
    with Progress(console=Console(stderr=True), transient=True) as progress:
        for pt in COMPARE_LIFTS_PT:
            task = progress.add_task(f"{rule.test}: {DEMO_LIKE}, lift {pt:+d} pt", total=cfg.challengers)
            scenario = at_null(rule, _scenario(cfg, DEMO_LIKE, 0.0)) if pt == 0 else _scenario(cfg, DEMO_LIKE, pt / 100.0)
            rows.append(Row(f"{rule.test}: {DEMO_LIKE}", scenario,
                            simulate(rule, scenario, cfg.challengers, cfg.seed, functools.partial(progress.advance, task))))
    return rows


def print_table(null: list[Row], power: list[Row], cfg: GateBenchConfig, other: list[Row] | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"promotion gate on simulated streams: {cfg.test}"
                        f"{f' ({cfg.looks} looks, {cfg.spending} spending)' if cfg.test == 'group-sequential' else ''}, "
                        f"alpha {cfg.alpha}, tau {cfg.tau}, margin {cfg.margin}, "
                        f"sessions {cfg.min_sessions}-{cfg.max_sessions}, {cfg.challenger_per_look} challenger "
                        f"sessions/look, champion ratio {cfg.champion_ratio}, {cfg.challengers} challengers each")
    for col in ("test", "scenario", "champion rate", "lift (pt)", "promote ± se", "reject", "expire",
                "median sessions"):
        table.add_column(col, justify="left" if col in ("test", "scenario") else "right")
    sections = [("null", null), ("power", [r for r in power if r.scenario.lift > 0])]
    if other:
        sections.append((f"side by side: {other[0].name.split(':')[0]}", other))
    for test, rows in sections:
        for row in rows:
            r, s = row.result, row.scenario
            table.add_row(test, row.name, f"{s.overall_rate():.3f}", f"{s.lift * 100:+.0f}",
                          f"{r.promote_rate:.4f} ± {r.promote_se:.4f}", f"{r.reject_rate:.4f}", f"{r.expire_rate:.4f}",
                          f"{r.median_sessions:.0f}")
    Console(width=160).print(table)


def plot(power: list[Row], cfg: GateBenchConfig, path: Path, other: list[Row] | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display on a server
    import matplotlib.pyplot as plt

    lifts = [r.scenario.lift * 100 for r in power]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax.errorbar(lifts, [r.result.promote_rate for r in power], yerr=[1.96 * r.result.promote_se for r in power],
                marker="o", capsize=3, label=f"{cfg.test}: promote rate (95% sim. interval)")
    if other:
        ax.plot([r.scenario.lift * 100 for r in other], [r.result.promote_rate for r in other], marker="s",
                linestyle="--", label=f"{cfg.other_rule().test}, same traffic")
    ax.axhline(cfg.alpha, color="red", linestyle="--", label=f"alpha {cfg.alpha}")
    ax.axhline(0.8, color="grey", linestyle=":", label="power 0.8")
    ax.set(xlabel="true lift (points of success)", ylabel="share of challengers promoted", ylim=(0, 1.02),
           title=f"power, {DEMO_LIKE} ({cfg.challengers} challengers per point)")
    ax.legend(loc="lower right", fontsize=8)
    ax2.plot(lifts, [r.result.median_sessions for r in power], marker="o")
    ax2.set(xlabel="true lift (points of success)", ylabel="challenger sessions",
            title=f"median sessions to a decision (max {cfg.max_sessions})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def summary(null: list[Row], power: list[Row], cfg: GateBenchConfig, png: Path, seconds: float,
            other: list[Row] | None = None) -> dict[str, object]:
    worst = max(null, key=lambda r: r.result.promote_rate)
    by_pt = {round(r.scenario.lift * 100): r.result for r in power}
    n = cfg.challengers
    # "alpha + simulation error": two standard errors of a rate equal to alpha at this many challengers
    allowed = cfg.alpha + 2.0 * binomial_se(cfg.alpha, n)
    out: dict[str, object] = {
        "false_promotion_rate": worst.result.promote_rate, "false_promotion_se": round(worst.result.promote_se, 5),
        "false_promotion_scenario": worst.name, "false_promotion_allowed": round(allowed, 5),
        "false_promotion_ok": worst.result.promote_rate <= allowed, "alpha": cfg.alpha,
        "power_5pt": by_pt[5].promote_rate, "power_5pt_se": round(by_pt[5].promote_se, 5),
        "power_10pt": by_pt[10].promote_rate, "power_10pt_se": round(by_pt[10].promote_se, 5),
        "power_10pt_ok": by_pt[10].promote_rate >= 0.8,
        "median_sessions_to_decision": by_pt[10].median_sessions, "median_sessions_5pt": by_pt[5].median_sessions,
        "false_rejection_10pt": by_pt[10].reject_rate, "challengers": n, "seed": cfg.seed, "tau": cfg.tau,
        "margin": cfg.margin, "min_sessions": cfg.min_sessions, "max_sessions": cfg.max_sessions,
        "challenger_per_look": cfg.challenger_per_look, "champion_ratio": cfg.champion_ratio,
        "test": cfg.test, "looks": cfg.looks, "spending": cfg.spending,
        "plot": str(png), "seconds": round(seconds, 1),
    }
    if other:
        # the other test side by side: its null rate and powers, and this test's power over it at +5 and +10
        name = cfg.other_rule().test.replace("-", "_")
        by = {round(r.scenario.lift * 100): r.result for r in other}
        out.update({f"{name}_false_promotion_rate": by[0].promote_rate, f"{name}_power_5pt": by[5].promote_rate,
                    f"{name}_power_10pt": by[10].promote_rate,
                    f"{name}_median_sessions_to_decision": by[10].median_sessions,
                    f"power_5pt_ratio_over_{name}": round(by_pt[5].promote_rate / max(by[5].promote_rate, 1e-9), 3),
                    f"power_10pt_ratio_over_{name}": round(by_pt[10].promote_rate / max(by[10].promote_rate, 1e-9), 3)})
    return out


def main(argv: list[str] | None = None) -> int:
    cfg = load_config(GateBenchConfig, argv, "flywheel bench gate")
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_resolved(cfg, out / "config.toml")
    t0 = time.perf_counter()
    null, power = run_all(cfg)
    other = run_other(cfg) if cfg.compare else None
    seconds = time.perf_counter() - t0
    print_table(null, power, cfg, other)
    png = plot(power, cfg, out / "power_vs_lift.png", other)
    print(json.dumps(summary(null, power, cfg, png, seconds, other)))
    return 0

