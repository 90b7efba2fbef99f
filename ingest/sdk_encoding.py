"""SDK encoding, on the background thread: a host's record -> (key, payload) for Kafka.

Event id, redaction of the free-text fields, size caps (text, JSON depth, the topic's record cap), JSON of
whatever the host passed (array-likes, non-finite floats, non-JSON values as repr()), the schema's own validation,
and the wire format (ingest/wire.py). What cannot be encoded is dropped and counted, never raised into the host.
Standard library only (with the project's schema, redact and wire modules).
"""

from __future__ import annotations

import array
import json
import math
import reprlib
import uuid
from typing import Any, Callable

from flywheel.ingest import schema, wire
from flywheel.ingest.redact import Redactor, redact_json
from flywheel.ingest.sdk_counters import Counters, WarnOnce

# Free-text fields: redacted and capped at MAX_TEXT_CHARS. JSON fields: strings inside are redacted,
# and the whole value is capped by its JSON length.
TEXT_FIELDS = ("prompt_text", "completion_text", "output", "subtask")
JSON_COLUMNS = tuple(c.name for c in schema.EVENT_COLUMNS if c.kind == "json")  # tags, sampling, arguments
SEQUENCE_FIELDS = ("prompt_token_ids", "completion_token_ids", "completion_logprobs", "summary_token_ids")


def json_default(value: Any) -> Any:
    """Turn the array-likes agents commonly pass (numpy, torch, tuples, sets) into JSON."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", "replace")
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def _finite(value: Any) -> Any:
    """NaN and infinities (not JSON) inside a free-form value, as their repr() text."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def json_default_or_repr(value: Any) -> Any:
    try:
        return json_default(value)
    except TypeError:
        return repr(value)


class Encoder:
    """A host's record -> (key, payload) for Kafka, on the background thread; None when it is dropped (counted in
    `counts`, warned once per kind). `over_cap(what, record, size)` says whether a payload is over the topic's
    record cap (the pipeline's producer learns it), and names the record in a DLQ notice when it is."""

    def __init__(self, counts: Counters, warn: WarnOnce, over_cap: Callable[[str, dict[str, Any], int], bool],
                 redact: Redactor | None, validate: Callable[[Any], Any],
                 id_field: str, columns: tuple[schema.Col, ...], wire_format: str = "packed") -> None:
        self._counts = counts
        self._warn = warn
        self._over_cap = over_cap
        self._redact = redact
        self._validate = validate
        self._id_field = id_field
        self._columns = columns  # for schema.check_limits: EVENT_COLUMNS or OUTCOME_COLUMNS
        self._wire_format = wire_format  # ingest/wire.py: "packed" (schema v3) or "json" (v2, token lists as JSON)

    def __call__(self, record: dict[str, Any]) -> tuple[bytes, bytes] | None:
        for name in [k for k, v in record.items() if v is None]:
            del record[name]  # optional fields not given
        record.setdefault(self._id_field, uuid.uuid4().hex)
        what = record.get("type", "outcome")
        for name in SEQUENCE_FIELDS:
            value = record.get(name)
            if value is not None and not isinstance(value, list):
                record[name] = value.tolist() if hasattr(value, "tolist") else list(value)
        truncated: list[str] = list(record.get("truncated") or [])
        self._cap_text(record, truncated)
        for name in JSON_COLUMNS:
            value = record.get(name)
            if value is not None:
                record[name] = self._json_value(what, name, value, truncated)
        if truncated:
            self._counts.truncated += 1
            record["truncated"] = sorted(set(truncated))
        return self._payload(what, record)

    def _cap_text(self, record: dict[str, Any], truncated: list[str]) -> None:
        """Redact the free-text fields and cut every string at MAX_TEXT_CHARS, naming what was cut."""
        for name, value in list(record.items()):
            if isinstance(value, str):
                if self._redact is not None and name in TEXT_FIELDS:
                    value = self._redact(value)
                if len(value) > schema.MAX_TEXT_CHARS:
                    value = value[: schema.MAX_TEXT_CHARS]
                    truncated.append(name)
                record[name] = value

    def _json_value(self, what: str, name: str, value: Any, truncated: list[str]) -> Any:
        """A JSON field as plain JSON: non-JSON values as their repr(), nothing nested deeper than
        schema.MAX_JSON_DEPTH (deeper containers become a short repr()), redacted, capped by its text."""
        text = self._json_text(what, name, value, truncated)
        value = json.loads(text)
        if text.count("[") + text.count("{") >= schema.MAX_JSON_DEPTH:  # fewer containers cannot nest that deep
            value, clipped = _clip_depth(value)
            if clipped:
                self._too_deep(what, name, truncated)
                text = json.dumps(value)
        if self._redact is not None:
            value = redact_json(value, self._redact)
            # The cap below cuts the text: it must be the redacted text, or a secret survives in the prefix.
            # Below half the cap the default redactor (placeholders about as long as what they replace) cannot
            # push it over, so the common small field is not encoded twice.
            if len(text) > schema.MAX_TEXT_CHARS // 2:
                text = json.dumps(value)
        if len(text) > schema.MAX_TEXT_CHARS:
            value = text[: schema.MAX_TEXT_CHARS]  # a prefix of its JSON text, flagged as cut
            truncated.append(name)
        return value

    def _json_text(self, what: str, name: str, value: Any, truncated: list[str]) -> str:
        try:
            return json.dumps(value, default=json_default, allow_nan=False)
        except RecursionError:  # nested past the interpreter's recursion limit: cut it first
            value, _ = _clip_depth(value)
            self._too_deep(what, name, truncated)
        except (TypeError, ValueError) as exc:
            self._counts.coerced += 1
            self._warn(f"json:{what}:{name}", "sdk: %s %s is not JSON serialisable (%s); such values are stored "
                      "as their repr() text", what, name, exc)
            value, clipped = _clip_depth(value)  # also unrolls a circular reference only down to the limit
            if clipped:
                self._too_deep(what, name, truncated)
        try:  # keep the structure, replace only the values JSON cannot hold
            return json.dumps(_finite(value), default=json_default_or_repr, allow_nan=False)
        except (TypeError, ValueError, RecursionError):  # keys JSON cannot hold: nothing structured to keep
            return json.dumps(_SHORT_REPR.repr(value))

    def _too_deep(self, what: str, name: str, truncated: list[str]) -> None:
        self._counts.limited += 1
        truncated.append(name)
        self._warn(f"limit:too_deep:{what}:{name}", "sdk: %s %s nested deeper than schema.MAX_JSON_DEPTH=%d; what "
                   "lies deeper is stored as a short repr() text and the field is named in `truncated`", what, name,
                  schema.MAX_JSON_DEPTH)

    def _payload(self, what: str, record: dict[str, Any]) -> tuple[bytes, bytes] | None:
        """(key, value) for Kafka once the record passes the schema and the size bound; None (counted) if not."""
        try:
            self._validate(_without_numeric_lists(record, what))
            # The lake writer's limits (it would dead-letter the record): the JSON fields were cut to them above,
            # what is left (token counts, int, float and timestamp ranges) cannot be cut without lying: drop.
            schema.check_limits({k: v for k, v in record.items() if k not in JSON_COLUMNS}, self._columns)
            # allow_nan=False: NaN/Infinity are not JSON, and the lake writer's strict parser would reject the record.
            # Packed (v3), the token lists become base64 of int32/float32: under half JSON's encoding time here
            # (44 vs 105 us per bench llm_call) and a fraction of the lake writer's decoding (docs/lake.md).
            payload = wire.encode(record, self._wire_format, default=json_default)
        except schema.LimitError as exc:
            self._counts.invalid += 1
            self._counts.limited += 1
            self._warn(f"limit:{exc.reason}:{what}", "sdk: %s dropped, past a schema limit (%s): %s",
                      what, exc.reason, exc)
            return None
        except (schema.SchemaError, TypeError, ValueError, OverflowError) as exc:
            self._counts.invalid += 1
            self._warn(f"invalid:{what}:{str(exc)[:40]}", "sdk: %s dropped: %s", what, exc)
            return None
        key = str(record.get("session_id", "")).encode()
        if self._over_cap(what, record, len(payload) + len(key)):
            return None
        return key, payload


_LIST_KINDS = {c.name: c.kind for c in schema.EVENT_COLUMNS if c.kind in ("ints", "floats")}
# The lake stores token ids as int32 (schema.arrow_type("ints")): packing them into a 32-bit array checks the
# range in the same C pass that checks the type.
_INT32 = next(code for code in "il" if array.array(code).itemsize == 4)
# Not schema.short_repr: that one is for error messages (50 characters); this one stores what a value looked
# like in place of what lies too deep, so it keeps more of it.
_SHORT_REPR = reprlib.Repr()  # bounded output, and no recursion past its maxlevel (a repr() of a deep value has both)
_SHORT_REPR.maxlevel, _SHORT_REPR.maxstring, _SHORT_REPR.maxother = 3, 200, 200


def _clip_depth(value: Any, depth: int = 1) -> tuple[Any, bool]:
    """`value` as dicts and lists, every container nested deeper than schema.MAX_JSON_DEPTH (1 is {"a": 1})
    replaced by a short repr() of it; and whether any was. Recurses at most MAX_JSON_DEPTH + 1 frames."""
    is_dict = isinstance(value, dict)
    if not is_dict and not isinstance(value, (list, tuple, set, frozenset)):
        return value, False
    if depth > schema.MAX_JSON_DEPTH:
        return _SHORT_REPR.repr(value), True
    clipped = False
    if is_dict:
        out: dict[Any, Any] = {}
        for key, item in value.items():
            out[key], cut = _clip_depth(item, depth + 1)
            clipped = clipped or cut
        return out, clipped
    items = []
    for item in value:
        item, cut = _clip_depth(item, depth + 1)
        items.append(item)
        clipped = clipped or cut
    return items, clipped


def _without_numeric_lists(record: dict[str, Any], what: str) -> dict[str, Any]:
    """Check the token-id and logprob lists in C (array.array), and return a copy without them.

    schema.validate_event checks every element in a Python generator: ~1 us per token, which on a
    long prompt is most of the background thread's time (and GIL the host waits for). The copy keeps
    the schema's own check of every other field; the list rules are the schema's, applied here.
    """
    lists = {name: record[name] for name in _LIST_KINDS if record.get(name) is not None}
    if not lists:
        return record
    for name, value in lists.items():
        kind = _LIST_KINDS[name]
        if not isinstance(value, list):
            raise schema.SchemaError(f"{what} event: field {name!r} should be {kind}, got {type(value).__name__}")
        try:
            packed = array.array(_INT32 if kind == "ints" else "d", value)
        except TypeError as exc:
            raise schema.SchemaError(f"{what} event: field {name!r} should be {kind} ({exc})") from None
        except OverflowError:
            raise schema.LimitError("int_out_of_range", f"{what} event: field {name!r} holds a token id outside int32, "
                                    "the lake's column type") from None
        if kind == "floats" and packed:
            total = sum(packed)  # NaN propagates; only then look for it element by element
            if total != total and any(x != x for x in packed):
                raise schema.SchemaError(f"{what} event: field {name!r} holds NaN")
    if what == "llm_call" and "completion_logprobs" in lists and "completion_token_ids" in lists:
        n_lp, n_tok = len(lists["completion_logprobs"]), len(lists["completion_token_ids"])
        if n_lp != n_tok:
            raise schema.SchemaError(f"llm_call event: completion_logprobs has {n_lp} values for {n_tok} "
                                     "completion tokens")
    light = dict(record)
    for name in lists:
        light[name] = []
    return light
