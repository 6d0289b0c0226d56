"""Tokenizer: the ``tokenizers`` library on ``tokenizer.json``, chat templates
rendered with a sandboxed jinja2 environment, and incremental detokenization."""

from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any


class Tokenizer:
    """A model folder's tokenizer (``tokenizer.json`` + ``tokenizer_config.json``)."""

    def __init__(self, folder: str) -> None:
        from tokenizers import Tokenizer as _HFTokenizer

        path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        try:
            tok = _HFTokenizer.from_file(path)
        except Exception as e:  # the library raises its own Exception type
            raise ValueError(f"could not read tokenizer file {path}: {e}") from e
        config: dict[str, Any] = {}
        cfg_path = os.path.join(folder, "tokenizer_config.json")
        if os.path.isfile(cfg_path):
            try:
                with open(cfg_path, encoding="utf-8") as f:
                    config = json.load(f)
            except (OSError, json.JSONDecodeError) as e:
                raise ValueError(f"malformed tokenizer config {cfg_path}: {e}") from e
        self._setup(tok, config, _find_chat_template(folder, config))

    @classmethod
    def from_backend(
        cls,
        tok: Any,
        config: dict[str, Any],
        chat_template: str | None = None,
        end_of_turn_ids: list[int] | None = None,
    ) -> Tokenizer:
        """A tokenizer from an in-memory ``tokenizers.Tokenizer`` and a config shaped
        like ``tokenizer_config.json`` (``bos_token``, ``eos_token``, ``pad_token``,
        ``add_bos_token``), with no folder behind it (a GGUF file's tokenizer).
        ``end_of_turn_ids`` are tokens that also end a chat turn (GGUF's EOT/EOM)."""
        self = cls.__new__(cls)
        self._setup(tok, dict(config), chat_template)
        self._extra_end_of_turn = list(end_of_turn_ids or [])
        return self

    def _setup(self, tok: Any, config: dict[str, Any], chat_template: str | None) -> None:
        self._tok = tok
        self._tok.no_padding()
        self._tok.no_truncation()
        self.config = config
        self.chat_template: str | None = chat_template
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token_id = self.token_to_id(self.eos_token) if self.eos_token else None
        self.bos_token_id = self.token_to_id(self.bos_token) if self.bos_token else None
        self.add_bos_token = bool(self.config.get("add_bos_token", False))
        self._end_of_turn: dict[str, list[int]] = {}  # template -> its end-of-turn ids
        self._extra_end_of_turn: list[int] = []
        self.all_special_ids = {
            i for i, t in self._tok.get_added_tokens_decoder().items() if t.special
        }

    def to_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` text (what the grammar engine reads)."""
        return self._tok.to_str()

    @property
    def vocab_size(self) -> int:
        """Number of tokens, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        """The id of a token string, or None."""
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text (with the BOS token when the tokenizer adds one)."""
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if (
            add_special_tokens
            and self.add_bos_token
            and self.bos_token_id is not None
            and (not ids or ids[0] != self.bos_token_id)
        ):
            ids = [self.bos_token_id, *ids]
        return ids

    def encode_with_types(self, text: str, pair: str | None = None) -> tuple[list[int], list[int]]:
        """Token ids and token type ids of a text, or of a text pair joined by
        the tokenizer's post-processor (BERT: ``[CLS] a [SEP] b [SEP]``, types
        0 then 1), special tokens included."""
        enc = self._tok.encode(text, pair, add_special_tokens=True)
        return enc.ids, enc.type_ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of token ids."""
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The token string of an id."""
        return self._tok.id_to_token(token_id)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Renders a conversation to a prompt string with the model's chat template."""
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError(
                "this model's tokenizer_config.json has no chat_template; "
                "pass chat_template=... to chat()"
            )
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m:
                raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content'")
        return _compile_template(template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )

    def end_of_turn_token_ids(self, chat_template: str | None = None) -> list[int]:
        """The special token(s) a chat template closes an assistant turn with
        (``<|im_end|>``, ``<|eot_id|>``, ...): a chat reply stops there.

        Found by rendering a one-turn conversation and reading the first
        special token after the assistant's text; empty when the template
        closes turns with plain text or has none.
        """
        template = chat_template or self.chat_template
        if template is None:
            return []
        cached = self._end_of_turn.get(template)
        if cached is None:
            if len(self._end_of_turn) >= 32:  # templates sent in requests: keep it small
                self._end_of_turn.clear()
            cached = self._end_of_turn[template] = self._probe_end_of_turn(template)
        return list(cached)

    def _probe_end_of_turn(self, template: str) -> list[int]:
        marker = "fastllm-end-of-turn-probe"
        try:
            text = self.apply_chat_template(
                [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}],
                chat_template=template,
                add_generation_prompt=False,
            )
        except Exception:  # a template that cannot render this: no known end of turn
            return []
        tail = text[text.find(marker) + len(marker) :] if marker in text else ""
        specials = {
            t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special
        }
        first = min(
            ((tail.find(tok), tok) for tok in specials if tok and tok in tail), default=None
        )
        ids = [specials[first[1]]] if first is not None else []
        for extra in (self.eos_token_id, *self._extra_end_of_turn):
            if extra is not None and extra not in ids:
                ids.append(extra)
        return ids


def _find_chat_template(folder: str, config: dict[str, Any]) -> str | None:
    tmpl = config.get("chat_template")
    if isinstance(tmpl, list):  # named templates: prefer "default"
        named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, dict)}
        tmpl = named.get("default") or next(iter(named.values()), None)
    if tmpl:
        return tmpl
    jinja = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    return None


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # AddedToken serialised as a dict
        return value.get("content")
    return value if isinstance(value, str) else None


_TEMPLATES: dict[str, Any] = {}


def _compile_template(source: str) -> Any:
    tmpl = _TEMPLATES.get(source)
    if tmpl is None:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        def strftime_now(fmt: str) -> str:
            return datetime.now().strftime(fmt)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda x, indent=None: json.dumps(
            x, ensure_ascii=False, indent=indent
        )
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        tmpl = env.from_string(source)
        _TEMPLATES[source] = tmpl
    return tmpl


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes a small window of recent tokens and emits only the new text once it
    no longer ends in an incomplete UTF-8 sequence (shown as U+FFFD), so
    multi-byte characters split across tokens come out whole.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        # Seed the window with a few prompt tokens so the first output token
        # decodes with its real leading space / merge context.
        self.ids: list[int] = list(prompt_ids[-4:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        """Appends one token; returns the text it completes (possibly empty)."""
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset], self.skip)
        full = self.tokenizer.decode(self.ids[self.prefix_offset :], self.skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""


class BatchEncoding(dict):
    """What ``HFCompatibleTokenizer.__call__`` returns: a dict with attribute access."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class HFCompatibleTokenizer:
    """A ``Tokenizer`` with the calls and defaults of a Hugging Face tokenizer,
    for code written against ``vllm.LLM.get_tokenizer()`` (``__call__``,
    ``encode``, ``decode``, ``convert_ids_to_tokens``, ``apply_chat_template``,
    ``eos_token_id``, ...). Anything else is the wrapped ``Tokenizer``'s."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)

    def __len__(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def vocab_size(self) -> int:
        """The base vocabulary, without added tokens (as Hugging Face counts it)."""
        return self.tokenizer._tok.get_vocab_size(with_added_tokens=False)

    @property
    def pad_token(self) -> str | None:
        """The padding token's text, when the tokenizer config names one."""
        return _token_text(self.tokenizer.config.get("pad_token"))

    @property
    def pad_token_id(self) -> int | None:
        """The padding token's id."""
        pad = self.pad_token
        return self.tokenizer.token_to_id(pad) if pad else None

    @property
    def all_special_tokens(self) -> list[str]:
        """Texts of the special tokens."""
        return [self.tokenizer.id_to_token(i) or "" for i in sorted(self.tokenizer.all_special_ids)]

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of the special tokens."""
        return sorted(self.tokenizer.all_special_ids)

    def get_vocab(self) -> dict[str, int]:
        """Token text -> id, added tokens included."""
        return self.tokenizer._tok.get_vocab(with_added_tokens=True)

    def __call__(
        self, text: str | list[str], add_special_tokens: bool = True, **kwargs: Any
    ) -> BatchEncoding:
        """``{"input_ids": ..., "attention_mask": ...}`` of one text or a list of texts."""
        if isinstance(text, str):
            ids = self.encode(text, add_special_tokens=add_special_tokens)
            return BatchEncoding(input_ids=ids, attention_mask=[1] * len(ids))
        batch = [self.encode(t, add_special_tokens=add_special_tokens) for t in text]
        return BatchEncoding(input_ids=batch, attention_mask=[[1] * len(ids) for ids in batch])

    def encode(self, text: str, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        """Token ids of a text."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(
        self, token_ids: int | list[int], skip_special_tokens: bool = False, **kwargs: Any
    ) -> str:
        """Text of token ids (special tokens kept unless asked, as Hugging Face does)."""
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def batch_decode(
        self, sequences: list[list[int]], skip_special_tokens: bool = False, **kwargs: Any
    ) -> list[str]:
        """``decode`` of each sequence."""
        return [self.decode(s, skip_special_tokens=skip_special_tokens) for s in sequences]

    def tokenize(self, text: str, add_special_tokens: bool = False, **kwargs: Any) -> list[str]:
        """Token texts of a text."""
        return self.convert_ids_to_tokens(self.encode(text, add_special_tokens=add_special_tokens))

    def convert_ids_to_tokens(self, ids: int | list[int], skip_special_tokens: bool = False) -> Any:
        """Token text of an id, or of each id of a list."""
        if isinstance(ids, int):
            return self.tokenizer.id_to_token(ids)
        special = self.tokenizer.all_special_ids if skip_special_tokens else set()
        return [self.tokenizer.id_to_token(i) for i in ids if i not in special]

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> Any:
        """Id of a token text, or of each text of a list (None when unknown)."""
        if isinstance(tokens, str):
            return self.tokenizer.token_to_id(tokens)
        return [self.tokenizer.token_to_id(t) for t in tokens]

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]] | list[list[dict[str, Any]]],
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        **kwargs: Any,
    ) -> Any:
        """The conversation rendered by the chat template: ``{"input_ids",
        "attention_mask"}`` by default (ids alone with ``return_dict=False``),
        the text with ``tokenize=False`` (transformers' defaults)."""
        if conversation and isinstance(conversation[0], list):
            return [
                self.apply_chat_template(
                    c, chat_template, add_generation_prompt, tokenize, **kwargs
                )
                for c in conversation
            ]
        if kwargs.pop("return_tensors", None) is not None:
            raise ValueError("apply_chat_template: return_tensors is not supported (lists only)")
        # Current transformers' default: a dict of input_ids and attention_mask.
        return_dict = bool(kwargs.pop("return_dict", True))
        text = self.tokenizer.apply_chat_template(
            conversation,  # type: ignore[arg-type]
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)
        return BatchEncoding(input_ids=ids, attention_mask=[1] * len(ids)) if return_dict else ids
