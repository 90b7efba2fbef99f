"""Kafka client settings, once, for every process: security protocol, SASL credentials, TLS files, client id.

Every Kafka client the project creates (the SDK's producer, the lake writer's consumer and DLQ producer,
the stack's and `flywheel topics`' admin clients) takes its security settings from one KafkaClientConfig,
so a managed cluster (MSK, Confluent, Aiven) is reached by setting them once:

    FLYWHEEL_KAFKA_SECURITY_PROTOCOL=SASL_SSL FLYWHEEL_KAFKA_SASL_MECHANISM=SCRAM-SHA-512 \\
    FLYWHEEL_KAFKA_SASL_USERNAME=flywheel FLYWHEEL_KAFKA_SASL_PASSWORD=... flywheel lake-writer

Values come, lowest precedence first, from field defaults, a `[kafka]` table in the TOML file named by
FLYWHEEL_KAFKA_CONFIG, and FLYWHEEL_KAFKA_<FIELD> variables. `client_kwargs()` turns a config into
kafka-python keyword arguments. The password is kept out of repr(), `describe()` and resolved configs.
Imports only the standard library: the SDK reads it on the agent's process.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

from flywheel.base.config import ConfigError, resolve, setting

KAFKA_ENV_PREFIX = "FLYWHEEL_KAFKA_"
CONFIG_FILE_ENV = "FLYWHEEL_KAFKA_CONFIG"
SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
_SSL_FILES = ("ssl_cafile", "ssl_certfile", "ssl_keyfile")
_SASL_FIELDS = ("sasl_mechanism", "sasl_username", "sasl_password")
_OTHER_KAFKA_ENV = frozenset({"FLYWHEEL_KAFKA_BOOTSTRAP", CONFIG_FILE_ENV})  # read by each process's own config
log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class KafkaClientConfig:
    """Security and identity settings shared by every Kafka client of every process."""

    security_protocol: str = setting("PLAINTEXT", "how clients talk to brokers: one of "
                                                  f"{', '.join(SECURITY_PROTOCOLS)}")
    sasl_mechanism: str | None = setting(None, f"SASL mechanism with SASL_*: one of {', '.join(SASL_MECHANISMS)}")
    sasl_username: str | None = setting(None, "SASL user name (required with SASL_*)")
    # repr=False: a config printed in a log or a traceback must not carry the secret
    sasl_password: str | None = dataclasses.field(default=None, repr=False,
                                                  metadata={"help": "SASL password (required with SASL_*; "
                                                                    "never logged)"})
    ssl_cafile: str | None = setting(None, "CA bundle (PEM) that signed the brokers' certificates; system CAs if unset")
    ssl_certfile: str | None = setting(None, "client certificate (PEM) for mutual TLS")
    ssl_keyfile: str | None = setting(None, "private key (PEM) of ssl_certfile")
    client_id: str | None = setting(None, "client id prefix in broker logs and quotas (default: each "
                                          "process's own name)")

    def check(self) -> None:
        protocol = self.security_protocol
        if protocol not in SECURITY_PROTOCOLS:
            raise ConfigError(f"kafka.security_protocol: {protocol!r} is not one of {list(SECURITY_PROTOCOLS)}")
        if protocol.startswith("SASL_"):
            missing = [name for name in _SASL_FIELDS if not getattr(self, name)]
            if missing:
                raise ConfigError(f"kafka.{', kafka.'.join(missing)}: required with security_protocol={protocol} "
                                  f"(env {', '.join(KAFKA_ENV_PREFIX + m.upper() for m in missing)})")
            if self.sasl_mechanism not in SASL_MECHANISMS:
                raise ConfigError(f"kafka.sasl_mechanism: {self.sasl_mechanism!r} is not one of "
                                  f"{list(SASL_MECHANISMS)}")
        else:
            stray = [name for name in _SASL_FIELDS if getattr(self, name)]
            if stray:
                raise ConfigError(f"kafka.{', kafka.'.join(stray)}: set, but security_protocol={protocol} does not use "
                                  "SASL (choose SASL_PLAINTEXT or SASL_SSL)")
        self._check_ssl_files(protocol)

    def _check_ssl_files(self, protocol: str) -> None:
        given = [name for name in _SSL_FILES if getattr(self, name)]
        if given and not protocol.endswith("SSL"):
            raise ConfigError(f"kafka.{', kafka.'.join(given)}: set, but security_protocol={protocol} does not use TLS "
                              "(choose SSL or SASL_SSL)")
        if bool(self.ssl_certfile) != bool(self.ssl_keyfile):
            raise ConfigError("kafka.ssl_certfile, kafka.ssl_keyfile: mutual TLS needs both, or neither")
        for name in given:  # fail at start-up, not at the first TLS handshake
            if not Path(getattr(self, name)).is_file():
                raise ConfigError(f"kafka.{name}: no such file {getattr(self, name)!r}")

    @property
    def sasl(self) -> bool:
        return self.security_protocol.startswith("SASL_")

    def describe(self) -> str:
        """One line for a setup log: every setting, the password only as whether it is set."""
        parts = [f"security_protocol={self.security_protocol}"]
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "security_protocol" or value is None:
                continue
            parts.append(f"{f.name}={'***' if f.name == 'sasl_password' else value}")
        return ", ".join(parts)


def load_kafka_config(env: Mapping[str, str] | None = None, toml_path: str | Path | None = None) -> KafkaClientConfig:
    """The checked KafkaClientConfig from `[kafka]` in `toml_path` (or $FLYWHEEL_KAFKA_CONFIG) and FLYWHEEL_KAFKA_*.

    Raises ConfigError naming the field (and the variable) that is wrong.
    """
    env = os.environ if env is None else env
    path = toml_path if toml_path is not None else env.get(CONFIG_FILE_ENV) or None
    table: dict[str, Any] = {}
    if path is not None:
        try:
            table = tomllib.loads(Path(path).read_text()).get("kafka", {})
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"{CONFIG_FILE_ENV}: cannot read {path}: {exc}") from None
        if not isinstance(table, dict):
            raise ConfigError(f"{CONFIG_FILE_ENV}: [kafka] in {path} is not a table")
    # Only FLYWHEEL_KAFKA_* is ours (a flat FLYWHEEL_CLIENT_ID belongs to nobody here); a typo in it, likely
    # next to a secret, is refused by name rather than ignored.
    names = {f.name for f in dataclasses.fields(KafkaClientConfig)}
    scoped = {key: value for key, value in env.items() if key.startswith(KAFKA_ENV_PREFIX)}
    unknown = sorted(k for k in scoped if k[len(KAFKA_ENV_PREFIX):].lower() not in names and k not in _OTHER_KAFKA_ENV)
    if unknown:
        raise ConfigError(f"kafka: unknown environment variable(s) {unknown}; known: "
                          f"{sorted(KAFKA_ENV_PREFIX + n.upper() for n in names) + sorted(_OTHER_KAFKA_ENV)}")
    try:
        return resolve(KafkaClientConfig, table, scoped, {}, process="KAFKA")
    except ConfigError as exc:
        text = str(exc)
        raise ConfigError(text if text.startswith("kafka.") else f"kafka.{text}") from None


def client_kwargs(cfg: KafkaClientConfig, client_id: str) -> dict[str, Any]:
    """kafka-python keyword arguments (KafkaProducer, KafkaConsumer, KafkaAdminClient) for these settings.

    `client_id` is the process's own name for the client; cfg.client_id, when set, is put in front of it,
    so broker-side quotas and logs can match one prefix and still tell the clients apart.
    """
    kwargs: dict[str, Any] = {
        "security_protocol": cfg.security_protocol,
        "client_id": f"{cfg.client_id}-{client_id}" if cfg.client_id else client_id,
    }
    if cfg.sasl:
        kwargs.update(sasl_mechanism=cfg.sasl_mechanism, sasl_plain_username=cfg.sasl_username,
                      sasl_plain_password=cfg.sasl_password)
    for name in _SSL_FILES:
        if getattr(cfg, name):
            kwargs[name] = getattr(cfg, name)
    return kwargs


# What a one-record batch needs beyond the record's key and value (a 61-byte batch header, the record's own
# varint header, room for headers): the SDK caps key + value at the topic's max.message.bytes less this.
RECORD_OVERHEAD_BYTES = 1024


def create_missing_topics(admin: Any, topics: list[str], partitions: int, replication_factor: int,
                          configs: dict[str, str] | None = None) -> list[str]:
    """Create the topics the cluster does not have yet, through a KafkaAdminClient; return their names.

    The one creation path for `flywheel infra up` and `flywheel topics create`. A topic created meanwhile by
    someone else raises kafka's TopicAlreadyExistsError: each caller decides whether that is an error.
    """
    from kafka.admin import NewTopic

    existing = set(admin.list_topics())
    missing = [t for t in topics if t not in existing]
    if missing:
        admin.create_topics([NewTopic(t, num_partitions=partitions, replication_factor=replication_factor,
                                      topic_configs=configs or {}) for t in missing])
    return missing


def topic_configs(admin: Any, topics: list[str]) -> dict[str, dict[str, str]]:
    """Every live config value of each topic (defaults included), through a KafkaAdminClient: {topic: {key: value}}.

    A topic the broker does not know is missing from the result. Reads both kafka-python 3's describe_configs
    (a dict) and 2.x's (response objects with `resources` tuples).
    """
    from kafka.admin import ConfigResource, ConfigResourceType

    resources = [ConfigResource(ConfigResourceType.TOPIC, t) for t in topics]
    try:
        result = admin.describe_configs(resources, config_filter="all")
    except TypeError:  # kafka-python 2.x: no config_filter, every value is returned anyway
        result = admin.describe_configs(resources)
    out: dict[str, dict[str, str]] = {}
    if isinstance(result, dict):
        for name, entries in result.get("topic", {}).items():
            if entries:
                out[name] = {key: str(entry.get("value")) for key, entry in entries.items()}
        return out
    for response in result:
        for error_code, _message, _rtype, name, entries in (r[:5] for r in response.resources):
            if error_code == 0:
                out[name] = {entry[0]: str(entry[1]) for entry in entries}
    return out


def recover_lost_join(consumer: Any) -> bool:
    """Restart a group join whose completion kafka-python dropped; True when it did. Call after each poll.

    kafka-python 3.0.12 (`coordinator/base.py`, `join_group_async`) runs a join as a task and, when a poll's time
    runs out first, leaves the task in flight for the next poll to await, but only while `need_rejoin()` holds. A
    rejoin caused by a metadata change (the group leader assigned partitions before it knew the topic's, which a
    fresh group on a fresh topic often does) needs it only until the leader's new assignment updates its metadata
    snapshot, inside the task. If the poll timed out before that, the next poll sees no rejoin needed and never
    awaits the task: its assignment is never applied, the member stays REBALANCING with no partitions, for ever
    (reproduced: a consumer polled with a timeout of 0-2 ms, 10 fresh groups of 10; tests/integration/
    test_kafka_group_join.py). A finished join task that nobody took, while the member is still rebalancing, is
    exactly that state: asking for a rejoin makes the next poll run a new join (the partitions were already
    revoked when the lost one began). Private attributes, read defensively: a kafka-python without them (or
    with the bug fixed and the task cleared) makes this a no-op.
    """
    coordinator = getattr(consumer, "_coordinator", None)
    task = getattr(coordinator, "_join_task", None)
    if task is None or not getattr(task, "is_done", False):
        return False
    if coordinator is None or str(getattr(coordinator, "state", "")) != "<rebalancing>" or coordinator.need_rejoin():
        return False
    coordinator.request_rejoin()
    return True


def connect_with_retry(make: Callable[[], T], what: str, timeout_s: float, stop: threading.Event | None = None,
                       first_wait_s: float = 1.0, max_wait_s: float = 15.0,
                       clock: Callable[[], float] = time.monotonic) -> T | None:
    """`make()` (a client whose constructor bootstraps), retried with doubling waits until it succeeds, `stop` is set
    (None) or `timeout_s` has passed (the last error is raised).

    A daemon that a supervisor restarts while the broker is away (an outage, a rolling restart) would otherwise exit
    at once on kafka-python's "Unable to bootstrap" and be restarted in a tight loop, or not at all. An unreachable
    address and refused credentials read alike to kafka-python 3 (both "Unable to bootstrap"), so each attempt's
    error is logged and the wait is bounded.
    """
    stop = stop if stop is not None else threading.Event()
    deadline = clock() + timeout_s
    wait, attempt = first_wait_s, 0
    while True:
        attempt += 1
        try:
            return make()
        except Exception as exc:
            left = deadline - clock()
            if left <= 0:
                log.error("setup: %s: Kafka still unreachable after %d attempts in %.0f s (%s: %s); giving up",
                          what, attempt, timeout_s, type(exc).__name__, exc)
                raise
            pause = min(wait, left)
            log.warning("setup: %s: Kafka unreachable (%s: %s); attempt %d, retrying in %.1f s (giving up in %.0f s; "
                        "a wrong address or refused credentials also read like this)",
                        what, type(exc).__name__, exc, attempt, pause, left)
            if stop.wait(pause):
                log.info("setup: %s: stopped while waiting for Kafka", what)
                return None
            wait = min(2 * wait, max_wait_s)
