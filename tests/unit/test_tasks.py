"""The demo task family: generation, the tools, the reply parser, the checker and the dialogue loop."""

from __future__ import annotations

import random

import pytest

from flywheel.demo import tasks


def _spec(tool: str, args: dict, text: str = "x") -> tasks.TaskSpec:
    return tasks.TaskSpec("t1", (tasks.Part(tool, args, text),))


def test_generated_tasks_are_solvable_and_round_trip_through_json() -> None:
    rng = random.Random(0)
    specs = [tasks.make_task(rng, multi_share=0.5) for _ in range(300)]
    assert {s.multi for s in specs} == {True, False}
    assert {s.task_type for s in specs} == {f"tool_use.{t}" for t in tasks.TOOLS} | {"tool_use.multi"}
    assert {p.tool for s in specs for p in s.parts} == set(tasks.TOOLS)
    for spec in specs:
        again = tasks.TaskSpec.from_json(spec.to_json())
        assert again == spec
        # the ideal answers pass the checker, a wrong one fails it
        assert tasks.check(spec, [tasks.truth(p) for p in spec.parts])
        assert not tasks.check(spec, [tasks.truth(p) + "1" for p in spec.parts])


def test_from_json_rejects_malformed_specs_with_a_clear_error() -> None:
    with pytest.raises(ValueError, match="malformed"):
        tasks.TaskSpec.from_json({"task_id": "x"})
    with pytest.raises(ValueError, match="unknown tool 'rm'"):
        tasks.TaskSpec.from_json({"task_id": "x", "parts": [{"tool": "rm", "args": {}, "text": "rm"}]})


def test_tools_compute_and_refuse_bad_arguments_without_raising() -> None:
    assert tasks.run_tool("add", {"a": 37, "b": 58}) == (True, "95")
    assert tasks.run_tool("mul", {"a": "6", "b": 7}) == (True, "42")
    ok, out = tasks.run_tool("weather", {"city": "Oslo"})
    assert ok and out == tasks.weather_of("oslo")
    assert tasks.run_tool("weather", {"city": "atlantis"})[0] is False
    assert tasks.run_tool("add", {"a": 1})[0] is False
    assert tasks.run_tool("add", [1, 2])[0] is False
    assert tasks.run_tool("sub", {"a": 1, "b": 2})[0] is False
    assert tasks.run_tool("country", {"city": "lima"}) == (True, "peru")
    assert tasks.run_tool("timezone", {"city": "delhi"}) == (True, "UTC+5:30")


def test_production_knows_only_the_current_generations_tool_names() -> None:
    # the drift the demo's RL adapts to: an older harness's name is an unknown tool, with an error the agent can read
    for tool, names in tasks.TOOL_NAMES.items():
        assert names[tasks.CURRENT] == tool and len(set(names)) == len(tasks.GENERATIONS)
        args = {"city": "oslo"} if tool in tasks.LOOKUPS else {"a": 2, "b": 3}
        assert tasks.run_tool(tool, args)[0]
        for old in names[:tasks.CURRENT]:
            assert tasks.run_tool(old, args) == (False, f"error: unknown tool {old!r}")
            assert tasks.generation_of(old) == (tool, names.index(old))
    every = [n for names in tasks.TOOL_NAMES.values() for n in names]
    assert len(every) == len(set(every)), "a name shared by two tools would make the convention ambiguous"
    part = tasks.Part("add", {"a": 2, "b": 3}, "add 2 and 3")
    old_call = tasks.format_tool_call("sum", {"a": 2, "b": 3})
    assert not tasks.call_is_correct(part, old_call) and tasks.call_is_correct(part, old_call, any_generation=True)
    assert not tasks.call_is_correct(part, tasks.format_tool_call("times", {"a": 2, "b": 3}), any_generation=True)
    assert tasks.demonstration(part, 0)[1]["content"] == old_call
    assert tasks.demonstration(part)[1]["content"] == tasks.format_tool_call("add", {"a": 2, "b": 3})


def test_production_traffic_is_mostly_lookups_with_arithmetic_about_a_fifth() -> None:
    rng = random.Random(11)
    parts = [p for _ in range(4000) for p in tasks.make_task(rng, multi_share=0.1).parts]
    share = {t: sum(p.tool == t for p in parts) / len(parts) for t in tasks.TOOLS}
    assert abs(share["add"] + share["mul"] - 0.2) < 0.03, share
    for tool in tasks.LOOKUPS:
        assert abs(share[tool] - 0.8 / 3) < 0.03, share
    uniform = [tasks.make_part(rng) for _ in range(3000)]
    assert min(sum(p.tool == t for p in uniform) for t in tasks.TOOLS) > 500, "demonstrations draw tools uniformly"


def test_weather_is_deterministic_across_processes() -> None:
    # the verifier runs in another process: the forecast must not depend on hash randomisation
    assert tasks.weather_of("paris") == tasks.weather_of("paris")
    assert len({tasks.weather_of(c) for c in tasks.CITIES}) > len(tasks.CITIES) // 2
    assert set(tasks.COUNTRY) == set(tasks.TIMEZONE) == set(tasks.CITIES)


def test_parse_reply_reads_calls_answers_and_malformed_calls() -> None:
    call = tasks.parse_reply(tasks.format_tool_call("add", {"a": 1, "b": 2}))
    assert (call.kind, call.tool, call.arguments) == ("tool_call", "add", {"a": 1, "b": 2})
    assert tasks.parse_reply("<tool_call>{\"name\": \"add\", \"argu").kind == "malformed_call"
    assert tasks.parse_reply("<tool_call>{not json}</tool_call>").kind == "malformed_call"
    assert tasks.parse_reply("<tool_call>[1, 2]</tool_call>").kind == "malformed_call"
    good = tasks.format_tool_call("add", {"a": 1, "b": 2})
    assert tasks.parse_reply(f"  {good}\n").kind == "tool_call", "whitespace around the call is fine"
    assert tasks.parse_reply(good + '{"name": nswer').kind == "malformed_call", "rambling after the call"
    assert tasks.parse_reply("Sure. " + good).kind == "malformed_call", "text before the call"
    answer = tasks.parse_reply("Answer:  95 ")
    assert (answer.kind, answer.answer) == ("answer", "95")
    assert tasks.parse_reply("I think 95").answer == "I think 95"


def test_checker_is_strict_about_the_value_and_lenient_about_spacing() -> None:
    spec = _spec("add", {"a": 37, "b": 58})
    assert tasks.check(spec, ["95"])
    assert tasks.check(spec, [" 95 "])
    assert not tasks.check(spec, ["96"])
    assert not tasks.check(spec, ["the answer is 95"])
    assert not tasks.check(spec, [None])
    assert not tasks.check(spec, [])
    weather = _spec("weather", {"city": "rome"})
    assert tasks.check(weather, [tasks.weather_of("rome").upper()])


def _scripted(replies: list[str]) -> tasks.Generate:
    it = iter(replies)
    seen: list[list[tasks.Message]] = []

    def generate(messages: list[tasks.Message]) -> str:
        seen.append([dict(m) for m in messages])
        return next(it)

    generate.seen = seen  # type: ignore[attr-defined]
    return generate


def test_solve_part_follows_the_demonstrated_protocol() -> None:
    part = tasks.Part("add", {"a": 37, "b": 58}, "add 37 and 58")
    demo = tasks.demonstration(part)
    gen = _scripted([demo[1]["content"], demo[3]["content"]])
    answer, turns = tasks.solve_part(part, gen)
    assert answer == "95" and [t.parsed.kind for t in turns] == ["tool_call", "answer"]
    assert turns[0].tool_ok and turns[0].tool_output == "95"
    # the second prompt is exactly the demonstration's history: training and serving see the same dialogue
    assert [m["content"] for m in gen.seen[1]] == [m["content"] for m in demo[:3]]  # type: ignore[attr-defined]


def test_solve_part_retries_after_a_bad_call_and_gives_up_after_max_turns() -> None:
    part = tasks.Part("mul", {"a": 3, "b": 4}, "multiply 3 by 4")
    gen = _scripted(["<tool_call>oops</tool_call>", tasks.format_tool_call("mul", {"a": 3, "b": 4}), "Answer: 12"])
    answer, turns = tasks.solve_part(part, gen)
    assert answer == "12" and turns[0].tool_ok is False and "malformed" in (turns[0].tool_output or "")
    gen = _scripted(["<tool_call>x</tool_call>"] * 3)
    answer, turns = tasks.solve_part(part, gen, max_turns=3)
    assert answer is None and len(turns) == 3


def test_history_past_the_budget_is_summarised_once_and_reported() -> None:
    part = tasks.Part("add", {"a": 1, "b": 2}, "add 1 and 2")
    bad = "<tool_call>" + "x" * 200 + "</tool_call>"
    gen = _scripted([bad, bad, bad, "Answer: 3"])
    edits: list[tuple[int, str]] = []
    answer, _ = tasks.solve_part(part, gen, max_turns=4, budget_chars=300,
                                 on_compact=lambda removed, note: edits.append((len(removed), note["content"])))
    assert answer == "3"
    assert edits and edits[0][0] == 2 and "1 earlier" in edits[0][1], edits
    last_prompt = gen.seen[-1]  # type: ignore[attr-defined]
    assert sum(len(m["content"]) for m in last_prompt) < 4 * len(bad), "the summarised history should be shorter"


def test_corpus_lines_cover_the_task_vocabulary() -> None:
    lines = tasks.corpus_lines(400)
    assert len(lines) == 400
    text = "\n".join(lines)
    for needle in ("<tool_call>", '"arguments"', "Answer:", "weather in", "multiply"):
        assert needle in text


def test_call_is_correct_accepts_equivalent_arguments_only() -> None:
    part = tasks.Part("add", {"a": 37, "b": 58}, "add 37 and 58")
    assert tasks.call_is_correct(part, tasks.format_tool_call("add", {"a": 37, "b": 58}))
    assert tasks.call_is_correct(part, tasks.format_tool_call("add", {"b": 58, "a": 37}))
    assert not tasks.call_is_correct(part, tasks.format_tool_call("add", {"a": 37, "b": 59}))
    assert not tasks.call_is_correct(part, tasks.format_tool_call("mul", {"a": 37, "b": 58}))
    assert not tasks.call_is_correct(part, "Answer: 95")


@pytest.mark.parametrize("reply, kept", [
    ('<tool_call>{"name": "spawny 9, "b": 0}}</tool_call>', '<tool_call>{"name": "spawny 9, "'),
    ('<tool_call>{"name": "spawn", "arguments": {"tasks": ["add 3 and 4", "weather in oslo]}}</tool_call>',
     '<tool_call>{"name": "spawn", "arguments": {"tasks": ["add 3 and 4", '),
    ('<tool_call>{"name": "spawn", "arguments": {"tasks": []}}</tool_call>', '<tool_call>{"name": "spawn", '),
    ('<tool_call>{"name": "add", "arguments": {}}</tool_call> x', '<tool_call>{"name": "add", "arguments": {}}</tool_call> '),
    ('<tool_call>{"name": "add", "arguments": {}}</tool_ca', '<tool_call>{"name": "add", "arguments": {}}</tool_ca'),
    ('<tool_call>[1]</tool_call>', '<tool_call>'),
    ('Sure. <tool_call>{}</tool_call>', ''),
    ('  <tool_cal{"name": "add"}', '  <tool_cal'),
])
def test_malformed_from_keeps_the_prefix_that_still_reads_as_a_call(reply: str, kept: str) -> None:
    assert reply[:tasks.malformed_from(reply)] == kept


def test_token_at_finds_the_token_holding_a_character() -> None:
    pieces = ["<tool_call>", '{"name":', ' "sp', 'awn"', "}", "</tool_call>", ""]  # the last: a stop token
    decode = lambda ids: "".join(pieces[i] for i in ids)  # noqa: E731
    ids = list(range(len(pieces)))
    text = decode(ids)
    assert [tasks.token_at(decode, ids, text, c) for c in (0, 10, 11, 18, 19, 23)] == [0, 0, 1, 1, 2, 3]
    assert tasks.token_at(decode, ids, text, len(text)) == len(ids) - 1, "never closed: the last token"
    assert tasks.token_at(decode, ids, text + "x", 3) is None, "ids that are not the text: unknown"
    assert tasks.token_at(decode, [], "", 0) is None
