"""``/v1/chat/completions``: a conversation in, the assistant's reply out,
whole or streamed, with tool calls."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from fastllm.inputs import chat_stop
from fastllm.outputs import RequestOutput
from fastllm.reasoning import ReasoningParser
from fastllm.sampling_params import RequestOutputKind, SamplingParams
from fastllm.server.context import RouteContext
from fastllm.server.http import (
    chat_logprobs,
    engine_error,
    read_model,
    sse,
    unless_disconnected,
    usage,
)
from fastllm.server.protocol import ChatCompletionRequest
from fastllm.server.tools import (
    ParsedCall,
    Tool,
    ToolStream,
    forced_call_constraint,
    needs_special_tokens,
    parse_reply,
    parse_tools,
    resolve_tool_choice,
    tool_calls_json,
    unfinished_forced_call,
)


@dataclass
class ChatSetup:
    """Everything a chat request needs to run, validated: what
    ``/v1/chat/completions``, ``/v1/responses`` and ``/v1/messages`` share."""

    name: str  # the served model name
    request_id: str
    prompt_text: str
    prompt_ids: list[int]
    # with the template's end-of-turn stop tokens; DELTA outputs when streamed
    params: SamplingParams
    tools: list[Tool]
    fmt: str  # the tool-call format
    forced: bool  # a tool call the request forces (tool_choice required / named)
    calls_wanted: bool
    reasoning: ReasoningParser | None  # --reasoning-parser
    include_reasoning: bool = True


def prepare_chat(
    ctx: RouteContext, req: ChatCompletionRequest, prefix: str = "chatcmpl"
) -> ChatSetup:
    """A chat request rendered, tokenized and checked; an APIError (400
    naming the field) for anything wrong."""
    name = ctx.model_name(req.model)
    ctx.tokenizer("messages", "rendering chat messages")
    template = ctx.chat_template(req.chat_template)
    tools = parse_tools(req.tools) if req.tools else []
    choice = resolve_tool_choice(req.tool_choice, tools)
    fmt = ctx.tool_format(template)
    forced = None
    if choice == "required":
        forced = forced_call_constraint(tools, fmt)
    elif isinstance(choice, Tool):
        forced = forced_call_constraint([choice], fmt)
    text, ids = req.prompt(ctx.tok, template)
    max_tokens, field = req.requested_max_tokens()
    # the reply ends at the template's end of turn, as LLM.chat's does
    params = chat_stop(req.to_sampling_params(max_tokens, forced), ctx.tok, template)
    ctx.check_request(
        ids,
        params,
        "messages",
        {"max_tokens": field, "logprobs": "top_logprobs"},
    )
    if choice != "none" and needs_special_tokens(fmt) and params.skip_special_tokens:
        # the format's call marker is a special token: keep it in the text (as vLLM does)
        params = params.clone(skip_special_tokens=False)
    if req.stream:
        params = params.clone(output_kind=RequestOutputKind.DELTA)
    return ChatSetup(
        name=name,
        request_id=f"{prefix}-{uuid.uuid4().hex}",
        prompt_text=text,
        prompt_ids=ids,
        params=params,
        tools=tools,
        fmt=fmt,
        forced=forced is not None,
        calls_wanted=choice != "none",
        reasoning=ctx.llm.reasoning,
        include_reasoning=req.include_reasoning,
    )


def whole_reply(setup: ChatSetup, text: str) -> tuple[str | None, str | None, list[ParsedCall]]:
    """``(reasoning_content, content, tool calls)`` of one finished choice: the
    thinking split off first, tool calls parsed from the answer alone."""
    reasoning, content = None, text
    if setup.reasoning is not None:
        reasoning, content = setup.reasoning.split(text, setup.prompt_text)
        content = content or ""
    calls: list[ParsedCall] = []
    if setup.calls_wanted:
        content, calls = parse_reply(content, setup.fmt, setup.tools)
    elif setup.reasoning is not None:
        content = content or None
    return (reasoning if setup.include_reasoning else None), content, calls


class ReplyStream:
    """One choice's text deltas as chat ``delta`` objects: the thinking as
    ``reasoning_content``, the answer as ``content`` or, through a
    ToolStream, ``tool_calls``. Joined, they equal ``whole_reply``."""

    def __init__(self, setup: ChatSetup) -> None:
        self.setup = setup
        self.split = setup.reasoning.stream(setup.prompt_text) if setup.reasoning else None
        self.tools = (
            ToolStream(setup.fmt, setup.tools, setup.forced) if setup.calls_wanted else None
        )

    def add(self, text: str) -> list[dict[str, Any]]:
        """The deltas for new text."""
        return self._deltas(text, final=False)[0]

    def finish(self) -> tuple[list[dict[str, Any]], bool]:
        """The last deltas, and whether the reply made tool calls."""
        return self._deltas("", final=True)

    def _deltas(self, text: str, final: bool) -> tuple[list[dict[str, Any]], bool]:
        out: list[dict[str, Any]] = []
        answer = text
        if self.split is not None:
            reasoning, answer = self.split.finish() if final else self.split.add(text)
            if reasoning and self.setup.include_reasoning:
                out.append({"reasoning_content": reasoning})
        if self.tools is None:
            if answer:
                out.append({"content": answer})
            return out, False
        out += self.tools.add(answer) if answer else []
        if not final:
            return out, False
        last, called = self.tools.finish()
        return out + last, called


def register(app: FastAPI, ctx: RouteContext) -> None:
    """Adds ``/v1/chat/completions`` to ``app``."""

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        req = await read_model(raw, ChatCompletionRequest, ctx.state.max_body_bytes)
        setup = prepare_chat(ctx, req)
        top_k = req.top_logprobs or 0
        created = int(time.time())
        gen = ctx.engine.generate(
            setup.prompt_text, setup.prompt_ids, setup.params, setup.request_id
        )
        if req.stream:
            body = stream_chat(gen, setup, created, req.include_usage, top_k, req.return_token_ids)
            return StreamingResponse(body, media_type="text/event-stream")
        try:
            out = await unless_disconnected(raw, last_output(gen))
        except Exception as e:
            raise engine_error(e) from e
        if out is None:
            return Response(status_code=499)
        choices = [_choice(c, setup, top_k) for c in out.outputs]
        completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        body = {
            "id": setup.request_id,
            "object": "chat.completion",
            "created": created,
            "model": setup.name,
            "choices": choices,
            "usage": usage(len(setup.prompt_ids), completion_tokens),
        }
        if req.return_token_ids:
            body["prompt_token_ids"] = list(setup.prompt_ids)
            for choice, c in zip(choices, out.outputs, strict=True):
                choice["token_ids"] = list(c.token_ids)
        return JSONResponse(body)


async def last_output(gen: AsyncIterator[RequestOutput]) -> RequestOutput | None:
    """The final output of a request that is not streamed."""
    final = None
    async for out in gen:
        final = out
    return final


def _choice(c: Any, setup: ChatSetup, top_k: int) -> dict[str, Any]:
    """One choice of a whole reply. A forced call that did not complete is a 400."""
    params = setup.params
    lp = None
    if params.logprobs is not None and c.logprobs is not None:
        lp = chat_logprobs(c.token_ids, c.logprobs, top_k)
    reasoning, content, calls = whole_reply(setup, c.text)
    if setup.forced and not calls:
        raise unfinished_forced_call(params.max_tokens, c.index)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if setup.reasoning is not None:
        message["reasoning_content"] = reasoning
    finish = c.finish_reason
    if calls:
        message["tool_calls"] = tool_calls_json(calls)
        finish = "tool_calls" if finish == "stop" else finish
    return {
        "index": c.index,
        "message": message,
        "logprobs": lp,
        "finish_reason": finish,
        "stop_reason": c.stop_reason,
    }


async def stream_chat(
    gen: AsyncIterator[RequestOutput],
    setup: ChatSetup,
    created: int,
    include_usage: bool,
    top_k: int,
    ids_out: bool = False,
) -> AsyncIterator[str]:
    """The SSE chunks of a streamed chat reply: each choice's text goes
    through a ReplyStream (reasoning_content, content and tool_calls deltas);
    with ``ids_out`` the first chunk gives ``prompt_token_ids`` and each
    output's new tokens ride on its first chunk as ``token_ids``."""
    params = setup.params
    streams = [ReplyStream(setup) for _ in range(params.n)]

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
        body = {
            "id": setup.request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": setup.name,
            "choices": choices,
        }
        body.update(extra)
        return sse(body)

    # Outputs are deltas (RequestOutputKind.DELTA): new text, tokens and logprobs.
    completion_tokens = 0
    try:
        for i in range(params.n):
            first = {"index": i, "delta": {"role": "assistant", "content": ""}}
            extra = {"prompt_token_ids": list(setup.prompt_ids)} if ids_out and i == 0 else {}
            yield chunk([{**first, "logprobs": None, "finish_reason": None}], **extra)
        async for out in gen:
            for c in out.outputs:
                text, finish = c.text, c.finish_reason
                want_lp = params.logprobs is not None and c.logprobs is not None
                completion_tokens += len(c.token_ids)
                new_ids = bool(c.token_ids) and (want_lp or ids_out)
                if not text and not finish and not new_ids:
                    continue
                ids = {"token_ids": list(c.token_ids)} if ids_out else {}
                lp = chat_logprobs(c.token_ids, c.logprobs, top_k) if want_lp else None
                rs = streams[c.index]
                deltas = rs.add(text)
                if finish:
                    last, called = rs.finish()
                    deltas += last
                    if setup.forced and not called:
                        raise unfinished_forced_call(params.max_tokens, c.index)
                    if called and finish == "stop":
                        finish = "tool_calls"
                for d in deltas:
                    yield chunk(
                        [
                            {
                                "index": c.index,
                                "delta": d,
                                "logprobs": lp,
                                "finish_reason": None,
                                **ids,
                            }
                        ]
                    )
                    lp, ids = None, {"token_ids": []} if ids else {}
                if not finish and not lp and not (ids and ids["token_ids"]):
                    continue
                choice = {
                    "index": c.index,
                    "delta": {} if finish else {"content": ""},
                    "logprobs": lp,
                    "finish_reason": finish,
                    **ids,
                }
                if finish:
                    choice["stop_reason"] = c.stop_reason
                yield chunk([choice])
        if include_usage:
            yield chunk([], usage=usage(len(setup.prompt_ids), completion_tokens))
    except Exception as e:
        yield sse(engine_error(e).body())
    yield "data: [DONE]\n\n"
