"""The trajectory lake: its layout, how a file is published, and how readers find new files.

Layout (Hive-style, readable by DuckDB, Spark, Trino or plain pyarrow with no project code):

    <root>/<table>/date=YYYY-MM-DD/<source>-<partition>-<first>-<last>.parquet

`table` is events, outcomes or episodes. For events and outcomes `source` is the Kafka topic,
`partition` the Kafka partition and first/last the first and last Kafka offset in the file,
so a range written again after a crash gets the same name and replaces, never duplicates.
Each file holds one contiguous offset range of one partition and one date. Writers of other
tables (the episode builder) use their own source name and a monotonically increasing
sequence number in place of the offset.

Publishing is write-to-hidden-temp then rename (atomic on a local or POSIX filesystem; on
object storage a single PUT of the final name is already atomic). Readers ignore names
starting with "." or "_". Compaction publishes a file covering several ranges before it
deletes them; a reader that sees both keeps only the covering file (`_drop_covered`), so no
reader ever sees a row twice or misses one.

Readers keep a cursor: {"<source>/<partition>": last offset consumed}. `files_since(cursor)`
returns the files with anything past it; rows at or below the cursor inside a file that
straddles it (only after compaction) are filtered by `rows_after_cursor`.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:  # pyarrow is an extra; keep it off the SDK's import path
    import pyarrow as pa
    import pyarrow.fs as pafs

TABLES = ("events", "outcomes", "episodes")
_NAME = re.compile(r"^(?P<source>.+)-(?P<partition>\d{4})-(?P<first>\d{20})-(?P<last>\d{20})\.parquet$")
Cursor = dict[str, int]


@dataclass(frozen=True, order=True)
class LakeFile:
    """One published, immutable lake file."""

    table: str
    date: str
    source: str
    partition: int
    first: int
    last: int
    path: str  # filesystem path (no scheme) as the lake's filesystem understands it

    @property
    def key(self) -> str:
        """The cursor key of this file's stream."""
        return cursor_key(self.source, self.partition)

    @property
    def rows_range(self) -> int:
        return self.last - self.first + 1


def cursor_key(source: str, partition: int) -> str:
    return f"{source}/{partition}"


def file_name(source: str, partition: int, first: int, last: int) -> str:
    assert 0 <= first <= last, f"bad range {first}..{last}"
    assert "/" not in source, f"source {source!r} must not contain '/'"
    return f"{source}-{partition:04d}-{first:020d}-{last:020d}.parquet"


def parse_file_name(name: str) -> tuple[str, int, int, int] | None:
    """(source, partition, first, last) of a published file name, or None for anything else."""
    m = _NAME.match(name)
    if m is None:
        return None
    return m["source"], int(m["partition"]), int(m["first"]), int(m["last"])


def filesystem(root: str) -> tuple["pafs.FileSystem", str]:
    """The pyarrow filesystem of a lake root and the root's path inside it.

    A plain path is the local filesystem; anything with a scheme (s3://, gs://, hdfs://,
    file://) goes through pyarrow, so the writer and readers have no local-only logic.
    """
    import pyarrow.fs as pafs

    if "://" in root:
        fs, path = pafs.FileSystem.from_uri(root)
        return fs, path.rstrip("/")
    return pafs.LocalFileSystem(), str(Path(root).resolve())


def _walk_table(fs: "pafs.FileSystem", base: str, table: str) -> Iterable[LakeFile]:
    import pyarrow.fs as pafs

    table_dir = f"{base}/{table}"
    if fs.get_file_info(table_dir).type == pafs.FileType.NotFound:
        return
    for info in fs.get_file_info(pafs.FileSelector(table_dir, recursive=True)):
        if info.type != pafs.FileType.File or info.base_name.startswith((".", "_")):
            continue
        parsed = parse_file_name(info.base_name)
        if parsed is None:
            continue
        parent = info.path.rsplit("/", 2)[-2]
        date = parent[len("date="):] if parent.startswith("date=") else ""
        source, partition, first, last = parsed
        yield LakeFile(table, date, source, partition, first, last, info.path)


def _drop_covered(files: list[LakeFile]) -> list[LakeFile]:
    """Keep only files not covered by a larger range of the same stream and date (mid-compaction)."""
    by_stream: dict[tuple[str, str, int], list[LakeFile]] = {}
    for f in files:
        by_stream.setdefault((f.date, f.source, f.partition), []).append(f)
    kept: list[LakeFile] = []
    for group in by_stream.values():
        # widest first: a file is dropped when an already-kept file contains its range
        group.sort(key=lambda f: (f.first, -f.last))
        reach = -1
        for f in group:
            if f.last <= reach:
                continue
            kept.append(f)
            reach = f.last
    return sorted(kept, key=lambda f: (f.source, f.partition, f.first, f.date))


def list_files(root: str, table: str) -> list[LakeFile]:
    """Every visible file of a table, ordered by stream and offset."""
    assert table in TABLES, f"unknown table {table!r}"
    fs, base = filesystem(root)
    return _drop_covered(list(_walk_table(fs, base, table)))


def files_since(root: str, table: str, cursor: Cursor) -> list[LakeFile]:
    """Files holding anything past the cursor (the incremental readers' hand-off)."""
    return [f for f in list_files(root, table) if f.last > cursor.get(f.key, -1)]


def advance(cursor: Cursor, files: Iterable[LakeFile]) -> Cursor:
    """The cursor after consuming `files` completely."""
    out = dict(cursor)
    for f in files:
        out[f.key] = max(out.get(f.key, -1), f.last)
    return out


def rows_after_cursor(table: "pa.Table", f: LakeFile, cursor: Cursor, offset_column: str = "_offset") -> "pa.Table":
    """Drop rows of a straddling file that the cursor already consumed."""
    done = cursor.get(f.key, -1)
    if f.first > done:
        return table
    import pyarrow.compute as pc

    return table.filter(pc.greater(table[offset_column], done))


def next_offsets(root: str, table: str, source: str) -> dict[int, int]:
    """For each partition of `source`, the first offset not yet in the lake (exactly-once recovery)."""
    out: dict[int, int] = {}
    for f in list_files(root, table):
        if f.source == source:
            out[f.partition] = max(out.get(f.partition, 0), f.last + 1)
    return out


def write_file(root: str, table: str, date: str, source: str, partition: int, first: int, last: int, data: "pa.Table",
               compression: str = "zstd") -> LakeFile:
    """Write `data` as one immutable file and publish it atomically under its range name."""
    import pyarrow.parquet as pq

    fs, base = filesystem(root)
    directory = f"{base}/{table}/date={date}"
    fs.create_dir(directory, recursive=True)
    final = f"{directory}/{file_name(source, partition, first, last)}"
    if "://" in root:
        # object stores publish a single PUT atomically and have no cheap rename
        pq.write_table(data, final, filesystem=fs, compression=compression)
    else:
        tmp = f"{directory}/.{uuid.uuid4().hex}.tmp"
        pq.write_table(data, tmp, filesystem=fs, compression=compression)
        # fsync before rename so a power loss cannot publish a name whose bytes are not on disk
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
    return LakeFile(table, date, source, partition, first, last, final)


def read_file(root: str, f: LakeFile) -> "pa.Table":
    import pyarrow.parquet as pq

    fs, _ = filesystem(root)
    return pq.read_table(f.path, filesystem=fs)


def load_cursor(path: Path) -> Cursor:
    """A durable reader cursor; an absent file is the empty cursor (read from the start)."""
    try:
        return {str(k): int(v) for k, v in json.loads(Path(path).read_text()).items()}
    except FileNotFoundError:
        return {}


def save_cursor(path: Path, cursor: Cursor) -> None:
    """Persist a cursor atomically (temp file, fsync, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    with open(tmp, "w") as fh:
        json.dump(cursor, fh, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
