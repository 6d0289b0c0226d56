"""Scheduler: continuous batching under a token budget, chunked prefill,
prefix-cache reuse, and preemption by recompute when KV blocks run out."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from fastllm.engine.kv_cache_manager import KVCacheManager
from fastllm.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    """What one step computes: each sequence with its number of new tokens."""

    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    num_preempted: int = 0

    @property
    def num_tokens(self) -> int:
        """Tokens computed this step."""
        return sum(n for _, n in self.scheduled)


class Scheduler:
    """Picks the sequences and token counts of every step (never touches torch)."""

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queues a new sequence."""
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        """Whether any sequence waits or runs."""
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """Chooses this step's work: running sequences first, then waiting ones."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: set[int] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
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
                out.scheduled.append((seq, num_new))
                scheduled.add(seq.seq_id)
                budget -= num_new
                i += 1
                continue
            # seq itself was preempted: the list shifted, i now points at the next one

        if out.num_preempted == 0:
            while self.waiting and budget > 0:
                seq = self.waiting[0]
                n_children = seq.request.params.n if seq.num_output_tokens == 0 else 1
                if len(self.running) + n_children > self.max_num_seqs and self.running:
                    break
                fresh = not seq.block_table
                if fresh:
                    self.kv.acquire_prefix(seq)
                num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
                if not self.kv.allocate_slots(seq, num_new):
                    if fresh:
                        self.kv.free(seq)
                        seq.num_cached_tokens = 0
                    break
                self.waiting.popleft()
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                out.scheduled.append((seq, num_new))
                budget -= num_new
        out.block_copies = self.kv.pending_copies
        self.kv.pending_copies = []
        return out

    def _preempt(self, seq: Sequence) -> None:
        """Frees a running sequence's blocks; it will be recomputed from scratch."""
        self.running.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Removes a finished (or aborted) sequence and frees its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
