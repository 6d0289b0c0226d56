"""Request bodies of the OpenAI-compatible API (OpenAI's fields plus vLLM's
extras), their conversion to SamplingParams, and OpenAI-format errors."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fastllm.sampling_params import SamplingParams, StructuredOutputsParams

MAX_N = 128


class APIError(Exception):
    """An error answered in OpenAI's format: ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        type: str | None = None,
        code: str | int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.type = type or _ERROR_TYPES.get(status, "InternalServerError")
        self.code = code if code is not None else status

    def body(self) -> dict[str, Any]:
        """The JSON body of the error response."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    413: "RequestTooLargeError",
    503: "ServiceUnavailableError",
}


def validation_error(err: ValidationError) -> APIError:
    """A 400 APIError naming the first invalid field of a pydantic ValidationError."""
    first = err.errors()[0]
    loc = [str(p) for p in first.get("loc", ())]
    if first.get("type") == "extra_forbidden" and loc:
        # A field this server does not know is never silently dropped.
        field = ".".join(loc)
        return APIError(
            f"unknown field {field!r}: fastllm does not implement it (remove it from the request)",
            400,
            param=field,
        )
    # Union members add their type name to the location; keep only real fields.
    field = ".".join(p for p in loc if not _TYPE_TAG.match(p)) or None
    where = f"{field}: " if field else ""
    return APIError(f"{where}{first.get('msg', 'invalid value')}", 400, param=field)


_TYPE_TAG = re.compile(r"^(str|int|float|bool|list\[.*\]|dict\[.*\]|function-.*|.*\[.*\])$")
_PARAM_IN_MESSAGE = re.compile(r"SamplingParams\.(\w+)")


def sampling_error(err: ValueError, rename: dict[str, str] | None = None) -> APIError:
    """A 400 APIError from SamplingParams' ValueError, naming the request field."""
    msg = str(err)
    m = _PARAM_IN_MESSAGE.search(msg)
    field = m.group(1) if m else None
    if field and rename and field in rename:
        msg = msg.replace(f"SamplingParams.{field}", rename[field])
        field = rename[field]
    elif field:
        msg = msg.replace(f"SamplingParams.{field}", field)
    return APIError(msg, 400, param=field)


class StreamOptions(BaseModel):
    """``stream_options`` of a streaming request."""

    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class _Common(BaseModel):
    """Fields shared by completions and chat completions. A field not listed
    here is a 400 naming it (``extra="forbid"``), never silently dropped."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # OpenAI fields that change nothing a stateless engine produces: accepted.
    # ``store`` may only be false (fastllm keeps no completions), ``metadata``
    # goes with it; ``service_tier`` has one tier here; ``prompt_cache_key`` is
    # a hint to a prefix cache that fastllm runs on every request anyway.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # the most tokens a reply may think before the engine closes its thinking
    # (needs --reasoning-parser; vLLM's name)
    thinking_token_budget: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and
    # its older guided_* fields (one of them per request).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None

    def structured(self) -> StructuredOutputsParams | None:
        """The request's output constraint (None: free text); a 400 naming the field."""
        sources: dict[str, dict[str, Any]] = {}
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type") if isinstance(rf, dict) else None
            if kind == "json_object":
                sources["response_format"] = {"json_object": True}
            elif kind == "json_schema":
                spec = rf.get("json_schema")
                schema = spec.get("schema") if isinstance(spec, dict) else None
                if not isinstance(schema, dict):
                    raise APIError(
                        "response_format.json_schema.schema must be a JSON schema object",
                        400,
                        param="response_format",
                    )
                sources["response_format"] = {"json": schema}
            elif kind != "text":
                raise APIError(
                    "response_format.type must be 'text', 'json_object' or 'json_schema', "
                    f"got {kind!r}",
                    400,
                    param="response_format",
                )
        if self.structured_outputs is not None:
            sources["structured_outputs"] = dict(self.structured_outputs)
        guided = {
            "json": self.guided_json,
            "regex": self.guided_regex,
            "choice": self.guided_choice,
            "grammar": self.guided_grammar,
        }
        for k, v in guided.items():
            if v is not None:
                sources[f"guided_{k}"] = {k: v}
        if len(sources) > 1:
            raise APIError(
                f"only one output constraint per request; got {', '.join(sorted(sources))}",
                400,
                param=sorted(sources)[1],
            )
        if not sources:
            return None
        ((field, kw),) = sources.items()
        if self.guided_whitespace_pattern is not None and "whitespace_pattern" not in kw:
            kw["whitespace_pattern"] = self.guided_whitespace_pattern
        try:
            return StructuredOutputsParams(**kw)
        except TypeError as e:
            raise APIError(f"{field}: {e}", 400, param=field) from None
        except ValueError as e:
            msg = str(e)
            if field != "structured_outputs":
                msg = re.sub(r"StructuredOutputsParams(\.\w+)?", field, msg)
            else:
                msg = msg.replace("StructuredOutputsParams", "structured_outputs")
            raise APIError(msg, 400, param=field) from None

    def _sampling_kwargs(self) -> dict[str, Any]:
        if self.store:
            raise APIError(
                "store=true is not supported: fastllm keeps no completions (send store=false "
                "or leave it out)",
                400,
                param="store",
            )
        if isinstance(self.n, int) and self.n > MAX_N:
            raise APIError(f"n must be at most {MAX_N}, got {self.n}", 400, param="n")
        kw: dict[str, Any] = {
            "n": self.n,
            "stop": self.stop,
            "seed": self.seed,
            "min_tokens": self.min_tokens,
            "ignore_eos": self.ignore_eos,
            "stop_token_ids": self.stop_token_ids,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "skip_special_tokens": self.skip_special_tokens,
            "spaces_between_special_tokens": self.spaces_between_special_tokens,
            "thinking_token_budget": self.thinking_token_budget,
            "logit_bias": self.logit_bias or None,
            "allowed_token_ids": self.allowed_token_ids,
            "bad_words": self.bad_words,
            "structured_outputs": self.structured(),
        }
        optional = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
        }
        kw.update({k: v for k, v in optional.items() if v is not None})
        return kw

    @property
    def include_usage(self) -> bool:
        """Whether a streaming response ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    """Body of ``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    # vLLM's: each choice also gives ``prompt_token_ids`` and ``token_ids``
    # (streamed: the prompt's in a choice's first chunk, then each chunk's
    # new tokens). None: only when the server has no tokenizer, where the
    # ids are the reply.
    return_token_ids: bool | None = None

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError("prompt must not be empty", 400, param="prompt")
        if isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        for i, item in enumerate(p):
            if isinstance(item, list) and not item:
                raise APIError(f"prompt[{i}] must not be empty", 400, param="prompt")
        return list(p)  # type: ignore[arg-type]

    def to_sampling_params(self, max_tokens: int | None) -> SamplingParams:
        """SamplingParams of this request; a 400 APIError names a bad field."""
        if self.suffix:
            raise APIError("suffix is not supported", 400, param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError("best_of must equal n (or be omitted)", 400, param="best_of")
        if self.echo and self.logprobs is not None:
            raise APIError("echo together with logprobs is not supported", 400, param="echo")
        kw = self._sampling_kwargs()
        try:
            return SamplingParams(max_tokens=max_tokens, logprobs=self.logprobs, **kw)
        except ValueError as e:
            raise sampling_error(e) from e


class ChatMessage(BaseModel):
    """One message of a conversation."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None

    def as_dict(self) -> dict[str, Any]:
        """The message as the chat template sees it (text parts joined)."""
        d = self.model_dump(exclude_none=True)
        content = self.content
        if isinstance(content, list):
            parts = []
            for i, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(
                        f"content part {i} must be {{'type': 'text', 'text': ...}}; "
                        "only text is supported",
                        400,
                        param="messages",
                    )
                parts.append(part["text"])
            d["content"] = "\n".join(parts)
        elif content is None:
            d["content"] = ""
        return d


class ChatCompletionRequest(_Common):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI's reasoning_effort reaches the template as the variable of that name
    reasoning_effort: str | None = None
    # vLLM's: whether a reply with --reasoning-parser carries reasoning_content
    include_reasoning: bool = True
    # vLLM's: the response also gives ``prompt_token_ids`` and each choice
    # its ``token_ids`` (streamed: the prompt's in the first chunk, then each
    # chunk's new tokens)
    return_token_ids: bool = False

    def template_options(self) -> dict[str, Any]:
        """render_chat's keywords of this request."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", self.reasoning_effort)
        return {
            "chat_template_kwargs": kwargs,
            "continue_final_message": self.continue_final_message,
            "documents": self.documents,
        }

    def prompt(self, tokenizer: Any, chat_template: str | None) -> tuple[str, list[int]]:
        """The conversation as the template renders it, and its token ids: what
        the replica runs and what the Ray router routes by. The tools go to the
        template unless ``tool_choice`` is ``"none"``; a 400 when the template
        cannot render the conversation."""
        tools = self.tools if self.tools and self.tool_choice != "none" else None
        return messages_prompt(
            tokenizer,
            self.messages,
            chat_template,
            self.add_generation_prompt,
            tools,
            **self.template_options(),
        )

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """The output length limit and the field that set it."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def to_sampling_params(
        self, max_tokens: int | None, forced_call: StructuredOutputsParams | None = None
    ) -> SamplingParams:
        """SamplingParams of this request; a 400 APIError names a bad field.
        ``forced_call``: the constraint of a tool call the request forces."""
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs requires logprobs=true", 400, param="top_logprobs")
        if self.top_logprobs is not None and self.top_logprobs < 0:
            raise APIError(
                f"top_logprobs must be at least 0, got {self.top_logprobs}",
                400,
                param="top_logprobs",
            )
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        kw = self._sampling_kwargs()
        if forced_call is not None:
            if kw["structured_outputs"] is not None:
                raise APIError(
                    "a forced tool call cannot be combined with response_format or "
                    "structured_outputs",
                    400,
                    param="tool_choice",
                )
            kw["structured_outputs"] = forced_call
        _, field = self.requested_max_tokens()
        try:
            return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **kw)
        except ValueError as e:
            raise sampling_error(e, {"logprobs": "top_logprobs", "max_tokens": field}) from e


class TokenizeRequest(BaseModel):
    """Body of ``POST /tokenize``: a prompt, or messages rendered with the chat template."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    def prompt_of_messages(self, tokenizer: Any, chat_template: str) -> tuple[str, list[int]]:
        """``messages`` rendered as a chat request renders them."""
        return messages_prompt(
            tokenizer,
            self.messages or [],
            chat_template,
            self.add_generation_prompt,
            self.tools,
            chat_template_kwargs=self.chat_template_kwargs,
            continue_final_message=self.continue_final_message,
        )


class DetokenizeRequest(BaseModel):
    """Body of ``POST /detokenize``."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


def messages_prompt(
    tokenizer: Any,
    messages: list[ChatMessage],
    chat_template: str | None,
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None = None,
    **options: Any,
) -> tuple[str, list[int]]:
    """A request's conversation through ``inputs.chat_prompt`` (``options``:
    render_chat's keywords); a 400 naming the field when the template cannot
    render it."""
    from fastllm.inputs import chat_prompt

    try:
        return chat_prompt(
            tokenizer,
            [m.as_dict() for m in messages],
            chat_template,
            add_generation_prompt,
            tools,
            **options,
        )
    except ValueError as e:
        msg = str(e)
        param = "messages"
        for name in ("chat_template_kwargs", "continue_final_message"):
            if msg.startswith(name):
                param = name
        raise APIError(f"cannot apply the chat template: {msg}", 400, param=param) from e
