"""SessionLogger and OutcomeReporter without a broker: everything they accept ends up, encoded
and schema-valid, in the spill spool, and bad input is warned, counted and never raised."""

from __future__ import annotations

import json
import logging
import os
import socket
from pathlib import Path

import pytest

from flywheel.ingest import schema, wire
from flywheel.ingest.sdk import OutcomeReporter, SessionLogger
from flywheel.ingest.spool import Spool


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def dead_address() -> str:
    """host:port of a port nothing listens on: a broker that is down (the SDK and proxy tests' Kafka)."""
    return f"127.0.0.1:{_closed_port()}"


@pytest.fixture
def dead_bootstrap() -> str:
    return dead_address()


def _spooled(directory: Path) -> list[dict]:
    spool = Spool(directory)
    records = [wire.as_lists(wire.decode(r)) for r in spool.peek(1_000_000)]  # v3: token lists packed on the wire
    spool.close()
    return records


def _logger(dead_bootstrap: str, tmp_path: Path, **kw) -> SessionLogger:
    options = {"name": "t", "spool_dir": tmp_path / "spool", "linger_s": 0.01, "retry_s": 0.2, **kw}
    return SessionLogger(dead_bootstrap, **options)


def _full_session(log: SessionLogger) -> str:
    with log.session(task_type="code_edit", tags={"repo": "x"}) as s:
        s.llm_call(model="policy-v3", policy_version=3, prompt_token_ids=[1, 2, 3], completion_token_ids=[4, 5],
                   completion_logprobs=[-0.1, -0.2], finish_reason="stop", latency_s=0.01,
                   sampling={"temperature": 1.0}, completion_text="hi")
        call = s.tool_call("grep", {"pattern": "foo"})
        s.tool_result(call, ok=True, output="a.py:1:foo")
        child = s.spawn_subagent(subtask="fix lint")
        child.llm_call(model="policy-v3", policy_version=3, prompt_token_ids=[1], completion_token_ids=[2],
                       completion_logprobs=[-0.5])
        child.finish(ok=True)
        s.context_edit("summarize", tokens_removed=120, summary_token_ids=[7, 8, 9])
        s.traced_llm_call("gpt-x", provider="openai", input_tokens=12, output_tokens=3, completion_text="done")
    return s.session_id


def test_every_event_type_is_encoded_valid_and_spilled(dead_bootstrap: str, tmp_path: Path) -> None:
    log = _logger(dead_bootstrap, tmp_path)
    session_id = _full_session(log)
    log.close(timeout=5)
    events = _spooled(tmp_path / "spool")
    for event in events:
        schema.validate_event(event)
    assert {e["type"] for e in events} == set(schema.EVENT_TYPES)
    assert all(e["session_id"] == session_id for e in events)
    assert len({e["event_id"] for e in events}) == len(events), "event ids must be unique"
    child = [e for e in events if e["type"] == "llm_call" and e["agent_id"] != "main"]
    spawn = next(e for e in events if e["type"] == "subagent_spawn")
    assert child[0]["parent_agent_id"] == "main" and child[0]["agent_id"] == spawn["child_agent_id"]
    main_seqs = [e["seq"] for e in events if e["agent_id"] == "main"]
    assert main_seqs == sorted(main_seqs) and len(set(main_seqs)) == len(main_seqs)
    assert events[-1]["type"] == "session_end" and events[-1]["status"] == "ok"
    m = log.metrics()
    assert m["spilled"] == len(events) == m["enqueued"] and m["dropped"] == 0 and m["invalid"] == 0, m


def test_session_end_status_error_when_block_raises(dead_bootstrap: str, tmp_path: Path) -> None:
    log = _logger(dead_bootstrap, tmp_path)
    with pytest.raises(KeyError):
        with log.session(task_type="t"):
            raise KeyError("agent bug")
    log.close(timeout=5)
    assert _spooled(tmp_path / "spool")[-1]["status"] == "error"


def test_bad_input_is_warned_counted_and_never_raised(dead_bootstrap: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    log = _logger(dead_bootstrap, tmp_path)
    s = log.attach("sess-bad")
    good = dict(model="m", policy_version=0, prompt_token_ids=[1], completion_token_ids=[2], completion_logprobs=[-1.0])
    with caplog.at_level(logging.WARNING, logger="flywheel.ingest.sdk"):
        s.tool_call("f", {"when": object()})  # not JSON serialisable -> repr text, counted
        s.tool_result("c1", ok=True, output="x" * (schema.MAX_TEXT_CHARS + 10))  # capped and flagged
        s.llm_call(**good, bogus_field=1)  # unknown field: dropped from the event, warned
        s.llm_call(**{**good, "policy_version": "three"})  # wrong type: event dropped, counted
        s.llm_call(**{**good, "completion_logprobs": [-1.0, -2.0]})  # length mismatch: dropped
        s.llm_call(model="m")  # missing required fields: dropped
        s.context_edit("rewrite", tokens_removed=3)  # not a known edit kind: dropped
        s.tool_result("c2", ok=True, output={"not": "a string"})  # object output stored as its repr
        s.llm_call(**good)  # the SDK still works afterwards
        log.close(timeout=5)
    events = _spooled(tmp_path / "spool")
    for event in events:
        schema.validate_event(event)
    by_type = [e["type"] for e in events]
    assert by_type == ["tool_call", "tool_result", "llm_call", "tool_result", "llm_call"], by_type
    assert events[0]["arguments"]["when"].startswith("<object object")
    assert events[1]["truncated"] == ["output"] and len(events[1]["output"]) == schema.MAX_TEXT_CHARS
    assert "bogus_field" not in events[2]
    m = log.metrics()
    assert m["invalid"] == 4 and m["coerced"] == 1 and m["truncated"] == 1, m
    messages = " | ".join(r.getMessage() for r in caplog.records)
    for needle in ("not JSON serialisable", "bogus_field", "policy_version", "completion_logprobs", "required", "edit_kind"):
        assert needle in messages, f"no warning mentions {needle!r}: {messages}"


def test_text_is_redacted_before_it_leaves(dead_bootstrap: str, tmp_path: Path) -> None:
    log = _logger(dead_bootstrap, tmp_path)
    s = log.attach("sess-r")
    s.tool_call("mail", {"to": "bob@example.com", "auth": "Bearer abcdefghijklmnop"})
    s.tool_result("c", ok=True, output="sent to bob@example.com with key sk-abcdefghijklmnopqrstu")
    log.close(timeout=5)
    text = json.dumps(_spooled(tmp_path / "spool"))
    assert "bob@example.com" not in text and "sk-abcdefghijklmnopqrstu" not in text and "abcdefghijklmnop" not in text


def test_no_bootstrap_is_a_noop_with_one_warning(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv("FLYWHEEL_KAFKA_BOOTSTRAP", raising=False)
    with caplog.at_level(logging.WARNING, logger="flywheel.ingest.sdk"):
        log = SessionLogger()
        with log.session(task_type="t") as s:
            assert s.tool_call("f", {}) and s.spawn_subagent("x").agent_id
        assert OutcomeReporter().report("s", kind="k", value=1.0)
    assert not log.enabled and log.flush(0.1)
    assert sum("no Kafka bootstrap" in r.getMessage() for r in caplog.records) == 2  # one per client


def test_sampling_is_per_session_and_deterministic(dead_bootstrap: str, tmp_path: Path) -> None:
    log = _logger(dead_bootstrap, tmp_path, sample_rate=0.3)
    sampled = [log.attach(f"s{i}").sampled for i in range(2000)]
    again = [log.attach(f"s{i}").sampled for i in range(2000)]
    assert sampled == again
    assert 0.25 < sum(sampled) / 2000 < 0.35, sum(sampled)
    log.close(timeout=1)


def test_outcomes_validate_and_bad_values_are_counted(dead_bootstrap: str, tmp_path: Path) -> None:
    reporter = OutcomeReporter(dead_bootstrap, name="o", spool_dir=tmp_path / "o", linger_s=0.01)
    oid = reporter.report("sess-1", kind="tests_passed", value=1, source="ci")
    reporter.report("sess-1", kind="rating", value="not a number")
    reporter.report("sess-1", kind=None, value=1.0)  # type: ignore[arg-type]
    reporter.close(timeout=5)
    outcomes = _spooled(tmp_path / "o")
    assert [o["outcome_id"] for o in outcomes] == [oid]
    schema.validate_outcome(outcomes[0])
    assert outcomes[0]["value"] == 1.0 and reporter.metrics()["invalid"] == 2


def test_an_outcome_reported_again_with_its_id_keeps_that_id(dead_bootstrap: str, tmp_path: Path) -> None:
    # a source that re-sends after a crash passes its own id, so the builder sees a duplicate, not news
    reporter = OutcomeReporter(dead_bootstrap, name="o", spool_dir=tmp_path / "o", linger_s=0.01)
    first = reporter.report("sess-1", kind="task_success", value=1.0, source="verifier", outcome_id="oid-7")
    again = reporter.report("sess-1", kind="task_success", value=1.0, source="verifier", outcome_id="oid-7")
    fresh = reporter.report("sess-1", kind="task_success", value=1.0, source="verifier")
    reporter.close(timeout=5)
    ids = [o["outcome_id"] for o in _spooled(tmp_path / "o")]
    assert first == again == "oid-7" and ids[:2] == ["oid-7", "oid-7"], ids
    assert fresh != "oid-7" and ids[2] == fresh, ids


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_gets_its_own_pipeline(dead_bootstrap: str, tmp_path: Path) -> None:
    log = _logger(dead_bootstrap, tmp_path)
    log.attach("parent").tool_call("before_fork", {})
    pid = os.fork()
    if pid == 0:  # child: log, close, and leave without running the parent's test machinery
        code = 1
        try:
            for i in range(5):
                log.attach("child").tool_call(f"c{i}", {})
            log.close(timeout=5)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    log.close(timeout=5)
    child_events = _spooled(tmp_path / f"spool-{pid}")
    assert [e["name"] for e in child_events] == [f"c{i}" for i in range(5)], child_events
    assert [e["name"] for e in _spooled(tmp_path / "spool")] == ["before_fork"]


def test_dicts_reused_by_the_agent_do_not_change_logged_events(dead_bootstrap: str, tmp_path: Path) -> None:
    log = _logger(dead_bootstrap, tmp_path, linger_s=10.0)  # the background thread encodes only at close
    s = log.attach("sess-reuse")
    args = {"path": "a.py"}
    s.llm_call(model="m", policy_version=0, prompt_token_ids=(1, 2, 3), completion_token_ids=[4], completion_logprobs=[-1.0])
    s.tool_call("read", args)
    args["path"] = "b.py"  # the agent's next step reuses its dict
    s.llm_call(model="m", policy_version=0, prompt_token_ids=5, completion_token_ids=[4], completion_logprobs=[-1.0])  # type: ignore[arg-type]
    log.close(timeout=5)
    events = _spooled(tmp_path / "spool")
    assert events[0]["prompt_token_ids"] == [1, 2, 3] and events[1]["arguments"] == {"path": "a.py"}
    assert len(events) == 2 and log.metrics()["invalid"] == 1, "a non-list prompt is dropped, not raised"


def test_non_finite_floats_never_leave_as_invalid_json(dead_bootstrap: str, tmp_path: Path) -> None:
    log = _logger(dead_bootstrap, tmp_path)
    s = log.attach("sess-nan")
    s.tool_call("f", {"x": float("nan"), "y": [1.0, float("inf")]})  # free-form: kept as text
    s.llm_call(model="m", policy_version=0, prompt_token_ids=[1], completion_token_ids=[2],
               completion_logprobs=[float("-inf")])  # a behaviour logprob of -inf: dropped with a reason
    log.close(timeout=5)
    spool = Spool(tmp_path / "spool")
    raw = spool.peek(100)
    spool.close()
    assert len(raw) == 1 and b"NaN" not in raw[0] and b"Infinity" not in raw[0], raw
    assert json.loads(raw[0])["arguments"] == {"x": "nan", "y": [1.0, "inf"]}
    assert log.metrics()["invalid"] == 1 and log.metrics()["coerced"] == 1


def test_the_lake_writer_accepts_every_event_and_outcome_the_sdk_emits(dead_bootstrap: str, tmp_path: Path) -> None:
    """The hand-off contract: what the SDK puts on the wire is what the lake writer decodes without a DLQ."""
    lake_writer = pytest.importorskip("flywheel.ingest.lake_writer")
    log = _logger(dead_bootstrap, tmp_path)
    _full_session(log)
    log.close(timeout=5)
    reporter = OutcomeReporter(dead_bootstrap, name="o", spool_dir=tmp_path / "o")
    reporter.report("sess-1", kind="accepted", value=0.0, agent_id="main", source="user")
    reporter.close(timeout=5)
    for table, directory in (("events", tmp_path / "spool"), ("outcomes", tmp_path / "o")):
        spool = Spool(directory)
        values = spool.peek(1000)
        spool.close()
        assert values, f"nothing spooled for {table}"
        for value in values:
            lake_writer.decode_record(table, value)  # raises Rejected with the DLQ reason


def _nested(depth: int) -> dict:
    value: dict = {"leaf": 1}
    for _ in range(depth - 1):
        value = {"k": value}
    return value


def _depth(value: object) -> int:
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


def test_json_fields_nested_past_the_limit_are_cut_flagged_and_pass_the_writers_limits(
        dead_bootstrap: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    log = _logger(dead_bootstrap, tmp_path)
    s = log.attach("sess-deep")
    circular: list = [1]
    circular.append(circular)
    with caplog.at_level(logging.WARNING, logger="flywheel.ingest.sdk"):
        s.tool_call("deep", _nested(schema.MAX_JSON_DEPTH + 30))  # a model's own tool call can nest like this
        s.tool_call("deeper", {"x": _nested(5000)})  # past the interpreter's recursion limit
        s.tool_call("circular", {"x": circular})
        s.llm_call(model="m", policy_version=0, prompt_token_ids=[1], completion_token_ids=[2],
                   completion_logprobs=[-1.0], sampling={"stop": _nested(200)})
        with log.session(task_type="t", tags=_nested(schema.MAX_JSON_DEPTH)):  # exactly at the limit: kept as is
            pass
        log.close(timeout=5)
    events = _spooled(tmp_path / "spool")
    assert [e["type"] for e in events] == ["tool_call", "tool_call", "tool_call", "llm_call", "session_start",
                                           "session_end"], "over-deep values are cut, never a reason to drop"
    for event in events:
        schema.validate_event(event)
        schema.check_limits(event)  # what the lake writer checks again: it must not dead-letter these
    for event, field in zip(events[:4], ("arguments", "arguments", "arguments", "sampling")):
        assert field in event.get("truncated", []) and _depth(event[field]) <= schema.MAX_JSON_DEPTH, (
            f"{event['type']} {field}: depth {_depth(event[field])}, truncated {event.get('truncated')}")
    assert "truncated" not in events[4] and events[4]["tags"] == _nested(schema.MAX_JSON_DEPTH)
    m = log.metrics()
    assert m["limited"] == 4 and m["invalid"] == 0 and m["truncated"] == 4, m
    warnings = [r.getMessage() for r in caplog.records if "MAX_JSON_DEPTH" in r.getMessage()]
    assert len(warnings) == 2, f"one warning per kind (tool_call arguments, llm_call sampling): {warnings}"


def test_values_past_the_other_limits_drop_the_event_with_one_warning_each(dead_bootstrap: str, tmp_path: Path,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    log = _logger(dead_bootstrap, tmp_path)
    s = log.attach("sess-limits")
    good = dict(model="m", policy_version=0, prompt_token_ids=[1], completion_token_ids=[2], completion_logprobs=[-1.0])
    with caplog.at_level(logging.WARNING, logger="flywheel.ingest.sdk"):
        s.llm_call(**{**good, "prompt_token_ids": [1] * (schema.MAX_TOKENS + 1)})  # too_many_tokens
        s.llm_call(**{**good, "prompt_token_ids": [1] * (schema.MAX_TOKENS + 1)})  # the same kind: counted only
        s.llm_call(**{**good, "completion_token_ids": [2**31]})  # beyond the lake's int32 column
        s.llm_call(**{**good, "completion_logprobs": [-1e39]})  # beyond float32
        s.llm_call(**{**good, "policy_version": 2**63})  # beyond int64
        s.llm_call(**good)
        log.close(timeout=5)
    events = _spooled(tmp_path / "spool")
    assert len(events) == 1 and events[0]["completion_token_ids"] == [2], events
    m = log.metrics()
    assert m["invalid"] == 5 and m["limited"] == 5, m
    messages = [r.getMessage() for r in caplog.records if "schema limit" in r.getMessage()]
    for reason in ("too_many_tokens", "int_out_of_range", "float_out_of_range"):
        assert any(reason in msg for msg in messages), f"no warning names {reason}: {messages}"
    assert sum("too_many_tokens" in msg for msg in messages) == 1, messages

    reporter = OutcomeReporter(dead_bootstrap, name="o", spool_dir=tmp_path / "o", linger_s=0.01)
    reporter.report("sess-limits", kind="accepted", value=1.0, ts="1970-01-01T00:00:00+00:00")  # a clock never set
    reporter.report("sess-limits", kind="accepted", value=1.0)
    reporter.close(timeout=5)
    assert len(_spooled(tmp_path / "o")) == 1 and reporter.metrics()["limited"] == 1, reporter.metrics()


def test_a_json_field_cut_to_size_is_cut_after_redaction(dead_bootstrap: str, tmp_path: Path) -> None:
    log = _logger(dead_bootstrap, tmp_path)
    half = schema.MAX_TEXT_CHARS // 2
    log.attach("sess-cut").tool_call("mail", {"a": "x" * half, "to": "bob@example.com", "b": "y" * half})
    log.close(timeout=5)
    event = _spooled(tmp_path / "spool")[0]
    assert event["truncated"] == ["arguments"] and len(event["arguments"]) == schema.MAX_TEXT_CHARS
    assert "bob@example.com" not in event["arguments"] and "[EMAIL]" in event["arguments"], "the prefix leaks"
