"""``/v1/messages``: Anthropic's Messages API, translated to a chat request and
run through the chat pipeline (the same prompt, tools, reasoning split and
tool-call parser as ``/v1/chat/completions``), answered as a message or as
its stream of named events, with Anthropic-format errors."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fastllm.outputs import RequestOutput
from fastllm.server.chat import ChatSetup, ReplyStream, last_output, prepare_chat, whole_reply
from fastllm.server.context import RouteContext
from fastllm.server.http import (
    engine_error,
    read_model,
    renamed,
    sse_event,
    unless_disconnected,
)
from fastllm.server.protocol import APIError, ChatCompletionRequest, validation_error
from fastllm.server.tools import unfinished_forced_call

# Chat fields a translated request's errors name, in this API's words.
_FIELDS = {
    "stop": "stop_sequences",
    "thinking_token_budget": "thinking.budget_tokens",
    "chat_template_kwargs": "thinking",
    "parallel_tool_calls": "tool_choice",
    "response_format": "output_config.format",
    "reasoning_effort": "output_config.effort",
    ".function.parameters": ".input_schema",
    ".function.name": ".name",
}
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
}


def anthropic_error(err: APIError) -> dict[str, Any]:
    """The body of an error in Anthropic's format."""
    kind = _ERROR_TYPES.get(err.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def anthropic_error_response(err: APIError) -> JSONResponse:
    """The error response of ``/v1/messages`` (the middleware's too)."""
    return JSONResponse(anthropic_error(err), status_code=err.status)


class MessagesRequest(BaseModel):
    """Body of ``POST /v1/messages``; a field not listed is a 400 naming it."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None


def register(app: FastAPI, ctx: RouteContext) -> None:
    """Adds ``/v1/messages`` to ``app``."""

    @app.post("/v1/messages")
    async def messages(raw: Request) -> Response:
        try:
            return await _answer(raw, ctx)
        except APIError as e:
            return anthropic_error_response(e)


async def _answer(raw: Request, ctx: RouteContext) -> Response:
    """The reply to one request, whole or streamed; an APIError for a bad one."""
    req = await read_model(raw, MessagesRequest, ctx.state.max_body_bytes)
    try:
        setup = prepare_chat(ctx, chat_request(req), prefix="msg")
    except APIError as e:
        raise renamed(e, _FIELDS) from e
    gen = ctx.engine.generate(setup.prompt_text, setup.prompt_ids, setup.params, setup.request_id)
    mid = "msg_" + setup.request_id.rpartition("-")[2]
    if req.stream:
        body = stream_message(gen, setup, mid)
        return StreamingResponse(body, media_type="text/event-stream")

    try:
        out = await unless_disconnected(raw, last_output(gen))
    except Exception as e:
        raise renamed(engine_error(e), _FIELDS) from e
    if out is None:
        return Response(status_code=499)
    c = out.outputs[0]
    reasoning, content, calls = whole_reply(setup, c.text)
    if setup.forced and not calls:
        raise unfinished_forced_call(setup.params.max_tokens, 0)
    blocks: list[dict[str, Any]] = []
    if reasoning:
        blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if content:
        blocks.append({"type": "text", "text": content})
    for call in calls:
        block = {"type": "tool_use", "id": _tool_use_id(), "name": call.name}
        blocks.append({**block, "input": json.loads(call.arguments)})
    stop, sequence = _stop_reason(c.finish_reason, c.stop_reason, bool(calls))
    body = _message(mid, setup.name, blocks, stop, sequence)
    body["usage"] = {"input_tokens": len(setup.prompt_ids), "output_tokens": len(c.token_ids)}
    return JSONResponse(body)


# ---- the request as a chat request ---------------------------------------------


def chat_request(req: MessagesRequest) -> ChatCompletionRequest:
    """The chat request that renders the same conversation with the same
    options; a 400 naming this API's field when something cannot translate."""
    choice, parallel = _chat_tool_choice(req.tool_choice)
    if choice not in (None, "none") and not req.tools:
        raise APIError(f"tool_choice {req.tool_choice} needs tools", 400, param="tool_choice")
    body: dict[str, Any] = {
        "model": req.model,
        "messages": chat_messages(req.system, req.messages),
        "max_tokens": req.max_tokens,
        "stream": req.stream,
        "stop": req.stop_sequences,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "tools": [_chat_tool(t, i) for i, t in enumerate(req.tools)] if req.tools else None,
        "tool_choice": choice,
        "parallel_tool_calls": parallel,
        "user": (req.metadata or {}).get("user_id"),
        **_thinking(req.thinking),
        **_output_config(req.output_config),
    }
    try:
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in body.items() if v is not None}
        )
    except ValidationError as e:
        raise renamed(validation_error(e), _FIELDS) from e


def chat_messages(
    system: str | list[dict[str, Any]] | None, messages: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Chat messages of ``system`` and ``messages``: text blocks joined,
    ``tool_use`` blocks as the assistant's ``tool_calls``, ``tool_result``
    blocks as ``tool`` messages, ``thinking`` as ``reasoning_content``."""
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": _joined_text(system, "system")})
    names: dict[str, str] = {}  # tool_use id -> the tool it called
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        role = msg.get("role")
        if role not in ("user", "assistant"):
            raise APIError(
                f"{where}.role must be 'user' or 'assistant', got {role!r}",
                400,
                param=f"{where}.role",
            )
        content = msg.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif not isinstance(content, list):
            raise APIError(
                f"{where}.content must be a string or a list of blocks",
                400,
                param=f"{where}.content",
            )
        elif role == "assistant":
            out.append(_assistant_message(content, f"{where}.content", names))
        else:
            out += _user_messages(content, f"{where}.content", names)
    return out


def _block_kind(block: Any, where: str) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if not isinstance(kind, str):
        raise APIError(f"{where} must be a block with a type", 400, param=where)
    return kind


def _unsupported(kind: str, where: str) -> APIError:
    return APIError(
        f"{where}.type {kind!r} is not supported; fastllm reads text, thinking, "
        "tool_use and tool_result blocks",
        400,
        param=f"{where}.type",
    )


def _text(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise APIError(f"{where}.text must be a string", 400, param=f"{where}.text")
    return text


def _joined_text(content: str | list[dict[str, Any]], where: str) -> str:
    """Text content (a string, or text blocks) as one string."""
    if isinstance(content, str):
        return content
    parts = []
    for j, block in enumerate(content):
        kind = _block_kind(block, f"{where}[{j}]")
        if kind != "text":
            raise APIError(
                f"{where}[{j}].type must be 'text', got {kind!r}", 400, param=f"{where}[{j}].type"
            )
        parts.append(_text(block, f"{where}[{j}]"))
    return "\n".join(parts)


def _assistant_message(
    blocks: list[dict[str, Any]], where: str, names: dict[str, str]
) -> dict[str, Any]:
    """One assistant turn: its text, its thinking, its tool calls."""
    texts, thoughts, calls = [], [], []
    for j, block in enumerate(blocks):
        at = f"{where}[{j}]"
        kind = _block_kind(block, at)
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "thinking":
            thoughts.append(str(block.get("thinking") or ""))
        elif kind == "redacted_thinking":
            continue  # encrypted for another server: nothing a template can show
        elif kind == "tool_use":
            call_id, name = block.get("id"), block.get("name")
            if not isinstance(call_id, str) or not isinstance(name, str):
                raise APIError(f"{at} needs a string id and name", 400, param=at)
            names[call_id] = name
            arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
            calls.append(
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
            )
        else:
            raise _unsupported(kind, at)
    msg: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if thoughts:
        msg["reasoning_content"] = "\n".join(thoughts)
    if calls:
        msg["tool_calls"] = calls
    return msg


def _user_messages(
    blocks: list[dict[str, Any]], where: str, names: dict[str, str]
) -> list[dict[str, Any]]:
    """One user turn: a ``tool`` message per tool result, then its text."""
    out: list[dict[str, Any]] = []
    texts = []
    for j, block in enumerate(blocks):
        at = f"{where}[{j}]"
        kind = _block_kind(block, at)
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "tool_result":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str):
                raise APIError(f"{at}.tool_use_id must be a string", 400, param=f"{at}.tool_use_id")
            result = _joined_text(block.get("content") or "", f"{at}.content")
            if block.get("is_error"):
                result = f"Error: {result}"
            msg = {"role": "tool", "tool_call_id": call_id, "content": result}
            if call_id in names:
                msg["name"] = names[call_id]
            out.append(msg)
        else:
            raise _unsupported(kind, at)
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    """An Anthropic tool (``name``, ``description``, ``input_schema``) as a chat tool."""
    if tool.get("type", "custom") != "custom":
        raise APIError(
            f"tools[{i}].type {tool.get('type')!r} is a server tool; fastllm runs none, "
            "only custom tools (name, description, input_schema)",
            400,
            param=f"tools[{i}].type",
        )
    fn: dict[str, Any] = {"name": tool.get("name")}
    if "description" in tool:
        fn["description"] = tool["description"]
    if "input_schema" in tool:
        fn["parameters"] = tool["input_schema"]
    return {"type": "function", "function": fn}


def _chat_tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """(chat ``tool_choice``, ``parallel_tool_calls``) of Anthropic's ``tool_choice``."""
    if choice is None:
        return None, None
    parallel = False if choice.get("disable_parallel_tool_use") else None
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise APIError(
        "tool_choice must be {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', 'name': ...}",
        400,
        param="tool_choice",
    )


def _thinking(thinking: dict[str, Any] | None) -> dict[str, Any]:
    """The chat fields of ``thinking``: enabled sets the thinking budget,
    disabled tells the template not to think (``enable_thinking``)."""
    if thinking is None:
        return {}
    kind = thinking.get("type")
    if kind == "disabled":
        return {"chat_template_kwargs": {"enable_thinking": False}}
    if kind == "adaptive":
        return {"chat_template_kwargs": {"enable_thinking": True}}
    budget = thinking.get("budget_tokens")
    if kind == "enabled" and isinstance(budget, int) and not isinstance(budget, bool):
        return {"chat_template_kwargs": {"enable_thinking": True}, "thinking_token_budget": budget}
    raise APIError(
        "thinking must be {'type': 'enabled', 'budget_tokens': N}, {'type': 'adaptive'} "
        "or {'type': 'disabled'}",
        400,
        param="thinking",
    )


def _output_config(config: dict[str, Any] | None) -> dict[str, Any]:
    """The chat fields of ``output_config``: ``format`` (a JSON schema) as
    ``response_format``, ``effort`` as the template's ``reasoning_effort``."""
    out: dict[str, Any] = {}
    for key, value in (config or {}).items():
        if key == "effort":
            out["reasoning_effort"] = value
        elif key == "format" and value is not None:
            schema = value.get("schema") if isinstance(value, dict) else None
            if value.get("type") != "json_schema" or not isinstance(schema, dict):
                raise APIError(
                    "output_config.format must be {'type': 'json_schema', 'schema': {...}}",
                    400,
                    param="output_config.format",
                )
            spec = {"name": "output", "schema": schema}
            out["response_format"] = {"type": "json_schema", "json_schema": spec}
        elif key != "format":
            raise APIError(
                f"unknown field 'output_config.{key}': fastllm does not implement it",
                400,
                param=f"output_config.{key}",
            )
    return out


# ---- the reply -------------------------------------------------------------------


def _tool_use_id(call_id: str | None = None) -> str:
    """A ``toolu_`` id, from a chat call id when there is one."""
    tail = call_id.removeprefix("call_") if call_id else uuid.uuid4().hex[:24]
    return f"toolu_{tail}"


def _stop_reason(
    finish: str | None, stop: int | str | None, called: bool
) -> tuple[str, str | None]:
    """(``stop_reason``, ``stop_sequence``) of a finished reply."""
    if finish == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def _message(
    mid: str, model: str, content: list[dict[str, Any]], stop: str | None, sequence: str | None
) -> dict[str, Any]:
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop,
        "stop_sequence": sequence,
    }


class MessageEvents:
    """Turns one reply's chat deltas into Anthropic's content block events:
    one block at a time is open (thinking, text, a tool call) and a delta of
    another kind stops it."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # the open block's type

    def delta(self, d: dict[str, Any]) -> list[str]:
        """The events of one chat delta."""
        if d.get("reasoning_content"):
            return self._piece(
                "thinking", {"type": "thinking_delta", "thinking": d["reasoning_content"]}
            )
        if d.get("content"):
            return self._piece("text", {"type": "text_delta", "text": d["content"]})
        out: list[str] = []
        for tc in d.get("tool_calls") or []:
            fn = tc.get("function") or {}
            if tc.get("id"):
                block = {"type": "tool_use", "id": _tool_use_id(tc["id"]), "name": fn.get("name")}
                out += self._start({**block, "input": {}})
            if fn.get("arguments"):
                piece = {"type": "input_json_delta", "partial_json": fn["arguments"]}
                out.append(self._delta(piece))
        return out

    def _piece(self, kind: str, piece: dict[str, Any]) -> list[str]:
        out = []
        if self.open != kind:
            empty = {"text": ""} if kind == "text" else {"thinking": "", "signature": ""}
            out += self._start({"type": kind, **empty})
        out.append(self._delta(piece))
        return out

    def _start(self, block: dict[str, Any]) -> list[str]:
        out = self.stop()
        self.index += 1
        self.open = block["type"]
        start = {"type": "content_block_start", "index": self.index, "content_block": block}
        return [*out, sse_event("content_block_start", start)]

    def _delta(self, piece: dict[str, Any]) -> str:
        body = {"type": "content_block_delta", "index": self.index, "delta": piece}
        return sse_event("content_block_delta", body)

    def stop(self) -> list[str]:
        """The event that stops the open block, if any."""
        if self.open is None:
            return []
        self.open = None
        body = {"type": "content_block_stop", "index": self.index}
        return [sse_event("content_block_stop", body)]


async def stream_message(
    gen: AsyncIterator[RequestOutput], setup: ChatSetup, mid: str
) -> AsyncIterator[str]:
    """The event stream of one reply: message_start, each content block's
    start, deltas and stop, message_delta (stop reason, usage), message_stop;
    a failure is an ``error`` event."""
    start = _message(mid, setup.name, [], None, None)
    start["usage"] = {"input_tokens": len(setup.prompt_ids), "output_tokens": 0}
    yield sse_event("message_start", {"type": "message_start", "message": start})
    events = MessageEvents()
    reply = ReplyStream(setup)
    completion = 0
    try:
        async for out in gen:
            for c in out.outputs:
                completion += len(c.token_ids)
                deltas = reply.add(c.text)
                called = False
                if c.finish_reason:
                    last, called = reply.finish()
                    deltas += last
                    if setup.forced and not called:
                        raise unfinished_forced_call(setup.params.max_tokens, c.index)
                for d in deltas:
                    for e in events.delta(d):
                        yield e
                if not c.finish_reason:
                    continue
                for e in events.stop():
                    yield e
                stop, sequence = _stop_reason(c.finish_reason, c.stop_reason, called)
                delta = {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop, "stop_sequence": sequence},
                    "usage": {"output_tokens": completion},
                }
                yield sse_event("message_delta", delta)
                yield sse_event("message_stop", {"type": "message_stop"})
    except Exception as e:
        yield sse_event("error", anthropic_error(renamed(engine_error(e), _FIELDS)))
