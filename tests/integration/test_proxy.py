"""The capture proxy against the real vLLM server and Kafka broker.

An official `openai` client pointed at the proxy gets what it gets from vLLM directly, and the
llm_call events in Kafka carry token ids that decode to that text, one logprob per token, and
the routed policy version.
"""

from __future__ import annotations

import array
import json
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from flywheel.ingest import schema, wire

openai = pytest.importorskip("openai")
REPO = Path(__file__).resolve().parents[2]
SECRET = "sk-test-" + uuid.uuid4().hex  # the agent's API key: must reach nothing but vLLM


def _stop_proxy(proc: subprocess.Popen, log_path: Path) -> None:
    proc.terminate()
    code = proc.wait(timeout=30)
    assert code == 0, f"proxy exited {code} on SIGTERM: {log_path.read_text()[-2000:]}"


@pytest.fixture(scope="module")
def proxy(kafka_bootstrap: str, vllm_url: str, tmp_path_factory: pytest.TempPathFactory,
          start_proxy: Any) -> Iterator[dict[str, Any]]:
    from kafka.admin import KafkaAdminClient, NewTopic

    topic = f"test.proxy.{uuid.uuid4().hex[:10]}"
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap, client_id="tests")
    admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])
    log_path = tmp_path_factory.mktemp("proxy") / "proxy.log"
    proc, url = start_proxy(["--upstream", vllm_url, "--kafka-bootstrap", kafka_bootstrap, "--events-topic", topic,
                              "--idle-timeout-s", "2", "--spool-name", f"test-proxy-{uuid.uuid4().hex[:8]}"], log_path)
    yield {"url": url, "topic": topic, "proc": proc, "log": log_path}
    _stop_proxy(proc, log_path)
    admin.delete_topics([topic])
    admin.close()


def _client(base: str) -> Any:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=SECRET, max_retries=0)


def _matching(kafka_bootstrap: str, topic: str, keep: Callable[[dict], bool], want: int,
              timeout_s: float = 20.0) -> list[dict]:
    """The topic's events `keep` selects, in the topic's order, waiting until at least `want` arrived; no record of
    the topic holds the agent's secret."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=kafka_bootstrap, consumer_timeout_ms=500, client_id="tests")
    tp = TopicPartition(topic, 0)
    consumer.assign([tp])
    consumer.seek_to_beginning(tp)
    raw: list[bytes] = []
    found: list[dict] = []
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        raw += [m.value for m in consumer]
        found = [e for e in (wire.as_lists(wire.decode(r)) for r in raw) if keep(e)]  # v3: packed lists
        if len(found) >= want:
            break
    consumer.close()
    assert all(SECRET.encode() not in r for r in raw), "the Authorization key reached Kafka"
    return found


def _events(kafka_bootstrap: str, topic: str, session_id: str, want: int, timeout_s: float = 20.0) -> list[dict]:
    """Every event of one session, waiting until at least `want` arrived."""
    return _matching(kafka_bootstrap, topic, lambda e: e["session_id"] == session_id, want, timeout_s)


def _calls(kafka_bootstrap: str, topic: str, want: int, keep: Callable[[dict], bool]) -> list[dict]:
    """The llm_calls `keep` selects, oldest first, waiting until `want` of them arrived."""
    found = _matching(kafka_bootstrap, topic, lambda e: e["type"] == "llm_call" and keep(e), want)
    return sorted(found, key=lambda e: e["ts"])


MESSAGES = [{"role": "user", "content": "Name a prime number."}]


def _visible(text: str | None) -> str:
    return (text or "").replace("\ufffd", "")


def test_chat_matches_vllm_and_logged_tokens_decode_to_the_text(proxy: dict, vllm_url: str, kafka_bootstrap: str,
                                                                 base_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    session = f"s-{uuid.uuid4().hex}"
    headers = {"X-Flywheel-Session-Id": session}
    args = dict(model="my-agent-model", messages=MESSAGES, temperature=0, max_tokens=24)
    direct = _client(vllm_url).chat.completions.create(**{**args, "model": "policy-v0"})
    via = _client(proxy["url"]).chat.completions.create(**args, extra_headers=headers)
    stream = _client(proxy["url"]).chat.completions.create(**args, stream=True, extra_headers=headers)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    assert via.choices[0].message.content == direct.choices[0].message.content
    assert streamed == direct.choices[0].message.content
    assert via.model == "my-agent-model", "the reply must show the agent's own model name"
    dumped = via.model_dump()
    assert dumped["choices"][0]["logprobs"] is None and dumped.get("prompt_token_ids") is None, "unrequested extras leaked"

    events = [e for e in _events(kafka_bootstrap, proxy["topic"], session, 2) if e["type"] == "llm_call"]
    assert len(events) == 2, f"expected one llm_call per request, got {len(events)}"
    tok = AutoTokenizer.from_pretrained(str(base_model_dir))
    prompt_ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    prompt_ids = list(prompt_ids["input_ids"] if isinstance(prompt_ids, dict) or hasattr(prompt_ids, "keys") else prompt_ids)
    for event in events:
        schema.validate_event(event)
        assert event["model"] == "policy-v0" and event["policy_version"] == 0
        text = tok.decode(event["completion_token_ids"], skip_special_tokens=True)
        # vLLM's incremental detokenizer holds back byte tokens that never complete a UTF-8 character;
        # a plain decode shows them as U+FFFD. Every other character must match.
        assert _visible(text) == _visible(direct.choices[0].message.content), f"logged tokens decode to {text!r}"
        assert len(event["completion_logprobs"]) == len(event["completion_token_ids"]) > 0
        assert all(lp <= 0 for lp in event["completion_logprobs"])
        assert event["prompt_token_ids"] == prompt_ids
        assert event["sampling"]["temperature"] == 0 and event["sampling"]["max_tokens"] == 24


def test_requested_logprobs_completions_and_n_choices(proxy: dict, kafka_bootstrap: str) -> None:
    session = f"s-{uuid.uuid4().hex}"
    headers = {"X-Flywheel-Session-Id": session}
    client = _client(proxy["url"])
    chat = client.chat.completions.create(model="m", messages=MESSAGES, temperature=1.0, max_tokens=8, logprobs=True,
                                          top_logprobs=2, n=2, seed=7, extra_headers=headers)
    comp = client.completions.create(model="m", prompt="def add(a, b):", temperature=0, max_tokens=8,
                                     extra_headers=headers)
    assert all(c.logprobs is not None and len(c.logprobs.content[0].top_logprobs) == 2 for c in chat.choices)
    events = [e for e in _events(kafka_bootstrap, proxy["topic"], session, 3) if e["type"] == "llm_call"]
    assert len(events) == 3, f"2 chat choices + 1 completion should give 3 llm_calls, got {len(events)}"
    chat_events = [e for e in events if e["request_id"] == chat.id]
    comp_events = [e for e in events if e["request_id"] == comp.id]
    assert len(chat_events) == 2 and len(comp_events) == 1, [e["request_id"] for e in events]
    assert chat_events[0]["group_id"] == chat_events[1]["group_id"] == chat.id, "n>1 choices share a group"
    served = sorted([c.logprob for c in ch.logprobs.content] for ch in chat.choices)
    served = sorted(list(array.array("f", lps)) for lps in served)  # v3 sends float32, the lake's column type
    assert sorted(e["completion_logprobs"] for e in chat_events) == served, "logged logprobs differ from the served ones"
    assert comp_events[0]["completion_text"] == comp.choices[0].text
    assert comp.choices[0].logprobs is None


def test_session_headers_idle_timeout_and_unlogged_requests(proxy: dict, kafka_bootstrap: str) -> None:
    client = _client(proxy["url"])
    ended, idle = f"s-{uuid.uuid4().hex}", f"s-{uuid.uuid4().hex}"
    args = dict(model="m", messages=MESSAGES, temperature=0, max_tokens=4)
    client.chat.completions.create(**args, extra_headers={"X-Flywheel-Session-Id": ended, "X-Flywheel-Session-Event": "start",
                                                          "X-Flywheel-Task-Type": "qa", "X-Flywheel-Agent-Id": "a1"})
    client.chat.completions.create(**args, extra_headers={"X-Flywheel-Session-Id": ended, "X-Flywheel-Session-Event": "end"})
    client.chat.completions.create(**args, extra_headers={"X-Flywheel-Session-Id": idle, "X-Flywheel-Session-Event": "start"})
    before = json.loads(urllib.request.urlopen(f"{proxy['url']}/stats").read())
    client.chat.completions.create(**args)  # no session id: forwarded, not logged
    after = json.loads(urllib.request.urlopen(f"{proxy['url']}/stats").read())
    assert after["unlogged_no_session"] == before["unlogged_no_session"] + 1
    assert after["logged_calls"] == before["logged_calls"]

    types = [e["type"] for e in _events(kafka_bootstrap, proxy["topic"], ended, 4)]
    assert types == ["session_start", "llm_call", "llm_call", "session_end"], types
    idle_events = _events(kafka_bootstrap, proxy["topic"], idle, 3, timeout_s=30)  # idle timeout is 2 s
    assert [e["type"] for e in idle_events] == ["session_start", "llm_call", "session_end"]
    assert idle_events[-1]["status"] == "idle_timeout"


def test_bad_requests_get_clear_errors_and_the_proxy_keeps_working(proxy: dict) -> None:
    request = urllib.request.Request(f"{proxy['url']}/v1/chat/completions", data=b"{not json",
                                     headers={"Content-Type": "application/json"}, method="POST")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request)
    assert info.value.code == 400 and "not valid JSON" in info.value.read().decode()
    with pytest.raises(openai.BadRequestError):  # vLLM's own validation error is passed through unchanged
        _client(proxy["url"]).chat.completions.create(model="m", messages=MESSAGES, max_tokens=-5)
    ok = _client(proxy["url"]).chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
    assert ok.choices[0].message is not None
    assert "policy-v0" in [m.id for m in _client(proxy["url"]).models.list().data]


def test_serving_router_logs_the_version_the_server_holds(kafka_bootstrap: str, vllm_url: str, new_topic: Any,
                                                          tmp_path: Path, vllm_weights_lock: None, start_proxy: Any) -> None:
    """--router serving: an empty registry means the base model; the logged version is what vLLM reports."""
    from flywheel.serving.vllm_client import weight_version

    topic = new_topic("proxy-router")
    env = {"FLYWHEEL_REGISTERED_MODEL": f"test-proxy-{uuid.uuid4().hex[:8]}", "FLYWHEEL_SERVERS": vllm_url}
    proc, url = start_proxy(["--router", "serving", "--kafka-bootstrap", kafka_bootstrap, "--events-topic", topic,
                              "--spool-name", f"test-proxy-r-{uuid.uuid4().hex[:8]}"], tmp_path / "proxy.log", env)
    try:
        session = f"s-{uuid.uuid4().hex}"
        reply = _client(url).chat.completions.create(model="m", messages=MESSAGES, max_tokens=4,
                                                     extra_headers={"X-Flywheel-Session-Id": session})
        assert reply.model == "m"
        held = weight_version(vllm_url)
        events = [e for e in _events(kafka_bootstrap, topic, session, 1) if e["type"] == "llm_call"]
        assert len(events) == 1 and events[0]["policy_version"] == held and events[0]["model"] == "policy-v0", events
    finally:
        _stop_proxy(proc, tmp_path / "proxy.log")


def test_a_call_during_which_vllm_reloads_its_weights_is_logged_with_both_versions(
        kafka_bootstrap: str, vllm_url: str, base_model_dir: Path, new_topic: Any, tmp_path: Path,
        vllm_weights_lock: None, start_proxy: Any) -> None:
    """A real in-place weight reload (vLLM's reload_weights, then the new version recorded) while a long streamed call
    is being generated: the call is still logged, with policy_version the version before and policy_version_alt the
    one after, and counted; the lake keeps both (the learner's rule for such rows, staleness from the older version,
    is tests/unit/test_episodes.py's). The publisher's own path pauses first (mode=wait), so there a call straddles
    only when its end and the reload race; this drives the reload into the middle of the call on purpose."""
    from flywheel.ingest import lake
    from flywheel.ingest.lake_writer import LakeWriterConfig
    from flywheel.serving import vllm_client
    from flywheel.serving.publisher import reload_full
    from tests.integration.test_lake_writer import run_until

    topic, outcomes, dlq = new_topic("proxy-straddle"), new_topic("straddle-out"), new_topic("straddle-dlq")
    held = vllm_client.weight_version(vllm_url)
    assert held is not None
    env = {"FLYWHEEL_REGISTERED_MODEL": f"test-proxy-{uuid.uuid4().hex[:8]}", "FLYWHEEL_SERVERS": vllm_url}
    proc, url = start_proxy(["--router", "serving", "--kafka-bootstrap", kafka_bootstrap, "--events-topic", topic,
                              "--spool-name", f"test-proxy-s-{uuid.uuid4().hex[:8]}"], tmp_path / "proxy.log", env)
    session = f"s-{uuid.uuid4().hex}"
    try:
        # ~1,900 tokens without stopping at eos: seconds of decoding, longer than the reload
        stream = _client(url).chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=1900, temperature=1.0, stream=True,
            extra_body={"ignore_eos": True}, extra_headers={"X-Flywheel-Session-Id": session})
        chunks = iter(stream)
        first = next(chunks)
        vllm_client.reload_weights(vllm_url, base_model_dir)  # the same weights, really reloaded
        vllm_client.update_weight_version(vllm_url, held + 7)
        text = (first.choices[0].delta.content or "") + "".join(c.choices[0].delta.content or "" for c in chunks
                                                                 if c.choices)
        assert text
        deadline = time.time() + 30  # the proxy logs after the stream's end (its second version read): not at once
        while True:
            stats = json.loads(urllib.request.urlopen(f"{url}/stats").read())
            if stats["logged_calls"] + stats["version_unknown"] >= 1 or time.time() > deadline:
                break
            time.sleep(0.2)
        assert stats["version_straddled"] == 1 and stats["logged_calls"] == 1, stats
    finally:
        try:
            _stop_proxy(proc, tmp_path / "proxy.log")
        finally:
            reload_full(vllm_url, base_model_dir, held)
    (event,) = [e for e in _events(kafka_bootstrap, topic, session, 1) if e["type"] == "llm_call"]
    assert (event["policy_version"], event["policy_version_alt"]) == (held, held + 7), event
    assert len(event["completion_logprobs"]) == len(event["completion_token_ids"]) == 1900
    root = tmp_path / "lake"
    cfg = LakeWriterConfig(kafka_bootstrap=kafka_bootstrap, events_topic=topic, outcomes_topic=outcomes,
                           dlq_topic=dlq, group_id=f"test-straddle-{uuid.uuid4().hex[:8]}", lake_root=str(root),
                           var_dir=str(tmp_path / "var"), roll_max_age_s=0.5, session_timeout_s=6,
                           status_interval_s=0.5)
    run_until(cfg, lambda: sum(lake.next_offsets(str(root), "events", topic).values()) >= 1)
    stored = [r for f in lake.list_files(str(root), "events") for r in lake.read_file(str(root), f).to_pylist()
              if r["event_id"] == event["event_id"]]
    assert [(r["policy_version"], r["policy_version_alt"]) for r in stored] == [(held, held + 7)]


def test_calls_answered_just_before_a_sigkill_reach_kafka_after_the_restart(
        kafka_bootstrap: str, vllm_url: str, tmp_path: Path, start_proxy: Any, new_topic: Any) -> None:
    """The proxy journals each call before it answers (ingest/journal.py). Its first life cannot reach Kafka (port 1),
    so every answered call is still in the SDK's memory when SIGKILL comes: without the journal all are lost."""
    import signal

    topic, name = new_topic("proxy-kill"), f"test-proxy-kill-{uuid.uuid4().hex[:8]}"
    env = {"FLYWHEEL_SPOOL_DIR": str(tmp_path / "spool")}
    args = ["--upstream", vllm_url, "--events-topic", topic, "--spool-name", name]
    first, url = start_proxy([*args, "--kafka-bootstrap", "127.0.0.1:1"], tmp_path / "first.log", env)
    session = uuid.uuid4().hex
    client = _client(url)
    for _ in range(5):
        client.chat.completions.create(model="policy-v0", messages=MESSAGES, max_tokens=4, temperature=1.0,
                                       extra_headers={"X-Flywheel-Session-Id": session})
    first.send_signal(signal.SIGKILL)  # within the SDK's 2 s before it spools anything
    first.wait(timeout=30)
    second, _ = start_proxy([*args, "--kafka-bootstrap", kafka_bootstrap], tmp_path / "second.log", env)
    try:
        deadline = time.time() + 60
        while True:  # until the 5 distinct calls are there: the first records read may be copies of fewer
            calls = [e for e in _events(kafka_bootstrap, topic, session, 5, timeout_s=10) if e["type"] == "llm_call"]
            if len({c["event_id"] for c in calls}) >= 5 or time.time() > deadline:
                break
    finally:
        _stop_proxy(second, tmp_path / "second.log")
    # the SDK may have spooled some before the kill, so the successor replays those from the spool and the journal:
    # copies share the event_id, and the lake keeps one (a consumer of the topic de-duplicates by it)
    answered = {c["event_id"]: c for c in calls}
    assert len(answered) == 5, f"{len(answered)} of 5 answered calls reached Kafka after the SIGKILL:\n" \
                               f"{(tmp_path / 'second.log').read_text()[-2000:]}"
    calls = list(answered.values())
    assert all(len(c["completion_logprobs"]) == len(c["completion_token_ids"]) > 0 for c in calls)


def test_the_anthropic_client_through_the_proxy_gets_what_vllm_generated_and_each_call_is_logged(
        proxy: dict, vllm_url: str, kafka_bootstrap: str) -> None:
    """POST /v1/messages, whole and streamed, with the official `anthropic` client: translated to chat completions
    and back (serving/dialects.py; the tool-use blocks' translation is covered in tests/unit/test_proxy_messages.py,
    as the tiny model's chat template renders no tool calls)."""
    anthropic = pytest.importorskip("anthropic")

    session = f"s-{uuid.uuid4().hex}"
    client = anthropic.Anthropic(base_url=proxy["url"], api_key=SECRET, max_retries=0,
                                 default_headers={"X-Flywheel-Session-Id": session})
    # greedy, to compare with vLLM's own reply (this SDK's create() takes no temperature argument: the body does)
    args: dict[str, Any] = dict(model="claude-agent", max_tokens=24, messages=MESSAGES, extra_body={"temperature": 0})
    direct = _client(vllm_url).chat.completions.create(model="policy-v0", messages=MESSAGES, temperature=0,
                                                       max_tokens=24)
    whole = client.messages.create(**args)
    with client.messages.stream(**args) as stream:
        streamed_text = "".join(stream.text_stream)
        streamed = stream.get_final_message()
    expected = direct.choices[0].message.content or ""
    texts = ["".join(b.text for b in m.content if b.type == "text") for m in (whole, streamed)]
    assert texts == [expected, expected] and streamed_text == expected
    assert whole.model == "claude-agent" and whole.stop_reason in ("end_turn", "max_tokens")

    events = [e for e in _events(kafka_bootstrap, proxy["topic"], session, 2) if e["type"] == "llm_call"]
    assert len(events) == 2, f"expected one llm_call per request, got {len(events)}"
    for event, message in zip(events, (whole, streamed)):
        schema.validate_event(event)
        assert event["model"] == "policy-v0" and event["policy_version"] == 0
        assert len(event["completion_logprobs"]) == len(event["completion_token_ids"]) > 0
        assert all(lp <= 0 and lp == lp for lp in event["completion_logprobs"]), "a logprob is not finite"
        assert message.usage.output_tokens == len(event["completion_token_ids"])
        assert message.usage.input_tokens == len(event["prompt_token_ids"])
        assert event["completion_text"] == expected
    assert SECRET not in proxy["log"].read_text(), "the x-api-key reached the proxy's log"


def test_the_openai_responses_client_through_the_proxy_continues_one_session_by_previous_response_id(
        proxy: dict, vllm_url: str, kafka_bootstrap: str) -> None:
    """POST /v1/responses, whole, streamed and continued, with the official `openai` client and no session header:
    the proxy opens a session for the first response and keeps the follow-up in it."""
    client = _client(proxy["url"])
    first = client.responses.create(model="agent", input=MESSAGES[0]["content"], temperature=0, max_output_tokens=16)
    follow = client.responses.create(model="agent", input="And another?", previous_response_id=first.id,
                                     temperature=0, max_output_tokens=16)
    events = list(client.responses.create(model="agent", input=MESSAGES[0]["content"], temperature=0,
                                          max_output_tokens=16, stream=True))
    streamed = events[-1].response
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    direct = _client(vllm_url).chat.completions.create(model="policy-v0", messages=MESSAGES, temperature=0,
                                                       max_tokens=16)
    assert first.output_text == streamed.output_text == (direct.choices[0].message.content or "")

    stats = json.loads(urllib.request.urlopen(f"{proxy['url']}/stats").read())
    assert stats["open_sessions"] >= 2
    ordered = _calls(kafka_bootstrap, proxy["topic"], 3,
                     lambda e: e["session_id"].startswith("resp-") and bool(e.get("request_id")))
    assert len(ordered) == 3, f"expected 3 llm_calls of resp- sessions, got {len(ordered)}"
    first_call, follow_call, stream_call = ordered
    session = first_call["session_id"]
    assert follow_call["session_id"] == session != stream_call["session_id"], "the chain is one session"
    assert len(follow_call["prompt_token_ids"]) > len(first_call["prompt_token_ids"]), "the follow-up saw the history"
    for event, reply in zip(ordered, (first, follow, streamed)):
        assert len(event["completion_logprobs"]) == len(event["completion_token_ids"]) == reply.usage.output_tokens
        assert len(event["prompt_token_ids"]) == reply.usage.input_tokens
        assert event["completion_text"] == reply.output_text


CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["paris", "rome", "oslo"]}},
        "required": ["city"]}


def test_a_tool_use_turn_and_its_follow_up_through_messages_and_responses(proxy: dict, kafka_bootstrap: str) -> None:
    """A real tool-use turn with vLLM: the tool is named in tool_choice, so vLLM writes its arguments under its
    structured-output grammar (no tool-call parser needed; the tiny model's template renders no tools). Each turn is
    one llm_call with one finite logprob per completion id and the reply's token counts; the follow-up that hands
    back the tool's result continues the conversation."""
    anthropic = pytest.importorskip("anthropic")

    session = f"s-{uuid.uuid4().hex}"
    claude = anthropic.Anthropic(base_url=proxy["url"], api_key=SECRET, max_retries=0,
                                 default_headers={"X-Flywheel-Session-Id": session})
    tool = {"name": "weather", "description": "The weather of a city", "input_schema": CITY}
    ask = [{"role": "user", "content": "How is the weather in rome?"}]
    turn = claude.messages.create(model="claude-agent", max_tokens=40, messages=ask, tools=[tool],
                                  tool_choice={"type": "tool", "name": "weather"}, extra_body={"temperature": 0})
    (use,) = [b for b in turn.content if b.type == "tool_use"]
    assert use.name == "weather" and use.input.get("city") in ("paris", "rome", "oslo"), turn
    assert turn.stop_reason == "tool_use", turn.stop_reason
    with claude.messages.stream(model="claude-agent", max_tokens=40, messages=ask, tools=[tool],
                                tool_choice={"type": "tool", "name": "weather"},
                                extra_body={"temperature": 0}) as stream:
        streamed = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in streamed.content if b.type == "tool_use"] == \
        [("tool_use", "weather", use.input)], streamed
    answer = claude.messages.create(
        model="claude-agent", max_tokens=16, tools=[tool], tool_choice={"type": "none"},
        messages=ask + [{"role": "assistant", "content": [b.model_dump() for b in turn.content]},
                        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                      "content": "sunny, 21 C"}]}])
    assert answer.content and answer.content[0].type == "text"
    logged = _calls(kafka_bootstrap, proxy["topic"], 3, lambda e: e["session_id"] == session)
    assert len(logged) == 3, f"one llm_call per request, got {len(logged)}"
    for event, reply in zip(logged, (turn, streamed, answer)):
        schema.validate_event(event)
        assert len(event["completion_logprobs"]) == len(event["completion_token_ids"]) == reply.usage.output_tokens
        assert all(lp <= 0 and lp == lp for lp in event["completion_logprobs"]), "a logprob is not finite"
        assert len(event["prompt_token_ids"]) == reply.usage.input_tokens
    assert len(logged[2]["prompt_token_ids"]) > len(logged[0]["prompt_token_ids"]), "the follow-up saw the result"

    client = _client(proxy["url"])
    function = {"type": "function", "name": "weather", "description": "The weather of a city", "parameters": CITY}
    first = client.responses.create(model="agent", input="How is the weather in oslo?", tools=[function],
                                    tool_choice={"type": "function", "name": "weather"}, temperature=0,
                                    max_output_tokens=40)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "weather" and json.loads(call.arguments)["city"] in ("paris", "rome", "oslo"), first
    follow = client.responses.create(model="agent", previous_response_id=first.id, tools=[function],
                                     tool_choice="none", temperature=0, max_output_tokens=16,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "snow, -3 C"}])
    assert follow.output and follow.output[0].type == "message"
    # a Responses chain is its own session (resp-...); each call is logged under its response's id
    pair = _calls(kafka_bootstrap, proxy["topic"], 2, lambda e: e.get("request_id") in (first.id, follow.id))
    assert [e["request_id"] for e in pair] == [first.id, follow.id] and pair[0]["session_id"] == pair[1]["session_id"]
    for event, reply in zip(pair, (first, follow)):
        assert len(event["completion_logprobs"]) == len(event["completion_token_ids"]) == reply.usage.output_tokens
        assert len(event["prompt_token_ids"]) == reply.usage.input_tokens
    assert SECRET not in proxy["log"].read_text()
