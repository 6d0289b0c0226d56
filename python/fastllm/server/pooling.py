"""The pooling routes: ``/v1/embeddings`` (OpenAI), ``/v1/rerank``,
``/rerank``, ``/v2/rerank`` (Jina / Cohere), ``/score``, ``/v1/score`` and
``/classify`` (vLLM), served by a ``--runner pooling`` server through one
AsyncPooling worker. A generation server answers them with a 400 that says
how to start a pooling one, and a pooling server answers the generation
routes the same way."""

from __future__ import annotations

import base64
import re
import struct
import time
import uuid
from collections.abc import Awaitable
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from fastllm.server.context import RouteContext
from fastllm.server.http import engine_error, read_model, unless_disconnected
from fastllm.server.pooling_loop import AsyncPooling
from fastllm.server.protocol import APIError

# Routes of a generation server that a pooling server refuses.
GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")
RERANK_ROUTES = ("/v1/rerank", "/rerank", "/v2/rerank")
SCORE_ROUTES = ("/score", "/v1/score")

# ---- request bodies -----------------------------------------------------------

Input = str | list[str] | list[int] | list[list[int]]


class _PoolingRequest(BaseModel):
    """Fields every pooling request has; a field not listed is a 400 naming it."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    # vLLM's extra: keep each input's last N tokens instead of refusing a long one
    truncate_prompt_tokens: int | None = None


class EmbeddingRequest(_PoolingRequest):
    """Body of ``POST /v1/embeddings`` (OpenAI's fields, vLLM's ``normalize``)."""

    input: Input
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    normalize: bool | None = None


class ClassificationRequest(_PoolingRequest):
    """Body of ``POST /classify`` (vLLM's)."""

    input: Input
    user: str | None = None


class RerankRequest(_PoolingRequest):
    """Body of ``POST /v1/rerank``, ``/rerank``, ``/v2/rerank`` (Jina / Cohere)."""

    query: str
    # strings, or Jina's and Cohere's objects {"text": ...}
    documents: list[str | dict[str, Any]]
    # the best N results (None or 0: all)
    top_n: int | None = Field(default=None, ge=0)
    return_documents: bool = True


class ScoreRequest(_PoolingRequest):
    """Body of ``POST /score`` and ``/v1/score`` (vLLM's)."""

    text_1: str | list[str]
    text_2: str | list[str]


def prompts_of(value: Input, field: str, vocab: int) -> list[str | list[int]]:
    """The inputs of ``input``: a string, strings, token ids, lists of token
    ids; a 400 naming ``field`` when there are none, one is empty or a token
    id is outside the vocabulary ``[0, vocab)``."""
    if isinstance(value, str) or (value and isinstance(value[0], int)):
        items: list[Any] = [value]
    else:
        items = list(value)
    if not items:
        raise APIError(f"{field}: give at least one input (got an empty list)", 400, param=field)
    for i, item in enumerate(items):
        if len(item) == 0:
            where = field if len(items) == 1 else f"{field}[{i}]"
            kind = "string" if isinstance(item, str) else "token list"
            raise APIError(f"{where}: the input is an empty {kind}", 400, param=field)
        if not isinstance(item, str) and not 0 <= min(item) <= max(item) < vocab:
            raise APIError(
                f"{field}[{i}]: token ids must be in the vocabulary [0, {vocab})", 400, param=field
            )
    return items


def document_texts(documents: list[str | dict[str, Any]]) -> list[str]:
    """The texts of rerank ``documents`` (strings or ``{"text": ...}``); a 400
    naming the document when there are none or one has other fields."""
    if not documents:
        raise APIError(
            "documents: give at least one document (got an empty list)", 400, param="documents"
        )
    texts = []
    for i, doc in enumerate(documents):
        if isinstance(doc, dict):
            extra = sorted(set(doc) - {"text"})
            if extra:
                field = f"documents.{i}.{extra[0]}"
                raise APIError(
                    f"unknown field {field!r}: a document is a string or {{'text': ...}}",
                    400,
                    param=field,
                )
            if not isinstance(doc.get("text"), str):
                field = f"documents.{i}.text"
                raise APIError(
                    f"{field}: a document object needs 'text', a string", 400, param=field
                )
            doc = doc["text"]
        if not doc:
            raise APIError(f"documents[{i}] is an empty string", 400, param="documents")
        texts.append(doc)
    return texts


def _texts(value: str | list[str], field: str) -> list[str]:
    """A text or a list of texts as a list; a 400 naming ``field`` when empty."""
    items = [value] if isinstance(value, str) else list(value)
    if not items:
        raise APIError(f"{field}: give at least one text (got an empty list)", 400, param=field)
    for i, text in enumerate(items):
        if not text:
            raise APIError(f"{field}[{i}] is an empty string", 400, param=field)
    return items


# ---- helpers ------------------------------------------------------------------


def _worker(ctx: RouteContext, route: str) -> AsyncPooling:
    """The pooling worker; a 400 naming the route on a generation server."""
    if ctx.pooling is None:
        raise APIError(
            f"{route} needs a pooling model (embeddings, rerank, score, classify), but this "
            "server serves a text-generation model: start the server with --runner pooling "
            "and an embedding, reranker or classifier model",
            400,
            param="model",
        )
    return ctx.pooling


def _needs(pool: AsyncPooling, task: str, route: str, name: str) -> None:
    """A 400 when the served model cannot do ``task`` (embed, score, classify)."""
    tasks = pool.engine.tasks
    if task not in tasks:
        what = {"embed": "embed texts", "score": "score pairs", "classify": "classify texts"}
        raise APIError(
            f"{route}: the model `{name}` cannot {what[task]} (it supports: "
            f"{', '.join(sorted(tasks)) or 'nothing'})",
            400,
            param="model",
        )


def _params(**fields: Any) -> Any:
    """The request's PoolingParams; a 400 naming the field it refuses."""
    from fastllm.pooling.params import PoolingParams

    try:
        return PoolingParams(**fields)
    except ValueError as e:
        raise pooling_error(e, {}) from e


_HEAD = re.compile(r"^(?:PoolingParams\.)?([A-Za-z_]\w*)")
# "input[3]: dimensions=5: ...": the setting, not the input, is the field
_SETTING = re.compile(r"^[\w\[\]]+: (dimensions|normalize|truncate_prompt_tokens)=")
# Names the engine's messages start with, for every route.
_ENGINE_FIELDS = ("input", "dimensions", "normalize", "truncate_prompt_tokens")


def pooling_error(e: Exception, names: dict[str, str]) -> APIError:
    """The APIError of an engine failure: a ValueError is a 400 naming the
    request field its message starts with (``names`` maps the engine's
    names to this route's: ``pair`` → ``documents``)."""
    err = engine_error(e)
    if err.status != 400 or err.param is not None:
        return err
    msg = err.message.removeprefix("PoolingParams.")
    setting = _SETTING.match(msg)
    if setting:
        return APIError(msg, 400, param=setting.group(1))
    m = _HEAD.match(msg)
    head = m.group(1) if m else ""
    if head not in names and head not in _ENGINE_FIELDS:
        return err
    param = names.get(head, head)
    return APIError(param + msg[len(head) :], 400, param=param)


async def _await(raw: Request, work: Awaitable[Any], names: dict[str, str]) -> Any:
    """The engine's result, or None when the client left; engine errors as APIError."""
    try:
        return await unless_disconnected(raw, work)
    except APIError:
        raise
    except Exception as e:
        raise pooling_error(e, names) from e


def _usage(outs: list[Any]) -> dict[str, int]:
    tokens = sum(len(o.prompt_token_ids) for o in outs)
    return {"prompt_tokens": tokens, "total_tokens": tokens}


def encode_embedding(vector: list[float], encoding_format: str) -> list[float] | str:
    """An embedding as OpenAI sends it: floats, or base64 of little-endian float32."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


def class_labels(engine: Any, num_classes: int) -> list[str]:
    """The classifier's label names: the engine's ``id2label``, else ``LABEL_i``."""
    id2label = engine.id2label or {}
    return [id2label.get(i, f"LABEL_{i}") for i in range(num_classes)]


def _head(prefix: str, name: str) -> dict[str, Any]:
    return {
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": name,
    }


# ---- routes -------------------------------------------------------------------


def register(app: FastAPI, ctx: RouteContext) -> None:
    """Adds the pooling routes to ``app``; on a pooling server also the
    refusals of the generation routes."""
    if ctx.pooling is not None:
        for path in GENERATION_ROUTES:
            app.add_api_route(path, _refusal(path), methods=["POST"])

    @app.post("/v1/embeddings")
    async def embeddings(raw: Request) -> Response:
        pool = _worker(ctx, "/v1/embeddings")
        req = await read_model(raw, EmbeddingRequest, ctx.state.max_body_bytes)
        name = ctx.model_name(req.model)
        _needs(pool, "embed", "/v1/embeddings", name)
        prompts = prompts_of(req.input, "input", ctx.vocab_size())
        params = _params(
            dimensions=req.dimensions,
            normalize=req.normalize,
            truncate_prompt_tokens=req.truncate_prompt_tokens,
        )
        outs = await _await(raw, pool.embed(prompts, params), {})
        if outs is None:
            return Response(status_code=499)
        data = [
            {
                "object": "embedding",
                "index": i,
                "embedding": encode_embedding(o.outputs.embedding, req.encoding_format),
            }
            for i, o in enumerate(outs)
        ]
        return JSONResponse({**_head("embd", name), "data": data, "usage": _usage(outs)})

    labels: list[str] = []  # the classifier's label names, read on first use

    @app.post("/classify")
    async def classify(raw: Request) -> Response:
        pool = _worker(ctx, "/classify")
        req = await read_model(raw, ClassificationRequest, ctx.state.max_body_bytes)
        name = ctx.model_name(req.model)
        _needs(pool, "classify", "/classify", name)
        prompts = prompts_of(req.input, "input", ctx.vocab_size())
        params = _params(truncate_prompt_tokens=req.truncate_prompt_tokens)
        outs = await _await(raw, pool.classify(prompts, params), {})
        if outs is None:
            return Response(status_code=499)
        data = []
        for i, o in enumerate(outs):
            probs = list(o.outputs.probs)
            if len(labels) != len(probs):
                labels[:] = class_labels(pool.engine, len(probs))
            best = max(range(len(probs)), key=probs.__getitem__) if probs else 0
            label = labels[best] if probs else None
            data.append({"index": i, "label": label, "probs": probs, "num_classes": len(probs)})
        return JSONResponse({**_head("classify", name), "data": data, "usage": _usage(outs)})

    for path in RERANK_ROUTES:
        app.add_api_route(path, _rerank_route(ctx, path), methods=["POST"])
    for path in SCORE_ROUTES:
        app.add_api_route(path, _score_route(ctx, path), methods=["POST"])


def _rerank_route(ctx: RouteContext, route: str) -> Any:
    """The handler of one rerank path: the documents by relevance to the query."""

    async def rerank(raw: Request) -> Response:
        pool = _worker(ctx, route)
        req = await read_model(raw, RerankRequest, ctx.state.max_body_bytes)
        name = ctx.model_name(req.model)
        _needs(pool, "score", route, name)
        if not req.query:
            raise APIError("query: the query is an empty string", 400, param="query")
        docs = document_texts(req.documents)
        params = _params(truncate_prompt_tokens=req.truncate_prompt_tokens)
        # the engine names a cross-encoder's pair, or an embedding model's input
        names = {"pair": "documents", "input": "documents"}
        outs = await _await(raw, pool.score(req.query, docs, params), names)
        if outs is None:
            return Response(status_code=499)
        # sorted is stable: equal scores keep the documents' order
        order = sorted(range(len(outs)), key=lambda i: -outs[i].outputs.score)
        if req.top_n:
            order = order[: req.top_n]
        results = []
        for i in order:
            item: dict[str, Any] = {"index": i, "relevance_score": outs[i].outputs.score}
            if req.return_documents:
                item["document"] = {"text": docs[i]}
            results.append(item)
        body = {
            "id": f"rerank-{uuid.uuid4().hex}",
            "model": name,
            "results": results,
            "usage": _usage(outs),
        }
        return JSONResponse(body)

    return rerank


def _score_route(ctx: RouteContext, route: str) -> Any:
    """The handler of one score path: a score per (text_1, text_2) pair."""

    async def score(raw: Request) -> Response:
        pool = _worker(ctx, route)
        req = await read_model(raw, ScoreRequest, ctx.state.max_body_bytes)
        name = ctx.model_name(req.model)
        _needs(pool, "score", route, name)
        t1 = _texts(req.text_1, "text_1")
        t2 = _texts(req.text_2, "text_2")
        if len(t1) > 1 and len(t1) != len(t2):
            raise APIError(
                f"text_1: {len(t1)} texts and text_2: {len(t2)} texts; give one text_1 "
                "(scored against every text_2) or as many as text_2 (scored pairwise)",
                400,
                param="text_1",
            )
        params = _params(truncate_prompt_tokens=req.truncate_prompt_tokens)
        names = {"pair": "text_2", "input": "text_2"}
        one = t1 if len(t1) > 1 else t1[0]
        outs = await _await(raw, pool.score(one, t2, params), names)
        if outs is None:
            return Response(status_code=499)
        data = [
            {"index": i, "object": "score", "score": o.outputs.score} for i, o in enumerate(outs)
        ]
        return JSONResponse({**_head("score", name), "data": data, "usage": _usage(outs)})

    return score


def _refusal(path: str) -> Any:
    """The handler of a generation route on a pooling server: a 400 that says so."""

    async def refuse() -> Response:
        err = APIError(
            f"this server serves a pooling model (embeddings, rerank, score): {path} needs a "
            "text-generation model; start the server without --runner pooling (and with a "
            "generation model) to serve it",
            400,
            param="model",
        )
        if path == "/v1/messages":
            from fastllm.server.messages import anthropic_error_response

            return anthropic_error_response(err)
        raise err

    return refuse


def startup_summary(state: Any, version: str, host: str, port: int) -> str:
    """The block ``serve`` logs before it listens, for a pooling server."""
    engine = state.engine.engine
    pooler = getattr(engine, "pooler", None)
    rows = [
        ("model", engine.folder),
        ("served as", ", ".join(state.model_names)),
        ("runner", f"pooling ({', '.join(sorted(engine.tasks))})"),
    ]
    for name in ("device", "dtype"):  # where the engine says
        if getattr(engine, name, None) is not None:
            rows.append((name, str(getattr(engine, name)).removeprefix("torch.")))
    rows.append(("max_model_len", str(state.max_model_len)))
    if pooler is not None:
        sizes = ", ".join(map(str, pooler.matryoshka_dimensions)) or "none"
        rows.append(
            (
                "pooler",
                f"{pooler.pooling_type}, {pooler.dimensions} dimensions (matryoshka: {sizes}), "
                f"{'normalized' if pooler.normalize else 'not normalized'}",
            )
        )
    shown_host = f"[{host}]" if ":" in host else host
    rows.append(("API key", "required" if state.api_key_required else "not required"))
    rows.append(("address", f"http://{shown_host}:{port}"))
    width = max(len(k) for k, _ in rows)
    return "\n".join([f"fastllm {version} server", *(f"  {k.ljust(width)}  {v}" for k, v in rows)])
