"""`flywheel swarm-preflight`: does splitting pay for the swarm's policy-v0, before a 20-minute run? No stack needed.

RL raises how often a policy does what it can already sometimes do; it pays only where one way is better than the
other. This check measures, offline and cheaply, the choice the swarm's RL is to learn (issue 39): the same
multi-part requests run three times through the swarm's own harness (`swarm.SwarmSession`) against a local
transformers copy of the warm-started model, sampled as vLLM serves it (temperature 1, no top-k/top-p):

* **spawn**: the orchestrator's opening is forced to a spawn of every piece (`{"parts": [1, ..., n]}`); the
  sub-agents then do their pieces with the model's own replies;
* **serial**: every orchestrator reply that would spawn is resampled, up to `max_resamples` times (the policy
  conditioned on not splitting), so it solves the request itself;
* **unforced**: the policy as it is; its openings give the base's spawn share.

It passes when, at every part count, forced spawn's session success beats forced serial's by at least `min_gap`
and the unforced openings spawn within `spawn_band`: then splitting pays and the base does it sometimes, so RL on
production's outcomes has something to sharpen. tests/integration/test_swarm_preflight_builds.py runs it on the suite's
smaller builds of the same rules (150 steps of 32 demonstrations); on the demo's own builds (about 17 minutes of
CPU) it runs by hand, and docs/swarm.md has each result.

    flywheel swarm-preflight [--model var/models/tiny-swarm-warm] [--subagent-model var/models/tiny-swarm-subagent]
                             [--no-frozen-subagents] [--requests 80]

All sessions of a mode step in lockstep: each runs the unchanged harness in its own thread, and a model call
waits until every live session has asked, so one batched sample serves them all, in session order (seeded,
repeatable).
"""

from __future__ import annotations

import json
import logging
import random
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from flywheel.base.config import ConfigError, load_config, setting, setup_logging
from flywheel.demo import swarm, tasks

log = logging.getLogger(__name__)

MODES = ("spawn", "serial", "unforced")
Sampler = Callable[[list[list[tasks.Message]]], list[str]]


@dataclass
class SwarmPreflightConfig:
    """The offline measurement of what splitting is worth to the swarm's warm-started policy."""

    model: Path = setting(Path("var/models/tiny-swarm-warm"), "the swarm's warm-started model directory")
    subagent_model: Path = setting(Path("var/models/tiny-swarm-subagent"), "the frozen sub-agents' model, as the swarm "
                                   "recipe runs them (built from base_model by swarm.subagent_model unless current)")
    frozen_subagents: bool = setting(True, "sample the spawned pieces from subagent_model (the recipe's loop); off: "
                                           "the policy does its own pieces (the loop before frozen sub-agents)")
    base_model: Path = setting(Path("var/models/tiny-base"), "the base a missing sub-agent model is built from")
    requests: int = setting(80, "multi-part requests per part count (2 and 3 parts: swarm.MULTI_PARTS)")
    min_gap: float = setting(0.25, "forced spawn's session success must beat forced serial's by this, per part count")
    spawn_lo: float = setting(0.3, "lowest share of unforced multi-part openings that spawn")
    spawn_hi: float = setting(0.7, "highest share of unforced multi-part openings that spawn")
    max_turns: int = setting(3, "model replies per part (the agent's --max-turns)")
    max_new_tokens: int = setting(40, "a reply's token budget (the agent's --max-tokens)")
    max_resamples: int = setting(10, "serial: draws of an orchestrator reply that spawns before it counts as given")
    seed: int = setting(0, "seed of the requests and of torch's sampling")
    out: Path | None = setting(None, "also write the result here as JSON")

    def check(self) -> None:
        if self.requests < 1 or self.max_turns < 1 or self.max_new_tokens < 1 or self.max_resamples < 1:
            raise ConfigError("requests, max_turns, max_new_tokens and max_resamples must be >= 1")
        if not 0.0 <= self.spawn_lo <= self.spawn_hi <= 1.0:
            raise ConfigError(f"spawn band: need 0 <= spawn_lo ({self.spawn_lo}) <= spawn_hi ({self.spawn_hi}) <= 1")


@dataclass
class QuietAgent:
    """The SDK Session surface the harness logs through, logging nothing (no stack here)."""

    agent_id: str = "main"
    children: list["QuietAgent"] = field(default_factory=list)

    def tool_call(self, name: str, arguments: Any, malformed: bool | None = None,
                  malformed_token: int | None = None) -> str:
        return uuid.uuid4().hex[:12]

    def tool_result(self, call_id: str, ok: bool, output: str, name: str | None = None) -> None:
        return None

    def spawn_subagent(self, subtask: str) -> "QuietAgent":
        child = QuietAgent(f"{self.agent_id}.{len(self.children)}")
        self.children.append(child)
        return child

    def finish(self, ok: bool) -> None:
        return None

    def context_edit(self, kind: str, tokens_removed: int, summary_token_ids: list[int] | None) -> None:
        return None


class Lockstep:
    """One batched model call per round for many sessions, each in its own thread: `ask` blocks until every live
    session has asked (or finished); `drive` then samples the round's dialogues in session order."""

    def __init__(self, sample: Sampler, sessions: int, subagent_sample: Sampler | None = None) -> None:
        self.samplers = {"policy": sample, "subagent": subagent_sample or sample}
        self.live = sessions
        self.cv = threading.Condition()
        self.pending: dict[int, tuple[str, list[tasks.Message]]] = {}
        self.replies: dict[int, str] = {}
        self.rounds = 0

    def ask(self, key: int, messages: list[tasks.Message], role: str = "policy") -> str:
        """The reply of `role` (the policy, or a sub-agent: the policy unless frozen sub-agents were given)."""
        with self.cv:
            self.pending[key] = (role, messages)
            self.cv.notify_all()
            self.cv.wait_for(lambda: key in self.replies)
            return self.replies.pop(key)

    def done(self) -> None:
        with self.cv:
            self.live -= 1
            self.cv.notify_all()

    def drive(self) -> None:
        while True:
            with self.cv:
                self.cv.wait_for(lambda: len(self.pending) >= self.live)
                if self.live == 0:
                    return
                batch = sorted(self.pending.items())
                self.pending.clear()
            replies: dict[int, str] = {}
            for role, sample in self.samplers.items():  # one batch per model, each in session order
                mine = [(key, messages) for key, (who, messages) in batch if who == role]
                if mine:
                    replies.update(zip([key for key, _ in mine], sample([messages for _, messages in mine])))
            self.rounds += 1
            with self.cv:
                self.replies.update(replies)
                self.cv.notify_all()


def requests(cfg: SwarmPreflightConfig) -> list[swarm.SwarmTask]:
    """cfg.requests multi-part requests per part count, drawn as production draws them (swarm.make_lookup_part)."""
    rng = random.Random(cfg.seed)
    return [swarm.SwarmTask("multi", tasks.TaskSpec(f"p{n}-{i}", tuple(swarm.make_lookup_part(rng) for _ in range(n))))
            for n in swarm.MULTI_PARTS for i in range(cfg.requests)]


def run_mode(mode: str, requests_: list[swarm.SwarmTask], sample: Sampler, cfg: SwarmPreflightConfig,
             subagent_sample: Sampler | None = None) -> list[dict[str, Any]]:
    """Every request once through swarm.SwarmSession with the opening forced (spawn), spawning resampled away
    (serial) or as sampled (unforced); per session: parts, success, parts right, critical steps, opening spawned.
    subagent_sample: the frozen sub-agents' model (None: the policy does its own pieces)."""
    step = Lockstep(sample, len(requests_), subagent_sample)
    rows: list[dict[str, Any]] = [{} for _ in requests_]

    def one(i: int, task: swarm.SwarmTask) -> None:
        main = QuietAgent()
        openings: list[bool] = []

        def generate(agent: Any, messages: list[tasks.Message]) -> swarm.Reply:
            if agent is not main:
                return swarm.Reply(step.ask(i, messages, "subagent"))
            if mode == "spawn" and not openings:
                openings.append(True)
                return swarm.Reply(swarm.format_spawn_parts(list(range(1, len(task.spec.parts) + 1))))
            text = step.ask(i, messages)
            for _ in range(cfg.max_resamples - 1 if mode == "serial" else 0):
                parsed = tasks.parse_reply(text)
                if not (parsed.kind == "tool_call" and parsed.tool == swarm.SPAWN):
                    break
                text = step.ask(i, messages)
            if not openings:
                parsed = tasks.parse_reply(text)
                openings.append(parsed.kind == "tool_call" and parsed.tool == swarm.SPAWN)
            return swarm.Reply(text)

        try:
            limits = swarm.SwarmLimits(max_turns_per_part=cfg.max_turns)
            result = swarm.SwarmSession(task, main, generate, limits).run()
            right = [tasks.check_part(p, a) for p, a in zip(task.spec.parts, result.answers)]
            rows[i] = {"parts": len(task.spec.parts), "success": all(right), "parts_right": sum(right),
                       "critical_steps": result.critical_steps, "spawned": result.spawned > 0,
                       "opening_spawn": bool(openings and openings[0])}
        finally:
            step.done()

    threads = [threading.Thread(target=one, args=(i, t), daemon=True) for i, t in enumerate(requests_)]
    for t in threads:
        t.start()
    step.drive()
    for t in threads:
        t.join()
    missing = [i for i, r in enumerate(rows) if not r]
    if missing:
        raise RuntimeError(f"swarm preflight: {len(missing)} sessions of mode {mode} ended with an error")
    log.info("swarm preflight: %s, %d sessions in %d model rounds", mode, len(rows), step.rounds)
    return rows


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    n = len(rows)
    return {"sessions": n, "success": round(sum(r["success"] for r in rows) / n, 4),
            "part_success": round(sum(r["parts_right"] for r in rows) / sum(r["parts"] for r in rows), 4),
            "critical_steps": round(sum(r["critical_steps"] for r in rows) / n, 3),
            "opening_spawn": round(sum(r["opening_spawn"] for r in rows) / n, 4),
            "spawned": round(sum(r["spawned"] for r in rows) / n, 4)}


def _load(model_dir: Path, cfg: SwarmPreflightConfig) -> Sampler:
    """The sampler: the model in model_dir, sampled as vLLM serves it (temperature 1, no top-k/top-p), seeded."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flywheel.demo import warm_start

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    torch.manual_seed(cfg.seed)

    def sample(dialogues: list[list[tasks.Message]]) -> list[str]:
        return warm_start.sample_replies(model, tok, dialogues, cfg.max_new_tokens)

    return sample


def run(cfg: SwarmPreflightConfig) -> dict[str, Any]:
    """The three modes on the same requests; per part count and mode the summary, and whether it passed."""
    subagents = swarm.ensure_subagent_model(cfg.base_model, cfg.subagent_model) if cfg.frozen_subagents else None
    sample = _load(Path(cfg.model), cfg)
    subagent_sample = _load(subagents, cfg) if subagents is not None else None
    reqs = requests(cfg)
    t0 = time.time()
    by_mode = {mode: run_mode(mode, reqs, sample, cfg, subagent_sample) for mode in MODES}
    result: dict[str, Any] = {"model": str(cfg.model), "subagent_model": str(subagents) if subagents else None,
                              "config": json.loads(json.dumps(asdict(cfg), default=str)),
                              "by_parts": {}, "failed": []}
    for n in swarm.MULTI_PARTS:
        figures = {mode: summarise([r for r in rows if r["parts"] == n]) for mode, rows in by_mode.items()}
        gap = round(figures["spawn"]["success"] - figures["serial"]["success"], 4)
        result["by_parts"][str(n)] = {**figures, "gap": gap}
        if gap < cfg.min_gap:
            result["failed"].append(f"{n} parts: forced spawn {figures['spawn']['success']:.0%} of sessions against "
                                    f"forced serial {figures['serial']['success']:.0%}, a gap of {gap:+.0%} "
                                    f"(want >= {cfg.min_gap:+.0%})")
    share = summarise(by_mode["unforced"])["opening_spawn"]
    result["unforced_opening_spawn"] = share
    if not cfg.spawn_lo <= share <= cfg.spawn_hi:
        result["failed"].append(f"the unforced policy opens {share:.0%} of multi-part sessions with a spawn "
                                f"(want {cfg.spawn_lo:.0%}-{cfg.spawn_hi:.0%})")
    result["passed"] = not result["failed"]
    result["seconds"] = round(time.time() - t0, 1)
    if cfg.out is not None:
        Path(cfg.out).write_text(json.dumps(result, indent=1))
    return result


def table(result: dict[str, Any]) -> str:
    lines = ["| parts | mode | sessions | session success | part success | critical steps | opening spawns |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for n, figures in result["by_parts"].items():
        for mode in MODES:
            f = figures[mode]
            lines.append(f"| {n} | {mode} | {f['sessions']} | {f['success']:.1%} | {f['part_success']:.1%} | "
                         f"{f['critical_steps']:.2f} | {f['opening_spawn']:.1%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    cfg = load_config(SwarmPreflightConfig, argv, prog="flywheel swarm-preflight")
    setup_logging()
    swarm.ensure_warm_model(cfg.base_model, cfg.model)  # the demo's set-up builds it too; a fresh clone has none
    result = run(cfg)
    print(table(result))
    print(json.dumps({"passed": result["passed"], "failed": result["failed"],
                      "gap": {n: f["gap"] for n, f in result["by_parts"].items()},
                      "unforced_opening_spawn": result["unforced_opening_spawn"], "seconds": result["seconds"]}))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
