"""What every route of the server shares: reading a request body, the error
responses, waiting on the engine while watching the client, and the pieces
of OpenAI's reply formats (logprobs, usage, server-sent events)."""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from fastllm.outputs import Logprob, RequestOutput
from fastllm.server.engine_loop import EngineDeadError
from fastllm.server.protocol import APIError, validation_error

M = TypeVar("M", bound=BaseModel)


T = TypeVar("T")


def too_large(limit: int) -> APIError:
    return APIError(f"request body is larger than the limit of {limit} bytes", 413)


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


async def read_model(raw: Request, model: type[M], limit: int) -> M:
    """Reads the body (at most ``limit`` bytes) and validates it as ``model``."""
    body = bytearray()
    async for chunk in raw.stream():
        body += chunk
        if len(body) > limit:
            raise too_large(limit)
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"the request body is not valid JSON: {e}", 400) from e
    if not isinstance(data, dict):
        raise APIError("the request body must be a JSON object", 400)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from e


async def unless_disconnected(raw: Request, work: Awaitable[T]) -> T | None:
    """Runs ``work``; cancels it (aborting its requests) if the client disconnects first."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await raw.receive()
            if message["type"] == "http.disconnect":
                task.cancel()
                return

    watcher = asyncio.ensure_future(watch())
    try:
        return await task
    except asyncio.CancelledError:
        if watcher.done():  # the client left: nobody reads the answer
            return None
        raise
    finally:
        watcher.cancel()


async def merge_outputs(
    iters: list[AsyncIterator[RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleaves several requests' outputs as (prompt index, output); leaving
    early cancels (and so aborts) every request still running."""
    q: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, it: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in it:
                q.put_nowait((i, out))
        except Exception as e:
            q.put_nowait((i, e))
        finally:
            q.put_nowait((i, done))

    tasks = [asyncio.ensure_future(pump(i, it)) for i, it in enumerate(iters)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await q.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


def engine_error(e: Exception) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, EngineDeadError):
        return APIError(str(e), 503)
    if isinstance(e, ValueError):
        return APIError(str(e), 400)
    return APIError(f"generation failed: {e}", 500, type="InternalServerError")


def _finite(x: float) -> float:
    """OpenAI clients cannot read -inf / NaN: map them to a very low log-probability."""
    return x if math.isfinite(x) else -9999.0


def _ranked(entry: dict[int, Logprob], k: int) -> list[Logprob]:
    return sorted(entry.values(), key=lambda lp: -lp.logprob)[:k]


def completion_logprobs(
    token_ids: list[int], entries: list[dict[int, Logprob]], offset: int
) -> dict[str, Any]:
    """The ``logprobs`` object of a completions choice, text offsets from ``offset``."""
    tokens, lps, tops, offsets = [], [], [], []
    for tok, entry in zip(token_ids, entries):
        chosen = entry[tok]
        text = chosen.decoded_token or ""
        tokens.append(text)
        lps.append(_finite(chosen.logprob))
        top: dict[str, float] = {}
        for lp in _ranked(entry, len(entry)):
            # tokens that decode alike share a key: keep the likelier one
            top.setdefault(lp.decoded_token or "", _finite(lp.logprob))
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(
    token_ids: list[int], entries: list[dict[int, Logprob]], k: int
) -> dict[str, Any]:
    """The ``logprobs`` object of a chat choice (``content`` list with top_logprobs)."""

    def item(lp: Logprob) -> dict[str, Any]:
        text = lp.decoded_token or ""
        return {"token": text, "logprob": _finite(lp.logprob), "bytes": list(text.encode())}

    content = []
    for tok, entry in zip(token_ids, entries):
        d = item(entry[tok])
        d["top_logprobs"] = [item(lp) for lp in _ranked(entry, k)]
        content.append(d)
    return {"content": content}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def sse_event(name: str, obj: Any) -> str:
    """A named server-sent event: the Responses and Anthropic Messages streams
    name each event (Anthropic's client skips events without a name)."""
    return f"event: {name}\n{sse(obj)}"


def renamed(err: APIError, names: dict[str, str]) -> APIError:
    """``err`` with the chat fields it names said in another API's words, for
    routes that translate to chat: a key names a top-level field
    (``max_tokens`` → ``max_output_tokens``), or, starting with ``.``, a part
    of a path (``.function.parameters`` → ``.input_schema``)."""
    param, message = err.param or "", err.message
    head = param.split("[")[0].split(".")[0]
    if head in names:
        message = re.sub(rf"(?<![\w/]){re.escape(head)}\b", names[head], message)
        param = names[head] + param[len(head) :]
    for ours, theirs in names.items():
        if ours.startswith(".") and ours in param:
            param, message = param.replace(ours, theirs), message.replace(ours, theirs)
    if param == (err.param or "") and message == err.message:
        return err
    return APIError(message, err.status, param=param or None, type=err.type, code=err.code)
