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

Range claims (how several writers, zombies included, never publish overlapping ranges).
Before publishing offsets F..L of a stream, a writer claims F: it creates
`<root>/_claims/<table>/<source>-<partition>/<F>.json` holding {last, date} with an
exclusive create. Whoever claims F first fixes where that file ends and which date it
lands in; any other writer holding records from F (a stale owner after a rebalance, or
the new owner re-reading after a crash between claim and publish) conforms: it publishes
exactly F..L in that date, an identical name with identical rows, and continues at L+1.
Every file therefore starts at a claimed offset and ends where its claim says, so two
files of one stream never partly overlap. Claims are kept (a few bytes each): deleting
the claim of a range a zombie still holds would let it claim a different end.
On a local filesystem the exclusive create is a hard link (atomic, fails if the name
exists). On S3 (and S3-compatible stores) it is a conditional PUT, `If-None-Match: *`: the
store creates the key only if it is absent and answers 412 otherwise, atomically, so of two
writers racing on one offset exactly one wins. pyarrow's S3FileSystem cannot send that
header, so the claim alone goes through a small SigV4-signed request (`s3_put_if_absent`, the
standard library only); the endpoint and credentials are the environment variables pyarrow
reads too (AWS_ENDPOINT_URL[_S3], AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN,
AWS_REGION). Other remote schemes (gs://, hdfs://) keep a check-then-write claim: two writers
claiming one offset within a round trip of each other (only a stale owner racing the new one)
could both win there.

Readers keep a cursor: {"<source>/<partition>": last offset consumed}. `files_since(cursor)`
returns the files with anything past it; rows at or below the cursor inside a file that
straddles it (only after compaction) are filtered by `rows_after_cursor`.

Listing by cursor (the claims are the manifest). Every published file is claimed first
(`write_file` claims unless its caller already did), and a writer opens each file where the
last one of its stream ended, offsets missing from the log included, so a stream's claims form
a chain: the file after one ending at L starts at L + 1, and the claim on L + 1 names its end
and date, hence its path. `files_since` follows that chain from each stream's cursor + 1: a
read of the claim and a look at the file per new file, and one missed look per stream when
nothing is new, so its cost grows with new files and streams, never with the table. A claim
is made before its file is published, so there is no window in which a published file is
missing from the manifest; a claimed file not yet published ends the chain until it is (the
claim fixes its range: the writer, or the next owner, publishes exactly it). A claimed file
that is gone was merged by a compaction: one listing of the claim's date finds the covering
file. The whole table is listed only for what the chain cannot know: a reader's first call
in a process (`full`), a stream new to the cursor, and files written without claims.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import hmac
import http.client
import json
import os
import re
import time
import urllib.parse
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

from flywheel.base.atomic import Durability, write_json, write_with

if TYPE_CHECKING:  # pyarrow and duckdb are extras; keep them off the SDK's import path
    import duckdb
    import pyarrow as pa
    import pyarrow.dataset as pa_dataset
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

    A remote filesystem is made once per root, process and credentials (the AWS_* / GOOGLE_* variables it
    reads): building an S3FileSystem costs ~20 ms of CPU, and the writer asked for one up to five times per
    published file (docs/lake.md, "Against Quix Streams"). pyarrow's filesystems are safe to share across threads.
    """
    import pyarrow.fs as pafs

    if "://" in root:
        key = (root, os.getpid(), *sorted((k, v) for k, v in os.environ.items() if k.startswith(_FS_ENV)))
        cached = _FILESYSTEMS.get(key)
        if cached is None:
            fs, path = pafs.FileSystem.from_uri(root)
            cached = _FILESYSTEMS.setdefault(key, (fs, path.rstrip("/")))
        return cached
    return pafs.LocalFileSystem(), str(Path(root).resolve())


# what a remote filesystem is configured from, beyond its URI (endpoint, keys, checksums, CA bundle, profile
# files ...): a change of any such variable makes a new one
_FS_ENV = ("AWS_", "GOOGLE_", "STORAGE_EMULATOR")
_FILESYSTEMS: dict[tuple[Any, ...], tuple["pafs.FileSystem", str]] = {}


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


def files_since(root: str, table: str, cursor: Cursor, owns: Callable[[int], bool] | None = None,
                limit: int | None = None, full: bool = False) -> list[LakeFile]:
    """Files holding anything past the cursor (the incremental readers' hand-off), by stream and offset.

    Listing by cursor (see "Listing by cursor" in the module docstring): each stream the cursor knows
    is followed along its claims from its cursor + 1, so the cost grows with the new files and the
    number of streams, not with the table. The whole table is listed instead when `full` is asked
    (a reader's first call in a process), or when an owned stream is new to the cursor or has no
    claims (written before every table was claimed).
    owns: only streams of these partitions; limit: at most this many files per stream (the first ones).
    """
    assert table in TABLES, f"unknown table {table!r}"
    keep = owns or (lambda partition: True)
    fs, base = filesystem(root)
    streams = {s for s in _claimed_streams(fs, base, table) if keep(s[1])}
    known = {k: v for k, v in cursor.items() if keep(int(k.rsplit("/", 1)[1]))}
    claimed = {cursor_key(*s) for s in streams}
    new_stream, unclaimed = bool(claimed - known.keys()), bool(known.keys() - claimed)
    if full or not known or new_stream or unclaimed:
        files = [f for f in list_files(root, table) if keep(f.partition) and f.last > cursor.get(f.key, -1)]
        return _first_per_stream(files, limit)
    out: list[LakeFile] = []
    for source, partition in sorted(streams):
        out.extend(_follow(fs, base, table, source, partition, known[cursor_key(source, partition)], limit))
    return out


def _first_per_stream(files: list[LakeFile], limit: int | None) -> list[LakeFile]:
    if limit is None:
        return files
    seen: dict[str, int] = {}
    out = []
    for f in files:  # ordered by stream and offset
        seen[f.key] = seen.get(f.key, 0) + 1
        if seen[f.key] <= limit:
            out.append(f)
    return out


_STREAM_DIR = re.compile(r"^(?P<source>.+)-(?P<partition>\d{4})$")


def _claimed_streams(fs: "pafs.FileSystem", base: str, table: str) -> set[tuple[str, int]]:
    """(source, partition) of every stream with claims: one level of `_claims/<table>/`, one entry per stream."""
    import pyarrow.fs as pafs

    found = set()
    selector = pafs.FileSelector(f"{base}/{CLAIMS_DIR}/{table}", allow_not_found=True)
    for info in fs.get_file_info(selector):
        m = _STREAM_DIR.match(info.base_name)
        if info.type == pafs.FileType.Directory and m is not None:
            found.add((m["source"], int(m["partition"])))
    return found


def _follow(fs: "pafs.FileSystem", base: str, table: str, source: str, partition: int, after: int,
            limit: int | None) -> list[LakeFile]:
    """The stream's published files after offset `after`, along its claims: the file after one ending at L
    starts at L + 1 (the writers open each file where the last one ended, gaps included), and the claim
    on L + 1 names its end and date. Stops at the first offset nobody claimed (nothing newer) or claimed
    but not published (a writer between claim and publish: the next call finds it)."""
    import pyarrow.fs as pafs

    out: list[LakeFile] = []
    first = after + 1
    while limit is None or len(out) < limit:
        claim_path = _claim_path(base, table, source, partition, first)
        if fs.get_file_info(claim_path).type == pafs.FileType.NotFound:
            break
        with fs.open_input_stream(claim_path) as fh:
            claim = _parse_claim(first, fh.read().decode())
        path = f"{base}/{table}/date={claim.date}/{file_name(source, partition, first, claim.last)}"
        if fs.get_file_info(path).type == pafs.FileType.File:
            found: LakeFile | None = LakeFile(table, claim.date, source, partition, first, claim.last, path)
        else:
            found = _covering(fs, base, table, claim, source, partition)
        if found is None:
            break
        out.append(found)
        first = found.last + 1
    return out


def _covering(fs: "pafs.FileSystem", base: str, table: str, claim: Claim, source: str,
              partition: int) -> LakeFile | None:
    """The file holding a claimed range whose own file is gone: the covering file a compaction published
    (it starts at or before the claim and reaches past it, in the claim's date), or None while the claimed
    file is not published yet. Lists one date of the table: compaction is the only rare path here."""
    import pyarrow.fs as pafs

    directory = f"{base}/{table}/date={claim.date}"
    cover = None
    for info in fs.get_file_info(pafs.FileSelector(directory, allow_not_found=True)):
        parsed = parse_file_name(info.base_name)
        if info.type != pafs.FileType.File or parsed is None or parsed[:2] != (source, partition):
            continue
        _, _, first, last = parsed
        if first <= claim.first <= last and (cover is None or last > cover.last):
            cover = LakeFile(table, claim.date, source, partition, first, last, info.path)
    return cover


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
    return offsets_after(list_files(root, table), source)


def offsets_after(files: Iterable[LakeFile], source: str) -> dict[int, int]:
    """next_offsets over a listing already made."""
    out: dict[int, int] = {}
    for f in files:
        if f.source == source:
            out[f.partition] = max(out.get(f.partition, 0), f.last + 1)
    return out


def stream_tail(root: str, files: Iterable[LakeFile], column: str, n: int) -> list[Any]:
    """The `column` values of the last `n` rows of one stream (the files of one source and partition),
    in offset order: how the lake writer rebuilds its de-duplication window on every assignment.

    Reads only that column and `_offset`, newest files first, and stops once it has n rows, so its cost is
    bounded by the window (plus any zero-row files among those), not by the stream's history. A file deleted
    between the listing and the read (`flywheel compact` merged it into a covering file) makes it list the
    stream again and start over, rather than fail the caller (the writer's rebalance).
    """
    files = list(files)
    assert len({(f.source, f.partition) for f in files}) <= 1, "stream_tail reads one stream"
    for _attempt in range(_TAIL_ATTEMPTS):
        tail = _read_tail(root, files, column, n)
        if tail is not None:
            return tail
        f = files[0]
        files = [g for g in list_files(root, f.table) if (g.source, g.partition) == (f.source, f.partition)]
    raise RuntimeError(f"lake: the files of {files[0].key if files else '?'} kept disappearing while their last "
                       f"{n} rows were read ({_TAIL_ATTEMPTS} listings); is a compaction deleting them in a loop?")


_TAIL_ATTEMPTS = 5  # a compaction deletes each file once: a second listing already sees the covering file


def _read_tail(root: str, files: list[LakeFile], column: str, n: int) -> list[Any] | None:
    """stream_tail over one listing; None when a listed file is gone (list again)."""
    import pyarrow as pa

    parts: list[pa.Table] = []
    have = 0
    for f in sorted(files, key=lambda f: f.first, reverse=True):
        if have >= n:
            break
        try:
            # one file at a time (a dataset would take a zero-row file's column types for all of them)
            part = read_file(root, f, [column, "_offset"])
        except LakeFileGone:
            return None
        parts.append(part)
        have += part.num_rows
    if not parts or n <= 0:
        return []
    tail = pa.concat_tables(parts, promote_options="permissive").sort_by("_offset")
    return tail.slice(max(0, tail.num_rows - n)).column(column).to_pylist()


def write_file(root: str, table: str, date: str, source: str, partition: int, first: int, last: int, data: "pa.Table",
               compression: str = "zstd", claimed: bool = False) -> LakeFile:
    """Write `data` as one immutable file and publish it atomically under its range name.

    The range is claimed first unless the caller already did (`claimed`: the lake writer claims before
    it decides the range), so every published file is on its stream's claim chain, which is how readers
    list by cursor. A claim already in force must be this range, or a narrower one in the same date that
    this file covers (a compaction's merged file); anything else would publish a file no reader finds.
    """
    import pyarrow.parquet as pq

    if not claimed:
        claim = claim_range(root, table, source, partition, first, last, date)
        if claim.date != date or claim.last > last:
            raise ValueError(f"lake: {table} {source}-{partition} {first}..{last} ({date}) conflicts with the claim in "
                             f"force on {first} (..{claim.last}, {claim.date}); publish exactly the claimed range")
    fs, base = filesystem(root)
    directory = f"{base}/{table}/date={date}"
    if not root.startswith("s3://"):  # S3 has no directories: pyarrow's create_dir there is a HEAD and a PUT a level
        fs.create_dir(directory, recursive=True)
    final = f"{directory}/{file_name(source, partition, first, last)}"
    if "://" in root:
        # object stores publish a single PUT atomically and have no cheap rename
        pq.write_table(data, final, filesystem=fs, compression=compression)
    else:
        # durable: a power loss cannot publish a name whose bytes are not on disk
        write_with(final, lambda tmp: pq.write_table(data, str(tmp), filesystem=fs, compression=compression),
                   Durability.DURABLE)
    return LakeFile(table, date, source, partition, first, last, final)


# ---------------------------------------------------------------------------------------------
# Reading: one reader for every stage, one policy for a file that cannot be read
# ---------------------------------------------------------------------------------------------
class LakeReadError(RuntimeError):
    """A published lake file cannot be read: the reader stops before it (read_file says why)."""


class LakeFileGone(LakeReadError):
    """A listed lake file is no longer there: a compaction replaced it with a file covering its range, so the
    reader lists again (the covering file holds the same rows)."""


def read_file(root: str, f: LakeFile, columns: Sequence[str] | None = None,
              filters: list[tuple[str, str, Any]] | None = None) -> "pa.Table":
    """The rows of one lake file: how the episode builder, the learner, compaction, the judge's calibration and
    stream_tail read the lake (reports and the gate query it through `sql_view`, with the same policy).

    columns: only these, of those the file has; a file written before a column joined the schema lacks it, and
    the caller conforms the table to today's schema. filters: pyarrow's row filter (e.g. one session's rows).

    The policy for a file that cannot be read (truncated, foreign, damaged on the store): LakeReadError naming
    the file, and every reader stops before it with its cursor before the file. Lake files are immutable and
    published whole (an atomic rename, or a single PUT), so an unreadable one is damage, never a write in
    progress, and waiting does not mend it; a reader that skipped it would lose its rows for good (the builder's
    sessions; the learner's rows, which it can never train later because it does not read backwards). The cure is
    an operator's: restore the file from the stream (the lake writer re-publishes a range it is re-sent) or
    remove it, then restart the reader. A file that is gone raises LakeFileGone: list again.
    """
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    fs, _ = filesystem(root)
    try:
        if columns is not None:
            present = set(pq.read_schema(f.path, filesystem=fs).names)
            columns = [c for c in columns if c in present]
        return pq.read_table(f.path, filesystem=fs, columns=columns, filters=filters)
    except (OSError, ValueError) as exc:  # pyarrow raises ArrowInvalid (a ValueError) for a corrupt file
        # FileNotFoundError locally; an object store may raise a plain OSError: ask the store
        if isinstance(exc, FileNotFoundError) or fs.get_file_info(f.path).type == pafs.FileType.NotFound:
            raise LakeFileGone(f"lake: {f.path} is gone (replaced by a compaction?); list the table again") from exc
        raise LakeReadError(f"lake: cannot read {f.path} ({type(exc).__name__}: {exc}); the reader stops before it: "
                            "restore or remove the file, then restart") from exc


def sql_view(con: "duckdb.DuckDBPyConnection", name: str, root: str, table: str, paths: list[str]) -> None:
    """DuckDB view `name` over lake files of `table` (paths as `list_files` gives them), columns matched by name:
    how reports and the gate query the lake. A query over an unreadable file fails with DuckDB's or pyarrow's
    error naming the file: nothing is skipped (read_file's policy).

    A remote lake (s3://...) is scanned through pyarrow's filesystem, with the endpoint and credentials pyarrow
    reads from the environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...), because DuckDB's own S3 reader is
    its httpfs extension, downloaded at run time from DuckDB's extension site and configured apart; DuckDB
    then scans the dataset lazily and reads only the columns the query uses.
    """
    if "://" not in root:
        con.execute(f"CREATE VIEW {name} AS SELECT * FROM read_parquet({_sql_list(paths)}, union_by_name = true)")
        return
    con.register(f"{name}_files", dataset(root, table, paths))
    con.execute(f"CREATE VIEW {name} AS SELECT * FROM {name}_files")


def dataset(root: str, table: str, paths: list[str]) -> "pa_dataset.Dataset":
    """A pyarrow dataset over lake files of `table` on the lake's filesystem, in the table's schema of today:
    a column an older file lacks reads as null, as DuckDB's union_by_name does."""
    import pyarrow.dataset as ds

    from flywheel.ingest import schema

    fs, _ = filesystem(root)
    wanted = {"events": schema.event_arrow_schema, "outcomes": schema.outcome_arrow_schema,
              "episodes": schema.episode_arrow_schema}[table]()
    return ds.dataset(paths, schema=wanted, filesystem=fs, format="parquet")


def _sql_list(paths: list[str]) -> str:
    """A SQL list literal of file paths (a view cannot take prepared parameters)."""
    return "[" + ", ".join("'" + p.replace("'", "''") + "'" for p in paths) + "]"


def load_cursor(path: Path) -> Cursor:
    """A durable reader cursor; an absent file is the empty cursor (read from the start)."""
    try:
        return {str(k): int(v) for k, v in json.loads(Path(path).read_text()).items()}
    except FileNotFoundError:
        return {}


def save_cursor(path: Path, cursor: Cursor) -> None:
    """Persist a cursor atomically (temp file, fsync, rename)."""
    write_json(path, cursor, Durability.DURABLE, sort_keys=True)


# ---------------------------------------------------------------------------------------------
# Range claims (see the module docstring) and deletion (compaction)
# ---------------------------------------------------------------------------------------------
CLAIMS_DIR = "_claims"


@dataclass(frozen=True)
class Claim:
    """The fixed extent of the file that starts at `first`: it ends at `last`, in `date`."""

    first: int
    last: int
    date: str


def _claim_path(base: str, table: str, source: str, partition: int, first: int) -> str:
    return f"{base}/{CLAIMS_DIR}/{table}/{source}-{partition:04d}/{first:020d}.json"


def _parse_claim(first: int, text: str) -> Claim:
    payload = json.loads(text)
    return Claim(first, int(payload["last"]), str(payload["date"]))


def read_claim(root: str, table: str, source: str, partition: int, first: int) -> Claim | None:
    """The claim on the file starting at `first`, or None when nobody has claimed it."""
    import pyarrow.fs as pafs

    fs, base = filesystem(root)
    path = _claim_path(base, table, source, partition, first)
    if fs.get_file_info(path).type == pafs.FileType.NotFound:
        return None
    with fs.open_input_stream(path) as fh:
        return _parse_claim(first, fh.read().decode())


def claim_range(root: str, table: str, source: str, partition: int, first: int, last: int, date: str) -> Claim:
    """Claim the file starting at `first` as first..last in `date`; return the claim in force.

    The result is this claim when nobody claimed `first` before, otherwise the earlier claim,
    which the caller must follow (publish exactly that range in that date).
    """
    assert 0 <= first <= last, f"bad claim range {first}..{last}"
    fs, base = filesystem(root)
    path = _claim_path(base, table, source, partition, first)
    return _parse_claim(first, _create_once(root, path, json.dumps({"last": last, "date": date})))


def _create_once(root: str, path: str, text: str) -> str:
    """Create `path` holding `text` unless it exists; return the content in force (the first writer's)."""
    fs, _ = filesystem(root)
    if root.startswith("s3://"):  # no directories to make: a key is its whole path
        return _s3_create_once(fs, path, text)
    directory = path.rsplit("/", 1)[0]
    fs.create_dir(directory, recursive=True)
    if "://" in root:  # check-then-write: see the module docstring
        import pyarrow.fs as pafs

        if fs.get_file_info(path).type != pafs.FileType.NotFound:
            with fs.open_input_stream(path) as fh:
                return fh.read().decode()
        with fs.open_output_stream(path) as fh:
            fh.write(text.encode())
        return text
    # write the content first, then link it into place: the link is atomic and refuses an existing
    # name, so the file is never seen half-written and exactly one writer wins it
    tmp = f"{directory}/.{uuid.uuid4().hex}.tmp"
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    try:
        os.link(tmp, path)
        return text
    except FileExistsError:
        with open(path) as fh:
            return fh.read()
    finally:
        os.unlink(tmp)


# ---------------------------------------------------------------------------------------------
# The conditional create on S3 (the claim's atomic primitive there; see the module docstring)
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class S3Endpoint:
    """Where and as whom the claims talk to S3, read from the variables pyarrow's S3FileSystem reads."""

    url: str  # scheme://host[:port]; requests are path-style: <url>/<bucket>/<key>
    region: str
    access_key: str
    secret_key: str
    session_token: str | None = None


def s3_endpoint(env: Mapping[str, str] | None = None) -> S3Endpoint:
    """The S3 endpoint of an s3:// lake from the environment (AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL,
    AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_REGION or AWS_DEFAULT_REGION)."""
    env = os.environ if env is None else env
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1"
    url = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or f"https://s3.{region}.amazonaws.com"
    key, secret = env.get("AWS_ACCESS_KEY_ID"), env.get("AWS_SECRET_ACCESS_KEY")
    if not key or not secret:
        raise RuntimeError("lake: an s3:// lake needs AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the environment "
                           "(its range claims are signed conditional PUTs); none set, so nothing can be claimed")
    return S3Endpoint(url.rstrip("/"), region, key, secret, env.get("AWS_SESSION_TOKEN") or None)


def _sigv4_headers(ep: S3Endpoint, method: str, uri: str, headers: dict[str, str], body: bytes,
                   now: _dt.datetime) -> dict[str, str]:
    """`headers` plus the AWS Signature Version 4 ones (x-amz-date, x-amz-content-sha256, authorization)."""
    amz_date = now.strftime("%Y%m%dT%H%M%SZ")
    out = {k.lower(): v for k, v in headers.items()}
    out.update({"host": urllib.parse.urlsplit(ep.url).netloc, "x-amz-date": amz_date,
                "x-amz-content-sha256": hashlib.sha256(body).hexdigest()})
    if ep.session_token:
        out["x-amz-security-token"] = ep.session_token
    names = sorted(out)
    signed = ";".join(names)
    canonical = "\n".join([method, uri, "", *(f"{k}:{out[k].strip()}" for k in names), "", signed,
                           out["x-amz-content-sha256"]])
    scope = f"{amz_date[:8]}/{ep.region}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    key = ("AWS4" + ep.secret_key).encode()
    for part in (amz_date[:8], ep.region, "s3", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    out["authorization"] = (f"AWS4-HMAC-SHA256 Credential={ep.access_key}/{scope}, SignedHeaders={signed}, "
                            f"Signature={signature}")
    return out


_S3_ATTEMPTS = 4  # a 409 (another conditional write of the key in flight), a 5xx or a dropped connection


def s3_put_if_absent(ep: S3Endpoint, bucket: str, key: str, body: bytes, timeout_s: float = 30.0) -> bool:
    """PUT s3://bucket/key with `If-None-Match: *`: True when this call created it, False when it already existed.

    Retrying is safe: a PUT that landed before its answer was lost is answered 412 on the retry, and the
    caller then reads back the content in force, which is its own.
    """
    uri = urllib.parse.urlsplit(ep.url).path + "/" + urllib.parse.quote(f"{bucket}/{key}", safe="/~")
    parts = urllib.parse.urlsplit(ep.url)
    connection = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    for attempt in range(_S3_ATTEMPTS):
        headers = _sigv4_headers(ep, "PUT", uri, {"If-None-Match": "*", "Content-Type": "application/json"}, body,
                                 _dt.datetime.now(_dt.timezone.utc))
        conn = connection(parts.netloc, timeout=timeout_s)
        try:
            conn.request("PUT", uri, body=body, headers=headers)
            resp = conn.getresponse()
            status, detail = resp.status, resp.read()[:300].decode(errors="replace")
        except OSError as e:
            status, detail = 0, repr(e)
        finally:
            conn.close()
        if status in (200, 201):
            return True
        if status == 412:
            return False
        if status not in (0, 409) and status < 500:
            break
        time.sleep(0.1 * 2**attempt)
    raise OSError(f"lake: conditional PUT of s3://{bucket}/{key} at {ep.url} failed (last answer {status}: "
                  f"{detail}); the claim was not made")


def _s3_create_once(fs: "pafs.FileSystem", path: str, text: str) -> str:
    """_create_once on S3: a conditional PUT, then the content in force (ours, or the first writer's)."""
    bucket, _, key = path.partition("/")
    if s3_put_if_absent(s3_endpoint(), bucket, key, text.encode()):
        return text
    with fs.open_input_stream(path) as fh:
        return fh.read().decode()


def stream_identity(root: str, table: str, source: str, identity: str) -> str:
    """Record which incarnation of `source` (its Kafka topic id) the table's files come from, once;
    return the identity recorded first: equal to `identity` unless the topic was recreated since."""
    _, base = filesystem(root)
    path = f"{base}/{CLAIMS_DIR}/{table}/{source}.identity.json"
    return str(json.loads(_create_once(root, path, json.dumps({"identity": identity})))["identity"])


def read_identity(root: str, table: str, source: str) -> str | None:
    """The identity `stream_identity` recorded for `source`, or None when none was (reads, never creates)."""
    import pyarrow.fs as pafs

    fs, base = filesystem(root)
    path = f"{base}/{CLAIMS_DIR}/{table}/{source}.identity.json"
    if fs.get_file_info(path).type == pafs.FileType.NotFound:
        return None
    with fs.open_input_stream(path) as fh:
        return str(json.loads(fh.read().decode())["identity"])


def delete_files(root: str, files: Iterable[LakeFile]) -> int:
    """Delete lake files (compaction's originals once their covering file is published)."""
    fs, _ = filesystem(root)
    count = 0
    for f in files:
        fs.delete_file(f.path)
        count += 1
    return count


def list_all_files(root: str, table: str) -> list[LakeFile]:
    """Every file of a table on disk, covered ones included (compaction cleans those up)."""
    assert table in TABLES, f"unknown table {table!r}"
    fs, base = filesystem(root)
    return sorted(_walk_table(fs, base, table), key=lambda f: (f.source, f.partition, f.first, -f.last, f.date))
