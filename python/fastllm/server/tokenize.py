"""The model and its tokenizer over HTTP: ``/health``, ``/v1/models``,
``/tokenize`` and ``/detokenize``."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from fastllm.loading import quantization_name
from fastllm.server.context import RouteContext
from fastllm.server.http import error_response, read_model
from fastllm.server.protocol import APIError, DetokenizeRequest, TokenizeRequest


def register(app: FastAPI, ctx: RouteContext) -> None:
    """Adds the routes about the model and its tokenizer to ``app``."""

    @app.get("/health")
    async def health() -> Response:
        if not ctx.engine.is_alive:
            return error_response(APIError(f"the engine is not running: {ctx.engine.error!r}", 503))
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        # a pooling server's engine may not say how it loaded the weights
        loaded = getattr(ctx.llm, "loaded", None)
        data = [
            {
                "id": name,
                "object": "model",
                "created": ctx.state.created,
                "owned_by": "fastllm",
                "root": ctx.folder,
                "max_model_len": ctx.state.max_model_len,
                "quantization": quantization_name(loaded) if loaded is not None else None,
                **({"gguf": loaded.gguf} if loaded is not None and loaded.gguf else {}),
            }
            for name in ctx.state.model_names
        ]
        return JSONResponse({"object": "list", "data": data})

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> JSONResponse:
        req = await read_model(raw, TokenizeRequest, ctx.state.max_body_bytes)
        ctx.model_name(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError("give exactly one of prompt and messages", 400, param="prompt")
        tok = ctx.tokenizer("prompt" if req.messages is None else "messages", "/tokenize")
        if req.messages is not None:
            ids = req.prompt_of_messages(tok, ctx.chat_template(None))[1]
        else:
            ids = tok.encode(req.prompt or "", add_special_tokens=req.add_special_tokens)
        return JSONResponse(
            {"count": len(ids), "max_model_len": ctx.state.max_model_len, "tokens": ids}
        )

    @app.post("/detokenize")
    async def detokenize(raw: Request) -> JSONResponse:
        req = await read_model(raw, DetokenizeRequest, ctx.state.max_body_bytes)
        ctx.model_name(req.model)
        vocab = ctx.vocab_size()
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(
                f"tokens: token id {bad} is outside the vocabulary [0, {vocab})",
                400,
                param="tokens",
            )
        return JSONResponse({"prompt": ctx.tokenizer("tokens", "/detokenize").decode(req.tokens)})
