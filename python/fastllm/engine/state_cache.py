"""Recurrent state of hybrid models: one state slot per running sequence, and
snapshots of states at fixed prefix lengths for the prefix cache.

A hybrid model (Qwen3.5, LFM2) has layers whose memory of the past is a
fixed-size state (``layers/recurrent.py``) beside attention layers with a
paged KV cache. Every running sequence holds one *slot*: index ``s`` of each
recurrent layer's state tensors. A slot is zeroed when its sequence starts
from its first token, freed when the sequence finishes or is preempted (it is
recomputed like its KV blocks), and copied when an ``n > 1`` request forks.

Prefix caching. A recurrent state cannot be rewound: the state after token
``t`` exists only if some step ended at ``t``. So the engine keeps
*snapshots*: copies of a sequence's state at chosen prefix lengths, in
``max_state_snapshots`` slots of their own (least recently used first). A
snapshot is keyed by a hash chain over the prefix's tokens, one link per KV
block (``block_size`` tokens), and holds the tokens to verify a hit.
Snapshots are taken

* at the last block boundary inside each prompt: the scheduler ends the
  prompt's chunk there (``cut``), costing at most one more step per prompt,
  so the next turn of a chat, which repeats this prompt, resumes within a
  block of its end;
* whenever a step ends a sequence exactly at a multiple of ``interval``
  tokens (``state_snapshot_interval``, a multiple of the block size):
  decoding passes each one, so a long reply leaves a snapshot at most
  ``interval`` tokens before its end.

The reuse rule: a new sequence resumes at the longest prefix ``P`` that has
both a snapshot and every attention layer's KV blocks in the prefix cache
(``KVCacheManager.acquire_prefix``); it recomputes from ``P`` on, and
``num_cached_tokens`` is ``P``. A multi-turn chat therefore recomputes the
previous reply (up to ``interval`` tokens of it) and the new turn, not the
conversation.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from fastllm.engine.sequence import Sequence

_ROOT = hash("fastllm-state-snapshot")


@dataclass
class StateOps:
    """What the model runner must do to the state tensors this step."""

    # In this order: copies (src, dst), then resets (slots to zero), before
    # the forward pass; saves (src, dst) after it.
    copies: list[tuple[int, int]] = field(default_factory=list)
    resets: list[int] = field(default_factory=list)
    saves: list[tuple[int, int]] = field(default_factory=list)


class StateCache:
    """Slots of the running sequences' states and the snapshot store."""

    def __init__(
        self,
        num_seq_slots: int,
        num_snapshots: int,
        interval: int,
        enable_prefix_caching: bool,
        block_size: int,
    ) -> None:
        self.num_seq_slots = num_seq_slots
        #: Slots every state tensor has: the sequences' first, then the snapshots'.
        self.num_slots = num_seq_slots + num_snapshots
        self.interval = interval
        self.block_size = block_size
        self.snapshots_enabled = enable_prefix_caching and num_snapshots > 0
        self._free = list(range(num_seq_slots - 1, -1, -1))
        self._free_snaps = list(range(num_seq_slots + num_snapshots - 1, num_seq_slots - 1, -1))
        # key -> (slot, prefix tokens), least recently used first
        self._snaps: OrderedDict[int, tuple[int, tuple[int, ...]]] = OrderedDict()
        # snapshots reserved this step, entered once the step has run
        self._reserved: list[tuple[int, int, tuple[int, ...]]] = []
        self.pending = StateOps()
        #: counters for ``/metrics``: lookups, lookups that resumed from a
        #: snapshot, tokens not recomputed thanks to them, snapshots taken
        self.stats = {"queries": 0, "hits": 0, "hit_tokens": 0, "saved": 0}

    def take_pending(self) -> StateOps:
        """The state work queued since the last call."""
        ops, self.pending = self.pending, StateOps()
        return ops

    # ---- keys --------------------------------------------------------------

    def _keys(self, seq: Sequence, links: int) -> list[int]:
        """The chain keys of ``seq``'s first ``links`` blocks (cached on it)."""
        keys = seq.state_keys
        n = self.block_size
        tokens = seq.token_ids
        while len(keys) < links:
            j = len(keys)
            parent = keys[-1] if keys else _ROOT
            keys.append(hash((parent, tuple(tokens[j * n : (j + 1) * n]))))
        return keys[:links]

    # ---- sequences ---------------------------------------------------------

    def resume_point(self, seq: Sequence, limit: int) -> int:
        """The longest prefix of ``seq`` (at most ``limit`` tokens, a whole
        number of blocks) with a snapshot; 0 when none. The snapshot is
        queued for copying into the sequence's slot (``ensure_slot``)."""
        if not self.snapshots_enabled:
            return 0
        self.stats["queries"] += 1
        links = limit // self.block_size
        keys = self._keys(seq, links)
        for j in range(links, 0, -1):
            entry = self._snaps.get(keys[j - 1])
            if entry is None:
                continue
            slot, tokens = entry
            length = j * self.block_size
            if tokens != tuple(seq.token_ids[:length]):
                continue
            self._snaps.move_to_end(keys[j - 1])
            seq.state_restore = slot
            self.stats["hits"] += 1
            self.stats["hit_tokens"] += length
            return length
        return 0

    def ensure_slot(self, seq: Sequence) -> bool:
        """Gives ``seq`` a slot before its next step: zeroed when it starts
        from its first token, else filled from the snapshot it resumes from;
        False when every slot is taken."""
        if seq.state_slot is not None:
            return True
        if not self._free:
            return False
        seq.state_slot = self._free.pop()
        if seq.num_computed_tokens == 0 or seq.state_restore is None:
            self.pending.resets.append(seq.state_slot)
        else:
            self.pending.copies.append((seq.state_restore, seq.state_slot))
        seq.state_restore = None
        return True

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child continues from a copy of the parent's state."""
        if not self._free:
            raise RuntimeError("no free recurrent-state slot for a forked sequence")
        child.state_slot = self._free.pop()
        child.state_keys = list(parent.state_keys)
        if parent.state_slot is not None:
            self.pending.copies.append((parent.state_slot, child.state_slot))
        else:
            self.pending.resets.append(child.state_slot)

    def free(self, seq: Sequence) -> None:
        """Returns the sequence's slot (and drops the work queued to fill it)."""
        slot, seq.state_slot = seq.state_slot, None
        seq.state_restore = None
        if slot is not None:
            pending = self.pending
            pending.copies = [c for c in pending.copies if c[1] != slot]
            pending.resets = [r for r in pending.resets if r != slot]
            self._free.append(slot)

    def reclaim(self) -> int:
        """With no sequence left, returns every slot an interrupt cut off
        from its sequence to the free list; how many."""
        lost = [s for s in range(self.num_seq_slots) if s not in self._free]
        self._free.extend(lost)
        self.pending = StateOps()
        return len(lost)

    # ---- snapshots ---------------------------------------------------------

    def _prompt_point(self, seq: Sequence) -> int:
        """The last block boundary before the end of ``seq``'s prompt (at
        least one prompt token after it, as a resumed sequence needs)."""
        return (seq.num_prompt_tokens - 1) // self.block_size * self.block_size

    def cut(self, seq: Sequence, start: int, num_new: int) -> int:
        """``num_new`` shortened so a prompt chunk ends at the prompt's
        snapshot point (``_prompt_point``) when the chunk crosses it."""
        if not self.snapshots_enabled:
            return num_new
        point = self._prompt_point(seq)
        if start < point < start + num_new:
            return point - start
        return num_new

    def save_after_step(self, seq: Sequence, end: int) -> None:
        """Snapshots ``seq``'s state after this step when the step ends it at
        a snapshot point (a multiple of ``interval``, or the prompt's point)
        not stored yet."""
        if not self.snapshots_enabled or end == 0 or seq.state_slot is None:
            return
        if end % self.interval and end != self._prompt_point(seq):
            return
        key = self._keys(seq, end // self.block_size)[-1]
        if key in self._snaps:
            self._snaps.move_to_end(key)
            return
        if any(k == key for k, _, _ in self._reserved):
            return
        if self._free_snaps:
            slot = self._free_snaps.pop()
        elif self._snaps:
            _, (slot, _) = self._snaps.popitem(last=False)
        else:
            return
        self._reserved.append((key, slot, tuple(seq.token_ids[:end])))
        self.pending.saves.append((seq.state_slot, slot))

    def commit(self) -> None:
        """Enters the snapshots of the step that has just run."""
        for key, slot, tokens in self._reserved:
            self._snaps[key] = (slot, tokens)
            self.stats["saved"] += 1
        self._reserved = []

    def drop_reserved(self) -> None:
        """Forgets the reservations of a step that did not run."""
        for _, slot, _ in self._reserved:
            self._free_snaps.append(slot)
        self._reserved = []
