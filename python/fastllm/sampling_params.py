"""SamplingParams: how to pick each next token and when to stop (vLLM's names and semantics)."""

from __future__ import annotations

import enum
import json as _json
from dataclasses import dataclass, field
from typing import Any

_GREEDY_EPS = 1e-5


class RequestOutputKind(enum.Enum):
    """What each ``RequestOutput`` of a request holds (vLLM's names).

    ``CUMULATIVE``: everything generated so far; ``DELTA``: only what is new
    since the previous output (text held back while a stop string could still
    cut it); ``FINAL_ONLY``: one output, when the request finishes.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class StructuredOutputsParams:
    """A constraint on the output, enforced token by token (vLLM's names).

    Exactly one of ``json`` (a JSON schema, as a dict or its JSON text),
    ``json_object`` (any JSON object), ``regex`` (matched in full), ``choice``
    (one of these strings) or ``grammar`` (a Lark-style grammar). With
    ``disable_any_whitespace`` JSON is written without optional whitespace;
    by default it may have one space after ``,`` and ``:`` and nowhere else
    (as ``json.dumps`` writes it); ``any_whitespace=True`` allows any amount
    anywhere (vLLM's default, xgrammar's name); ``whitespace_pattern`` (a
    regex) sets what whitespace JSON may have instead.
    The constraint is compiled (without a tokenizer) when the params are
    built, so a bad one is a ValueError naming the field and, for a schema,
    the path of the offending keyword.
    """

    json: str | dict[str, Any] | bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None
    any_whitespace: bool = False

    def __post_init__(self) -> None:
        def bad(name: str, allowed: str, value: object) -> ValueError:
            return ValueError(f"StructuredOutputsParams.{name} must be {allowed}, got {value!r}")

        given = [
            k
            for k in ("json", "regex", "choice", "grammar", "json_object")
            if getattr(self, k) not in (None, False)
        ]
        if len(given) != 1:
            which = ", ".join(given) if given else "none"
            raise ValueError(
                "StructuredOutputsParams needs exactly one of json, regex, choice, grammar "
                f"or json_object; got {which}"
            )
        if self.json is not None and not isinstance(self.json, (str, dict, bool)):
            raise bad("json", "a JSON schema (a dict or its JSON text)", self.json)
        if self.regex is not None and not isinstance(self.regex, str):
            raise bad("regex", "a string", self.regex)
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise bad("grammar", "a string", self.grammar)
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise bad("json_object", "True or False", self.json_object)
        if self.choice is not None:
            if (
                not isinstance(self.choice, (list, tuple))
                or not self.choice
                or any(not isinstance(c, str) for c in self.choice)
            ):
                raise bad("choice", "a non-empty list of strings", self.choice)
            self.choice = list(self.choice)
        for name in ("disable_any_whitespace", "any_whitespace"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "True or False", getattr(self, name))
        if self.any_whitespace and (self.disable_any_whitespace or self.whitespace_pattern):
            other = (
                "disable_any_whitespace" if self.disable_any_whitespace else "whitespace_pattern"
            )
            raise bad("any_whitespace", f"False when {other} is set", True)
        if self.whitespace_pattern is not None:
            if not isinstance(self.whitespace_pattern, str):
                raise bad("whitespace_pattern", "None or a regex", self.whitespace_pattern)
            if self.regex is not None or self.choice is not None or self.grammar is not None:
                raise bad("whitespace_pattern", "used only with json or json_object", "set")
        from fastllm import _core

        kind, value = self.constraint
        try:
            _core.validate_structured(kind, value, self.any_whitespace)
        except ValueError as e:
            raise ValueError(f"StructuredOutputsParams.{e}") from None

    @property
    def constraint(self) -> tuple[str, str | list[str] | None]:
        """The constraint as (kind, value) for the grammar engine: kind is one of
        json, json_object, regex, choice, grammar. A JSON schema carries its
        whitespace rule in its ``x-guidance`` options (the schema's own win)."""
        if self.json_object or isinstance(self.json, (dict, str)):
            schema: Any = self.json if self.json is not None else {"type": "object"}
            if isinstance(schema, str):
                try:
                    schema = _json.loads(schema)
                except ValueError:
                    return "json", self.json  # the grammar engine names the error
            own = schema.get("x-guidance") if isinstance(schema, dict) else None
            if isinstance(schema, dict) and (own is None or isinstance(own, dict)):
                opts = {**self._whitespace_options(), **(own or {})}
                return "json", _json.dumps({**schema, "x-guidance": opts})
        if self.json is not None:
            text = self.json if isinstance(self.json, str) else _json.dumps(self.json)
            return "json", text
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", self.choice
        if self.grammar is not None:
            return "grammar", self.grammar
        return "json_object", None

    def _whitespace_options(self) -> dict[str, Any]:
        """The grammar engine's JSON whitespace options. By default JSON is
        written as Python's ``json.dumps`` writes it: at most one space after
        ``,`` and ``:``, nothing else, so a schema whose instances are bounded
        always closes within a bounded number of tokens (free whitespace lets
        a sampled model write newlines until ``max_tokens``)."""
        if self.whitespace_pattern is not None:
            return {"whitespace_pattern": self.whitespace_pattern}
        if self.any_whitespace:
            return {"whitespace_flexible": True}
        if self.disable_any_whitespace:
            return {"whitespace_flexible": False}
        return {"whitespace_flexible": False, "item_separator": ", ?", "key_separator": ": ?"}


@dataclass
class SamplingParams:
    """Sampling and stopping parameters of one request, validated on creation.

    Names, defaults and meanings follow vLLM: ``temperature`` below 1e-5 means
    greedy; ``top_k`` 0 or -1, ``top_p`` 1 and ``min_p`` 0 disable those
    filters; penalties at their neutral values (1, 0, 0) do nothing.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    # The most tokens the reply may spend thinking: the engine then writes the
    # end of the thinking block and the reply goes on with its answer (needs
    # the engine's reasoning_parser). None: no limit.
    thinking_token_budget: int | None = None
    # Filled in by the engine: the stop strings as a list, for quick checks.
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self._stop_list = [self.stop]
        elif self.stop is None:
            self._stop_list = []
        else:
            self._stop_list = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        else:
            self.stop_token_ids = list(self.stop_token_ids)
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, allowed: str, value: object) -> ValueError:
            return ValueError(f"SamplingParams.{name} must be {allowed}, got {value!r}")

        def number(name: str) -> float:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise bad(name, "a number", value)
            if value != value:  # NaN
                raise bad(name, "a number, not NaN", value)
            return float(value)

        def integer(name: str) -> int:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise bad(name, "an integer", value)
            return value

        if integer("n") < 1:
            raise bad("n", "at least 1", self.n)
        if not -2.0 <= number("presence_penalty") <= 2.0:
            raise bad("presence_penalty", "in [-2, 2]", self.presence_penalty)
        if not -2.0 <= number("frequency_penalty") <= 2.0:
            raise bad("frequency_penalty", "in [-2, 2]", self.frequency_penalty)
        if not 0.0 < number("repetition_penalty") <= 1e4:
            raise bad("repetition_penalty", "in (0, 10000]", self.repetition_penalty)
        if not 0.0 <= number("temperature") <= 1e4:
            raise bad("temperature", "in [0, 10000]", self.temperature)
        if not 0.0 < number("top_p") <= 1.0:
            raise bad("top_p", "in (0, 1]", self.top_p)
        if integer("top_k") < -1:
            raise bad("top_k", "-1, 0 (disabled) or a positive integer", self.top_k)
        if not 0.0 <= number("min_p") <= 1.0:
            raise bad("min_p", "in [0, 1]", self.min_p)
        if self.seed is not None and (integer("seed") < 0 or self.seed >= 2**64):
            raise bad("seed", "None or an integer in [0, 2**64)", self.seed)
        if self.max_tokens is not None and integer("max_tokens") < 1:
            raise bad("max_tokens", "None or at least 1", self.max_tokens)
        if self.thinking_token_budget is not None and integer("thinking_token_budget") < 0:
            raise bad("thinking_token_budget", "None or at least 0", self.thinking_token_budget)
        if integer("min_tokens") < 0:
            raise bad("min_tokens", "at least 0", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"at most max_tokens={self.max_tokens}", self.min_tokens)
        if self.logprobs is not None and integer("logprobs") < 0:
            raise bad("logprobs", "None or at least 0", self.logprobs)
        if self.prompt_logprobs is not None and integer("prompt_logprobs") < 0:
            raise bad("prompt_logprobs", "None or at least 0", self.prompt_logprobs)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias", "a dict of token id -> bias", self.logit_bias)
            bias = {}
            for t, v in self.logit_bias.items():
                tid = int(t) if isinstance(t, str) and t.lstrip("-").isdigit() else t
                if isinstance(tid, bool) or not isinstance(tid, int) or tid < 0:
                    raise bad("logit_bias", "keyed by non-negative token ids", t)
                if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
                    raise bad("logit_bias", "valued by numbers", v)
                bias[tid] = max(-100.0, min(100.0, float(v)))  # OpenAI's range
            self.logit_bias = bias
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if (
                not isinstance(ids, (list, tuple))
                or not ids
                or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids)
            ):
                raise bad("allowed_token_ids", "a non-empty list of non-negative token ids", ids)
            self.allowed_token_ids = list(ids)
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)) or any(
                not isinstance(w, str) or not w.strip() for w in self.bad_words
            ):
                raise bad("bad_words", "a list of non-empty strings", self.bad_words)
            self.bad_words = list(self.bad_words)
        if self.truncate_prompt_tokens is not None and integer("truncate_prompt_tokens") < 1:
            raise bad("truncate_prompt_tokens", "None or at least 1", self.truncate_prompt_tokens)
        if not isinstance(self.detokenize, bool):
            raise bad("detokenize", "True or False", self.detokenize)
        if not self.detokenize and self._stop_list:
            raise bad("stop", "empty when detokenize=False (stop strings need text)", self.stop)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise bad(
                "structured_outputs", "None or a StructuredOutputsParams", self.structured_outputs
            )
        if not isinstance(self.output_kind, RequestOutputKind):
            raise bad("output_kind", "a RequestOutputKind", self.output_kind)
        for s in self._stop_list:
            if not isinstance(s, str) or not s:
                raise bad("stop", "a non-empty string or a list of non-empty strings", self.stop)
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise bad("stop_token_ids", "a list of non-negative integers", self.stop_token_ids)

    @classmethod
    def from_optional(cls, **kwargs: object) -> SamplingParams:
        """SamplingParams from keyword arguments where None means "the default"
        (as vLLM's ``from_optional``); unknown names are a TypeError."""
        unknown = sorted(
            set(kwargs) - {k for k in cls.__dataclass_fields__ if not k.startswith("_")}
        )
        if unknown:
            raise TypeError(
                f"SamplingParams.from_optional got unknown fields: {', '.join(unknown)}"
            )
        nullable = {"seed", "stop", "stop_token_ids", "max_tokens", "logprobs", "prompt_logprobs"}
        nullable |= {"logit_bias", "allowed_token_ids", "bad_words", "truncate_prompt_tokens"}
        nullable |= {"structured_outputs"}
        # A None for a field whose default is not None means "use the default".
        return cls(**{k: v for k, v in kwargs.items() if v is not None or k in nullable})

    @property
    def greedy(self) -> bool:
        """Whether this request samples greedily (temperature below 1e-5)."""
        return self.temperature < _GREEDY_EPS

    @property
    def stop_holdback(self) -> int:
        """Characters a streamed text keeps back so that a stop string, which
        is cut from the output, never leaks out before it is complete."""
        if not self._stop_list or self.include_stop_str_in_output:
            return 0
        return max(len(s) for s in self._stop_list) - 1

    def clone(self, **changes: object) -> SamplingParams:
        """A copy, with ``changes`` applied (requests never share a mutable SamplingParams)."""
        fields = {k: getattr(self, k) for k in self.__dataclass_fields__ if not k.startswith("_")}
        fields.update(changes)
        return SamplingParams(**fields)
