"""Every lake reader on a lake root with a scheme (the code path of s3://, here through pyarrow's file:// filesystem):
the episode builder, the learner's episode reader and the report's session table give the rows they give on a
plain local path holding the same data. tests/integration/test_lake_readers_s3.py runs the same on S3Proxy."""

from __future__ import annotations

import datetime as dt
import shutil
from pathlib import Path
from typing import Any

from bench.episodes import TOML  # the rewards of the builder's benchmark: task_success within 600 s
from bench.fixtures import sessions as synthetic
from flywheel.demo import report
from flywheel.ingest import lake
from flywheel.learner.data import EpisodeStream
from flywheel.rewards import builder as episodes
from flywheel.rewards import config
from flywheel.serving.sessions import read_sessions

NOW = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.timezone.utc)
VOLATILE = ("emitted_ts",)  # when a row was written: differs between two builds by design


def by_id(record: Any) -> str:
    return str(record.session_id)


def fill(root: str) -> None:
    feed = synthetic.LakeFeeder(root)
    for i in range(3):  # three files per table, two dates
        ev, oc = synthetic.generate(12, NOW - dt.timedelta(days=1, hours=i * 12), seed=i)
        feed.write("events", ev)
        feed.write("outcomes", oc)


def build(root: str, base: Path) -> list[dict[str, Any]]:
    cfg = episodes.EpisodesConfig(lake_root=root, state_dir=str(base / "state"), var_dir=str(base / "var"))
    with episodes.Builder(cfg, config.parse(TOML)) as builder:
        while not builder.run_pass(NOW).idle:
            pass
    rows = [r for f in lake.list_files(root, "episodes") for r in lake.read_file(root, f).to_pylist()]
    return sorted(({k: v for k, v in r.items() if k not in VOLATILE} for r in rows), key=lambda r: r["episode_id"])


def test_builder_learner_and_report_read_a_remote_root_as_a_local_one(tmp_path: Path) -> None:
    local, remote = str(tmp_path / "local"), f"file://{tmp_path}/remote"
    fill(local)
    shutil.copytree(local, tmp_path / "remote")  # the same files (and claims) under a root with a scheme
    assert len(lake.list_files(remote, "events")) == len(lake.list_files(local, "events")) > 0

    rows_local, rows_remote = build(local, tmp_path / "b-local"), build(remote, tmp_path / "b-remote")
    assert rows_local and rows_remote == rows_local, \
        f"episodes differ: {len(rows_remote)} rows on the remote root, {len(rows_local)} on the local one"

    streams = {}
    for name, root in (("local", local), ("remote", remote)):
        stream = EpisodeStream(root, vocab_size=512, max_seq_len=4096)
        stream.poll()
        streams[name] = sorted((p.episode.episode_id, p.episode.reward) for p in stream.pending)
        assert stream.poll() == 0, f"the {name} reader found rows again past what it loaded"
    assert streams["local"] and streams["remote"] == streams["local"]
    assert len(streams["local"]) == len(rows_local)

    sessions = {name: sorted(read_sessions(root), key=by_id) for name, root in (("local", local), ("remote", remote))}
    assert len(sessions["local"]) == 36 and sessions["remote"] == sessions["local"]
    facts = {name: report.lake_facts(root) for name, root in (("local", local), ("remote", remote))}
    for name, f in facts.items():
        assert (f.sessions_total, len(f.session_to_lake_s), f.episodes) == (36, 36, len(rows_local)), \
            f"{name}: {f.sessions_total} ended sessions, {len(f.session_to_lake_s)} with a publication time, " \
            f"{f.episodes} episodes"
    assert facts["remote"].tool_calls == facts["local"].tool_calls and facts["local"].tool_calls
    assert sorted(facts["remote"].sessions, key=by_id) == sorted(facts["local"].sessions, key=by_id)
