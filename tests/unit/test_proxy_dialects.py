"""Anthropic Messages and OpenAI Responses on the capture proxy: the translation to chat completions and back
(serving/dialects.py), and the official `anthropic` and `openai` clients through the proxy against a stand-in for
vLLM's chat route (the same routes with the real vLLM: tests/integration/test_proxy.py). Each reply is one
llm_call with the ids and logprobs upstream returned; the clients read text, tool calls, stop reasons and usage
as their APIs give them."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from flywheel.ingest import schema, wire
from flywheel.ingest.sdk import SessionLogger
from flywheel.ingest.spool import Spool
from flywheel.serving import dialects
from flywheel.serving.proxy import CaptureProxy, ProxyConfig, make_app, static_route
from tests.unit.test_sdk import dead_address

SECRET = "sk-ant-test-secret-0123456789"


def test_a_tool_use_conversation_becomes_the_chat_messages_vllm_renders() -> None:
    body = {
        "model": "claude-x", "max_tokens": 64, "temperature": 0.5, "stop_sequences": ["\n\n"],
        "system": [{"type": "text", "text": "You call tools."}],
        "tools": [{"name": "weather", "description": "the sky", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "tool", "name": "weather"},
        "messages": [
            {"role": "user", "content": "weather in oslo"},
            {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                              {"type": "tool_use", "id": "toolu_1", "name": "weather",
                                               "input": {"city": "oslo"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": [{"type": "text", "text": "cloudy 12C"}]},
                                         {"type": "text", "text": "and?"}]},
        ],
    }
    chat = dialects.messages_request(body)
    assert chat["messages"] == [
        {"role": "system", "content": "You call tools."},
        {"role": "user", "content": "weather in oslo"},
        {"role": "assistant", "content": "Let me look.",
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "weather", "arguments": '{"city": "oslo"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "cloudy 12C"},
        {"role": "user", "content": "and?"},
    ]
    assert chat["tools"] == [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"},
                                                               "description": "the sky"}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    assert (chat["max_tokens"], chat["temperature"], chat["stop"]) == (64, 0.5, ["\n\n"])
    assert "stream" not in chat
    streamed = dialects.messages_request({**body, "stream": True})
    assert streamed["stream"] is True and streamed["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize(("body", "says"), [
    ({"max_tokens": 8}, "messages: expected a non-empty list"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens: required"),
    ({"max_tokens": 8, "messages": [{"role": "system", "content": "hi"}]}, "role user or assistant"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "'image' block in a user message cannot be translated"),
    ({"max_tokens": 8, "messages": [{"role": "assistant", "content": [{"type": "tool_result"}]}]},
     "'tool_result' block in a assistant message"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "tool"}},
     "tool_choice"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "system": [{"type": "image"}]},
     "system: only text blocks"),
])
def test_a_request_that_cannot_be_translated_says_what_is_wrong(body: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError, match=says.replace("(", r"\(")):
        dialects.messages_request(body)


def test_a_reply_with_text_and_a_tool_call_becomes_blocks_and_a_stop_sequence_is_named() -> None:
    payload = {"id": "chatcmpl-9", "usage": {"prompt_tokens": 5, "completion_tokens": 3}, "choices": [{
        "index": 0, "finish_reason": "tool_calls",
        "message": {"role": "assistant", "content": "ok",
                    "tool_calls": [{"id": "call_1", "type": "function",
                                    "function": {"name": "add", "arguments": '{"a": 1}'}}]}}]}
    reply = dialects.messages_reply(payload, "claude-x", [])
    assert reply["content"] == [{"type": "text", "text": "ok"},
                                {"type": "tool_use", "id": "call_1", "name": "add", "input": {"a": 1}}]
    assert (reply["stop_reason"], reply["usage"]) == ("tool_use", {"input_tokens": 5, "output_tokens": 3})
    assert reply["id"] == "msg_chatcmpl-9" and reply["model"] == "claude-x"
    stopped = {"choices": [{"index": 0, "finish_reason": "stop", "stop_reason": "END",
                            "message": {"role": "assistant", "content": "x"}}]}
    assert (dialects.messages_reply(stopped, "m", ["END"])["stop_reason"],
            dialects.messages_reply(stopped, "m", ["END"])["stop_sequence"]) == ("stop_sequence", "END")
    # a tool named in tool_choice: vLLM finishes with "stop", and the reply still stopped for the tool
    named = {"choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "",
                                                                          "tool_calls": payload["choices"][0][
                                                                              "message"]["tool_calls"]}}]}
    assert dialects.messages_reply(named, "m", [])["stop_reason"] == "tool_use"
    stream = dialects.MessagesStream("m", [])
    stream.feed({"id": "c", "choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "id": "call_1", "function": {"name": "add", "arguments": '{"a": 1}'}}]}}]})
    stream.feed({"id": "c", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    assert b'"stop_reason":"tool_use"' in b"".join(stream.finish())
    broken = {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {"tool_calls": [
        {"id": "c", "function": {"name": "add", "arguments": '{"a": '}}]}}]}
    assert dialects.messages_reply(broken, "m", [])["content"][0]["input"] == {"_unparsed_arguments": '{"a": '}


# ---------------------------------------------------------------- through the proxy, with the anthropic client

PROMPT_IDS = [1, 2, 3, 4]
TEXT_IDS, TEXT_LOGPROBS, TEXT = [11, 12, 13], [-0.5, -0.25, -0.125], ["Clou", "dy ", "12C"]
TOOL_IDS, TOOL_LOGPROBS = [21, 22], [-1.0, -0.75]


def _upstream(seen: list[dict[str, Any]]) -> Any:
    """vLLM's chat route as the proxy calls it: token ids and logprobs on, a text or a tool-call reply."""
    from aiohttp import web

    async def chat(request: Any) -> Any:
        body = await request.json()
        seen.append({"body": body, "authorization": request.headers.get("Authorization")})
        tool = bool(body.get("tools"))
        ids, logprobs = (TOOL_IDS, TOOL_LOGPROBS) if tool else (TEXT_IDS, TEXT_LOGPROBS)
        usage = {"prompt_tokens": len(PROMPT_IDS), "completion_tokens": len(ids), "total_tokens": 0}
        finish = "tool_calls" if tool else "stop"
        call = {"id": "call_7", "type": "function", "function": {"name": "weather", "arguments": '{"city": "oslo"}'}}
        if not body.get("stream"):
            message = ({"role": "assistant", "content": None, "tool_calls": [call]} if tool
                       else {"role": "assistant", "content": "".join(TEXT)})
            return web.json_response({"id": "chatcmpl-1", "object": "chat.completion", "model": body["model"],
                                      "prompt_token_ids": PROMPT_IDS, "usage": usage, "choices": [{
                                          "index": 0, "message": message, "finish_reason": finish,
                                          "token_ids": ids, "logprobs": {"content": [
                                              {"token": "t", "logprob": x} for x in logprobs]}}]})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        deltas: list[dict[str, Any]] = (
            [{"tool_calls": [{"index": 0, "id": "call_7", "type": "function",
                              "function": {"name": "weather", "arguments": '{"city": '}}]},
             {"tool_calls": [{"index": 0, "function": {"arguments": '"oslo"}'}}]}] if tool
            else [{"role": "assistant", "content": t} for t in TEXT])
        for i, delta in enumerate(deltas):
            chunk: dict[str, Any] = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": body["model"],
                                     "choices": [{"index": 0, "delta": delta, "token_ids": [ids[i]],
                                                  "logprobs": {"content": [{"token": "t", "logprob": logprobs[i]}]},
                                                  "finish_reason": finish if i == len(deltas) - 1 else None}]}
            if i == 0:
                chunk["prompt_token_ids"] = PROMPT_IDS
            if tool and i == len(deltas) - 1:  # the ids of a streamed tool call may trail its last delta
                chunk["choices"][0]["token_ids"] = ids[i:]
                chunk["choices"][0]["logprobs"]["content"] = [{"token": "t", "logprob": x} for x in logprobs[i:]]
            await out.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await out.write(f"data: {json.dumps({'id': 'chatcmpl-1', 'choices': [], 'usage': usage})}\n\n".encode())
        await out.write(b"data: [DONE]\n\n")
        return out

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return app


def _all(spool_dir: Path) -> list[dict[str, Any]]:
    spool = Spool(spool_dir)
    events = [wire.decode(r) for r in spool.peek(10_000)]
    spool.close()
    for event in events:
        schema.validate_event(event)
    return [wire.as_lists(event) for event in events]


def _logged(spool_dir: Path) -> list[dict[str, Any]]:
    return [event for event in _all(spool_dir) if event["type"] == "llm_call"]


def test_the_anthropic_client_gets_messages_and_streams_and_each_call_is_logged(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from aiohttp.test_utils import TestServer
    from anthropic import AsyncAnthropic

    seen: list[dict[str, Any]] = []
    weather = [{"name": "weather", "description": "the sky", "input_schema": {
        "type": "object", "properties": {"city": {"type": "string"}}}}]

    async def scenario() -> list[Any]:
        async with TestServer(_upstream(seen)) as upstream:
            logger = SessionLogger(dead_address(), name="m", spool_dir=tmp_path / "spool", linger_s=0.01)
            proxy = CaptureProxy(ProxyConfig(upstream=str(upstream.make_url("")).rstrip("/"), heartbeat_s=0),
                                 logger, static_route("policy-v3", 3))
            async with TestServer(make_app(proxy)) as server:
                client = AsyncAnthropic(base_url=str(server.make_url("")).rstrip("/"), api_key=SECRET,
                                        default_headers={"X-Flywheel-Session-Id": "sess-1"}, max_retries=0)
                ask = [{"role": "user", "content": "weather in oslo"}]
                whole = await client.messages.create(model="claude-x", max_tokens=16, messages=ask)
                tool = await client.messages.create(model="claude-x", max_tokens=16, messages=ask, tools=weather)
                async with client.messages.stream(model="claude-x", max_tokens=16, messages=ask) as stream:
                    streamed_text = "".join([t async for t in stream.text_stream])
                    streamed = await stream.get_final_message()
                async with client.messages.stream(model="claude-x", max_tokens=16, messages=ask,
                                                  tools=weather) as stream:
                    streamed_tool = await stream.get_final_message()
                await client.close()
            logger.close(timeout=5)
        return [whole, tool, streamed_text, streamed, streamed_tool]

    with caplog.at_level("DEBUG"):
        whole, tool, streamed_text, streamed, streamed_tool = asyncio.run(scenario())
    text = "".join(TEXT)
    assert [b.type for b in whole.content] == ["text"] and whole.content[0].text == text
    assert whole.model == "claude-x" and whole.stop_reason == "end_turn"
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (len(PROMPT_IDS), len(TEXT_IDS))
    assert [b.type for b in tool.content] == ["tool_use"] and tool.stop_reason == "tool_use"
    assert (tool.content[0].name, tool.content[0].input, tool.content[0].id) == ("weather", {"city": "oslo"}, "call_7")
    assert streamed_text == text and streamed.content[0].text == text and streamed.stop_reason == "end_turn"
    assert (streamed.usage.input_tokens, streamed.usage.output_tokens) == (len(PROMPT_IDS), len(TEXT_IDS))
    assert streamed_tool.content[0].type == "tool_use" and streamed_tool.content[0].input == {"city": "oslo"}
    assert streamed_tool.stop_reason == "tool_use"

    # the upstream saw chat requests with the routed model, ids and logprobs on, the key as a bearer token
    assert len(seen) == 4 and all(s["body"]["model"] == "policy-v3" and s["body"]["return_token_ids"]
                                  and s["body"]["logprobs"] is True for s in seen)
    assert all(s["authorization"] == f"Bearer {SECRET}" for s in seen)
    calls = _logged(tmp_path / "spool")
    assert len(calls) == 4, [c["completion_token_ids"] for c in calls]
    for call, (ids, logprobs) in zip(calls, [(TEXT_IDS, TEXT_LOGPROBS), (TOOL_IDS, TOOL_LOGPROBS)] * 2):
        assert call["session_id"] == "sess-1" and call["policy_version"] == 3
        assert call["prompt_token_ids"] == PROMPT_IDS and call["completion_token_ids"] == ids
        assert call["completion_logprobs"] == pytest.approx(logprobs)
    assert calls[0]["completion_text"] == text and calls[2]["completion_text"] == text
    records = "".join(json.dumps(c) for c in calls) + caplog.text
    assert SECRET not in records, "the client's key reached a record or a log"


def _posted_to_a_dead_upstream(tmp_path: Path, route: str, bodies: list[bytes],
                                headers: dict[str, str]) -> list[tuple[int, dict[str, Any]]]:
    """(status, JSON body) of each body POSTed to the proxy's route with no vLLM behind it, then GET /health's."""
    from aiohttp.test_utils import TestClient, TestServer

    async def scenario() -> list[tuple[int, dict[str, Any]]]:
        logger = SessionLogger(dead_address(), name="b", spool_dir=tmp_path / "spool")
        proxy = CaptureProxy(ProxyConfig(upstream=f"http://{dead_address()}", heartbeat_s=0), logger,
                             static_route("policy-v0", 0))
        out = []
        async with TestClient(TestServer(make_app(proxy))) as client:
            for body in bodies:
                resp = await client.post(route, data=body, headers=headers)
                out.append((resp.status, await resp.json()))
            out.append(((await client.get("/health")).status, {}))
        logger.close(timeout=1)
        return out

    return asyncio.run(scenario())


def test_bad_messages_bodies_get_an_anthropic_error_and_the_proxy_stays_up(tmp_path: Path) -> None:
    results = _posted_to_a_dead_upstream(tmp_path, "/v1/messages", [
        b"{not json", b"[1]", json.dumps({"model": "m", "max_tokens": 4}).encode(),
        json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]}).encode(),
        json.dumps({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}).encode()],
        {"X-Flywheel-Session-Id": "s"})
    assert [status for status, _ in results] == [400, 400, 400, 400, 502, 200], results
    for status, body in results[:5]:
        assert body["type"] == "error" and body["error"]["message"], body
    assert [body["error"]["type"] for _, body in results[:5]] == ["invalid_request_error"] * 4 + ["api_error"]
    assert "messages: expected a non-empty list" in results[2][1]["error"]["message"]
    assert "max_tokens: required" in results[3][1]["error"]["message"]
    assert "unavailable" in results[4][1]["error"]["message"]


# ---------------------------------------------------------------- OpenAI Responses

def test_responses_input_items_and_history_become_chat_messages() -> None:
    history = [{"role": "user", "content": "weather in oslo"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]}]
    body = {"model": "m", "instructions": "Be brief.", "max_output_tokens": 32, "temperature": 0.2,
            "tools": [{"type": "function", "name": "weather", "parameters": {"type": "object"}, "strict": True}],
            "tool_choice": {"type": "function", "name": "weather"},
            "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
            "input": [{"type": "function_call_output", "call_id": "call_1", "output": "cloudy 12C"},
                      {"role": "developer", "content": [{"type": "input_text", "text": "Say it."}]},
                      {"type": "function_call", "call_id": "call_2", "name": "tz", "arguments": "{}"},
                      {"type": "function_call", "call_id": "call_3", "name": "tz", "arguments": "{}"}]}
    chat = dialects.responses_request(body, history)
    assert chat["messages"][0] == {"role": "system", "content": "Be brief."}
    assert chat["messages"][1:3] == history
    assert chat["messages"][3] == {"role": "tool", "tool_call_id": "call_1", "content": "cloudy 12C"}
    assert chat["messages"][4] == {"role": "system", "content": "Say it."}
    assert [c["id"] for c in chat["messages"][5]["tool_calls"]] == ["call_2", "call_3"], "one assistant turn"
    assert chat["tools"] == [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"},
                                                               "strict": True}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    assert (chat["max_tokens"], chat["temperature"]) == (32, 0.2)
    assert chat["response_format"]["json_schema"]["name"] == "w"
    assert dialects.responses_request({"input": "hi"}, [])["messages"] == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("body", "says"), [
    ({}, "input: expected text or a non-empty list"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "'input_image' item cannot be translated"),
    ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "'input_file' part cannot be translated"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "only function tools"),
    ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "needs a call_id and a name"),
])
def test_a_responses_request_that_cannot_be_translated_says_what_is_wrong(body: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        dialects.responses_request(body, [])


def test_the_openai_client_gets_responses_streams_and_follow_ups_in_one_session(tmp_path: Path) -> None:
    from aiohttp.test_utils import TestServer
    from openai import AsyncOpenAI, NotFoundError

    seen: list[dict[str, Any]] = []
    tools = [{"type": "function", "name": "weather", "parameters": {"type": "object",
                                                                    "properties": {"city": {"type": "string"}}}}]

    async def scenario() -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with TestServer(_upstream(seen)) as upstream:
            logger = SessionLogger(dead_address(), name="r", spool_dir=tmp_path / "spool", linger_s=0.01)
            proxy = CaptureProxy(ProxyConfig(upstream=str(upstream.make_url("")).rstrip("/"), heartbeat_s=0),
                                 logger, static_route("policy-v3", 3))
            async with TestServer(make_app(proxy)) as server:
                client = AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key=SECRET, max_retries=0)
                out["call"] = first = await client.responses.create(model="agent", input="weather in oslo",
                                                                    tools=tools, instructions="Use tools.")
                call = next(item for item in first.output if item.type == "function_call")
                out["answer"] = await client.responses.create(
                    model="agent", previous_response_id=first.id,
                    input=[{"type": "function_call_output", "call_id": call.call_id, "output": "cloudy 12C"}])
                events = await client.responses.create(model="agent", input="hi", stream=True)
                out["events"] = [e async for e in events]
                async with client.responses.stream(model="agent", input="weather?", tools=tools) as stream:
                    out["streamed_tool"] = await stream.get_final_response()
                try:
                    await client.responses.create(model="agent", input="x", previous_response_id="resp_unknown")
                except NotFoundError as exc:
                    out["missing"] = exc
                await client.close()
            out["open_sessions"] = dict(proxy.sessions)
            logger.close(timeout=5)
        return out

    out = asyncio.run(scenario())
    first, answer = out["call"], out["answer"]
    assert [item.type for item in first.output] == ["function_call"] and first.status == "completed"
    assert (first.output[0].name, json.loads(first.output[0].arguments)) == ("weather", {"city": "oslo"})
    assert (first.usage.input_tokens, first.usage.output_tokens) == (len(PROMPT_IDS), len(TOOL_IDS))
    assert answer.output_text == "".join(TEXT) and answer.previous_response_id == first.id
    # the follow-up carried the conversation (not its instructions) to the model
    sent = seen[1]["body"]["messages"]
    assert sent[0] == {"role": "user", "content": "weather in oslo"}
    assert sent[1]["tool_calls"][0]["id"] == first.output[0].call_id
    assert sent[2] == {"role": "tool", "tool_call_id": first.output[0].call_id, "content": "cloudy 12C"}
    assert all(m["role"] != "system" for m in sent), "instructions are not carried over by previous_response_id"

    kinds = [e.type for e in out["events"]]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "".join(e.delta for e in out["events"] if e.type == "response.output_text.delta") == "".join(TEXT)
    assert [e.sequence_number for e in out["events"]] == list(range(len(kinds)))
    assert out["events"][-1].response.usage.output_tokens == len(TEXT_IDS)
    streamed_tool = out["streamed_tool"]
    assert streamed_tool.output[0].type == "function_call"
    assert json.loads(streamed_tool.output[0].arguments) == {"city": "oslo"}
    assert "not known to this proxy" in str(out["missing"])

    calls = _logged(tmp_path / "spool")
    assert len(calls) == 4
    assert calls[0]["session_id"] == calls[1]["session_id"], "a previous_response_id chain is one session"
    assert len({c["session_id"] for c in calls}) == 3 and all(c["session_id"].startswith("resp-") for c in calls)
    assert [c["completion_token_ids"] for c in calls] == [TOOL_IDS, TEXT_IDS, TEXT_IDS, TOOL_IDS]
    assert [c["request_id"] for c in calls[:2]] == [out["call"].id, out["answer"].id], \
        "a Responses call is logged under the id its client got, the one previous_response_id names"
    starts = [e for e in _all(tmp_path / "spool") if e["type"] == "session_start"]
    assert sorted(e["session_id"] for e in starts) == sorted({c["session_id"] for c in calls}), \
        "the proxy starts each session it opened, once"
    assert all(s.owned for s in out["open_sessions"].values()), "the idle timeout will end them"


def test_bad_responses_bodies_get_an_openai_error_and_the_proxy_stays_up(tmp_path: Path) -> None:
    results = _posted_to_a_dead_upstream(tmp_path, "/v1/responses", [
        b"{not json", b"[1]", json.dumps({"model": "m"}).encode(),
        json.dumps({"model": "m", "input": [{"type": "input_image"}]}).encode(),
        json.dumps({"model": "m", "input": "x", "previous_response_id": "resp_x"}).encode(),
        json.dumps({"model": "m", "input": "x"}).encode()], {})
    assert [status for status, _ in results] == [400, 400, 400, 400, 404, 502, 200], results
    for _, body in results[:6]:
        assert body["error"]["message"], body
    assert "input: expected text" in results[2][1]["error"]["message"]
    assert "not known to this proxy" in results[4][1]["error"]["message"]
