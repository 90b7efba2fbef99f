"""The lake on a real S3-compatible server (S3Proxy, `flywheel infra up --parts s3`): the conditional create the
range claims rely on, and two lake writers racing on one topic into one s3:// lake, exactly once.

The server runs on a free port with its own state folder; the writers are real subprocesses against the real
broker, configured for the lake only through the AWS_* variables (as pyarrow and the lake's claims read them).
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Callable, Iterator

import pytest

from flywheel import stack as stack_mod
from flywheel.ingest import lake
from tests.integration.test_lake_writer_kill import produce, wait_for

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[stack_mod.StackConfig]:
    """A private S3Proxy through the stack's own `s3` part, with AWS_* set in this process for it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cfg = stack_mod.replace_config(stack_mod.load_stack_config([]), var_dir=tmp_path_factory.mktemp("s3-var"),
                                   s3_port=port)
    started = stack_mod.ensure_up(cfg, parts=["s3"])
    assert started == ["s3"], f"a fresh port must start a fresh server, started {started}"
    with pytest.MonkeyPatch.context() as mp:
        for key, value in stack_mod.s3_env(cfg).items():
            mp.setenv(key, value)
        yield cfg
    stack_mod.down(cfg, parts=["s3"])


@pytest.fixture(scope="module")
def kafka_bootstrap() -> Iterator[str]:
    """The broker alone (this module needs no MLflow or vLLM); stopped only when this module started it."""
    cfg = stack_mod.load_stack_config([])
    started = stack_mod.ensure_up(cfg, parts=["kafka"])
    yield cfg.kafka_bootstrap
    if os.environ.get("FLYWHEEL_KEEP_STACK") != "1":
        stack_mod.down(cfg, parts=started)


def _read(fs: object, path: str) -> bytes:
    with fs.open_input_stream(path) as fh:  # type: ignore[attr-defined]
        return fh.read()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_server_creates_a_key_once_under_if_none_match(s3: stack_mod.StackConfig) -> None:
    ep = lake.s3_endpoint()
    fs, _ = lake.filesystem(f"s3://{s3.s3_bucket}")
    key = f"probe/{uuid.uuid4().hex}.json"
    assert lake.s3_put_if_absent(ep, s3.s3_bucket, key, b"first") is True
    assert lake.s3_put_if_absent(ep, s3.s3_bucket, key, b"second") is False, "a second conditional create must get 412"
    assert _read(fs, f"{s3.s3_bucket}/{key}") == b"first"
    # a plain PUT does overwrite: the refusal above is the header's doing, not a store that never overwrites
    with fs.open_output_stream(f"{s3.s3_bucket}/{key}") as fh:
        fh.write(b"overwritten")
    assert lake.s3_put_if_absent(ep, s3.s3_bucket, key, b"third") is False
    assert _read(fs, f"{s3.s3_bucket}/{key}") == b"overwritten"

    # racing: 8 threads create the same 40 keys at once; each key must have exactly one winner, whose body it holds
    keys, threads = [f"race-{uuid.uuid4().hex[:8]}/{i}" for i in range(40)], 8
    wins: dict[str, list[int]] = {k: [] for k in keys}
    lock, gate = threading.Lock(), threading.Barrier(threads)

    def race(me: int) -> None:
        gate.wait()
        for k in keys:
            if lake.s3_put_if_absent(ep, s3.s3_bucket, k, str(me).encode()):
                with lock:
                    wins[k].append(me)

    workers = [threading.Thread(target=race, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    several = {k: v for k, v in wins.items() if len(v) != 1}
    assert not several, f"{len(several)} of {len(keys)} keys had other than one winner: {list(several.items())[:3]}"
    held = {k: int(_read(fs, f"{s3.s3_bucket}/{k}")) for k in keys}
    assert held == {k: v[0] for k, v in wins.items()}, "a key holds another body than its winner's"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_racing_claims_on_s3_agree_on_one_extent(s3: stack_mod.StackConfig) -> None:
    root = f"s3://{s3.s3_bucket}/claims-{uuid.uuid4().hex[:8]}"
    claims: list[lake.Claim] = []
    gate = threading.Barrier(6)

    def claim(last: int) -> None:
        gate.wait()
        claims.append(lake.claim_range(root, "events", "t", 0, 100, last, f"2026-01-0{1 + last % 5}"))

    workers = [threading.Thread(target=claim, args=(100 + 7 * i,)) for i in range(6)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert len(set(claims)) == 1, f"writers racing on offset 100 were told different extents: {sorted(set(claims))}"
    assert lake.read_claim(root, "events", "t", 0, 100) == claims[0]


def _start_writer(bootstrap: str, topic: str, dlq: str, group: str, instance: str, root: str, var: Path,
                  env: dict[str, str], roll_records: int) -> subprocess.Popen:
    args = [sys.executable, "-m", "flywheel.ingest.lake_writer", "--kafka-bootstrap", bootstrap, "--events-topic", topic,
            "--outcomes-topic", "", "--dlq-topic", dlq, "--group-id", group, "--instance-id", instance,
            "--lake-root", root, "--var-dir", str(var), "--roll-max-age-s", "0.5",
            "--roll-max-records", str(roll_records), "--session-timeout-s", "6", "--log-level", "WARNING",
            # twice in CI a writer's first join never completed; the watch starts a new consumer well within 90 s
            "--join-timeout-s", "15"]
    log = open(var / f"{instance}.log", "ab")
    return subprocess.Popen(args, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env})


def _check_exact(root: str, produced: list[str], partitions: int) -> int:
    """Every produced event_id once (count and sha256), files contiguous per partition; returns the file count."""
    import pyarrow.dataset as ds

    files = lake.list_files(root, "events")
    for p in range(partitions):
        ranges = sorted((f.first, f.last) for f in files if f.partition == p)
        assert ranges and ranges[0][0] == 0, f"partition {p}: files start at {ranges[:1]}"
        gaps = [(a, b) for a, b in zip(ranges, ranges[1:]) if b[0] != a[1] + 1]
        assert not gaps, f"partition {p}: files overlap or leave gaps: {gaps[:5]}"
    fs, _ = lake.filesystem(root)
    ids = ds.dataset([f.path for f in files], filesystem=fs, format="parquet").to_table(columns=["event_id"])
    got = sorted(ids.column("event_id").to_pylist())
    assert (len(got), len(set(got))) == (len(produced), len(produced)), \
        f"the s3 lake holds {len(got)} rows, {len(set(got))} distinct event_ids; produced {len(produced)}"
    want = hashlib.sha256("".join(sorted(produced)).encode()).hexdigest()
    assert hashlib.sha256("".join(got).encode()).hexdigest() == want, "event_id checksum of the lake differs"
    return len(files)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_writers_racing_into_one_s3_lake_land_each_event_once(
        s3: stack_mod.StackConfig, kafka_bootstrap: str, new_topic: Callable[..., str], tmp_path: Path) -> None:
    """Two writers in different consumer groups both read every partition, so they race to claim and publish
    every range, with different roll sizes (their claims disagree); one is SIGKILLed mid-stream and restarted."""
    from flywheel.base.heartbeat import read_statuses
    from flywheel.serving.sessions import read_sessions

    n, partitions_n = 12_000, 4
    topic, dlq = new_topic("lw-s3", partitions=partitions_n), new_topic("lw-s3-dlq")
    root, var = f"s3://{s3.s3_bucket}/lake-{uuid.uuid4().hex[:8]}", tmp_path / "var"
    var.mkdir()
    env, suffix = stack_mod.s3_env(s3), uuid.uuid4().hex[:8]

    def start(instance: str) -> subprocess.Popen:
        return _start_writer(kafka_bootstrap, topic, dlq, f"test-s3-{instance}-{suffix}", instance, root, var, env,
                             roll_records=1500 if instance == "a" else 400)

    def landed() -> int:
        return sum(lake.next_offsets(root, "events", topic).values())

    def partitions(w: str) -> int | None:
        return read_statuses(var).get(f"lake-writer-{w}", {}).get("partitions")

    writers = {"a": start("a"), "b": start("b")}
    produced: list[str] = []
    # produced over about 8 s, so the kill below lands while both writers are publishing
    producer = threading.Thread(target=lambda: produced.extend(produce(kafka_bootstrap, topic, n, partitions_n, 1500)))
    try:
        # both must hold every partition before the feed starts, or there is no race: in one CI run writer b never
        # got an assignment, and its heartbeat's lag (over no partitions) read 0, so the test ran one writer alone
        try:
            wait_for(lambda: all(partitions(w) == partitions_n for w in "ab"), 90,
                     f"both writers to hold all {partitions_n} partitions")
        except AssertionError as exc:  # what each writer said, for the next diagnosis
            logs = {w: (var / f"{w}.log").read_text(errors="replace")[-3000:] for w in "ab"}
            raise AssertionError(f"{exc}\nstatuses {read_statuses(var)}\nlogs {logs}") from exc
        producer.start()
        wait_for(lambda: landed() > 0, 90, "the first files in the s3 lake")
        writers["a"].send_signal(signal.SIGKILL)  # with open buffers and maybe a claim not yet published
        writers["a"].wait()
        at_kill = landed()
        writers["a"] = start("a")
        producer.join()
        wait_for(lambda: landed() >= n, 180, f"{n} events in the s3 lake")
        wait_for(lambda: all(partitions(w) == partitions_n and read_statuses(var)[f"lake-writer-{w}"].get("lag_records") == 0
                             for w in "ab"), 60, "both writers' heartbeats to show all partitions at lag 0")
        published = {w: read_statuses(var)[f"lake-writer-{w}"]["files"] for w in "ab"}
    finally:
        for proc in writers.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=30)
    assert all(p.returncode == 0 for p in writers.values()), {w: p.returncode for w, p in writers.items()}
    files = _check_exact(root, produced, partitions_n)
    print(f"publishes per writer {published}, files in the s3 lake {files}, events landed at the kill {at_kill}")
    assert at_kill < n, f"the kill came after all {n} events had landed: it tested no restart mid-stream"
    # both published, and more publishes than files: they raced on the same ranges (identical names, one file each)
    assert min(published.values()) > 0 and sum(published.values()) > files, \
        f"publishes per writer {published} against {files} files: the writers did not race"
    # the gate's reader on the remote lake: produce() spreads the events over 97 sessions
    sessions = read_sessions(root)
    assert len(sessions) == 97, f"read_sessions on the s3 lake found {len(sessions)} sessions, want 97"
