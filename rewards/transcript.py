"""What the LLM judge reads: a session's whole trajectory rendered as text, cut to a token budget.

The trajectory is every agent's turns in order (main agent first, then each sub-agent): the user's
request (the main agent's first prompt), each completion, tool call and tool result, sub-agent
spawns and finishes, context edits and how the session ended. Text fields are the logged (redacted)
ones; a field logged without text is named by its size, never guessed.

Truncation rule (`fit`), with tokens estimated as ceil(UTF-8 bytes / chars_per_token), because
the builder does not hold the judge's tokenizer (a hosted judge's is not public):
1. the request is kept, its text cut to its last third of the budget (the user's message ends a
   rendered prompt; a system prompt leads it);
2. every tool result's header line (tool name and ok) is kept, so the judge sees what each call
   achieved even where the output is gone (only past what is left minus a quarter of the budget,
   kept for the last turns, do the oldest headers go too);
3. the rest of the budget goes to whole turns from the last backwards (the answer and the
   turns before it); the first turn that does not fit whole keeps the tail of its text that fits;
   older turns are left out, with one marker line saying how many.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from flywheel.rewards.session import SessionEvents, agent_order

HEADER_CHARS = 120  # a header line is cut to this many characters
MARKER = "[... {} turns left out ...]"  # where rule 3 left turns out (tool results keep their headers)


@dataclass(frozen=True)
class TranscriptStep:
    """One rendered step: a header line and its text (either may be empty)."""

    header: str
    body: str = ""
    tool_result: bool = False  # its header survives any cut (rule 2)

    def text(self) -> str:
        return f"{self.header}\n{self.body}" if self.body else self.header


def tokens(text: str, chars_per_token: float) -> int:
    """The token estimate the rule uses."""
    return math.ceil(len(text.encode()) / chars_per_token)


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= HEADER_CHARS else text[: HEADER_CHARS - 3] + "..."


def _event_turn(e: dict[str, Any]) -> TranscriptStep | None:
    kind = e["type"]
    if kind == "llm_call":
        text = e.get("completion_text")
        return TranscriptStep("[assistant]", text if text is not None
                              else f"(text not logged: {len(e.get('completion_token_ids') or [])} tokens)")
    if kind == "traced_llm_call":  # known from a trace: text if the span carried it, else its token count
        text = e.get("completion_text")
        return TranscriptStep(f"[assistant, traced: {e.get('model')}]", text if text is not None
                              else f"(text not in the trace: {e.get('output_tokens') or '?'} tokens)")
    if kind == "tool_call":
        bad = " MALFORMED" if e.get("malformed") else ""
        return TranscriptStep(f"[tool call{bad}] {_short(e.get('name') or '?')}({_short(e.get('arguments') or '')})")
    if kind == "tool_result":
        return TranscriptStep(f"[tool result] {_short(e.get('name') or e.get('call_id') or '?')} ok={e.get('ok')}",
                    e.get("output") or "", tool_result=True)
    if kind == "subagent_spawn":
        return TranscriptStep(f"[spawned sub-agent {e.get('child_agent_id')}] {_short(e.get('subtask') or '')}")
    if kind == "subagent_finish":
        return TranscriptStep(f"[sub-agent {e.get('child_agent_id')} finished] ok={e.get('ok')}")
    if kind == "context_edit":
        return TranscriptStep(f"[context {e.get('edit_kind')}: {e.get('tokens_removed')} tokens removed]")
    if kind == "session_end":
        return TranscriptStep(f"[session end] status={e.get('status')}")
    return None


def render(s: SessionEvents) -> tuple[TranscriptStep, list[TranscriptStep]]:
    """(the request, every other turn in order) of a session."""
    main_calls = [e for e in s.agents.get(s.main_agent, []) if e["type"] in ("llm_call", "traced_llm_call")]
    first = main_calls[0] if main_calls else None
    if first is None:
        request = TranscriptStep("[request]", "(no llm_call)")
    elif first.get("prompt_text") is not None:
        request = TranscriptStep("[request]", first["prompt_text"])
    else:
        request = TranscriptStep("[request]", f"(prompt not logged: {len(first.get('prompt_token_ids') or [])} tokens)")
    turns: list[TranscriptStep] = []
    for agent in agent_order(s):
        if agent != s.main_agent:
            turns.append(TranscriptStep(f"== sub-agent {agent} (of {s.parent.get(agent)}) =="))
        turns.extend(t for t in map(_event_turn, s.agents[agent]) if t is not None)
    return request, turns


def _tail(text: str, budget_tokens: int, chars_per_token: float) -> str:
    """The end of `text` that fits `budget_tokens` (by the estimate), marked as cut."""
    if tokens(text, chars_per_token) <= budget_tokens:
        return text
    keep = max(0, int(budget_tokens * chars_per_token) - 16)
    cut = text.encode()[-keep:].decode(errors="ignore") if keep else ""
    return "[...cut...]" + cut


def fit(request: TranscriptStep, turns: list[TranscriptStep], max_tokens: int, chars_per_token: float) -> str:
    """The transcript under `max_tokens` by the module's rule."""
    req = TranscriptStep(request.header, _tail(request.body, max_tokens // 3, chars_per_token)).text()
    left = max_tokens - tokens(req, chars_per_token)
    # rule 2: tool result headers, newest first, leaving a quarter of the budget for the last turns
    header_cost = {i: tokens(t.header, chars_per_token) + 1 for i, t in enumerate(turns) if t.tool_result}
    kept_headers: set[int] = set()
    for i in sorted(header_cost, reverse=True):
        if sum(header_cost[j] for j in kept_headers) + header_cost[i] > left - max_tokens // 4:
            break
        kept_headers.add(i)
    left -= tokens(MARKER.format(len(turns)), chars_per_token) + 1  # the marker line of rule 3
    left -= sum(header_cost[i] for i in kept_headers)
    # rule 3: whole turns from the last backwards; the first that does not fit keeps its tail
    shown: dict[int, str] = {i: turns[i].header for i in kept_headers}
    for i in range(len(turns) - 1, -1, -1):
        full = turns[i].text()
        extra = tokens(full, chars_per_token) + 1 - (header_cost.get(i, 0) if i in kept_headers else 0)
        if extra <= left:
            shown[i], left = full, left - extra
            continue
        if left > 8:
            shown[i] = turns[i].header + "\n" + _tail(turns[i].body,
                                                      left - tokens(turns[i].header, chars_per_token) - 1,
                                                      chars_per_token) if turns[i].body else shown.get(i, "")
        break
    out = [req]
    omitted = sum(1 for i in range(len(turns)) if not shown.get(i))
    for i in range(len(turns)):
        if shown.get(i):
            out.append(shown[i])
        elif omitted:  # one marker, where the first gap is
            out.append(MARKER.format(omitted))
            omitted = 0
    return "\n".join(out)


def transcript(s: SessionEvents, max_tokens: int, chars_per_token: float) -> str:
    """The judge's view of a session (see the module docstring)."""
    request, turns = render(s)
    return fit(request, turns, max_tokens, chars_per_token)
