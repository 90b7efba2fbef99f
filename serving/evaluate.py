"""Offline evaluation: a fixed set of verifiable tasks run through vLLM against one policy version.

The gate runs the same task set against champion and challenger (greedy, so a rerun scores the
same) and refuses a challenger that scores significantly lower. The set is pluggable: any
"module:function" returning an iterable of `EvalTask` (the demo passes its own task family);
the default is a small deterministic arithmetic set.

Scores are cached as tags on the MLflow model version (`offline_eval.<task set>`), because a
full-weight champion is no longer loaded anywhere once a full-weight challenger replaced it: its
score from when it was loaded is the one the gate compares against.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import logging
import random
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from flywheel.serving.vllm_client import ServerError, http

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalTask:
    """One verifiable task: chat messages, and a checker of the model's reply text."""

    task_id: str
    messages: list[dict[str, str]]
    check: Callable[[str], bool]
    max_tokens: int = 16
    request: dict[str, Any] = field(default_factory=dict)  # extra body fields (tools, structured_outputs, ...)


@dataclass(frozen=True)
class EvalScore:
    task_set: str
    n: int
    successes: int

    @property
    def rate(self) -> float:
        return self.successes / self.n if self.n else float("nan")

    def to_tag(self) -> str:
        return json.dumps({"n": self.n, "successes": self.successes})

    @classmethod
    def from_tag(cls, task_set: str, text: str) -> "EvalScore":
        value = json.loads(text)
        return cls(task_set, int(value["n"]), int(value["successes"]))


class EvalUnavailable(RuntimeError):
    """The version cannot be evaluated now (not served anywhere, server down); the message says why."""


def _first_int(text: str) -> int | None:
    match = re.search(r"-?\d+", text)
    return int(match.group()) if match else None


def _is_int(text: str, want: int) -> bool:
    return _first_int(text) == want


def arithmetic_tasks(n: int = 64, seed: int = 0) -> list[EvalTask]:
    """The default set: "a+b" with one-digit operands; correct when the first integer of the reply is the sum."""
    rng = random.Random(seed)
    tasks = []
    for i in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        tasks.append(EvalTask(f"add-{i}", [{"role": "user", "content": f"{a}+{b}="}],
                              functools.partial(_is_int, want=a + b), max_tokens=6))
    return tasks


def load_tasks(spec: str) -> list[EvalTask]:
    """Tasks from "module:function" or "path/to/file.py:function" (called with no arguments)."""
    module_name, _, func_name = spec.partition(":")
    if not func_name:
        raise ValueError(f"eval task set {spec!r}: expected 'module:function'")
    if module_name.endswith(".py"):  # a file path: a demo's task family need not be an installed module
        spec_obj = importlib.util.spec_from_file_location(Path(module_name).stem, module_name)
        if spec_obj is None or spec_obj.loader is None:
            raise ValueError(f"eval task set {spec!r}: cannot load {module_name}")
        module = importlib.util.module_from_spec(spec_obj)
        spec_obj.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    func = getattr(module, func_name)
    tasks = list(func())
    if not tasks or not all(isinstance(t, EvalTask) for t in tasks):
        raise ValueError(f"eval task set {spec!r}: must return a non-empty iterable of EvalTask")
    return tasks


def _run_one(server: str, model: str, task: EvalTask, timeout: float) -> bool:
    body = {"model": model, "messages": task.messages, "max_tokens": task.max_tokens, "temperature": 0.0,
            **task.request}
    out = http("POST", f"{server}/v1/chat/completions", body, timeout)
    return bool(task.check(out["choices"][0]["message"].get("content") or ""))


def run_eval(tasks: Iterable[EvalTask], server: str, model: str, task_set: str = "custom", concurrency: int = 4,
             timeout: float = 60.0) -> EvalScore:
    """Greedy replies of `model` on every task; a server error makes the whole run unavailable, never a failure."""
    tasks = list(tasks)
    try:
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            results = list(pool.map(lambda t: _run_one(server, model, t, timeout), tasks))
    except ServerError as exc:
        raise EvalUnavailable(f"{model} on {server}: {exc}") from exc
    score = EvalScore(task_set, len(tasks), sum(results))
    log.info("eval: %s on %s scored %d/%d on %s", model, server, score.successes, score.n, task_set)
    return score
