"""RequestOutput and CompletionOutput: what generate() returns (vLLM's names)."""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    """The log-probability of one token, its rank among all tokens, and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the chosen token plus the top-N).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class RequestMetrics:
    """Timings of one request, in seconds since the epoch (time.time())."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        """Seconds from arrival to the first generated token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class CompletionOutput:
    """One generated sequence of a request (``n`` of them per request)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None
    # With the LLM's reasoning_parser: ``text`` split into the thinking and
    # the answer (each None when empty); both None without a parser.
    reasoning_content: str | None = None
    content: str | None = None

    def finished(self) -> bool:
        """Whether this sequence has finished."""
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (
            f"CompletionOutput(index={self.index}, text={self.text!r}, "
            f"token_ids={_short(self.token_ids)}, finish_reason={self.finish_reason!r}, "
            f"stop_reason={self.stop_reason!r})"
        )


@dataclass
class RequestOutput:
    """The output of one request: its prompt and its ``n`` completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = field(default=None, repr=False)

    def __repr__(self) -> str:
        outs = ", ".join(repr(o) for o in self.outputs)
        return (
            f"RequestOutput(request_id={self.request_id!r}, prompt={self.prompt!r}, "
            f"prompt_token_ids={_short(self.prompt_token_ids)}, "
            f"num_cached_tokens={self.num_cached_tokens}, finished={self.finished}, "
            f"outputs=[{outs}])"
        )

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{o.index}</td><td><pre style='margin:0'>{html.escape(o.text)}</pre></td>"
            f"<td>{len(o.token_ids)}</td><td>{html.escape(str(o.finish_reason))}</td></tr>"
            for o in self.outputs
        )
        prompt = html.escape(self.prompt if self.prompt is not None else str(self.prompt_token_ids))
        return (
            f"<div><b>RequestOutput</b> {html.escape(self.request_id)}"
            f" &middot; prompt: <code>{prompt}</code>"
            f" &middot; cached tokens: {self.num_cached_tokens}"
            "<table><tr><th>#</th><th>text</th><th>tokens</th><th>finish</th></tr>"
            f"{rows}</table></div>"
        )


def _short(ids: list[int], limit: int = 12) -> str:
    if len(ids) <= limit:
        return str(ids)
    return f"[{', '.join(map(str, ids[:limit]))}, ... ({len(ids)} tokens)]"


# ---- pooling outputs (LLM.embed / score / classify; vLLM's names) -------------------


@dataclass
class EmbeddingOutput:
    """One input's embedding."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        """The embedding's number of dimensions."""
        return len(self.embedding)


@dataclass
class ScoringOutput:
    """One (query, document) pair's score: a cross-encoder's relevance, or the
    cosine similarity of an embedding model's two vectors."""

    score: float


@dataclass
class ClassificationOutput:
    """One input's class probabilities (the raw logits with ``activation=False``)."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        """The number of classes."""
        return len(self.probs)


@dataclass
class PoolingRequestOutput:
    """The output of one pooling request: its prompt's tokens and its result."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: Any
    finished: bool = True


@dataclass
class EmbeddingRequestOutput(PoolingRequestOutput):
    """``LLM.embed``'s output: ``outputs.embedding``."""

    outputs: EmbeddingOutput


@dataclass
class ScoringRequestOutput(PoolingRequestOutput):
    """``LLM.score``'s output: ``outputs.score``."""

    outputs: ScoringOutput


@dataclass
class ClassificationRequestOutput(PoolingRequestOutput):
    """``LLM.classify``'s output: ``outputs.probs``."""

    outputs: ClassificationOutput
