"""Scheduler: continuous batching under a token budget, chunked prefill,
prefix-cache reuse, preemption by recompute when KV blocks run out, and the
token-level bookkeeping after each step (appending sampled tokens, forking
``n > 1`` completions, stop tokens and lengths)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property

from fastllm.engine.kv_cache_manager import KVCacheManager
from fastllm.engine.sequence import Sequence, SequenceStatus
from fastllm.engine.state_cache import StateOps
from fastllm.engine.thinking import ANSWER, OPEN
from fastllm.outputs import Logprob


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: ``num_new_tokens`` tokens at packed rows
    ``[row, row + num_new_tokens)``."""

    seq: Sequence
    num_new_tokens: int
    row: int
    start: int  # position of the first new token in the sequence
    # Completions drawn from this entry's last row: 0 (mid-prompt chunk), 1, or
    # n when the prompt of an ``n > 1`` request completes (the parent and its
    # n - 1 forks each sample their own first token from the same logits).
    num_samples: int = 0
    # Whether every row's logits are wanted (the request asked for prompt logprobs).
    prompt_logprobs: bool = False
    # Tokens the samples may not be (EOS and stop tokens before ``min_tokens``).
    suppressed: list[int] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        """How many of the new tokens are prompt tokens."""
        seq = self.seq
        return max(0, min(seq.num_prompt_tokens, self.start + self.num_new_tokens) - self.start)


@dataclass
class SchedulerOutput:
    """What one step computes, laid out once for everyone who reads it."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Recurrent-state resets and copies around the forward pass (hybrid models).
    state_ops: StateOps | None = None
    num_preempted: int = 0

    @property
    def num_tokens(self) -> int:
        """Tokens computed this step."""
        return sum(s.num_new_tokens for s in self.scheduled)

    @cached_property
    def sampled(self) -> list[ScheduledSeq]:
        """The entries that sample this step, in order (read by the runner and
        by postprocess; computed once, after ``scheduled`` is laid out)."""
        return [s for s in self.scheduled if s.num_samples]


@dataclass
class SampledToken:
    """One token drawn by the sampler, with its raw logprob, rank and the top-N."""

    token: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass
class StepResult:
    """What the model runner returns for a step."""

    # Per entry of ``SchedulerOutput.sampled``: its ``num_samples`` tokens.
    samples: list[list[SampledToken]]
    # Scheduled index -> logprob entries of the next prompt tokens of that chunk.
    prompt_logprobs: dict[int, list[dict[int, Logprob]]] = field(default_factory=dict)


@dataclass
class StepUpdate:
    """What ``Scheduler.postprocess`` did: new tokens (in order) and new forks."""

    new_tokens: list[tuple[Sequence, SampledToken]] = field(default_factory=list)
    forked: list[Sequence] = field(default_factory=list)


class Scheduler:
    """Picks the sequences and token counts of every step and applies their
    results (never touches torch)."""

    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: Iterable[int] = (),
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queues a new sequence."""
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        """Whether any sequence waits or runs."""
        return bool(self.waiting or self.running)

    def drop_all(self) -> None:
        """Forgets every waiting and running sequence (their blocks are the
        engine's to reclaim)."""
        for seq in (*self.running, *self.waiting):
            seq.status = SequenceStatus.FINISHED
        self.running.clear()
        self.waiting.clear()

    def sequences_of(self, request_id: str) -> list[Sequence]:
        """The running and waiting sequences of one request."""
        return [s for s in (*self.running, *self.waiting) if s.request_id == request_id]

    def num_requests(self) -> tuple[int, int]:
        """Requests with a running sequence, and requests only waiting."""
        running = {s.request_id for s in self.running}
        waiting = {s.request_id for s in self.waiting} - running
        return len(running), len(waiting)

    # ---- scheduling ----------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Chooses this step's work: running sequences first, then waiting ones."""
        out = SchedulerOutput()
        states = self.kv.states
        if states is not None:
            states.drop_reserved()  # a step that raised never ran its saves
        chosen: list[tuple[Sequence, int]] = []
        budget = self.max_num_batched_tokens
        scheduled: set[int] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = self._chunk(seq, budget)
            if num_new <= 0:
                i += 1
                continue
            while not self.kv.allocate_slots(seq, num_new):
                victim = self.running[-1]
                if victim.seq_id in scheduled:  # never undo work already placed
                    victim = seq
                self._preempt(victim)
                out.num_preempted += 1
                if victim is seq:
                    break
            else:
                chosen.append((seq, num_new))
                scheduled.add(seq.seq_id)
                budget -= num_new
                i += 1
                continue
            # seq itself was preempted: the list shifted, i now points at the next one

        if out.num_preempted == 0:
            while self.waiting and budget > 0:
                seq = self.waiting[0]
                n_children = seq.params.n if seq.num_output_tokens == 0 else 1
                if len(self.running) + n_children > self.max_num_seqs and self.running:
                    break
                fresh = not seq.block_table
                if fresh:
                    self.kv.acquire_prefix(seq)
                num_new = self._chunk(seq, budget)
                if not self.kv.allocate_slots(seq, num_new):
                    if fresh:
                        self.kv.free(seq)
                        seq.num_cached_tokens = 0
                    break
                self.waiting.popleft()
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                chosen.append((seq, num_new))
                budget -= num_new
        out.scheduled = self._lay_out(chosen)
        out.block_copies = self.kv.take_pending_copies()
        if states is not None:
            for seq, n in chosen:
                states.save_after_step(seq, seq.num_computed_tokens + n)
            out.state_ops = states.take_pending()
        return out

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """How many of ``seq``'s tokens to compute next, within ``budget``
        (a hybrid model's prompt chunk ends at its last state snapshot point)."""
        num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
        if self.kv.states is not None and num_new > 1:
            num_new = self.kv.states.cut(seq, seq.num_computed_tokens, num_new)
        return num_new

    def _lay_out(self, chosen: list[tuple[Sequence, int]]) -> list[ScheduledSeq]:
        """Packed rows, who samples and how many, and who wants every row's logits."""
        entries = []
        row = 0
        for seq, n in chosen:
            entry = ScheduledSeq(seq, n, row, seq.num_computed_tokens)
            if seq.num_computed_tokens + n == seq.num_tokens:
                first = seq.num_output_tokens == 0 and seq.index == 0
                entry.num_samples = seq.params.n if first else 1
                entry.suppressed = self._suppressed_tokens(seq)
            entry.prompt_logprobs = (
                seq.params.prompt_logprobs is not None and seq.index == 0 and not seq.prefill_done
            )
            entries.append(entry)
            row += n
        return entries

    def unschedulable(self) -> str | None:
        """Why nothing can run although sequences wait (None when something can)."""
        if self.running or not self.waiting:
            return None
        seq = self.waiting[0]
        return (
            f"request {seq.request_id} cannot be scheduled: needs "
            f"{self.kv.blocks_for(seq.num_tokens)} KV blocks, pool has "
            f"{self.kv.num_free_blocks} free"
        )

    def _preempt(self, seq: Sequence) -> None:
        """Frees a running sequence's blocks; it will be recomputed from scratch."""
        self.running.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    # ---- after the step ------------------------------------------------

    def postprocess(self, sched: SchedulerOutput, result: StepResult) -> StepUpdate:
        """Advances the step's sequences, forks ``n > 1`` completions, appends
        the sampled tokens and finishes sequences on stop tokens and lengths
        (stop strings are the output processor's: see ``stop``)."""
        for entry in sched.scheduled:
            entry.seq.num_computed_tokens += entry.num_new_tokens
            self.kv.register_computed_blocks(entry.seq)
        if self.kv.states is not None:
            self.kv.states.commit()
        update = StepUpdate()
        for entry, samples in zip(sched.sampled, result.samples, strict=True):
            parent = entry.seq
            seqs = [parent]
            for i in range(1, len(samples)):
                child = parent.fork(i, parent.seed + i)
                self.kv.fork(parent, child)
                child.status = SequenceStatus.RUNNING
                self.running.append(child)
                update.forked.append(child)
                seqs.append(child)
            for seq, sample in zip(seqs, samples):
                self._append(seq, sample.token)
                update.new_tokens.append((seq, sample))
        return update

    def _append(self, seq: Sequence, token: int) -> None:
        """Appends one token and applies the token-level stop rules in vLLM's order."""
        seq.token_ids.append(token)
        p = seq.params
        n_out = seq.num_output_tokens
        ends = (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids
        thinking = seq.thinking
        in_thinking = False  # the grammar does not see the thinking's tokens
        if thinking is not None:
            was_open = thinking.phase == OPEN
            in_thinking = thinking.on_token(token, seq.output_token_ids)
            if was_open and in_thinking:
                # the reply opened a block: its grammar waits for the answer
                thinking.grammar, seq.grammar = seq.grammar, None
            elif thinking.phase == ANSWER and thinking.grammar is not None:
                seq.grammar, thinking.grammar = thinking.grammar, None
        if seq.grammar is not None and not in_thinking and not (ends and n_out >= p.min_tokens):
            try:
                seq.grammar.consume(token)
            except ValueError:
                # Only a token the mask let through can arrive here, so this
                # is a grammar engine failure: the sequence ends, others go on.
                return self.stop(seq, "stop", "grammar_error")
            if seq.grammar.is_finished:
                # The grammar is complete: nothing but EOS may follow, so the
                # sequence ends here, with this token's text (min_tokens cannot
                # be honoured past the end of the grammar).
                seq.grammar_complete = True
                return self.stop(seq, "stop")
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                return self.stop(seq, "stop")
            if token in p.stop_token_ids:
                return self.stop(seq, "stop", token)
        if (p.max_tokens is not None and n_out >= p.max_tokens) or (
            seq.num_tokens >= self.max_model_len
        ):
            self.stop(seq, "length")

    def _suppressed_tokens(self, seq: Sequence) -> list[int]:
        """Tokens ``seq`` may not produce next: EOS and stop tokens before
        ``min_tokens``, and the token that would complete one of its bad words."""
        p = seq.params
        toks: list[int] = []
        if seq.num_output_tokens < p.min_tokens:
            toks.extend(p.stop_token_ids)
            if not p.ignore_eos:
                toks.extend(self.eos_token_ids)
        if seq.bad_words_token_ids:
            out = seq.output_token_ids
            for word in seq.bad_words_token_ids:
                head = word[:-1]
                if not head or (len(out) >= len(head) and out[len(out) - len(head) :] == head):
                    toks.append(word[-1])
        return toks

    def stop(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """Finishes ``seq`` (or, already finished, gives it this reason) and frees its blocks."""
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        if seq.is_finished:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
