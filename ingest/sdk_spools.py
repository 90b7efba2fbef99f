"""An SDK logger's spools: where each one lives, and the one it writes, replays from and adopts into.

The spool is per logger name and topic (<root>/<name>@<topic>, the name defaulting to the program's, without the
pid; the root is FLYWHEEL_SPOOL_DIR, else the user's state directory $XDG_STATE_HOME/flywheel/spool or
~/.local/state/flywheel/spool, never the host's working directory): a restarted agent replays its predecessor's
spool, and adopts the sibling spools (<spool>-<pid>) that dead processes of the same name and topic left behind
(each spool's owner.json says whose it is). The records themselves are ingest/spool.py's; delivery (when to spill,
when to replay) is the pipeline's (flywheel.ingest.sdk). Standard library only.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from flywheel.ingest.sdk_counters import Counters, WarnOnce
from flywheel.ingest.spool import SEGMENT_SUFFIX, Spool, SpoolLocked, read_owner

log = logging.getLogger("flywheel.ingest.sdk")  # the SDK's parts all log as the SDK: a host configures one logger

SPOOL_DIR_ENV = "FLYWHEEL_SPOOL_DIR"
LEGACY_SPOOL_ROOT = Path("var/spool")  # the default before the state directory, relative to the working directory


def _safe_name(text: str) -> str:
    """A name usable as one path component: [A-Za-z0-9._-], not starting with a dot or a dash."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", text).lstrip(".-")


def name_component(name: str) -> str:
    return _safe_name(name) or "python"


def default_spool_root() -> Path:
    """FLYWHEEL_SPOOL_DIR, else the user's state directory: a container's working directory is often read-only,
    and a spool there would be replayed only by an agent restarted in that same directory."""
    configured = os.environ.get(SPOOL_DIR_ENV)
    if configured:
        return Path(configured).expanduser()
    state = os.environ.get("XDG_STATE_HOME")
    # XDG: relative = unset
    base = Path(state) if state and Path(state).is_absolute() else Path.home() / ".local" / "state"
    return base / "flywheel" / "spool"


def default_spool_dir(name: str, topic: str) -> Path:
    """<root>/<name>@<topic>: one spool per logger name and topic (a SessionLogger and an OutcomeReporter
    of the same name must not replay each other's records into the wrong topic)."""
    return default_spool_root() / f"{name_component(name)}@{_safe_name(topic)}"


def default_journal_dir(name: str, topic: str) -> Path:
    """<root>/../journal/<name>@<topic>: a journal beside the spools, not among them (tools that list spools by
    name, the chaos audit among them, must not take one for a spool)."""
    return default_spool_root().with_name("journal") / f"{name_component(name)}@{_safe_name(topic)}"


class SpoolKeeper:
    """The spool of one logger (name, topic): opened when first needed, or at start when earlier processes left
    records; orphaned sibling spools adopted behind it; records spilled into it. `spool` is None until opened."""

    def __init__(self, name: str, topic: str, spool_dir: str | Path | None, spool_max_bytes: int, counts: Counters,
                 warn: WarnOnce) -> None:
        self.name, self.topic = name, topic
        # Resolved once: FLYWHEEL_SPOOL_DIR may change later in the host, but this logger's spool must not move.
        self.default_dir = default_spool_dir(name, topic)
        self.dir = Path(spool_dir) if spool_dir is not None else self.default_dir
        self.is_default = spool_dir is None
        self.spool_max_bytes = spool_max_bytes
        self.spool: Spool | None = None
        self._counts, self._warn = counts, warn

    def open_existing(self) -> None:
        """Replay what earlier processes of this name left: our own spool, then orphans (oldest first).

        An orphan is a sibling `<spool>-<pid>[-<n>]` whose lock is free: the spool of a dead process
        (or a closed logger) that could not take the main one, or of a forked child.
        """
        self._warn_old_path_spool()
        orphans = self._orphans()
        if orphans or any(self.dir.glob("*.seg")):
            self.open()
        if self.spool is None:
            return
        for directory in orphans:
            if directory != self.dir:
                self._adopt(directory)
        if len(self.spool):
            log.info("sdk %s: found %d spooled records in %s from an earlier run (%d adopted from %d orphaned "
                     "spools); replaying them", self.name, len(self.spool), self.dir, self._counts.adopted,
                     len(orphans))

    def _orphans(self) -> list[Path]:
        base = self.dir
        pattern = re.compile(re.escape(base.name) + r"-\d+(-\d+)?")
        try:
            found = [d for d in base.parent.iterdir()
                     if pattern.fullmatch(d.name) and d.is_dir() and self._may_adopt(d)]
        except OSError:  # no spool root yet: nothing left behind
            return []

        def age(directory: Path) -> float:  # the oldest segment's mtime; an orphan without one sorts first
            return min((p.stat().st_mtime for p in directory.glob(f"*{SEGMENT_SUFFIX}")), default=0.0)

        try:
            return sorted(found, key=age)
        except OSError:  # vanished while we looked (its owner closed it): try them in name order
            return sorted(found)

    def owner(self) -> dict[str, str]:
        return {"name": self.name, "topic": self.topic}

    def _may_adopt(self, directory: Path) -> bool:
        """Whether a sibling spool holds this logger's records: its owner marker says this name and topic.

        `spool/x-2` may be another logger's (an OutcomeReporter's, replayed into the wrong topic). A sibling without
        a marker (from a version before markers) is adopted only under the default layout, whose directory name
        itself says the name and topic.
        """
        owner = read_owner(directory)
        if owner is not None:
            if owner != self.owner():
                log.info("sdk %s: leaving spool %s alone: it belongs to %s, not %s", self.name, directory, owner,
                         self.owner())
            return owner == self.owner()
        default = self.default_dir
        if directory.parent.resolve() == default.parent.resolve() and re.fullmatch(
                re.escape(default.name) + r"-\d+(-\d+)?", directory.name):
            log.info("sdk %s: adopting %s, a spool without an owner marker (an older version's), by its name",
                     self.name, directory)
            return True
        self._warn(f"unmarked:{directory}", "sdk %s: spool %s has no owner marker and is not named for %s; not "
                  "adopted (move its records yourself if they are this logger's)", self.name, directory, self.owner())
        return False

    def _warn_old_path_spool(self) -> None:
        """Say once if a spool where older SDK versions kept it still holds records: <root>/<name> (before spools
        were per topic) and var/spool/<name>@<topic> under the working directory (before the state directory)."""
        if not self.is_default:
            return
        name = name_component(self.name)
        olds = (self.default_dir.parent / name, LEGACY_SPOOL_ROOT / name, LEGACY_SPOOL_ROOT / self.default_dir.name)
        for old in dict.fromkeys(olds):
            try:
                if old.resolve() == self.default_dir.resolve():
                    continue
                records = any(p.stat().st_size > 0 for p in old.glob(f"*{SEGMENT_SUFFIX}"))
            except OSError:
                continue
            if records:
                self._warn(f"old-path:{old}", "sdk %s: %s holds spooled records from an older SDK version (spools are "
                          "now per topic, under the state directory: %s); they are not replayed: move them into that "
                          "directory to replay them", self.name, old, self.default_dir)

    def _adopt(self, directory: Path) -> None:
        """Move an orphaned spool's records behind ours (fsynced before they leave it), then remove it."""
        try:
            orphan = Spool(directory, max_bytes=self.spool_max_bytes, segment_bytes=self._segment_bytes())
        except SpoolLocked:
            return  # its owner is alive
        except OSError as exc:
            self._warn("spool-adopt", "sdk %s: cannot open orphaned spool %s (%s); left for a later start",
                      self.name, directory, exc)
            return
        moved = 0
        try:
            while len(orphan):
                records = orphan.peek(2000)
                if not records:
                    break
                assert self.spool is not None, "an orphan is adopted into an open spool"
                self._counts.dropped_spool += self.spool.append(records)  # beyond our bound the oldest go, as always
                self.spool.sync()  # on disk here before the orphan lets go of them: a crash duplicates, never loses
                orphan.commit(len(records))
                moved += len(records)
        except OSError as exc:
            self._warn("spool-adopt", "sdk %s: adopting %s failed (%s); the rest stays there", self.name, directory,
                       exc)
        finally:
            orphan.close()  # an emptied spool removes itself
        self._counts.adopted += moved
        log.info("sdk %s: adopted %d records from orphaned spool %s", self.name, moved, directory)

    def _segment_bytes(self) -> int:
        return max(1024 * 1024, min(8 * 1024 * 1024, self.spool_max_bytes // 8))

    def open(self) -> Spool | None:
        if self.spool is not None:
            return self.spool
        # Another live logger of this name holds the main spool: take a sibling (a later start adopts it).
        own = self.dir.with_name(f"{self.dir.name}-{os.getpid()}")
        candidates = [self.dir, own, *(own.with_name(f"{own.name}-{n}") for n in range(1, 4))]
        for directory in candidates:
            owner = read_owner(directory)
            if owner is not None and owner != self.owner():  # the same spool_dir given to another logger
                self._warn(f"spool-owner:{directory}", "sdk %s: spool %s belongs to %s; using a sibling", self.name,
                          directory, owner)
                continue
            try:
                self.spool = Spool(directory, max_bytes=self.spool_max_bytes, segment_bytes=self._segment_bytes(),
                                    owner=self.owner())
                self.dir = directory
                return self.spool
            except SpoolLocked:
                continue
            except OSError as exc:
                self._warn("spool-open", "sdk %s: cannot open spool %s (%s); records that cannot be sent are dropped",
                          self.name, directory, exc)
                return None
        return None

    def spill(self, batch: list[tuple[bytes, bytes]]) -> None:
        spool = self.open()
        if spool is None:
            self._counts.dropped_spool += len(batch)
            return
        try:
            dropped = spool.append([value for _key, value in batch])
        except OSError as exc:
            self._counts.dropped_spool += len(batch)
            self._warn("spool-write", "sdk %s: spool write failed (%s); %d records dropped", self.name, exc, len(batch))
            return
        self._counts.spilled += len(batch)
        if dropped:
            self._counts.dropped_spool += dropped
            log.warning("sdk %s: spool %s over its %d bytes bound; dropped the %d oldest records (%d dropped in all)",
                        self.name, self.dir, self.spool_max_bytes, dropped, self._counts.dropped_spool)
