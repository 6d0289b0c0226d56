"""Request: one prompt, its sampling parameters and its ``n`` sequences."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastllm.engine.sequence import Sequence
from fastllm.outputs import PromptLogprobs, RequestMetrics

if TYPE_CHECKING:  # pragma: no cover
    from fastllm.sampling_params import SamplingParams


class Request:
    """A prompt and the sequences generated from it (the first one until the
    prompt is prefilled; then ``n``)."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        seed: int,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.seed = seed  # completion i samples with seed + i
        self.seqs: list[Sequence] = [Sequence(request_id, prompt_token_ids, params, seed)]
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.prompt_logprobs: PromptLogprobs | None = (
            [None] if params.prompt_logprobs is not None else None
        )

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens whose KV came from the prefix cache."""
        return self.seqs[0].num_cached_tokens

    @property
    def finished(self) -> bool:
        """Whether all n sequences exist and have finished."""
        return len(self.seqs) == self.params.n and all(s.is_finished for s in self.seqs)
