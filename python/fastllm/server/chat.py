"""``/v1/chat/completions``: a conversation in, the assistant's reply out,
whole or streamed, with tool calls."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from fastllm.inputs import chat_stop
from fastllm.outputs import RequestOutput
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
    Tool,
    ToolStream,
    call_format,
    forced_call_constraint,
    parse_reply,
    parse_tools,
    resolve_tool_choice,
    tool_calls_json,
    unfinished_forced_call,
)


def register(app: FastAPI, ctx: RouteContext) -> None:
    """Adds ``/v1/chat/completions`` to ``app``."""

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        req = await read_model(raw, ChatCompletionRequest, ctx.state.max_body_bytes)
        name = ctx.model_name(req.model)
        template = ctx.chat_template(req.chat_template)
        tools = parse_tools(req.tools) if req.tools else []
        choice = resolve_tool_choice(req.tool_choice, tools)
        fmt = call_format(template)
        forced = None
        if choice == "required":
            forced = forced_call_constraint(tools, fmt)
        elif isinstance(choice, Tool):
            forced = forced_call_constraint([choice], fmt)
        calls_wanted = choice != "none"
        text, ids = req.prompt(ctx.tok, template)
        max_tokens, field = req.requested_max_tokens()
        # the reply ends at the template's end of turn, as LLM.chat's does
        params = chat_stop(req.to_sampling_params(max_tokens, forced), ctx.tok, template)
        ctx.check_request(
            ids, params, "messages", {"max_tokens": field, "logprobs": "top_logprobs"}
        )
        top_k = req.top_logprobs or 0
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if req.stream:
            params = params.clone(output_kind=RequestOutputKind.DELTA)
        gen = ctx.engine.generate(text, ids, params, cid)
        if req.stream:

            def tool_stream() -> ToolStream | None:
                return ToolStream(fmt, tools, forced is not None) if calls_wanted else None

            body = stream_chat(
                gen, cid, created, name, params, req.include_usage, len(ids), top_k, tool_stream
            )
            return StreamingResponse(body, media_type="text/event-stream")

        async def collect() -> RequestOutput | None:
            final = None
            async for out in gen:
                final = out
            return final

        try:
            out = await unless_disconnected(raw, collect())
        except Exception as e:
            raise engine_error(e) from e
        if out is None:
            return Response(status_code=499)
        calls = (fmt, tools, forced is not None) if calls_wanted else None
        choices = [_choice(c, params, top_k, calls) for c in out.outputs]
        completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        return JSONResponse(
            {
                "id": cid,
                "object": "chat.completion",
                "created": created,
                "model": name,
                "choices": choices,
                "usage": usage(len(ids), completion_tokens),
            }
        )


def _choice(
    c: Any, params: SamplingParams, top_k: int, calls: tuple[str, list[Tool], bool] | None
) -> dict[str, Any]:
    """One choice of a whole reply; ``calls``: (format, tools, forced) when the
    reply may hold tool calls. A forced call that did not complete is a 400."""
    lp = None
    if params.logprobs is not None and c.logprobs is not None:
        lp = chat_logprobs(c.token_ids, c.logprobs, top_k)
    message: dict[str, Any] = {"role": "assistant", "content": c.text}
    finish = c.finish_reason
    if calls is not None:
        fmt, tools, forced = calls
        content, parsed = parse_reply(c.text, fmt, tools)
        if forced and not parsed:
            raise unfinished_forced_call(params.max_tokens, c.index)
        if parsed:
            message = {
                "role": "assistant",
                "content": content,
                "tool_calls": tool_calls_json(parsed),
            }
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
    cid: str,
    created: int,
    name: str,
    params: SamplingParams,
    include_usage: bool,
    prompt_tokens: int,
    top_k: int,
    tool_stream: Callable[[], ToolStream | None] = lambda: None,
) -> AsyncIterator[str]:
    """The SSE chunks of a streamed chat reply; with ``tool_stream``, each
    choice's text goes through a ToolStream, which sends tool calls as
    ``tool_calls`` deltas."""
    streams = [tool_stream() for _ in range(params.n)]

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
        body = {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": name,
            "choices": choices,
        }
        body.update(extra)
        return sse(body)

    # Outputs are deltas (RequestOutputKind.DELTA): new text, tokens and logprobs.
    completion_tokens = 0
    try:
        for i in range(params.n):
            yield chunk(
                [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )
        async for out in gen:
            for c in out.outputs:
                text, finish = c.text, c.finish_reason
                want_lp = params.logprobs is not None and c.logprobs is not None
                completion_tokens += len(c.token_ids)
                if not text and not finish and not (c.token_ids and want_lp):
                    continue
                lp = None
                if want_lp:
                    lp = chat_logprobs(c.token_ids, c.logprobs, top_k)
                ts = streams[c.index] if c.index < len(streams) else None
                if ts is not None:
                    # Text goes through the tool-call parser: content and tool_calls deltas.
                    deltas = ts.add(text)
                    if finish:
                        last, called = ts.finish()
                        deltas += last
                        if ts.forced and not called:
                            raise unfinished_forced_call(params.max_tokens, c.index)
                        if called and finish == "stop":
                            finish = "tool_calls"
                    for d in deltas:
                        yield chunk(
                            [{"index": c.index, "delta": d, "logprobs": lp, "finish_reason": None}]
                        )
                        lp = None
                    if not finish:
                        continue
                    text = ""
                choice = {
                    "index": c.index,
                    "delta": {"content": text} if text or not finish else {},
                    "logprobs": lp,
                    "finish_reason": finish,
                }
                if finish:
                    choice["stop_reason"] = c.stop_reason
                yield chunk([choice])
        if include_usage:
            yield chunk([], usage=usage(prompt_tokens, completion_tokens))
    except Exception as e:
        yield sse(engine_error(e).body())
    yield "data: [DONE]\n\n"
