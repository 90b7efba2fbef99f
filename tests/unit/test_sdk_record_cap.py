"""The SDK's record cap against the topic: it reads the topic's max.message.bytes once its producer connects,
caps records below it, and names every record over the cap in a DLQ notice (counted in metrics), never
dropping one silently. Fake kafka-python clients play the broker; the real one is in
tests/integration/test_kafka_sasl.py."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from flywheel.base.kafka import RECORD_OVERHEAD_BYTES
from flywheel.ingest import schema
from flywheel.ingest.sdk import SessionLogger

TOPIC_LIMIT = 256 * 1024


class _Future:
    is_done, exception = True, None

    def add_callback(self, fn: Callable[..., Any], *args: Any) -> "_Future":
        fn(*args, None)
        return self

    def add_errback(self, fn: Callable[..., Any], *args: Any) -> "_Future":
        return self


class _Producer:
    def __init__(self, **config: Any) -> None:
        self.config = config
        self.sent: list[tuple[str, bytes]] = []

    def send(self, topic: str, key: bytes | None = None, value: bytes | None = None) -> _Future:
        self.sent.append((topic, value or b""))
        return _Future()

    def flush(self, timeout: float | None = None) -> None:
        pass

    def close(self, timeout: float | None = None) -> None:
        pass


class _Admin:
    DEFAULT_CONFIG = {"bootstrap_servers": None, "client_id": None, "request_timeout_ms": None,
                      "security_protocol": None, "sasl_mechanism": None, "sasl_plain_username": None,
                      "sasl_plain_password": None}
    made: list[dict[str, Any]] = []
    fail = False

    def __init__(self, **config: Any) -> None:
        _Admin.made.append(config)
        if _Admin.fail:
            raise RuntimeError("describe refused")

    def describe_configs(self, resources: list[Any], config_filter: str = "modified") -> dict[str, Any]:
        assert config_filter == "all"
        return {"topic": {r.name: {"max.message.bytes": {"value": str(TOPIC_LIMIT)}} for r in resources}}

    def close(self) -> None:
        pass


@pytest.fixture
def producers(monkeypatch: pytest.MonkeyPatch) -> list[_Producer]:
    import kafka

    made: list[_Producer] = []

    def make(**config: Any) -> _Producer:
        made.append(_Producer(**config))
        return made[-1]

    monkeypatch.setattr(kafka, "KafkaProducer", make)
    monkeypatch.setattr(kafka, "KafkaAdminClient", _Admin)
    _Admin.made, _Admin.fail = [], False
    for key in ("SECURITY_PROTOCOL", "SASL_MECHANISM", "SASL_USERNAME", "SASL_PASSWORD", "CLIENT_ID", "CONFIG"):
        monkeypatch.delenv(f"FLYWHEEL_KAFKA_{key}", raising=False)
    return made


@pytest.fixture
def listening() -> Iterator[str]:
    """A bootstrap address that accepts connections: _broker_reachable() is true."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    yield f"127.0.0.1:{server.getsockname()[1]}"
    server.close()


def _wait(predicate: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def _big_call(s: Any, tokens: int) -> None:
    s.llm_call(model="policy-v1", policy_version=1, prompt_token_ids=list(range(100_000, 100_000 + tokens)),
               completion_token_ids=[1, 2], completion_logprobs=[-0.1, -0.2])


def test_records_over_the_topic_limit_become_dlq_notices(producers: list[_Producer], listening: str,
                                                         tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLYWHEEL_KAFKA_SECURITY_PROTOCOL", "SASL_PLAINTEXT")
    monkeypatch.setenv("FLYWHEEL_KAFKA_SASL_MECHANISM", "SCRAM-SHA-256")
    monkeypatch.setenv("FLYWHEEL_KAFKA_SASL_USERNAME", "agent")
    monkeypatch.setenv("FLYWHEEL_KAFKA_SASL_PASSWORD", "pw")
    log = SessionLogger(listening, name="cap", spool_dir=tmp_path / "spool", linger_s=0.01)
    assert _wait(lambda: log.metrics()["record_cap"] != schema.MAX_RECORD_BYTES), log.metrics()
    s = log.attach("sess-big")
    _big_call(s, 10)  # fits
    _big_call(s, 60_000)  # ~420 KB of JSON: over the topic's 256 KiB, under schema.MAX_RECORD_BYTES
    assert log.flush(5.0), log.metrics()
    metrics = log.metrics()
    log.close()

    producer = producers[0]
    assert producer.config["sasl_plain_username"] == "agent" and producer.config["security_protocol"] == "SASL_PLAINTEXT"
    assert _Admin.made[0]["sasl_plain_password"] == "pw", "the admin client must use the producer's credentials"
    assert metrics["record_cap"] == TOPIC_LIMIT - RECORD_OVERHEAD_BYTES, metrics
    assert (metrics["oversized"], metrics["oversized_noticed"]) == (1, 1), metrics
    events = [v for t, v in producer.sent if t == schema.EVENTS_TOPIC]
    notices = [json.loads(v) for t, v in producer.sent if t == schema.DLQ_TOPIC]
    assert len(events) == 1 and all(len(v) < TOPIC_LIMIT for v in events), [len(v) for v in events]
    assert len(notices) == 1, notices
    notice = notices[0]
    assert (notice["reason"], notice["session_id"], notice["type"], notice["topic"]) == \
        ("oversized", "sess-big", "llm_call", schema.EVENTS_TOPIC), notice
    assert notice["id"] and notice["bytes"] > TOPIC_LIMIT, notice


def test_a_failed_describe_keeps_the_schema_cap(producers: list[_Producer], listening: str, tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    _Admin.fail = True
    log = SessionLogger(listening, name="cap2", spool_dir=tmp_path / "spool", linger_s=0.01)
    s = log.attach("sess")
    _big_call(s, 60_000)
    assert log.flush(5.0), log.metrics()
    assert _wait(lambda: "cannot read max.message.bytes" in caplog.text), caplog.text
    metrics = log.metrics()
    log.close()
    assert metrics["record_cap"] == schema.MAX_RECORD_BYTES and metrics["oversized"] == 0, metrics
    assert [t for t, _ in producers[0].sent] == [schema.EVENTS_TOPIC], producers[0].sent
