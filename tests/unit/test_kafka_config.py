"""KafkaClientConfig (FLYWHEEL_KAFKA_*, a [kafka] TOML table), its kafka-python arguments, and `flywheel topics
check`'s comparison of live topics with the wanted settings."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest

from flywheel.base.config import ConfigError
from flywheel.base.kafka import KafkaClientConfig, client_kwargs, connect_with_retry, load_kafka_config
from flywheel.ingest import schema
from flywheel.topics import (
    DLQ_LARGEST_RECORD,
    SDK_LARGEST_RECORD,
    LiveTopic,
    TopicsConfig,
    mismatches,
)

SCRAM = {"FLYWHEEL_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT", "FLYWHEEL_KAFKA_SASL_MECHANISM": "SCRAM-SHA-256",
         "FLYWHEEL_KAFKA_SASL_USERNAME": "agent", "FLYWHEEL_KAFKA_SASL_PASSWORD": "s3cret-pw"}


def test_no_settings_mean_plaintext_with_the_process_client_id() -> None:
    kwargs = client_kwargs(load_kafka_config(env={}), "lake-writer-a")
    assert kwargs == {"security_protocol": "PLAINTEXT", "client_id": "lake-writer-a"}, kwargs


def test_env_scram_settings_become_kafka_python_arguments() -> None:
    kwargs = client_kwargs(load_kafka_config(env={**SCRAM, "FLYWHEEL_KAFKA_CLIENT_ID": "team-x"}), "sdk")
    assert kwargs == {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "SCRAM-SHA-256",
                      "sasl_plain_username": "agent", "sasl_plain_password": "s3cret-pw", "client_id": "team-x-sdk"}, kwargs


def test_ssl_files_are_passed_and_must_exist(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    env = {"FLYWHEEL_KAFKA_SECURITY_PROTOCOL": "SSL", "FLYWHEEL_KAFKA_SSL_CAFILE": str(ca)}
    assert client_kwargs(load_kafka_config(env=env), "c")["ssl_cafile"] == str(ca)
    with pytest.raises(ConfigError, match="kafka.ssl_cafile: no such file"):
        load_kafka_config(env={**env, "FLYWHEEL_KAFKA_SSL_CAFILE": str(tmp_path / "missing.pem")})
    with pytest.raises(ConfigError, match="ssl_certfile, kafka.ssl_keyfile"):
        load_kafka_config(env={**env, "FLYWHEEL_KAFKA_SSL_CERTFILE": str(ca)})


@pytest.mark.parametrize("env, message", [
    ({"FLYWHEEL_KAFKA_SECURITY_PROTOCOL": "TLS"}, "kafka.security_protocol: 'TLS' is not one of"),
    ({**SCRAM, "FLYWHEEL_KAFKA_SASL_MECHANISM": "GSSAPI"}, "kafka.sasl_mechanism: 'GSSAPI' is not one of"),
    ({k: v for k, v in SCRAM.items() if "PASSWORD" not in k}, "kafka.sasl_password: required with "
                                                               "security_protocol=SASL_PLAINTEXT"),
    ({"FLYWHEEL_KAFKA_SASL_USERNAME": "agent"}, "kafka.sasl_username: set, but security_protocol=PLAINTEXT"),
    ({"FLYWHEEL_KAFKA_SSL_CAFILE": "/etc/ca.pem"}, "kafka.ssl_cafile: set, but security_protocol=PLAINTEXT"),
])
def test_invalid_settings_name_the_field(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_kafka_config(env=env)
    assert message in str(info.value), str(info.value)


def test_toml_table_is_read_and_env_wins(tmp_path: Path) -> None:
    path = tmp_path / "kafka.toml"
    path.write_text('[kafka]\nsecurity_protocol = "SASL_SSL"\nsasl_mechanism = "SCRAM-SHA-512"\n'
                    'sasl_username = "from-file"\nsasl_password = "file-pw"\n')
    cfg = load_kafka_config(env={"FLYWHEEL_KAFKA_CONFIG": str(path), "FLYWHEEL_KAFKA_SASL_USERNAME": "from-env"})
    assert (cfg.security_protocol, cfg.sasl_mechanism, cfg.sasl_username, cfg.sasl_password) == \
        ("SASL_SSL", "SCRAM-SHA-512", "from-env", "file-pw"), cfg.describe()
    path.write_text('[kafka]\nsasl_user = "typo"\n')
    with pytest.raises(ConfigError, match="sasl_user"):
        load_kafka_config(env={"FLYWHEEL_KAFKA_CONFIG": str(path)})


def test_other_flywheel_variables_do_not_leak_in() -> None:
    cfg = load_kafka_config(env={"FLYWHEEL_CLIENT_ID": "not-kafka", "FLYWHEEL_SECURITY_PROTOCOL": "SSL"})
    assert (cfg.client_id, cfg.security_protocol) == (None, "PLAINTEXT"), cfg.describe()


def test_password_is_never_in_repr_or_describe(caplog: pytest.LogCaptureFixture) -> None:
    cfg = load_kafka_config(env=SCRAM)
    with caplog.at_level(logging.INFO):
        logging.getLogger("test").info("settings %s / %r", cfg.describe(), cfg)
    assert "s3cret-pw" not in repr(cfg) and "s3cret-pw" not in caplog.text, caplog.text
    assert "sasl_password=***" in cfg.describe() and "sasl_username=agent" in cfg.describe(), cfg.describe()
    assert KafkaClientConfig().describe() == "security_protocol=PLAINTEXT"


# ---------------------------------------------------------------- topics check's comparison
def _cfg(**changes: object) -> TopicsConfig:
    cfg = TopicsConfig(**changes)  # type: ignore[arg-type]
    cfg.check()
    return cfg


def _fit(cfg: TopicsConfig) -> LiveTopic:
    return LiveTopic(cfg.partitions, cfg.replication_factor, dict(cfg.topic_settings()))


def test_a_topic_made_by_create_passes_check() -> None:
    cfg = _cfg()
    assert all(not mismatches(cfg, t, _fit(cfg), largest) for t, largest in cfg.topics().items())


def test_check_names_each_shortfall() -> None:
    cfg = _cfg(partitions=12, replication_factor=3, min_insync_replicas=2, retention_ms=604_800_000,
               max_message_bytes=8 * 1024 * 1024)
    live = LiveTopic(4, 1, {"min.insync.replicas": "1", "retention.ms": "3600000", "max.message.bytes": "1048588"})
    found = mismatches(cfg, "flywheel.events", live, SDK_LARGEST_RECORD)
    expected = ["4 partitions < --partitions 12", "replication factor 1 < --replication-factor 3",
                "min.insync.replicas 1 < --min-insync-replicas 2", "retention.ms 3600000 < --retention-ms 604800000",
                "max.message.bytes 1048588 < --max-message-bytes 8388608",
                f"max.message.bytes 1048588 < the SDK's largest record ({SDK_LARGEST_RECORD} bytes)"]
    assert found == [f"flywheel.events: {line}" for line in expected], found


def test_check_flags_a_max_message_bytes_below_the_largest_record_even_when_the_flag_allows_it() -> None:
    cfg = _cfg(max_message_bytes=1024 * 1024, replication_factor=1, min_insync_replicas=1)
    assert SDK_LARGEST_RECORD > schema.MAX_RECORD_BYTES
    events = mismatches(cfg, "e", _fit(cfg), SDK_LARGEST_RECORD)
    dlq = mismatches(cfg, "d", LiveTopic(cfg.partitions, 1, {"max.message.bytes": str(SDK_LARGEST_RECORD)}),
                     DLQ_LARGEST_RECORD)
    assert events == [f"e: max.message.bytes 1048576 < the SDK's largest record ({SDK_LARGEST_RECORD} bytes)"], events
    assert dlq == [f"d: max.message.bytes {SDK_LARGEST_RECORD} < a dead letter of the largest SDK record "
                   f"({DLQ_LARGEST_RECORD} bytes)"], dlq


def test_check_accepts_more_and_flags_isr_that_stops_writes() -> None:
    cfg = _cfg(partitions=4, replication_factor=3, min_insync_replicas=2, retention_ms=1000)
    more = LiveTopic(16, 3, {"min.insync.replicas": "3", "retention.ms": "-1", "max.message.bytes": str(16 << 20)})
    assert mismatches(cfg, "t", more, SDK_LARGEST_RECORD) == [
        "t: min.insync.replicas 3 >= replication factor 3: one broker down stops every acks=all write"]
    assert mismatches(cfg, "t", None, SDK_LARGEST_RECORD) == ["t: missing (run `flywheel topics create`)"]


def test_topics_config_rejects_impossible_settings() -> None:
    with pytest.raises(ConfigError, match="min_insync_replicas, replication_factor"):
        _cfg(replication_factor=1, min_insync_replicas=2)
    with pytest.raises(ConfigError, match="must be three different topics"):
        _cfg(dlq_topic=schema.EVENTS_TOPIC)


def test_a_misspelt_kafka_variable_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="FLYWHEEL_KAFKA_SASL_USER'"):
        load_kafka_config(env={**SCRAM, "FLYWHEEL_KAFKA_SASL_USER": "agent", "FLYWHEEL_KAFKA_BOOTSTRAP": "b:9092"})


class _Task:
    def __init__(self, done: bool) -> None:
        self.is_done = done


class _Coordinator:
    def __init__(self, state: str, task: _Task | None, rejoin: bool) -> None:
        self.state, self._join_task, self.rejoin_needed = state, task, rejoin

    def need_rejoin(self) -> bool:
        return self.rejoin_needed

    def request_rejoin(self) -> None:
        self.rejoin_needed = True


class _Consumer:
    def __init__(self, coordinator: object) -> None:
        self._coordinator = coordinator


def test_only_a_finished_join_left_untaken_while_rebalancing_is_restarted() -> None:
    from flywheel.base.kafka import recover_lost_join

    lost = _Coordinator("<rebalancing>", _Task(done=True), rejoin=False)
    assert recover_lost_join(_Consumer(lost)) and lost.rejoin_needed, "the dropped completion must ask for a rejoin"
    assert not recover_lost_join(_Consumer(lost)), "once asked, the next poll's join loop takes over"
    healthy = [
        _Coordinator("<rebalancing>", _Task(done=False), rejoin=False),  # the join still runs: the next poll awaits it
        _Coordinator("<rebalancing>", _Task(done=True), rejoin=True),    # the next poll's loop will take it
        _Coordinator("<stable>", _Task(done=True), rejoin=False),        # joined
        _Coordinator("<rebalancing>", None, rejoin=False),               # no task at all
    ]
    for coordinator in healthy:
        before = coordinator.rejoin_needed
        assert not recover_lost_join(_Consumer(coordinator)) and coordinator.rejoin_needed == before, vars(coordinator)
    assert not recover_lost_join(object()), "a client without kafka-python 3's attributes is left alone"


# ---------------------------------------------------------------------------------------------
# start-up while the broker is away: wait (bounded, logged), do not exit
# ---------------------------------------------------------------------------------------------
class _Flaky:
    """A client constructor that fails `failures` times (as kafka-python's does while no broker answers)."""

    def __init__(self, failures: int) -> None:
        self.failures, self.calls = failures, 0

    def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise TimeoutError("Unable to bootstrap from ['127.0.0.1:1']")
        return "client"


def test_a_client_made_while_the_broker_is_away_is_retried_until_it_answers(caplog: pytest.LogCaptureFixture) -> None:
    make = _Flaky(3)
    with caplog.at_level(logging.WARNING, logger="flywheel.base.kafka"):
        got = connect_with_retry(make, "test writer", timeout_s=30.0, first_wait_s=0.01, max_wait_s=0.02)
    assert got == "client" and make.calls == 4, make.calls
    retries = [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()]
    assert len(retries) == 3 and "Unable to bootstrap" in retries[0] and "test writer" in retries[0], retries


def test_the_wait_for_the_broker_is_bounded_and_then_raises_the_last_error() -> None:
    now = [0.0]

    def clock() -> float:
        now[0] += 1.0  # each look at the clock is a second later: the bound is reached after a few attempts
        return now[0]

    make = _Flaky(10**6)
    with pytest.raises(TimeoutError, match="Unable to bootstrap"):
        connect_with_retry(make, "test writer", timeout_s=5.0, first_wait_s=0.001, max_wait_s=0.001, clock=clock)
    assert 1 < make.calls < 10, make.calls


def test_a_stop_while_waiting_for_the_broker_returns_none_at_once() -> None:
    stop = threading.Event()
    stop.set()
    make = _Flaky(10**6)
    assert connect_with_retry(make, "test writer", timeout_s=600.0, stop=stop, first_wait_s=60.0) is None
    assert make.calls == 1
