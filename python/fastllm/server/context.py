"""What every route needs: the server's state and the rules it applies to
every request (the model's name, the engine's request rule, the chat
template)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastllm.engine.llm_engine import RequestError
from fastllm.sampling_params import SamplingParams
from fastllm.server.engine_loop import AsyncEngine
from fastllm.server.pooling_loop import AsyncPooling
from fastllm.server.protocol import APIError


@dataclass
class ServerState:
    """What every route needs: the engine, the served names and the limits."""

    # AsyncPooling on a --runner pooling server (embeddings, rerank, score, classify)
    engine: AsyncEngine | AsyncPooling
    model_names: list[str]
    max_model_len: int
    max_body_bytes: int
    created: int
    # names accepted in a request's "model" besides model_names (not listed by /v1/models)
    aliases: tuple[str, ...] = ()
    # default template of /v1/chat/completions (--chat-template); None: the model's
    chat_template: str | None = None
    api_key_required: bool = False
    # format of tool calls in replies (--tool-call-parser); "auto": the chat template's
    tool_call_parser: str = "auto"

    def routing_info(self) -> dict[str, Any]:
        """What a prefix-aware router needs to compute this server's prompt
        tokens and KV blocks: the tokenizer's folder or GGUF file (None: no
        tokenizer), the block size and whether prefix caching is on."""
        from fastllm.loading import resolve_model_folder

        llm = self.engine.engine
        cfg = llm.config
        path = llm.folder
        if cfg.tokenizer:
            path = resolve_model_folder(cfg.tokenizer, cfg.tokenizer_revision, cfg.download_dir)
        return {
            "tokenizer_folder": path if llm.tokenizer is not None else None,
            "block_size": cfg.block_size,
            "prefix_caching": bool(cfg.enable_prefix_caching),
        }


class RouteContext:
    """The state of one server as its routes use it."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.engine = state.engine
        #: The LLMEngine the engine thread runs (a PoolingEngine on a pooling server).
        self.llm: Any = state.engine.engine
        self.tok: Any = self.llm.tokenizer
        #: The pooling worker; None on a generation server.
        self.pooling = state.engine if isinstance(state.engine, AsyncPooling) else None

    @property
    def folder(self) -> str:
        """The served model's folder."""
        return self.llm.folder

    def model_name(self, requested: str | None) -> str:
        """The served name a request's ``model`` field means; a 404 for another."""
        state = self.state
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

    def tokenizer(self, param: str, what: str) -> Any:
        """The served model's tokenizer; a 400 naming ``param`` (``what``
        needs it) when the server runs without one."""
        if self.tok is None:
            raise APIError(
                f"{what} needs a tokenizer, and this server has none (--skip-tokenizer-init, "
                "or --load-format dummy on a folder without tokenizer.json): send prompts "
                "as token ids to /v1/completions",
                400,
                param=param,
            )
        return self.tok

    def encoder(self, param: str) -> Callable[[str], list[int]]:
        """``encode`` for a request's text prompts (``tokenizer``'s 400 when
        there is no tokenizer)."""
        return lambda text: self.tokenizer(param, "a text prompt").encode(text)

    def vocab_size(self) -> int:
        """The model's vocabulary (token ids below it are valid prompts)."""
        model_config = getattr(self.llm, "model_config", None)
        if model_config is not None:
            return model_config.vocab_size
        return self.tokenizer("prompt", "this route").vocab_size

    def check_request(
        self, ids: list[int], params: SamplingParams, where: str, fields: dict[str, str]
    ) -> None:
        """The engine's rule for every request (offline too); ``fields`` maps
        SamplingParams names to this endpoint's names."""
        try:
            self.llm.validate_request(ids, params, where)
        except RequestError as e:
            param = where.split("[")[0] if e.field == "prompt" else fields.get(e.field, e.field)
            msg = str(e)
            for ours, theirs in fields.items():
                msg = msg.replace(f"{ours}=", f"{theirs}=").replace(
                    f"lower {ours}", f"lower {theirs}"
                )
            raise APIError(msg, 400, param=param) from e

    def tool_format(self, template: str) -> str:
        """The tool-call format of replies rendered with ``template``: the
        server's --tool-call-parser, else the one the template defines."""
        from fastllm.server.tools import call_format

        return call_format(template, self.state.tool_call_parser)

    def chat_template(self, requested: str | None) -> str:
        """The template a chat request renders with: its own, else the server's
        (--chat-template), else the model's; a 400 when there is none."""
        model_template = self.tok.chat_template if self.tok is not None else None
        template = requested or self.state.chat_template or model_template
        if template is None:
            raise APIError(
                "this model has no chat template, so /v1/chat/completions cannot render "
                "messages: start the server with --chat-template FILE|STRING (or send "
                "chat_template in the request)",
                400,
                param="messages",
            )
        return template
