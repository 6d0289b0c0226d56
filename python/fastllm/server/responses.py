"""``/v1/responses``: OpenAI's Responses API, translated to a chat request and
run through the chat pipeline (the same prompt, tools, reasoning split and
tool-call parser as ``/v1/chat/completions``), answered as a response object
or as its stream of named events.

fastllm keeps no state between requests, so the API's stored responses
(``store: true``, ``previous_response_id``, item references) are refused: a
conversation is sent whole, its earlier turns as input items.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError

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
from fastllm.server.tools import ParsedCall, new_call_id, unfinished_forced_call

# Chat fields a translated request's errors name, in this API's words.
_FIELDS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
    ".function.parameters": ".parameters",
    ".function.name": ".name",
}


class ReasoningConfig(BaseModel):
    """``reasoning``: ``effort`` reaches the chat template as ``reasoning_effort``;
    the thinking itself is returned whole (no summaries are written)."""

    model_config = ConfigDict(extra="forbid")

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class TextConfig(BaseModel):
    """``text``: the output's format (plain text, a JSON object, a JSON schema)."""

    model_config = ConfigDict(extra="forbid")

    format: dict[str, Any] | None = None


class ResponsesRequest(BaseModel):
    """Body of ``POST /v1/responses``; a field not listed is a 400 naming it."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    user: str | None = None

    def check_stateless(self) -> None:
        """A 400 for the fields that need responses kept on the server."""
        if self.previous_response_id is not None:
            raise APIError(
                "previous_response_id: fastllm keeps no responses, so it cannot continue "
                "one; send the whole conversation in input (earlier outputs as items)",
                400,
                param="previous_response_id",
            )
        if self.store:
            raise APIError(
                "store: fastllm keeps no responses; send store=false (or leave it out)",
                400,
                param="store",
            )


def register(app: FastAPI, ctx: RouteContext) -> None:
    """Adds ``/v1/responses`` to ``app``."""

    @app.post("/v1/responses")
    async def responses(raw: Request) -> Response:
        req = await read_model(raw, ResponsesRequest, ctx.state.max_body_bytes)
        req.check_stateless()
        try:
            setup = prepare_chat(ctx, chat_request(req), prefix="resp")
        except APIError as e:
            raise renamed(e, _FIELDS) from e
        head = _Head(req, setup, int(time.time()))
        gen = ctx.engine.generate(
            setup.prompt_text, setup.prompt_ids, setup.params, setup.request_id
        )
        if req.stream:
            body = stream_response(gen, setup, head, ctx.tok)
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
            raise renamed(unfinished_forced_call(setup.params.max_tokens, 0), _FIELDS)
        incomplete = c.finish_reason == "length"
        items = _output_items(reasoning, content, calls, incomplete)
        usage = _usage(
            len(setup.prompt_ids), len(c.token_ids), out.num_cached_tokens, reasoning, ctx.tok
        )
        return JSONResponse(head.response(items, usage, incomplete))


# ---- the request as a chat request ---------------------------------------------


def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that renders the same conversation with the same
    options; a 400 naming this API's field when something cannot translate."""
    body: dict[str, Any] = {
        "model": req.model,
        "messages": input_messages(req.input, req.instructions),
        "stream": req.stream,
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "user": req.user,
        "tools": [_chat_tool(t, i) for i, t in enumerate(req.tools)] if req.tools else None,
        "tool_choice": _chat_tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": _response_format(req.text),
        "reasoning_effort": req.reasoning.effort if req.reasoning else None,
    }
    try:
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in body.items() if v is not None}
        )
    except ValidationError as e:
        raise renamed(validation_error(e), _FIELDS) from e


def input_messages(items: str | list[dict[str, Any]], instructions: str | None) -> list[dict]:
    """Chat messages of ``input``: messages as they are (``developer`` as
    ``system``), function calls as the assistant's ``tool_calls``, their
    outputs as ``tool`` messages, and a reasoning item as the next assistant
    message's ``reasoning_content``."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    if not items:
        raise APIError("input must not be empty", 400, param="input")
    names: dict[str, str] = {}  # call_id -> the function it called
    thinking: str | None = None
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(
                    f"{where}.role must be user, system, developer or assistant, got {role!r}",
                    400,
                    param=f"{where}.role",
                )
            msg = {"role": "system" if role == "developer" else role}
            msg["content"] = _text_of(item.get("content"), f"{where}.content")
            if role == "assistant" and thinking is not None:
                msg["reasoning_content"], thinking = thinking, None
            messages.append(msg)
        elif kind == "function_call":
            call = _function_call(item, where)
            names[call["id"]] = call["function"]["name"]
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant" or not _joins_previous(items, i):
                last = {"role": "assistant", "content": ""}
                if thinking is not None:
                    last["reasoning_content"], thinking = thinking, None
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", where)
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, f"{where}.output")
            msg = {"role": "tool", "tool_call_id": call_id, "content": text}
            if call_id in names:
                msg["name"] = names[call_id]
            messages.append(msg)
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            thinking = "\n".join(p.get("text", "") for p in parts if isinstance(p, dict))
        else:
            hint = " (fastllm keeps no items to refer to)" if kind == "item_reference" else ""
            raise APIError(
                f"{where}.type {kind!r} is not supported{hint}; send messages, "
                "function_call, function_call_output or reasoning items",
                400,
                param=f"{where}.type",
            )
    return messages


def _joins_previous(items: list[dict[str, Any]], i: int) -> bool:
    """Whether the function call ``items[i]`` belongs to the assistant message
    before it: it follows that message or another call of the same turn."""
    prev = items[i - 1] if i > 0 else {}
    return prev.get("type") == "function_call" or prev.get("role") == "assistant"


def _text_of(content: Any, where: str) -> str | list[dict[str, str]]:
    """A message's content as chat content: a string, or its text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(f"{where} must be a string or a list of parts", 400, param=where)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(
            part.get("text"), str
        ):
            raise APIError(
                f"{where}[{j}] must be an input_text or output_text part; only text is "
                f"supported, got {kind!r}",
                400,
                param=f"{where}[{j}]",
            )
        parts.append({"type": "text", "text": part["text"]})
    return parts


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(f"{where}.{key} must be a string", 400, param=f"{where}.{key}")
    return value


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A ``function_call`` item as one of the chat message's ``tool_calls``."""
    return {
        "id": _string(item, "call_id", where),
        "type": "function",
        "function": {
            "name": _string(item, "name", where),
            "arguments": _string(item, "arguments", where),
        },
    }


def _chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    """A Responses function tool (flat) as a chat tool (nested under ``function``)."""
    if tool.get("type") != "function":
        raise APIError(
            f"tools[{i}].type must be 'function', got {tool.get('type')!r}; fastllm runs "
            "no built-in tools",
            400,
            param=f"tools[{i}].type",
        )
    fn = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
    return {"type": "function", "function": fn}


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(
        "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}",
        400,
        param="tool_choice",
    )


def _response_format(text: TextConfig | None) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format``."""
    fmt = text.format if text is not None else None
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "json_schema":
        spec = {"name": fmt.get("name", "response"), "schema": fmt.get("schema")}
        return {"type": "json_schema", "json_schema": spec}
    if kind in ("json_object", "text"):
        return {"type": kind}
    raise APIError(
        f"text.format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
        400,
        param="text.format",
    )


# ---- the response object ----------------------------------------------------------


class _Head:
    """What every response object of one request says besides its output: the
    request's settings echoed, the id and the model."""

    def __init__(self, req: ResponsesRequest, setup: ChatSetup, created: int) -> None:
        # OpenAI's id form; the engine's request id has the same tail
        self.id = "resp_" + setup.request_id.rpartition("-")[2]
        self.fields: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": created,
            "model": setup.name,
            "instructions": req.instructions,
            "metadata": req.metadata or {},
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "tool_choice": req.tool_choice or "auto",
            "tools": req.tools or [],
            "max_output_tokens": req.max_output_tokens,
            "previous_response_id": None,
            "reasoning": req.reasoning.model_dump() if req.reasoning else None,
            "text": {"format": (req.text.format if req.text else None) or {"type": "text"}},
            "store": False,
            "user": req.user,
        }

    def response(
        self, output: list[dict[str, Any]], usage: dict[str, Any] | None, incomplete: bool
    ) -> dict[str, Any]:
        """The response object; without ``usage``, the one of a response in progress."""
        status = "in_progress" if usage is None else "incomplete" if incomplete else "completed"
        details = {"reason": "max_output_tokens"} if incomplete else None
        return {
            **self.fields,
            "status": status,
            "error": None,
            "incomplete_details": details,
            "output": output,
            "usage": usage,
        }


def _usage(prompt: int, completion: int, cached: int, reasoning: str | None, tok: Any) -> dict:
    """The response's ``usage``; the reasoning tokens are the thinking text's
    tokens as the tokenizer encodes it again."""
    thought = len(tok.encode(reasoning, add_special_tokens=False)) if reasoning else 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": min(thought, completion)},
        "total_tokens": prompt + completion,
    }


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _reasoning_item(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    return {
        "id": item_id or _item_id("rs"),
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}] if text else [],
        "status": status,
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    return {
        "id": item_id or _item_id("msg"),
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [_text_part(text)] if text else [],
    }


def _call_item(
    call_id: str, name: str, arguments: str, status: str, item_id: str | None = None
) -> dict[str, Any]:
    return {
        "id": item_id or _item_id("fc"),
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _output_items(
    reasoning: str | None, content: str | None, calls: list[ParsedCall], incomplete: bool
) -> list[dict[str, Any]]:
    """The output of a whole reply: its reasoning, its message, its calls, in
    that order (the last one incomplete when max_output_tokens cut it)."""
    items = []
    if reasoning:
        items.append(_reasoning_item(reasoning, "completed"))
    if content:
        items.append(_message_item(content, "completed"))
    for c in calls:
        items.append(_call_item(new_call_id(), c.name, c.arguments, "completed"))
    if incomplete and items:
        items[-1]["status"] = "incomplete"
    return items


# ---- streaming -------------------------------------------------------------------


class ResponseEvents:
    """Turns one reply's chat deltas into the Responses stream's events,
    keeping the output items as they are built: one item at a time is open
    (a reasoning item, a message, a function call) and a delta of another
    kind closes it."""

    def __init__(self) -> None:
        self.seq = 0
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the last of items, still streaming
        self.text = ""  # the open item's text (or arguments) so far

    def event(self, kind: str, **fields: Any) -> str:
        """The next event of the stream (``sequence_number`` counts them)."""
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse_event(kind, body)

    def delta(self, d: dict[str, Any]) -> list[str]:
        """The events of one chat delta."""
        if d.get("reasoning_content"):
            return self._text("reasoning", d["reasoning_content"])
        if d.get("content"):
            return self._text("message", d["content"])
        out: list[str] = []
        for tc in d.get("tool_calls") or []:
            fn = tc.get("function") or {}
            if tc.get("id"):
                out += self.close("completed")
                item = _call_item(tc["id"], fn.get("name", ""), "", "in_progress")
                out += self._add(item)
            if fn.get("arguments") and self.open is not None:
                self.text += fn["arguments"]
                out.append(
                    self.event(
                        "response.function_call_arguments.delta",
                        item_id=self.open["id"],
                        output_index=len(self.items) - 1,
                        delta=fn["arguments"],
                    )
                )
        return out

    def _add(self, item: dict[str, Any]) -> list[str]:
        self.items.append(item)
        self.open, self.text = item, ""
        added = self.event(
            "response.output_item.added", output_index=len(self.items) - 1, item=dict(item)
        )
        if item["type"] == "function_call":
            return [added]
        part = (
            {"type": "reasoning_text", "text": ""}
            if item["type"] == "reasoning"
            else _text_part("")
        )
        where = {"item_id": item["id"], "output_index": len(self.items) - 1, "content_index": 0}
        return [added, self.event("response.content_part.added", **where, part=part)]

    def _text(self, kind: str, text: str) -> list[str]:
        out: list[str] = []
        if self.open is None or self.open["type"] != kind:
            out += self.close("completed")
            empty = _reasoning_item if kind == "reasoning" else _message_item
            out += self._add(empty("", "in_progress"))
        self.text += text
        assert self.open is not None
        where = {"item_id": self.open["id"], "output_index": len(self.items) - 1}
        name = (
            "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        )
        extra = {} if kind == "reasoning" else {"logprobs": []}
        out.append(self.event(name, **where, content_index=0, delta=text, **extra))
        return out

    def close(self, status: str) -> list[str]:
        """The events that finish the open item, if any, with ``status``."""
        item = self.open
        if item is None:
            return []
        self.open = None
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        out = []
        if item["type"] == "function_call":
            item.update(arguments=self.text, status=status)
            out.append(
                self.event(
                    "response.function_call_arguments.done",
                    **where,
                    name=item["name"],
                    arguments=self.text,
                )
            )
        else:
            build = _reasoning_item if item["type"] == "reasoning" else _message_item
            item.update(build(self.text, status, item["id"]))
            (part,) = item["content"]
            if item["type"] == "reasoning":
                done = self.event(
                    "response.reasoning_text.done", **where, content_index=0, text=self.text
                )
            else:
                done = self.event(
                    "response.output_text.done",
                    **where,
                    content_index=0,
                    text=self.text,
                    logprobs=[],
                )
            out += [
                done,
                self.event("response.content_part.done", **where, content_index=0, part=part),
            ]
        out.append(
            self.event("response.output_item.done", output_index=len(self.items) - 1, item=item)
        )
        return out


async def stream_response(
    gen: AsyncIterator[RequestOutput], setup: ChatSetup, head: _Head, tok: Any
) -> AsyncIterator[str]:
    """The Responses stream of one reply: created, in progress, each output
    item's events, then completed (or incomplete, when max_output_tokens cut
    the reply short); a failure is an ``error`` event."""
    events = ResponseEvents()
    reply = ReplyStream(setup)
    started = head.response([], None, False)
    yield events.event("response.created", response=started)
    yield events.event("response.in_progress", response=started)
    completion, cached, reasoning = 0, 0, ""
    try:
        async for out in gen:
            cached = out.num_cached_tokens
            for c in out.outputs:
                completion += len(c.token_ids)
                deltas = reply.add(c.text)
                if c.finish_reason:
                    last, called = reply.finish()
                    deltas += last
                    if setup.forced and not called:
                        raise unfinished_forced_call(setup.params.max_tokens, c.index)
                for d in deltas:
                    reasoning += d.get("reasoning_content") or ""
                    for e in events.delta(d):
                        yield e
                if c.finish_reason:
                    incomplete = c.finish_reason == "length"
                    for e in events.close("incomplete" if incomplete else "completed"):
                        yield e
                    usage = _usage(len(setup.prompt_ids), completion, cached, reasoning, tok)
                    kind = "response.incomplete" if incomplete else "response.completed"
                    yield events.event(
                        kind, response=head.response(events.items, usage, incomplete)
                    )
    except Exception as e:
        err = renamed(engine_error(e), _FIELDS)
        yield events.event("error", code=str(err.code), message=err.message, param=err.param)
