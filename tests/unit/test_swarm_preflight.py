"""flywheel swarm-preflight's harness with a scripted policy (no model): forcing, resampling, lockstep batching and
the pass rule. The measurement on the real warm start is tests/integration/test_swarm_preflight.py."""

from __future__ import annotations

from typing import Any

from flywheel.demo import swarm, swarm_preflight, tasks

PROMPTS = {tasks.prompt_text(t, a, i): tasks.Part(t, a, tasks.prompt_text(t, a, i))
           for t, a, i in tasks.task_space() if t in tasks.LOOKUPS}


class Scripted:
    """Solves a one-piece request right; opens a multi-part request with a spawn when it starts with a weather piece
    (on its first draw of that dialogue only: a second draw calls a tool), else with a call for its first piece, and
    then answers it wrong. Records each batch's size and each dialogue's draws."""

    def __init__(self) -> None:
        self.batches: list[int] = []
        self.draws: dict[str, int] = {}

    def reply(self, messages: list[tasks.Message]) -> str:
        pieces = swarm.request_pieces(messages[0]["content"])
        key = f"{messages[0]['content']}/{len(messages)}"
        self.draws[key] = self.draws.get(key, 0) + 1
        if messages[-1]["role"] == "user":
            if len(pieces) > 1:
                if PROMPTS[pieces[0]].tool == "weather" and self.draws[key] == 1:
                    return swarm.format_spawn_parts(list(range(1, len(pieces) + 1)))
                first = PROMPTS[pieces[0]]
                return tasks.format_tool_call(first.tool, first.args)
            part = PROMPTS[pieces[0]]
            return tasks.format_tool_call(part.tool, part.args)
        return tasks.format_answer(messages[-1]["content"] if len(pieces) == 1 else "no idea")

    def __call__(self, dialogues: list[list[tasks.Message]]) -> list[str]:
        self.batches.append(len(dialogues))
        return [self.reply(d) for d in dialogues]


def _cfg(**kw: Any) -> swarm_preflight.SwarmPreflightConfig:
    # frozen_subagents off: run() would build the sub-agents' model (minutes); these tests script both samplers
    return swarm_preflight.SwarmPreflightConfig(**{"requests": 12, "frozen_subagents": False, **kw})


def test_forced_spawn_solves_each_piece_with_a_sub_agent_and_forced_serial_never_splits() -> None:
    cfg = _cfg()
    reqs = swarm_preflight.requests(cfg)
    assert [len(r.spec.parts) for r in reqs] == [2] * 12 + [3] * 12
    policy = Scripted()
    spawn = swarm_preflight.run_mode("spawn", reqs, policy, cfg)
    assert all(r["success"] and r["spawned"] and r["opening_spawn"] for r in spawn), spawn
    assert {r["critical_steps"] for r in spawn} == {3}, "an opening, then each sub-agent's call and answer"
    assert policy.batches[0] == len(reqs), "every session's first sub-agent call is sampled in one batch"
    resampling = Scripted()
    serial = swarm_preflight.run_mode("serial", reqs, resampling, cfg)
    assert not any(r["spawned"] or r["opening_spawn"] or r["success"] for r in serial), serial
    assert max(resampling.draws.values()) == 2, "a spawning opening is drawn again, once, and the call taken"
    unforced = swarm_preflight.run_mode("unforced", reqs, Scripted(), cfg)
    weather_first = [r.spec.parts[0].tool == "weather" for r in reqs]
    assert any(weather_first) and not all(weather_first)
    assert [r["opening_spawn"] for r in unforced] == weather_first, "the opening as the policy wrote it"
    assert [r["success"] for r in unforced] == weather_first, "its spawned sessions pass, its serial ones fail"


def test_it_passes_on_a_gap_and_a_spawn_share_in_the_band_and_names_what_failed(monkeypatch: Any) -> None:
    def fake_mode(mode: str, reqs: list[swarm.SwarmTask], sample: Any, cfg: Any, sub: Any = None) -> list[dict[str, Any]]:
        win = {"spawn": True, "serial": False, "unforced": None}[mode]
        return [{"parts": len(r.spec.parts), "success": bool(win) if win is not None else i % 2 == 0,
                 "parts_right": 0, "critical_steps": 3, "spawned": mode != "serial", "opening_spawn": i % 2 == 0}
                for i, r in enumerate(reqs)]

    monkeypatch.setattr(swarm_preflight, "run_mode", fake_mode)
    monkeypatch.setattr(swarm_preflight, "_load", lambda model_dir, cfg: (lambda dialogues: []))
    result = swarm_preflight.run(_cfg())
    assert result["passed"] and result["by_parts"]["2"]["gap"] == 1.0 and result["unforced_opening_spawn"] == 0.5
    narrow = swarm_preflight.run(_cfg(spawn_lo=0.6, min_gap=1.01))
    assert not narrow["passed"] and len(narrow["failed"]) == 3, narrow["failed"]
    assert "2 parts" in narrow["failed"][0] and "opens 50%" in narrow["failed"][2]


class Clueless(Scripted):
    """Opens every request with a call for its first piece and answers every piece wrong: a policy that cannot do a
    lookup. Records every dialogue it was asked to continue."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def reply(self, messages: list[tasks.Message]) -> str:
        self.seen.append(messages[0]["content"])
        pieces = swarm.request_pieces(messages[0]["content"])
        if messages[-1]["role"] == "user":
            first = PROMPTS[pieces[0]]
            return tasks.format_tool_call(first.tool, first.args)
        return tasks.format_answer("no idea")


def test_frozen_sub_agents_do_the_spawned_pieces_with_their_own_model_and_the_policy_never_sees_them() -> None:
    """With a sub-agent model given, every spawned piece is sampled from it (batched apart from the policy's calls)
    and the policy answers only as the orchestrator."""
    cfg = _cfg()
    reqs = swarm_preflight.requests(cfg)
    policy, subagents = Clueless(), Scripted()
    spawn = swarm_preflight.run_mode("spawn", reqs, policy, cfg, subagents)
    assert all(r["success"] for r in spawn), "the sub-agents' model solves every piece"
    assert policy.seen == [], "a forced spawn never asks the policy, and its pieces go to the sub-agents' model"
    assert subagents.batches[0] == len(reqs)
    policy, subagents = Clueless(), Scripted()
    serial = swarm_preflight.run_mode("serial", reqs, policy, cfg, subagents)
    assert not any(r["success"] for r in serial) and subagents.batches == [], "serial: the policy alone, and it fails"
    assert all(len(swarm.request_pieces(text)) > 1 for text in policy.seen), "the policy saw only whole requests"


def test_the_cli_builds_the_swarm_policy_unless_current(monkeypatch: Any, tmp_path: Any) -> None:
    from flywheel.demo import warm_start

    built: list[Any] = []
    monkeypatch.setattr(swarm, "warm_start_model", lambda base, out: built.append(out))
    monkeypatch.setattr(warm_start, "is_current", lambda out, base, rule, settings=None: rule == "current")
    monkeypatch.setattr(swarm, "warm_rule", lambda: "stale")
    assert swarm.ensure_warm_model(tmp_path / "base", tmp_path / "warm") == tmp_path / "warm"
    assert built == [tmp_path / "warm"], "a fresh clone has no policy-v0: the pre-flight builds it"
    monkeypatch.setattr(swarm, "warm_rule", lambda: "current")
    swarm.ensure_warm_model(tmp_path / "base", tmp_path / "warm")
    assert len(built) == 1, "a current one is reused"
