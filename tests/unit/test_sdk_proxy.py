"""The capture proxy's response handling without a server: what it logs from vLLM replies (whole and
streamed), what it strips before the agent sees them, and how sessions end."""

from __future__ import annotations

import array
import json
from pathlib import Path
from typing import Any

import pytest

from flywheel.ingest import schema, wire
from flywheel.ingest.sdk import SessionLogger
from flywheel.ingest.spool import Spool
from flywheel.serving.proxy import CaptureProxy, ProxyConfig, Routed, collect, static_route, strip
from tests.unit.test_sdk import dead_address


class _Headers(dict):
    def get(self, key: str, default: Any = None) -> Any:  # HTTP headers are case-insensitive
        return next((v for k, v in self.items() if k.lower() == key.lower()), default)


class _Request:
    def __init__(self, headers: dict[str, str]) -> None:
        self.headers = _Headers(headers)


@pytest.fixture
def proxy(tmp_path: Path) -> CaptureProxy:
    logger = SessionLogger(dead_address(), name="p", spool_dir=tmp_path / "spool", linger_s=0.01)
    proxy = CaptureProxy(ProxyConfig(idle_timeout_s=5.0), logger, static_route("policy-v4", 4))
    proxy.spool_dir = tmp_path / "spool"  # type: ignore[attr-defined]
    return proxy


def _f32(values: list[float]) -> list[float]:
    """What the lake holds of these logprobs: v3 sends float32, the lake's column type."""
    return list(array.array("f", values))


def _logged(proxy: CaptureProxy) -> list[dict]:
    proxy.logger.close(timeout=5)
    spool = Spool(proxy.spool_dir)  # type: ignore[attr-defined]
    events = [wire.decode(r) for r in spool.peek(10_000)]
    spool.close()
    for event in events:
        schema.validate_event(event)  # as the lake writer sees it: token lists as packed views
        assert event["type"] != "llm_call" or event["schema_version"] == wire.PACKED_VERSION, "the proxy logs v3"
    return [wire.as_lists(event) for event in events]


def _call(proxy: CaptureProxy, body: dict, headers: dict[str, str], kind: str = "chat") -> Any:
    return proxy._begin(_Request(headers), kind, body, 0.0, proxy.route(headers.get("X-Flywheel-Session-Id", "")))


CHAT_REPLY = {
    "id": "chatcmpl-1", "model": "policy-v4", "prompt_token_ids": [1, 2, 3],
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop", "token_ids": [7, 8],
         "logprobs": {"content": [{"token": "h", "logprob": -0.1}, {"token": "i", "logprob": -0.2}]}},
        {"index": 1, "message": {"role": "assistant", "content": "yo"}, "finish_reason": "length", "token_ids": [9, 10],
         "logprobs": {"content": [{"token": "y", "logprob": -1.0}, {"token": "o", "logprob": -2.0}]}},
    ],
}


def test_whole_reply_logs_each_choice_and_strips_unrequested_fields(proxy: CaptureProxy) -> None:
    body = {"model": "agent-name", "messages": [], "n": 2, "temperature": 0.7}
    call = _call(proxy, body, {"X-Flywheel-Session-Id": "s1", "X-Flywheel-Agent-Id": "a", "Authorization": "Bearer sk-x"})
    upstream = proxy._upstream_body("chat", body, call)
    assert upstream["model"] == "policy-v4" and upstream["return_token_ids"] is True and upstream["logprobs"] is True
    reply = json.loads(json.dumps(CHAT_REPLY))
    collect(call, reply, streaming=False)
    proxy._log(call)
    strip(call, reply, streaming=False)
    assert reply["model"] == "agent-name" and reply["prompt_token_ids"] is None
    assert all(c["logprobs"] is None and c["token_ids"] is None for c in reply["choices"])
    events = _logged(proxy)
    assert [(e["completion_token_ids"], e["completion_logprobs"], e["finish_reason"]) for e in events] == [
        ([7, 8], _f32([-0.1, -0.2]), "stop"), ([9, 10], [-1.0, -2.0], "length")]
    assert all(e["prompt_token_ids"] == [1, 2, 3] and e["policy_version"] == 4 and e["model"] == "policy-v4" for e in events)
    assert all(e["group_id"] == "chatcmpl-1" and e["agent_id"] == "a" for e in events), "n>1 choices form one group"
    assert events[0]["sampling"] == {"temperature": 0.7, "n": 2} and events[0]["completion_text"] == "hi"


def test_stream_chunks_are_accumulated_and_requested_fields_kept(proxy: CaptureProxy) -> None:
    body = {"model": "m", "messages": [], "stream": True, "logprobs": True, "return_token_ids": True}
    call = _call(proxy, body, {"X-Flywheel-Session-Id": "s2"})
    chunks = [
        {"id": "c", "model": "policy-v4", "prompt_token_ids": [5, 6], "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"id": "c", "model": "policy-v4", "choices": [{"index": 0, "delta": {"content": "ab"}, "token_ids": [11, 12],
                                                       "logprobs": {"content": [{"logprob": -0.5}, {"logprob": -0.25}]}}]},
        {"id": "c", "model": "policy-v4", "choices": [{"index": 0, "delta": {"content": "c"}, "token_ids": [13],
                                                       "logprobs": {"content": [{"logprob": -3.0}]}, "finish_reason": "stop"}]},
    ]
    for chunk in chunks:
        collect(call, chunk, streaming=True)
        strip(call, chunk, streaming=True)
    proxy._log(call)
    assert chunks[0]["prompt_token_ids"] == [5, 6] and chunks[1]["choices"][0]["token_ids"] == [11, 12], "asked-for fields kept"
    assert chunks[1]["model"] == "m"
    (event,) = _logged(proxy)
    assert event["prompt_token_ids"] == [5, 6] and event["completion_token_ids"] == [11, 12, 13]
    assert event["completion_logprobs"] == [-0.5, -0.25, -3.0] and event["completion_text"] == "abc"


def test_completions_logprobs_and_echo(proxy: CaptureProxy) -> None:
    body = {"model": "m", "prompt": "x", "echo": True}
    call = _call(proxy, body, {"X-Flywheel-Session-Id": "s3"}, kind="completion")
    assert proxy._upstream_body("completion", body, call)["logprobs"] == 0
    reply = {"id": "cmpl", "model": "policy-v4", "choices": [{
        "index": 0, "text": "xyz", "prompt_token_ids": [1], "token_ids": [2, 3], "finish_reason": "length",
        "logprobs": {"token_logprobs": [None, -0.5, -0.7], "tokens": ["x", "y", "z"]}}]}
    collect(call, reply, streaming=False)
    proxy._log(call)
    strip(call, reply, streaming=False)
    assert reply["choices"][0]["logprobs"] is None and reply["choices"][0]["prompt_token_ids"] is None
    (event,) = _logged(proxy)
    assert event["completion_logprobs"] == _f32([-0.5, -0.7]), "echo: the prompt's logprobs are not behaviour logprobs"


def test_mismatched_reply_is_not_logged_but_counted(proxy: CaptureProxy) -> None:
    call = _call(proxy, {"model": "m", "messages": []}, {"X-Flywheel-Session-Id": "s4"})
    reply = {"id": "x", "prompt_token_ids": [1], "choices": [{"index": 0, "message": {"content": "a"}, "token_ids": [1, 2],
                                                              "logprobs": {"content": [{"logprob": -1.0}]}}]}
    collect(call, reply, streaming=False)
    proxy._log(call)
    assert proxy.counters["log_errors"] == 1 and proxy.counters["logged_calls"] == 0
    assert _logged(proxy) == []


def test_session_start_end_and_idle_timeout(proxy: CaptureProxy) -> None:
    start = {"X-Flywheel-Session-Id": "s5", "X-Flywheel-Session-Event": "start", "X-Flywheel-Task-Type": "qa"}
    _call(proxy, {"model": "m"}, start)
    _call(proxy, {"model": "m"}, {"X-Flywheel-Session-Id": "s6", "X-Flywheel-Session-Event": "start"})
    call = _call(proxy, {"model": "m"}, {"X-Flywheel-Session-Id": "s5", "X-Flywheel-Session-Event": "end"})
    proxy._after(_Request({"X-Flywheel-Session-Id": "s5", "X-Flywheel-Session-Event": "end"}), call)
    _call(proxy, {"model": "m"}, {})  # no session: not logged
    proxy.reap_once(now=1e9)  # long after everything: s6 is idle
    assert proxy.counters["unlogged_no_session"] == 1 and proxy.counters["idle_timeouts"] == 1
    events = _logged(proxy)
    got = [(e["session_id"], e["type"], e.get("status") or e.get("task_type")) for e in events]
    assert got == [("s5", "session_start", "qa"), ("s6", "session_start", "unknown"), ("s5", "session_end", "ok"),
                   ("s6", "session_end", "idle_timeout")], got
    assert not proxy.sessions, "idle sessions are forgotten"


def test_routed_server_and_model_come_from_the_route(tmp_path: Path) -> None:
    logger = SessionLogger(dead_address(), name="r", spool_dir=tmp_path / "spool")
    proxy = CaptureProxy(ProxyConfig(), logger, lambda sid: Routed("policy-v9", 9, "http://other:8000"))
    call = proxy._begin(_Request({"X-Flywheel-Session-Id": "s"}), "chat", {"model": "agent"}, 0.0, proxy.route("s"))
    assert (call.model, call.policy_version) == ("policy-v9", 9)
    logger.close(timeout=1)


def test_http_errors_are_clear_when_the_body_is_bad_or_vllm_is_down(tmp_path: Path) -> None:
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer

    from flywheel.serving.proxy import make_app

    async def scenario() -> list[tuple[int, str]]:
        logger = SessionLogger(dead_address(), name="h", spool_dir=tmp_path / "spool")
        proxy = CaptureProxy(ProxyConfig(upstream=f"http://{dead_address()}", heartbeat_s=0), logger, static_route("policy-v0", 0))
        async with TestClient(TestServer(make_app(proxy))) as client:
            out = []
            for body in (b"{not json", b"[1, 2]", json.dumps({"model": "m", "messages": []}).encode(),
                         json.dumps({"model": "m", "messages": [], "stream": True}).encode()):
                resp = await client.post("/v1/chat/completions", data=body, headers={"X-Flywheel-Session-Id": "s"})
                out.append((resp.status, (await resp.json())["error"]["message"]))
            out.append(((await client.get("/health")).status, ""))
        logger.close(timeout=1)
        return out

    results = asyncio.run(scenario())
    assert [status for status, _ in results] == [400, 400, 502, 502, 200], results
    assert "not valid JSON" in results[0][1] and "expected a JSON object" in results[1][1]
    assert "unavailable" in results[2][1] and "unavailable" in results[3][1]


def test_stats_show_what_the_router_routes_by(tmp_path: Path) -> None:
    import asyncio

    logger = SessionLogger(dead_address(), name="m", spool_dir=tmp_path / "spool", linger_s=0.01)
    state = {"aliases": {"champion": 3}, "read_at": 1234.5}
    try:
        with_router = CaptureProxy(ProxyConfig(heartbeat_s=0), logger, static_route("policy-v3", 3), lambda: state)
        static = CaptureProxy(ProxyConfig(heartbeat_s=0), logger, static_route("policy-v3", 3))
        assert json.loads(asyncio.run(with_router.stats(None)).text)["router"] == state
        assert json.loads(asyncio.run(static.stats(None)).text)["router"] is None
    finally:
        logger.close(timeout=5)


def test_a_call_during_a_reload_is_logged_with_both_versions_and_an_unknown_version_is_not(tmp_path: Path) -> None:
    import asyncio

    logger = SessionLogger(dead_address(), name="v", spool_dir=tmp_path / "spool", linger_s=0.01)
    proxy = CaptureProxy(ProxyConfig(idle_timeout_s=5.0), logger, static_route("policy-v4", 4))
    proxy.spool_dir = tmp_path / "spool"  # type: ignore[attr-defined]
    held = iter([2, 3, 5, 5, None, 5])  # the server's version before and after each call

    def route(session_id: str) -> Routed:
        return Routed("policy-full", 0, "http://127.0.0.1:1", loaded_version=lambda: next(held))

    async def one(session: str) -> None:
        routed = route(session)
        call = proxy._begin(_Request({"X-Flywheel-Session-Id": session}), "chat", {"model": "m"}, 0.0, routed)
        call.version_before = await proxy._loaded_version(routed)
        collect(call, json.loads(json.dumps(CHAT_REPLY)), streaming=False)
        await proxy._check_version(call, routed)
        proxy._log(call)

    for session in ("straddled", "steady", "unknown"):
        asyncio.run(one(session))
    calls = [e for e in _logged(proxy) if e["type"] == "llm_call"]
    by_session = {(e["session_id"], e["policy_version"], e.get("policy_version_alt")) for e in calls}
    assert by_session == {("straddled", 2, 3), ("steady", 5, None)}, by_session
    assert proxy.counters["version_straddled"] == 1 and proxy.counters["version_unknown"] == 1
    assert proxy.counters["logged_calls"] == 4  # two choices each
