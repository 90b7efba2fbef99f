"""The proxy's frozen_models: a request for a frozen model (the swarm's sub-agents) goes to that model's own server
and is logged with FROZEN_VERSION and the session's arm, in the plain and the streaming path, while the session's
other requests go where the router sends them; the router's loaded-version check is never asked about a frozen call.
Against stand-ins for two vLLM servers (the same path with real servers: tests/integration/test_swarm_loop.py)."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from typing import Any

from flywheel.base.versions import FROZEN_VERSION
from flywheel.ingest import schema, wire
from flywheel.ingest.sdk import SessionLogger
from flywheel.ingest.spool import Spool
from flywheel.serving.proxy import CaptureProxy, ProxyConfig, Routed, make_app

PROMPT_IDS, IDS, LOGPROBS = [1, 2, 3], [7, 8], [-0.5, -0.25]


def _server(name: str, seen: list[tuple[str, str]]) -> Any:
    """A chat route that records (its name, the model asked for) and answers with ids and logprobs."""
    from aiohttp import web

    async def chat(request: Any) -> Any:
        body = await request.json()
        seen.append((name, body["model"]))
        if not body.get("stream"):
            return web.json_response({"id": "c1", "object": "chat.completion", "model": body["model"],
                                      "prompt_token_ids": PROMPT_IDS, "choices": [{
                                          "index": 0, "finish_reason": "stop", "token_ids": IDS,
                                          "message": {"role": "assistant", "content": "ok"},
                                          "logprobs": {"content": [{"token": "t", "logprob": x} for x in LOGPROBS]}}]})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for i, (tid, lp) in enumerate(zip(IDS, LOGPROBS)):
            chunk = {"id": "c1", "object": "chat.completion.chunk", "model": body["model"],
                     "choices": [{"index": 0, "delta": {"content": "o" if i == 0 else "k"}, "token_ids": [tid],
                                  "logprobs": {"content": [{"token": "t", "logprob": lp}]},
                                  "finish_reason": "stop" if i == len(IDS) - 1 else None}]}
            if i == 0:
                chunk["prompt_token_ids"] = PROMPT_IDS
            await out.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await out.write(b"data: [DONE]\n\n")
        return out

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return app


def _dead_bootstrap() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def test_a_frozen_models_calls_go_to_its_server_logged_off_the_line_in_the_sessions_arm(tmp_path: Path) -> None:
    from aiohttp.test_utils import TestClient, TestServer

    seen: list[tuple[str, str]] = []
    version_reads: list[str] = []

    async def scenario() -> None:
        async with TestServer(_server("policy", seen)) as policy, TestServer(_server("frozen", seen)) as frozen:
            policy_url, frozen_url = (str(s.make_url("")).rstrip("/") for s in (policy, frozen))

            def route(session_id: str) -> Routed:  # a full-weight tier: the server's loaded version is read
                return Routed("policy-v2", 2, policy_url, lambda: version_reads.append(session_id) or 2, "challenger")

            logger = SessionLogger(_dead_bootstrap(), name="f", spool_dir=tmp_path / "spool", linger_s=0.01)
            cfg = ProxyConfig(upstream=policy_url, heartbeat_s=0, frozen_models=f"subagent={frozen_url}")
            async with TestClient(TestServer(make_app(CaptureProxy(cfg, logger, route)))) as client:
                for model, agent, stream in [("policy", "main", False), ("subagent", "main.0", False),
                                             ("subagent", "main.1", True), ("policy", "main", True)]:
                    headers = {"X-Flywheel-Session-Id": "s1", "X-Flywheel-Agent-Id": agent}
                    if agent != "main":
                        headers["X-Flywheel-Parent-Agent-Id"] = "main"
                    resp = await client.post("/v1/chat/completions", headers=headers, json={
                        "model": model, "messages": [{"role": "user", "content": "hi"}], "stream": stream})
                    assert resp.status == 200, await resp.text()
                    await resp.read()
            logger.close(timeout=5)

    asyncio.run(scenario())
    assert seen == [("policy", "policy-v2"), ("frozen", "subagent"), ("frozen", "subagent"), ("policy", "policy-v2")]
    assert len(version_reads) == 4, "the policy's two calls read the loaded version before and after, the frozen none"
    spool = Spool(tmp_path / "spool")
    events = [wire.as_lists(wire.decode(r)) for r in spool.peek(10_000)]
    spool.close()
    for event in events:
        schema.validate_event(event)
    calls = [(e["agent_id"], e["model"], e["policy_version"], e["arm"], e["completion_token_ids"])
             for e in events if e["type"] == "llm_call"]
    assert calls == [("main", "policy-v2", 2, "challenger", IDS), ("main.0", "subagent", FROZEN_VERSION, "challenger", IDS),
                     ("main.1", "subagent", FROZEN_VERSION, "challenger", IDS), ("main", "policy-v2", 2, "challenger", IDS)]
