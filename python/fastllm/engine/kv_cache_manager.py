"""KV-cache manager: gives sequences KV blocks from the Rust block pool,
reuses cached prefix blocks, and copies shared blocks before they are written."""

from __future__ import annotations

from fastllm import _core
from fastllm.engine.sequence import Sequence


class KVCacheManager:
    """Block tables of the running sequences over one ``_core.BlockPool``."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = _core.BlockPool(num_blocks, block_size, enable_prefix_caching)
        # (src, dst) block copies the model runner must do before the next forward.
        self.pending_copies: list[tuple[int, int]] = []

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """The copies queued since the last call (the runner does them before the forward)."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now."""
        return self.pool.num_free_blocks()

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold num_tokens tokens."""
        return -(-num_tokens // self.block_size)

    def acquire_prefix(self, seq: Sequence) -> None:
        """Gives a new sequence the cached blocks of its longest cached prefix.

        At least one token is left to compute, so the step still yields logits.
        """
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return
        usable = (seq.num_tokens - 1) // self.block_size * self.block_size
        if usable <= 0:
            return
        blocks = self.pool.match_prefix(seq.token_ids[:usable])
        for b in blocks:
            self.pool.incref(b)
        seq.block_table = list(blocks)
        seq.num_registered_blocks = len(blocks)
        seq.num_computed_tokens = len(blocks) * self.block_size
        seq.num_cached_tokens = seq.num_computed_tokens

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Makes room for num_new_tokens more computed tokens; False (and no
        change) when the pool cannot provide enough blocks."""
        start = seq.num_computed_tokens
        end = start + num_new_tokens
        missing = max(0, self.blocks_for(end) - len(seq.block_table))
        first = start // self.block_size
        shared = (
            first < len(seq.block_table)
            and start % self.block_size != 0
            and self.pool.ref_count(seq.block_table[first]) > 1
        )
        if missing + int(shared) > self.pool.num_free_blocks():
            return False
        if shared:
            src = seq.block_table[first]
            dst = self.pool.copy_on_write(src)
            seq.block_table[first] = dst
            self.pending_copies.append((src, dst))
        if missing:
            seq.block_table.extend(self.pool.allocate_many(missing))
        return True

    def register_computed_blocks(self, seq: Sequence) -> None:
        """Enters every full block whose KV is now computed into the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        for i in range(seq.num_registered_blocks, full):
            parent = seq.block_table[i - 1] if i > 0 else None
            self.pool.register_full_block(
                seq.block_table[i], parent, seq.token_ids[i * bs : (i + 1) * bs]
            )
        seq.num_registered_blocks = max(seq.num_registered_blocks, full)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Lets child share every block of parent (copy-on-write later)."""
        for b in parent.block_table:
            self.pool.incref(b)
        child.block_table = list(parent.block_table)
        child.num_registered_blocks = parent.num_registered_blocks
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens

    def free(self, seq: Sequence) -> None:
        """Returns a sequence's blocks; the last ones are freed first so they are
        evicted before the shared prefix they extend. The table is detached
        first: an interrupt part-way leaves blocks unfreed (which
        ``LLMEngine.reclaim_blocks`` returns once idle), never a table that
        lists a freed block (which a later free would free twice)."""
        table = seq.block_table
        seq.block_table = []
        seq.num_registered_blocks = 0
        seq.num_computed_tokens = 0
        for b in reversed(table):
            self.pool.free(b)
