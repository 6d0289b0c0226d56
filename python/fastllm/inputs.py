"""Prompts to token ids, one way for every entrance: ``LLM``, the server, Ray
Data and the Ray router all turn a prompt (text, token ids, vLLM's typed
prompts) or a conversation (rendered by the chat template, with its tools
and template arguments) into token ids here, so a router computes the very
prompt a replica runs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypedDict

from fastllm.sampling_params import SamplingParams


class TextPrompt(TypedDict):
    """A prompt as text (vLLM's ``TextPrompt``)."""

    prompt: str


class _TokenIds(TypedDict):
    prompt_token_ids: list[int]


class TokensPrompt(_TokenIds, total=False):
    """A prompt as token ids (vLLM's ``TokensPrompt``); ``prompt`` is only echoed back."""

    prompt: str


PromptType = str | TextPrompt | TokensPrompt | dict[str, Any] | list[int]
#: A prompt ready for the engine: its text (None when given as ids) and token ids.
Prompt = tuple[str | None, list[int]]


def is_token_ids(value: Any) -> bool:
    """Whether ``value`` is a list (or tuple) of token ids (ints, not bools)."""
    return isinstance(value, (list, tuple)) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def parse_prompts(prompts: Any, encode: Callable[[str], list[int]]) -> list[Prompt]:
    """Every prompt of ``generate``'s argument (one prompt or a list of them),
    text encoded with ``encode``; a ValueError naming the bad one."""
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    elif isinstance(prompts, list) and prompts and isinstance(prompts[0], int):
        prompts = [prompts]
    return [parse_prompt(p, encode, f"prompts[{i}]") for i, p in enumerate(prompts)]


def parse_prompt(p: Any, encode: Callable[[str], list[int]], where: str) -> Prompt:
    """One prompt in any of vLLM's forms; ``where`` names it in errors."""
    if isinstance(p, dict) and (p.get("multi_modal_data") or p.get("mm_processor_kwargs")):
        raise ValueError(f"{where}: multi-modal prompts are not supported")
    if isinstance(p, str):
        return p, encode(p)
    if isinstance(p, dict) and "prompt_token_ids" in p:
        ids = p["prompt_token_ids"]
        if not is_token_ids(ids):
            raise ValueError(f"{where}.prompt_token_ids must be a list of ints")
        text = p.get("prompt")
        return (text if isinstance(text, str) else None), list(ids)
    if isinstance(p, dict) and isinstance(p.get("prompt"), str):
        return p["prompt"], encode(p["prompt"])
    if isinstance(p, (list, tuple)) and all(isinstance(t, int) for t in p):
        return None, list(p)
    raise ValueError(
        f"{where} must be a str, a list of token ids, or a dict with "
        f"'prompt' or 'prompt_token_ids', got {type(p).__name__}"
    )


def truncate(ids: list[int], params: SamplingParams) -> list[int]:
    """The prompt cut to its last ``truncate_prompt_tokens`` tokens (vLLM's rule)."""
    k = params.truncate_prompt_tokens
    return ids[-k:] if k is not None and len(ids) > k else ids


# Template variables the renderer sets itself; chat_template_kwargs may not replace them.
_RESERVED_TEMPLATE_VARS = ("messages", "add_generation_prompt", "tools", "documents")


def render_chat(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    *,
    chat_template_kwargs: dict[str, Any] | None = None,
    continue_final_message: bool = False,
    documents: list[dict[str, Any]] | None = None,
) -> str:
    """A conversation as the chat template writes it (with the request's
    ``tools`` when it offers the model any, ``documents`` for templates that
    take them, and ``chat_template_kwargs`` as extra template variables, such
    as Qwen3's ``enable_thinking``). ``continue_final_message``: the text ends
    inside the last message (an assistant reply to continue), not after it.
    A ValueError names the problem when the template cannot render it."""
    from jinja2.exceptions import TemplateError

    kwargs = dict(chat_template_kwargs or {})
    for name in _RESERVED_TEMPLATE_VARS:
        if name in kwargs:
            raise ValueError(f"chat_template_kwargs may not set {name!r}; it has its own argument")
    if tools:
        kwargs["tools"] = tools
    if documents:
        kwargs["documents"] = documents
    if continue_final_message:
        if add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        if not messages or not isinstance(messages[-1].get("content"), str):
            raise ValueError("continue_final_message needs a last message with text content")
    try:
        text = tokenizer.apply_chat_template(
            list(messages),
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )
    except TemplateError as e:
        raise ValueError(str(e)) from e
    if continue_final_message:
        final = messages[-1]["content"].strip()
        end = text.rfind(final) if final else -1
        if end < 0:
            raise ValueError(
                "continue_final_message: the template does not write the last message's "
                "text as it is, so the reply cannot continue it"
            )
        text = text[: end + len(final)]
    return text


def chat_prompt(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    **options: Any,
) -> Prompt:
    """A conversation's text and token ids (the template writes the special
    tokens, so none are added); ``options`` are render_chat's keywords."""
    text = render_chat(tokenizer, messages, chat_template, add_generation_prompt, tools, **options)
    return text, tokenizer.encode(text, add_special_tokens=False)


def chat_stop(params: SamplingParams, tokenizer: Any, chat_template: str | None) -> SamplingParams:
    """``params`` for a chat reply: the template's end-of-turn token ends it
    too (unless ``ignore_eos``), so a reply stops where its turn closes."""
    if params.ignore_eos:
        return params
    extra = [
        t for t in tokenizer.end_of_turn_token_ids(chat_template) if t not in params.stop_token_ids
    ]
    if not extra:
        return params
    return params.clone(stop_token_ids=[*params.stop_token_ids, *extra])


def check_chat_template(tokenizer: Any, template: str | None, folder: str) -> None:
    """A ValueError at startup, not at the first message, when there is no chat
    template (``template`` from ``--chat-template``, else the model's) or it
    cannot render a conversation."""
    if template is None and tokenizer.chat_template is None:
        raise ValueError(
            f"{folder} has no chat template (no chat_template in tokenizer_config.json, no "
            "chat_template.jinja); pass --chat-template FILE|STRING"
        )
    try:
        render_chat(tokenizer, [{"role": "user", "content": "hi"}], template)
    except ValueError as e:
        whose = "--chat-template" if template is not None else f"the chat template of {folder}"
        raise ValueError(f"{whose} cannot render a conversation: {e}") from None
