"""How a record travels as a Kafka value: the one encoder and decoder of the wire format.

schema.py says what an event or outcome holds; this module says how its bytes look. Two encodings:

* `json` (schema v1, v2): the record as one JSON object, token ids and logprobs as JSON number lists.
* `packed` (schema v3): the same JSON object, except that every `ints` / `floats` field (schema.PACKED_FIELDS:
  prompt, completion and summary token ids, completion logprobs) is a base64 string of its items as
  little-endian int32 / float32. A JSON list stays valid there too (v3 only adds an encoding), so a
  producer that builds records with schema.SCHEMA_VERSION and plain lists is still read. Decoded, such a field
  is a `memoryview` of the items (format schema.INT32_CODE resp. "f"), which schema validation accepts and the
  lake writer hands to Arrow without a Python object per item. The lake stores the same list<int32> /
  list<float32> columns as for v1, so readers do not change.

A third layout, `binary` (a 0xFF-led envelope: a JSON header whose packed fields hold their item counts,
then the raw little-endian arrays), was measured against `packed` on `flywheel bench ingest` (docs/lake.md,
"Ingest throughput") and is kept decodable for that comparison only: nothing emits it. Base64 in JSON costs the
writer a C-level base64 pass and a third more bytes on the arrays, and keeps every record JSON: the DLQ's
original_b64, the SDK's spool replay (it reads session_id back from the value), and any tool that json.loads
a record (event_id, session_id ...) keep working unchanged.

Records with nothing to pack (tool events, outcomes) look the same in both encodings. Decoding checks the
structure only (base64 alphabet, a whole number of items, counts that add up); what the items may hold is
schema validation's business (schema.validate_event, schema.check_limits).

This module imports only the standard library: it is on the SDK's hot import path.
"""

from __future__ import annotations

import binascii
import json
import struct
import sys
from typing import Any, Callable

from flywheel.ingest import schema

FORMATS = ("json", "packed")  # what an encoder may emit (the SDK's `wire_format`)
PACKED_VERSION = 3  # the schema_version of a packed record
JSON_VERSION = 2  # the newest schema_version whose token lists travel as JSON lists
BINARY_MAGIC = b"\xffFW\x03"  # 0xFF never starts UTF-8 text, so a binary value cannot be mistaken for JSON
_HEADER = struct.Struct("<I")  # after the magic: the JSON header's byte length
# field -> (memoryview format of one item, kind); item order follows schema.PACKED_FIELDS
_ITEM = {name: (schema.INT32_CODE if kind == "ints" else "f", kind) for name, kind in schema.PACKED_FIELDS.items()}
_LITTLE = sys.byteorder == "little"


class WireError(ValueError):
    """A value whose bytes are not a well-formed record of its encoding; the message names the field."""


# ---------------------------------------------------------------------------------------------
# Encoding
# ---------------------------------------------------------------------------------------------
def pack_items(kind: str, items: Any) -> bytes:
    """Items of an `ints` (int32) or `floats` (float32) field as little-endian bytes.

    Raises OverflowError for an int outside int32 (or a float outside float32) and TypeError for an item
    of the wrong type, in one C pass (array.array checks both while it packs).
    """
    import array

    packed = array.array(schema.INT32_CODE if kind == "ints" else "f", items)
    if not _LITTLE:
        packed.byteswap()
    return packed.tobytes()


def packed_view(kind: str, items: Any) -> memoryview:
    """Items of an `ints` / `floats` field as the memoryview a decoded v3 record holds (native byte order)."""
    return _view(pack_items(kind, items), schema.INT32_CODE if kind == "ints" else "f")


def packed_version(record: dict[str, Any]) -> int:
    """The schema_version a packed record travels as: v3, or the oldest later version that has every field it
    holds (a v4 field). Not simply the newest: a writer one version behind then dead-letters only the records
    that use a field it does not know, not every record of an upgraded SDK (docs/deploy.md)."""
    return max(PACKED_VERSION, _needed(record))


def _needed(record: dict[str, Any]) -> int:
    """The oldest schema_version with every field `record` holds (an outcome has no `type`)."""
    return schema.version_needed(record, record["type"] if isinstance(record.get("type"), str) else "outcome")


def packed_record(record: dict[str, Any]) -> dict[str, Any]:
    """A copy of `record` as schema v3 (or the later version its fields need): its list fields as base64 text of
    their packed items."""
    out = dict(record)
    out["schema_version"] = packed_version(record)
    for name, (_, kind) in _ITEM.items():
        value = out.get(name)
        if value is not None:
            out[name] = binascii.b2a_base64(pack_items(kind, value), newline=False).decode("ascii")
    return out


def encode(record: dict[str, Any], fmt: str = "packed", default: Callable[[Any], Any] | None = None) -> bytes:
    """The Kafka value of `record` in `fmt` ("json", "packed", or "binary" for benchmarks).

    `json` keeps the record's schema_version, capped at JSON_VERSION unless a field needs a later one;
    `packed` and `binary` write v3, or the later version a field needs (packed_version). NaN and
    infinity are refused (ValueError) in the JSON part, as the lake writer's strict parser would; `default` is
    json.dumps's hook for values JSON has no type for. Packing raises OverflowError for a token id beyond int32.
    """
    if fmt == "json":
        out = dict(record)
        if isinstance(out.get("schema_version"), int) and out["schema_version"] > JSON_VERSION:
            # capped for a writer older than v3, unless a field needs a later version: such a record keeps
            # that version (JSON lists are valid in every version), so no writer drops the field unannounced
            out["schema_version"] = max(JSON_VERSION, _needed(out))
        return _dumps(out, default).encode()
    if fmt == "packed":
        return _dumps(packed_record(record), default).encode()
    if fmt == "binary":
        return _encode_binary(record, default)
    raise ValueError(f"wire format {fmt!r} not in {FORMATS + ('binary',)}")


def _dumps(value: Any, default: Callable[[Any], Any] | None = None) -> str:
    return json.dumps(value, default=default, separators=(",", ":"), allow_nan=False)


def _encode_binary(record: dict[str, Any], default: Callable[[Any], Any] | None = None) -> bytes:
    header = dict(record)
    header["schema_version"] = packed_version(record)
    arrays = []
    for name, (_, kind) in _ITEM.items():
        value = header.get(name)
        if value is not None:
            arrays.append(pack_items(kind, value))
            header[name] = len(value)
    head = _dumps(header, default).encode()
    return b"".join([BINARY_MAGIC, _HEADER.pack(len(head)), head, *arrays])


# ---------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------
def is_binary(value: bytes) -> bool:
    return value[:4] == BINARY_MAGIC


def is_packed_version(version: Any) -> bool:
    """Whether records of this schema_version carry their list fields packed (v3 and later)."""
    return type(version) is int and version >= PACKED_VERSION


def _view(raw: bytes | memoryview, fmt: str) -> memoryview:
    if not _LITTLE:  # pragma: no cover - little-endian hosts only in CI
        import array

        swapped = array.array(fmt, bytes(raw))
        swapped.byteswap()
        return memoryview(swapped)
    return memoryview(raw).cast("B").cast(fmt)  # type: ignore[call-overload]  # fmt is one of the packed item codes


def _b64decode(text: str) -> bytes:
    return binascii.a2b_base64(text, strict_mode=True)


def unpack_fields(record: dict[str, Any], b64decode: Callable[[str], bytes] = _b64decode) -> dict[str, Any]:
    """Turn the base64 fields of a decoded packed (v3) JSON record into memoryviews of their items, in place.

    Raises WireError naming the field when one is not a base64 string of whole items. `b64decode` must reject
    what binascii's strict mode rejects; the lake writer passes pybase64's SIMD decoder (10x the stdlib's).
    """
    for name, (fmt, kind) in _ITEM.items():
        value = record.get(name)
        if value is None or isinstance(value, list):
            continue  # a JSON list is still a valid v3 field (validation checks it as for v1)
        if not isinstance(value, str):
            raise WireError(f"field {name!r}: a v3 record carries {kind} as base64 of little-endian "
                            f"{'int32' if kind == 'ints' else 'float32'} (or a JSON list), got {type(value).__name__}")
        try:
            raw = b64decode(value)
        except (binascii.Error, ValueError) as exc:
            raise WireError(f"field {name!r}: not base64 ({exc})") from None
        if len(raw) % 4:
            raise WireError(f"field {name!r}: {len(raw)} bytes is not a whole number of 4-byte items")
        record[name] = _view(raw, fmt)
    return record


def decode_binary(value: bytes, loads: Callable[[bytes], Any] = json.loads) -> Any:
    """Decode a binary envelope into a record whose packed fields are memoryviews (WireError if malformed)."""
    if len(value) < len(BINARY_MAGIC) + _HEADER.size:
        raise WireError(f"binary envelope of {len(value)} bytes is shorter than its fixed header")
    (n_head,) = _HEADER.unpack_from(value, len(BINARY_MAGIC))
    start = len(BINARY_MAGIC) + _HEADER.size
    if start + n_head > len(value):
        raise WireError(f"binary envelope: header of {n_head} bytes runs past the value's {len(value)} bytes")
    record = loads(value[start:start + n_head])
    if not isinstance(record, dict):
        return record  # validation names what it is
    body, pos = memoryview(value), start + n_head
    for name, (fmt, _) in _ITEM.items():
        count = record.get(name)
        if count is None:
            continue
        if type(count) is not int or count < 0:
            raise WireError(f"field {name!r}: a binary envelope holds an item count here, got "
                            f"{schema.short_repr(count)}")
        end = pos + 4 * count
        if end > len(value):
            raise WireError(f"field {name!r}: {count} items run past the value's end ({len(value) - pos} bytes left)")
        record[name] = _view(body[pos:end], fmt)
        pos = end
    if pos != len(value):
        raise WireError(f"binary envelope: {len(value) - pos} bytes after the last packed field")
    return record


def decode(value: bytes, loads: Callable[[bytes], Any] = json.loads,
           b64decode: Callable[[str], bytes] = _b64decode) -> Any:
    """A Kafka value -> the decoded record (v3 packed fields as memoryviews); any JSON value passes through.

    Raises WireError for a malformed packed field or envelope, ValueError (UnicodeDecodeError, JSON errors)
    for bytes that are not JSON. For readers that want plain lists, see `as_lists`.
    """
    if is_binary(value):
        return decode_binary(value, loads)
    record = loads(value)
    if isinstance(record, dict) and is_packed_version(record.get("schema_version")):
        unpack_fields(record, b64decode)
    return record


def as_lists(record: dict[str, Any]) -> dict[str, Any]:
    """`record` with every memoryview field turned into a Python list (for tools and tests that print or compare)."""
    return {k: (v.tolist() if isinstance(v, memoryview) else v) for k, v in record.items()}
