"""Lake compaction: `flywheel compact [--lake-root var/lake] [--before 2026-11-30]`.

Merges runs of contiguous small files of closed date partitions per (topic, partition) into
files named by the covering range: it publishes the merged file first, then deletes the
originals; in between `lake.list_files` shows only the covering file, so no reader sees a row
twice or misses one. A compaction killed in between leaves covered files, which the next one
deletes. Its own process beside the lake writer (a cron job, say), never inside it.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from dataclasses import dataclass
from typing import Any

from flywheel.base import defaults
from flywheel.base.config import ConfigError, load_config, setting, setup_logging
from flywheel.ingest import lake

log = logging.getLogger(__name__)


@dataclass
class CompactConfig:
    """Merge small files of closed date partitions of the lake."""

    lake_root: str = setting(defaults.LAKE_ROOT, "lake root: a local path or a pyarrow filesystem URI")
    before: str | None = setting(None, "compact date partitions strictly before this date (default: today, UTC)")
    tables: list[str] = setting(["events", "outcomes"], "tables to compact")
    small_file_bytes: int = setting(32 * 1024 * 1024, "files smaller than this are merge candidates")
    target_rows: int = setting(1_000_000, "a merged file holds at most this many offsets")
    compression: str = setting("zstd", "Parquet compression codec")
    dry_run: bool = setting(False, "only print what would be merged")
    stale_temp_s: float = setting(3600.0, "delete temp files of killed writers older than this in closed dates")
    log_level: str = setting("INFO", "logging level")

    def check(self) -> None:
        if self.before is not None:
            try:
                dt.date.fromisoformat(self.before)
            except ValueError:
                raise ConfigError(f"before: {self.before!r} is not a date YYYY-MM-DD") from None
        bad = [t for t in self.tables if t not in ("events", "outcomes")]
        if bad:
            raise ConfigError(f"tables: {bad} cannot be compacted (events, outcomes only)")
        if self.target_rows < 2:
            raise ConfigError("target_rows: must be >= 2")


def plan_compaction(files: list[lake.LakeFile], sizes: dict[str, int], before: str, small_file_bytes: int,
                    target_rows: int) -> list[list[lake.LakeFile]]:
    """Runs of contiguous small files (one stream, one closed date) to merge, each run >= 2 files.

    Pure: `files` are the visible files (covered ones removed), `sizes` their byte sizes.
    """
    groups: dict[tuple[str, str, int], list[lake.LakeFile]] = {}
    for f in files:
        if f.date and f.date < before:
            groups.setdefault((f.date, f.source, f.partition), []).append(f)
    runs: list[list[lake.LakeFile]] = []
    for group in groups.values():
        group.sort(key=lambda f: f.first)
        run: list[lake.LakeFile] = []
        for f in group:
            small = sizes.get(f.path, 0) < small_file_bytes
            fits = bool(run) and f.first == run[-1].last + 1 and f.last - run[0].first + 1 <= target_rows
            if small and fits:
                run.append(f)
                continue
            if len(run) >= 2:
                runs.append(run)
            run = [f] if small else []
        if len(run) >= 2:
            runs.append(run)
    return runs


def _delete_stale_temps(fs: Any, root: str, table: str, before: str, older_than_s: float) -> int:
    """Remove temp files a killed writer left in closed date partitions (late events may still be
    written into a closed date, so only temps older than `older_than_s` go)."""
    import pyarrow.fs as pafs

    base = lake.filesystem(root)[1]
    table_dir = f"{base}/{table}"
    if fs.get_file_info(table_dir).type == pafs.FileType.NotFound:
        return 0
    now = time.time()
    count = 0
    for info in fs.get_file_info(pafs.FileSelector(table_dir, recursive=True)):
        parent = info.path.rsplit("/", 2)[-2]
        if (info.type == pafs.FileType.File and info.base_name.startswith(".") and info.base_name.endswith(".tmp")
                and parent.startswith("date=") and parent[5:] < before and info.mtime is not None
                and now - info.mtime.timestamp() > older_than_s):
            fs.delete_file(info.path)
            count += 1
    return count


def compact(cfg: CompactConfig) -> dict[str, int]:
    """Merge runs of small files; publish each merged file before deleting what it covers."""
    import pyarrow as pa
    import pyarrow.fs as pafs
    from rich.progress import Progress

    before = cfg.before or dt.datetime.now(dt.timezone.utc).date().isoformat()
    fs, _ = lake.filesystem(cfg.lake_root)
    totals = {"runs": 0, "merged_files": 0, "leftovers_deleted": 0, "stale_temps_deleted": 0}
    for table in cfg.tables:
        on_disk = lake.list_all_files(cfg.lake_root, table)
        visible = lake.list_files(cfg.lake_root, table)
        # files covered by a visible one are leftovers of a compaction that died before deleting them
        leftovers = [f for f in set(on_disk) - set(visible) if f.date and f.date < before]
        if leftovers and not cfg.dry_run:
            totals["leftovers_deleted"] += lake.delete_files(cfg.lake_root, leftovers)
        if not cfg.dry_run:
            totals["stale_temps_deleted"] += _delete_stale_temps(fs, cfg.lake_root, table, before, cfg.stale_temp_s)
        infos = fs.get_file_info([f.path for f in visible])
        sizes = {i.path: i.size for i in infos if i.type == pafs.FileType.File}
        runs = plan_compaction(visible, sizes, before, cfg.small_file_bytes, cfg.target_rows)
        log.info("compact: %s: %d runs of small files before %s", table, len(runs), before)
        if cfg.dry_run:
            for r in runs:
                log.info("compact: would merge %s-%d %d..%d (%d files, %s)", r[0].source, r[0].partition,
                         r[0].first, r[-1].last, len(r), r[0].date)
            totals["runs"] += len(runs)
            continue
        with Progress(transient=True) as progress:
            task = progress.add_task(f"compact {table}", total=len(runs))
            for r in runs:
                parts = [lake.read_file(cfg.lake_root, f) for f in r]
                merged = pa.concat_tables(parts, promote_options="default")
                lake.write_file(cfg.lake_root, table, r[0].date, r[0].source, r[0].partition, r[0].first, r[-1].last,
                                merged, compression=cfg.compression)
                lake.delete_files(cfg.lake_root, r)
                totals["runs"] += 1
                totals["merged_files"] += len(r)
                progress.advance(task)
    log.info("compact: done %s", totals)
    return totals


def main(argv: list[str] | None = None) -> int:
    cfg = load_config(CompactConfig, argv, prog="flywheel compact")
    setup_logging(cfg.log_level)
    compact(cfg)
    return 0
