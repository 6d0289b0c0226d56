"""Sequence: one generated stream's tokens, KV blocks and progress."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from fastllm.engine.request import Request
    from fastllm.tokenizer import IncrementalDetokenizer


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """The tokens of one completion (prompt + output), its block table and its
    progress through the model (``num_computed_tokens`` have KV in the cache)."""

    def __init__(self, seq_id: int, request: Request, index: int, seed: int) -> None:
        self.seq_id = seq_id
        self.request = request
        self.index = index  # which of the request's n completions
        self.seed = seed
        self.status = SequenceStatus.WAITING
        self.token_ids: list[int] = list(request.prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.block_table: list[int] = []
        self.num_registered_blocks = 0  # leading full blocks entered in the prefix cache
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.cumulative_logprob = 0.0
        self.logprobs: list = []
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.detokenizer: IncrementalDetokenizer | None = None
        # Text already returned by stream(): the next delta starts here.
        self.streamed_len = 0
        self.streamed_tokens = 0

    @property
    def output_token_ids(self) -> list[int]:
        """Tokens generated so far."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        """Number of tokens generated so far."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        """Prompt plus output length."""
        return len(self.token_ids)

    @property
    def is_finished(self) -> bool:
        """Whether the sequence has stopped."""
        return self.status is SequenceStatus.FINISHED

    @property
    def prefill_done(self) -> bool:
        """Whether every prompt token has KV in the cache."""
        return self.num_computed_tokens >= self.num_prompt_tokens
