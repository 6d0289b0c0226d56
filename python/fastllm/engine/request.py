"""Request: one prompt, its sampling parameters and its ``n`` sequences."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastllm.outputs import PromptLogprobs, RequestMetrics

if TYPE_CHECKING:  # pragma: no cover
    from fastllm.engine.sequence import Sequence
    from fastllm.sampling_params import SamplingParams


class Request:
    """A prompt and the sequences generated from it."""

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
        self.seed = seed  # child i samples with seed + i
        self.seqs: list[Sequence] = []
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.prompt_logprobs: PromptLogprobs | None = (
            [None] if params.prompt_logprobs is not None else None
        )
        self.num_cached_tokens = 0
        self.aborted = False

    @property
    def finished(self) -> bool:
        """Whether all n sequences exist and have finished."""
        return len(self.seqs) == self.params.n and all(s.is_finished for s in self.seqs)
