"""The demo report: what the online loop achieved, computed from the lake and the registry, never typed in.

    flywheel demo ... (writes it at the end)      or      python -m infra.report --lake-root var/lake

Inputs: the lake's events (sessions, their llm_calls' policy versions, session ends), outcomes
(the verifier's task_success) and episodes; the learner's trained-episode log and the policy
version directories; the MLflow registry (published versions, gate decisions). Outputs under
`out_dir` (default var/report): report.md, success_by_version.png, freshness.png,
throughput.png and summary.json.

A session counts for the version that served ALL its llm_calls (a session that straddles a
weight push is counted apart as mixed). Success is the verifier's task_success. The champion
is the registry's `champion` alias at the end of the run; the test is a one-sided
two-proportion z-test of champion > base.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flywheel.base.versions import version_name
from flywheel.serving.stats import p_better, wilson

log = logging.getLogger(__name__)


def p95(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]


@dataclass
class VersionStats:
    version: int
    sessions: int = 0
    successes: int = 0

    @property
    def rate(self) -> float:
        return self.successes / self.sessions if self.sessions else 0.0


@dataclass
class Facts:
    """Everything the report states, gathered from the lake, the learner and the registry."""

    by_version: dict[int, VersionStats] = field(default_factory=dict)
    mixed_sessions: int = 0
    sessions_total: int = 0
    session_to_lake_s: list[float] = field(default_factory=list)
    outcome_to_episode_s: list[float] = field(default_factory=list)
    episode_to_trained_s: list[float] = field(default_factory=list)
    trained_to_served_s: list[float] = field(default_factory=list)
    session_end_times: list[float] = field(default_factory=list)  # epoch seconds
    versions_published: list[int] = field(default_factory=list)
    promotions: list[int] = field(default_factory=list)
    champion: int | None = None
    episodes: int = 0


# ---------------------------------------------------------------------------------------------
# gathering
# ---------------------------------------------------------------------------------------------
def _glob(root: str, table: str) -> str | None:
    base = Path(root) / table
    return str(base / "**" / "*.parquet") if any(base.rglob("*.parquet")) else None


def _epoch(value: Any) -> float:
    if isinstance(value, dt.datetime):
        return value.timestamp() if value.tzinfo else value.replace(tzinfo=dt.timezone.utc).timestamp()
    return float(value)


def lake_facts(lake_root: str, since: float = 0.0) -> Facts:
    """Per-version success and freshness from the lake's events, outcomes and episodes (sessions ending after `since`)."""
    import duckdb

    facts = Facts()
    con = duckdb.connect()
    con.execute("SET TimeZone='UTC'")
    events = _glob(lake_root, "events")
    outcomes = _glob(lake_root, "outcomes")
    if events is None:
        return facts
    src = f"read_parquet('{events}', hive_partitioning=true, union_by_name=true, filename=true)"
    con.execute(f"CREATE VIEW ev AS SELECT * FROM {src}")
    ends = con.execute(
        "SELECT session_id, min(ts) AS end_ts, min(filename) AS file FROM ev WHERE type='session_end' AND status='ok' "
        "AND epoch(ts) >= ? GROUP BY session_id", [since]).fetchall()
    mtimes: dict[str, float] = {}
    for session_id, end_ts, file in ends:
        if file not in mtimes:
            mtimes[file] = os.path.getmtime(file) if os.path.exists(file) else float("nan")
        end = _epoch(end_ts)
        facts.session_end_times.append(end)
        if not math.isnan(mtimes[file]):
            # visible in the lake = the moment its file was published (atomic rename)
            facts.session_to_lake_s.append(max(0.0, mtimes[file] - end))
    facts.sessions_total = len(ends)
    if outcomes is None:
        return facts
    con.execute(f"CREATE VIEW oc AS SELECT * FROM read_parquet('{outcomes}', hive_partitioning=true, union_by_name=true)")
    rows = con.execute(
        """
        WITH ended AS (SELECT session_id FROM ev WHERE type='session_end' AND status='ok' AND epoch(ts) >= ? GROUP BY 1),
             versions AS (SELECT session_id, min(policy_version) AS vmin, max(policy_version) AS vmax
                          FROM ev WHERE type='llm_call' GROUP BY 1),
             verdicts AS (SELECT session_id, arg_max(value, ts) AS value FROM oc WHERE kind='task_success' GROUP BY 1)
        SELECT v.vmin, v.vmax, d.value FROM ended e JOIN versions v USING (session_id) JOIN verdicts d USING (session_id)
        """, [since]).fetchall()
    for vmin, vmax, value in rows:
        if vmin != vmax:
            facts.mixed_sessions += 1
            continue
        stats = facts.by_version.setdefault(int(vmin), VersionStats(int(vmin)))
        stats.sessions += 1
        stats.successes += int(value >= 0.5)
    episodes = _glob(lake_root, "episodes")
    if episodes is not None:
        rows = con.execute(
            f"SELECT last_outcome_ts, emitted_ts, filename FROM read_parquet('{episodes}', hive_partitioning=true, "
            "union_by_name=true, filename=true) WHERE last_outcome_ts IS NOT NULL AND epoch(emitted_ts) >= ?", [since]).fetchall()
        facts.episodes = len(rows)
        for last_outcome, emitted, file in rows:
            if file not in mtimes:
                mtimes[file] = os.path.getmtime(file) if os.path.exists(file) else _epoch(emitted)
            facts.outcome_to_episode_s.append(max(0.0, mtimes[file] - _epoch(last_outcome)))
    return facts


def learner_facts(facts: Facts, lake_root: str, learner_run_dir: str | None, policies_dir: str, since: float) -> None:
    """Episode -> trained (into a published version) and the versions the learner wrote during the run."""
    policies: list[dict[str, Any]] = []
    for path in sorted(Path(policies_dir).glob("policy-v*/policy.json")):
        try:
            record = json.loads(path.read_text())
            created = dt.datetime.fromisoformat(str(record["created_ts"]).replace("Z", "+00:00")).timestamp()
        except (OSError, ValueError, KeyError):
            continue
        if created >= since:
            record["_created"] = created
            policies.append(record)
    policies.sort(key=lambda r: r["_created"])
    if not learner_run_dir or not policies:
        return
    trained_path = Path(learner_run_dir) / "trained.jsonl"
    episodes = _glob(lake_root, "episodes")
    if not trained_path.exists() or episodes is None:
        return
    import duckdb

    emitted = dict(duckdb.connect().execute(
        f"SELECT episode_id, epoch(min(emitted_ts)) FROM read_parquet('{episodes}', hive_partitioning=true, "
        "union_by_name=true) GROUP BY 1").fetchall())
    for line in trained_path.read_text().splitlines():
        try:
            step_record = json.loads(line)
        except json.JSONDecodeError:
            continue
        # the first version written at or after this step carries what the step learned
        carrier = next((p for p in policies if int(p.get("learner_step", -1)) >= int(step_record["step"])), None)
        if carrier is None:
            continue
        for episode_id in step_record.get("episode_ids", []):
            if episode_id in emitted:
                facts.episode_to_trained_s.append(max(0.0, carrier["_created"] - float(emitted[episode_id])))


def registry_facts(facts: Facts, tracking_uri: str, registered_model: str, policies_dir: str, since: float) -> None:
    """Published versions (registered during the run), trained -> served delays, promotions and the champion."""
    try:
        from flywheel.base import tracking

        client = tracking.client(tracking_uri)
        versions = client.search_model_versions(f"name='{registered_model}'")
    except Exception as exc:  # a report without the registry still shows the lake's numbers
        log.warning("report: MLflow registry %s unreadable (%s); versions and promotions left empty", tracking_uri, exc)
        return
    for mv in versions:
        created = mv.creation_timestamp / 1000.0
        tags = dict(mv.tags or {})
        try:
            version = int(tags.get("policy_version", -1))
        except ValueError:
            continue
        if created < since or version < 0:
            continue
        facts.versions_published.append(version)
        policy_json = Path(policies_dir) / version_name(version) / "policy.json"
        try:
            written = dt.datetime.fromisoformat(str(json.loads(policy_json.read_text())["created_ts"]).replace("Z", "+00:00")).timestamp()
            # registration happens after every server took the weights: written -> registered is trained -> served
            facts.trained_to_served_s.append(max(0.0, created - written))
        except (OSError, ValueError, KeyError):
            pass
        if tags.get("gate_decision") == "promote":
            facts.promotions.append(version)
    facts.versions_published.sort()
    facts.promotions.sort()
    try:
        champion = client.get_model_version_by_alias(registered_model, "champion")
        facts.champion = int(dict(champion.tags or {}).get("policy_version", -1))
    except Exception:
        facts.champion = None


# ---------------------------------------------------------------------------------------------
# summary, plots, markdown
# ---------------------------------------------------------------------------------------------
def summarize(facts: Facts, min_sessions: int = 300) -> dict[str, Any]:
    base = facts.by_version.get(0, VersionStats(0))
    champion_version = facts.champion if facts.champion is not None and facts.champion > 0 else None
    if champion_version is None and facts.promotions:
        champion_version = facts.promotions[-1]
    champ = facts.by_version.get(champion_version, VersionStats(champion_version or -1)) if champion_version else VersionStats(-1)
    p_value = p_better(base.successes, base.sessions, champ.successes, champ.sessions)
    ratio = champ.rate / base.rate if base.rate > 0 else None
    return {
        "base_success": round(base.rate, 4), "n_base": base.sessions,
        "champion_version": champion_version,
        "champion_success": round(champ.rate, 4), "n_champion": champ.sessions,
        "success_ratio": round(ratio, 3) if ratio is not None else None,
        "p_value": p_value,
        "significant": bool(p_value < 0.05 and base.sessions >= min_sessions and champ.sessions >= min_sessions),
        "versions_published": len(set(facts.versions_published)),
        "versions": sorted(set(facts.versions_published)),
        "promotions": len(facts.promotions),
        "promoted_versions": facts.promotions,
        "sessions": facts.sessions_total, "mixed_version_sessions": facts.mixed_sessions, "episodes": facts.episodes,
        "per_version": {str(v): {"sessions": s.sessions, "success": round(s.rate, 4), "ci95": [round(x, 4) for x in wilson(s.successes, s.sessions)]}
                        for v, s in sorted(facts.by_version.items())},
        "p95_session_to_lake_s": _round(p95(facts.session_to_lake_s)),
        "p95_outcome_to_episode_s": _round(p95(facts.outcome_to_episode_s)),
        "p95_episode_to_trained_s": _round(p95(facts.episode_to_trained_s)),
        "p95_trained_to_served_s": _round(p95(facts.trained_to_served_s)),
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def plots(facts: Facts, out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")  # no display on a server
    import matplotlib.pyplot as plt

    written: list[str] = []
    versions = sorted(facts.by_version)
    if versions:
        rates = [facts.by_version[v].rate for v in versions]
        cis = [wilson(facts.by_version[v].successes, facts.by_version[v].sessions) for v in versions]
        # wide enough for each bar's "n=..." label: at 7 inches 18 versions' labels ran into each other
        fig, ax = plt.subplots(figsize=(max(7.0, 0.65 * len(versions) + 1.5), 4))
        ax.bar([f"v{v}\nn={facts.by_version[v].sessions}" for v in versions], rates,
               yerr=[[max(0.0, r - lo) for r, (lo, _) in zip(rates, cis)], [max(0.0, hi - r) for r, (_, hi) in zip(rates, cis)]],
               capsize=4, color=["#888888" if v == 0 else ("#2a9d8f" if v == facts.champion else "#8ab6d6") for v in versions])
        ax.set_ylabel("task success (95% CI)")
        ax.set_title("Success rate per policy version (production sessions)")
        fig.tight_layout()
        fig.savefig(out_dir / "success_by_version.png", dpi=110)
        plt.close(fig)
        written.append("success_by_version.png")
    series = [("session end -> lake", facts.session_to_lake_s), ("outcome -> episode", facts.outcome_to_episode_s),
              ("episode -> trained version", facts.episode_to_trained_s), ("trained -> served", facts.trained_to_served_s)]
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, values in series:
        if values:
            ordered = sorted(values)
            ax.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=f"{label} (p95 {p95(values):.1f}s)")
    ax.set_xscale("symlog")
    ax.set_xlabel("seconds")
    ax.set_ylabel("CDF")
    ax.set_title("End-to-end freshness")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "freshness.png", dpi=110)
    plt.close(fig)
    written.append("freshness.png")
    if facts.session_end_times:
        t0 = min(facts.session_end_times)
        minutes = [int((t - t0) // 60) for t in facts.session_end_times]
        fig, ax = plt.subplots(figsize=(7, 3))
        counts = [minutes.count(m) for m in range(max(minutes) + 1)]
        ax.bar(range(len(counts)), counts, color="#457b9d")
        ax.set_xlabel("minute of the run")
        ax.set_ylabel("sessions ended")
        ax.set_title("Throughput")
        fig.tight_layout()
        fig.savefig(out_dir / "throughput.png", dpi=110)
        plt.close(fig)
        written.append("throughput.png")
    return written


def markdown(summary: dict[str, Any], images: list[str], context: dict[str, Any]) -> str:
    lines = ["# agent-flywheel demo report", "",
             f"Run: {context.get('started', '?')} to {context.get('ended', '?')} ({context.get('minutes', '?')} min of traffic). "
             "Every number below is read from the lake (production sessions of the simulated agent) and the MLflow registry.", "",
             "## Did the policy get better?", "",
             f"- base (policy-v0): **{summary['base_success']:.1%}** success on n = {summary['n_base']} sessions",
             f"- champion (policy-v{summary['champion_version']}): **{summary['champion_success']:.1%}** on n = {summary['n_champion']} sessions"
             if summary["champion_version"] is not None else "- champion: no version was promoted during the run",
             f"- ratio {summary['success_ratio']}, one-sided p = {summary['p_value']:.3g} "
             f"({'significant at 95% with >= 300 sessions each' if summary['significant'] else 'NOT significant at 95% with >= 300 sessions each'})",
             f"- versions published: {summary['versions_published']} {summary['versions']}; promotions by the gate: {summary['promotions']} {summary['promoted_versions']}",
             "", "| version | sessions | success | 95% CI |", "|---|---|---|---|"]
    for version, row in summary["per_version"].items():
        lines.append(f"| policy-v{version} | {row['sessions']} | {row['success']:.1%} | {row['ci95'][0]:.1%} - {row['ci95'][1]:.1%} |")
    lines += ["", f"Sessions: {summary['sessions']} ({summary['mixed_version_sessions']} straddled a weight push and are not counted for a version); episodes: {summary['episodes']}.",
              "", "## Freshness (p95)", "",
              f"- session end -> visible in the lake: {summary['p95_session_to_lake_s']} s (target < 10 s)",
              f"- outcome arrival -> episode: {summary['p95_outcome_to_episode_s']} s (target < 30 s)",
              f"- episode -> in a published version: {summary['p95_episode_to_trained_s']} s",
              f"- trained -> served: {summary['p95_trained_to_served_s']} s", ""]
    lines += [f"![{name}]({name})" for name in images]
    return "\n".join(lines) + "\n"


def write_report(out_dir: str | Path, lake_root: str, since: float, learner_run_dir: str | None, policies_dir: str,
                 tracking_uri: str, registered_model: str, context: dict[str, Any] | None = None) -> dict[str, Any]:
    """Gather, plot and write report.md + summary.json; returns the summary."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    facts = lake_facts(lake_root, since)
    learner_facts(facts, lake_root, learner_run_dir, policies_dir, since)
    registry_facts(facts, tracking_uri, registered_model, policies_dir, since)
    summary = summarize(facts)
    context = dict(context or {})
    summary["report_written"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    summary.update({k: v for k, v in context.items() if k not in summary})
    images = plots(facts, out)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    (out / "report.md").write_text(markdown(summary, images, context))
    return summary


def main(argv: list[str] | None = None) -> int:
    import argparse

    from flywheel.base import defaults
    from flywheel.base.config import setup_logging

    parser = argparse.ArgumentParser(prog="python -m infra.report", description="write the demo report from the lake")
    parser.add_argument("--lake-root", default=defaults.LAKE_ROOT)
    parser.add_argument("--out", default="var/report")
    parser.add_argument("--since", type=float, default=0.0, help="only sessions ending after this epoch time")
    parser.add_argument("--learner-run-dir", default="var/learner")
    parser.add_argument("--policies-dir", default=defaults.POLICIES_DIR)
    parser.add_argument("--mlflow-tracking-uri", default=defaults.MLFLOW_TRACKING_URI)
    parser.add_argument("--registered-model", default=defaults.REGISTERED_MODEL)
    args = parser.parse_args(argv)
    setup_logging()
    summary = write_report(args.out, args.lake_root, args.since, args.learner_run_dir, args.policies_dir,
                           args.mlflow_tracking_uri, args.registered_model)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
