"""`flywheel infra up|down|status`: the local stack on loopback — Apache Kafka, MLflow, vLLM on CPU.

    flywheel infra up      # start what is not running; idempotent
    flywheel infra status  # each part with its address and health
    flywheel infra down    # stop what `up` started (by pid file), nothing else

Each part runs as its own process session with a pid file under var/run/ and a log under
var/log/. `up` checks health before starting anything (a healthy part is left alone), refuses
a busy port with one line naming it, and stops what it started if a later part fails.

- Kafka: a single-node KRaft broker from the jars infra/setup.sh fetched from Maven Central,
  storage formatted on first start, topics created with the configured partitions.
  `--kafka-brokers 3` runs a KRaft cluster instead: 3 combined broker+controller nodes, node i
  on kafka_port + 2i (clients) and kafka_controller_port + 2i (its controller), each with its own
  pid file (kafka-<node.id>), log and data dir, and topics on 3 replicas (min.insync.replicas 2).
- MLflow: the embedded default store is a sqlite file and a local artifact folder under var/,
  usable with no server at all; `up` also starts `mlflow server` on the same store for its UI.
- vLLM: the OpenAI-compatible server on CPU serving the base model as `policy-v0`, with
  runtime LoRA loading (unless `--no-vllm-lora`: a tier that only takes full weights) and the
  dev-mode endpoints (reload_weights, pause/resume, weight version).
  `--vllm-servers N` runs N of them on consecutive ports (a full-weight tier needs a server per
  live version: control, champion, challenger), each its own process, pid file and log.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Literal

from flywheel.base import defaults, tracking
from flywheel.base.config import ConfigError, check_choices, load_config, setting, setup_logging
from flywheel.base.kafka import (
    KafkaClientConfig,
    client_kwargs,
    create_missing_topics,
    load_kafka_config,
)
from flywheel.base.versions import version_name

log = logging.getLogger(__name__)

PARTS = ("kafka", "mlflow", "vllm", "s3")
DEFAULT_PARTS = ("kafka", "mlflow", "vllm")  # s3 is an option: the default lake is a local folder
REPO_ROOT = Path(__file__).resolve().parent.parent


class StackError(RuntimeError):
    """One part of the stack could not be brought up; the message says what and what to do."""


@dataclass
class StackConfig:
    """The local stack: ports, paths and limits of Kafka, MLflow and vLLM."""

    action: Literal["up", "down", "status", "restart"] = setting("status", "up, down, restart or status")
    parts: list[str] = setting(list(DEFAULT_PARTS), "which parts to act on (comma-separated): kafka, mlflow, vllm, "
                                                   "s3 (an S3-compatible server for an s3:// lake; not in the default)")
    var_dir: Path = setting(Path(defaults.VAR_DIR), "state directory (data, logs, pid files)")
    kafka_host: str = setting("127.0.0.1", "address the broker listens on")
    kafka_port: int = setting(9092, "broker port")
    kafka_controller_port: int = setting(9093, "KRaft controller port")
    kafka_partitions: int = setting(4, "partitions of the topics flywheel.events, flywheel.outcomes, flywheel.dlq")
    kafka_topics: list[str] = setting(["flywheel.events", "flywheel.outcomes", "flywheel.dlq"], "topics created by up")
    kafka_heap: str = setting("512m", "broker JVM heap (-Xmx)")
    kafka_libs: Path = setting(REPO_ROOT / "var" / "kafka" / "libs", "Kafka broker jars (fetched by make setup)")
    kafka_timeout_s: float = setting(90.0, "how long to wait for the broker to answer")
    kafka_sasl: bool = setting(False, "listen with SASL_PLAINTEXT SCRAM-SHA-256 instead of PLAINTEXT; the user and "
                                      "password are FLYWHEEL_KAFKA_SASL_USERNAME/PASSWORD, the same settings every "
                                      "client reads")
    kafka_brokers: int = setting(1, "Kafka nodes: 1 (one broker) or a KRaft cluster of >= 3 combined broker+controller "
                                    "nodes, node i on kafka_port + 2i and kafka_controller_port + 2i, topics "
                                    "on 3 replicas")
    mlflow_tracking_uri: str = setting(defaults.MLFLOW_TRACKING_URI, "tracking store every process uses (sqlite "
                                                                     "file by default)")
    mlflow_artifacts_dir: Path = setting(Path(defaults.MLFLOW_ARTIFACTS_DIR),
                                         "local artifact folder of the embedded store")
    mlflow_host: str = setting("127.0.0.1", "address of the MLflow UI server")
    mlflow_port: int = setting(defaults.MLFLOW_PORT, "port of the MLflow UI server")
    mlflow_timeout_s: float = setting(120.0, "how long to wait for the MLflow server")
    vllm_host: str = setting("127.0.0.1", "address vLLM listens on")
    vllm_port: int = setting(8000, "vLLM port (of the first server; server i listens on vllm_port + i)")
    vllm_servers: int = setting(1, "how many vLLM servers to run, each its own process on the base model "
                                   "(a full-weight tier serves each live version on a server of its own)")
    base_model: Path = setting(Path(defaults.BASE_MODEL_DIR), "model directory vLLM serves (the default is built by "
                                                              "`flywheel model init`)")
    served_model_name: str = setting(version_name(0), "name vLLM serves the base model under")
    vllm_max_model_len: int = setting(2048, "context length vLLM allocates for")
    vllm_lora: bool = setting(True, "start the servers with --enable-lora and runtime LoRA loading: needed when "
                                    "LoRA versions are published (the learner's --mode lora); a tier that only takes "
                                    "full weights (--mode full) runs without, so vLLM does not wrap its layers for "
                                    "adapters that never come. A server of ours running without it is restarted by "
                                    "an `up` that wants it; one with it is kept by an `up` that does not")
    vllm_max_loras: int = setting(4, "LoRA adapters resident at once (--max-loras)")
    vllm_max_lora_rank: int = setting(32, "largest LoRA rank vLLM accepts (--max-lora-rank)")
    vllm_kv_cache_gib: int = setting(1, "VLLM_CPU_KVCACHE_SPACE, GiB of KV cache on CPU")
    vllm_dtype: str = setting("float32", "weights dtype; float32 keeps learner and server logprobs within 1e-4")
    vllm_extra_args: list[str] = setting([], "extra vLLM server flags, comma-separated")
    vllm_timeout_s: float = setting(300.0, "how long to wait for vLLM to serve")
    vllm_nice: int = setting(0, "the servers' scheduling niceness (0-19; every thread of each, and its session's "
                                "scheduler autogroup): on a "
                                "machine they share with the learner, a positive value lets a learner step take a "
                                "core when it has one to run, and the servers take the cores back while it waits. "
                                "Set once they serve (starting at 10 beside a warm-start build, none served within "
                                "300 s), and on servers of ours already running; a niceness is only ever raised "
                                "(lowering needs privileges)")
    s3_host: str = setting("127.0.0.1", "address the S3-compatible server (S3Proxy) listens on")
    s3_port: int = setting(9000, "S3 port; clients use AWS_ENDPOINT_URL=http://<s3_host>:<s3_port>")
    s3_bucket: str = setting("flywheel", "bucket `up` creates; the lake root is then s3://<bucket>/lake")
    s3_access_key: str = setting("flywheel", "the one identity S3Proxy accepts (clients: AWS_ACCESS_KEY_ID)")
    s3_secret_key: str = setting("flywheel-local-secret", "its secret (clients: AWS_SECRET_ACCESS_KEY); loopback only")
    s3_jar: Path = setting(REPO_ROOT / "var" / "s3proxy" / "s3proxy-4.1.0-jar-with-dependencies.jar",
                           "S3Proxy jar (fetched from Maven Central by make setup)")
    s3_heap: str = setting("256m", "S3Proxy JVM heap (-Xmx)")
    s3_timeout_s: float = setting(60.0, "how long to wait for S3Proxy to answer")

    def check(self) -> None:
        unknown = sorted(set(self.parts) - set(PARTS))
        if unknown:
            raise ConfigError(f"parts: unknown {unknown}; choose from {list(PARTS)}")
        check_choices(self)
        if self.vllm_servers < 1:
            raise ConfigError(f"vllm_servers: must be >= 1, got {self.vllm_servers}")
        if not 0 <= self.vllm_nice <= 19:
            raise ConfigError(f"vllm_nice: must be within 0-19, got {self.vllm_nice}")
        ports = {"kafka_port": self.kafka_port, "kafka_controller_port": self.kafka_controller_port,
                 "mlflow_port": self.mlflow_port}
        if len(set(ports.values())) != len(ports):
            raise ConfigError(f"kafka_port, kafka_controller_port and mlflow_port must differ: {ports}")
        clash = {name: port for name, port in ports.items() if port in self.vllm_ports}
        if clash:
            raise ConfigError(f"vllm_port and vllm_servers: the vLLM servers' ports {self.vllm_ports} collide "
                              f"with {clash}")
        if self.kafka_brokers > 1:
            self._check_kafka_cluster(ports)

    def _check_kafka_cluster(self, ports: dict[str, int]) -> None:
        if self.kafka_brokers < 3:
            raise ConfigError(f"kafka_brokers: 1 or at least 3, got {self.kafka_brokers} (a KRaft quorum of 2 "
                              "stops when either node does, and 3 replicas need 3 nodes)")
        node_ports = [port for _, client, controller in self.kafka_nodes for port in (client, controller)]
        taken = {name: port for name, port in ports.items() if not name.startswith("kafka_")}
        taken |= {f"vllm server {i}": port for i, port in enumerate(self.vllm_ports)}
        clash = {name: port for name, port in taken.items() if port in node_ports}
        if len(set(node_ports)) != len(node_ports) or clash:
            raise ConfigError(f"kafka_brokers, kafka_port and kafka_controller_port: the {self.kafka_brokers} nodes' "
                              f"ports {node_ports} (client, controller per node) must differ from each other and from "
                              f"{clash or taken}")

    @property
    def kafka_nodes(self) -> list[tuple[int, int, int]]:
        """(node.id, client port, controller port) of each Kafka node; ports step by 2 so the defaults interleave
        (9092/9093, 9094/9095, 9096/9097) and one node keeps exactly kafka_port and kafka_controller_port."""
        return [(i + 1, self.kafka_port + 2 * i, self.kafka_controller_port + 2 * i) for i in range(self.kafka_brokers)]

    @property
    def kafka_replication(self) -> int:
        """Replicas of each topic partition: 1 on one node, 3 on a cluster (with min.insync.replicas 2)."""
        return 1 if self.kafka_brokers == 1 else 3

    @property
    def kafka_bootstrap(self) -> str:
        """Every node's client address, comma-separated (the form every flywheel client takes)."""
        return ",".join(f"{self.kafka_host}:{port}" for _, port, _ in self.kafka_nodes)

    @property
    def vllm_ports(self) -> list[int]:
        return [self.vllm_port + i for i in range(self.vllm_servers)]

    @property
    def vllm_urls(self) -> list[str]:
        return [f"http://{self.vllm_host}:{port}" for port in self.vllm_ports]

    @property
    def vllm_url(self) -> str:
        """The first server (the only one unless vllm_servers > 1)."""
        return self.vllm_urls[0]

    @property
    def mlflow_ui_url(self) -> str:
        return f"http://{self.mlflow_host}:{self.mlflow_port}"

    def port_of(self, part: str) -> int:
        return {"kafka": self.kafka_port, "mlflow": self.mlflow_port, "vllm": self.vllm_port, "s3": self.s3_port}[part]

    def address_of(self, part: str) -> str:
        return {"kafka": self.kafka_bootstrap, "mlflow": f"{self.mlflow_tracking_uri} (UI {self.mlflow_ui_url})",
                "vllm": ", ".join(self.vllm_urls), "s3": f"{self.s3_url} (bucket s3://{self.s3_bucket})"}[part]

    @property
    def s3_url(self) -> str:
        return f"http://{self.s3_host}:{self.s3_port}"


def load_stack_config(argv: list[str] | None) -> StackConfig:
    return load_config(StackConfig, argv, prog="flywheel infra")


# ---------------------------------------------------------------------------------------------
# process bookkeeping
# ---------------------------------------------------------------------------------------------
def _run_dir(cfg: StackConfig) -> Path:
    return Path(cfg.var_dir) / "run"


def _log_path(cfg: StackConfig, part: str) -> Path:
    path = Path(cfg.var_dir) / "log" / f"{part}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _pid_path(cfg: StackConfig, part: str) -> Path:
    return _run_dir(cfg) / f"{part}.pid.json"


def _read_pid(cfg: StackConfig, part: str) -> dict[str, Any] | None:
    try:
        record = json.loads(_pid_path(cfg, part).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return record if _alive_and_ours(record) else None


def _alive_and_ours(record: dict[str, Any]) -> bool:
    """The pid is alive and still runs our command (pids are reused after a reboot)."""
    try:
        cmdline = Path(f"/proc/{record['pid']}/cmdline").read_bytes().decode(errors="replace")
    except (OSError, KeyError):
        return False
    return record.get("marker", "") in cmdline


def _spawn(cfg: StackConfig, part: str, cmd: list[str], env: dict[str, str], marker: str,
           port: int | None = None) -> dict[str, Any]:
    log_file = open(_log_path(cfg, part), "ab")
    log_file.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} starting {part}: {' '.join(cmd)}\n".encode())
    log_file.flush()
    # A process session of its own: it outlives `infra up`, and `down` can stop its whole group
    # (vLLM and mlflow start worker processes).
    proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=env, start_new_session=True, cwd=str(REPO_ROOT))
    record = {"pid": proc.pid, "part": part, "marker": marker, "cmd": cmd, "started": time.time(),
              "port": cfg.port_of(part) if port is None else port, "log": str(_log_path(cfg, part))}
    _run_dir(cfg).mkdir(parents=True, exist_ok=True)
    _pid_path(cfg, part).write_text(json.dumps(record))
    return record


def _stop_record(record: dict[str, Any], timeout_s: float = 20.0) -> None:
    pid = int(record["pid"])
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return
        _reap(pid)
        time.sleep(0.2)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    _reap(pid)


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _port_busy(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def _port_open(host: str, port: int) -> bool:
    """Something accepts connections there (a probe that, unlike bind, cannot steal the port)."""
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def _http_get(url: str, timeout: float = 3.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except (urllib.error.URLError, OSError, TimeoutError):
        return 0, ""


def _alive_twice(record: dict[str, Any]) -> bool:
    """Whether the process is alive and ours; /proc/PID/cmdline reads empty for a few ms while the child is
    still in exec(), so a first miss is looked at again."""
    if _alive_and_ours(record):
        return True
    time.sleep(0.2)
    return _alive_and_ours(record)


def _wait(what: str, check: Callable[[], bool], timeout_s: float, record: dict[str, Any], log_path: Path) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if check():
            return
        # /proc/PID/cmdline reads empty for a few ms while the child is still in exec(): look twice.
        if not _alive_twice(record):
            tail = _tail(log_path)
            raise StackError(f"{what} exited during start-up; last lines of {log_path}:\n{tail}")
        time.sleep(0.5)
    raise StackError(f"{what} did not become healthy within {timeout_s:.0f}s; see {log_path}")


def _tail(path: Path, lines: int = 15) -> str:
    """The last lines the current start wrote (the log is appended to across starts)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    current = text.rsplit("\n==== ", 1)[-1]
    return "\n".join(current.splitlines()[-lines:])


# ---------------------------------------------------------------------------------------------
# Kafka
# ---------------------------------------------------------------------------------------------
def _kafka_dir(cfg: StackConfig) -> Path:
    """The broker's folder, var/kafka; a cluster's is var/kafka-<N>-nodes, holding its cluster id and a node-<id>
    folder per node (a quorum of another size is another cluster: it never shares storage with this one)."""
    name = "kafka" if cfg.kafka_brokers == 1 else f"kafka-{cfg.kafka_brokers}-nodes"
    return (Path(cfg.var_dir) / name).resolve()


def _node_dir(cfg: StackConfig, node_id: int) -> Path:
    """A node's server.properties and data/ (the broker's own folder when there is one node)."""
    return _kafka_dir(cfg) if cfg.kafka_brokers == 1 else _kafka_dir(cfg) / f"node-{node_id}"


def kafka_node_name(cfg: StackConfig, node_id: int) -> str:
    """A node's name for its pid file and log: kafka for the one broker, kafka-<node.id> in a cluster."""
    return "kafka" if cfg.kafka_brokers == 1 else f"kafka-{node_id}"


def _kafka_client(cfg: StackConfig) -> KafkaClientConfig:
    """The client settings (FLYWHEEL_KAFKA_*) the stack's own admin calls use, checked against --kafka-sasl."""
    try:
        client = load_kafka_config()
    except ConfigError as exc:
        raise StackError(f"kafka: {exc}") from None
    wanted = ("SASL_PLAINTEXT", "SCRAM-SHA-256") if cfg.kafka_sasl else ("PLAINTEXT", None)
    if (client.security_protocol, client.sasl_mechanism) != wanted:
        raise StackError(f"kafka: the local broker {'with' if cfg.kafka_sasl else 'without'} --kafka-sasl takes "
                         f"FLYWHEEL_KAFKA_SECURITY_PROTOCOL={wanted[0]}"
                         + (f" and FLYWHEEL_KAFKA_SASL_MECHANISM={wanted[1]}"
                            " (and a user name and password)" if wanted[1] else "")
                         + f", not {client.describe()}")
    return client


def _listener_props(cfg: StackConfig, node_id: int = 1) -> str:
    """The client listener: PLAINTEXT, or SASL_PLAINTEXT with SCRAM-SHA-256 for the user of FLYWHEEL_KAFKA_SASL_*."""
    _, port, controller_port = cfg.kafka_nodes[node_id - 1]
    controller = f"CONTROLLER://{cfg.kafka_host}:{controller_port}"
    if not cfg.kafka_sasl:
        return (f"listeners=PLAINTEXT://{cfg.kafka_host}:{port},{controller}\n"
                f"advertised.listeners=PLAINTEXT://{cfg.kafka_host}:{port}\n"
                "listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT\n"
                "inter.broker.listener.name=PLAINTEXT\n")
    client = _kafka_client(cfg)
    def quote(text: str | None) -> str:  # a JAAS string literal
        return str(text).replace("\\", "\\\\").replace('"', '\\"')

    return (f"listeners=SASL_PLAINTEXT://{cfg.kafka_host}:{port},{controller}\n"
            f"advertised.listeners=SASL_PLAINTEXT://{cfg.kafka_host}:{port}\n"
            "listener.security.protocol.map=CONTROLLER:PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT\n"
            "inter.broker.listener.name=SASL_PLAINTEXT\n"
            "sasl.enabled.mechanisms=SCRAM-SHA-256\n"
            "sasl.mechanism.inter.broker.protocol=SCRAM-SHA-256\n"
            # the broker's own client on the inter-broker listener logs in as the same SCRAM user
            "listener.name.sasl_plaintext.scram-sha-256.sasl.jaas.config=org.apache.kafka.common.security.scram."
            f'ScramLoginModule required username="{quote(client.sasl_username)}" '
            f'password="{quote(client.sasl_password)}";\n')


def _replication_props(cfg: StackConfig) -> str:
    if cfg.kafka_brokers == 1:
        return """# A single node: without these three the group coordinator never becomes available
# (reported against Kafka 4.0 in kafkajs issue 1752).
offsets.topic.replication.factor=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
"""
    # 3 replicas and an acks=all write on at least 2: one node can die without losing an acknowledged
    # record or refusing writes; only a replica that was in sync may become leader.
    return """default.replication.factor=3
min.insync.replicas=2
offsets.topic.replication.factor=3
transaction.state.log.replication.factor=3
transaction.state.log.min.isr=2
unclean.leader.election.enable=false
"""


def _write_kafka_config(cfg: StackConfig, node_id: int = 1) -> Path:
    """Node node_id's server.properties (and the shared log4j2 file). Every node of a cluster is broker and
    controller (combined mode) and lists all of them as a static quorum (controller.quorum.voters)."""
    kdir, ndir = _kafka_dir(cfg), _node_dir(cfg, node_id)
    ndir.mkdir(parents=True, exist_ok=True)
    voters = ",".join(f"{n}@{cfg.kafka_host}:{controller}" for n, _, controller in cfg.kafka_nodes)
    props = f"""# written by infra/stack.py; regenerated on every start
process.roles=broker,controller
node.id={node_id}
controller.quorum.voters={voters}
{_listener_props(cfg, node_id)}controller.listener.names=CONTROLLER
log.dirs={ndir / 'data'}
num.partitions={cfg.kafka_partitions}
{_replication_props(cfg)}offsets.topic.num.partitions=4
group.initial.rebalance.delay.ms=0
message.max.bytes=8388608
auto.create.topics.enable=false
log.retention.hours=168
"""
    path = ndir / "server.properties"
    path.touch(mode=0o600)  # with --kafka-sasl it holds the SCRAM password
    path.write_text(props)
    (kdir / "log4j2.properties").write_text(
        "status = error\nappender.console.type = Console\nappender.console.name = STDOUT\n"
        "appender.console.layout.type = PatternLayout\nappender.console.layout.pattern = [%d] %p %m (%c)%n\n"
        "rootLogger.level = WARN\nrootLogger.appenderRef.stdout.ref = STDOUT\n"
        "logger.kafka.name = kafka\nlogger.kafka.level = WARN\n"
        "logger.server.name = kafka.server.KafkaRaftServer\nlogger.server.level = INFO\n"
        # "Failed authentication with /host (reason)": an operator's record of refused clients, and the broker's
        # side of a refusal when a client sees only the closed socket
        "logger.selector.name = org.apache.kafka.common.network.Selector\nlogger.selector.level = INFO\n"
    )
    return path


def _kafka_classpath(cfg: StackConfig) -> str:
    libs = Path(cfg.kafka_libs)
    if not (libs / ".complete").exists() and not any(libs.glob("kafka_2.13-*.jar")):
        raise StackError(f"Kafka jars missing in {libs}; run `make setup` (it fetches them from Maven "
                         "Central with Maven)")
    return f"{libs}/*"


def _java() -> str:
    java = shutil.which("java")
    if java is None:
        raise StackError("java not found; install a JDK 17+ (apt-get install openjdk-17-jre-headless): the Kafka "
                         "broker needs it")
    return java


def kafka_healthy(cfg: StackConfig, timeout_s: float = 5.0) -> bool:
    """The broker answers a metadata request (not only an open port); a cluster lists every node as a live broker."""
    if cfg.kafka_brokers > 1:
        return kafka_live_brokers(cfg, timeout_s) == cfg.kafka_brokers
    if not _port_open(cfg.kafka_host, cfg.kafka_port):
        return False  # nothing listens: skip kafka-python's bootstrap retries and their error logs
    try:
        from kafka import KafkaAdminClient

        admin = KafkaAdminClient(bootstrap_servers=cfg.kafka_bootstrap, request_timeout_ms=int(timeout_s * 1000),
                                 **client_kwargs(load_kafka_config(), "flywheel-health"))
    except Exception:  # kafka-python raises several types while a broker starts
        return False
    try:
        admin.list_topics()
        return True
    except Exception:
        return False
    finally:
        admin.close()


def kafka_live_brokers(cfg: StackConfig, timeout_s: float = 5.0) -> int:
    """How many brokers the cluster's metadata lists (a killed node drops out once the controller fences it,
    broker.session.timeout.ms after its last heartbeat); 0 when no node answers."""
    listening = [f"{cfg.kafka_host}:{port}" for _, port, _ in cfg.kafka_nodes if _port_open(cfg.kafka_host, port)]
    if not listening:
        return 0  # only nodes that listen: kafka-python logs an error for each dead bootstrap address it tries
    try:
        from kafka import KafkaAdminClient

        admin = KafkaAdminClient(bootstrap_servers=listening, request_timeout_ms=int(timeout_s * 1000),
                                 **client_kwargs(load_kafka_config(), "flywheel-health"))
    except Exception:  # kafka-python raises several types while a broker starts
        return 0
    try:
        # fenced brokers are listed too (kafka-python asks with include_fenced_brokers): a fenced one serves nothing
        return sum(1 for broker in admin.describe_cluster()["brokers"] if not broker.get("is_fenced"))
    except Exception:
        return 0
    finally:
        admin.close()


def ensure_topics(cfg: StackConfig, retry_s: float = 30.0) -> None:
    from kafka.errors import KafkaConnectionError

    # A node that has just come up may still refuse the request sent to it (see _cluster_up): retry a refused
    # connection for a while rather than fail a start that is otherwise healthy.
    deadline = time.monotonic() + retry_s
    while True:
        try:
            return _create_topics(cfg)
        except KafkaConnectionError as exc:
            if time.monotonic() >= deadline:
                raise StackError(f"kafka: creating topics at {cfg.kafka_bootstrap} failed for "
                                 f"{retry_s:.0f}s: {exc}") from exc
            log.info("kafka: creating topics refused (%s); retrying", exc)
            time.sleep(1.0)


def _create_topics(cfg: StackConfig) -> None:
    from kafka import KafkaAdminClient
    from kafka.errors import TopicAlreadyExistsError

    admin = KafkaAdminClient(bootstrap_servers=cfg.kafka_bootstrap,
                             **client_kwargs(_kafka_client(cfg), "flywheel-infra"))
    try:
        try:
            missing = create_missing_topics(admin, list(cfg.kafka_topics), cfg.kafka_partitions, cfg.kafka_replication)
        except TopicAlreadyExistsError:  # another `infra up` created them meanwhile: nothing of ours to report
            missing = []
        if missing:
            log.info("kafka: created topics %s with %d partitions, %d replicas", missing, cfg.kafka_partitions,
                     cfg.kafka_replication)
            _wait_for_leaders(admin, missing, cfg.kafka_partitions)
    finally:
        admin.close()


def _wait_for_leaders(admin: Any, topics: list[str], partitions: int, timeout_s: float = 30.0) -> None:
    """Wait until every new topic's partitions have a leader in the metadata. A KRaft cluster answers CreateTopics
    before its brokers' metadata show the partitions: a describe right after it found none (CI, 3 nodes). On
    timeout, warn and go on: the topics exist, and clients retry their metadata."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ready = sum(1 for t in admin.describe_topics(topics) if len(t.get("partitions") or []) == partitions
                        and all(p.get("leader_id", -1) >= 0 for p in t["partitions"]))
        except Exception as exc:  # noqa: BLE001 - metadata not there yet reads as an error on some versions
            log.debug("kafka: describing new topics failed (%s); retrying", exc)
            ready = 0
        if ready == len(topics):
            return
        if time.monotonic() >= deadline:
            log.warning("kafka: new topics %s have no leader for every partition after %.0fs; going on", topics,
                        timeout_s)
            return
        time.sleep(0.2)


def start_kafka(cfg: StackConfig) -> dict[str, Any]:
    """Start the broker, or every node of a cluster (formatting storage on first start), and wait until it answers;
    returns the (first) node's pid record. A cluster that does not come up whole is stopped whole."""
    _kafka_client(cfg)  # fail fast on client settings that this broker would refuse
    java = _java()
    classpath = _kafka_classpath(cfg)
    if cfg.kafka_brokers == 1:
        record = _spawn_kafka_node(cfg, 1, java, classpath)
        _wait("kafka broker", lambda: kafka_healthy(cfg), cfg.kafka_timeout_s, record, _log_path(cfg, "kafka"))
        ensure_topics(cfg)
        return record
    records: list[dict[str, Any]] = []
    try:
        # all spawned before any is waited on: a node serves nothing until a majority of the quorum runs
        for node_id, _, _ in cfg.kafka_nodes:
            records.append(_spawn_kafka_node(cfg, node_id, java, classpath))
        _wait(f"kafka cluster of {cfg.kafka_brokers} nodes", lambda: _cluster_up(cfg, records), cfg.kafka_timeout_s,
              records[0], _log_path(cfg, kafka_node_name(cfg, 1)))
        ensure_topics(cfg)
    except BaseException:
        stop_kafka(cfg)
        raise
    return records[0]


def _cluster_up(cfg: StackConfig, records: list[dict[str, Any]]) -> bool:
    """Every node lists every node as a broker; a node that exited fails the start at once, naming its log."""
    for (node_id, _, _), record in zip(cfg.kafka_nodes, records):
        if not _alive_twice(record):
            log_path = _log_path(cfg, kafka_node_name(cfg, node_id))
            raise StackError(f"kafka node {node_id} exited during start-up; last lines of "
                             f"{log_path}:\n{_tail(log_path)}")
    # A KRaft broker is unfenced (listed as live) before its listeners accept connections: a create-topics request
    # sent to it in that window was refused (ECONNREFUSED, CI of b692c01). Every listener open, then the metadata.
    if not all(_port_open(cfg.kafka_host, port) for _, port, _ in cfg.kafka_nodes):
        return False
    return kafka_healthy(cfg)


def _spawn_kafka_node(cfg: StackConfig, node_id: int, java: str, classpath: str) -> dict[str, Any]:
    """Write node node_id's config, format its storage on first start, and start its JVM (not waited on)."""
    props = _write_kafka_config(cfg, node_id)
    kdir, data = _kafka_dir(cfg), _node_dir(cfg, node_id) / "data"
    if not (data / "meta.properties").exists():
        _format_storage(cfg, java, classpath, props, node_id)
    elif cfg.kafka_sasl and _scram_user(kdir) != _kafka_client(cfg).sasl_username:
        # SCRAM users are bootstrapped only when storage is formatted: a broker on other storage would refuse them
        raise StackError(f"kafka: storage in {data} was formatted without a SCRAM user "
                         f"{_kafka_client(cfg).sasl_username!r}; remove {kdir} or choose another --var-dir")
    port = cfg.kafka_nodes[node_id - 1][1]
    marker = f"flywheel-kafka-{port}"
    cmd = [java, f"-Xmx{cfg.kafka_heap}", f"-Xms{cfg.kafka_heap}", f"-Dflywheel.marker={marker}",
           f"-Dlog4j2.configurationFile={kdir / 'log4j2.properties'}", "-cp", classpath, "kafka.Kafka", str(props)]
    return _spawn(cfg, kafka_node_name(cfg, node_id), cmd, dict(os.environ), marker, port=port)


def _scram_user(kdir: Path) -> str | None:
    path = kdir / "scram.user"
    return path.read_text().strip() if path.exists() else None


def _format_storage(cfg: StackConfig, java: str, classpath: str, props: Path, node_id: int = 1) -> None:
    """Format a node's storage with the cluster's one id (every node of a cluster shares it); with --kafka-sasl,
    bootstrap the SCRAM-SHA-256 user in the metadata log."""
    kdir, data = _kafka_dir(cfg), _node_dir(cfg, node_id) / "data"
    cluster_id = _kafka_cluster_id(kdir)
    cmd = [java, "-cp", classpath, "kafka.tools.StorageTool", "format",
           f"--cluster-id={cluster_id}",  # "=": an id may start with "-"
           "-c", str(props), "--ignore-formatted"]
    if cfg.kafka_sasl:
        client = _kafka_client(cfg)
        cmd += ["--add-scram", f"SCRAM-SHA-256=[name={client.sasl_username},password={client.sasl_password}]"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise StackError(f"kafka: formatting storage in {data} failed: {out.stderr.strip() or out.stdout.strip()}")
    if cfg.kafka_sasl:
        (kdir / "scram.user").write_text(str(_kafka_client(cfg).sasl_username))
    log.info("kafka: formatted storage %s (cluster %s%s)", data, cluster_id,
             ", SCRAM-SHA-256 user " + str(_kafka_client(cfg).sasl_username) if cfg.kafka_sasl else "")


def _kafka_cluster_id(kdir: Path) -> str:
    path = kdir / "cluster.id"
    if not path.exists():
        import base64

        path.write_text(base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("="))
    return path.read_text().strip()


def stop_kafka(cfg: StackConfig) -> None:
    stop_part(cfg, "kafka")


# ---------------------------------------------------------------------------------------------
# MLflow
# ---------------------------------------------------------------------------------------------
def init_mlflow_store(cfg: StackConfig) -> None:
    """Create the sqlite store and run its migrations once, before several processes open it."""
    uri = tracking.absolute_uri(cfg.mlflow_tracking_uri)
    if uri.startswith("sqlite:///"):
        Path(uri[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
    Path(cfg.mlflow_artifacts_dir).mkdir(parents=True, exist_ok=True)
    from mlflow.tracking import MlflowClient

    MlflowClient(tracking_uri=uri).search_experiments(max_results=1)


def mlflow_healthy(cfg: StackConfig) -> bool:
    status, _ = _http_get(f"{cfg.mlflow_ui_url}/health")
    return status == 200


def start_mlflow(cfg: StackConfig) -> dict[str, Any]:
    init_mlflow_store(cfg)
    marker = "mlflow"  # with the pid, enough to tell our server from a reused pid
    artifacts = Path(cfg.mlflow_artifacts_dir).resolve()
    cmd = [sys.executable, "-m", "mlflow", "server",
           "--backend-store-uri", tracking.absolute_uri(cfg.mlflow_tracking_uri),
           "--default-artifact-root", artifacts.as_uri(), "--host", cfg.mlflow_host, "--port", str(cfg.mlflow_port),
           "--workers", "1"]
    record = _spawn(cfg, "mlflow", cmd, dict(os.environ), marker)
    _wait("mlflow server", lambda: mlflow_healthy(cfg), cfg.mlflow_timeout_s, record, _log_path(cfg, "mlflow"))
    return record


# ---------------------------------------------------------------------------------------------
# S3 (S3Proxy on its filesystem backend: a real S3 server, so an s3:// lake runs here as at scale)
# ---------------------------------------------------------------------------------------------
def s3_env(cfg: StackConfig) -> dict[str, str]:
    """The environment an s3:// lake's processes need for this server (pyarrow and the lake's claims read it)."""
    return {"AWS_ENDPOINT_URL": cfg.s3_url, "AWS_ACCESS_KEY_ID": cfg.s3_access_key,
            "AWS_SECRET_ACCESS_KEY": cfg.s3_secret_key, "AWS_REGION": "us-east-1"}


def _s3_filesystem(cfg: StackConfig, create_buckets: bool = False) -> Any:
    import pyarrow.fs as pafs

    return pafs.S3FileSystem(access_key=cfg.s3_access_key, secret_key=cfg.s3_secret_key, region="us-east-1",
                             endpoint_override=cfg.s3_url, connect_timeout=2.0, request_timeout=5.0,
                             allow_bucket_creation=create_buckets,
                             retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=1))


def s3_healthy(cfg: StackConfig) -> bool:
    """The server accepts our credentials and has the bucket (an open port alone could be anything)."""
    if not _port_open(cfg.s3_host, cfg.s3_port):
        return False
    import pyarrow.fs as pafs

    try:
        return _s3_filesystem(cfg).get_file_info(cfg.s3_bucket).type == pafs.FileType.Directory
    except OSError:
        return False


def _write_s3_config(cfg: StackConfig) -> Path:
    sdir = Path(cfg.var_dir).resolve() / "s3"
    (sdir / "data").mkdir(parents=True, exist_ok=True)
    path = sdir / "s3proxy.conf"
    path.touch(mode=0o600)  # it holds the secret
    # filesystem-nio2 creates an If-None-Match object with a hard link, so the conditional create
    # the lake's claims rely on is atomic in the server too (tests/integration/test_lake_s3.py races it)
    path.write_text(f"""s3proxy.endpoint={cfg.s3_url}
s3proxy.authorization=aws-v2-or-v4
s3proxy.identity={cfg.s3_access_key}
s3proxy.credential={cfg.s3_secret_key}
jclouds.provider=filesystem-nio2
jclouds.filesystem.basedir={sdir / 'data'}
""")
    return path


def start_s3(cfg: StackConfig) -> dict[str, Any]:
    jar = Path(cfg.s3_jar)
    if not jar.is_file():
        raise StackError(f"s3: {jar} not found; run `make setup` (infra/setup.sh fetches S3Proxy from Maven Central)")
    props = _write_s3_config(cfg)
    cmd = [_java(), f"-Xmx{cfg.s3_heap}", "-jar", str(jar), "--properties", str(props)]
    record = _spawn(cfg, "s3", cmd, dict(os.environ), marker=str(props))
    _wait("s3proxy", lambda: _port_open(cfg.s3_host, cfg.s3_port), cfg.s3_timeout_s, record, _log_path(cfg, "s3"))
    _s3_filesystem(cfg, create_buckets=True).create_dir(cfg.s3_bucket)
    _wait("s3proxy bucket", lambda: s3_healthy(cfg), cfg.s3_timeout_s, record, _log_path(cfg, "s3"))
    return record


# ---------------------------------------------------------------------------------------------
# vLLM
# ---------------------------------------------------------------------------------------------
VLLM_MARKER = "vllm.entrypoints.openai.api_server"
LORA_FLAG = "--enable-lora"


def vllm_name(i: int) -> str:
    """Server i's name for its pid file and log; the first keeps the one-server names (vllm.pid.json, vllm.log)."""
    return "vllm" if i == 0 else f"vllm-{i}"


def vllm_models(cfg: StackConfig, url: str | None = None) -> list[dict[str, Any]] | None:
    """The models a server lists (default: the first server); None when it does not answer."""
    status, body = _http_get(f"{url or cfg.vllm_url}/v1/models")
    if status != 200:
        return None
    try:
        return list(json.loads(body).get("data", []))
    except json.JSONDecodeError:
        return None


def _serves_name(cfg: StackConfig, url: str) -> bool:
    models = vllm_models(cfg, url)
    return models is not None and any(m.get("id") == cfg.served_model_name for m in models)


def _serves_base_at(cfg: StackConfig, url: str) -> bool:
    models = vllm_models(cfg, url) or []
    want = str(Path(cfg.base_model).resolve())
    return any(m.get("id") == cfg.served_model_name and str(Path(m.get("root", "")).resolve()) == want for m in models)


def vllm_healthy(cfg: StackConfig) -> bool:
    """Every server answers and serves the configured name."""
    return all(_serves_name(cfg, url) for url in cfg.vllm_urls)


def vllm_serves_base(cfg: StackConfig) -> bool:
    """Every server serves cfg.base_model (its `root`) under the configured name."""
    return all(_serves_base_at(cfg, url) for url in cfg.vllm_urls)


def _vllm_base(cfg: StackConfig) -> Path:
    """The model directory the servers load. The stack builds no model (the tiny one is the demo's:
    `flywheel model init`, which `make up`, `make test`, the demo and the benchmarks run first)."""
    base = Path(cfg.base_model)
    if not (base / "config.json").exists():
        raise StackError(f"vllm: {base} is not a model directory (no config.json); pass --base-model or run "
                         "`flywheel model init`")
    return base.resolve()


def _lora_args(cfg: StackConfig) -> list[str]:
    """vLLM's LoRA flags, only for a tier that loads adapters (vllm_lora)."""
    if not cfg.vllm_lora:
        return []
    return [LORA_FLAG, "--max-loras", str(cfg.vllm_max_loras), "--max-lora-rank", str(cfg.vllm_max_lora_rank)]


def _vllm_command(cfg: StackConfig, base: Path, port: int) -> list[str]:
    # processed_logprobs: the logprob vLLM returns (and the proxy logs as the behaviour logprob) is
    # that of the distribution the token was drawn from, after temperature and top-k/top-p; the
    # default raw_logprobs is the model's log-softmax, wrong as pi_old for any other setting than
    # T=1 without truncation. The learner scores tokens under the same processing (docs/serving.md).
    return [sys.executable, "-m", VLLM_MARKER, "--model", str(base), "--served-model-name", cfg.served_model_name,
            "--host", cfg.vllm_host, "--port", str(port), "--dtype", cfg.vllm_dtype,
            "--max-model-len", str(cfg.vllm_max_model_len), *_lora_args(cfg),
            "--logprobs-mode", "processed_logprobs", "--disable-log-stats", *cfg.vllm_extra_args]


def _vllm_env(cfg: StackConfig, i: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "VLLM_CPU_KVCACHE_SPACE": str(cfg.vllm_kv_cache_gib),
        "VLLM_SERVER_DEV_MODE": "1",  # /collective_rpc reload_weights, /pause, /resume, /update_weight_version
        "VLLM_LOGGING_LEVEL": env.get("VLLM_LOGGING_LEVEL", "WARNING"),
        "TOKENIZERS_PARALLELISM": "false",
    })
    if cfg.vllm_lora:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # POST /v1/load_lora_adapter
    cores = os.cpu_count() or 1
    if cfg.vllm_servers > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        if cfg.vllm_servers <= cores:
            # Each server's OpenMP threads on a core of their own: with the default binding two servers on
            # this 2-core machine made 511 tokens/s in all (one alone: 1097-1181), bound to cores 0 and 1
            # 823 tokens/s.
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(i)
        else:
            # More servers than cores: one thread each, none bound, so the scheduler shares the cores evenly. Bound
            # round-robin, the third server shared the first's core, and the gate compares the latency of the
            # champion's and the challenger's servers: a challenger 35 points better was held back by the slow
            # guardrail (12% of its sessions beyond the champion's p95 against 5%) because its server shared a core
            # with the control's (demo run of 2026-12-05, c4b1f4a).
            env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
            env["OMP_NUM_THREADS"] = "1"
    return env


def start_vllm(cfg: StackConfig, servers: list[int] | None = None) -> list[dict[str, Any]]:
    """Start these servers (default: all) at once, then wait until each serves; a failure stops all it started."""
    indices = list(range(cfg.vllm_servers)) if servers is None else servers
    base = _vllm_base(cfg)
    records: list[dict[str, Any]] = []
    try:
        for i in indices:  # spawn all first: the servers load their model at the same time
            records.append(_spawn(cfg, vllm_name(i), _vllm_command(cfg, base, cfg.vllm_ports[i]), _vllm_env(cfg, i),
                                  VLLM_MARKER, port=cfg.vllm_ports[i]))
        for i, record in zip(indices, records):
            url = cfg.vllm_urls[i]
            _wait(f"vllm server {url}", functools.partial(_serves_name, cfg, url), cfg.vllm_timeout_s, record,
                  _log_path(cfg, vllm_name(i)))
        # once they serve, not before: starting at nice 10 beside the demo's warm-start build (two threads), no server
        # served within 300 s (run 19); the niceness reaches the threads and workers they made meanwhile
        nice_vllm(cfg)
    except BaseException:
        for i, record in zip(indices, records):
            _stop_record(record)
            _pid_path(cfg, vllm_name(i)).unlink(missing_ok=True)
        raise
    return records


def _vllm_ready(cfg: StackConfig, i: int) -> bool:
    """Server i already serves the base (left alone); else it is cleared for a fresh start: ours is stopped,
    a process that is not ours is refused with one line."""
    url, name, port = cfg.vllm_urls[i], vllm_name(i), cfg.vllm_ports[i]
    if _serves_name(cfg, url):
        record = _read_pid(cfg, name)
        # a server of ours started without LoRA cannot load the adapters a LoRA tier publishes; one with LoRA
        # serves full weights too (only slower), so it is kept for whoever shares it
        lacks_lora = cfg.vllm_lora and record is not None and LORA_FLAG not in record.get("cmd", [LORA_FLAG])
        if _serves_base_at(cfg, url) and not lacks_lora:
            log.info("%s: already healthy at %s", name, url)
            return True
        if record is None:
            raise StackError(f"vllm on port {port} serves another model than {cfg.base_model} "
                             "and was not started by this stack; stop it or pass --vllm-port")
        log.info("%s: %s; restarting it on %s", name, "started without LoRA" if lacks_lora else
                 "serves another base model", cfg.base_model)
    _stop_one(cfg, name)  # ours but unhealthy (still starting, or hung), or on another model
    if _port_busy(cfg.vllm_host, port):
        raise StackError(f"vllm: port {port} is already in use by another process; stop it or choose another port "
                         f"(--vllm-port / FLYWHEEL_INFRA_VLLM_PORT; the servers use {cfg.vllm_ports})")
    return False


def nice_vllm(cfg: StackConfig) -> list[int]:
    """Raise every running server of ours to cfg.vllm_nice; returns the process groups it changed."""
    records = [_read_pid(cfg, vllm_name(i)) for i in range(cfg.vllm_servers)]
    changed = [int(r["pid"]) for r in records if r is not None and _nice_group(int(r["pid"]), cfg.vllm_nice)]
    if changed:
        log.info("vllm: niceness %d on process groups %s", cfg.vllm_nice, changed)
    return changed


def _nice_group(pgid: int, nice: int) -> bool:
    """Raise the process group and session pgid to `nice`; True when it changed.

    A server is a process group and a session of its own (start_new_session). Two settings, both needed:
    - setpriority on the group reaches every thread of every process in it (vLLM's engine core and its OpenMP
      threads included); threads and processes made later inherit it from their makers;
    - with the kernel's autogroup scheduling (sched_autogroup_enabled, on by default) each session is a group that
      competes with the others as one process of its own weight, whatever its threads' niceness: thread nice 10
      alone left the demo's learner at 14% of a core beside three servers at 20-50% (run 18); the session's
      autogroup niceness (/proc/<pid>/autogroup) is what weighs it against the learner's session."""
    changed = False
    try:
        # PRIO_PGRP reads the group's highest priority: the least nice of its threads
        if os.getpriority(os.PRIO_PGRP, pgid) < nice:
            os.setpriority(os.PRIO_PGRP, pgid, nice)
            changed = True
        autogroup = Path(f"/proc/{pgid}/autogroup")
        if autogroup.exists() and autogroup_nice(pgid) < nice:  # "/autogroup-11 nice 0"
            autogroup.write_text(str(nice))
            changed = True
    except OSError as e:  # gone meanwhile
        log.warning("process group %d: niceness %d not set: %s", pgid, nice, e)
    return changed


def autogroup_nice(pid: int) -> int:
    """The niceness of pid's scheduler autogroup (its session's weight), from /proc/<pid>/autogroup."""
    return int(Path(f"/proc/{pid}/autogroup").read_text().split()[-1])


def ensure_vllm(cfg: StackConfig) -> list[str]:
    """Start the servers that do not serve the base yet; ["vllm"] when it started any, else []."""
    todo = [i for i in range(cfg.vllm_servers) if not _vllm_ready(cfg, i)]
    if not todo:
        nice_vllm(cfg)  # servers kept from an `up` with another niceness
        return []
    log.info("vllm: starting %d server(s) on ports %s (logs under %s)", len(todo), [cfg.vllm_ports[i] for i in todo],
             _log_path(cfg, "vllm").parent)
    t0 = time.time()
    start_vllm(cfg, todo)
    log.info("vllm: healthy at %s after %.1fs", cfg.address_of("vllm"), time.time() - t0)
    return ["vllm"]


def frozen_vllm_name(served_name: str) -> str:
    """The pid and log name of a frozen model's server: vllm-<name>, so `down` of vllm stops it with the tier's."""
    return f"vllm-{served_name}"


def ensure_frozen_vllm(cfg: StackConfig, served_name: str, model_dir: Path, port: int) -> tuple[str, bool]:
    """A server beside the tier's for a frozen model outside the router (the swarm's sub-agents, which the proxy's
    frozen_models sends to it): model_dir served as served_name on port, started unless it already serves it.
    Returns (its URL, whether this call started it)."""
    own = [*cfg.vllm_ports, cfg.mlflow_port, *(p for _, client, ctrl in cfg.kafka_nodes for p in (client, ctrl))]
    if port in own:
        raise StackError(f"{frozen_vllm_name(served_name)}: port {port} is one of the stack's own")
    fcfg = replace_config(cfg, base_model=model_dir, served_model_name=served_name, vllm_port=port, vllm_servers=1,
                          vllm_lora=False)
    with _stack_lock(cfg):  # beside another process's `up` or `down`
        return _ensure_frozen_vllm(cfg, fcfg, served_name, model_dir, port)


def _ensure_frozen_vllm(cfg: StackConfig, fcfg: StackConfig, served_name: str, model_dir: Path,
                        port: int) -> tuple[str, bool]:
    url, name = fcfg.vllm_url, frozen_vllm_name(served_name)
    if _serves_base_at(fcfg, url):
        log.info("%s: already serves %s at %s", name, model_dir, url)
        return url, False
    _stop_one(cfg, name)  # ours on another model, or hung
    if _port_busy(cfg.vllm_host, port):
        raise StackError(f"{name}: port {port} is already in use by another process")
    env = _vllm_env(fcfg, 0)
    # beside the tier's servers (unbound, one thread each on this 2-core machine): the same, not a core of its own
    env.update({"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"})
    record = _spawn(fcfg, name, _vllm_command(fcfg, _vllm_base(fcfg), port), env, VLLM_MARKER, port=port)
    try:
        _wait(f"vllm server {url}", functools.partial(_serves_name, fcfg, url), cfg.vllm_timeout_s, record,
              _log_path(cfg, name))
    except BaseException:
        _stop_record(record)
        _pid_path(cfg, name).unlink(missing_ok=True)
        raise
    _nice_group(int(record["pid"]), cfg.vllm_nice)  # serves beside the tier: its priority, once it serves
    log.info("%s: serves %s as %s at %s", name, model_dir, served_name, url)
    return url, True


def stop_frozen_vllm(cfg: StackConfig, served_name: str) -> bool:
    """Stop the frozen model's server this stack started (False: none was running)."""
    with _stack_lock(cfg):
        return _stop_one(cfg, frozen_vllm_name(served_name))


# ---------------------------------------------------------------------------------------------
# the stack as a whole
# ---------------------------------------------------------------------------------------------
_HEALTH: dict[str, Callable[[StackConfig], bool]] = {"kafka": kafka_healthy, "mlflow": mlflow_healthy,
                                                     "vllm": vllm_healthy, "s3": s3_healthy}
_START: dict[str, Callable[[StackConfig], dict[str, Any]]] = {"kafka": start_kafka, "mlflow": start_mlflow,
                                                              "s3": start_s3}


def _processes(cfg: StackConfig, part: str) -> list[str]:
    """The process names of a part: the part itself, or each vLLM server (with any server beyond
    vllm_servers that an earlier `up --vllm-servers N` left, so `down` stops it too), or each Kafka node
    (with the broker or the cluster nodes an `up` with another --kafka-brokers left)."""
    if part == "kafka":
        names = [kafka_node_name(cfg, node_id) for node_id, _, _ in cfg.kafka_nodes]
        left = sorted(p.name[: -len(".pid.json")] for p in _run_dir(cfg).glob("kafka*.pid.json"))
        return names + [n for n in left if n not in names]
    if part != "vllm":
        return [part]
    names = [vllm_name(i) for i in range(cfg.vllm_servers)]
    left = sorted(p.name[: -len(".pid.json")] for p in _run_dir(cfg).glob("vllm-*.pid.json"))
    return names + [n for n in left if n not in names]


def _stop_one(cfg: StackConfig, name: str) -> bool:
    record = _read_pid(cfg, name)
    if record is None:
        _pid_path(cfg, name).unlink(missing_ok=True)
        return False
    log.info("%s: stopping pid %s", name, record["pid"])
    _stop_record(record)
    _pid_path(cfg, name).unlink(missing_ok=True)
    return True


def stop_part(cfg: StackConfig, part: str) -> bool:
    """Stop a part this stack started (by its pid files; every server of vllm); anything else is left alone."""
    if part == "kafka":
        return _stop_together(cfg, _processes(cfg, part))
    return any([_stop_one(cfg, name) for name in _processes(cfg, part)])  # a list: stop them all


def _stop_together(cfg: StackConfig, names: list[str]) -> bool:
    """Stop these processes at the same time: one after the other, the last nodes of a cluster would each wait
    out their controlled shutdown (20 s, then SIGKILL) for a controller quorum the nodes stopped before took away."""
    stopped: dict[str, bool] = {}
    stoppers = [threading.Thread(target=lambda name=name: stopped.update({name: _stop_one(cfg, name)}),
                                 name=f"stop-{name}") for name in names]
    for thread in stoppers:
        thread.start()
    for thread in stoppers:
        thread.join()
    return any(stopped.values())


@contextlib.contextmanager
def _stack_lock(cfg: StackConfig):
    """Serialise `up`/`down` across processes: two test runs starting the stack at once must not race."""
    _run_dir(cfg).mkdir(parents=True, exist_ok=True)
    with open(_run_dir(cfg) / "stack.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def ensure_up(cfg: StackConfig, parts: Iterable[str] | None = None) -> list[str]:
    """Start every requested part that is not healthy; return the parts this call started ("vllm" when
    it started any of the servers: `down` of that part then stops them all).

    A failure stops what this call started and raises StackError with one clear line.
    """
    with _stack_lock(cfg):
        return _ensure_up_locked(cfg, parts)


def _ensure_up_locked(cfg: StackConfig, parts: Iterable[str] | None) -> list[str]:
    wanted = [p for p in PARTS if p in set(parts if parts is not None else cfg.parts)]
    started: list[str] = []
    try:
        for part in wanted:
            if part == "vllm":
                started += ensure_vllm(cfg)  # it stops the servers it spawned when one fails
                continue
            if _ready(cfg, part):
                continue
            log.info("%s: starting (log %s)", part, _log_path(cfg, part))
            t0 = time.time()
            started.append(part)
            _START[part](cfg)
            log.info("%s: healthy at %s after %.1fs", part, cfg.address_of(part), time.time() - t0)
    except BaseException:
        for part in reversed(started):
            stop_part(cfg, part)
        raise
    return started


def _ready(cfg: StackConfig, part: str) -> bool:
    """Kafka or MLflow is healthy already (left alone); else it is cleared for a fresh start: ours is
    stopped, a busy port is refused with one line."""
    if _HEALTH[part](cfg):
        if part == "kafka":
            ensure_topics(cfg)
        log.info("%s: already healthy at %s", part, cfg.address_of(part))
        return True
    stop_part(cfg, part)  # ours but unhealthy (still starting, or hung): give it a fresh start
    host = {"kafka": cfg.kafka_host, "mlflow": cfg.mlflow_host, "s3": cfg.s3_host}[part]
    if _port_busy(host, cfg.port_of(part)):
        raise StackError(f"{part}: port {cfg.port_of(part)} is already in use by another process; "
                         f"stop it or choose another port (--{part}-port / FLYWHEEL_INFRA_{part.upper()}_PORT)")
    if part == "kafka" and _port_busy(cfg.kafka_host, cfg.kafka_controller_port):
        raise StackError(f"kafka: controller port {cfg.kafka_controller_port} is already in use; "
                         "choose another with --kafka-controller-port")
    if part == "kafka" and cfg.kafka_brokers > 1:
        busy = [port for _, client, controller in cfg.kafka_nodes[1:] for port in (client, controller)
                if _port_busy(cfg.kafka_host, port)]
        if busy:
            raise StackError(f"kafka: ports {busy} of the cluster's other nodes are already in use (node i listens on "
                             "kafka_port + 2i and kafka_controller_port + 2i); choose another --kafka-port or "
                             "--kafka-controller-port")
    return False


def down(cfg: StackConfig, parts: Iterable[str] | None = None) -> list[str]:
    wanted = [p for p in reversed(PARTS) if p in set(parts if parts is not None else cfg.parts)]
    with _stack_lock(cfg):
        return [p for p in wanted if stop_part(cfg, p)]


def health(cfg: StackConfig) -> dict[str, tuple[bool, str]]:
    out: dict[str, tuple[bool, str]] = {}
    for part in PARTS:
        ok = _HEALTH[part](cfg)
        pids = [str(r["pid"]) for name in _processes(cfg, part) if (r := _read_pid(cfg, name))]
        owner = f"pid {', '.join(pids)}" if pids else ("not started by this stack" if ok else "-")
        out[part] = (ok, owner)
    return out


def status_table(cfg: StackConfig) -> Any:
    from rich.table import Table

    table = Table(title="flywheel stack")
    table.add_column("part")
    table.add_column("address")
    table.add_column("health")
    table.add_column("process")
    for part, (ok, owner) in health(cfg).items():
        detail = ""
        if part == "vllm" and ok:
            names = sorted({str(m.get("id")) for url in cfg.vllm_urls for m in vllm_models(cfg, url) or []})
            detail = (f" serving {', '.join(names)}"
                      + (f" on {cfg.vllm_servers} servers" if cfg.vllm_servers > 1 else ""))
        if part == "kafka" and cfg.kafka_brokers > 1:  # a cluster that lost a node still serves: say how many are left
            detail = f" ({kafka_live_brokers(cfg)} of {cfg.kafka_brokers} brokers live)"
        table.add_row(part, cfg.address_of(part), ("[green]healthy[/green]" if ok else "[red]down[/red]") + detail,
                      owner)
    return table


def run(cfg: StackConfig) -> int:
    from rich.console import Console

    console = Console()
    if cfg.action in ("down", "restart"):
        stopped = down(cfg)
        console.print(f"stopped: {', '.join(stopped) or 'nothing (no part of ours was running)'}")
    if cfg.action in ("up", "restart"):
        try:
            started = ensure_up(cfg)
        except StackError as exc:
            console.print(f"[red]infra up failed:[/red] {exc}")
            return 1
        console.print(f"started: {', '.join(started) or 'nothing (all healthy already)'}")
    if cfg.action in ("up", "status", "restart"):
        console.print(status_table(cfg))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and not args[0].startswith("-"):
        args = ["--action", args[0]] + args[1:]
    cfg = load_stack_config(args)
    setup_logging()
    return run(cfg)


def replace_config(cfg: StackConfig, **changes: Any) -> StackConfig:
    """A copy of cfg with some fields changed (private stacks in tests, the demo's servers), checked."""
    changed = replace(cfg, **changes)
    changed.check()
    return changed
