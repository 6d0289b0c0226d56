"""``/v1/completions``: prompts in, completions out, whole or streamed."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from fastllm.inputs import parse_prompt
from fastllm.outputs import RequestOutput
from fastllm.sampling_params import RequestOutputKind, SamplingParams
from fastllm.server.context import RouteContext
from fastllm.server.http import (
    completion_logprobs,
    engine_error,
    merge_outputs,
    read_model,
    sse,
    unless_disconnected,
    usage,
)
from fastllm.server.protocol import APIError, CompletionRequest


def register(app: FastAPI, ctx: RouteContext) -> None:
    """Adds ``/v1/completions`` to ``app``."""

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        req = await read_model(raw, CompletionRequest, ctx.state.max_body_bytes)
        name = ctx.model_name(req.model)
        items = [parse_prompt(p, ctx.encoder("prompt"), "prompt") for p in req.prompts()]
        params = req.to_sampling_params(req.max_tokens)
        for i, (_, ids) in enumerate(items):
            where = "prompt" if len(items) == 1 else f"prompt[{i}]"
            ctx.check_request(ids, params, where, {})
        cid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.CUMULATIVE
        gens = [
            ctx.engine.generate(text, ids, params.clone(output_kind=kind), f"{cid}-{i}")
            for i, (text, ids) in enumerate(items)
        ]
        echoes = [
            (text if text is not None else ctx.tokenizer("echo", "echo").decode(ids))
            if req.echo
            else ""
            for text, ids in items
        ]
        ids_out = req.return_token_ids if req.return_token_ids is not None else ctx.tok is None
        if req.stream:
            body = stream_completion(
                gens, cid, created, name, params, req.include_usage, echoes, items, ids_out
            )
            return StreamingResponse(body, media_type="text/event-stream")

        async def collect() -> list[RequestOutput]:
            final: list[RequestOutput | None] = [None] * len(gens)
            async for i, out in merge_outputs(gens):
                if out.finished:
                    final[i] = out
            return [f for f in final if f is not None]

        try:
            finals = await unless_disconnected(raw, collect())
        except Exception as e:
            raise engine_error(e) from e
        if finals is None:
            return Response(status_code=499)
        choices = []
        completion_tokens = 0
        for i, out in enumerate(finals):
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                lp = None
                if params.logprobs is not None and c.logprobs is not None:
                    lp = completion_logprobs(c.token_ids, c.logprobs, len(echoes[i]))
                choice = {
                    "index": i * params.n + c.index,
                    "text": echoes[i] + c.text,
                    "logprobs": lp,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                if ids_out:
                    choice["prompt_token_ids"] = items[i][1]
                    choice["token_ids"] = list(c.token_ids)
                choices.append(choice)
        prompt_tokens = sum(len(ids) for _, ids in items)
        head = _head(cid, created, name)
        return JSONResponse(
            {**head, "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}
        )


def _head(cid: str, created: int, name: str) -> dict[str, Any]:
    """The fields every completions reply and chunk starts with."""
    return {"id": cid, "object": "text_completion", "created": created, "model": name}


async def stream_completion(
    gens: list[AsyncIterator[RequestOutput]],
    cid: str,
    created: int,
    name: str,
    params: SamplingParams,
    include_usage: bool,
    echoes: list[str],
    items: list[tuple[str | None, list[int]]],
    ids_out: bool = False,
) -> AsyncIterator[str]:
    # Outputs are deltas (RequestOutputKind.DELTA): new text, tokens and logprobs.
    offsets: dict[tuple[int, int], int] = {}  # text offset of the next logprob token
    completion_tokens = 0
    head = _head(cid, created, name)
    try:
        async for i, out in merge_outputs(gens):
            for c in out.outputs:
                key = (i, c.index)
                text, finish = c.text, c.finish_reason
                want_lp = params.logprobs is not None and c.logprobs is not None
                started = key in offsets
                completion_tokens += len(c.token_ids)
                new_ids = bool(c.token_ids) and (want_lp or ids_out)
                if not text and not finish and not new_ids and started:
                    continue
                prefix = ""
                if not started:
                    prefix = echoes[i]
                    offsets[key] = len(prefix)
                lp = None
                if want_lp:
                    lp = completion_logprobs(c.token_ids, c.logprobs, offsets[key])
                    offsets[key] += sum(len(t) for t in lp["tokens"])
                choice = {
                    "index": i * params.n + c.index,
                    "text": prefix + text,
                    "logprobs": lp,
                    "finish_reason": finish,
                    "stop_reason": c.stop_reason if finish else None,
                }
                if ids_out:
                    if not started:
                        choice["prompt_token_ids"] = items[i][1]
                    choice["token_ids"] = list(c.token_ids)
                yield sse({**head, "choices": [choice]})
        if include_usage:
            prompt_tokens = sum(len(ids) for _, ids in items)
            yield sse({**head, "choices": [], "usage": usage(prompt_tokens, completion_tokens)})
    except APIError as e:
        yield sse(e.body())
    except Exception as e:
        yield sse(engine_error(e).body())
    yield "data: [DONE]\n\n"
