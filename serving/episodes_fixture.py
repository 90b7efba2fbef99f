"""Synthetic episode rows in the lake, for the gate's tests and demos: sessions of given versions with given rewards.

Rows carry every column of ingest.schema.EPISODE_COLUMNS (the schema is derived, never restated)
and are written through ingest.lake.write_file, exactly as the episode builder publishes them.
"""

from __future__ import annotations

import datetime as _dt
import uuid
from typing import Any

from ingest import lake
from ingest.schema import EPISODE_COLUMNS, episode_arrow_schema

_FILLERS: dict[str, Any] = {"str": "", "int": 0, "float": 0.0, "ints": [], "floats": [], "json": None}


def episode_row(session_id: str, policy_version: int, reward: float, label_version: int = 1,
                episode_id: str | None = None) -> dict[str, Any]:
    now = _dt.datetime.now(_dt.timezone.utc)
    row: dict[str, Any] = {}
    for col in EPISODE_COLUMNS:
        row[col.name] = now if col.kind == "ts" else (_FILLERS.get(col.kind) if col.required else None)
    row.update(episode_id=episode_id or uuid.uuid4().hex, label_version=label_version, session_id=session_id,
               agent_id="a0", task_type="synthetic", model=f"policy-v{policy_version}", policy_version=policy_version,
               reward=reward, r_outcome=reward)
    return row


def write_sessions(lake_root: str, policy_version: int, rewards: list[float], calls_per_session: int = 2,
                   source: str = "gate-test") -> list[str]:
    """One file of sessions for a version: session i gets reward rewards[i] on each of its calls."""
    import pyarrow as pa

    rows, sessions = [], []
    for reward in rewards:
        session = f"s-{policy_version}-{uuid.uuid4().hex[:12]}"
        sessions.append(session)
        rows += [episode_row(session, policy_version, reward) for _ in range(calls_per_session)]
    existing = [f for f in lake.list_files(lake_root, "episodes") if f.source == source]
    first = max((f.last for f in existing), default=-1) + 1
    table = pa.Table.from_pylist(rows, schema=episode_arrow_schema())
    lake.write_file(lake_root, "episodes", _dt.date.today().isoformat(), source, 0, first, first + len(rows) - 1, table)
    return sessions
