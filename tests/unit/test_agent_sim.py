"""The tool-use agent says where a malformed call broke: the token the malformed-call penalty is charged from."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from flywheel.demo import tasks
from flywheel.demo.agent_sim import AgentSim, AgentSimConfig

BASE = Path(__file__).resolve().parents[2] / "var" / "models" / "tiny-base"  # make test's `model` target builds it


class _Client:
    """The OpenAI client's one call the agent makes; each reply comes with its completion token ids, as the proxy
    returns them under return_token_ids (the tokenizer's ids of the text, then the stop token)."""

    def __init__(self, replies: list[str], tok: Any, eos: int) -> None:
        self.replies, self.tok, self.eos, self.asked = list(replies), tok, eos, []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    def create(self, **kw: Any) -> Any:
        self.asked.append(kw.get("extra_body"))
        text = self.replies.pop(0)
        ids = self.tok.encode(text).ids + [self.eos]
        return SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(content=text), token_ids=ids)])


class _Agent:
    session_id, agent_id, parent_agent_id = "s", "main", None

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def tool_call(self, name: Any = None, arguments: Any = None, malformed: Any = None,
                  malformed_token: Any = None) -> str:
        self.calls.append({"name": name, "malformed": malformed, "malformed_token": malformed_token})
        return f"c{len(self.calls)}"

    def tool_result(self, *args: Any, **kwargs: Any) -> None:
        pass

    def context_edit(self, *args: Any, **kwargs: Any) -> None:  # the agent summarises two failed calls
        pass


def test_a_malformed_call_names_the_token_it_broke_at_and_a_good_call_none() -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(BASE / "tokenizer.json"))
    eos = tok.token_to_id("<|im_end|>")
    cut = '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 0}}</'  # run 12's v1: stopped inside the closing tag
    garbled = '<tool_call>{"name": "add", "arguments": {"a": "lor "b": 5}}</tool_call>'
    good = tasks.format_tool_call("add", {"a": 3, "b": 4})
    client = _Client([cut, garbled, good], tok, eos)
    sim = AgentSim(AgentSimConfig(tokenizer=str(BASE)), logger=None, client=client)
    part = tasks.Part("add", {"a": 3, "b": 4}, "add 3 and 4")
    agent = _Agent()
    sim._solve(part, agent, "tool_use.add")
    assert all(body == {"return_token_ids": True} for body in client.asked), client.asked
    first, second, third = agent.calls
    # the text ended where `tool_call>` should have followed: the stop token (the reply's last) is what broke it
    assert first["malformed"] and first["malformed_token"] == len(tok.encode(cut).ids)
    # a string opened where a number goes: from the token holding the character the JSON decoder stopped at
    ids = tok.encode(garbled).ids
    at = second["malformed_token"]
    assert second["malformed"] and at is not None and 0 < at < len(ids)
    assert len(tok.decode(ids[:at])) <= tasks.malformed_from(garbled) < len(tok.decode(ids[:at + 1]))
    assert third == {"name": "add", "malformed": None, "malformed_token": None}
