"""Prometheus metrics of every process: each is updated through its real code path, scraped, and parsed with
prometheus_client's own parser (names, types, label values and numbers), without Kafka, vLLM or MLflow."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import random
import socket
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from flywheel.base.metrics import CONTENT_TYPE, Metrics, Reading, metric_name


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _parse(text: str) -> dict[str, Any]:
    """family name -> family; every family of a flywheel process follows the naming rule."""
    families = {f.name: f for f in text_string_to_metric_families(text)}
    ours = [n for n in families if not n.endswith("_created")]
    assert ours and all(n.startswith("flywheel_") for n in ours), sorted(families)
    return families


def _value(families: dict[str, Any], sample: str, kind: str, **labels: str) -> float:
    """The value of the one sample named `sample` with exactly these labels, in a family of type `kind`."""
    found = [(f.type, s.value) for f in families.values() for s in f.samples if s.name == sample and s.labels == labels]
    assert len(found) == 1, f"{sample}{labels}: found {found}; families {sorted(families)}"
    assert found[0][0] == kind, f"{sample} is in a {found[0][0]}, expected a {kind}"
    return found[0][1]


# ---- the shared helper -------------------------------------------------------------------------
def test_names_follow_the_rule_and_readings_become_typed_samples() -> None:
    assert metric_name("lake_writer", "consumed", "records") == "flywheel_lake_writer_consumed_records"
    for bad in (("Proxy", "http", "requests"), ("proxy", "http-x", "requests"), ("proxy", "http", "requests_total")):
        with pytest.raises(AssertionError):
            metric_name(*bad)
    m = Metrics("t")
    box = {"n": 1}
    m.read(lambda: [Reading("counter", "seen", "records", "h", box["n"]),
                    Reading("gauge", "lag", "records", "h", {"b": 2, "a": 1}, "part")])
    box["n"] = 7  # read at scrape time, not when registered
    fam = _parse(m.exposition().decode())
    assert _value(fam, "flywheel_t_seen_records_total", "counter") == 7
    assert (_value(fam, "flywheel_t_lag_records", "gauge", part="a"), _value(fam, "flywheel_t_lag_records", "gauge",
                                                                           part="b")) == (1, 2)
    assert Metrics("t").registry is not m.registry, "each process has its own registry"


def test_serve_is_off_at_port_0_and_a_real_endpoint_otherwise() -> None:
    m = Metrics("t")
    m.counter("hit", "requests", "h").inc(3)
    assert m.serve(0) is False
    port = _free_port()
    assert m.serve(port, host="127.0.0.1") is True
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert _value(_parse(text), "flywheel_t_hit_requests_total", "counter") == 3
    finally:
        m.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


# ---- proxy ----------------------------------------------------------------------------------------
def test_proxy_metrics_are_prometheus_text_and_stats_the_json(tmp_path: Path) -> None:
    from aiohttp.test_utils import TestClient, TestServer

    from flywheel.ingest.sdk import SessionLogger
    from flywheel.serving.proxy import CaptureProxy, ProxyConfig, make_app, static_route

    async def scenario() -> tuple[str, str, dict]:
        logger = SessionLogger(f"127.0.0.1:{_free_port()}", name="m", spool_dir=tmp_path / "spool", linger_s=0.01)
        dead = f"http://127.0.0.1:{_free_port()}"
        proxy = CaptureProxy(ProxyConfig(upstream=dead, heartbeat_s=0), logger, static_route("policy-v0", 0))
        try:
            async with TestClient(TestServer(make_app(proxy))) as client:
                await client.post("/v1/chat/completions", data=b"{not json")
                for sid in ("s1", "s2"):  # vLLM is down: 502s, two sessions seen
                    await client.post("/v1/chat/completions", json={"model": "m", "messages": []},
                                      headers={"X-Flywheel-Session-Id": sid})
                resp = await client.get("/metrics")
                stats = await (await client.get("/stats")).json()
                return resp.headers["Content-Type"], await resp.text(), stats
        finally:
            logger.close(timeout=1)

    content_type, text, stats = asyncio.run(scenario())
    assert content_type == CONTENT_TYPE and "version=0.0.4" in content_type, content_type
    fam = _parse(text)
    assert _value(fam, "flywheel_proxy_http_requests_total", "counter") == 3 == stats["requests"]
    assert _value(fam, "flywheel_proxy_bad_requests_total", "counter") == 1 == stats["bad_requests"]
    assert _value(fam, "flywheel_proxy_upstream_errors_total", "counter") == 2 == stats["upstream_errors"]
    assert _value(fam, "flywheel_proxy_open_sessions", "gauge") == 2 == stats["open_sessions"]
    assert _value(fam, "flywheel_proxy_unlogged_calls_total", "counter", reason="no_session") == 0
    assert _value(fam, "flywheel_proxy_sdk_dropped_records_total", "counter") == stats["sdk"]["dropped"]
    hist = fam["flywheel_proxy_request_duration_seconds"]
    assert hist.type == "histogram"
    counts = {s.labels["route"]: s.value for s in hist.samples if s.name.endswith("_count")}
    assert counts == {"chat": 3}, counts
    assert stats["router"] is None and "sdk" in stats, stats


# ---- lake writer ----------------------------------------------------------------------------------
class _Consumer:
    """The KafkaConsumer calls of the writer's loop: polls in turn, fixed log end offsets."""

    def __init__(self, batches: list[dict], ends: dict[tuple[str, int], int]) -> None:
        self.batches, self.ends = batches, ends

    def poll(self, timeout_ms: int, max_records: int) -> dict:
        return self.batches.pop(0) if self.batches else {}

    def end_offsets(self, parts: list, timeout_ms: int) -> dict:
        return {t: self.ends.get((t.topic, t.partition), 0) for t in parts}

    def seek(self, tp: object, offset: int) -> None: ...

    def seek_to_beginning(self, tp: object) -> None: ...

    def pause(self, *parts: object) -> None: ...

    def commit_async(self, offsets: dict) -> None: ...

    def group_metadata(self) -> object:
        from kafka.structs import ConsumerGroupMetadata, MemberState

        return ConsumerGroupMetadata(group_id="test", generation_id=1, state=MemberState.STABLE)


def test_lake_writer_counts_records_files_dead_letters_by_reason_and_lag(tmp_path: Path) -> None:
    from kafka import TopicPartition

    from flywheel.ingest.lake_writer import (
        DeadLetters,
        LakeWriter,
        LakeWriterConfig,
        _loop,
        _Rebalance,
        writer_metrics,
    )

    topic = "flywheel.events"
    good = [{"schema_version": 1, "event_id": f"e{i}", "session_id": "s", "agent_id": "main", "seq": i,
             "ts": "2026-11-30T10:00:00.000001+00:00", "type": "session_start", "task_type": "qa"} for i in range(4)]
    values = [json.dumps(e).encode() for e in good] + [b"{not json", None]  # offsets 4, 5: two reasons
    msgs = [SimpleNamespace(offset=i, value=v, key=None, timestamp=None) for i, v in enumerate(values)]
    cfg = LakeWriterConfig(events_topic=topic, outcomes_topic="", lake_root=str(tmp_path / "lake"), roll_max_records=3,
                           status_interval_s=0.0, var_dir=str(tmp_path / "var"))
    writer = LakeWriter(cfg, DeadLetters(None, cfg.dlq_topic, cfg.lake_root), clock=lambda: 0.0)
    consumer = _Consumer([{TopicPartition(topic, 0): msgs}], ends={(topic, 0): 10})
    rebalance = _Rebalance(writer, consumer)
    rebalance.on_partitions_assigned({TopicPartition(topic, 0)})
    metrics = writer_metrics(writer)
    polls = iter(range(3))
    _loop(cfg, consumer, writer, rebalance, "lake-writer-test", lambda: next(polls, None) is None)
    fam = _parse(metrics.exposition().decode())
    assert _value(fam, "flywheel_lake_writer_consumed_records_total", "counter") == 6
    assert _value(fam, "flywheel_lake_writer_landed_rows_total", "counter") == 4
    assert _value(fam, "flywheel_lake_writer_published_files_total", "counter") == 2  # 0..2 and 3..5 by count
    dead = {s.labels["reason"]: s.value for s in fam["flywheel_lake_writer_dead_lettered_records"].samples
            if s.name.endswith("_total")}
    assert dead == {"malformed_json": 1, "empty": 1}, dead
    # the last heartbeat saw offsets 0..5 published of a log ending at 10
    assert _value(fam, "flywheel_lake_writer_consumer_lag_records", "gauge") == 4
    assert _value(fam, "flywheel_lake_writer_assigned_partitions", "gauge") == 1


# ---- episode builder ------------------------------------------------------------------------------
REWARDS = """
[outcomes.task_success]
window_s = 600
missing = 0.0
[task_types.tool_use]
wait_for = ["task_success"]
"""


def test_episode_builder_counts_episodes_pending_sessions_and_drops_by_reason(tmp_path: Path) -> None:
    from bench.fixtures import sessions as synthetic
    from flywheel.rewards import builder as episodes
    from flywheel.rewards import config

    t0 = dt.datetime(2026, 1, 1, 12, tzinfo=dt.timezone.utc)
    feed = synthetic.LakeFeeder(str(tmp_path / "lake"))
    done = synthetic.SessionBuilder("done", t0, task_type="tool_use").begin()
    for _ in range(2):
        done.llm_call()
        done.tool()
    end = done.end()
    open_ = synthetic.SessionBuilder("open", t0, task_type="tool_use").begin()
    open_.llm_call()
    feed.write("events", done.events + open_.events)
    o = synthetic.outcome("done", "task_success", 1.0, end + dt.timedelta(seconds=5), outcome_id="o-1")
    feed.write("outcomes", [o, o])  # a replay: one counts, one is dropped
    cfg = episodes.EpisodesConfig(lake_root=str(tmp_path / "lake"), state_dir=str(tmp_path / "state"),
                                  var_dir=str(tmp_path / "var"))
    with episodes.Builder(cfg, config.parse(REWARDS)) as builder:
        metrics = episodes.EpisodesMetrics(builder)
        before = _parse(metrics.metrics.exposition().decode())
        assert _value(before, "flywheel_episodes_written_episodes_total", "counter") == 0
        res = builder.run_pass(now=end + dt.timedelta(seconds=30))
        metrics.observe(res)
        fam = _parse(metrics.metrics.exposition().decode())
    assert _value(fam, "flywheel_episodes_written_episodes_total", "counter") == 2 == res.rows_written
    assert _value(fam, "flywheel_episodes_labelled_sessions_total", "counter") == 1
    assert _value(fam, "flywheel_episodes_pending_sessions", "gauge") == 1 == res.pending_sessions
    assert _value(fam, "flywheel_episodes_dropped_records_total", "counter", reason="duplicate_outcome") == 1
    assert _value(fam, "flywheel_episodes_pass_duration_seconds_count", "histogram") == 1


# ---- learner --------------------------------------------------------------------------------------
def test_learner_exports_steps_throughput_and_policy_lag_while_it_runs(tmp_path: Path) -> None:
    from bench.fixtures.episodes import random_rows, write_episodes
    from bench.fixtures.models import tiny_model
    from flywheel.learner.config import LearnerConfig
    from flywheel.learner.daemon import run

    for i in range(3):
        write_episodes(tmp_path / "lake", random_rows(8, seed=i, vocab_size=512), seq=i)
    port = _free_port()
    cfg = LearnerConfig(lake_root=str(tmp_path / "lake"), base_model=str(tiny_model(tmp_path / "tiny")),
                        run_dir=str(tmp_path / "run"), policies_dir=str(tmp_path / "policies"),
                        var_dir=str(tmp_path / "var"), mlflow_tracking_uri="", publish=False, batch_size=8, min_batch=8,
                        micro_batch=4, lora_rank=4, device="cpu", poll_s=0.2, metrics_port=port)
    stop = threading.Event()
    daemon = threading.Thread(target=run, args=(cfg, stop), daemon=True)
    daemon.start()
    fam: dict[str, Any] = {}
    deadline = time.monotonic() + 180
    try:
        while time.monotonic() < deadline:
            try:
                fam = _parse(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode())
                if _value(fam, "flywheel_learner_trained_steps_total", "counter") >= 3:
                    break
            except OSError:
                pass  # not listening yet: the model is still loading
            time.sleep(0.2)
    finally:
        stop.set()
        daemon.join(60)
    assert fam and _value(fam, "flywheel_learner_trained_steps_total", "counter") == 3, "3 batches of 8 episodes"
    assert _value(fam, "flywheel_learner_trained_episodes_total", "counter") == 24
    assert _value(fam, "flywheel_learner_policy_lag_steps_count", "histogram") == 24, "one lag per trained row"
    # step k trains rows of policy-v0 that is k-1 steps behind by then (nothing is published): 8 rows each of 0, 1, 2
    assert _value(fam, "flywheel_learner_policy_lag_steps_sum", "histogram") == 8 * (0 + 1 + 2)
    assert _value(fam, "flywheel_learner_policy_lag_steps_bucket", "histogram", le="1.0") == 16
    assert _value(fam, "flywheel_learner_training_throughput_tokens_per_second", "gauge") > 0
    assert _value(fam, "flywheel_learner_policy_version", "gauge") == 0, "publish is off"
    assert not daemon.is_alive()
    with pytest.raises(OSError):  # run() closed its endpoint on the way out
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


# ---- gate -----------------------------------------------------------------------------------------
def test_gate_counts_decisions_by_action_and_the_sessions_it_compared() -> None:
    from flywheel.serving.evaluate import EvalScore
    from flywheel.serving.promote import (
        ACTIONS,
        Decision,
        GateMetrics,
        PromoteConfig,
        gate_round,
    )
    from flywheel.serving.sessions import SessionRecord

    rng = random.Random(0)

    def arm(version: int, name: str, rate: float, n: int) -> list[SessionRecord]:
        return [SessionRecord(f"{name}-{i}", "t", version, name, 1000.0 + i, 1005.0 + i, "ok",
                              float(rng.random() < rate), 1007.0 + i) for i in range(n)]

    # the router's split for these arms (55 / 45), and no guardrails: the records carry no guardrail metrics
    cfg = PromoteConfig(min_sessions=30, max_sessions=2000, maturity_s=10.0, challenger_share=0.45, guardrails={})
    records = arm(1, "champion", 0.3, 300) + arm(2, "challenger", 0.7, 250)
    promoted = gate_round(1, 2, records, (EvalScore("t", 64, 20), EvalScore("t", 64, 30)), cfg, 10_000.0)
    assert promoted.action == "promote", promoted.reason
    metrics = GateMetrics()
    metrics.observe_round([promoted], 0.5, failed=False)
    metrics.observe_round([Decision("none", "round failed: down", -1, None)], 2.0, failed=True)
    fam = _parse(metrics.metrics.exposition().decode())
    by_action = {a: _value(fam, "flywheel_promote_gate_decisions_total", "counter", action=a) for a in ACTIONS}
    assert by_action == {a: float(a in ("promote", "none")) for a in ACTIONS}, by_action
    compared = {s.labels["arm"]: s.value for s in fam["flywheel_promote_compared_sessions"].samples}
    assert compared == {"champion": 300, "challenger": 250}, compared
    assert _value(fam, "flywheel_promote_failed_rounds_total", "counter") == 1
    assert _value(fam, "flywheel_promote_round_duration_seconds_count", "histogram") == 2
    assert _value(fam, "flywheel_promote_champion_version", "gauge") == 1, "a failed round keeps the last champion"
