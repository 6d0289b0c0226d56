"""Sequence: one generated stream's tokens, KV blocks and progress."""

from __future__ import annotations

import enum
import itertools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from fastllm import _core
    from fastllm.engine.thinking import ThinkingState
    from fastllm.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """The tokens of one completion (prompt + output), its block table and its
    progress through the model (``num_computed_tokens`` have KV in the cache).

    It carries what the scheduler and the model runner need of its request
    (id, sampling parameters, seed), so neither looks the request up.
    """

    _ids = itertools.count()

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seed: int,
        index: int = 0,
    ) -> None:
        self.seq_id = next(Sequence._ids)
        self.request_id = request_id
        self.params = params
        self.index = index  # which of the request's n completions
        self.seed = seed
        self.status = SequenceStatus.WAITING
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        # One block table per layer group (``KVCacheManager``; empty before
        # the first allocation), with per group the leading full blocks
        # entered in the prefix cache and the leading blocks freed (out of a
        # window: their entries are 0 and never read).
        self.block_tables: list[list[int]] = []
        self.num_registered: list[int] = []
        self.num_freed: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        # Hybrid models (``engine/state_cache.py``): the slot of this sequence's
        # recurrent state, the snapshot slot it resumes from, and the chain
        # keys of its prefix's snapshot points.
        self.state_slot: int | None = None
        self.state_restore: int | None = None
        self.state_keys: list[int] = []
        self.finish_reason: str | None = None  # "stop", "length" or "abort"
        self.stop_reason: int | str | None = None
        # SamplingParams.bad_words as token ids (set by the engine, which has the tokenizer).
        self.bad_words_token_ids: list[list[int]] = []
        # SamplingParams.structured_outputs as a grammar matcher (set by the engine),
        # advanced by every appended token: its state is a function of the output
        # tokens, so preemption by recompute keeps it as it is.
        self.grammar: _core.GrammarMatcher | None = None
        self.grammar_complete = False  # ended because its grammar allows nothing more
        # Where the reply is relative to its thinking block (set by the engine when
        # it has a reasoning parser and the request a budget or a grammar).
        self.thinking: ThinkingState | None = None
        # A pooling request's pooled hidden states (set by the pooling engine;
        # fastllm.pooling.decoder.PoolState), filled in as the prompt runs.
        self.pooling: Any = None

    def fork(self, index: int, seed: int) -> Sequence:
        """A sibling completion of the same prompt (no blocks yet: ``KVCacheManager.fork``)."""
        child = Sequence(
            self.request_id, self.token_ids[: self.num_prompt_tokens], self.params, seed, index
        )
        child.bad_words_token_ids = self.bad_words_token_ids
        if self.grammar is not None:
            child.grammar = self.grammar.fork()
        if self.thinking is not None:
            child.thinking = self.thinking.fork()
        return child

    @property
    def block_table(self) -> list[int]:
        """The block table of layer group 0 (every layer's, in most models)."""
        return self.block_tables[0] if self.block_tables else []

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt's tokens."""
        return self.token_ids[: self.num_prompt_tokens]

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
