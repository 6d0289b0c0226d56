"""The OpenAI-compatible HTTP server: FastAPI routes over one AsyncEngine."""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from fastllm.config import EngineConfig
from fastllm.inputs import check_chat_template
from fastllm.loading import describe_quantization
from fastllm.logs import configure_logging
from fastllm.server import chat, completions, messages, metrics, pooling, responses, tokenize
from fastllm.server.context import RouteContext, ServerState
from fastllm.server.engine_loop import AsyncEngine
from fastllm.server.http import error_response, too_large
from fastllm.server.protocol import APIError

logger = logging.getLogger("fastllm.server")

DEFAULT_MAX_BODY_BYTES = 4 << 20
# Paths a configured API key protects (health and metrics stay open, as in vLLM).
_PROTECTED = ("/v1/", "/v2/", "/tokenize", "/detokenize", "/rerank", "/score", "/classify")


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
    tool_call_parser: str | None = None,
) -> FastAPI:
    """Loads the model and returns the FastAPI app serving it (the engine thread
    starts with the app's lifespan).

    Without ``served_model_name`` the model is served under
    ``default_model_name`` (the folder's name) and a request may also name it
    as ``engine_args.model`` was given, by its folder or by its hub id.
    ``chat_template`` (a Jinja template) replaces the model's as the default of
    ``/v1/chat/completions``; a request's own ``chat_template`` still wins.
    ``tool_call_parser`` (vLLM's ``--tool-call-parser`` names, ``tools.FORMATS``)
    is the format of tool calls in replies; None or ``auto``: the one each
    request's chat template writes.
    """
    from fastllm.engine.llm_engine import LLMEngine
    from fastllm.server.tools import check_tool_call_parser

    tool_call_parser = check_tool_call_parser(tool_call_parser)
    if tool_call_parser == "openai" and engine_args.reasoning_parser != "openai_gptoss":
        raise ValueError(
            "--tool-call-parser openai (gpt-oss's harmony calls) needs --reasoning-parser "
            f"openai_gptoss, which reads the harmony messages; got {engine_args.reasoning_parser!r}"
        )
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be positive, got {max_body_bytes}")
    if isinstance(served_model_name, str):
        served_model_name = [served_model_name]
    if served_model_name is not None and (
        not served_model_name or not all(isinstance(n, str) and n for n in served_model_name)
    ):
        raise ValueError(f"served_model_name must be non-empty strings, got {served_model_name!r}")
    if _serves_pooling(engine_args):
        from fastllm.pooling.engine import PoolingEngine
        from fastllm.server.pooling_loop import AsyncPooling

        llm: Any = PoolingEngine(engine_args)
        engine: Any = AsyncPooling(llm)
        route_modules: tuple = (tokenize, pooling, metrics)
    else:
        llm = LLMEngine(engine_args)
        if chat_template is not None:
            check_chat_template(llm.tokenizer, chat_template, llm.folder)
        engine = AsyncEngine(llm)
        route_modules = (tokenize, completions, chat, responses, messages, metrics, pooling)
    aliases: list[str] = []
    folder = llm.folder
    if served_model_name is None:
        names = [default_model_name(engine_args.model, folder)]
        for alias in (engine_args.model, folder, _hub_repo_id(folder)):
            if alias and alias not in names and alias not in aliases:
                aliases.append(alias)
    else:
        names = list(served_model_name)
    state = ServerState(
        engine=engine,
        model_names=names,
        max_model_len=llm.max_model_len,
        max_body_bytes=max_body_bytes,
        created=int(time.time()),
        aliases=tuple(aliases),
        chat_template=chat_template,
        api_key_required=bool(api_key),
        tool_call_parser=tool_call_parser,
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
    ctx = RouteContext(state)
    for routes in route_modules:
        routes.register(app, ctx)
    return app


def _serves_pooling(config: EngineConfig) -> bool:
    """Whether the server serves a pooling model: ``runner="pooling"`` (or
    vLLM's older pooling ``task``), or with ``runner="auto"`` an encoder
    folder (the offline ``LLM``'s rule)."""
    if config.pooling:
        return True
    from fastllm.pooling.engine import is_pooling_folder

    return config.runner == "auto" and is_pooling_folder(config)


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
            if not self._key_matches(headers):
                err = APIError(
                    "missing or invalid API key: send 'Authorization: Bearer <key>' "
                    "(or 'x-api-key: <key>')",
                    401,
                    type="invalid_request_error",
                    code="invalid_api_key",
                )
                await _error_response(path, err)(scope, receive, send)
                return
        length = headers.get(b"content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                n = -1
            if n < 0:
                err = APIError("malformed Content-Length header", 400, param=None)
                await _error_response(path, err)(scope, receive, send)
                return
            if n > self.max_body_bytes:
                await _error_response(path, too_large(self.max_body_bytes))(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _key_matches(self, headers: dict[bytes, bytes]) -> bool:
        """Whether the request carries the key: OpenAI's ``Authorization:
        Bearer`` or Anthropic's ``x-api-key``."""
        assert self.api_key is not None
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key):
            return True
        return hmac.compare_digest(headers.get(b"x-api-key", b"").strip(), self.api_key)


def _error_response(path: str, err: APIError) -> JSONResponse:
    """The error in the format of the API ``path`` belongs to."""
    if path.startswith("/v1/messages"):
        return messages.anthropic_error_response(err)
    return error_response(err)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        field = ".".join(loc) or None
        msg = f"{field}: {first.get('msg', 'invalid request')}" if field else "invalid request"
        return error_response(APIError(msg, 400, param=field))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(APIError(str(exc.detail), exc.status_code))

    @app.exception_handler(Exception)
    async def internal(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_response(APIError(f"internal error: {exc}", 500, type="InternalServerError"))


# ---- formatting helpers ------------------------------------------------------


# ---- routes ------------------------------------------------------------------

# ---- metrics -----------------------------------------------------------------


# ---- running -----------------------------------------------------------------


def startup_summary(app: FastAPI, host: str, port: int) -> str:
    """The block ``serve`` logs once before it listens: what is served, how, and where."""
    state: ServerState = app.state.fastllm
    if not isinstance(state.engine, AsyncEngine):
        return pooling.startup_summary(state, _version(), host, port)
    llm = state.engine.engine
    quant = describe_quantization(llm.loaded, llm.config.quantization)
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
        ("tool calls", _tool_calls_summary(state, getattr(llm.tokenizer, "chat_template", None))),
        ("API key", "required" if state.api_key_required else "not required"),
        ("address", f"http://{shown_host}:{port}"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"fastllm {_version()} server"]
    lines += [f"  {k.ljust(width)}  {v}" for k, v in rows]
    return "\n".join(lines)


def _tool_calls_summary(state: ServerState, model_template: str | None) -> str:
    """The format of tool calls in replies to the default chat template, and why."""
    from fastllm.server.tools import call_format

    fmt = call_format(state.chat_template or model_template, state.tool_call_parser)
    return f"{fmt} ({'--tool-call-parser' if state.tool_call_parser != 'auto' else 'auto'})"


def serve(
    engine_args: EngineConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    served_model_name: str | list[str] | None = None,
    log_level: str = "info",
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    chat_template: str | None = None,
    tool_call_parser: str | None = None,
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
        tool_call_parser=tool_call_parser,
    )
    logger.info("%s", startup_summary(app, host, port))
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=5,
    )
