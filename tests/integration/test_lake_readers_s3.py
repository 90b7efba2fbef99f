"""Every lake reader on an s3:// lake (S3Proxy, `flywheel infra up --parts s3`): events and outcomes landed by the
real lake writer in an s3:// lake and, from the same topics, in a local one; then the episode builder, the learner's
episode reader and the report's session table read both and must give equal rows. A second batch then lands and a
running builder finds it by cursor on S3 (the claim chain), still equal to the local lake's.

The writers are real subprocesses against the real broker, configured for the lake only through the AWS_* variables
(and the two checksum settings design.md names, without which pyarrow's S3 client frames objects aws-chunked).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import sys
import uuid
import zlib
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from bench.episodes import TOML
from bench.fixtures import sessions as synthetic
from flywheel import stack as stack_mod
from flywheel.ingest import lake
from tests.integration.test_lake_s3 import kafka_bootstrap, s3  # noqa: F401 (module fixtures: the broker, a private S3Proxy)
from tests.integration.test_lake_writer_kill import wait_for

ROOT = Path(__file__).resolve().parents[2]
PARTITIONS = 2
CHECKSUMS = {"AWS_REQUEST_CHECKSUM_CALCULATION": "WHEN_REQUIRED", "AWS_RESPONSE_CHECKSUM_VALIDATION": "WHEN_REQUIRED"}


@pytest.fixture(scope="module")
def checksums() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        for key, value in CHECKSUMS.items():
            mp.setenv(key, value)
        yield


def produce(bootstrap: str, topics: dict[str, str],
            batch: tuple[list[dict[str, Any]], list[dict[str, Any]]]) -> dict[str, int]:
    """Send a batch of events and outcomes, each keyed and partitioned by its session (as the SDK does)."""
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=20, acks="all")
    counts = {}
    for table, records in zip(("events", "outcomes"), batch):
        for r in records:
            key = r["session_id"].encode()
            producer.send(topics[table], key=key, value=json.dumps(r).encode(), partition=zlib.crc32(key) % PARTITIONS)
        counts[table] = len(records)
    producer.flush()
    producer.close()
    return counts


def start_writer(bootstrap: str, topics: dict[str, str], dlq: str, root: str, var: Path,
                 env: dict[str, str]) -> subprocess.Popen:
    name = "s3" if root.startswith("s3://") else "local"
    args = [sys.executable, "-m", "flywheel.ingest.lake_writer", "--kafka-bootstrap", bootstrap,
            "--events-topic", topics["events"], "--outcomes-topic", topics["outcomes"], "--dlq-topic", dlq,
            "--group-id", f"test-readers-{name}-{uuid.uuid4().hex[:8]}", "--instance-id", name, "--lake-root", root,
            "--var-dir", str(var / name), "--roll-max-age-s", "0.5", "--roll-max-records", "300",
            "--log-level", "WARNING"]
    log = open(var / f"{name}.log", "ab")
    return subprocess.Popen(args, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env})


def landed(root: str, topics: dict[str, str]) -> dict[str, int]:
    return {t: sum(lake.next_offsets(root, t, topics[t]).values()) for t in ("events", "outcomes")}


def episode_rows(root: str) -> list[tuple[Any, ...]]:
    rows = [r for f in lake.list_files(root, "episodes") for r in lake.read_file(root, f).to_pylist()]
    return sorted((r["episode_id"], r["label_version"], r["session_id"], r["reward"], tuple(r["completion_token_ids"]),
                   tuple(round(x, 6) for x in r["completion_logprobs"])) for r in rows)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_builder_learner_and_report_read_an_s3_lake_as_a_local_one(
        s3: stack_mod.StackConfig, kafka_bootstrap: str, checksums: None,  # noqa: F811
        new_topic: Callable[..., str], tmp_path: Path) -> None:
    from flywheel.demo.report import lake_facts
    from flywheel.learner.data import EpisodeStream
    from flywheel.rewards import builder as episodes
    from flywheel.rewards import config
    from flywheel.serving.sessions import read_sessions

    topics = {t: new_topic(f"readers-{t}", partitions=PARTITIONS) for t in ("events", "outcomes")}
    dlq = new_topic("readers-dlq")
    roots = {"s3": f"s3://{s3.s3_bucket}/readers-{uuid.uuid4().hex[:8]}", "local": str(tmp_path / "lake")}
    var = tmp_path / "var"
    var.mkdir()
    env = {**stack_mod.s3_env(s3), **CHECKSUMS}
    start = dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=2)
    batches = [synthetic.generate(40, start, seed=1, spacing_s=2.0),
               synthetic.generate(30, start + dt.timedelta(minutes=30), seed=2, spacing_s=2.0)]
    want = {t: 0 for t in ("events", "outcomes")}
    rewards = config.parse(TOML)
    now = dt.datetime.now(dt.timezone.utc)
    writers = {name: start_writer(kafka_bootstrap, topics, dlq, root, var, env) for name, root in roots.items()}
    builders = {name: episodes.Builder(episodes.EpisodesConfig(lake_root=root, state_dir=str(tmp_path / f"state-{name}"),
                                                               var_dir=str(var / f"b-{name}"), max_files_per_pass=10_000),
                                       rewards)
                for name, root in roots.items()}
    try:
        for i, batch in enumerate(batches):
            for t, n in produce(kafka_bootstrap, topics, batch).items():
                want[t] += n
            for name, root in roots.items():
                wait_for(lambda: landed(root, topics) == want, 120, f"batch {i + 1} in the {name} lake ({want})")
            for name, builder in builders.items():
                # batch 1: the running builder's first pass (whole listing); batch 2: by cursor, along the S3 claims
                res = builder.run_pass(now)
                assert res.sessions_emitted == len({e["session_id"] for e in batch[0]}), \
                    f"{name}, batch {i + 1}: {res.sessions_emitted} sessions emitted, drops {res.drops}"
            rows = {name: episode_rows(root) for name, root in roots.items()}
            assert rows["s3"] == rows["local"] and rows["local"], \
                f"batch {i + 1}: {len(rows['s3'])} episode rows on s3, {len(rows['local'])} on the local lake"
    finally:
        for builder in builders.values():
            builder.close()
        for proc in writers.values():
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
    assert all(p.returncode == 0 for p in writers.values()), {n: p.returncode for n, p in writers.items()}

    # the claim chain on S3 lists exactly what the whole-table walk lists past a cursor, without that walk
    files = lake.list_files(roots["s3"], "events")
    half: lake.Cursor = {}
    for key in {f.key for f in files}:
        mine = [f for f in files if f.key == key]
        half = lake.advance(half, mine[: len(mine) // 2])
    assert len(half) == PARTITIONS, f"every partition needs 2 files or more for this check: {files}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lake, "_walk_table", None)  # files_since must not need the walk: calling None would fail
        by_cursor = lake.files_since(roots["s3"], "events", half)
    assert by_cursor == [f for f in files if f.last > half.get(f.key, -1)] and by_cursor

    # the learner's reader
    read = {}
    for name, root in roots.items():
        stream = EpisodeStream(root, vocab_size=512, max_seq_len=4096)
        stream.poll()
        read[name] = sorted((p.episode.episode_id, p.episode.label_version, p.episode.reward) for p in stream.pending)
        assert stream.poll() == 0, f"{name}: a second poll found rows again"
    assert read["s3"] == read["local"] and len(read["local"]) == len(rows["local"])

    # the gate's and the report's session table
    sessions = {name: sorted(read_sessions(root), key=lambda r: r.session_id) for name, root in roots.items()}
    assert len(sessions["local"]) == 70 and sessions["s3"] == sessions["local"]
    facts = {name: lake_facts(root) for name, root in roots.items()}
    got = {name: (f.sessions_total, len(f.session_to_lake_s), f.episodes, len(f.outcome_to_episode_s))
           for name, f in facts.items()}
    assert got["s3"] == got["local"] == (70, 70, len(rows["local"]), len(rows["local"])), got
    assert facts["s3"].tool_calls == facts["local"].tool_calls
    assert max(facts["s3"].session_to_lake_s) < 24 * 3600, "publication times on S3 come from the objects' mtimes"
