"""What an SDK logger counts and warns about: one Counters object and one WarnOnce, shared by its delivery
pipeline, its spools and its encoder (flywheel.ingest.sdk). Standard library only: the SDK runs in the agent's
process."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

log = logging.getLogger("flywheel.ingest.sdk")  # the SDK's parts all log as the SDK: a host configures one logger


@dataclasses.dataclass
class Counters:
    """What a logger did with its records: one object shared by its pipeline, spools and encoder.

    Written without locks: exact where one thread writes a counter (the background thread, or the producer
    callbacks under the pipeline's lock); `invalid` and `dropped_full` are also written by host threads and may
    miss an increment under contention, acceptable for counters whose first occurrence is warned."""

    popped: int = 0  # taken off the host's queue by the background thread
    sent: int = 0  # acknowledged by Kafka
    spilled: int = 0  # written to the spool
    replayed: int = 0  # acknowledged by Kafka after a replay from the spool
    dropped_full: int = 0  # refused: the host's queue was full, or the logger closed
    dropped_spool: int = 0  # lost: the spool was over its bound, or could not be written
    invalid: int = 0  # dropped: missing or malformed fields, or past a schema limit
    coerced: int = 0  # values stored as their repr(): not JSON
    truncated: int = 0  # records with a value cut at a schema limit
    send_errors: int = 0
    rejected: int = 0  # refused by Kafka for good (too large, corrupt): dropped, named in a DLQ notice
    producer_restarts: int = 0
    adopted: int = 0  # records moved from the spools of dead processes of the same name and topic
    io_errors: int = 0  # OSErrors (disk full, EIO) that interrupted a background cycle
    limited: int = 0  # values cut or events dropped at a schema limit (MAX_JSON_DEPTH, MAX_TOKENS, ranges)
    oversized: int = 0  # records over the record cap: not sent, each named in a DLQ notice
    oversized_noticed: int = 0  # of those, notices the DLQ topic acknowledged

    def reset(self) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, 0)


class WarnOnce:
    """One warning per kind of problem; later ones are only counted (shown in the metrics log)."""

    def __init__(self) -> None:
        self._seen: dict[str, int] = {}

    def __call__(self, key: str, message: str, *args: Any) -> None:
        n = self._seen.get(key, 0)
        self._seen[key] = n + 1
        if n == 0:
            log.warning(message + " (further ones of this kind are only counted)", *args)
