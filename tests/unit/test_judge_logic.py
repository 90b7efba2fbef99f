"""The LLM judge's pure parts: the transcript's truncation rule, the cache key, which failures are retried,
the answer formats, the rewards TOML's judge settings and overlay, shadow weight and the retry queue."""

from __future__ import annotations

import datetime as dt
from typing import Any

import httpx
import openai
import pytest

from bench.fixtures import sessions as synthetic
from flywheel.ingest import schema
from flywheel.ingest.schema import episode_reward as total_reward
from flywheel.rewards import config, judge, judge_pass, transcript
from flywheel.rewards.session import assemble

T0 = dt.datetime(2026, 1, 1, 12, tzinfo=dt.timezone.utc)
RUBRIC = config.Rubric("t", "1", "Rate it.")


def _session(turns: int, output: str = "result " * 40, request: str = "SYSTEM PROMPT " * 100 + "USER: add 3 and 4"):
    b = synthetic.SessionBuilder("s1", T0).begin()
    for i in range(turns):
        e = b.llm_call(text=request if i == 0 else f"prompt {i}")
        e["completion_text"] = f'{{"tool": "add", "turn": {i}}}'
        call = b.tool()
        for ev in b.events:
            if ev["type"] == "tool_result" and ev["call_id"] == call:
                ev["output"] = f"out{i} " + output
    b.llm_call(text="final prompt")["completion_text"] = "THE ANSWER IS 7"
    b.end()
    return assemble("s1", [e | {"ts": schema.parse_ts(e["ts"])} for e in b.events])


def test_transcript_keeps_request_tool_headers_and_last_turns_within_budget() -> None:
    s = _session(turns=30)
    text = transcript.transcript(s, max_tokens=1200, chars_per_token=2.0)
    assert transcript.tokens(text, 2.0) <= 1200, f"{transcript.tokens(text, 2.0)} tokens for a budget of 1200"
    assert text.startswith("[request]") and text.split("\n")[1].endswith("USER: add 3 and 4"), text[:300]
    assert "[...cut...]" in text.split("\n")[1], "a request past a third of the budget keeps its tail, marked as cut"
    headers = [line for line in text.split("\n") if line.startswith("[tool result]")]
    assert len(headers) == 30, f"every tool result header must stay: {len(headers)} of 30"
    assert text.rstrip().endswith("[session end] status=ok") and "THE ANSWER IS 7" in text, text[-300:]
    assert text.count("turns left out") == 1, "older turns' bodies go first, and one line says so"
    assert "out0 result" not in text and "out29 result" in text, "the newest tool output is kept, the oldest dropped"


def test_transcript_of_a_short_session_is_whole() -> None:
    s = _session(turns=2, output="ok", request="USER: add 3 and 4")
    text = transcript.transcript(s, max_tokens=1000, chars_per_token=4.0)
    assert "left out" not in text and "cut" not in text, text
    for piece in ("USER: add 3 and 4", "out0 ok", "out1 ok", '{"tool": "add", "turn": 1}', "[tool call] search"):
        assert piece in text, (piece, text)


def test_a_traced_session_reads_as_a_transcript_too() -> None:
    """Calls known from OpenTelemetry spans (traced_llm_call, schema v5) carry text, not token ids."""
    b = synthetic.SessionBuilder("otel-1", T0).begin()
    b._event("main", "traced_llm_call", model="gpt-x", prompt_text="USER: weather in rome?", completion_text="CALL")
    b.tool()
    b._event("main", "traced_llm_call", model="gpt-x", output_tokens=4)
    b.end()
    text = transcript.transcript(assemble("otel-1", [e | {"ts": schema.parse_ts(e["ts"])} for e in b.events]),
                                 max_tokens=1000, chars_per_token=4.0)
    assert text.split("\n")[1] == "USER: weather in rome?", text
    for piece in ("[assistant, traced: gpt-x]", "CALL", "(text not in the trace: 4 tokens)", "[tool call] search"):
        assert piece in text, (piece, text)


def test_cache_key_covers_content_rubric_version_and_model() -> None:
    base = judge.cache_key("text", RUBRIC, "m")
    assert base == judge.cache_key("text", config.Rubric("t", "1", "Rate it."), "m")
    others = [judge.cache_key("text2", RUBRIC, "m"), judge.cache_key("text", config.Rubric("t", "2", "Rate it."), "m"),
              judge.cache_key("text", config.Rubric("u", "1", "Rate it."), "m"), judge.cache_key("text", RUBRIC, "m2")]
    assert len({base, *others}) == 5, "content, rubric name, rubric version and model must each change the key"
    assert judge.judge_version("m", RUBRIC) == "m/t@1"


def _status_error(code: int) -> openai.APIStatusError:
    response = httpx.Response(code, request=httpx.Request("POST", "http://judge/v1/chat/completions"))
    cls = {401: openai.AuthenticationError, 400: openai.BadRequestError, 429: openai.RateLimitError}.get(
        code, openai.InternalServerError)
    return cls(f"HTTP {code}", response=response, body=None)


def _flaky(failures: list[BaseException]):
    calls: list[int] = []

    def send() -> str:
        calls.append(1)
        if len(calls) <= len(failures):
            raise failures[len(calls) - 1]
        return "answer"

    return send, calls


def test_timeouts_429_and_5xx_are_retried_with_backoff() -> None:
    timeout = openai.APITimeoutError(request=httpx.Request("POST", "http://judge"))
    send, calls = _flaky([timeout, _status_error(429), _status_error(503)])
    waits: list[float] = []
    resp, status, attempts = judge.with_retries(send, retries=3, backoff_s=0.5, deadline=1e12, sleep=waits.append)
    assert (resp, status, attempts) == ("answer", "ok", 4) and waits == [0.5, 1.0, 2.0], (resp, status, attempts, waits)
    send, _ = _flaky([timeout] * 5)
    resp, status, attempts = judge.with_retries(send, retries=2, backoff_s=0.1, deadline=1e12, sleep=lambda s: None)
    assert (resp, status, attempts) == (None, "timeout", 3), "retries are bounded"


def test_4xx_other_than_429_is_not_retried_and_the_deadline_stops_retries() -> None:
    for code in (400, 401):
        send, calls = _flaky([_status_error(code)])
        resp, status, attempts = judge.with_retries(send, retries=3, backoff_s=0.1, deadline=1e12, sleep=lambda s: None)
        assert resp is None and attempts == 1 and status.startswith(f"error: HTTP {code}"), (code, status, attempts)
    timeout = openai.APITimeoutError(request=httpx.Request("POST", "http://judge"))
    send, calls = _flaky([timeout] * 3)
    resp, status, attempts = judge.with_retries(send, retries=3, backoff_s=10.0, deadline=0.0, sleep=lambda s: None)
    assert (status, attempts) == ("timeout", 1), "no retry whose wait ends past the pass's deadline"
    assert judge.JudgeResult(None, "timeout").retryable and judge.JudgeResult(None, "budget").retryable
    assert judge.JudgeResult(None, "unavailable: HTTP 503").retryable
    assert not judge.JudgeResult(None, "error: HTTP 401 (x)").retryable and not judge.JudgeResult(None, "unparseable: 'x'").retryable


def test_answers_parse_in_both_output_modes_and_requests_are_portable() -> None:
    assert judge.parse_answer('{"score": 4}', "json_schema") == 4
    assert judge.parse_answer(' {"score": 5, "reason": "fine"} ', "json_schema") == 5
    for bad in ('{"score": 6}', '{"score": "4"}', '{"score": true}', "4", "", None, "[4]"):
        assert judge.parse_answer(bad, "json_schema") is None, bad
    assert judge.parse_answer("3", "choice") == 3 and judge.parse_answer("x", "choice") is None
    portable = judge.request_body("t", RUBRIC, "m", config.JudgeSettings())
    schema_ = portable["response_format"]["json_schema"]["schema"]
    assert schema_["properties"]["score"]["enum"] == [1, 2, 3, 4, 5] and schema_["required"] == ["score"]
    assert "extra_body" not in portable, "the portable request carries no vLLM-only field"
    with_reason = judge.request_body("t", RUBRIC, "m", config.JudgeSettings(reason_chars=80))
    assert with_reason["response_format"]["json_schema"]["schema"]["required"] == ["reason", "score"]
    assert with_reason["max_tokens"] > portable["max_tokens"]
    choice = judge.request_body("t", RUBRIC, "m", config.JudgeSettings(output="choice"))
    assert choice["extra_body"] == {"structured_outputs": {"choice": judge.CHOICES}} and "response_format" not in choice


def test_toml_overlay_extends_the_packaged_rules_and_checks_judge_settings(tmp_path: Any) -> None:
    overlay = tmp_path / "demo.toml"
    overlay.write_text('extends = "default"\n[task_types.tool_use]\njudge = true\njudge_weight = 0.0\njudge_sample = 0.3\n'
                       "[judge]\nmax_tokens = 900\n")
    cfg = config.load(overlay)
    base = config.load()
    tool = cfg.task("tool_use.add")
    assert (tool.judge, tool.judge_weight, tool.judge_sample, tool.wait_for) == (True, 0.0, 0.3, ("task_success",)), tool
    assert tool.turn_kinds == base.task("tool_use").turn_kinds, "keys the overlay does not set come from the base"
    assert cfg.judge.max_tokens == 900 and cfg.judge.timeout_s == base.judge.timeout_s
    assert cfg.outcomes == base.outcomes and cfg.digest != base.digest
    assert cfg.judge_weight(tool) == 0.0 and base.judge_weight(base.task("code_edit")) == base.judge.weight
    for bad, where in (("[judge]\noutput = 'xml'\n", "judge.output"), ("[judge]\nconcurrency = 0\n", "judge.concurrency"),
                       ("[task_types.x]\njudge_sample = 1.5\n", "judge_sample"), ("[judge]\nmax_chars = 9\n", "max_chars")):
        with pytest.raises(config.RewardConfigError, match=where):
            config.parse(bad)


def test_a_shadow_score_never_changes_the_reward() -> None:
    for score in range(1, 6):
        r_judge = judge.JudgeResult(score, "ok").r_judge(0.0)
        assert r_judge == 0.0
        assert total_reward(1.0, None, r_judge, 0.0, 0.0, -0.5) == total_reward(1.0, None, None, 0.0, 0.0, -0.5)
    assert judge.JudgeResult(5, "ok").r_judge(0.5) == 0.5 and judge.JudgeResult(1, "ok").r_judge(0.5) == -0.5


def test_sampling_is_by_session_id_and_near_its_rate() -> None:
    ids = [f"s{i}" for i in range(4000)]
    picked = [sid for sid in ids if judge_pass.sampled(sid, 0.25)]
    assert 0.22 < len(picked) / len(ids) < 0.28, len(picked)
    assert picked == [sid for sid in ids if judge_pass.sampled(sid, 0.25)], "the same sessions on every run"
    assert not any(judge_pass.sampled(sid, 0.0) for sid in ids) and all(judge_pass.sampled(sid, 1.0) for sid in ids)


class Scripted(judge.Judge):
    """Our Judge with its endpoint replaced by a script of answers per transcript (no network in unit tests)."""

    def __init__(self, answers: dict[str, list[judge.JudgeResult]], settings: config.JudgeSettings) -> None:
        super().__init__("http://unused", "m", settings, None)
        self.answers = answers

    def score(self, text: str, rubric: config.Rubric, deadline: float | None = None) -> judge.JudgeResult:
        self._count(calls=1)
        return self.answers[text.split("\n")[1]].pop(0)


def test_retry_queue_retries_later_gives_up_after_max_attempts_and_keeps_order() -> None:
    rewards = config.parse("[task_types.default]\njudge = true\n[judge]\nmax_attempts = 2\nretry_after_s = 10\n")
    sessions = [_session(1, request=f"R{i}") for i in range(3)]
    for i, s in enumerate(sessions):
        s.session_id = f"s{i}"
    timeout, ok = judge.JudgeResult(None, "timeout"), judge.JudgeResult(4, "ok")
    j = Scripted({"R0": [ok], "R1": [timeout, ok], "R2": [timeout, timeout]}, rewards.judge)
    first = judge_pass.judge_pass(sessions, [], rewards, j, {}, T0)
    assert {sid: r.score for sid, r in first.judged.items()} == {"s0": 4, "s1": None, "s2": None}
    assert [r["session_id"] for r in first.queue] == ["s1", "s2"] and {r["attempts"] for r in first.queue} == {1}
    early = judge_pass.judge_pass([], first.queue, rewards, j, {}, T0 + dt.timedelta(seconds=5))
    assert early.queue == first.queue and not early.retried and j.calls == 3, "nothing is retried before retry_after_s"
    later = judge_pass.judge_pass([], first.queue, rewards, j, {}, T0 + dt.timedelta(seconds=11))
    assert {sid: r.score for sid, r in later.retried.items()} == {"s1": 4}
    assert later.queue == [] and later.gave_up == 1, "s2 failed its second and last attempt"
