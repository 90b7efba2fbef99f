"""The demo report: what the online loop achieved, computed from the lake and the registry, never typed in.

    flywheel demo ... (writes it at the end)      or      flywheel report --run-dir var/demo/<run id>

Inputs: the lake's events (sessions, their llm_calls' policy versions and router arms, session ends),
outcomes (the verifier's task_success) and episodes; the learner's trained-episode log and the policy
version directories; the MLflow registry (published versions, gate decisions, the champion alias).
Outputs under `out_dir` (default var/report): report.md, success_by_version.png, arms.png,
freshness.png, throughput.png and summary.json.

Per tool (`per_tool`): each one-part session's task type names its tool; its first tool call's name says which
harness generation's convention the policy used (tasks.TOOL_NAMES). The share of first calls that take
production's name, and the success, by version and in the final window per arm, show the adaptation the
demo's RL is for (the drift in infra/demo/tasks.py); arms.png draws the share per arm over the run too.

Sessions are read through `flywheel.serving.sessions.read_sessions`, the gate's own definition: a
session counts for the version that served ALL its llm_calls (one that straddled a weight push
counts for none), and for the router's arm (control, champion, challenger). A session that ended
in an infrastructure error is excluded and counted apart; one without the verifier's task_success
is unlabelled, not a failure. Success is task_success >= 0.5.

The headline is the final window: measure_s seconds of traffic at the end, with the learner and the
gate stopped and the proxy's router confirmed on the cleared challenger alias, so every non-control session goes to the
final champion. Its sessions there (started after its promotion too) are compared with the control arm's in the same
window, a sample the gate never saw when it chose the champion. The whole-run numbers (base_success, champion_success)
are kept, with their definitions in report.md.
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
from flywheel.demo import tasks
from flywheel.ingest import lake
from flywheel.rewards import calibrate
from flywheel.serving.decision import GateRule
from flywheel.serving.registry import CHAMPION, Registry
from flywheel.serving.router import ARMS
from flywheel.serving.sessions import (
    ERROR_STATUSES,
    SessionRecord,
    epoch,
    mature,
    read_sessions,
)
from flywheel.serving.stats import p_better, wilson

log = logging.getLogger(__name__)


def p95(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]


SIM_CHALLENGERS = 2000  # simulated null challengers behind gate_false_promotion_rate (simulation s.e. ~0.5 point)


@dataclass
class VersionStats:
    version: int
    sessions: int = 0  # counted: labelled, not errored
    successes: int = 0
    errored: int = 0  # ended in an infrastructure error: excluded
    unlabelled: int = 0  # ended without a task_success: excluded, not a failure

    @property
    def rate(self) -> float:
        return self.successes / self.sessions if self.sessions else 0.0


@dataclass
class Count:
    """Sessions of one selection (a version, an arm, a window): counted ones and the ones excluded."""

    n: int = 0  # labelled, not errored
    successes: int = 0
    errored: int = 0
    unlabelled: int = 0
    open: int = 0  # no session_end in the lake

    @property
    def rate(self) -> float | None:
        return self.successes / self.n if self.n else None


def count(records: list[SessionRecord], error_statuses: tuple[str, ...] = ERROR_STATUSES) -> Count:
    """Counted and excluded sessions, split as the gate splits them (every outcome window closed: the run is over)."""
    split = mature(records, math.inf, 0.0, error_statuses)
    return Count(len(split.counted), sum(1 for r in split.counted if (r.outcome or 0.0) >= 0.5), split.errored,
                 split.unlabelled, split.open)


@dataclass
class Facts:
    """Everything the report states, gathered from the lake, the learner and the registry."""

    by_version: dict[int, VersionStats] = field(default_factory=dict)
    mixed_sessions: int = 0
    sessions_total: int = 0
    session_to_lake_s: list[float] = field(default_factory=list)
    outcome_to_episode_s: list[float] = field(default_factory=list)
    episode_to_trained_s: list[float] = field(default_factory=list)
    episode_to_step_s: list[float] = field(default_factory=list)  # emitted -> the learner step that trained it
    step_times: list[float] = field(default_factory=list)  # epoch seconds of each learner step of the run
    trained_to_served_s: list[float] = field(default_factory=list)
    session_end_times: list[float] = field(default_factory=list)  # epoch seconds
    versions_published: list[int] = field(default_factory=list)
    promotions: list[int] = field(default_factory=list)
    champion: int | None = None  # the champion alias at the end; 0 when none is set; None: registry unreadable
    champion_promoted_at: float | None = None  # epoch seconds of the champion's promotion (registry tags)
    episodes: int = 0
    sessions: list[SessionRecord] = field(default_factory=list)  # this run's sessions (read_sessions)
    tool_calls: dict[str, tuple[int, int]] = field(default_factory=dict)  # session_id -> (tool calls, malformed ones)
    first_calls: dict[str, str | None] = field(default_factory=dict)  # session_id -> first call's name (None: bad)


# ---------------------------------------------------------------------------------------------
# gathering
# ---------------------------------------------------------------------------------------------
def _lake_files(lake_root: str, table: str) -> list[str]:
    """Paths of the table's visible files, local or remote (a compaction's originals are not counted twice)."""
    return [f.path for f in lake.list_files(lake_root, table)]


def _published_at(lake_root: str, table: str) -> dict[str, float]:
    """Epoch seconds each file of a lake table was published: its modification time (a lake file is written
    once, by an atomic rename or a single PUT, and never changed). One listing, local or remote."""
    import pyarrow.fs as pafs

    fs, base = lake.filesystem(lake_root)
    infos = fs.get_file_info(pafs.FileSelector(f"{base}/{table}", recursive=True, allow_not_found=True))
    return {i.path: i.mtime.timestamp() for i in infos if i.type == pafs.FileType.File and i.mtime is not None}


def _rows_with_file(lake_root: str, table: str, paths: list[str], columns: list[str], where: Any = None) -> Any:
    """`columns` of the rows of these lake files matching the pyarrow expression `where`, with each row's file in
    a `filename` column (what DuckDB's read_parquet(filename=true) gives, on any filesystem pyarrow reaches)."""
    import pyarrow as pa

    dataset = lake.dataset(lake_root, table, paths)
    parts = [dataset.schema.empty_table().select(columns).append_column("filename", pa.array([], pa.string()))]
    for frag in dataset.get_fragments():
        t = frag.to_table(schema=dataset.schema, columns=columns, filter=where)
        parts.append(t.append_column("filename", pa.array([frag.path] * t.num_rows, pa.string())))
    return pa.concat_tables(parts)


def lake_facts(lake_root: str, since: float = 0.0, error_statuses: tuple[str, ...] = ERROR_STATUSES) -> Facts:
    """Per-version success and freshness from the lake's events, outcomes and episodes (sessions ending after `since`).

    Reads a local or a remote (s3://...) lake alike: files from the lake's listing, rows through DuckDB (remote
    files as pyarrow datasets, ingest.lake.sql_view), publication times from the filesystem's listing.
    """
    import duckdb
    import pyarrow.dataset as ds

    facts = Facts()
    con = duckdb.connect()
    con.execute("SET TimeZone='UTC'")
    events = _lake_files(lake_root, "events")
    if not events:
        return facts
    lake.sql_view(con, "ev", lake_root, "events", events)
    ended = _rows_with_file(lake_root, "events", events, ["session_id", "ts"],
                            (ds.field("type") == "session_end") & (ds.field("status") == "ok"))
    con.register("ended_files", ended)
    ends = con.execute("SELECT session_id, min(ts) AS end_ts, min(filename) AS file FROM ended_files "
                       "WHERE epoch(ts) >= ? GROUP BY session_id", [since]).fetchall()
    con.unregister("ended_files")
    mtimes = _published_at(lake_root, "events")
    for _session_id, end_ts, file in ends:
        end = epoch(end_ts)
        if end is None:  # min(ts) of rows that have one: never None, but epoch() says it may be
            continue
        facts.session_end_times.append(end)
        if file in mtimes:
            # visible in the lake = the moment its file was published (atomic rename)
            facts.session_to_lake_s.append(max(0.0, mtimes[file] - end))
    facts.sessions_total = len(ends)
    # a session still running has no end: it belongs to this run if it started in it
    facts.sessions = [r for r in read_sessions(lake_root, "task_success")
                      if (r.ended if r.ended is not None else r.started) >= since]
    by_version(facts, error_statuses)
    facts.tool_calls = tool_calls(con)
    facts.first_calls = first_calls(con)
    episodes = _lake_files(lake_root, "episodes")
    if episodes:
        emitted = _rows_with_file(lake_root, "episodes", episodes, ["last_outcome_ts", "emitted_ts"],
                                  ds.field("last_outcome_ts").is_valid())
        con.register("emitted_files", emitted)
        rows = con.execute("SELECT last_outcome_ts, emitted_ts, filename FROM emitted_files "
                           "WHERE epoch(emitted_ts) >= ?",
                           [since]).fetchall()
        facts.episodes = len(rows)
        mtimes = _published_at(lake_root, "episodes")
        for last_outcome, emitted_ts, file in rows:
            published, outcome_at = mtimes.get(file, epoch(emitted_ts)), epoch(last_outcome)
            if published is not None and outcome_at is not None:  # both columns are filtered valid above
                facts.outcome_to_episode_s.append(max(0.0, published - outcome_at))
    return facts


def _malformed(con: Any) -> str:
    """SQL for "the agent marked this call malformed" over the events view (no such column: no call ever was)."""
    columns = {row[0] for row in con.execute("DESCRIBE ev").fetchall()}
    return "coalesce(malformed, false)" if "malformed" in columns else "false"


def tool_calls(con: Any) -> dict[str, tuple[int, int]]:
    """Per session (sub-agents' calls included): its tool_call events and how many the agent marked malformed."""
    marked = _malformed(con)
    bad = "0" if marked == "false" else f"count(DISTINCT event_id) FILTER (WHERE {marked})"
    # distinct event ids: a replayed event is one call (the episode builder drops the copy too)
    rows = con.execute(f"SELECT session_id, count(DISTINCT event_id), {bad} FROM ev WHERE type='tool_call' "
                       "GROUP BY 1").fetchall()
    return {str(sid): (int(n), int(m)) for sid, n, m in rows}


def first_calls(con: Any) -> dict[str, str | None]:
    """Per session: the tool name of its first tool call, in (ts, seq) order; None where that call was malformed."""
    bad = _malformed(con)
    rows = con.execute(f"SELECT session_id, name, bad FROM (SELECT session_id, name, {bad} AS bad, row_number() OVER "
                       "(PARTITION BY session_id ORDER BY ts, seq) AS k FROM ev WHERE type='tool_call') WHERE k = 1"
                       ).fetchall()
    return {str(sid): None if bad or name is None else str(name) for sid, name, bad in rows}


def tool_rows(records: list[SessionRecord], first: dict[str, str | None],
              error_statuses: tuple[str, ...] = ERROR_STATUSES) -> dict[str, dict[str, Any]]:
    """Per tool, over the one-part sessions of `records` that asked for it: counted sessions and success, and the
    share of their first tool calls (a malformed one included) that took production's name."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tasks.TOOLS:
        mine = [r for r in records if r.task_type == f"tool_use.{tool}"]
        c = count(mine, error_statuses)
        named = [first[r.session_id] for r in mine if r.session_id in first]
        out[tool] = {"sessions": c.n, "success": _rate(c), "first_calls": len(named),
                     "production_name": round(sum(n == tool for n in named) / len(named), 4) if named else None,
                     "older_name": round(sum(tasks.generation_of(n) is not None and n != tool for n in named)
                                         / len(named), 4) if named else None}
    return out


def per_tool(facts: Facts, final_start: float | None, control_version: int,
             error_statuses: tuple[str, ...] = ERROR_STATUSES) -> dict[str, Any]:
    """tool_rows per version (any arm, the whole run) and, in the final window, for the champion and the control."""
    out: dict[str, Any] = {"by_version": {str(v): tool_rows([r for r in facts.sessions if r.version == v],
                                                            facts.first_calls, error_statuses)
                                          for v in sorted(facts.by_version)}, "final": None}
    if final_start is not None and facts.champion is not None:
        out["final"] = {"champion": tool_rows(select(facts, "champion", facts.champion, final_start),
                                              facts.first_calls, error_statuses),
                        "control": tool_rows(select(facts, "control", control_version, final_start),
                                             facts.first_calls, error_statuses)}
    return out


def malformed_share(records: list[SessionRecord], calls: dict[str, tuple[int, int]]) -> tuple[float | None, int]:
    """(malformed tool calls / all tool calls, all tool calls) over the sessions in `records`; None without a call."""
    n = sum(calls.get(r.session_id, (0, 0))[0] for r in records)
    bad = sum(calls.get(r.session_id, (0, 0))[1] for r in records)
    return (round(bad / n, 4) if n else None), n


def by_version(facts: Facts, error_statuses: tuple[str, ...] = ERROR_STATUSES) -> None:
    """Counted sessions per serving version (all arms); sessions served by no single version are counted as mixed."""
    groups: dict[int, list[SessionRecord]] = {}
    for r in facts.sessions:
        if r.version is None:
            facts.mixed_sessions += int(r.ended is not None)
        else:
            groups.setdefault(r.version, []).append(r)
    for version, records in sorted(groups.items()):
        c = count(records, error_statuses)
        facts.by_version[version] = VersionStats(version, c.n, c.successes, c.errored, c.unlabelled)


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
    episodes = _lake_files(lake_root, "episodes")
    if not trained_path.exists() or not episodes:
        return
    import duckdb

    con = duckdb.connect()
    lake.sql_view(con, "ep", lake_root, "episodes", episodes)
    emitted = dict(con.execute("SELECT episode_id, epoch(min(emitted_ts)) FROM ep GROUP BY 1").fetchall())
    con.close()
    first_trained: dict[str, float] = {}
    steps: dict[int, float] = {}
    for line in trained_path.read_text().splitlines():
        try:
            step_record = json.loads(line)
        except json.JSONDecodeError:
            continue
        when = step_record.get("t")
        if isinstance(when, (int, float)) and when >= since:
            # a step trained again after a kill (checkpoint cadence) counts once, at its first training
            steps.setdefault(int(step_record["step"]), float(when))
            for episode_id in step_record.get("episode_ids", []):
                first_trained.setdefault(episode_id, float(when))
        # the first version written at or after this step carries what the step learned
        carrier = next((p for p in policies if int(p.get("learner_step", -1)) >= int(step_record["step"])), None)
        if carrier is None:
            continue
        for episode_id in step_record.get("episode_ids", []):
            if episode_id in emitted:
                facts.episode_to_trained_s.append(max(0.0, carrier["_created"] - float(emitted[episode_id])))
    facts.episode_to_step_s = [max(0.0, t - float(emitted[e])) for e, t in first_trained.items() if e in emitted]
    facts.step_times = sorted(steps.values())


def registry_facts(facts: Facts, tracking_uri: str, registered_model: str, policies_dir: str, since: float,
                   client: Any | None = None) -> None:
    """Published versions (registered during the run), trained -> served delays, promotions and the champion."""
    try:
        from flywheel.base import tracking

        client = client if client is not None else tracking.client(tracking_uri)
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
            written = dt.datetime.fromisoformat(
                str(json.loads(policy_json.read_text())["created_ts"]).replace("Z", "+00:00")).timestamp()
            # registration happens after every server took the weights: written -> registered is trained -> served
            facts.trained_to_served_s.append(max(0.0, created - written))
        except (OSError, ValueError, KeyError):
            pass
        # promoted_ts too: a gate stopped between moving the alias and recording its decision (serving/promote.py
        # applies, then records) leaves the first without the second
        if tags.get("gate_decision") == "promote" or tags.get("promoted_ts"):
            facts.promotions.append(version)
    facts.versions_published.sort()
    facts.promotions.sort()
    champion_facts(facts, Registry(tracking_uri, registered_model, client=client))


def champion_facts(facts: Facts, registry: Registry) -> None:
    """The champion at the end: the champion alias, or policy-v0 when none is set (before any promotion, or after
    a rollback to v0, which clears the alias); never the last promoted version, which a rollback may have undone."""
    try:
        slots = registry.alias_versions()
    except Exception as exc:  # the versions were readable a moment ago: say so rather than guess a champion
        log.warning("report: champion alias of %s unreadable (%s); champion left unknown", registry.name, exc)
        return
    champion = slots.get(CHAMPION)
    facts.champion = champion.policy_version if champion is not None else 0
    facts.champion_promoted_at = promotion_time(champion.tags) if champion is not None else None


def promotion_time(tags: dict[str, str]) -> float | None:
    """When a version last became champion: its `champion_since_ts` tag (a promotion or a rollback to it, epoch
    seconds), else `promoted_ts`, else its `gate_ts` (ISO), else None."""
    try:
        for key in ("champion_since_ts", "promoted_ts"):
            if tags.get(key):
                return float(tags[key])
        if tags.get("gate_ts"):
            return epoch(dt.datetime.fromisoformat(tags["gate_ts"].replace("Z", "+00:00")))
    except ValueError:
        log.warning("report: unreadable promotion tags %s",
                    {k: tags.get(k) for k in ("champion_since_ts", "promoted_ts", "gate_ts")})
    return None


# ---------------------------------------------------------------------------------------------
# summary, plots, markdown
# ---------------------------------------------------------------------------------------------
def summarize(facts: Facts, min_sessions: int = 300,
              error_statuses: tuple[str, ...] = ERROR_STATUSES) -> dict[str, Any]:
    """The whole run, per version: the base, the champion at the end and every version (defined in report.md)."""
    base = facts.by_version.get(0, VersionStats(0))
    champion_version = facts.champion  # the alias, or 0 when none is set; None only when the registry was unreadable
    champ = (facts.by_version.get(champion_version, VersionStats(champion_version)) if champion_version is not None
             else VersionStats(-1))
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
        "per_version": {str(v): {"sessions": s.sessions, "success": round(s.rate, 4),
                                 "ci95": [round(x, 4) for x in wilson(s.successes, s.sessions)],
                                 "errored": s.errored, "unlabelled": s.unlabelled}
                        for v, s in sorted(facts.by_version.items())},
        "per_arm": per_arm(facts, error_statuses),
        "p95_session_to_lake_s": _round(p95(facts.session_to_lake_s)),
        "p95_outcome_to_episode_s": _round(p95(facts.outcome_to_episode_s)),
        "p95_episode_to_trained_s": _round(p95(facts.episode_to_trained_s)),
        "p95_episode_to_step_s": _round(p95(facts.episode_to_step_s)),
        "learner_steps": len(facts.step_times),
        # over the learner's own span (first to last step), so the base phase and the final window do not dilute it
        "learner_steps_per_min": _per(len(facts.step_times) - 1, facts.step_times, 60.0),
        "sessions_per_s": _per(len(facts.session_end_times), facts.session_end_times, 1.0),
        "p95_trained_to_served_s": _round(p95(facts.trained_to_served_s)),
        "freshness_n": {"session_to_lake": len(facts.session_to_lake_s),
                        "outcome_to_episode": len(facts.outcome_to_episode_s),
                        "episode_to_trained": len(facts.episode_to_trained_s),
                        "trained_to_served": len(facts.trained_to_served_s)},
    }


def _per(count: int, times: list[float], unit_s: float) -> float | None:
    """count per unit_s over the span of `times` (None without a span)."""
    span = max(times) - min(times) if len(times) > 1 else 0.0
    return round(unit_s * count / span, 3) if span > 0 else None


def select(facts: Facts, arm: str, version: int | None = None, since: float | None = None) -> list[SessionRecord]:
    """Sessions of one arm served by one version (any single version when None) that started at or after `since`."""
    return [r for r in facts.sessions if r.arm == arm and r.version is not None
            and (version is None or r.version == version) and (since is None or r.started >= since)]


def per_arm(facts: Facts, error_statuses: tuple[str, ...] = ERROR_STATUSES) -> dict[str, dict[str, Any]]:
    """The whole run per router arm (any version): counted sessions, success with its interval, and the exclusions."""
    out: dict[str, dict[str, Any]] = {}
    for arm in ARMS:
        c = count(select(facts, arm), error_statuses)
        out[arm] = {"sessions": c.n, "success": _rate(c), "ci95": [round(x, 4) for x in wilson(c.successes, c.n)],
                    "n_errored": c.errored, "n_unlabelled": c.unlabelled}
    return out


FINAL_FIELDS = ("champion_final_success", "n_champion_final", "n_champion_final_errored", "n_champion_final_unlabelled",
                "control_final_success", "n_control_final", "n_control_final_errored", "n_control_final_unlabelled",
                "lift_points", "lift_ci95", "lift_ci_method", "p_value_final",
                "malformed_share_champion_final", "n_calls_champion_final",
                "malformed_share_control_final", "n_calls_control_final")


def measurement(facts: Facts, final_since: float | None, control_version: int = 0,
                error_statuses: tuple[str, ...] = ERROR_STATUSES) -> dict[str, Any]:
    """The control arm over the run, and the final window: the final champion against the concurrent control.

    The window starts at the later of `final_since` and the champion's promotion, so none of its sessions
    is one the gate saw when it chose the champion. Without a final window the final fields are None.
    """
    control = count(select(facts, "control", control_version), error_statuses)
    out: dict[str, Any] = {"control_version": control_version, "control_success": _rate(control),
                           "n_control": control.n, "n_control_errored": control.errored,
                           "n_control_unlabelled": control.unlabelled, "final_since": final_since,
                           "final_window_start": None, "champion_promoted_ts": facts.champion_promoted_at}
    out.update(dict.fromkeys(FINAL_FIELDS))
    if final_since is None or facts.champion is None:
        return out
    start = max(final_since, facts.champion_promoted_at if facts.champion_promoted_at is not None else final_since)
    champ_sessions = select(facts, "champion", facts.champion, start)
    ctrl_sessions = select(facts, "control", control_version, start)
    champ, ctrl = count(champ_sessions, error_statuses), count(ctrl_sessions, error_statuses)
    # every call of the window's sessions, errored and unlabelled ones too: the share is about the calls, not
    # the outcomes
    (out["malformed_share_champion_final"],
     out["n_calls_champion_final"]) = malformed_share(champ_sessions, facts.tool_calls)
    (out["malformed_share_control_final"],
     out["n_calls_control_final"]) = malformed_share(ctrl_sessions, facts.tool_calls)
    out.update({"final_window_start": start,
                "champion_final_success": _rate(champ), "n_champion_final": champ.n,
                "n_champion_final_errored": champ.errored, "n_champion_final_unlabelled": champ.unlabelled,
                "control_final_success": _rate(ctrl), "n_control_final": ctrl.n,
                "n_control_final_errored": ctrl.errored, "n_control_final_unlabelled": ctrl.unlabelled})
    interval = lift_ci(champ.successes, champ.n, ctrl.successes, ctrl.n)
    if interval is not None:
        out.update({"lift_points": round(100.0 * (champ.successes / champ.n - ctrl.successes / ctrl.n), 2),
                    "lift_ci95": [round(100.0 * x, 2) for x in interval], "lift_ci_method": "newcombe-wilson",
                    "p_value_final": p_better(ctrl.successes, ctrl.n, champ.successes, champ.n)})
    return out


def lift_ci(success_b: int, n_b: int, success_a: int, n_a: int) -> tuple[float, float] | None:
    """95% interval of rate_b - rate_a: Newcombe's hybrid score interval (his method 10, Stat Med 1998), built from
    the two Wilson intervals; unlike the Wald interval it stays sensible near 0 and 1 and at small n.
    None if a side is empty."""
    if n_a == 0 or n_b == 0:
        return None
    p_a, p_b = success_a / n_a, success_b / n_b
    lo_a, hi_a = wilson(success_a, n_a)
    lo_b, hi_b = wilson(success_b, n_b)
    diff = p_b - p_a
    return (diff - math.sqrt((p_b - lo_b) ** 2 + (hi_a - p_a) ** 2),
            diff + math.sqrt((hi_b - p_b) ** 2 + (p_a - lo_a) ** 2))


def gate_scenario(facts: Facts, control_version: int, gate_interval_s: float, shares: dict[str, float] | None,
                  error_statuses: tuple[str, ...] = ERROR_STATUSES) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """This run's traffic as a gate_sim.Scenario (its fields) under the null, and what it was estimated from.

    Rates and mix: the control arm's counted sessions per task type. Sessions per look: each challenger's
    counted challenger-arm sessions over the time from its first to its last (the arm only exists while a
    challenger does), times the gate's interval. Champion sessions per challenger session: from the shares (1 without).
    """
    control = mature(select(facts, "control", control_version), math.inf, 0.0, error_statuses).counted
    basis: dict[str, Any] = {"n_control": len(control), "gate_interval_s": gate_interval_s, "shares": shares,
                             "challengers": SIM_CHALLENGERS, "seed": 0}
    if not control:
        return None, basis
    by_type: dict[str, list[float]] = {}
    for r in control:
        by_type.setdefault(r.task_type, []).append(float((r.outcome or 0.0) >= 0.5))
    challengers: dict[int, list[float]] = {}
    for r in mature(select(facts, "challenger"), math.inf, 0.0, error_statuses).counted:
        challengers.setdefault(r.version, []).append(r.started)  # type: ignore[arg-type]
    spans = [(len(s), max(s) - min(s)) for s in challengers.values() if len(s) >= 2]
    seconds = sum(span for _, span in spans)
    per_s = sum(n for n, _ in spans) / seconds if seconds > 0 else None
    challenger_share = (shares or {}).get("challenger", 0.0)
    ratio = ((1.0 - (shares or {}).get("control", 0.0) - challenger_share) / challenger_share
             if challenger_share > 0 else 1.0)
    basis.update({"challenger_sessions_per_s": _round(per_s), "n_challenger": sum(n for n, _ in spans),
                  "challenger_seconds": round(seconds, 1)})
    scenario = {"rates": {t: round(sum(v) / len(v), 4) for t, v in sorted(by_type.items())},
                "mix": {t: round(len(v) / len(control), 4) for t, v in sorted(by_type.items())},
                "lift": 0.0, "challenger_per_look": max(1, round(per_s * gate_interval_s)) if per_s else 1,
                "champion_ratio": round(ratio, 4)}
    return scenario, basis


def gate_simulation(facts: Facts, rule: GateRule | None, control_version: int, gate_interval_s: float,
                    shares: dict[str, float] | None,
                    error_statuses: tuple[str, ...] = ERROR_STATUSES) -> dict[str, Any]:
    """The gate's false-promotion rate at this run's traffic: its own rule on 2,000 simulated null challengers."""
    out: dict[str, Any] = {"gate_false_promotion_rate": None, "gate_sim_scenario": None, "gate_sim_basis": None,
                           "gate_alpha": rule.alpha if rule is not None else None,
                           "gate_test": rule.test if rule is not None else None,
                           "gate_looks": (rule.look_sizes() if rule is not None and rule.test == "group-sequential"
                                          else None)}
    if rule is None:
        return out
    if rule.outcome_kind != "task_success":
        # the simulation draws pass/fail sessions at the control's task_success rates; a gate on another outcome
        # (the swarm's share of parts right) is not what it would simulate
        out["gate_sim_basis"] = {"skipped": f"the gate compares {rule.outcome_kind}; the simulation draws task_success"}
        log.warning("report: gate false-promotion rate not simulated (the gate compares %s)", rule.outcome_kind)
        return out
    scenario, basis = gate_scenario(facts, control_version, gate_interval_s, shares, error_statuses)
    out["gate_sim_basis"] = basis
    if scenario is None or scenario["champion_ratio"] <= 0:
        log.warning("report: gate false-promotion rate not simulated (%s)",
                    "no counted control-arm session" if scenario is None
                    else f"shares {shares} leave the champion none")
        return out
    from flywheel.serving import gate_sim

    out["gate_false_promotion_rate"] = gate_sim.false_promotion_rate(rule, gate_sim.Scenario(**scenario),
                                                                     challengers=SIM_CHALLENGERS, seed=0)
    out["gate_sim_scenario"] = scenario
    return out


def _rate(c: Count) -> float | None:
    return None if c.rate is None else round(c.rate, 4)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def plots(facts: Facts, out_dir: Path, final_since: float | None = None,
          error_statuses: tuple[str, ...] = ERROR_STATUSES) -> list[str]:
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
               yerr=[[max(0.0, r - lo) for r, (lo, _) in zip(rates, cis)],
                     [max(0.0, hi - r) for r, (_, hi) in zip(rates, cis)]],
               capsize=4,
               color=["#888888" if v == 0 else ("#2a9d8f" if v == facts.champion else "#8ab6d6") for v in versions])
        ax.set_ylabel("task success (95% CI)")
        ax.set_title("Success rate per policy version (production sessions)")
        fig.tight_layout()
        fig.savefig(out_dir / "success_by_version.png", dpi=110)
        plt.close(fig)
        written.append("success_by_version.png")
    if arms_plot(facts, out_dir, final_since, error_statuses):
        written.append("arms.png")
    series = [("session end -> lake", facts.session_to_lake_s), ("outcome -> episode", facts.outcome_to_episode_s),
              ("episode -> trained version", facts.episode_to_trained_s),
              ("trained -> served", facts.trained_to_served_s)]
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, values in series:
        if values:
            ordered = sorted(values)
            ax.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))],
                    label=f"{label} (p95 {p95(values):.1f}s)")
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


def arms_plot(facts: Facts, out_dir: Path, final_since: float | None,
              error_statuses: tuple[str, ...] = ERROR_STATUSES, bins: int = 12) -> bool:
    """arms.png: per router arm over the run (by session start, Wilson 95% intervals), the final window shaded: task
    success, and below it the share of one-part sessions whose first tool call took production's name."""
    import matplotlib.pyplot as plt

    counted = mature([r for r in facts.sessions if r.arm in ARMS and r.version is not None], math.inf, 0.0,
                     error_statuses).counted
    if not counted:
        return False
    t0 = min(r.started for r in counted)
    width = max(1.0, (max(r.started for r in counted) - t0) / bins)
    named = [r for r in facts.sessions if r.arm in ARMS and r.version is not None and r.session_id in facts.first_calls
             and r.task_type.removeprefix("tool_use.") in tasks.TOOLS]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    panels = ((top, counted, lambda r: int((r.outcome or 0.0) >= 0.5), "task success (95% CI)",
               "Success per router arm over time"),
              (bottom, named, lambda r: int(facts.first_calls[r.session_id] == r.task_type.removeprefix("tool_use.")),
               "first call takes production's\ntool name (95% CI)", "Adaptation to the production harness"))
    for ax, records, value, ylabel, title in panels:
        for k, (arm, colour) in enumerate(zip(ARMS, ("#888888", "#2a9d8f", "#e76f51"))):
            cells: dict[int, list[int]] = {}
            for r in records:
                if r.arm == arm:
                    cells.setdefault(min(bins - 1, max(0, int((r.started - t0) // width))), []).append(value(r))
            xs = sorted(cells)
            if not xs:
                continue
            rates = [sum(cells[x]) / len(cells[x]) for x in xs]
            cis = [wilson(sum(cells[x]), len(cells[x])) for x in xs]
            n = sum(len(v) for v in cells.values())
            # arms side by side within a bin, so their error bars do not hide each other
            ax.errorbar([((x + 0.35 + 0.15 * k) * width) / 60 for x in xs], rates,
                        yerr=[[r - lo for r, (lo, _) in zip(rates, cis)], [hi - r for r, (_, hi) in zip(rates, cis)]],
                        fmt="o-", capsize=3, color=colour, label=f"{arm} (n={n})")
        if final_since is not None:
            ax.axvspan((final_since - t0) / 60, bins * width / 60, color="#f4e285", alpha=0.4, label="final window")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend(fontsize=8)
    bottom.set_xlabel("minute of the run (session start)")
    fig.tight_layout()
    fig.savefig(out_dir / "arms.png", dpi=110)
    plt.close(fig)
    return True


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def _clock(epoch: float | None) -> str:
    return "?" if epoch is None else time.strftime("%H:%M:%S UTC", time.gmtime(epoch))


def _gate_test_line(s: dict[str, Any]) -> str:
    alpha = f" = {s['gate_alpha']}" if s.get("gate_alpha") is not None else ""
    if s.get("gate_test") == "group-sequential":
        looks = s.get("gate_looks") or []
        return ("- **The gate's test**: a group-sequential test in each one-sided direction on the "
                "task-type-stratified difference in success between concurrent, mature challenger and champion "
                f"sessions, with looks planned at {', '.join(map(str, looks))} sessions a side (each look reads the "
                "first that many of each side, in the order they matured) and O'Brien-Fleming type alpha spending, so "
                f"each challenger is promoted falsely with probability <= alpha{alpha} over all its looks, however "
                f"often the gate polls (every {s.get('gate_interval_s', '?')} s). Rollback: the mSPRT, valid "
                "at every look.")
    return ("- **The gate's test**: two one-sided mixture SPRTs (mSPRT) on the task-type-stratified difference in "
            "success between concurrent, mature challenger and champion sessions. An mSPRT is valid at every look, "
            f"so each challenger is promoted falsely with probability <= alpha{alpha} however often the gate looks "
            f"(every {s.get('gate_interval_s', '?')} s).")


def design_section(s: dict[str, Any]) -> list[str]:
    """What the control arm is, what the final window is, and what the gate's test guarantees."""
    share = f"{s['control_share']:.0%}" if s.get("control_share") is not None else "a fixed share"
    lines = ["## Measurement design", "",
             f"- **Control arm**: {share} of sessions, chosen by a sticky hash of the session id, are served by "
             f"policy-v{s['control_version']} for the whole run, whatever the gate does: a baseline on the same "
             "traffic, at the same time, with the same label delays.",
             f"- **Final window**: from {_clock(s['final_since'])} to the end of traffic the learner and the gate are "
             "stopped and the challenger alias is cleared, so every non-control session goes to the final champion. "
             "The headline counts only sessions that started in this window and after the champion's promotion: "
             "sessions the gate never saw when it chose the champion." if s["final_since"] is not None else
             "- **Final window**: none in this run (measure_s = 0), so there is no measurement the gate did not see.",
             _gate_test_line(s)]
    scenario, basis = s.get("gate_sim_scenario"), s.get("gate_sim_basis") or {}
    if s.get("gate_false_promotion_rate") is not None and scenario:
        rate = s["gate_false_promotion_rate"]
        se = math.sqrt(rate * (1.0 - rate) / basis.get("challengers", SIM_CHALLENGERS))
        lines.append(f"  Simulated at this run's traffic ({scenario['challenger_per_look']} challenger sessions per "
                     f"look, {scenario['champion_ratio']:.2f} champion sessions per challenger session, the control "
                     f"arm's success and mix per task type ({len(scenario['rates'])}) from n = "
                     f"{basis.get('n_control')} sessions): false-promotion rate **{rate:.3f}** (simulation s.e. "
                     f"{se:.3f}) over {basis.get('challengers')} simulated challengers with no true lift.")
    else:
        lines.append("  (false-promotion rate not simulated for this run: no gate rule given or no "
                     "control-arm session)")
    lines += ["- **Exclusions**: sessions that ended in an infrastructure error are excluded and counted apart; "
              "sessions without the verifier's task_success are unlabelled, not failures.", ""]
    return lines


def headline_section(s: dict[str, Any]) -> list[str]:
    """The final champion against the concurrent control, with both sample sizes, the lift's interval and p."""
    lines = ["## Headline: final champion vs concurrent control", ""]
    if s["final_since"] is None or s["final_window_start"] is None:
        why = ("no final window in this run" if s["final_since"] is None
               else "the champion is unknown (registry unreadable)")
        return lines + [f"Not measured: {why}; the final-window fields of summary.json are null. The whole-run numbers "
                        "below include the sessions on which the gate chose the champion, so they flatter it.", ""]
    lines += [f"Window: sessions started from {_clock(s['final_window_start'])} (the later of the final window's "
              f"start and the champion's promotion at {_clock(s['champion_promoted_ts'])}).", "",
              f"- final champion policy-v{s['champion_version']}: **{_pct(s['champion_final_success'])}** on "
              f"n = {s['n_champion_final']} sessions",
              f"- control policy-v{s['control_version']}: **{_pct(s['control_final_success'])}** on "
              f"n = {s['n_control_final']} sessions, same window"]
    if s["lift_points"] is not None:
        lo, hi = s["lift_ci95"]
        lines.append(f"- lift **{s['lift_points']:+.1f} points**, 95% CI [{lo:+.1f}, {hi:+.1f}] (Newcombe's hybrid "
                     f"score interval from two Wilson intervals); one-sided p = {s['p_value_final']:.3g} "
                     f"(two-proportion z-test, champion > control; n = {s['n_champion_final']} vs "
                     f"{s['n_control_final']})")
    else:
        lines.append("- lift: not computed, a side has no counted session in the window")
    if s.get("n_calls_champion_final") is not None:
        lines.append(f"- malformed tool calls: {_pct(s['malformed_share_champion_final'])} of the champion's "
                     f"{s['n_calls_champion_final']} calls, {_pct(s['malformed_share_control_final'])} of the "
                     f"control's {s['n_calls_control_final']} (all calls of the window's sessions, "
                     "sub-agents' included)")
    lines += [f"- excluded from the window: errored {s['n_champion_final_errored']} (champion) / "
              f"{s['n_control_final_errored']} (control); unlabelled {s['n_champion_final_unlabelled']} / "
              f"{s['n_control_final_unlabelled']}", ""]
    return lines


def whole_run_section(s: dict[str, Any]) -> list[str]:
    """base_success and champion_success as computed, every version and every arm, each with its sample size."""
    champion = s["champion_version"]
    lines = ["## Whole run, per version", "",
             "Definitions, exactly as computed: **base_success** is the task success of every session of the run "
             "served entirely by policy-v0, in any arm (the control arm throughout, the base phase before the learner "
             "started, and the champion arm before the first promotion or after a rollback to v0). "
             "**champion_success** is the same for the champion at the end (the registry's champion alias; policy-v0 "
             "when none is set) over the whole run, in any arm, including the challenger-arm sessions on which the "
             "gate selected it, so it is biased upward by that selection. Both exclude errored and unlabelled "
             "sessions; the test is a one-sided two-proportion z-test of champion > base.", "",
             f"- base (policy-v0): **{s['base_success']:.1%}** success on n = {s['n_base']} sessions",
             f"- champion (policy-v{champion}): **{s['champion_success']:.1%}** on n = {s['n_champion']} sessions"
             if champion is not None else "- champion: unknown (the registry was unreadable)",
             f"- ratio {s['success_ratio']}, one-sided p = {s['p_value']:.3g} "
             f"({'significant' if s['significant'] else 'NOT significant'} at 95% with >= 300 sessions each; "
             f"n = {s['n_champion']} vs {s['n_base']})",
             f"- control arm (policy-v{s['control_version']}, whole run): {_pct(s['control_success'])} on "
             f"n = {s['n_control']} sessions ({s['n_control_errored']} errored, {s['n_control_unlabelled']} "
             "unlabelled, excluded)",
             f"- versions published: {s['versions_published']} {s['versions']}; promotions by the gate: "
             f"{s['promotions']} {s['promoted_versions']}",
             "", "| version | sessions | success | 95% CI | errored | unlabelled |", "|---|---|---|---|---|---|"]
    for version, row in s["per_version"].items():
        lines.append(f"| policy-v{version} | {row['sessions']} | {row['success']:.1%} | {row['ci95'][0]:.1%} - "
                     f"{row['ci95'][1]:.1%} | {row['errored']} | {row['unlabelled']} |")
    lines += ["", "| arm | sessions | success | 95% CI | errored | unlabelled |", "|---|---|---|---|---|---|"]
    for arm, row in s["per_arm"].items():
        lines.append(f"| {arm} | {row['sessions']} | {_pct(row['success'])} | {row['ci95'][0]:.1%} - "
                     f"{row['ci95'][1]:.1%} | {row['n_errored']} | {row['n_unlabelled']} |")
    lines += ["", f"Sessions: {s['sessions']} ended ok; not counted for any version (a weight push mid-session, or no "
              f"llm_call): {s['mixed_version_sessions']}; episodes: {s['episodes']}.", ""]
    return lines


def tool_section(s: dict[str, Any]) -> list[str]:
    """Per tool: production-name share of first calls and success, in the final window per arm and by version."""
    tools = s.get("per_tool")
    if not tools:
        return []
    lines = ["## Per tool: adaptation to the production harness", "",
             "The demonstrations name each tool in one of three harness generations' conventions; production's tool "
             "server takes only the current one (infra/demo/tasks.py). **prod. name**: the share of one-part sessions "
             "whose first tool call used production's name; **older**: an older generation's name (the rest were "
             "malformed or another tool). Success as in the headline.", ""]
    final = tools.get("final")
    if final:
        lines += ["Final window:", "",
                  "| tool | control n | control prod. name | control success | champion n | champion prod. name | "
                  "champion success |", "|---|---|---|---|---|---|---|"]
        for tool in tasks.TOOLS:
            c, h = final["control"][tool], final["champion"][tool]
            lines.append(f"| {tool} | {c['sessions']} | {_pct(c['production_name'])} | {_pct(c['success'])} | "
                         f"{h['sessions']} | {_pct(h['production_name'])} | {_pct(h['success'])} |")
        lines.append("")
    lines += ["Whole run, by version (any arm):", "", "| version | " + " | ".join(tasks.TOOLS) + " |",
              "|---|" + "---|" * len(tasks.TOOLS)]
    for version, rows in tools["by_version"].items():
        cells = [f"{_pct(rows[t]['production_name'])} / {_pct(rows[t]['success'])} (n={rows[t]['sessions']})"
                 for t in tasks.TOOLS]
        lines.append(f"| policy-v{version} | " + " | ".join(cells) + " |")
    return lines + ["", "(each cell: prod. name / success (counted sessions))", ""]


def judge_section(s: dict[str, Any]) -> list[str]:
    """The shadow judge's agreement with the verifier (rewards/calibrate.py), with its sample sizes and the caveat."""
    if not s.get("judge_scored"):
        return ["## LLM judge (shadow mode)", "", "No session carries a judge score in this run.", ""]
    lines = ["## LLM judge (shadow mode)", "",
             "The judge is the policy's own base model (policy-v0 on the control arm's server), scoring a sample of "
             "tool-use sessions' whole trajectories in shadow mode: its scores are stored in `episodes.judge_score` "
             "and never enter the reward or the advantage. **A 3M-parameter model is a poor judge**: the point here is "
             "the path (the judge runs in the loop, its scores land beside the reward components, and its agreement "
             "with the verifier is measured), not the scores. Read the AUC below before giving any judge weight "
             "(docs/rewards.md).", "",
             f"- sessions scored: {s['judge_scored']}; with a verified {s.get('judge_outcome_kind')}: n = "
             f"{s['judge_n']}",
             f"- AUC of the score for success: **{_num(s.get('judge_auc'))}** (0.5: no better than a coin); "
             f"correlation with the outcome: {_num(s.get('judge_corr'))}"
             + (" (n/a: every verified session had the same outcome, or the judge gave one score)"
                if s.get("judge_auc") is None and s["judge_n"] else ""), "",
             "| group | n | successes | AUC | correlation |", "|---|---|---|---|---|"]
    for title, groups in (("task type", s.get("judge_by_task_type") or {}), ("judge", s.get("judge_by_version") or {})):
        lines += [f"| {title} {name} | {g['n']} | {g['n_success']} | {_num(g['auc'])} | {_num(g['corr'])} |"
                  for name, g in groups.items()]
    return lines + [""]


def _num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _early_text(early: dict[str, int] | None) -> str:
    """final_window.json's "early" (final_after_sessions): the traffic ended before `minutes`."""
    if not early:
        return ""
    return (f" at most: the final window started early, once policy-v{early['version']} had {early['sessions']} "
            "sessions with an outcome (final_after_sessions)")


def markdown(summary: dict[str, Any], images: list[str], context: dict[str, Any]) -> str:
    lines = ["# agent-flywheel demo report", "",
             f"Run: {context.get('started', '?')} to {context.get('ended', '?')} ({context.get('minutes', '?')} min of "
             f"traffic{_early_text(context.get('final_early'))}). Every number below is read from the lake (production "
             "sessions of the simulated agent) and the MLflow registry.", ""]
    if context.get("learning_claim") is False:
        lines += [f"**A smoke run: this report makes no learning claim.** It shows that every stage ran on "
                  f"{context.get('base_model', 'this model')} (the learner took {summary.get('learner_steps')} steps); "
                  "the run is too short, on too few cores, for a lift to mean anything. The numbers below are "
                  "what happened, not a measurement of what RL gains.", ""]
    lines += (design_section(summary) + headline_section(summary) + tool_section(summary) + whole_run_section(summary)
              + judge_section(summary))
    n = summary.get("freshness_n") or {}
    lines += ["## Freshness (p95)", "",
              f"- session end -> visible in the lake: {summary['p95_session_to_lake_s']} s (target < 10 s; "
              f"n = {n.get('session_to_lake', '?')} sessions)",
              f"- outcome arrival -> episode: {summary['p95_outcome_to_episode_s']} s (target < 30 s; "
              f"n = {n.get('outcome_to_episode', '?')} episodes)",
              f"- episode -> trained by a learner step: {summary.get('p95_episode_to_step_s')} s; -> in a published "
              f"version: {summary['p95_episode_to_trained_s']} s (n = {n.get('episode_to_trained', '?')} episodes)",
              f"- learner: {summary.get('learner_steps')} steps, {summary.get('learner_steps_per_min')} a minute over "
              f"its span; traffic {summary.get('sessions_per_s')} sessions/s",
              f"- trained -> served: {summary['p95_trained_to_served_s']} s (n = "
              f"{n.get('trained_to_served', '?')} versions)",
              ""]
    lines += [f"![{name}]({name})" for name in images]
    return "\n".join(lines) + "\n"


def write_report(out_dir: str | Path, lake_root: str, since: float, learner_run_dir: str | None, policies_dir: str,
                 tracking_uri: str, registered_model: str, context: dict[str, Any] | None = None,
                 final_since: float | None = None, control_version: int = 0, gate_rule: GateRule | None = None,
                 gate_interval_s: float = 10.0, shares: dict[str, float] | None = None) -> dict[str, Any]:
    """Gather, plot and write report.md + summary.json; returns the summary.

    final_since: epoch seconds when the final window began (None: the run had none); shares: the router's
    {"control": ..., "challenger": ...} shares; gate_rule and gate_interval_s: the gate's, for its simulation.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    errors = tuple(gate_rule.error_statuses) if gate_rule is not None else ERROR_STATUSES
    facts = lake_facts(lake_root, since, errors)
    learner_facts(facts, lake_root, learner_run_dir, policies_dir, since)
    registry_facts(facts, tracking_uri, registered_model, policies_dir, since)
    summary = summarize(facts, error_statuses=errors)
    summary.update(measurement(facts, final_since, control_version, errors))
    summary["per_tool"] = per_tool(facts, summary["final_window_start"], control_version, errors)
    summary.update(gate_simulation(facts, gate_rule, control_version, gate_interval_s, shares, errors))
    summary.update(calibrate.calibrate(lake_root))  # the shadow judge's agreement with the verifier
    summary.update({"control_share": (shares or {}).get("control"),
                    "challenger_share": (shares or {}).get("challenger"),
                    "gate_interval_s": gate_interval_s})
    context = dict(context or {})
    summary["report_written"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    summary.update({k: v for k, v in context.items() if k not in summary})
    images = plots(facts, out, final_since, errors)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    (out / "report.md").write_text(markdown(summary, images, context))
    return summary


def write_run_report(out_dir: str | Path, cfg: Any, plan: Any, tracking_uri: str, context: dict[str, Any],
                     final_since: float | None, since: float = 0.0) -> dict[str, Any]:
    """write_report for one demo run: its DemoConfig and RunPlan say where everything is and what the gate's
    rule and shares were (the demo at its end and `flywheel report --run-dir` both call this)."""
    from flywheel.demo.plan import CONTROL_VERSION

    context = {**context, "learning_claim": cfg.learning_claim, "base_model": str(cfg.base_model)}
    return write_report(out_dir, str(plan.lake_root), since, str(plan.learner_dir), str(plan.policies_dir),
                        tracking_uri, plan.registered_model, context=context, final_since=final_since,
                        control_version=CONTROL_VERSION, gate_rule=cfg.gate, gate_interval_s=cfg.gate_interval_s,
                        shares={"control": cfg.control_share, "challenger": cfg.challenger_share})


def run_report(run_dir: Path, out_dir: Path, tracking_uri: str) -> dict[str, Any]:
    """Rewrite a finished demo run's report from its folder (var/demo/<run id>), as the demo wrote it at the end.

    The folder holds demo.toml (the resolved DemoConfig), the lake, policies, learner and final_window.json;
    the registered model is named by the run id. `since` is 0: the run's lake and registered model hold only
    that run's data.
    """
    import tomllib

    from flywheel.base.config import resolve
    from flywheel.demo.plan import DemoConfig, RunPlan

    toml_path = run_dir / "demo.toml"
    if not toml_path.is_file():
        raise FileNotFoundError(f"{toml_path}: not a demo run folder (the demo writes demo.toml there at start)")
    cfg = resolve(DemoConfig, tomllib.loads(toml_path.read_text()), {}, {})
    plan = RunPlan(run_id=run_dir.name, var_dir=run_dir.parent.parent, traffic_s=cfg.minutes * 60.0)
    window_facts = plan.final_window()
    final = float(window_facts["since"]) if window_facts else None
    warm_path = Path(cfg.warm_model) / "warm_start.json"
    warm = json.loads(warm_path.read_text()) if cfg.warm_start and warm_path.exists() else {}
    context = {"run_id": plan.run_id, "minutes": cfg.minutes, "regenerated": True,
               "final_early": window_facts.get("early"),
               "warm_start": {k: warm.get(k) for k in ("steps", "final_success", "seconds")}}
    summary = write_run_report(out_dir, cfg, plan, tracking_uri, context, final)
    if cfg.scenario == "swarm":
        from flywheel.demo import swarm_report

        summary = swarm_report.write_for_run(out_dir, plan, summary)
    return summary


def main(argv: list[str] | None = None) -> int:
    """`flywheel report --run-dir var/demo/<run id>` rewrites that run's report; without --run-dir, from the flags."""
    import argparse

    from flywheel.base import defaults
    from flywheel.base.config import setup_logging

    parser = argparse.ArgumentParser(prog="flywheel report", description="write the demo report from the lake and "
                                                                         "the registry")
    parser.add_argument("--run-dir", type=Path, default=None,
                        help="a demo run's folder (var/demo/<run id>): every input below but the tracking URI "
                             "comes from it")
    parser.add_argument("--lake-root", default=defaults.LAKE_ROOT)
    parser.add_argument("--out", default=None, help="output folder (default: <run-dir>/report, or var/report)")
    parser.add_argument("--since", type=float, default=0.0, help="only sessions ending after this epoch time")
    parser.add_argument("--learner-run-dir", default="var/learner")
    parser.add_argument("--policies-dir", default=defaults.POLICIES_DIR)
    # the tracking store is the stack's, not the run's: the shared FLYWHEEL_MLFLOW_TRACKING_URI, as every process
    # reads it
    parser.add_argument("--mlflow-tracking-uri",
                        default=os.environ.get("FLYWHEEL_MLFLOW_TRACKING_URI", defaults.MLFLOW_TRACKING_URI))
    parser.add_argument("--registered-model", default=defaults.REGISTERED_MODEL)
    parser.add_argument("--final-since", type=float, default=None, help="epoch time the final window began "
                                                                        "(none: no window)")
    parser.add_argument("--control-version", type=int, default=0, help="the control arm's policy version")
    args = parser.parse_args(argv)
    setup_logging()
    if args.run_dir is not None:
        try:
            summary = run_report(args.run_dir, Path(args.out or args.run_dir / "report"), args.mlflow_tracking_uri)
        except FileNotFoundError as exc:
            parser.error(str(exc))
    else:
        summary = write_report(args.out or "var/report", args.lake_root, args.since, args.learner_run_dir,
                               args.policies_dir, args.mlflow_tracking_uri, args.registered_model,
                               final_since=args.final_since,
                               control_version=args.control_version)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
