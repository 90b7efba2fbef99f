"""`flywheel infra up|down|status`: the local stack on loopback — Apache Kafka, MLflow, vLLM on CPU.

    flywheel infra up      # start what is not running; idempotent
    flywheel infra status  # each part with its address and health
    flywheel infra down    # stop what `up` started (by pid file), nothing else

Each part runs as its own process session with a pid file under var/run/ and a log under
var/log/. `up` checks health before starting anything (a healthy part is left alone), refuses
a busy port with one line naming it, and stops what it started if a later part fails.

- Kafka: a single-node KRaft broker from the jars infra/setup.sh fetched from Maven Central,
  storage formatted on first start, topics created with the configured partitions.
- MLflow: the embedded default store is a sqlite file and a local artifact folder under var/,
  usable with no server at all; `up` also starts `mlflow server` on the same store for its UI.
- vLLM: the OpenAI-compatible server on CPU serving the base model as `policy-v0`, with
  runtime LoRA loading and the dev-mode endpoints (reload_weights, pause/resume, weight version).
  `--vllm-servers N` runs N of them on consecutive ports (a full-weight tier needs a server per
  live version: control, champion, challenger), each its own process, pid file and log.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable

from flywheel.base import defaults, tracking
from flywheel.base.config import ConfigError, load_config, setting, setup_logging
from flywheel.base.kafka import KafkaClientConfig, client_kwargs, load_kafka_config
from flywheel.base.versions import version_name

log = logging.getLogger(__name__)

PARTS = ("kafka", "mlflow", "vllm")
REPO_ROOT = Path(__file__).resolve().parent.parent


class StackError(RuntimeError):
    """One part of the stack could not be brought up; the message says what and what to do."""


@dataclass
class StackConfig:
    """The local stack: ports, paths and limits of Kafka, MLflow and vLLM."""

    action: str = setting("status", "up, down or status")
    parts: list[str] = setting(list(PARTS), "which parts to act on (comma-separated): kafka, mlflow, vllm")
    var_dir: Path = setting(Path(defaults.VAR_DIR), "state directory (data, logs, pid files)")
    kafka_host: str = setting("127.0.0.1", "address the broker listens on")
    kafka_port: int = setting(9092, "broker port")
    kafka_controller_port: int = setting(9093, "KRaft controller port")
    kafka_partitions: int = setting(4, "partitions of the topics flywheel.events, flywheel.outcomes, flywheel.dlq")
    kafka_topics: list[str] = setting(["flywheel.events", "flywheel.outcomes", "flywheel.dlq"], "topics created by up")
    kafka_heap: str = setting("512m", "broker JVM heap (-Xmx)")
    kafka_libs: Path = setting(REPO_ROOT / "var" / "kafka" / "libs", "Kafka broker jars (fetched by make setup)")
    kafka_timeout_s: float = setting(90.0, "how long to wait for the broker to answer")
    kafka_sasl: bool = setting(False, "listen with SASL_PLAINTEXT SCRAM-SHA-256 instead of PLAINTEXT; the user and password "
                                      "are FLYWHEEL_KAFKA_SASL_USERNAME/PASSWORD, the same settings every client reads")
    mlflow_tracking_uri: str = setting(defaults.MLFLOW_TRACKING_URI, "tracking store every process uses (sqlite file by default)")
    mlflow_artifacts_dir: Path = setting(Path(defaults.MLFLOW_ARTIFACTS_DIR), "local artifact folder of the embedded store")
    mlflow_host: str = setting("127.0.0.1", "address of the MLflow UI server")
    mlflow_port: int = setting(defaults.MLFLOW_PORT, "port of the MLflow UI server")
    mlflow_timeout_s: float = setting(120.0, "how long to wait for the MLflow server")
    vllm_host: str = setting("127.0.0.1", "address vLLM listens on")
    vllm_port: int = setting(8000, "vLLM port (of the first server; server i listens on vllm_port + i)")
    vllm_servers: int = setting(1, "how many vLLM servers to run, each its own process on the base model "
                                   "(a full-weight tier serves each live version on a server of its own)")
    base_model: Path = setting(Path(defaults.BASE_MODEL_DIR), "model directory vLLM serves (built by `flywheel model init` when it is the default)")
    served_model_name: str = setting(version_name(0), "name vLLM serves the base model under")
    vllm_max_model_len: int = setting(2048, "context length vLLM allocates for")
    vllm_max_loras: int = setting(4, "LoRA adapters resident at once (--max-loras)")
    vllm_max_lora_rank: int = setting(32, "largest LoRA rank vLLM accepts (--max-lora-rank)")
    vllm_kv_cache_gib: int = setting(1, "VLLM_CPU_KVCACHE_SPACE, GiB of KV cache on CPU")
    vllm_dtype: str = setting("float32", "weights dtype; float32 keeps learner and server logprobs within 1e-4")
    vllm_extra_args: list[str] = setting([], "extra vLLM server flags, comma-separated")
    vllm_timeout_s: float = setting(300.0, "how long to wait for vLLM to serve")

    def check(self) -> None:
        unknown = sorted(set(self.parts) - set(PARTS))
        if unknown:
            raise ConfigError(f"parts: unknown {unknown}; choose from {list(PARTS)}")
        if self.action not in ("up", "down", "status", "restart"):
            raise ConfigError(f"action: {self.action!r} is not up, down, restart or status")
        if self.vllm_servers < 1:
            raise ConfigError(f"vllm_servers: must be >= 1, got {self.vllm_servers}")
        ports = {"kafka_port": self.kafka_port, "kafka_controller_port": self.kafka_controller_port,
                 "mlflow_port": self.mlflow_port}
        if len(set(ports.values())) != len(ports):
            raise ConfigError(f"kafka_port, kafka_controller_port and mlflow_port must differ: {ports}")
        clash = {name: port for name, port in ports.items() if port in self.vllm_ports}
        if clash:
            raise ConfigError(f"vllm_port and vllm_servers: the vLLM servers' ports {self.vllm_ports} collide with {clash}")

    @property
    def kafka_bootstrap(self) -> str:
        return f"{self.kafka_host}:{self.kafka_port}"

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
        return {"kafka": self.kafka_port, "mlflow": self.mlflow_port, "vllm": self.vllm_port}[part]

    def address_of(self, part: str) -> str:
        return {"kafka": self.kafka_bootstrap, "mlflow": f"{self.mlflow_tracking_uri} (UI {self.mlflow_ui_url})",
                "vllm": ", ".join(self.vllm_urls)}[part]


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


def _wait(what: str, check: Callable[[], bool], timeout_s: float, record: dict[str, Any], log_path: Path) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if check():
            return
        # /proc/PID/cmdline reads empty for a few ms while the child is still in exec(): look twice.
        if not _alive_and_ours(record) and (time.sleep(0.2) or not _alive_and_ours(record)):
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
    return (Path(cfg.var_dir) / "kafka").resolve()


def _kafka_client(cfg: StackConfig) -> KafkaClientConfig:
    """The client settings (FLYWHEEL_KAFKA_*) the stack's own admin calls use, checked against --kafka-sasl."""
    try:
        client = load_kafka_config()
    except ConfigError as exc:
        raise StackError(f"kafka: {exc}") from None
    wanted = ("SASL_PLAINTEXT", "SCRAM-SHA-256") if cfg.kafka_sasl else ("PLAINTEXT", None)
    if (client.security_protocol, client.sasl_mechanism) != wanted:
        raise StackError(f"kafka: the local broker {'with' if cfg.kafka_sasl else 'without'} --kafka-sasl takes "
                         f"FLYWHEEL_KAFKA_SECURITY_PROTOCOL={wanted[0]}" + (f" and FLYWHEEL_KAFKA_SASL_MECHANISM={wanted[1]}"
                                                                             " (and a user name and password)" if wanted[1] else "")
                         + f", not {client.describe()}")
    return client


def _listener_props(cfg: StackConfig) -> str:
    """The client listener: PLAINTEXT, or SASL_PLAINTEXT with SCRAM-SHA-256 for the user of FLYWHEEL_KAFKA_SASL_*."""
    controller = f"CONTROLLER://{cfg.kafka_host}:{cfg.kafka_controller_port}"
    if not cfg.kafka_sasl:
        return (f"listeners=PLAINTEXT://{cfg.kafka_host}:{cfg.kafka_port},{controller}\n"
                f"advertised.listeners=PLAINTEXT://{cfg.kafka_host}:{cfg.kafka_port}\n"
                "listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT\n"
                "inter.broker.listener.name=PLAINTEXT\n")
    client = _kafka_client(cfg)
    def quote(text: str | None) -> str:  # a JAAS string literal
        return str(text).replace("\\", "\\\\").replace('"', '\\"')

    return (f"listeners=SASL_PLAINTEXT://{cfg.kafka_host}:{cfg.kafka_port},{controller}\n"
            f"advertised.listeners=SASL_PLAINTEXT://{cfg.kafka_host}:{cfg.kafka_port}\n"
            "listener.security.protocol.map=CONTROLLER:PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT\n"
            "inter.broker.listener.name=SASL_PLAINTEXT\n"
            "sasl.enabled.mechanisms=SCRAM-SHA-256\n"
            "sasl.mechanism.inter.broker.protocol=SCRAM-SHA-256\n"
            # the broker's own client on the inter-broker listener logs in as the same SCRAM user
            "listener.name.sasl_plaintext.scram-sha-256.sasl.jaas.config=org.apache.kafka.common.security.scram."
            f'ScramLoginModule required username="{quote(client.sasl_username)}" password="{quote(client.sasl_password)}";\n')


def _write_kafka_config(cfg: StackConfig) -> Path:
    kdir = _kafka_dir(cfg)
    kdir.mkdir(parents=True, exist_ok=True)
    props = f"""# written by infra/stack.py; regenerated on every start
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@{cfg.kafka_host}:{cfg.kafka_controller_port}
{_listener_props(cfg)}controller.listener.names=CONTROLLER
log.dirs={kdir / 'data'}
num.partitions={cfg.kafka_partitions}
# A single node: without these three the group coordinator never becomes available
# (reported against Kafka 4.0 in kafkajs issue 1752).
offsets.topic.replication.factor=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
offsets.topic.num.partitions=4
group.initial.rebalance.delay.ms=0
message.max.bytes=8388608
auto.create.topics.enable=false
log.retention.hours=168
"""
    path = kdir / "server.properties"
    path.touch(mode=0o600)  # with --kafka-sasl it holds the SCRAM password
    path.write_text(props)
    (kdir / "log4j2.properties").write_text(
        "status = error\nappender.console.type = Console\nappender.console.name = STDOUT\n"
        "appender.console.layout.type = PatternLayout\nappender.console.layout.pattern = [%d] %p %m (%c)%n\n"
        "rootLogger.level = WARN\nrootLogger.appenderRef.stdout.ref = STDOUT\n"
        "logger.kafka.name = kafka\nlogger.kafka.level = WARN\n"
        "logger.server.name = kafka.server.KafkaRaftServer\nlogger.server.level = INFO\n"
    )
    return path


def _kafka_classpath(cfg: StackConfig) -> str:
    libs = Path(cfg.kafka_libs)
    if not (libs / ".complete").exists() and not any(libs.glob("kafka_2.13-*.jar")):
        raise StackError(f"Kafka jars missing in {libs}; run `make setup` (it fetches them from Maven Central with Maven)")
    return f"{libs}/*"


def _java() -> str:
    java = shutil.which("java")
    if java is None:
        raise StackError("java not found; install a JDK 17+ (apt-get install openjdk-17-jre-headless): the Kafka broker needs it")
    return java


def kafka_healthy(cfg: StackConfig, timeout_s: float = 5.0) -> bool:
    """The broker answers a metadata request (not only an open port)."""
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


def ensure_topics(cfg: StackConfig) -> None:
    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic
    from kafka.errors import TopicAlreadyExistsError

    admin = KafkaAdminClient(bootstrap_servers=cfg.kafka_bootstrap, **client_kwargs(_kafka_client(cfg), "flywheel-infra"))
    try:
        existing = set(admin.list_topics())
        missing = [t for t in cfg.kafka_topics if t not in existing]
        if missing:
            try:
                admin.create_topics([NewTopic(t, num_partitions=cfg.kafka_partitions, replication_factor=1) for t in missing])
            except TopicAlreadyExistsError:
                pass
            log.info("kafka: created topics %s with %d partitions", missing, cfg.kafka_partitions)
    finally:
        admin.close()


def start_kafka(cfg: StackConfig) -> dict[str, Any]:
    """Start the broker (formatting its storage on first start) and wait until it answers."""
    _kafka_client(cfg)  # fail fast on client settings that this broker would refuse
    java = _java()
    classpath = _kafka_classpath(cfg)
    props = _write_kafka_config(cfg)
    kdir = _kafka_dir(cfg)
    if not (kdir / "data" / "meta.properties").exists():
        _format_storage(cfg, java, classpath, props)
    elif cfg.kafka_sasl and _scram_user(kdir) != _kafka_client(cfg).sasl_username:
        # SCRAM users are bootstrapped only when storage is formatted: a broker on other storage would refuse them
        raise StackError(f"kafka: storage in {kdir / 'data'} was formatted without a SCRAM user "
                         f"{_kafka_client(cfg).sasl_username!r}; remove {kdir} or choose another --var-dir")
    marker = f"flywheel-kafka-{cfg.kafka_port}"
    cmd = [java, f"-Xmx{cfg.kafka_heap}", f"-Xms{cfg.kafka_heap}", f"-Dflywheel.marker={marker}",
           f"-Dlog4j2.configurationFile={kdir / 'log4j2.properties'}", "-cp", classpath, "kafka.Kafka", str(props)]
    record = _spawn(cfg, "kafka", cmd, dict(os.environ), marker)
    _wait("kafka broker", lambda: kafka_healthy(cfg), cfg.kafka_timeout_s, record, _log_path(cfg, "kafka"))
    ensure_topics(cfg)
    return record


def _scram_user(kdir: Path) -> str | None:
    path = kdir / "scram.user"
    return path.read_text().strip() if path.exists() else None


def _format_storage(cfg: StackConfig, java: str, classpath: str, props: Path) -> None:
    """Format the broker's storage; with --kafka-sasl, bootstrap the SCRAM-SHA-256 user in the metadata log."""
    kdir = _kafka_dir(cfg)
    cluster_id = _kafka_cluster_id(kdir)
    cmd = [java, "-cp", classpath, "kafka.tools.StorageTool", "format", f"--cluster-id={cluster_id}",  # "=": an id may start with "-"
           "-c", str(props), "--ignore-formatted"]
    if cfg.kafka_sasl:
        client = _kafka_client(cfg)
        cmd += ["--add-scram", f"SCRAM-SHA-256=[name={client.sasl_username},password={client.sasl_password}]"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise StackError(f"kafka: formatting storage in {kdir / 'data'} failed: {out.stderr.strip() or out.stdout.strip()}")
    if cfg.kafka_sasl:
        (kdir / "scram.user").write_text(str(_kafka_client(cfg).sasl_username))
    log.info("kafka: formatted storage %s (cluster %s%s)", kdir / "data", cluster_id,
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
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", tracking.absolute_uri(cfg.mlflow_tracking_uri),
           "--default-artifact-root", artifacts.as_uri(), "--host", cfg.mlflow_host, "--port", str(cfg.mlflow_port),
           "--workers", "1"]
    record = _spawn(cfg, "mlflow", cmd, dict(os.environ), marker)
    _wait("mlflow server", lambda: mlflow_healthy(cfg), cfg.mlflow_timeout_s, record, _log_path(cfg, "mlflow"))
    return record


# ---------------------------------------------------------------------------------------------
# vLLM
# ---------------------------------------------------------------------------------------------
VLLM_MARKER = "vllm.entrypoints.openai.api_server"


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
    """The model directory the servers load (the default tiny base is built when missing)."""
    base = Path(cfg.base_model)
    if base.resolve() == (REPO_ROOT / defaults.BASE_MODEL_DIR).resolve() or base == Path(defaults.BASE_MODEL_DIR):
        from flywheel.demo.model_init import ensure_base_model

        ensure_base_model(base)
    if not (base / "config.json").exists():
        raise StackError(f"vllm: {base} is not a model directory (no config.json); pass --base-model or run `flywheel model init`")
    return base.resolve()


def _vllm_command(cfg: StackConfig, base: Path, port: int) -> list[str]:
    # processed_logprobs: the logprob vLLM returns (and the proxy logs as the behaviour logprob) is
    # that of the distribution the token was drawn from, after temperature and top-k/top-p; the
    # default raw_logprobs is the model's log-softmax, wrong as pi_old for any other setting than
    # T=1 without truncation. The learner scores tokens under the same processing (docs/serving.md).
    return [sys.executable, "-m", VLLM_MARKER, "--model", str(base), "--served-model-name", cfg.served_model_name,
            "--host", cfg.vllm_host, "--port", str(port), "--dtype", cfg.vllm_dtype,
            "--max-model-len", str(cfg.vllm_max_model_len), "--enable-lora",
            "--max-loras", str(cfg.vllm_max_loras), "--max-lora-rank", str(cfg.vllm_max_lora_rank),
            "--logprobs-mode", "processed_logprobs", "--disable-log-stats", *cfg.vllm_extra_args]


def _vllm_env(cfg: StackConfig, i: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "VLLM_CPU_KVCACHE_SPACE": str(cfg.vllm_kv_cache_gib),
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",  # POST /v1/load_lora_adapter
        "VLLM_SERVER_DEV_MODE": "1",  # /collective_rpc reload_weights, /pause, /resume, /update_weight_version
        "VLLM_LOGGING_LEVEL": env.get("VLLM_LOGGING_LEVEL", "WARNING"),
        "TOKENIZERS_PARALLELISM": "false",
    })
    if cfg.vllm_servers > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        # Each server's OpenMP threads on a core of their own: with the default binding two servers on
        # this 2-core machine made 511 tokens/s in all (one alone: 1097-1181), bound to cores 0 and 1
        # 823 tokens/s. An idle server takes no CPU, so a third may share a core with the first.
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(i % (os.cpu_count() or 1))
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
            _wait(f"vllm server {url}", lambda url=url: _serves_name(cfg, url), cfg.vllm_timeout_s, record,
                  _log_path(cfg, vllm_name(i)))
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
        if _serves_base_at(cfg, url):
            log.info("%s: already healthy at %s", name, url)
            return True
        if _read_pid(cfg, name) is None:
            raise StackError(f"vllm on port {port} serves another model than {cfg.base_model} "
                             "and was not started by this stack; stop it or pass --vllm-port")
        log.info("%s: serves another base model; restarting it on %s", name, cfg.base_model)
    _stop_one(cfg, name)  # ours but unhealthy (still starting, or hung), or on another model
    if _port_busy(cfg.vllm_host, port):
        raise StackError(f"vllm: port {port} is already in use by another process; stop it or choose another port "
                         f"(--vllm-port / FLYWHEEL_INFRA_VLLM_PORT; the servers use {cfg.vllm_ports})")
    return False


def ensure_vllm(cfg: StackConfig) -> list[str]:
    """Start the servers that do not serve the base yet; ["vllm"] when it started any, else []."""
    todo = [i for i in range(cfg.vllm_servers) if not _vllm_ready(cfg, i)]
    if not todo:
        return []
    log.info("vllm: starting %d server(s) on ports %s (logs under %s)", len(todo), [cfg.vllm_ports[i] for i in todo],
             _log_path(cfg, "vllm").parent)
    t0 = time.time()
    start_vllm(cfg, todo)
    log.info("vllm: healthy at %s after %.1fs", cfg.address_of("vllm"), time.time() - t0)
    return ["vllm"]


# ---------------------------------------------------------------------------------------------
# the stack as a whole
# ---------------------------------------------------------------------------------------------
_HEALTH: dict[str, Callable[[StackConfig], bool]] = {"kafka": kafka_healthy, "mlflow": mlflow_healthy, "vllm": vllm_healthy}
_START: dict[str, Callable[[StackConfig], dict[str, Any]]] = {"kafka": start_kafka, "mlflow": start_mlflow}


def _processes(cfg: StackConfig, part: str) -> list[str]:
    """The process names of a part: the part itself, or each vLLM server (with any server beyond
    vllm_servers that an earlier `up --vllm-servers N` left, so `down` stops it too)."""
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
    return any([_stop_one(cfg, name) for name in _processes(cfg, part)])  # a list: stop them all


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
    host = {"kafka": cfg.kafka_host, "mlflow": cfg.mlflow_host}[part]
    if _port_busy(host, cfg.port_of(part)):
        raise StackError(f"{part}: port {cfg.port_of(part)} is already in use by another process; "
                         f"stop it or choose another port (--{part}-port / FLYWHEEL_INFRA_{part.upper()}_PORT)")
    if part == "kafka" and _port_busy(cfg.kafka_host, cfg.kafka_controller_port):
        raise StackError(f"kafka: controller port {cfg.kafka_controller_port} is already in use; "
                         "choose another with --kafka-controller-port")
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
            detail = f" serving {', '.join(names)}" + (f" on {cfg.vllm_servers} servers" if cfg.vllm_servers > 1 else "")
        table.add_row(part, cfg.address_of(part), ("[green]healthy[/green]" if ok else "[red]down[/red]") + detail, owner)
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
