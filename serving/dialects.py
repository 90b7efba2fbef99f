"""Wire formats the capture proxy speaks besides OpenAI chat completions, translated to and from them.

The proxy captures through chat completions: there vLLM returns the prompt's and the completion's token ids and
each sampled token's logprob. A request in another format is translated into a chat request, sent and captured
exactly as a chat call is, and its reply translated back. The tokens logged are the ones the model saw and
produced: vLLM renders the translated messages with the model's chat template, as it renders the same
conversation sent as chat, and the completion ids are the sampled ones whatever the reply's format.

Anthropic Messages (`POST /v1/messages`, what the `anthropic` SDK and Claude-style agents send):
- request: `system` (text or text blocks) becomes the first system message; `messages` keep their order, an
  assistant's `tool_use` blocks become its `tool_calls` (the input as JSON arguments) and a user's `tool_result`
  blocks become `tool` messages (before the user's own text, as the results answer the calls); `tools`
  (`input_schema`) become functions; `tool_choice` auto/any/tool/none become auto/required/that function/none;
  `max_tokens` (required, as Anthropic's API requires it), `temperature`, `top_p`, `top_k`, `stop_sequences`.
  Image and document blocks are refused with a 400: the proxy does not translate them.
- reply: one `message` with a text block for the text and a `tool_use` block per tool call (the arguments parsed
  back into `input`); stop_reason end_turn, max_tokens, stop_sequence (with the sequence) or tool_use; usage in
  input_tokens / output_tokens, the prompt's and the completion's token counts.
- stream: the SSE events the SDK reads, `message_start`, `content_block_start` / `content_block_delta`
  (`text_delta`, `input_json_delta`) / `content_block_stop`, `message_delta` (stop_reason, usage) and
  `message_stop`, each with its `event:` line.
Pure functions and one small state machine; no I/O (serving/proxy.py does the HTTP).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

# Anthropic's stop reasons for chat's finish reasons (a matched stop string is stop_sequence, see _stop_reason)
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def _text_of(content: Any, where: str) -> str:
    """A system prompt or tool result given as text or as a list of text blocks."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for block in content:
            if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
                raise ValueError(f"{where}: only text blocks can be translated, got {_block_type(block)}")
            parts.append(block["text"])
        return "".join(parts)
    raise ValueError(f"{where}: expected text or a list of text blocks, got {type(content).__name__}")


def _block_type(block: Any) -> str:
    return repr(block.get("type")) if isinstance(block, dict) else type(block).__name__


def _message(i: int, message: Any) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages (a user turn with tool results is several)."""
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
        raise ValueError(f"messages[{i}]: expected an object with role user or assistant")
    role, content = message["role"], message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise ValueError(f"messages[{i}].content: expected text or a list of blocks")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        where = f"messages[{i}].content[{j}]"
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise ValueError(f"{where}: a tool_use block needs an id and a name")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block.get("input") or {})}})
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise ValueError(f"{where}: a tool_result block needs a tool_use_id")
            output = _text_of(block.get("content", ""), where)
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                            "content": f"error: {output}" if block.get("is_error") else output})
        else:
            raise ValueError(f"{where}: a {_block_type(block)} block in a {role} message cannot be translated "
                             "(text, tool_use from the assistant, tool_result from the user)")
    if role == "assistant":
        out: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}  # "": templates concatenate it
        if calls:
            out["tool_calls"] = calls
        return [out]
    return results + ([{"role": "user", "content": "".join(texts)}] if texts or not results else [])


def messages_request(body: dict[str, Any]) -> dict[str, Any]:
    """The chat completions request for an Anthropic Messages request (ValueError: what is wrong with it)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages: expected a non-empty list")
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ValueError("max_tokens: required, a positive integer")
    chat: list[dict[str, Any]] = []
    if body.get("system"):
        chat.append({"role": "system", "content": _text_of(body["system"], "system")})
    for i, message in enumerate(messages):
        chat.extend(_message(i, message))
    out: dict[str, Any] = {"model": body.get("model"), "messages": chat, "max_tokens": max_tokens}
    for key in ("temperature", "top_p", "top_k"):
        if body.get(key) is not None:
            out[key] = body[key]
    if body.get("stop_sequences"):
        out["stop"] = list(body["stop_sequences"])
    if body.get("tools"):
        out["tools"] = [_tool(i, t) for i, t in enumerate(body["tools"])]
    if body.get("tool_choice") is not None:
        out["tool_choice"] = _tool_choice(body["tool_choice"])
    if body.get("stream"):
        out["stream"] = True
        out["stream_options"] = {"include_usage": True}  # message_delta carries the output token count
    return out


def _tool(i: int, tool: Any) -> dict[str, Any]:
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
        raise ValueError(f"tools[{i}]: expected an object with a name")
    function = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"}}
    if tool.get("description"):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> Any:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in _TOOL_CHOICES:
        return _TOOL_CHOICES[kind]
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ValueError(f"tool_choice: expected type auto, any, tool (with a name) or none, got {choice!r}")


def _stop_reason(choice: dict[str, Any], stops: list[str], called_tools: bool = False
                 ) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a chat choice: vLLM names the stop string it matched in `stop_reason`.

    A reply that called a tool stopped for it (tool_use), whatever the finish reason: vLLM ends a call to a tool
    named in tool_choice with "stop", not "tool_calls"."""
    finish = choice.get("finish_reason")
    if finish is None:
        return None, None
    matched = choice.get("stop_reason")
    if finish == "stop" and isinstance(matched, str) and matched in stops:
        return "stop_sequence", matched
    if finish == "stop" and called_tools:
        return "tool_use", None
    return _STOP_REASONS.get(finish, "end_turn"), None


def _input(arguments: str) -> Any:
    try:
        return json.loads(arguments) if arguments else {}
    except ValueError:
        return {"_unparsed_arguments": arguments}  # the model wrote broken JSON: give it back, do not drop it


def message_id(chat_id: Any) -> str:
    return f"msg_{chat_id}" if isinstance(chat_id, str) and chat_id else f"msg_{uuid.uuid4().hex}"


def messages_reply(payload: dict[str, Any], model: Any, stops: list[str]) -> dict[str, Any]:
    """The Anthropic message for a whole chat completion (its first choice: Messages has no n)."""
    choice = (payload.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        content.append({"type": "tool_use", "id": call.get("id") or f"toolu_{uuid.uuid4().hex[:24]}",
                        "name": function.get("name"), "input": _input(function.get("arguments") or "")})
    reason, sequence = _stop_reason(choice, stops, bool(message.get("tool_calls")))
    usage = payload.get("usage") or {}
    return {"id": message_id(payload.get("id")), "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": reason, "stop_sequence": sequence,
            "usage": {"input_tokens": int(usage.get("prompt_tokens") or 0),
                      "output_tokens": int(usage.get("completion_tokens") or 0)}}


def sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


class _ChunkReader:
    """What each stream translator reads of a chat completion chunk: the token counts the usage chunk gives, and
    the first choice (Messages and Responses have no n)."""

    input_tokens = 0
    output_tokens = 0

    def _first_choice(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.input_tokens = int(usage.get("prompt_tokens") or self.input_tokens)
            self.output_tokens = int(usage.get("completion_tokens") or self.output_tokens)
        return next((c for c in chunk.get("choices") or [] if int(c.get("index", 0)) == 0), None)


class MessagesStream(_ChunkReader):
    """Chat completion chunks in, Anthropic stream events out (feed each chunk, then finish once)."""

    def __init__(self, model: Any, stops: list[str]) -> None:
        self.model, self.stops = model, stops
        self.started = False
        self.index = -1  # the open content block's index (-1: none yet)
        self.open: str | None = None  # "text" or the chat tool call index ("tool:<i>") the open block is for
        self.reason: str | None = None
        self.sequence: str | None = None
        self.called_tools = False

    def feed(self, chunk: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        if not self.started:
            self.started = True
            prompt = chunk.get("prompt_token_ids")
            self.input_tokens = len(prompt) if isinstance(prompt, list) else 0
            out.append(sse("message_start", {"type": "message_start", "message": {
                "id": message_id(chunk.get("id")), "type": "message", "role": "assistant", "model": self.model,
                "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": self.input_tokens, "output_tokens": 0}}}))
        choice = self._first_choice(chunk)
        if choice is None:
            return out
        delta = choice.get("delta") or {}
        if delta.get("content"):
            out += self._block("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or []:
            key = f"tool:{call.get('index', 0)}"
            function = call.get("function") or {}
            self.called_tools = True
            if self.open != key:
                tool_id = call.get("id") or f"toolu_{uuid.uuid4().hex[:24]}"
                out += self._block(key, {"type": "tool_use", "id": tool_id, "name": function.get("name"),
                                         "input": {}})
            if function.get("arguments"):
                out.append(self._delta({"type": "input_json_delta", "partial_json": function["arguments"]}))
        reason, sequence = _stop_reason(choice, self.stops, self.called_tools)
        if reason is not None:
            self.reason, self.sequence = reason, sequence
        return out

    def finish(self) -> list[bytes]:
        """The closing events, once the upstream stream is complete."""
        out = self._close()
        out.append(sse("message_delta", {"type": "message_delta",
                                         "delta": {"stop_reason": self.reason or "end_turn",
                                                   "stop_sequence": self.sequence},
                                         "usage": {"output_tokens": self.output_tokens}}))
        out.append(sse("message_stop", {"type": "message_stop"}))
        return out

    def _block(self, key: str, block: dict[str, Any]) -> list[bytes]:
        if self.open == key:
            return []
        out = self._close()
        self.index += 1
        self.open = key
        out.append(sse("content_block_start", {"type": "content_block_start", "index": self.index,
                                               "content_block": block}))
        return out

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [sse("content_block_stop", {"type": "content_block_stop", "index": self.index})]


def messages_error(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body (the SDK raises its typed errors from `error.type`)."""
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            429: "rate_limit_error", 503: "overloaded_error"}.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


# ---------------------------------------------------------------- OpenAI Responses

def _content_text(content: Any, where: str) -> str:
    """A Responses message's content: text, or input_text / output_text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}: expected text or a list of content parts")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise ValueError(f"{where}[{j}]: a {_block_type(part)} part cannot be translated (input_text, output_text)")
        parts.append(part["text"])
    return "".join(parts)


def _input_items(items: Any) -> list[dict[str, Any]]:
    """Responses input items as chat messages; consecutive function calls join one assistant message."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise ValueError("input: expected text or a non-empty list of items")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ValueError(f"input[{i}]: expected an object")
        kind = item.get("type", "message")
        if kind == "message" and item.get("role") in ("user", "assistant", "system", "developer"):
            role = "system" if item["role"] == "developer" else item["role"]
            out.append({"role": role, "content": _content_text(item.get("content"), f"input[{i}].content")})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name")):
                raise ValueError(f"input[{i}]: a function_call needs a call_id and a name")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"}}
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise ValueError(f"input[{i}]: a function_call_output needs a call_id")
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": output if isinstance(output, str) else _content_text(output, f"input[{i}].output")})
        else:
            raise ValueError(f"input[{i}]: a {kind!r} item cannot be translated (messages, function_call, "
                             "function_call_output)")
    return out


def responses_request(body: dict[str, Any], history: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat completions request for a Responses request; `history`: the chat messages of the conversation
    its previous_response_id names (without that response's instructions, as the Responses API does)."""
    chat: list[dict[str, Any]] = []
    if body.get("instructions"):
        if not isinstance(body["instructions"], str):
            raise ValueError("instructions: expected text")
        chat.append({"role": "system", "content": body["instructions"]})
    chat += history + _input_items(body.get("input"))
    out: dict[str, Any] = {"model": body.get("model"), "messages": chat}
    if body.get("max_output_tokens") is not None:
        out["max_tokens"] = body["max_output_tokens"]
    for key in ("temperature", "top_p"):
        if body.get(key) is not None:
            out[key] = body[key]
    if body.get("tools"):
        out["tools"] = []
        for i, tool in enumerate(body["tools"]):
            if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
                raise ValueError(f"tools[{i}]: only function tools can be translated, got {_block_type(tool)}")
            function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
            out["tools"].append({"type": "function", "function": function})
    choice = body.get("tool_choice")
    if isinstance(choice, str):
        out["tool_choice"] = choice
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None:
        raise ValueError(f"tool_choice: expected auto, none, required or a function, got {choice!r}")
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        out["response_format"] = {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
    elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
        out["response_format"] = {"type": "json_object"}
    if body.get("stream"):
        out["stream"] = True
        out["stream_options"] = {"include_usage": True}
    return out


def response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def _usage(input_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


def _response(rid: str, body: dict[str, Any], created: float, status: str, output: list[dict[str, Any]],
              usage: dict[str, Any] | None, finish: str | None) -> dict[str, Any]:
    return {"id": rid, "object": "response", "created_at": int(created), "status": status, "model": body.get("model"),
            "output": output, "usage": usage, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
            "instructions": body.get("instructions"), "previous_response_id": body.get("previous_response_id"),
            "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice") or "auto",
            "parallel_tool_calls": True, "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "max_output_tokens": body.get("max_output_tokens"), "metadata": body.get("metadata") or {},
            "text": body.get("text") or {"format": {"type": "text"}}, "store": body.get("store", True)}


def _message_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []}


def _call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def responses_reply(payload: dict[str, Any], body: dict[str, Any], rid: str, created: float) -> dict[str, Any]:
    """The Response object for a whole chat completion (its first choice)."""
    choice = (payload.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    output = [_message_item(message["content"])] if message.get("content") else []
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        output.append(_call_item(call.get("id") or f"call_{uuid.uuid4().hex[:24]}", function.get("name") or "",
                                 function.get("arguments") or ""))
    usage = payload.get("usage") or {}
    finish = choice.get("finish_reason")
    return _response(rid, body, created, "incomplete" if finish == "length" else "completed", output,
                     _usage(int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)), finish)


def reply_messages(reply: dict[str, Any]) -> list[dict[str, Any]]:
    """A Response's output as the chat messages a follow-up with previous_response_id continues from."""
    text = "".join(part.get("text", "") for item in reply["output"] if item["type"] == "message"
                   for part in item.get("content") or [])
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                      "arguments": item["arguments"]}}
             for item in reply["output"] if item["type"] == "function_call"]
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return [message]


class ResponsesStream(_ChunkReader):
    """Chat completion chunks in, Responses stream events out; `reply` is the final Response once finished."""

    def __init__(self, body: dict[str, Any], rid: str, created: float) -> None:
        self.body, self.rid, self.created = body, rid, created
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.text_item: dict[str, Any] | None = None  # the open message item (its text so far in self.text)
        self.text = ""
        self.calls: dict[int, dict[str, Any]] = {}  # chat tool call index -> its function_call item
        self.finish_reason: str | None = None
        self.reply: dict[str, Any] | None = None

    def _event(self, kind: str, **data: Any) -> bytes:
        self.seq += 1
        return sse(kind, {"type": kind, "sequence_number": self.seq - 1, **data})

    def feed(self, chunk: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        if self.seq == 0:
            snapshot = _response(self.rid, self.body, self.created, "in_progress", [], None, None)
            out += [self._event("response.created", response=snapshot),
                    self._event("response.in_progress", response=snapshot)]
        choice = self._first_choice(chunk)
        if choice is None:
            return out
        delta = choice.get("delta") or {}
        if delta.get("content"):
            out += self._text(delta["content"])
        for call in delta.get("tool_calls") or []:
            out += self._call(call)
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
        return out

    def _text(self, piece: str) -> list[bytes]:
        out: list[bytes] = []
        if self.text_item is None:
            self.text_item = _message_item("", status="in_progress")
            self.output.append(self.text_item)
            index = len(self.output) - 1
            out += [self._event("response.output_item.added", output_index=index, item=self.text_item),
                    self._event("response.content_part.added", item_id=self.text_item["id"], output_index=index,
                                content_index=0, part={"type": "output_text", "text": "", "annotations": []})]
        self.text += piece
        out.append(self._event("response.output_text.delta", item_id=self.text_item["id"],
                               output_index=self.output.index(self.text_item), content_index=0, delta=piece,
                               logprobs=[]))
        return out

    def _call(self, call: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        index = int(call.get("index", 0))
        function = call.get("function") or {}
        item = self.calls.get(index)
        if item is None:
            item = self.calls[index] = _call_item(call.get("id") or f"call_{uuid.uuid4().hex[:24]}",
                                                  function.get("name") or "", "", status="in_progress")
            self.output.append(item)
            out.append(self._event("response.output_item.added", output_index=len(self.output) - 1, item=item))
        if function.get("arguments"):
            item["arguments"] += function["arguments"]
            out.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                   output_index=self.output.index(item), delta=function["arguments"]))
        return out

    def finish(self) -> list[bytes]:
        """The closing events once the upstream stream is complete; sets `reply`."""
        out: list[bytes] = []
        for index, item in enumerate(self.output):
            if item is self.text_item:
                part = {"type": "output_text", "text": self.text, "annotations": []}
                out += [self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                    content_index=0, text=self.text, logprobs=[]),
                        self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                    content_index=0, part=part)]
                item.update(status="completed", content=[part])
            else:
                out.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                       output_index=index, arguments=item["arguments"]))
                item["status"] = "completed"
            out.append(self._event("response.output_item.done", output_index=index, item=item))
        status = "incomplete" if self.finish_reason == "length" else "completed"
        self.reply = _response(self.rid, self.body, self.created, status, self.output,
                               _usage(self.input_tokens, self.output_tokens), self.finish_reason)
        out.append(self._event(f"response.{status}", response=self.reply))
        return out


class ResponseStore:
    """The conversations previous_response_id continues, in memory, newest `capacity` kept: response id -> (the
    session it belongs to, the chat messages up to and including its reply). A restarted proxy forgets them (a
    follow-up then gets a 404 that says so); store=false responses are not kept."""

    def __init__(self, capacity: int = 10_000) -> None:
        from collections import OrderedDict

        self.capacity = capacity
        self._kept: OrderedDict[str, tuple[str, list[dict[str, Any]]]] = OrderedDict()

    def get(self, rid: str) -> tuple[str, list[dict[str, Any]]] | None:
        return self._kept.get(rid)

    def put(self, rid: str, session_id: str, messages: list[dict[str, Any]]) -> None:
        self._kept[rid] = (session_id, messages)
        while len(self._kept) > self.capacity:
            self._kept.popitem(last=False)
