"""Decoding: a Kafka value -> a lake row, or the reason it goes to the dead-letter topic (pure, no I/O).

The lake writer's per-record work, apart from the process (ingest/lake_writer.py) so that a decode worker
process can import it without the writer. `decode_record` + `convert_rows` is the reference: one record at a
time, each check in Python, every reason the DLQ table in docs/lake.md names. `decode_batch` (below) gives the
same rows, dates and rejections for a run of records at a fraction of the cost: it checks and converts column
by column in C (orjson, pybase64, Arrow) and hands every record it cannot prove good to `decode_record`.
"""

from __future__ import annotations

import array
import datetime as dt
import functools
import itertools
import json
import operator
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable

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

    _loads: Callable[[bytes | str], Any] = orjson.loads

    def _dumps_sorted(value: Any) -> str:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()

except ImportError:  # pragma: no cover - the lake extra installs orjson
    _loads = json.loads  # the same call, without orjson's speed

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


_UNPARSED: Any = object()


def decode_record(table: str, value: bytes | None, parsed: Any = _UNPARSED) -> tuple[dict[str, Any], str]:
    """Decode and validate one Kafka value into (lake row without meta columns, UTC date).

    Raises Rejected with the reason the dead-letter envelope carries, and nothing else: whatever
    else one record makes the code raise is that record's fault, so it becomes a `decode_error`
    naming the exception instead of stopping the writer at this offset for good. MemoryError is
    the one exception kept: it says the process is short of memory, not that the record is bad,
    and a restart retries the same record.
    """
    try:
        return _decode(table, value, parsed)
    except (Rejected, MemoryError):
        raise
    except Exception as exc:
        raise Rejected("decode_error", _describe(exc)) from None


def _describe(exc: BaseException) -> str:
    """`Class: message` of an exception, for a dead letter's detail (bounded: some messages quote the input)."""
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= 500 else text[:497] + "..."


def _decode(table: str, value: bytes | None, parsed: Any = _UNPARSED) -> tuple[dict[str, Any], str]:
    if value is None:
        raise Rejected("empty", "record has no value (tombstone)")
    if len(value) > schema.MAX_RECORD_BYTES:
        raise Rejected("oversized", f"{len(value)} bytes > schema.MAX_RECORD_BYTES={schema.MAX_RECORD_BYTES}")
    # `parsed`: decode_batch's orjson.loads of these very bytes (JSON, not a binary envelope), left untouched
    record = _parse(value) if parsed is _UNPARSED else parsed
    if isinstance(record, dict) and not schema.supported_version(record.get("schema_version")):
        raise Rejected("unsupported_schema_version",
                       f"schema_version {schema.short_repr(record.get('schema_version'))} "
                       f"not in {sorted(schema.SUPPORTED_SCHEMA_VERSIONS)}")
    try:
        if isinstance(record, dict) and wire.is_packed_version(record["schema_version"]) and not wire.is_binary(value):
            # base64 -> memoryviews of int32 / float32 items, no Python int per item
            wire.unpack_fields(record, _b64decode)
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


# ---------------------------------------------------------------------------------------------
# Batches: the same rows, dates and rejections for a run of records, checked and converted column by column
# ---------------------------------------------------------------------------------------------
@dataclass
class DecodedBatch:
    """What a run of records of one partition decodes to.

    `table` holds the good rows in input order, in the lake schema with the meta columns; its row j is input
    record `good[j]`, of UTC date `dates[j]`. Every other record's index maps to the (reason, detail) its dead
    letter carries, the reasons `decode_record` and `convert_rows` give (`unstorable` included).
    """

    table: "pa.Table"
    good: list[int]
    dates: list[str]
    rejected: dict[int, tuple[str, str]]


@dataclass(frozen=True)
class _Spec:
    """What the fast path checks per record of one event type (or of outcomes)."""

    known: frozenset[str]  # the closed set of fields
    required: Callable[[dict[str, Any]], tuple[Any, ...]]  # itemgetter of the required fields (KeyError: one missing)
    packed: tuple[str, ...]  # ints / floats fields
    json: tuple[str, ...]  # free-form JSON fields
    since: tuple[tuple[str, int], ...]  # (field, first schema_version carrying it)
    same_length: tuple[str, ...]  # fields whose item counts must match (an llm_call's completion ids and logprobs)
    one_of: tuple[str, tuple[str, ...]] | None  # (field, allowed values): a context_edit's edit_kind


def _spec(cols: tuple[schema.Col, ...], what: str) -> _Spec:
    required = tuple(c.name for c in cols if c.required)
    return _Spec(frozenset(c.name for c in cols), operator.itemgetter(*required),
                 tuple(c.name for c in cols if c.kind in ("ints", "floats")),
                 tuple(c.name for c in cols if c.kind == "json"),
                 tuple(schema.ADDED_IN.get(what, {}).items()),
                 ("completion_token_ids", "completion_logprobs") if what == "llm_call" else (),
                 ("edit_kind", schema.CONTEXT_EDIT_KINDS) if what == "context_edit" else None)


@functools.lru_cache(maxsize=None)
def _specs(table: str) -> dict[str | None, _Spec]:
    """Event type -> its spec (events); None -> the outcomes' spec."""
    if table == "outcomes":
        return {None: _spec(schema.OUTCOME_COLUMNS, "outcome")}
    return {etype: _spec(schema.EVENT_COMMON + cols, etype) for etype, cols in schema.EVENT_FIELDS.items()}


def _fast_record(specs: dict[str | None, _Spec], by_type: bool, value: Any) -> tuple[Any, bool]:
    """The record with its packed fields as raw bytes and its JSON fields as their text, when every check that
    needs one record at a time passes (the rest is checked by column): (record, True). Otherwise the record goes
    to `decode_record`, with the parsed value when it is still untouched ((value, False)), else (_UNPARSED, False).

    Each check is at least as strict as the reference's, so a record it passes is one the reference lands.
    """
    if type(value) is not bytes or len(value) > schema.MAX_RECORD_BYTES or value[:1] == b"\xff":
        return _UNPARSED, False
    try:
        rec = _loads(value)  # bytes: orjson checks the UTF-8 itself
    except Exception:
        return _UNPARSED, False
    if type(rec) is not dict:
        return rec, False
    version = rec.get("schema_version")
    if type(version) is not int or version not in schema.SUPPORTED_SCHEMA_VERSIONS:
        return rec, False
    etype = rec.get("type") if by_type else None
    spec = specs.get(etype) if etype is None or type(etype) is str else None
    if spec is None or not spec.known.issuperset(rec) or rec.get("truncated") is not None:
        return rec, False  # an unknown type or field; a `strs` list is rare enough for the reference
    try:
        if None in spec.required(rec):
            return rec, False
    except KeyError:
        return rec, False
    if any(name in rec and version < first for name, first in spec.since):
        return rec, False
    packed_text = wire.is_packed_version(version)
    if any(type(rec.get(name)) not in ((str, list, _NONE) if packed_text else (list, _NONE)) for name in spec.packed):
        return rec, False  # base64 text outside v3, or neither text nor a list: the reference says which
    # from here on the record is changed in place: a record refused below is parsed again by the reference
    return (rec, True) if _fast_packed(rec, spec) and _fast_json(rec, spec) else (_UNPARSED, False)


def _fast_packed(rec: dict[str, Any], spec: _Spec) -> bool:
    """Each packed field as raw little-endian items: v3's base64 decoded, or a JSON list (v1, v2, and allowed in
    v3) packed in C by `array` once its items pass the reference's checks (ints: exactly int, within int32;
    floats: int or float, not NaN, within float32). Anything else goes to the reference, which names it."""
    for name in spec.packed:
        value = rec.get(name)
        if value is None:
            continue
        if type(value) is list:
            raw = _list_items(value, schema.PACKED_FIELDS[name])
            if raw is None:
                return False
        else:
            try:
                raw = _b64decode(value)
            except Exception:
                return False
        if len(raw) % 4 or len(raw) > 4 * schema.MAX_TOKENS:
            return False
        rec[name] = raw
    if spec.same_length and len(rec[spec.same_length[0]]) != len(rec[spec.same_length[1]]):
        return False
    return spec.one_of is None or rec[spec.one_of[0]] in spec.one_of[1]


def _list_items(items: list[Any], kind: str) -> bytes | None:
    """A JSON list of a packed field as its little-endian int32 / float32 bytes, or None when any item is one the
    reference would refuse or name (a bool or float among ints, an id beyond int32, NaN or beyond float32)."""
    if len(items) > schema.MAX_TOKENS:
        return None
    types = set(map(type, items))  # one C-level pass settles the item types, as schema's check does
    try:
        if kind == "ints":
            if not types <= {int}:
                return None
            packed = array.array(schema.INT32_CODE, items)  # OverflowError beyond int32
        else:
            if not types <= {int, float} or (items and not -schema.MAX_FLOAT32 <= min(items) <= max(items)
                                                   <= schema.MAX_FLOAT32):
                return None  # NaN compares false, so it fails the bounds too
            if int in types and any(type(x) is int and not -_EXACT_FLOAT32 <= x <= _EXACT_FLOAT32 for x in items):
                return None  # Arrow refuses an int a float32 cannot hold exactly: the reference dead-letters it
            packed = array.array("f", items)
    except (OverflowError, TypeError):
        return None
    if sys.byteorder != "little":  # pragma: no cover (the fast path runs on little-endian hosts only)
        packed.byteswap()
    return packed.tobytes()


def _fast_json(rec: dict[str, Any], spec: _Spec) -> bool:
    for name in spec.json:
        value = rec.get(name)
        if value is None:
            continue
        try:
            text = _dumps_sorted(value)
        except Exception:
            return False
        # the text is at least as long as any string in it and holds at least as many brackets as its depth
        if len(text) > schema.MAX_STRING_CHARS or text.count("{") + text.count("[") > schema.MAX_JSON_DEPTH:
            return False
        rec[name] = text
    return True


class _Bad(Exception):
    """Records (positions in the fast run) a column check refused: they go to the reference path."""

    def __init__(self, positions: Iterable[int]) -> None:
        super().__init__()
        self.positions = set(positions)


_NONE = type(None)
_ALLOWED: dict[str, set[type]] = {"str": {str, _NONE}, "json": {str, _NONE}, "ts": {str, _NONE}, "int": {int, _NONE},
            "float": {float, int, _NONE}, "bool": {bool, _NONE}, "ints": {bytes, _NONE}, "floats": {bytes, _NONE},
            "strs": {_NONE}}
# the timestamps whose parse Arrow and the reference (datetime.fromisoformat) agree on; others go the reference way
_TS_PATTERN = r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{1,6})?(Z|[+-]\d{2}:\d{2})$"
_EXACT_FLOAT = 2**53  # an int beyond this as a float column's value: Arrow refuses it, the reference says how
_EXACT_FLOAT32 = 2**24  # the same for an int item of a float32 list (logprobs)


def _bad_where(col: list[Any], test: Callable[[Any], bool]) -> _Bad:
    return _Bad(k for k, v in enumerate(col) if v is not None and test(v))


def _kind_array(kind: str, name: str, col: list[Any], arrow_type: "pa.DataType") -> "pa.Array":
    """A column of the fast run as Arrow, after the checks validation and limits make on its kind (raises _Bad)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    allowed = _ALLOWED[kind]
    if not allowed.issuperset(set(map(type, col))):
        raise _bad_where(col, lambda v: type(v) not in allowed)
    if kind in ("str", "json"):
        if max(map(len, filter(None, col)), default=0) > schema.MAX_STRING_CHARS:
            raise _bad_where(col, lambda v: len(v) > schema.MAX_STRING_CHARS)
    elif kind == "float" and int in set(map(type, col)):
        if any(type(v) is int and not -_EXACT_FLOAT <= v <= _EXACT_FLOAT for v in col):
            raise _bad_where(col, lambda v: type(v) is int and not -_EXACT_FLOAT <= v <= _EXACT_FLOAT)
    elif kind == "ts":
        return _ts_array(col)
    elif kind in ("ints", "floats"):
        return _packed_array(kind, col, arrow_type)
    try:
        array = pa.array(col, type=arrow_type)
    except (OverflowError, pa.ArrowException):  # an int beyond int64 (`int_out_of_range`)
        raise _bad_where(col, lambda v: type(v) is int and not schema.MIN_INT <= v <= schema.MAX_INT) from None
    if name == "seq" and (pc.min(array).as_py() or 0) < 0:
        raise _bad_where(col, lambda v: v < 0)
    return array


def _ts_array(col: list[Any]) -> "pa.Array":
    import pyarrow as pa
    import pyarrow.compute as pc

    text = pa.array(col, type=pa.string())
    shaped = pc.match_substring_regex(text, _TS_PATTERN)
    if not pc.all(shaped).as_py() or text.null_count:
        raise _Bad(k for k, ok in enumerate(shaped.to_pylist()) if not ok)
    try:
        ts = pc.cast(text, pa.timestamp("us", tz="UTC"))
    except (pa.ArrowInvalid, ValueError):  # a day the month does not have, hour 24 ...: let the reference name it
        raise _Bad(range(len(col))) from None
    inside = pc.and_(pc.greater_equal(ts, pa.scalar(schema.MIN_TS, ts.type)),
                     pc.less(ts, pa.scalar(schema.MAX_TS, ts.type)))
    if not pc.all(inside).as_py():
        raise _Bad(k for k, ok in enumerate(inside.to_pylist()) if not ok)
    return ts


def _packed_array(kind: str, col: list[Any], list_type: "pa.ListType") -> "pa.Array":
    """A list<int32> / list<float32> column from raw little-endian items (None: a null list)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    offsets = list(itertools.accumulate((0 if v is None else len(v) >> 2 for v in col), initial=0))
    items = pa.Array.from_buffers(list_type.value_type, offsets[-1], [None, pa.py_buffer(b"".join(filter(None, col)))])
    if kind == "floats" and offsets[-1] and not pc.all(pc.is_finite(items)).as_py():
        # NaN is `invalid`, an infinity `float_out_of_range`: the reference names which
        finite = pc.is_finite(items).to_pylist()
        raise _Bad(k for k in range(len(col)) if not all(finite[offsets[k]:offsets[k + 1]]))
    nulls = pa.array([v is None for v in col]) if None in col else None
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), items, type=list_type, mask=nulls)


def _fast_table(table: str, recs: list[dict[str, Any]], meta: dict[str, "pa.Array"]) -> tuple["pa.Table", list[str]]:
    """The fast run's rows as an Arrow table of the lake schema, and their UTC dates (raises _Bad)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    kinds = {c.name: c.kind for c in _COLUMNS[table]}
    present = set().union(*recs)  # a column no record of the run holds is all null, with nothing to check
    columns = []
    for f in _arrow_schema(table):
        if f.name in meta:
            columns.append(meta[f.name])
        elif f.name not in present:
            columns.append(pa.nulls(len(recs), f.type))
        else:
            column = list(map(operator.methodcaller("get", f.name), recs))
            columns.append(_kind_array(kinds[f.name], f.name, column, f.type))
    out = pa.Table.from_arrays(columns, schema=_arrow_schema(table))
    dates = pc.cast(pc.cast(out.column("ts"), pa.date32()), pa.string()).to_pylist()
    return out, dates


def _meta(topic: str, partition: int, offsets: list[int], ingest_ts: dt.datetime) -> dict[str, "pa.Array"]:
    import pyarrow as pa

    n, ts_type = len(offsets), pa.timestamp("us", tz="UTC")
    return {"_topic": pa.array([topic] * n, pa.string()), "_partition": pa.array([partition] * n, pa.int64()),
            "_offset": pa.array(offsets, pa.int64()), "_ingest_ts": pa.array([ingest_ts] * n, ts_type)}


def _decode_fast(table: str, topic: str, partition: int, offsets: list[int], values: list[Any],
                 ingest_ts: dt.datetime, parsed: dict[int, Any]) -> tuple["pa.Table | None", list[int], list[str]]:
    """(table, input indexes, dates) of the records the fast path proves good; the others are left out (those
    parsed and untouched in `parsed`, by index, so the reference need not parse them again)."""
    specs, by_type = _specs(table), table == "events"
    idx, recs = [], []
    for i, value in enumerate(values):
        rec, fast = _fast_record(specs, by_type, value)
        if fast:
            idx.append(i)
            recs.append(rec)
        elif rec is not _UNPARSED:
            parsed[i] = rec
    while recs:
        try:
            out, dates = _fast_table(table, recs, _meta(topic, partition, [offsets[i] for i in idx], ingest_ts))
            return out, idx, dates
        except _Bad as bad:
            if not bad.positions:
                break  # a check that could not say which record: all of them the reference way
            idx = [i for k, i in enumerate(idx) if k not in bad.positions]
            recs = [r for k, r in enumerate(recs) if k not in bad.positions]
        except MemoryError:
            raise
        except Exception:  # whatever else: the reference path decides, record by record
            break
    return None, [], []


def warm_up() -> None:
    """Pay pyarrow's lazy imports now rather than inside the first batch: its first timestamp cast imports
    pandas (0.35-0.43 s here, measured in the bench's first decoded batch), and the first publish imports
    pyarrow.parquet (~0.2 s of CPU): either would otherwise delay the first records a writer lands after every
    (re)start."""
    import pyarrow as pa
    import pyarrow.parquet  # noqa: F401 (imported for its cost, now)

    pa.array([0], pa.int64()).cast(pa.timestamp("us", tz="UTC"))


def decode_batch(table: str, topic: str, partition: int, offsets: list[int], values: list[Any],
                 ingest_ts: dt.datetime | None = None) -> DecodedBatch:
    """Decode a run of one partition's records (values at those offsets) into lake rows and rejections.

    The result is what `decode_record` and `convert_rows` make of each record (tests/unit/test_decode_batch.py
    holds it to that), apart from `_ingest_ts`, one instant for the whole run. MemoryError propagates.
    """
    import pyarrow as pa

    ingest_ts = ingest_ts or dt.datetime.now(dt.timezone.utc)
    parsed: dict[int, Any] = {}
    if sys.byteorder == "little":  # the fast path reads packed items in place, as little-endian
        fast, fast_idx, fast_dates = _decode_fast(table, topic, partition, offsets, values, ingest_ts, parsed)
    else:  # pragma: no cover
        fast, fast_idx, fast_dates = None, [], []
    done = set(fast_idx)
    rejected: dict[int, tuple[str, str]] = {}
    rows, slow_idx, slow_dates = [], [], []
    for i, value in enumerate(values):
        if i in done:
            continue
        try:
            row, date = decode_record(table, value, parsed.get(i, _UNPARSED))
        except Rejected as rej:
            rejected[i] = (rej.reason, rej.detail)
            continue
        row.update(_topic=topic, _partition=partition, _offset=offsets[i], _ingest_ts=ingest_ts)
        rows.append(row)
        slow_idx.append(i)
        slow_dates.append(date)
    if not rows:
        return DecodedBatch(fast if fast is not None else rows_to_table(table, []), fast_idx, fast_dates, rejected)
    slow, bad = convert_rows(table, rows)
    for k, detail in bad:
        rejected[slow_idx[k]] = ("unstorable", detail)
    unstorable = {k for k, _ in bad}
    slow_idx = [i for k, i in enumerate(slow_idx) if k not in unstorable]
    slow_dates = [d for k, d in enumerate(slow_dates) if k not in unstorable]
    if fast is None:
        return DecodedBatch(slow, slow_idx, slow_dates, rejected)
    where, dates = fast_idx + slow_idx, fast_dates + slow_dates
    order = sorted(range(len(where)), key=where.__getitem__)
    merged = pa.concat_tables([fast, slow]).take(pa.array(order, pa.int64()))
    return DecodedBatch(merged, [where[k] for k in order], [dates[k] for k in order], rejected)
