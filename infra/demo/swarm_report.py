"""The swarm scenario's part of the demo report (`flywheel demo --scenario swarm`; docs/swarm.md).

Per served version: the share of multi-part sessions the policy parallelised (spawned sub-agents), mean
critical steps of multi-part sessions, spurious spawns (sub-agents whose task was empty, repeated a
sibling's, or had no part to answer), context edits per long session and success after an edit. The
final window's champion against the concurrent control (the same sessions, the same measure the base
report uses): parallel share with a one-sided two-proportion p-value, critical steps with a 95% interval,
success with Wilson intervals. The shaping lambdas come from the learner's trained.jsonl (the shaping
weight each step trained with, and when), drawn on the same time axis as the per-version figures.

Facts come from the agent's hand-off lines (what each session did: the swarm fields of infra/demo/swarm.py's
handoff_record) joined on session_id with the lake's sessions (version and arm, serving.sessions).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flywheel.demo import swarm, tasks

log = logging.getLogger(__name__)


@dataclass
class SwarmSessionStats:
    """One swarm session as the report counts it."""

    kind: str
    version: int | None
    arm: str | None
    started: float
    success: bool
    spawned: int
    spurious: int
    critical_steps: int
    edits: int
    parts: float = 0.0  # the share of its parts answered right (swarm.parts_correct; runs c-i gated on it)
    n_parts: int = 0


@dataclass
class Group:
    """Counts of a set of sessions (one version, or one arm in the final window)."""

    multi: list[SwarmSessionStats] = field(default_factory=list)
    long: list[SwarmSessionStats] = field(default_factory=list)

    def add(self, s: SwarmSessionStats) -> None:
        (self.multi if s.kind == "multi" else self.long).append(s)

    @property
    def parallel(self) -> int:
        return sum(s.spawned > 0 for s in self.multi)

    def row(self) -> dict[str, Any]:
        m, lg = self.multi, self.long
        edited = [s for s in lg if s.edits]
        both = m + lg
        return {"multi_sessions": len(m), "parallel_share": _share(self.parallel, len(m)),
                "success_multi": _share(sum(s.success for s in m), len(m)),
                "critical_steps_mean": _mean([s.critical_steps for s in m]),
                "spurious_spawns": sum(s.spurious for s in m),
                "long_sessions": len(lg), "edits_per_session": _mean([s.edits for s in lg]),
                "success_after_edit": _share(sum(s.success for s in edited), len(edited)), "n_after_edit": len(edited),
                "success": _share(sum(s.success for s in both), len(both)), "sessions": len(both),
                "parts_correct": _mean([s.parts for s in both]),
                "first_started": min((s.started for s in both), default=None)}


def _share(k: int, n: int) -> float | None:
    return round(k / n, 4) if n else None


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 3) if values else None


def mean_ci(values: list[float]) -> tuple[float, float] | None:
    """95% normal interval of a mean (None for fewer than two values)."""
    if len(values) < 2:
        return None
    m = sum(values) / len(values)
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))
    half = 1.96 * sd / math.sqrt(len(values))
    return round(m - half, 3), round(m + half, 3)


def spurious(record: dict[str, Any]) -> int:
    """Sub-agents of a session that were spurious: an empty task, a repeat of a sibling's, or one past the parts."""
    texts = [" ".join(str(t).lower().split()) for t in record.get("spawn_tasks") or []]
    seen: set[str] = set()
    n = 0
    for t in texts:
        n += int(not t or t in seen)
        seen.add(t)
    return n + max(0, len(texts) - len(record["task"]["parts"]))


def sessions_of(handoff: Path, lake_root: str) -> list[SwarmSessionStats]:
    """The swarm sessions of the hand-off file, each with the version and arm the lake says served it."""
    from flywheel.serving.sessions import read_sessions

    served = {r.session_id: r for r in read_sessions(lake_root)}
    out = []
    for line in handoff.read_text().splitlines() if handoff.exists() else []:
        try:
            rec = json.loads(line)
            if rec.get("scenario") != "swarm":
                continue
            spec = tasks.TaskSpec.from_json(rec["task"])
            ok = tasks.check(spec, [a if isinstance(a, str) else None for a in rec.get("answers") or []])
            parts = (swarm.parts_correct(rec) or (0.0, {}))[0]
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("swarm report: hand-off line skipped (%s)", exc)
            continue
        r = served.get(rec["session_id"])
        out.append(SwarmSessionStats(rec.get("kind", "multi"), r.version if r else None, r.arm if r else None,
                                r.started if r else float(rec.get("ended") or 0.0), ok, int(rec.get("spawned") or 0),
                                spurious(rec), int(rec.get("critical_steps") or 0), len(rec.get("edits") or []), parts,
                                len(spec.parts)))
    return out


def shaping_curve(learner_dir: Path, lambda1: float, lambda2: float) -> list[dict[str, float]]:
    """[{"t", "step", "lambda1", "lambda2"}] per learner step, from trained.jsonl's shaping_scale."""
    path = learner_dir / "trained.jsonl"
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a torn last line
        if "shaping_scale" in rec and "t" in rec:
            scale = float(rec["shaping_scale"])
            out.append({"t": float(rec["t"]), "step": int(rec["step"]), "lambda1": lambda1 * scale,
                        "lambda2": lambda2 * scale})
    return out


def zero_from(curve: list[dict[str, float]], start: float) -> float | None:
    """Minutes from `start` after which every step trained with both lambdas exactly 0 (None: never)."""
    last_on = max((c["t"] for c in curve if c["lambda1"] != 0.0 or c["lambda2"] != 0.0), default=None)
    after = [c["t"] for c in curve
             if c["lambda1"] == 0.0 and c["lambda2"] == 0.0 and (last_on is None or c["t"] > last_on)]
    return round((min(after) - start) / 60.0, 2) if after else None


def compare(sessions: list[SwarmSessionStats], since: float | None, champion: int | None,
            control_version: int = 0) -> dict[str, Any]:
    """The final window: the champion against the concurrent control (the summary.json keys of issue 23)."""
    from flywheel.serving.stats import p_better, wilson

    keys = ("parallel_share_control", "parallel_share_champion", "p_value_parallel", "critical_steps_control",
            "critical_steps_champion", "critical_steps_ci_control", "critical_steps_ci_champion", "success_control",
            "success_champion", "success_ci_control", "success_ci_champion", "n_multi_control", "n_multi_champion",
            "n_swarm_control", "n_swarm_champion", "parts_correct_control", "parts_correct_champion",
            "parts_correct_ci_control", "parts_correct_ci_champion", "success_multi_control", "success_multi_champion",
            "success_multi_ci_control", "success_multi_ci_champion", "p_value_success_multi",
            "critical_steps_3_control", "critical_steps_3_champion", "critical_steps_3_ci_control",
            "critical_steps_3_ci_champion", "n_three_part_control", "n_three_part_champion")
    out: dict[str, Any] = dict.fromkeys(keys)
    if since is None or champion is None:
        return out
    window = [s for s in sessions if s.started >= since]
    ctrl = [s for s in window if s.arm == "control" and s.version == control_version]
    champ = [s for s in window if s.arm == "champion" and s.version == champion]
    for name, side in (("control", ctrl), ("champion", champ)):
        multi = [s for s in side if s.kind == "multi"]
        out[f"parallel_share_{name}"] = _share(sum(s.spawned > 0 for s in multi), len(multi))
        out[f"critical_steps_{name}"] = _mean([s.critical_steps for s in multi])
        out[f"critical_steps_ci_{name}"] = mean_ci([s.critical_steps for s in multi])
        out[f"success_{name}"] = _share(sum(s.success for s in side), len(side))
        out[f"success_ci_{name}"] = ([round(x, 4) for x in wilson(sum(s.success for s in side), len(side))]
                                     if side else None)
        out[f"n_multi_{name}"], out[f"n_swarm_{name}"] = len(multi), len(side)
        out[f"parts_correct_{name}"] = _mean([s.parts for s in side])
        out[f"parts_correct_ci_{name}"] = mean_ci([s.parts for s in side])
        out[f"success_multi_{name}"] = _share(sum(s.success for s in multi), len(multi))
        out[f"success_multi_ci_{name}"] = ([round(x, 4) for x in wilson(sum(s.success for s in multi), len(multi))]
                                           if multi else None)
        three = [float(s.critical_steps) for s in multi if s.n_parts == 3]
        out[f"critical_steps_3_{name}"], out[f"critical_steps_3_ci_{name}"] = _mean(three), mean_ci(three)
        out[f"n_three_part_{name}"] = len(three)
    c_multi = [s for s in ctrl if s.kind == "multi"]
    h_multi = [s for s in champ if s.kind == "multi"]
    out["p_value_parallel"] = p_better(sum(s.spawned > 0 for s in c_multi), len(c_multi),
                                       sum(s.spawned > 0 for s in h_multi), len(h_multi))
    out["p_value_success_multi"] = p_better(sum(s.success for s in c_multi), len(c_multi),
                                            sum(s.success for s in h_multi), len(h_multi))
    return out


def after_shaping(sessions: list[SwarmSessionStats], zero_at: float | None, control_version: int = 0) -> dict[str, Any]:
    """Spawn share of the multi-part sessions that started once the shaping was exactly 0 (zero_at, epoch seconds),
    the champion arm (whichever version held it) against the concurrent control: what the outcome alone kept."""
    from flywheel.serving.stats import p_better

    keys = ("parallel_share_after_shaping_control", "parallel_share_after_shaping_champion",
            "n_multi_after_shaping_control", "n_multi_after_shaping_champion", "p_value_parallel_after_shaping")
    out: dict[str, Any] = dict.fromkeys(keys)
    if zero_at is None:
        return out
    late = [s for s in sessions if s.kind == "multi" and s.started >= zero_at]
    ctrl = [s for s in late if s.arm == "control" and s.version == control_version]
    champ = [s for s in late if s.arm == "champion"]
    for name, side in (("control", ctrl), ("champion", champ)):
        out[f"parallel_share_after_shaping_{name}"] = _share(sum(s.spawned > 0 for s in side), len(side))
        out[f"n_multi_after_shaping_{name}"] = len(side)
    out["p_value_parallel_after_shaping"] = p_better(sum(s.spawned > 0 for s in ctrl), len(ctrl),
                                                     sum(s.spawned > 0 for s in champ), len(champ))
    return out


def plot(per_version: dict[int, dict[str, Any]], curve: list[dict[str, float]], start: float, out: Path) -> str | None:
    """swarm_by_version.png: the per-version figures at each version's first session,
    lambdas on the same minutes axis."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("swarm report: matplotlib missing; no plot")
        return None
    fig, axes = plt.subplots(5, 1, figsize=(8, 12), sharex=True)
    pts = sorted((v, r) for v, r in per_version.items() if r["first_started"] is not None)
    x = [(r["first_started"] - start) / 60.0 for _, r in pts]
    for ax, key, label in ((axes[0], "parallel_share", "multi-part sessions parallelised"),
                           (axes[1], "success_multi", "multi-part sessions solved"),
                           (axes[2], "critical_steps_mean", "critical steps (multi-part)"),
                           (axes[3], "edits_per_session", "context edits per long session")):
        ax.plot(x, [r[key] if r[key] is not None else float("nan") for _, r in pts], "o-")
        for xi, (v, _) in zip(x, pts):
            ax.annotate(f"v{v}", (xi, 0), textcoords="offset points", xytext=(0, 2), fontsize=7)
        ax.set_ylabel(label, fontsize=8)
    axes[4].plot([(c["t"] - start) / 60.0 for c in curve], [c["lambda1"] for c in curve], label="lambda1 (r_parallel)")
    axes[4].plot([(c["t"] - start) / 60.0 for c in curve], [c["lambda2"] for c in curve], "--",
                 label="lambda2 (r_finish)")
    axes[4].set_ylabel("shaping lambdas", fontsize=8)
    axes[4].set_xlabel("minutes of traffic (a version's point: its first session)")
    axes[4].legend(fontsize=7)
    fig.tight_layout()
    name = "swarm_by_version.png"
    fig.savefig(out / name, dpi=90)
    plt.close(fig)
    return name


def markdown(s: dict[str, Any], per_version: dict[int, dict[str, Any]], image: str | None) -> str:
    lines = ["", "## Swarm: spawn, summarize, prune as the policy's actions", "",
             "| version | multi-part | parallelised | multi-part solved | critical steps | spurious spawns | long | "
             "edits/session | success after an edit | success | parts right |", "|---" * 11 + "|"]
    for v, r in sorted(per_version.items()):
        lines.append(f"| v{v} | {r['multi_sessions']} | {r['parallel_share']} | {r.get('success_multi')} | "
                     f"{r['critical_steps_mean']} | "
                     f"{r['spurious_spawns']} | {r['long_sessions']} | {r['edits_per_session']} | "
                     f"{r['success_after_edit']} (n={r['n_after_edit']}) | {r['success']} | {r.get('parts_correct')} |")
    lines += ["", "Final window, champion against the concurrent control:", "",
              f"- parallelised multi-part sessions: control {s['parallel_share_control']} (n={s['n_multi_control']}), "
              f"champion {s['parallel_share_champion']} (n={s['n_multi_champion']}), one-sided p = "
              f"{s['p_value_parallel']}",
              f"- critical steps per multi-part session: control {s['critical_steps_control']} "
              f"{s['critical_steps_ci_control']}, champion {s['critical_steps_champion']} "
              f"{s['critical_steps_ci_champion']} (95% intervals)",
              f"- critical steps per three-part session: control {s.get('critical_steps_3_control')} "
              f"(n={s.get('n_three_part_control')}), champion {s.get('critical_steps_3_champion')} "
              f"(n={s.get('n_three_part_champion')})",
              f"- multi-part sessions solved: control {s.get('success_multi_control')} "
              f"{s.get('success_multi_ci_control')}, champion {s.get('success_multi_champion')} "
              f"{s.get('success_multi_ci_champion')} (Wilson 95%), one-sided p = {s.get('p_value_success_multi')}",
              f"- success, every swarm session (what the gate compares): control {s['success_control']} "
              f"{s['success_ci_control']}, champion {s['success_champion']} {s['success_ci_champion']} (Wilson 95%)",
              f"- parallelised multi-part sessions once the shaping was 0: control "
              f"{s.get('parallel_share_after_shaping_control')} (n={s.get('n_multi_after_shaping_control')}), champion "
              f"arm {s.get('parallel_share_after_shaping_champion')} (n={s.get('n_multi_after_shaping_champion')}), "
              f"one-sided p = {s.get('p_value_parallel_after_shaping')}",
              f"- share of parts right: control {s.get('parts_correct_control')} "
              f"{s.get('parts_correct_ci_control')}, champion {s.get('parts_correct_champion')} "
              f"{s.get('parts_correct_ci_champion')} (95% intervals)",
              f"- shaping lambdas exactly 0 from minute {s['shaping_zero_from_min']} of traffic"]
    if image:
        lines += ["", f"![swarm by version]({image})"]
    return "\n".join(lines) + "\n"


def write_for_run(out_dir: Path, plan: Any, summary: dict[str, Any],
                  traffic_start: float | None = None) -> dict[str, Any]:
    """write() for one demo run (its RunPlan says where the hand-off, lake and learner are); the lambdas are
    swarm_rewards.toml's. traffic_start None (`flywheel report --run-dir`): the run's first session."""
    from flywheel.demo.plan import SWARM_REWARDS
    from flywheel.rewards.config import load

    parl = load(SWARM_REWARDS).parl
    return write(Path(out_dir), plan.handoff, str(plan.lake_root), plan.learner_dir, (parl.lambda1, parl.lambda2),
                 traffic_start, summary)


def write(out_dir: Path, handoff: Path, lake_root: str, learner_dir: Path, lambdas: tuple[float, float],
          traffic_start: float | None, summary: dict[str, Any]) -> dict[str, Any]:
    """Add the swarm section to report.md and its keys to summary.json (both already written by report.py)."""
    sessions = sessions_of(handoff, lake_root)
    if traffic_start is None:
        traffic_start = min((s.started for s in sessions), default=0.0)
    groups: dict[int, Group] = {}
    for s in sessions:
        if s.version is not None:
            groups.setdefault(s.version, Group()).add(s)
    per_version = {v: g.row() for v, g in groups.items()}
    curve = shaping_curve(learner_dir, *lambdas)
    extra = compare(sessions, summary.get("final_window_start"), summary.get("champion_version"),
                    summary.get("control_version", 0))
    zero_min = zero_from(curve, traffic_start)
    extra.update(after_shaping(sessions, None if zero_min is None else traffic_start + 60.0 * zero_min,
                               summary.get("control_version", 0)))
    extra.update({"shaping_zero_from_min": zero_min, "swarm_sessions": len(sessions),
                  "swarm_by_version": {str(v): r for v, r in sorted(per_version.items())}})
    image = plot(per_version, curve, traffic_start, out_dir)
    summary = summary | extra
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    with open(out_dir / "report.md", "a") as fh:
        fh.write(markdown(summary, per_version, image))
    return summary
