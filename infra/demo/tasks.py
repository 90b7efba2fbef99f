"""The demo's verifiable task family: what the simulated production agent is asked, its tools, and the checker.

A task is a short user request that needs one tool call: look up a city's weather, country or
time zone (closed sets), or add or multiply two one-digit numbers. The model must write the
call as text, `<tool_call>{"name": "weather", "arguments": {"city": "oslo"}}</tool_call>`, read
the tool's reply (a `tool` message), then answer `Answer: cloudy 12C`. Some tasks ask for two
independent things ("add 3 and 4; weather in oslo"): the agent runs one sub-agent per part.

**The production drift the demo's RL adapts to.** The simulated harness changed after its
demonstrations were collected: the demonstrations come from three harness generations in equal
shares, each naming its tools its own way (`TOOL_NAMES`: add was `sum`, then `plus`, now `add`).
Production's tool server knows only the current generation's names; an older name gets the error a
real tool server gives (`error: unknown tool 'sum'`), which the agent reads and may retry on. No
offline demonstration can tell the model which convention production takes; RL on production
traffic can. The demo's lift measures that adaptation (and the sharpening of add/mul, a skill the
warm start half forms), not a new skill.

Everything is derived from a `TaskSpec` (a plain dict on the wire), so the verifier can
recompute the truth from the spec alone and re-check the agent's answer (`check`). The same
module writes the supervised demonstrations the warm start trains on, and `corpus_lines`
gives the tokenizer builder the task's vocabulary. Pure Python, no third-party imports.

The task space is split once, by a stable hash of each prompt, a (tool, args, phrasing)
combination: about 20% of the prompts of every tool are "heldout", the rest "train" (`split_of`).
The warm start trains on train prompts only and is measured on heldout ones, so its held-out
numbers are on request texts it never saw, while every city and operand still appears in
training; production traffic (`make_task`) draws from the whole space, in `PRODUCTION_MIX`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
import re
from dataclasses import asdict, dataclass
from typing import Any, Callable

LOOKUPS = ("weather", "country", "timezone")  # closed-set lookups of a city: the bulk of production traffic
ARITHMETIC = ("add", "mul")
TOOLS = LOOKUPS + ARITHMETIC  # each tool's id is also its name in production (the current generation)
# Small vocabularies on purpose: a 3M-parameter model learns to copy a digit or a city name into its call
# within a few hundred supervised steps; two-digit operands and 16 cities stayed at 0% after 200 steps.
CITIES = ("paris", "oslo", "rome", "lima", "cairo", "tokyo", "delhi", "quito")
SKIES = ("sunny", "cloudy", "rainy", "windy", "snowy", "foggy")
COUNTRY = {"paris": "france", "oslo": "norway", "rome": "italy", "lima": "peru", "cairo": "egypt",
           "tokyo": "japan", "delhi": "india", "quito": "ecuador"}
TIMEZONE = {"paris": "UTC+1", "oslo": "UTC+1", "rome": "UTC+1", "lima": "UTC-5", "cairo": "UTC+2",
            "tokyo": "UTC+9", "delhi": "UTC+5:30", "quito": "UTC-5"}
MAX_OPERAND = 9  # one-digit operands: copying them into the JSON call is the skill the tiny model learns

# The harness generations (oldest first) and the name each gave each tool; the last is production's. Every name
# is one token of the tokenizer (model_init adds them; tests/unit/test_warm_start.py checks it on the built model),
# so the conventions differ in one decision, not in length: a policy is not pushed toward a name for being shorter.
GENERATIONS = ("g1", "g2", "g3")
TOOL_NAMES: dict[str, tuple[str, str, str]] = {
    "weather": ("sky", "forecast", "weather"),
    "country": ("nation", "land", "country"),
    "timezone": ("zone", "tz", "timezone"),
    "add": ("sum", "plus", "add"),
    "mul": ("times", "prod", "mul"),
}
CURRENT = len(GENERATIONS) - 1
# Production's traffic: mostly lookups (the headroom the drift leaves is in every one of them), add/mul about a
# fifth (a half-formed skill RL sharpens), two-part requests about a tenth (make_task's multi_share).
PRODUCTION_MIX: dict[str, float] = {"weather": 0.8 / 3, "country": 0.8 / 3, "timezone": 0.8 / 3, "add": 0.1, "mul": 0.1}

# Several phrasings per tool, so the model must read the request rather than memorise one template.
_PHRASES: dict[str, tuple[str, ...]] = {
    "add": ("add {a} and {b}", "what is {a} plus {b}?", "sum of {a} and {b}", "{a} + {b} = ?"),
    "mul": ("multiply {a} by {b}", "what is {a} times {b}?", "product of {a} and {b}", "{a} * {b} = ?"),
    "weather": ("weather in {city}", "what is the weather in {city}?", "how is the weather in {city}?"),
    "country": ("which country is {city} in?", "country of {city}", "{city} is in which country?"),
    "timezone": ("time zone of {city}", "what time zone is {city} in?", "{city} time zone?"),
}
TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
ANSWER_RE = re.compile(r"^\s*Answer:\s*(.+?)\s*$", re.DOTALL)


@dataclass(frozen=True)
class Part:
    """One tool-sized piece of a task."""

    tool: str
    args: dict[str, Any]
    text: str  # the user's words for this piece


@dataclass(frozen=True)
class TaskSpec:
    """A task as the agent received it; `parts` has one entry, or several independent ones."""

    task_id: str
    parts: tuple[Part, ...]

    @property
    def text(self) -> str:
        return "; ".join(p.text for p in self.parts)

    @property
    def task_type(self) -> str:
        """tool_use.<tool> (tool_use.multi for a split task): rewards.toml's tool_use rules (wait for
        the verifier's task_success) apply to all of them, while the learner keeps its baseline per
        family. With one baseline for all, weather (about half solved by the warm start) set the
        bar: the rare add/mul successes earned little more than routine weather ones, and under
        --baseline none the policy learned to call weather for everything (30% wrong tools)."""
        return "tool_use.multi" if self.multi else f"tool_use.{self.parts[0].tool}"

    @property
    def multi(self) -> bool:
        return len(self.parts) > 1

    def to_json(self) -> dict[str, Any]:
        return {"task_id": self.task_id, "parts": [asdict(p) for p in self.parts]}

    @staticmethod
    def from_json(record: dict[str, Any]) -> "TaskSpec":
        try:
            parts = tuple(Part(str(p["tool"]), dict(p["args"]), str(p["text"])) for p in record["parts"])
            spec = TaskSpec(str(record["task_id"]), parts)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"task spec: malformed record {record!r} ({exc})") from exc
        for part in spec.parts:
            if part.tool not in TOOLS:
                raise ValueError(f"task spec: unknown tool {part.tool!r} in {record!r}")
        return spec


# ---------------------------------------------------------------------------------------------
# tools (deterministic, so the verifier can recompute every result)
# ---------------------------------------------------------------------------------------------
def weather_of(city: str) -> str:
    """A fixed fake forecast per city (stable across processes: no hash randomisation)."""
    code = sum(ord(c) * (i + 1) for i, c in enumerate(city))
    return f"{SKIES[code % len(SKIES)]} {code % 31 + 5}C"


def run_tool(name: str, arguments: Any) -> tuple[bool, str]:
    """Production's tool server: execute a call as the model wrote it; (ok, output). Bad calls get an error text,
    never raise. Only the current generation's names exist here: an older one is an unknown tool."""
    if not isinstance(arguments, dict):
        return False, "error: arguments must be an object"
    try:
        if name == "add":
            return True, str(int(arguments["a"]) + int(arguments["b"]))
        if name == "mul":
            return True, str(int(arguments["a"]) * int(arguments["b"]))
        if name in LOOKUPS:
            city = str(arguments["city"]).strip().lower()
            if city not in CITIES:
                return False, f"error: unknown city {city!r}"
            return True, lookup(name, city)
    except (KeyError, TypeError, ValueError) as exc:
        return False, f"error: bad arguments for {name} ({exc.__class__.__name__})"
    return False, f"error: unknown tool {name!r}"


def lookup(tool: str, city: str) -> str:
    """The closed-set lookups' answers."""
    if tool == "weather":
        return weather_of(city)
    return COUNTRY[city] if tool == "country" else TIMEZONE[city]


def generation_of(name: Any) -> tuple[str, int] | None:
    """(tool, generation index) a tool name belongs to; None for a name no generation used."""
    for tool, names in TOOL_NAMES.items():
        if name in names:
            return tool, names.index(name)
    return None


def truth(part: Part) -> str:
    """The correct final answer to one part."""
    ok, output = run_tool(part.tool, part.args)
    assert ok, f"task generator produced an unsolvable part {part}"
    return output


# ---------------------------------------------------------------------------------------------
# generation
# ---------------------------------------------------------------------------------------------
def make_part(rng: random.Random, split: str | None = None, mix: dict[str, float] | None = None) -> Part:
    """A random part of the whole task space, or of one split ("train", "heldout").

    The tool is uniform (the demonstrations' and evaluations' draw) or drawn by `mix` (production's, PRODUCTION_MIX);
    within a split the (args, phrasing) are uniform among the split's own."""
    assert split is None or split in SPLITS, f"make_part: unknown split {split!r}; use one of {SPLITS}"
    while True:
        tool = rng.choices(list(mix), weights=list(mix.values()))[0] if mix else rng.choice(TOOLS)
        if tool in LOOKUPS:
            args: dict[str, Any] = {"city": rng.choice(CITIES)}
        else:
            args = {"a": rng.randint(0, MAX_OPERAND), "b": rng.randint(0, MAX_OPERAND)}
        phrasing = rng.randrange(len(_PHRASES[tool]))  # the same draw as rng.choice(_PHRASES[tool])
        if split is None or split_of(tool, args, phrasing) == split:
            return Part(tool, args, _PHRASES[tool][phrasing].format(**args))


# ---------------------------------------------------------------------------------------------
# the split of the task space: what the warm start may train on and what it is measured on
# ---------------------------------------------------------------------------------------------
SPLITS = ("train", "heldout")
HELDOUT_SHARE = 0.2  # of each tool's prompts
# The unit is the prompt, (tool, args, phrasing), as issue 18 words it ("held-out prompts are disjoint from
# every prompt the warm start trains on"). A first split by (tool, args) held out whole cities (2 of 8) that
# no demonstration ever named; the tiny model cannot copy a name it never saw, so the held-out loss rose from
# step 50 and the warm start kept step 50's weights (held-out success 0.8%). By prompt, every city and
# operand is trained on and only the request texts are held out.
Prompt = tuple[str, dict[str, Any], int]  # (tool, args, index into _PHRASES[tool])


def task_space() -> list[Prompt]:
    """Every prompt the generator can draw: each (tool, args) combination in each of its tool's phrasings."""
    combos: list[tuple[str, dict[str, Any]]] = [(tool, {"city": c}) for tool in LOOKUPS for c in CITIES]
    for tool in ARITHMETIC:
        combos += [(tool, {"a": a, "b": b}) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]
    assert {t for t, _ in combos} == set(TOOLS), "task_space: a tool of TOOLS is not enumerated"
    return [(tool, args, i) for tool, args in combos for i in range(len(_PHRASES[tool]))]


def prompt_text(tool: str, args: dict[str, Any], phrasing: int) -> str:
    """The user's words for a prompt of the space."""
    return _PHRASES[tool][phrasing].format(**args)


def phrasing_of(part: Part) -> int:
    """The index of the phrasing `part.text` was written in (ValueError for a text no phrasing gives)."""
    for i in range(len(_PHRASES.get(part.tool, ()))):
        if prompt_text(part.tool, part.args, i) == part.text:
            return i
    raise ValueError(f"phrasing_of: {part.text!r} is no phrasing of {part.tool} {part.args}")


def part_key(tool: str, args: dict[str, Any], phrasing: int) -> str:
    """A prompt's identity: the tool, its arguments (sorted) and the phrasing."""
    return json.dumps([tool, args, phrasing], sort_keys=True)


def _stable_hash(key: str) -> int:
    # not hash(): Python salts str hashes per process, and the split must be the same in every process and run
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")


@functools.lru_cache(maxsize=1)
def heldout_keys() -> frozenset[str]:
    """The held-out prompts: per tool, the HELDOUT_SHARE of its prompts with the smallest stable hash.

    Ranking within each tool, rather than thresholding one hash over the whole space, guarantees both
    splits hold every tool (a threshold can leave weather, with 24 prompts, with none held out)."""
    by_tool: dict[str, list[str]] = {}
    for tool, args, phrasing in task_space():
        by_tool.setdefault(tool, []).append(part_key(tool, args, phrasing))
    held: set[str] = set()
    for keys in by_tool.values():
        k = min(len(keys) - 1, max(1, round(HELDOUT_SHARE * len(keys))))
        held.update(sorted(keys, key=_stable_hash)[:k])
    return frozenset(held)


def split_of(tool: str, args: dict[str, Any], phrasing: int) -> str:
    """"heldout" or "train": which side of the warm start's split the prompt is on."""
    return "heldout" if part_key(tool, args, phrasing) in heldout_keys() else "train"


def make_task(rng: random.Random, multi_share: float = 0.2, task_id: str | None = None,
              mix: dict[str, float] | None = PRODUCTION_MIX) -> TaskSpec:
    """A random production task, its tools drawn by `mix`; with probability multi_share it has two independent
    parts (run by sub-agents)."""
    n_parts = 2 if rng.random() < multi_share else 1
    parts = tuple(make_part(rng, mix=mix) for _ in range(n_parts))
    return TaskSpec(task_id or f"t{rng.getrandbits(48):012x}", parts)


# ---------------------------------------------------------------------------------------------
# the protocol between model and agent
# ---------------------------------------------------------------------------------------------
def format_tool_call(tool: str, args: dict[str, Any]) -> str:
    return "<tool_call>" + json.dumps({"name": tool, "arguments": args}) + "</tool_call>"


def format_answer(result: str) -> str:
    return f"Answer: {result}"


@dataclass(frozen=True)
class ParsedReply:
    """What the agent makes of one model reply."""

    kind: str  # "tool_call", "malformed_call" or "answer"
    tool: str | None = None
    arguments: Any = None
    answer: str | None = None


def parse_reply(text: str) -> ParsedReply:
    """Read a model reply: a tool call (well-formed or not) or a final answer.

    A call must be the whole reply: text before or after it makes the call malformed. A lenient
    parser (first call wins, the rest ignored) let a policy that stopped emitting its end token
    still succeed; the rambling went unpenalised and RL spread it (a third of the demo's calls
    ran to max_tokens after ~20 steps).
    """
    match = TOOL_CALL_RE.search(text)
    if match is None:
        if TOOL_CALL_OPEN in text:
            return ParsedReply("malformed_call")  # started a call and never closed it
        answer = ANSWER_RE.match(text)
        return ParsedReply("answer", answer=(answer.group(1) if answer else text).strip())
    if text[:match.start()].strip() or text[match.end():].strip():
        return ParsedReply("malformed_call")
    try:
        payload = json.loads(match.group(1))
    except json.JSONDecodeError:
        return ParsedReply("malformed_call")
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return ParsedReply("malformed_call")
    return ParsedReply("tool_call", tool=payload["name"], arguments=payload.get("arguments"))


TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"


def _common_prefix(text: str, at: int, word: str) -> int:
    """How many leading characters of `word` text repeats from `at`."""
    k = 0
    while k < len(word) and at + k < len(text) and text[at + k] == word[k]:
        k += 1
    return k


def _skip_space(text: str, at: int) -> int:
    return len(text) - len(text[at:].lstrip()) if text[at:].strip() else len(text)


def malformed_from(text: str) -> int:
    """The character of a malformed reply from which it stopped being a well-formed call.

    The malformed-call penalty is charged from the token holding this character on (the harness logs
    it as the tool_call's malformed_token). Charged to the whole reply, the penalty also pushed down a
    well-formed prefix such as `<tool_call>{"name": "spawn", "arguments": {"tasks": [` before a
    broken sub-task string: in swarm run e, 37% of spawn attempts were malformed, and the penalty
    on their valid prefix taught the policy not to start a spawn at all. Reading rules, in the order
    parse_reply applies them: text before the call (from its first character); a broken opening tag
    (from the first character that leaves `<tool_call>`); JSON that does not parse (where the decoder
    stopped); JSON that parses but is not a call (from the call's body); a broken or missing closing tag
    or text after it (from there). A reply parse_reply accepts is a call whose arguments the tool
    refused (a spawn without tasks): from its "arguments".
    """
    start = _skip_space(text, 0)
    opened = text.find(TOOL_CALL_OPEN)
    if opened < 0 or text[:opened].strip():
        if opened < 0:
            return start + _common_prefix(text, start, TOOL_CALL_OPEN)
        return start
    body = _skip_space(text, opened + len(TOOL_CALL_OPEN))
    try:
        payload, end = json.JSONDecoder().raw_decode(text, body)
    except json.JSONDecodeError as e:
        return min(max(e.pos, body), len(text))
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return body
    close = _skip_space(text, end)
    if _common_prefix(text, close, TOOL_CALL_CLOSE) < len(TOOL_CALL_CLOSE):
        return close + _common_prefix(text, close, TOOL_CALL_CLOSE)
    after = close + len(TOOL_CALL_CLOSE)
    if text[after:].strip():
        return _skip_space(text, after)
    arguments = text.find('"arguments"', body, end)
    return arguments if arguments >= 0 else body


def token_at(decode: Callable[[list[int]], str], token_ids: list[int], text: str, char: int) -> int | None:
    """Index of the token of `token_ids` that holds character `char` of `text`, the reply they decode to.

    A character at or past the end (a call never closed) is the last token's: the stop token, or the
    token where max_tokens cut the reply. None when the ids do not decode to the text (the penalty then
    falls on the whole reply). Binary search on the length of decoded prefixes, which never shrinks as
    tokens are added.
    """
    if not token_ids or char < 0 or decode(token_ids) != text:
        return None
    if char >= len(text):
        return len(token_ids) - 1
    lo, hi = 0, len(token_ids) - 1
    while lo < hi:  # the first k with len(decode(ids[:k + 1])) > char
        mid = (lo + hi) // 2
        if len(decode(token_ids[:mid + 1])) > char:
            hi = mid
        else:
            lo = mid + 1
    return lo


def recorded_answer(answers: list[Any], i: int) -> str | None:
    """Part i's answer in a hand-off line's `answers` (None when it is missing or not text: a wrong answer)."""
    return answers[i] if i < len(answers) and isinstance(answers[i], str) else None


def check_part(part: Part, answer: str | None) -> bool:
    """The verifier's check: the final answer equals the recomputed truth (case and spacing aside)."""
    if answer is None:
        return False
    return " ".join(answer.lower().split()) == " ".join(truth(part).lower().split())


def check(spec: TaskSpec, answers: list[str | None]) -> bool:
    """A session succeeds when every part got its correct answer."""
    return len(answers) == len(spec.parts) and all(check_part(p, a) for p, a in zip(spec.parts, answers))


# ---------------------------------------------------------------------------------------------
# one part's dialogue, shared by the agent (through the proxy) and the warm start's evaluation
# ---------------------------------------------------------------------------------------------
Message = dict[str, Any]
# generate(messages) -> the assistant's reply text
Generate = Callable[[list[Message]], str]


@dataclass
class TaskTurn:
    """One exchange: what the model said and what the agent did with it (for logging)."""

    reply: str
    parsed: ParsedReply
    tool_ok: bool | None = None
    tool_output: str | None = None


def user_message(part: Part) -> Message:
    return {"role": "user", "content": part.text}


def tool_message(output: str, call_id: str) -> Message:
    return {"role": "tool", "content": output, "tool_call_id": call_id}


def demonstration(part: Part, generation: int = CURRENT) -> list[Message]:
    """The ideal dialogue for one part as the harness of `generation` ran it: call the right tool by that
    generation's name, then answer with its result."""
    call_id = "call0"
    return [
        user_message(part),
        {"role": "assistant", "content": format_tool_call(TOOL_NAMES[part.tool][generation], part.args)},
        tool_message(truth(part), call_id),
        {"role": "assistant", "content": format_answer(truth(part))},
    ]


def corpus_lines(n: int, seed: int = 1) -> list[str]:
    """Task texts for the tokenizer's BPE training, so its merges fit requests, calls (every generation's tool
    names) and answers."""
    rng = random.Random(seed)
    lines: list[str] = []
    while len(lines) < n:
        part = make_part(rng)
        result = truth(part)
        name = TOOL_NAMES[part.tool][rng.randrange(len(GENERATIONS))]
        lines += [part.text, format_tool_call(name, part.args), result, format_answer(result)]
    return lines[:n]


def compact(messages: list[Message], budget_chars: int) -> tuple[list[Message], list[Message], Message | None]:
    """Summarise a history past its budget: the failed exchanges between the request and the latest
    exchange are replaced by one short note. Returns (new messages, removed messages, the note or None)."""
    if sum(len(str(m.get("content", ""))) for m in messages) <= budget_chars or len(messages) <= 3:
        return messages, [], None
    removed = messages[1:-2]
    if not removed:
        return messages, [], None
    failed = sum(1 for m in removed if m["role"] == "tool")
    note: Message = {"role": "user", "content": f"({failed} earlier tool calls removed; try again)"}
    return [messages[0], note, *messages[-2:]], removed, note


def solve_part(part: Part, generate: Generate, max_turns: int = 3, budget_chars: int = 400,
               on_turn: Callable[[TaskTurn], None] | None = None,
               on_compact: Callable[[list[Message], Message], None] | None = None) -> tuple[str | None, list[TaskTurn]]:
    """Run the tool-use dialogue for one part; returns (final answer or None, the turns).

    The model gets at most max_turns replies; a malformed or failed call is answered with the
    tool's error text so the model can retry, as a production harness would.
    """
    messages: list[Message] = [user_message(part)]
    turns: list[TaskTurn] = []
    for i in range(max_turns):
        messages, removed, note = compact(messages, budget_chars)
        if note is not None and on_compact is not None:
            on_compact(removed, note)
        reply = generate(messages)
        parsed = parse_reply(reply)
        turn = TaskTurn(reply, parsed)
        turns.append(turn)
        messages.append({"role": "assistant", "content": reply})
        if parsed.kind == "answer":
            if on_turn is not None:
                on_turn(turn)
            return parsed.answer, turns
        if parsed.kind == "tool_call":
            turn.tool_ok, turn.tool_output = run_tool(parsed.tool or "", parsed.arguments)
        else:
            turn.tool_ok, turn.tool_output = False, "error: malformed tool call"
        if on_turn is not None:
            on_turn(turn)
        messages.append(tool_message(turn.tool_output, f"call{i}"))
    return None, turns


def call_is_correct(part: Part, reply: str, any_generation: bool = False) -> bool:
    """The first turn of a part is right when it calls the right tool with the right arguments."""
    parsed = parse_reply(reply)
    return parsed.kind == "tool_call" and call_matches(part, parsed.tool, parsed.arguments, any_generation)


def call_matches(part: Part, tool: Any, arguments: Any, any_generation: bool = False) -> bool:
    """A parsed tool call is the part's: its tool (by production's name; with any_generation, by any generation's
    name for it), and arguments whose result is the part's truth."""
    named = generation_of(tool) if any_generation else None
    if (tool != part.tool and (named is None or named[0] != part.tool)) or not isinstance(arguments, dict):
        return False
    ok, output = run_tool(part.tool, arguments)
    return ok and output == truth(part)


def eval_tasks_16() -> list[Any]:
    """The first 16 of eval_tasks: for a model whose 64 greedy first turns take minutes on CPU (the smollm2 recipe)."""
    return eval_tasks(16)


def eval_tasks(n: int = 64, seed: int = 7) -> list[Any]:
    """The promotion gate's offline set (serving.evaluate's "module:function" hook): first turns of held-out parts."""
    from flywheel.serving.evaluate import EvalTask

    rng = random.Random(seed)
    out = []
    for i in range(n):
        part = make_part(rng)
        out.append(EvalTask(task_id=f"tool-{i}", messages=[user_message(part)],
                            check=functools.partial(call_is_correct, part), max_tokens=40))
    return out
