"""The OpenAI-compatible HTTP server: FastAPI routes over one AsyncEngine."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from fastllm.config import EngineConfig
from fastllm.engine.llm_engine import RequestError
from fastllm.llm import chat_stop
from fastllm.logs import configure_logging
from fastllm.outputs import Logprob, RequestOutput
from fastllm.sampling_params import RequestOutputKind, SamplingParams
from fastllm.server.engine_loop import AsyncEngine, EngineDeadError, Histogram
from fastllm.server.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    validation_error,
)
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

logger = logging.getLogger("fastllm.server")

DEFAULT_MAX_BODY_BYTES = 4 << 20
# Paths a configured API key protects (health and metrics stay open, as in vLLM).
_PROTECTED = ("/v1/", "/tokenize", "/detokenize")

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


@dataclass
class ServerState:
    """What every route needs: the engine, the served names and the limits."""

    engine: AsyncEngine
    model_names: list[str]
    max_model_len: int
    max_body_bytes: int
    created: int
    # names accepted in a request's "model" besides model_names (not listed by /v1/models)
    aliases: tuple[str, ...] = ()
    # default template of /v1/chat/completions (--chat-template); None: the model's
    chat_template: str | None = None
    api_key_required: bool = False


def default_model_name(model: str, folder: str) -> str:
    """The short name a model is served as: the folder's base name, or for a
    Hugging Face cache snapshot (``.../models--org--name/snapshots/<commit>``)
    the repo's name."""
    path = os.path.normpath(os.path.abspath(folder))
    parent, base = os.path.split(path)
    grand, snapshots = os.path.split(parent)
    repo = os.path.basename(grand)
    if snapshots == "snapshots" and repo.startswith("models--"):
        return repo.split("--")[-1] or base
    return base or model


def _hub_repo_id(folder: str) -> str | None:
    """``org/name`` of a Hugging Face cache snapshot folder, else None."""
    parent = os.path.dirname(os.path.normpath(os.path.abspath(folder)))
    repo = os.path.basename(os.path.dirname(parent))
    if os.path.basename(parent) == "snapshots" and repo.startswith("models--"):
        return repo.removeprefix("models--").replace("--", "/")
    return None


def create_app(
    engine_args: EngineConfig,
    *,
    served_model_name: str | list[str] | None = None,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    chat_template: str | None = None,
) -> FastAPI:
    """Loads the model and returns the FastAPI app serving it (the engine thread
    starts with the app's lifespan).

    Without ``served_model_name`` the model is served under
    ``default_model_name`` (the folder's name) and a request may also name it
    as ``engine_args.model`` was given, by its folder or by its hub id.
    ``chat_template`` (a Jinja template) replaces the model's as the default of
    ``/v1/chat/completions``; a request's own ``chat_template`` still wins.
    """
    from fastllm.cli import check_chat_template
    from fastllm.engine.llm_engine import LLMEngine

    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be positive, got {max_body_bytes}")
    if isinstance(served_model_name, str):
        served_model_name = [served_model_name]
    if served_model_name is not None and (
        not served_model_name or not all(isinstance(n, str) and n for n in served_model_name)
    ):
        raise ValueError(f"served_model_name must be non-empty strings, got {served_model_name!r}")
    llm = LLMEngine(engine_args)
    if chat_template is not None:
        check_chat_template(llm.tokenizer, chat_template, llm.folder)
    aliases: list[str] = []
    if served_model_name is None:
        names = [default_model_name(engine_args.model, llm.folder)]
        for alias in (engine_args.model, llm.folder, _hub_repo_id(llm.folder)):
            if alias and alias not in names and alias not in aliases:
                aliases.append(alias)
    else:
        names = list(served_model_name)
    engine = AsyncEngine(llm)
    state = ServerState(
        engine=engine,
        model_names=names,
        max_model_len=llm.max_model_len,
        max_body_bytes=max_body_bytes,
        created=int(time.time()),
        aliases=tuple(aliases),
        chat_template=chat_template,
        api_key_required=bool(api_key),
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="fastllm", version=_version(), lifespan=lifespan)
    app.state.fastllm = state
    app.add_middleware(_Guard, api_key=api_key, max_body_bytes=max_body_bytes)
    _add_error_handlers(app)
    _add_routes(app, state)
    return app


def _version() -> str:
    from fastllm import __version__

    return __version__


# ---- middleware and errors ---------------------------------------------------


class _Guard:
    """ASGI middleware: the API key and the Content-Length limit, checked before routing."""

    def __init__(self, app: Any, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        path = scope.get("path", "")
        if self.api_key is not None and path.startswith(_PROTECTED):
            auth = headers.get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
                err = APIError(
                    "missing or invalid API key: send 'Authorization: Bearer <key>'",
                    401,
                    type="invalid_request_error",
                    code="invalid_api_key",
                )
                await _error_response(err)(scope, receive, send)
                return
        length = headers.get(b"content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                n = -1
            if n < 0:
                err = APIError("malformed Content-Length header", 400, param=None)
                await _error_response(err)(scope, receive, send)
                return
            if n > self.max_body_bytes:
                await _error_response(_too_large(self.max_body_bytes))(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _too_large(limit: int) -> APIError:
    return APIError(f"request body is larger than the limit of {limit} bytes", 413)


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        field = ".".join(loc) or None
        msg = f"{field}: {first.get('msg', 'invalid request')}" if field else "invalid request"
        return _error_response(APIError(msg, 400, param=field))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error_response(APIError(str(exc.detail), exc.status_code))

    @app.exception_handler(Exception)
    async def internal(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return _error_response(APIError(f"internal error: {exc}", 500, type="InternalServerError"))


async def _read_model(raw: Request, model: type[M], limit: int) -> M:
    """Reads the body (at most ``limit`` bytes) and validates it as ``model``."""
    body = bytearray()
    async for chunk in raw.stream():
        body += chunk
        if len(body) > limit:
            raise _too_large(limit)
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


async def _unless_disconnected(raw: Request, work: Awaitable[T]) -> T | None:
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


async def _merge(
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


def _engine_error(e: Exception) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, EngineDeadError):
        return APIError(str(e), 503)
    if isinstance(e, ValueError):
        return APIError(str(e), 400)
    return APIError(f"generation failed: {e}", 500, type="InternalServerError")


# ---- formatting helpers ------------------------------------------------------


def _finite(x: float) -> float:
    """OpenAI clients cannot read -inf / NaN: map them to a very low log-probability."""
    return x if math.isfinite(x) else -9999.0


def _ranked(entry: dict[int, Logprob], k: int) -> list[Logprob]:
    return sorted(entry.values(), key=lambda lp: -lp.logprob)[:k]


def _completion_logprobs(
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


def _chat_logprobs(
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


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


# ---- routes ------------------------------------------------------------------


def _add_routes(app: FastAPI, state: ServerState) -> None:
    engine = state.engine
    llm = engine.engine
    tok = llm.tokenizer

    def model_name(requested: str | None) -> str:
        if requested is None or requested in state.aliases:
            return state.model_names[0]
        if requested not in state.model_names:
            raise APIError(
                f"the model `{requested}` does not exist; this server serves "
                f"{', '.join(state.model_names)}",
                404,
                param="model",
                code="model_not_found",
            )
        return requested

    def check_request(
        ids: list[int], params: SamplingParams, where: str, fields: dict[str, str]
    ) -> None:
        """The engine's rule for every request (offline too); ``fields`` maps
        SamplingParams names to this endpoint's names."""
        try:
            llm.validate_request(ids, params, where)
        except RequestError as e:
            param = where.split("[")[0] if e.field == "prompt" else fields.get(e.field, e.field)
            msg = str(e)
            for ours, theirs in fields.items():
                msg = msg.replace(f"{ours}=", f"{theirs}=").replace(
                    f"lower {ours}", f"lower {theirs}"
                )
            raise APIError(msg, 400, param=param) from e

    def chat_template(requested: str | None) -> str:
        """The template a chat request renders with: its own, else the server's
        (--chat-template), else the model's; a 400 when there is none."""
        template = requested or state.chat_template or tok.chat_template
        if template is None:
            raise APIError(
                "this model has no chat template, so /v1/chat/completions cannot render "
                "messages: start the server with --chat-template FILE|STRING (or send "
                "chat_template in the request)",
                400,
                param="messages",
            )
        return template

    def render_chat(
        messages: list[ChatMessage],
        template: str,
        add_gen: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        from jinja2.exceptions import TemplateError

        dicts = [m.as_dict() for m in messages]
        extra = {"tools": tools} if tools else {}
        try:
            return tok.apply_chat_template(
                dicts, chat_template=template, add_generation_prompt=add_gen, **extra
            )
        except (ValueError, TemplateError) as e:
            raise APIError(f"cannot apply the chat template: {e}", 400, param="messages") from e

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_alive:
            return _error_response(APIError(f"the engine is not running: {engine.error!r}", 503))
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        data = [
            {
                "id": name,
                "object": "model",
                "created": state.created,
                "owned_by": "fastllm",
                "root": llm.folder,
                "max_model_len": state.max_model_len,
                "quantization": _quantization_field(llm),
                **({"gguf": llm.gguf} if getattr(llm, "gguf", None) else {}),
            }
            for name in state.model_names
        ]
        return JSONResponse({"object": "list", "data": data})

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        req = await _read_model(raw, CompletionRequest, state.max_body_bytes)
        name = model_name(req.model)
        items: list[tuple[str | None, list[int]]] = []
        prompts = req.prompts()
        for i, p in enumerate(prompts):
            ids = tok.encode(p) if isinstance(p, str) else p
            where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            items.append((p if isinstance(p, str) else None, ids))
        params = req.to_sampling_params(req.max_tokens)
        for i, (_, ids) in enumerate(items):
            where = "prompt" if len(items) == 1 else f"prompt[{i}]"
            check_request(ids, params, where, {})
        cid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.CUMULATIVE
        gens = [
            engine.generate(text, ids, params.clone(output_kind=kind), f"{cid}-{i}")
            for i, (text, ids) in enumerate(items)
        ]
        echoes = [
            (text if text is not None else tok.decode(ids)) if req.echo else ""
            for text, ids in items
        ]
        if req.stream:
            body = _stream_completion(
                gens, cid, created, name, params, req.include_usage, echoes, items
            )
            return StreamingResponse(body, media_type="text/event-stream")

        async def collect() -> list[RequestOutput]:
            final: list[RequestOutput | None] = [None] * len(gens)
            async for i, out in _merge(gens):
                if out.finished:
                    final[i] = out
            return [f for f in final if f is not None]

        try:
            finals = await _unless_disconnected(raw, collect())
        except Exception as e:
            raise _engine_error(e) from e
        if finals is None:
            return Response(status_code=499)
        choices = []
        completion_tokens = 0
        for i, out in enumerate(finals):
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                lp = None
                if params.logprobs is not None and c.logprobs is not None:
                    lp = _completion_logprobs(c.token_ids, c.logprobs, len(echoes[i]))
                choices.append(
                    {
                        "index": i * params.n + c.index,
                        "text": echoes[i] + c.text,
                        "logprobs": lp,
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                )
        prompt_tokens = sum(len(ids) for _, ids in items)
        return JSONResponse(
            {
                "id": cid,
                "object": "text_completion",
                "created": created,
                "model": name,
                "choices": choices,
                "usage": _usage(prompt_tokens, completion_tokens),
            }
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        req = await _read_model(raw, ChatCompletionRequest, state.max_body_bytes)
        name = model_name(req.model)
        template = chat_template(req.chat_template)
        tools = parse_tools(req.tools) if req.tools else []
        choice = resolve_tool_choice(req.tool_choice, tools)
        fmt = call_format(template)
        forced = None
        if choice == "required":
            forced = forced_call_constraint(tools, fmt)
        elif isinstance(choice, Tool):
            forced = forced_call_constraint([choice], fmt)
        calls_wanted = choice != "none"
        text = render_chat(
            req.messages, template, req.add_generation_prompt, req.tools if calls_wanted else None
        )
        ids = tok.encode(text, add_special_tokens=False)
        max_tokens, field = req.requested_max_tokens()
        # the reply ends at the template's end of turn, as LLM.chat's does
        params = chat_stop(req.to_sampling_params(max_tokens, forced), tok, template)
        check_request(ids, params, "messages", {"max_tokens": field, "logprobs": "top_logprobs"})
        top_k = req.top_logprobs or 0
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if req.stream:
            params = params.clone(output_kind=RequestOutputKind.DELTA)
        gen = engine.generate(text, ids, params, cid)
        if req.stream:

            def tool_stream() -> ToolStream | None:
                return ToolStream(fmt, tools, forced is not None) if calls_wanted else None

            body = _stream_chat(
                gen, cid, created, name, params, req.include_usage, len(ids), top_k, tool_stream
            )
            return StreamingResponse(body, media_type="text/event-stream")

        async def collect() -> RequestOutput | None:
            final = None
            async for out in gen:
                final = out
            return final

        try:
            out = await _unless_disconnected(raw, collect())
        except Exception as e:
            raise _engine_error(e) from e
        if out is None:
            return Response(status_code=499)
        choices = []
        for c in out.outputs:
            lp = None
            if params.logprobs is not None and c.logprobs is not None:
                lp = _chat_logprobs(c.token_ids, c.logprobs, top_k)
            message: dict[str, Any] = {"role": "assistant", "content": c.text}
            finish = c.finish_reason
            if calls_wanted:
                content, calls = parse_reply(c.text, fmt, tools)
                if forced is not None and not calls:
                    raise unfinished_forced_call(params.max_tokens, c.index)
                if calls:
                    message = {
                        "role": "assistant",
                        "content": content,
                        "tool_calls": tool_calls_json(calls),
                    }
                    finish = "tool_calls" if finish == "stop" else finish
            choices.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": lp,
                    "finish_reason": finish,
                    "stop_reason": c.stop_reason,
                }
            )
        completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        return JSONResponse(
            {
                "id": cid,
                "object": "chat.completion",
                "created": created,
                "model": name,
                "choices": choices,
                "usage": _usage(len(ids), completion_tokens),
            }
        )

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> JSONResponse:
        req = await _read_model(raw, TokenizeRequest, state.max_body_bytes)
        model_name(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError("give exactly one of prompt and messages", 400, param="prompt")
        if req.messages is not None:
            text = render_chat(req.messages, chat_template(None), req.add_generation_prompt)
            ids = tok.encode(text, add_special_tokens=False)
        else:
            ids = tok.encode(req.prompt or "", add_special_tokens=req.add_special_tokens)
        return JSONResponse(
            {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}
        )

    @app.post("/detokenize")
    async def detokenize(raw: Request) -> JSONResponse:
        req = await _read_model(raw, DetokenizeRequest, state.max_body_bytes)
        model_name(req.model)
        vocab = llm.model_config.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(
                f"tokens: token id {bad} is outside the vocabulary [0, {vocab})",
                400,
                param="tokens",
            )
        return JSONResponse({"prompt": tok.decode(req.tokens)})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(
            _prometheus(engine, state.model_names[0]),
            media_type="text/plain; version=0.0.4; charset=utf-8",
        )


# ---- streaming ---------------------------------------------------------------


async def _stream_completion(
    gens: list[AsyncIterator[RequestOutput]],
    cid: str,
    created: int,
    name: str,
    params: SamplingParams,
    include_usage: bool,
    echoes: list[str],
    items: list[tuple[str | None, list[int]]],
) -> AsyncIterator[str]:
    # Outputs are deltas (RequestOutputKind.DELTA): new text, tokens and logprobs.
    offsets: dict[tuple[int, int], int] = {}  # text offset of the next logprob token
    completion_tokens = 0
    try:
        async for i, out in _merge(gens):
            for c in out.outputs:
                key = (i, c.index)
                text, finish = c.text, c.finish_reason
                want_lp = params.logprobs is not None and c.logprobs is not None
                started = key in offsets
                completion_tokens += len(c.token_ids)
                if not text and not finish and not (c.token_ids and want_lp) and started:
                    continue
                prefix = ""
                if not started:
                    prefix = echoes[i]
                    offsets[key] = len(prefix)
                lp = None
                if want_lp:
                    lp = _completion_logprobs(c.token_ids, c.logprobs, offsets[key])
                    offsets[key] += sum(len(t) for t in lp["tokens"])
                choice = {
                    "index": i * params.n + c.index,
                    "text": prefix + text,
                    "logprobs": lp,
                    "finish_reason": finish,
                    "stop_reason": c.stop_reason if finish else None,
                }
                yield _sse(
                    {
                        "id": cid,
                        "object": "text_completion",
                        "created": created,
                        "model": name,
                        "choices": [choice],
                    }
                )
        if include_usage:
            prompt_tokens = sum(len(ids) for _, ids in items)
            yield _sse(
                {
                    "id": cid,
                    "object": "text_completion",
                    "created": created,
                    "model": name,
                    "choices": [],
                    "usage": _usage(prompt_tokens, completion_tokens),
                }
            )
    except APIError as e:
        yield _sse(e.body())
    except Exception as e:
        yield _sse(_engine_error(e).body())
    yield "data: [DONE]\n\n"


async def _stream_chat(
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
        return _sse(body)

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
                    lp = _chat_logprobs(c.token_ids, c.logprobs, top_k)
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
            yield chunk([], usage=_usage(prompt_tokens, completion_tokens))
    except APIError as e:
        yield _sse(e.body())
    except Exception as e:
        yield _sse(_engine_error(e).body())
    yield "data: [DONE]\n\n"


# ---- metrics -----------------------------------------------------------------


def _prometheus(engine: AsyncEngine, model: str, replica: str | None = None) -> str:
    """The /metrics page in Prometheus' text format; with ``replica`` (a Ray
    Serve replica's id) every sample also carries a ``replica`` label."""
    s = engine.stats
    label = f'model_name="{_escape(model)}"'
    if replica is not None:
        label += f',replica="{_escape(replica)}"'
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, value: float, extra: str = "") -> None:
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} {kind}")
        labels = f"{label},{extra}" if extra else label
        lines.append(f"{name}{{{labels}}} {_num(value)}")

    metric("fastllm_num_requests_running", "gauge", "Requests in the running batch.", s.running)
    metric("fastllm_num_requests_waiting", "gauge", "Requests waiting to run.", s.waiting)
    metric("fastllm_prompt_tokens_total", "counter", "Prompt tokens computed.", s.prompt_tokens)
    metric(
        "fastllm_generation_tokens_total",
        "counter",
        "Tokens generated.",
        s.generation_tokens,
    )
    metric("fastllm_engine_steps_total", "counter", "Engine steps run.", s.steps)
    metric("fastllm_kv_blocks_total", "gauge", "KV-cache blocks in the pool.", s.num_blocks)
    metric(
        "fastllm_kv_blocks_free",
        "gauge",
        "KV-cache blocks that can be handed out (free or evictable cached).",
        s.free_blocks,
    )
    metric(
        "fastllm_kv_blocks_used",
        "gauge",
        "KV-cache blocks held by requests.",
        s.num_blocks - s.free_blocks,
    )
    metric(
        "fastllm_kv_blocks_cached",
        "gauge",
        "KV-cache blocks holding prefix-cache content.",
        s.cached_blocks,
    )
    usage = (s.num_blocks - s.free_blocks) / s.num_blocks if s.num_blocks else 0.0
    metric("fastllm_kv_cache_usage_perc", "gauge", "Fraction of KV blocks in use.", usage)
    metric(
        "fastllm_prefix_cache_queries_total",
        "counter",
        "Full prompt blocks looked up in the prefix cache.",
        s.prefix_queries,
    )
    metric(
        "fastllm_prefix_cache_hits_total",
        "counter",
        "Prompt blocks found in the prefix cache.",
        s.prefix_hits,
    )
    rate = s.prefix_hits / s.prefix_queries if s.prefix_queries else 0.0
    metric("fastllm_prefix_cache_hit_rate", "gauge", "Prefix-cache hits per query.", rate)
    metric(
        "fastllm_prefix_cache_evictions_total",
        "counter",
        "Cached blocks evicted.",
        s.evictions,
    )
    name = "fastllm_request_finished_total"
    lines.append(f"# HELP {name} Requests finished, by reason (stop, length, abort, error).")
    lines.append(f"# TYPE {name} counter")
    for reason in ("stop", "length", "abort", "error"):
        lines.append(f'{name}{{{label},finished_reason="{reason}"}} {s.finished.get(reason, 0)}')
    _histogram(
        lines,
        "fastllm_time_to_first_token_seconds",
        "Seconds from arrival to the first generated token.",
        engine.ttft,
        label,
    )
    _histogram(
        lines,
        "fastllm_inter_token_latency_seconds",
        "Seconds between successive generated tokens of a request.",
        engine.itl,
        label,
    )
    return "\n".join(lines) + "\n"


def _histogram(lines: list[str], name: str, help_: str, h: Histogram, label: str) -> None:
    buckets, total, count = h.snapshot()
    lines.append(f"# HELP {name} {help_}")
    lines.append(f"# TYPE {name} histogram")
    for le, c in buckets:
        lines.append(f'{name}_bucket{{{label},le="{le}"}} {c}')
    lines.append(f"{name}_sum{{{label}}} {_num(total)}")
    lines.append(f"{name}_count{{{label}}} {count}")


def _num(v: float) -> str:
    if isinstance(v, int):
        return str(v)
    return repr(float(v))


def _escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _quantization_field(llm: Any) -> str | None:
    """/v1/models' ``quantization``: the format quantized at load, or "gguf"."""
    if getattr(llm, "gguf", None):
        return "gguf"
    return getattr(llm, "quantization", None)


# ---- running -----------------------------------------------------------------


def startup_summary(app: FastAPI, host: str, port: int) -> str:
    """The block ``serve`` logs once before it listens: what is served, how, and where."""
    state: ServerState = app.state.fastllm
    llm = state.engine.engine
    from fastllm.layers.quantization import describe

    quant = describe(getattr(llm.config, "quantization", None))
    if getattr(llm, "gguf", None):
        from fastllm.gguf import describe_tensor_types

        quant = f"gguf ({describe_tensor_types(llm.gguf)})"
    if state.chat_template is not None:
        chat = "from --chat-template"
    elif llm.tokenizer.chat_template is not None:
        chat = "the model's"
    else:
        chat = "none (/v1/chat/completions answers 400; start with --chat-template)"
    shown_host = f"[{host}]" if ":" in host else host
    rows = [
        ("model", llm.folder),
        ("served as", ", ".join(state.model_names)),
        ("device", str(llm.device)),
        ("dtype", str(llm.dtype).removeprefix("torch.")),
        ("quantization", quant),
        ("max_model_len", str(state.max_model_len)),
        ("KV cache", llm.cache.describe()),
        ("chat template", chat),
        ("API key", "required" if state.api_key_required else "not required"),
        ("address", f"http://{shown_host}:{port}"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"fastllm {_version()} server"]
    lines += [f"  {k.ljust(width)}  {v}" for k, v in rows]
    return "\n".join(lines)


def serve(
    engine_args: EngineConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    served_model_name: str | list[str] | None = None,
    log_level: str = "info",
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    chat_template: str | None = None,
) -> None:
    """Loads the model, logs the startup summary and serves it with uvicorn
    until interrupted."""
    import uvicorn

    configure_logging(log_level)
    app = create_app(
        engine_args,
        served_model_name=served_model_name,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        chat_template=chat_template,
    )
    logger.info("%s", startup_summary(app, host, port))
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=5,
    )
