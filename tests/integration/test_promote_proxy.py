"""Through the capture proxy (--router serving): control, champion and challenger are served at the same
time on one server (the base and two LoRA adapters), each session entirely by its arm's version, the
arm and the version logged on every llm_call; a promotion re-routes new requests within seconds and
leaves the control arm where it was."""

from __future__ import annotations

import json
import random
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Callable, Collection

from bench.fixtures import models as synthetic
from flywheel.serving import publisher
from flywheel.serving.registry import Registry
from flywheel.serving.router import bucket
from flywheel.serving.tier import TierConfig
from flywheel.serving.vllm_client import http


def _chat(url: str, session: str) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "2+2="}], "max_tokens": 3}
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", "X-Flywheel-Session-Id": session})
    urllib.request.urlopen(request, timeout=60).read()


def _llm_calls(kafka_bootstrap: str, topic: str, want: int, timeout_s: float = 30.0,
               need: Collection[str] = ()) -> dict[str, dict]:
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=kafka_bootstrap, consumer_timeout_ms=500, client_id="tests")
    tp = TopicPartition(topic, 0)
    consumer.assign([tp])
    consumer.seek_to_beginning(tp)
    calls: dict[str, dict] = {}
    deadline = time.time() + timeout_s
    while time.time() < deadline and (len(calls) < want or not set(need) <= calls.keys()):
        for message in consumer:
            event = json.loads(message.value)
            if event["type"] == "llm_call":
                calls[event["session_id"]] = event
    consumer.close()
    return calls


def _await_router_read_after(url: str, moment: float, timeout_s: float = 60.0) -> None:
    """Send warm-up requests (each may start a background alias read) until the router routes from a read that began
    after `moment`."""
    deadline = time.time() + timeout_s
    snapshot: dict = {}
    while time.time() < deadline:
        _chat(url, f"warm-up-{uuid.uuid4().hex[:8]}")
        snapshot = json.loads(urllib.request.urlopen(f"{url}/stats", timeout=10).read())["router"]
        if (snapshot.get("read_at") or 0.0) > moment:
            return
        time.sleep(0.5)
    raise AssertionError(f"the proxy's router read no aliases after the promotion within {timeout_s:.0f} s: {snapshot}")


def test_proxy_logs_challenger_and_champion_versions_and_follows_a_promotion(
        kafka_bootstrap: str, vllm_url: str, mlflow_uri: str, base_model_dir: Path, new_topic: Callable[..., str],
        tmp_path: Path, start_proxy: Callable[..., Any]) -> None:
    name = f"test-proxy-gate-{uuid.uuid4().hex[:8]}"
    tier = TierConfig(servers=[vllm_url], mlflow_tracking_uri=mlflow_uri, registered_model=name,
                      base_model=str(base_model_dir))
    registry = Registry(mlflow_uri, name)
    champion, challenger = random.randint(7_000_000, 7_999_999), random.randint(7_000_000, 7_999_999)
    for v, seed in ((champion, 61), (challenger, 62)):
        publisher.publish(synthetic.make_lora_version(base_model_dir, tmp_path / f"policy-v{v}", v, seed=seed), tier)
    registry.make_champion(champion)
    assert registry.aliases() == {"champion": champion, "challenger": challenger}

    topic = new_topic("promote-proxy")
    env = {"FLYWHEEL_REGISTERED_MODEL": name, "FLYWHEEL_SERVERS": vllm_url, "FLYWHEEL_MLFLOW_TRACKING_URI": mlflow_uri,
           "FLYWHEEL_CHALLENGER_SHARE": "0.4", "FLYWHEEL_CONTROL_SHARE": "0.2", "FLYWHEEL_ALIAS_REFRESH_S": "1"}
    log_path = tmp_path / "proxy.log"
    proc, url = start_proxy(["--router", "serving", "--kafka-bootstrap", kafka_bootstrap, "--events-topic", topic,
                              "--spool-name", f"test-pp-{uuid.uuid4().hex[:8]}"], log_path, env)
    try:
        def arm(s: str) -> str:
            return "control" if bucket(s) < 0.2 else "challenger" if bucket(s) < 0.6 else "champion"

        pool = [f"s-{uuid.uuid4().hex}" for _ in range(300)]
        sessions = [s for name in ("control", "challenger", "champion") for s in [p for p in pool if arm(p) == name][:5]]
        for s in sessions:
            _chat(url, s)
            _chat(url, s)  # a second call of the session: the same version
        calls = _llm_calls(kafka_bootstrap, topic, len(sessions))
        assert len(calls) == len(sessions), f"{len(calls)} of {len(sessions)} sessions' llm_calls arrived"
        want_version = {"control": 0, "challenger": challenger, "champion": champion}
        for s in sessions:
            got: dict[str, Any] = calls[s]
            want = want_version[arm(s)]
            assert (got["policy_version"], got["arm"]) == (want, arm(s)), (s, got["policy_version"], got["arm"], want)
            assert got["model"] == f"policy-v{want}", got["model"]

        promoted_at = time.time()
        registry.make_champion(challenger)  # promotion: every new session now goes to the new champion
        # alias_refresh_s=1, re-read in the background on a request: wait until the router's read began after the
        # promotion (GET /stats), not for a fixed time a busy machine's MLflow query can outlast
        _await_router_read_after(url, promoted_at)
        later = [f"t-{uuid.uuid4().hex}" for _ in range(6)]
        for s in later:
            _chat(url, s)
        calls = _llm_calls(kafka_bootstrap, topic, len(sessions) + len(later) + 1, need=later)
        assert {calls[s]["policy_version"] for s in later if arm(s) != "control"} == {challenger}, \
            {s: calls[s]["policy_version"] for s in later}
        assert all(calls[s]["policy_version"] == 0 for s in later if arm(s) == "control"), "the control arm moved"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        for v in (champion, challenger):
            http("POST", f"{vllm_url}/v1/unload_lora_adapter", {"lora_name": f"policy-v{v}"})
