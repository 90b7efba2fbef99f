"""Generative reward model: an LLM judge behind any OpenAI-compatible chat endpoint.

The judge reads a session transcript and a rubric and answers one of "1".."5". The answer is
constrained with vLLM structured output (`"structured_outputs": {"choice": [...]}`), so even a
weak or randomly initialised model always returns a parseable score; an endpoint that ignores
the field and answers something else is recorded as status "unparseable", never guessed.

Results are cached on disk by sha256(transcript, rubric name, rubric version, model): a rubric
edit must bump the version, which invalidates exactly its entries. Timeouts and errors are
returned as a status (and not cached, so a later pass may succeed); the builder records them in
reward_detail and carries on: a judge outage costs r_judge, never the episode.
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flywheel.base.atomic import Durability, write_json
from flywheel.rewards.config import Rubric

log = logging.getLogger(__name__)
CHOICES = ["1", "2", "3", "4", "5"]
SYSTEM = (
    "You are a strict reviewer of an AI agent's work. Read the transcript and answer with a single "
    "digit from 1 to 5 according to the rubric.\nRubric: {rubric}"
)


@dataclass(frozen=True)
class JudgeResult:
    score: int | None  # 1..5, None when the judge failed
    status: str  # "ok", "cached", "timeout", "error: ...", "unparseable: ...", "budget"
    latency_s: float = 0.0

    def r_judge(self, weight: float) -> float | None:
        """weight * (score - 3) / 2: 1..5 maps to [-weight, +weight]; None when unscored."""
        return None if self.score is None else weight * (self.score - 3) / 2


def cache_key(transcript: str, rubric: Rubric, model: str) -> str:
    h = hashlib.sha256()
    for part in (transcript, rubric.name, rubric.version, model):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def transcript(llm_calls: list[dict[str, Any]], max_chars: int) -> str:
    """The text the judge reads: the main agent's last prompt and completion, tail-cut to max_chars.

    Uses the logged (redacted) text; a call logged without text is shown by its token ids, which
    still gives a stable cache key even though a judge can say little about it.
    """
    if not llm_calls:
        return ""
    last = llm_calls[-1]
    prompt = last.get("prompt_text") or f"<prompt token ids> {last.get('prompt_token_ids')}"
    completion = last.get("completion_text") or f"<completion token ids> {last.get('completion_token_ids')}"
    text = f"TASK AND CONTEXT:\n{prompt}\n\nAGENT ANSWER:\n{completion}"
    return text[-max_chars:] if len(text) > max_chars else text


class Judge:
    """Scores transcripts through `url`/v1/chat/completions with one rubric per task type."""

    def __init__(self, url: str, model: str, timeout_s: float, cache_dir: Path | None) -> None:
        self.url = url.rstrip("/") + "/v1/chat/completions"
        self.model = model
        self.timeout_s = timeout_s
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self.calls = 0
        self.failures = 0
        self.cache_hits = 0

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
        if path is None:
            return
        write_json(path, {"score": score, "model": self.model, "ts": time.time()}, Durability.ADVISORY)  # a cache

    def score(self, text: str, rubric: Rubric) -> JudgeResult:
        key = cache_key(text, rubric, self.model)
        hit = self._cached(key)
        if hit is not None:
            self.cache_hits += 1
            return hit
        body = {
            "model": self.model,
            "messages": [
                {"role": "system", "content": SYSTEM.format(rubric=rubric.text)},
                {"role": "user", "content": text},
            ],
            "max_tokens": 2,
            "temperature": 0.0,
            "structured_outputs": {"choice": CHOICES},
        }
        request = urllib.request.Request(self.url, json.dumps(body).encode(), {"content-type": "application/json"})
        self.calls += 1
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as resp:
                payload = json.loads(resp.read())
        except (TimeoutError, socket.timeout):
            return self._fail("timeout", t0)
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, (TimeoutError, socket.timeout)):
                return self._fail("timeout", t0)
            return self._fail(f"error: {exc.reason}", t0)
        except (OSError, ValueError) as exc:  # connection reset, bad JSON, HTTP error bodies
            return self._fail(f"error: {type(exc).__name__}: {exc}", t0)
        latency = time.perf_counter() - t0
        try:
            answer = payload["choices"][0]["message"]["content"].strip()
        except (KeyError, IndexError, TypeError, AttributeError):
            return self._fail(f"unparseable: {str(payload)[:80]}", t0)
        if answer not in CHOICES:
            return self._fail(f"unparseable: {answer[:20]!r}", t0)
        self._store(key, int(answer))
        return JudgeResult(int(answer), "ok", latency)

    def _fail(self, status: str, t0: float) -> JudgeResult:
        self.failures += 1
        log.warning("judge: %s at %s after %.2fs; episode recorded without r_judge", status, self.url, time.perf_counter() - t0)
        return JudgeResult(None, status, time.perf_counter() - t0)
