"""Generative reward model: an LLM judge behind any OpenAI-compatible chat endpoint.

The judge reads a session's transcript (rewards/transcript.py) and its task type's rubric and
answers a score from 1 to 5. It is asked through the `openai` client, so any OpenAI-compatible
base URL works (OpenAI, a hosted vLLM or SGLang, the local vLLM), with an API key read from the
environment variable the builder names (never logged, never written to a resolved config). The
answer is constrained:

* "json_schema" (default, portable): `response_format` with a JSON schema, an object with an
  integer `score` in 1..5 (and a short `reason` when asked for);
* "choice": vLLM's own `"structured_outputs": {"choice": ["1".."5"]}`, for a vLLM that lacks JSON
  schema support. An answer that does not parse is recorded as "unparseable", never guessed.

A request is retried with exponential backoff only where a retry can help: a timeout, a refused
or reset connection, 429 or 5xx; never another 4xx (a bad request or a wrong key fails the same way
again). `score_many` runs requests with at most `concurrency` in flight and stops starting new ones
when the pass's time or call budget is spent (those sessions are "budget": retried on a later pass).

Answers are cached on disk by sha256(transcript, rubric name, rubric version, model): a rubric
edit must bump the version, which invalidates exactly its entries. The judge version a row records
is `<model>/<rubric>@<version>`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from flywheel.base.atomic import Durability, write_json
from flywheel.rewards.config import JudgeSettings, Rubric

log = logging.getLogger(__name__)
CHOICES = ["1", "2", "3", "4", "5"]
SYSTEM = (
    "You are a strict reviewer of an AI agent's work. Read the transcript of the agent's session and score it "
    "from 1 to 5 according to the rubric. {answer}\nRubric: {rubric}"
)
ANSWER_JSON = "Answer with a JSON object {fields}."
ANSWER_CHOICE = "Answer with a single digit."
# statuses a later pass may turn into a score (the builder keeps such sessions for a retry)
RETRYABLE = ("timeout", "unavailable", "budget")


@dataclass(frozen=True)
class JudgeResult:
    score: int | None  # 1..5, None when the judge failed
    # "ok", "cached", "timeout", "unavailable: ..." (connection, 429, 5xx), "error: ..." (other 4xx),
    # "unparseable: ...", "budget"
    status: str
    latency_s: float = 0.0
    attempts: int = 0  # requests sent for this answer (0: cached or not asked)

    @property
    def retryable(self) -> bool:
        return self.score is None and self.status.split(":")[0] in RETRYABLE

    def r_judge(self, weight: float) -> float | None:
        """weight * (score - 3) / 2: 1..5 maps to [-weight, +weight] (0.0 in shadow mode); None when unscored."""
        return None if self.score is None else weight * (self.score - 3) / 2


def cache_key(transcript: str, rubric: Rubric, model: str) -> str:
    h = hashlib.sha256()
    for part in (transcript, rubric.name, rubric.version, model):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def judge_version(model: str, rubric: Rubric) -> str:
    """What scored a row: the judge model and the rubric's name and version."""
    return f"{model}/{rubric.name}@{rubric.version}"


def response_schema(reason_chars: int) -> dict[str, Any]:
    """The JSON schema of an answer: an integer score 1..5 and, when asked, a reason (strict-mode compatible)."""
    props: dict[str, Any] = {"score": {"type": "integer", "enum": [1, 2, 3, 4, 5]}}
    if reason_chars:
        props["reason"] = {"type": "string"}
    return {"type": "object", "properties": props, "required": sorted(props), "additionalProperties": False}


def request_body(text: str, rubric: Rubric, model: str, settings: JudgeSettings) -> dict[str, Any]:
    """The chat request's keyword arguments for `client.chat.completions.create`."""
    extra: dict[str, Any]
    if settings.output == "choice":
        answer, extra = ANSWER_CHOICE, {"extra_body": {"structured_outputs": {"choice": CHOICES}}}
        max_tokens = 2
    else:
        fields = '{"score": <1-5>}' if not settings.reason_chars else \
            f'{{"reason": "<at most {settings.reason_chars} characters>", "score": <1-5>}}'
        answer = ANSWER_JSON.format(fields=fields)
        extra = {"response_format": {"type": "json_schema", "json_schema": {
            "name": "judge_score", "strict": True, "schema": response_schema(settings.reason_chars)}}}
        # {"score": 5} is under 16 tokens in any tokenizer, plus room for whitespace the grammar allows (see
        # JudgeSettings.frequency_penalty); a reason costs at most a token per character
        max_tokens = 32 + settings.reason_chars + 8 * bool(settings.reason_chars)
    return {"model": model, "max_tokens": max_tokens, "temperature": 0.0,
            "frequency_penalty": settings.frequency_penalty,
            "messages": [{"role": "system", "content": SYSTEM.format(answer=answer, rubric=rubric.text)},
                         {"role": "user", "content": text}], **extra}


def parse_answer(content: str | None, output: str) -> int | None:
    """The score in an answer, or None when it does not parse."""
    content = (content or "").strip()
    if output == "choice":
        return int(content) if content in CHOICES else None
    try:
        score = json.loads(content).get("score")
    except (ValueError, AttributeError):
        return None
    return score if isinstance(score, int) and not isinstance(score, bool) and 1 <= score <= 5 else None


def classify(exc: BaseException) -> tuple[str, bool]:
    """(status, retry helps) of a failed request: timeouts, connection errors, 429 and 5xx are worth a retry."""
    import openai

    if isinstance(exc, openai.APITimeoutError):
        return "timeout", True
    if isinstance(exc, openai.APIConnectionError):
        return f"unavailable: connection ({type(exc.__cause__ or exc).__name__})", True
    if isinstance(exc, openai.APIStatusError):
        code = exc.status_code
        if code in (408, 429) or code >= 500:
            return f"unavailable: HTTP {code}", True
        return f"error: HTTP {code} ({str(exc)[:80]})", False
    return f"error: {type(exc).__name__}: {str(exc)[:80]}", False


def with_retries(send: Callable[[], Any], retries: int, backoff_s: float, deadline: float,
                 sleep: Callable[[float], None] = time.sleep) -> tuple[Any, str, int]:
    """(response or None, status, attempts): `send` retried with doubling backoff while the failure is retryable,
    retries remain, and the wait ends before `deadline` (time.monotonic)."""
    attempt = 0
    while True:
        attempt += 1
        try:
            return send(), "ok", attempt
        except Exception as exc:  # noqa: BLE001 -- classify decides; an unexpected error is a non-retryable status
            status, retry = classify(exc)
        wait = backoff_s * 2 ** (attempt - 1)
        if not retry or attempt > retries or time.monotonic() + wait >= deadline:
            return None, status, attempt
        sleep(wait)


class Judge:
    """Scores transcripts at an OpenAI-compatible endpoint, one rubric per task type, thread-safe."""

    def __init__(self, url: str, model: str, settings: JudgeSettings, cache_dir: Path | None,
                 api_key: str | None = None, client: Any | None = None) -> None:
        self.url = url.rstrip("/")
        self.base_url = self.url if self.url.endswith("/v1") else self.url + "/v1"
        self.model = model
        self.settings = settings
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self._api_key = api_key
        self._client = client  # created on first use: the openai import stays off the builder's start-up
        self._lock = threading.Lock()
        self.calls = 0  # requests sent (retries included)
        self.failures = 0  # answers that ended without a score
        self.cache_hits = 0

    @property
    def client(self) -> Any:
        with self._lock:
            if self._client is None:
                import openai

                # retries are ours (with_retries): the client's own would retry past the pass's budget
                self._client = openai.OpenAI(base_url=self.base_url, api_key=self._api_key or "EMPTY",
                                             timeout=self.settings.timeout_s, max_retries=0)
            return self._client

    def _cache_path(self, key: str) -> Path | None:
        return self.cache_dir / key[:2] / f"{key}.json" if self.cache_dir else None

    def _cached(self, key: str) -> JudgeResult | None:
        path = self._cache_path(key)
        if path is None:
            return None
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return None
        return JudgeResult(int(record["score"]), "cached", 0.0)

    def _store(self, key: str, score: int) -> None:
        path = self._cache_path(key)
        if path is not None:
            write_json(path, {"score": score, "model": self.model, "ts": time.time()}, Durability.ADVISORY)  # a cache

    def _count(self, calls: int = 0, failures: int = 0, hits: int = 0) -> None:
        with self._lock:
            self.calls += calls
            self.failures += failures
            self.cache_hits += hits

    def score(self, text: str, rubric: Rubric, deadline: float | None = None) -> JudgeResult:
        """One transcript's score (from the cache, or asked with retries until `deadline`, time.monotonic)."""
        key = cache_key(text, rubric, self.model)
        hit = self._cached(key)
        if hit is not None:
            self._count(hits=1)
            return hit
        body = request_body(text, rubric, self.model, self.settings)
        t0 = time.perf_counter()
        resp, status, attempts = with_retries(lambda: self.client.chat.completions.create(**body),
                                              self.settings.retries,
                                              self.settings.backoff_s, deadline or time.monotonic() + 3600.0)
        self._count(calls=attempts)
        latency = time.perf_counter() - t0
        if resp is None:
            return self._fail(status, latency, attempts)
        try:
            content = resp.choices[0].message.content
        except (AttributeError, IndexError, TypeError):
            return self._fail(f"unparseable: {str(resp)[:80]}", latency, attempts)
        score = parse_answer(content, self.settings.output)
        if score is None:
            return self._fail(f"unparseable: {str(content)[:40]!r}", latency, attempts)
        self._store(key, score)
        return JudgeResult(score, "ok", latency, attempts)

    def _fail(self, status: str, latency: float, attempts: int) -> JudgeResult:
        self._count(failures=1)
        log.warning("judge: %s at %s after %.2fs (%d attempts); the session is recorded without a judge score",
                    status, self.url, latency, attempts)
        return JudgeResult(None, status, latency, attempts)

    def score_many(self, items: dict[str, tuple[str, Rubric]], deadline: float, max_calls: int = 0
                   ) -> dict[str, JudgeResult]:
        """Scores of many transcripts (key -> (text, rubric)), `concurrency` at a time; a request not started
        before `deadline` or past `max_calls` new requests (0: no limit) is "budget"."""
        started = 0
        gate = threading.Lock()

        def one(item: tuple[str, Rubric]) -> JudgeResult:
            nonlocal started
            if self._cached(cache_key(item[0], item[1], self.model)) is None:  # a cached answer costs no budget
                with gate:
                    over = time.monotonic() >= deadline or bool(max_calls and started >= max_calls)
                    started += not over
                if over:
                    return JudgeResult(None, "budget")
            return self.score(item[0], item[1], deadline)

        with ThreadPoolExecutor(max_workers=self.settings.concurrency, thread_name_prefix="judge") as pool:
            results = list(pool.map(one, items.values()))
        return dict(zip(items, results))
