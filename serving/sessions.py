"""Production sessions as the gate and the report see them: one row per session, read from the lake.

`read_sessions(lake_root)` -> list[SessionRecord]: when the session started and ended, its task
type, the policy version and the router's arm that served it (from its llm_calls), how it ended,
and the latest value of one outcome kind (the verifier's task_success by default). A session whose
calls were served by more than one version (it straddled a reload) has version None and counts for
nobody. Both the promotion gate (serving/promote.py) and the demo report read sessions through
this one function, so they cannot disagree on what a session is.

`mature(records, now, maturity_s, error_statuses)` splits sessions into those whose outcome window
has closed (they count), those still open (not yet), those that ended in an infrastructure error
and those whose window closed without the outcome (excluded and counted separately: an error the
version did not cause must not count as its failure).
"""

from __future__ import annotations

import datetime as _dt
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

from flywheel.base.versions import FROZEN_VERSION
from flywheel.ingest import lake

if TYPE_CHECKING:
    import duckdb

# session_end statuses of an infrastructure error, by default (the gate's rule and the demo report's)
ERROR_STATUSES = ("error",)


@dataclass(frozen=True)
class SessionRecord:
    session_id: str
    task_type: str
    version: int | None  # None: served by more than one version (or no llm_call)
    arm: str | None  # control | champion | challenger; None: no router logged one
    started: float  # epoch seconds of session_start (the first event when there is none)
    ended: float | None  # epoch seconds of the main agent's session_end; None: still running
    status: str | None  # the main agent's session_end status
    outcome: float | None  # the latest value of the outcome kind; None: none arrived yet
    outcome_ts: float | None = None
    # what the gate's guardrails read (serving/decision.py): what a reward-hacking policy moves first
    malformed: int = 0  # tool calls in the session (any agent) the harness could not parse
    tool_calls: int = 0  # tool calls in the session (any agent), parsed or not
    tokens: int | None = None  # prompt + completion tokens over its llm_calls (the session's cost); None: no call
    judge: float | None = None  # the LLM judge's first score of the session (None: not judged, or not read)

    @property
    def latency_s(self) -> float | None:
        """Wall time from the session's start to the main agent's end; None while it runs."""
        return None if self.ended is None else max(0.0, self.ended - self.started)


@dataclass
class Maturity:
    """Sessions split by whether they may be counted now."""

    counted: list[SessionRecord] = field(default_factory=list)
    open: int = 0  # still running, or ended less than maturity_s ago
    errored: int = 0  # ended in an infrastructure error: excluded
    unlabelled: int = 0  # window closed without the outcome: excluded


def epoch(value: object) -> float | None:
    """Epoch seconds of a timestamp as DuckDB returns it (a naive datetime is UTC), or of a number; None stays None."""
    if value is None:
        return None
    if isinstance(value, _dt.datetime):
        return (value if value.tzinfo else value.replace(tzinfo=_dt.timezone.utc)).timestamp()
    return float(value)  # type: ignore[arg-type]


def _session_outcomes_view(con: "duckdb.DuckDBPyConnection", lake_root: str, outcomes: list[str]) -> None:
    """View `oc`: the outcomes about whole sessions. One about one agent (a sub-agent's part) or one tool call
    (a turn check, schema v2) is narrower than the session and says nothing of the session's success."""
    if not outcomes:
        con.execute("CREATE VIEW oc AS SELECT NULL::VARCHAR AS session_id, NULL::VARCHAR AS kind, "
                    "NULL::DOUBLE AS value, NULL::TIMESTAMPTZ AS ts WHERE false")
        return
    lake.sql_view(con, "oc_all", lake_root, "outcomes", outcomes)
    cols = {r[0] for r in con.execute("DESCRIBE oc_all").fetchall()}
    narrow = " AND ".join(f"{c} IS NULL" for c in ("agent_id", "call_id") if c in cols) or "true"
    con.execute(f"CREATE VIEW oc AS SELECT session_id, kind, value, ts FROM oc_all WHERE {narrow}")


# A session's version is that of its policy's calls: a frozen model's (the swarm's sub-agents, FROZEN_VERSION) are
# not the version under test, and would make every spawned session mixed.
POLICY_CALLS = f"policy_version <> {FROZEN_VERSION}"


def read_sessions(lake_root: str, outcome_kind: str = "task_success", outcome_within_s: float | None = None,
                  judge: bool = False) -> list[SessionRecord]:
    """Every session in the lake's events, with its serving version and arm, end and latest outcome.

    outcome_within_s: only outcomes that arrived within this many seconds of the session's end count
    (the gate passes its maturity window), so a session counted at one look keeps its value at every
    later one: a late or revised outcome cannot change a sample the sequential test already saw.
    judge: also read each session's judge score from the episodes (its latest label's), for the gate's judge
    guardrail; off, `judge` stays None and the episodes are not read."""
    import duckdb

    events = [f.path for f in lake.list_files(lake_root, "events")]
    if not events:
        return []
    outcomes = [f.path for f in lake.list_files(lake_root, "outcomes")]
    con = duckdb.connect()
    try:
        con.execute("SET TimeZone='UTC'")
        lake.sql_view(con, "ev", lake_root, "events", events)
        columns = {r[0] for r in con.execute("DESCRIBE ev").fetchall()}
        has_arm = "arm" in columns
        arm = "min(arm)" if has_arm else "NULL"
        malformed = ("count(*) FILTER (WHERE type = 'tool_call' AND malformed)" if "malformed" in columns else "0")
        # a traced_llm_call (schema v5: a model call known from an OpenTelemetry span) counts like a captured one:
        # its version and arm when it says them, its tokens from the span's usage (it has no token ids)
        traced = "input_tokens" in columns
        call_types = "('llm_call', 'traced_llm_call')" if traced else "('llm_call')"
        tokens = ("coalesce(len(prompt_token_ids) + len(completion_token_ids), CASE WHEN input_tokens IS NULL AND "
                  "output_tokens IS NULL THEN NULL ELSE coalesce(input_tokens, 0) + coalesce(output_tokens, 0) END)"
                  if traced else "len(prompt_token_ids) + len(completion_token_ids)")
        _session_outcomes_view(con, lake_root, outcomes)
        _judge_view(con, lake_root, judge)
        rows = con.execute(
            f"""
            WITH firsts AS (SELECT session_id, min(ts) AS first_ts FROM ev GROUP BY 1),
                 starts AS (SELECT session_id, min(ts) AS start_ts, arg_min(task_type, ts) AS task_type
                            FROM ev WHERE type = 'session_start' AND parent_agent_id IS NULL GROUP BY 1),
                 calls AS (SELECT session_id, min(policy_version) FILTER (WHERE {POLICY_CALLS}) AS vmin,
                                  max(policy_version) FILTER (WHERE {POLICY_CALLS}) AS vmax,
                                  {arm} AS arm, count(DISTINCT {"arm" if has_arm else "NULL"}) AS arms,
                                  sum({tokens}) AS tokens
                           FROM ev WHERE type IN {call_types} GROUP BY 1),
                 bad AS (SELECT session_id, {malformed} AS malformed,
                                count(*) FILTER (WHERE type = 'tool_call') AS tool_calls FROM ev GROUP BY 1),
                 ends AS (SELECT session_id, max(ts) AS end_ts, arg_max(status, ts) AS status
                          FROM ev WHERE type = 'session_end' AND parent_agent_id IS NULL GROUP BY 1),
                 verdicts AS (SELECT o.session_id, arg_max(o.value, o.ts) AS value, max(o.ts) AS outcome_ts
                              FROM oc o LEFT JOIN ends e2 ON o.session_id = e2.session_id
                              WHERE o.kind = ? AND (? IS NULL OR e2.end_ts IS NULL
                                                    OR epoch(o.ts) <= epoch(e2.end_ts) + ?)
                              GROUP BY 1)
            SELECT f.session_id, s.task_type, c.vmin, c.vmax, c.arm, c.arms, coalesce(s.start_ts, f.first_ts),
                   e.end_ts, e.status, d.value, d.outcome_ts, b.malformed, b.tool_calls, c.tokens, j.score
            FROM firsts f LEFT JOIN starts s USING (session_id) LEFT JOIN calls c USING (session_id)
                 LEFT JOIN ends e USING (session_id) LEFT JOIN verdicts d USING (session_id)
                 LEFT JOIN bad b USING (session_id) LEFT JOIN judged j USING (session_id)
            """, [outcome_kind, outcome_within_s, outcome_within_s or 0.0]).fetchall()
    finally:
        con.close()
    return [_record(row) for row in rows]


def _record(row: tuple[Any, ...]) -> SessionRecord:
    sid, task_type, vmin, vmax, arm_value, arms, start, end, status, value, outcome_ts, bad, calls, tokens, score = row
    version = int(vmin) if vmin is not None and vmin == vmax else None
    return SessionRecord(str(sid), task_type or "unknown", version, arm_value if (arms or 0) <= 1 else None,
                         epoch(start) or 0.0, epoch(end), status,
                         float(value) if value is not None and math.isfinite(value) else None,
                         epoch(outcome_ts), int(bad or 0), int(calls or 0), None if tokens is None else int(tokens),
                         float(score) if score is not None else None)


def _judge_view(con: "duckdb.DuckDBPyConnection", lake_root: str, wanted: bool) -> None:
    """View `judged`: each session's judge score, from the first of its episodes' labels that carries one (none
    unless `wanted`). The first, not the latest: a score the gate has tested must not change under it."""
    episodes = [f.path for f in lake.list_files(lake_root, "episodes")] if wanted else []
    if not episodes:
        con.execute("CREATE VIEW judged AS SELECT NULL::VARCHAR AS session_id, NULL::DOUBLE AS score WHERE false")
        return
    lake.sql_view(con, "ep", lake_root, "episodes", episodes)
    if "judge_score" not in {r[0] for r in con.execute("DESCRIBE ep").fetchall()}:
        con.execute("CREATE VIEW judged AS SELECT NULL::VARCHAR AS session_id, NULL::DOUBLE AS score WHERE false")
        return
    con.execute("CREATE VIEW judged AS SELECT session_id, arg_min(judge_score, label_version)::DOUBLE AS score "
                "FROM ep WHERE judge_score IS NOT NULL GROUP BY 1")


def mature(records: Iterable[SessionRecord], now: float, maturity_s: float,
           error_statuses: Iterable[str] = ERROR_STATUSES) -> Maturity:
    """Split sessions by whether their outcome window (maturity_s after the session ended) has closed at `now`."""
    errors = set(error_statuses)
    out = Maturity()
    for r in records:
        if r.ended is not None and r.status in errors:
            out.errored += 1
        elif r.ended is None or now - r.ended < maturity_s:
            out.open += 1  # even with an outcome in: a later one of the same kind may still replace it
        elif r.outcome is None:
            out.unlabelled += 1
        else:
            out.counted.append(r)
    return out
