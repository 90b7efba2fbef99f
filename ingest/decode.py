"""Decoding: a Kafka value -> a lake row, or the reason it goes to the dead-letter topic (pure, no I/O).

The lake writer's per-record work, apart from the process (ingest/lake_writer.py) so that a decode worker
process can import it without the writer. `decode_record` + `convert_rows` is the reference: one record at a
time, each check in Python, every reason the DLQ table in docs/lake.md names. `decode_batch` (below) gives the
same rows, dates and rejections for a run of records at a fraction of the cost: it checks and converts column
by column in C (orjson, pybase64, Arrow) and hands every record it cannot prove good to `decode_record`.
"""

from __future__ import annotations

import functools
import itertools
import json
from typing import TYPE_CHECKING, Any

from flywheel.ingest import schema, wire

if TYPE_CHECKING:
    import pyarrow as pa

_VALIDATE = {"events": schema.validate_event, "outcomes": schema.validate_outcome}
_COLUMNS = {"events": schema.EVENT_COLUMNS, "outcomes": schema.OUTCOME_COLUMNS}
_ARROW_SCHEMA = {"events": schema.event_arrow_schema, "outcomes": schema.outcome_arrow_schema}
_LIST_KIND = {"int32": "ints", "float": "floats"}  # str() of a packed list column's item type -> schema kind


class Rejected(Exception):
    """A record that cannot land; `reason` is a short code, the message the detail."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def _converters(table: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    cols = _COLUMNS[table]
    return tuple(c.name for c in cols if c.kind == "ts"), tuple(c.name for c in cols if c.kind == "json")


_KIND_FIELDS = {t: _converters(t) for t in _COLUMNS}


try:  # decoding is most of the writer's work per record; orjson (the lake extra) is 3-5x the stdlib
    import orjson

    _loads = orjson.loads

    def _dumps_sorted(value: Any) -> str:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()

except ImportError:  # pragma: no cover - the lake extra installs orjson
    _loads = json.loads

    def _dumps_sorted(value: Any) -> str:
        return json.dumps(value, sort_keys=True, separators=(",", ":"))

try:  # a v3 record's token ids are base64: pybase64 (the lake extra, SIMD) decodes them 10x faster than binascii
    import pybase64

    def _b64decode(text: str) -> bytes:
        return pybase64.b64decode(text, validate=True)

except ImportError:  # pragma: no cover - the lake extra installs pybase64
    _b64decode = wire._b64decode


# Every reason a dead letter can carry (docs/lake.md has the table): the decode path's, the limits', Arrow's.
DLQ_REASONS = ("empty", "oversized", "not_utf8", "malformed_json", "malformed_packed", "unsupported_schema_version",
               "invalid", *schema.LIMIT_REASONS, "decode_error", "unstorable")
_ID_COLUMN = {"events": "event_id", "outcomes": "outcome_id"}


def decode_record(table: str, value: bytes | None) -> tuple[dict[str, Any], str]:
    """Decode and validate one Kafka value into (lake row without meta columns, UTC date).

    Raises Rejected with the reason the dead-letter envelope carries, and nothing else: whatever
    else one record makes the code raise is that record's fault, so it becomes a `decode_error`
    naming the exception instead of stopping the writer at this offset for good. MemoryError is
    the one exception kept: it says the process is short of memory, not that the record is bad,
    and a restart retries the same record.
    """
    try:
        return _decode(table, value)
    except (Rejected, MemoryError):
        raise
    except Exception as exc:
        raise Rejected("decode_error", _describe(exc)) from None


def _describe(exc: BaseException) -> str:
    """`Class: message` of an exception, for a dead letter's detail (bounded: some messages quote the input)."""
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= 500 else text[:497] + "..."


def _decode(table: str, value: bytes | None) -> tuple[dict[str, Any], str]:
    if value is None:
        raise Rejected("empty", "record has no value (tombstone)")
    if len(value) > schema.MAX_RECORD_BYTES:
        raise Rejected("oversized", f"{len(value)} bytes > schema.MAX_RECORD_BYTES={schema.MAX_RECORD_BYTES}")
    record = _parse(value)
    if isinstance(record, dict) and not schema.supported_version(record.get("schema_version")):
        raise Rejected("unsupported_schema_version", f"schema_version {schema.short_repr(record.get('schema_version'))} "
                       f"not in {sorted(schema.SUPPORTED_SCHEMA_VERSIONS)}")
    try:
        if isinstance(record, dict) and wire.is_packed_version(record["schema_version"]) and not wire.is_binary(value):
            wire.unpack_fields(record, _b64decode)  # base64 -> memoryviews of int32 / float32 items, no Python int per item
    except wire.WireError as exc:
        raise Rejected("malformed_packed", str(exc)) from None
    try:
        _VALIDATE[table](record)
        schema.check_limits(record, _COLUMNS[table])
    except schema.LimitError as exc:
        raise Rejected(exc.reason, str(exc)) from None
    except schema.SchemaError as exc:
        raise Rejected("invalid", str(exc)) from None
    ts_fields, json_fields = _KIND_FIELDS[table]
    for name in ts_fields:
        if record.get(name) is not None:
            record[name] = schema.parse_ts(record[name])
    for name in json_fields:
        if record.get(name) is not None:
            record[name] = _dumps_sorted(record[name])
    return record, record["ts"].date().isoformat()


def _parse(value: bytes) -> Any:
    """Kafka value -> the decoded JSON value (a binary envelope's packed fields already memoryviews)."""
    if wire.is_binary(value):
        try:
            return wire.decode_binary(value, _loads)
        except wire.WireError as exc:
            raise Rejected("malformed_packed", str(exc)) from None
        except (ValueError, RecursionError) as exc:
            raise Rejected("malformed_json", f"binary envelope's header is not JSON: {exc}") from None
    try:
        text = value.decode("utf-8")  # ASCII in the common case: a memcpy; and a reason of its own when it fails
    except UnicodeDecodeError as exc:
        raise Rejected("not_utf8", f"value is not UTF-8: {exc}") from None
    try:
        return _loads(text)
    except (ValueError, RecursionError) as exc:  # JSONDecodeErrors are ValueErrors; the stdlib recurses on depth
        raise Rejected("malformed_json", f"value is not JSON: {exc}") from None




def rows_to_table(table: str, rows: list[dict[str, Any]]) -> "pa.Table":
    """Rows (already converted by decode_record, meta columns added) -> an Arrow table of the lake schema.

    Column by column: a packed field (v3) is one join of its rows' item bytes and one offsets array, so its
    thousands of items never become Python objects; the other columns go through pa.array as before.
    """
    import pyarrow as pa

    arrow_schema = _arrow_schema(table)
    columns = [_column(f, [row.get(f.name) for row in rows]) for f in arrow_schema]
    return pa.Table.from_arrays(columns, schema=arrow_schema)


@functools.lru_cache(maxsize=None)
def _arrow_schema(table: str) -> "pa.Schema":
    return _ARROW_SCHEMA[table]()


def _column(field: "pa.Field", values: list[Any]) -> "pa.Array":
    import pyarrow as pa

    if field.name in schema.PACKED_FIELDS and any(type(v) is memoryview for v in values):
        return _packed_column(field.type, values)
    return pa.array(values, type=field.type)


def _packed_column(list_type: "pa.ListType", values: list[Any]) -> "pa.Array":
    """A list<int32> / list<float32> column from rows holding memoryviews of packed items (or None, or a v1 list)."""
    import pyarrow as pa

    kind = _LIST_KIND[str(list_type.value_type)]
    # a v1 row in the same chunk as v3 rows is packed here (OverflowError for an id beyond int32: the chunk then
    # goes row by row, and that row to the DLQ as unstorable, as before)
    views = [wire.packed_view(kind, v) if type(v) is list else v for v in values]
    offsets = list(itertools.accumulate((0 if v is None else len(v) for v in views), initial=0))
    if offsets[-1] > 2**31 - 1:
        raise OverflowError(f"{offsets[-1]} list items in one chunk exceed a list column's int32 offsets")
    items = pa.Array.from_buffers(list_type.value_type, offsets[-1],
                                  [None, pa.py_buffer(b"".join(v for v in views if v is not None))])
    nulls = None if all(v is not None for v in views) else pa.array([v is None for v in views])
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), items, type=list_type, mask=nulls)


def convert_rows(table: str, rows: list[dict[str, Any]]) -> tuple["pa.Table", list[tuple[int, str]]]:
    """Rows -> an Arrow table of the lake schema without the rows Arrow cannot hold (a token id beyond int32 ...).

    Returns (table, [(index in `rows` of a row left out, "Class: message")]). The whole batch is tried
    first; only when it fails is each row converted on its own, so one bad row costs its chunk a slow
    pass, never the chunk. MemoryError propagates (see decode_record).
    """
    import pyarrow as pa

    try:
        return rows_to_table(table, rows), []
    except MemoryError:
        raise
    except Exception:
        pass
    singles: list[pa.Table] = []
    bad: list[tuple[int, str]] = []
    for i, row in enumerate(rows):
        try:
            singles.append(rows_to_table(table, [row]))
        except MemoryError:
            raise
        except Exception as exc:
            bad.append((i, _describe(exc)))
    return (pa.concat_tables(singles) if singles else rows_to_table(table, [])), bad
