"""KV-cache manager: gives sequences KV blocks from the Rust block pool,
reuses cached prefix blocks, copies shared blocks before they are written,
and frees the blocks a sliding-window layer can no longer see.

Layer groups (``KVLayout``). A model whose layers all attend to the whole
sequence, or all within one window, keeps one block table per sequence, and
a block holds the K and V of one block of tokens in every layer. A model
that mixes both (Gemma 2 and 3, SmolLM3, Qwen2 with ``max_window_layers``)
splits its layers into groups of ``k`` layers, full-attention layers and
windowed layers apart, ``k`` the smaller of the two counts; a block holds
one block of tokens for the ``k`` layers of one group, and every sequence
has one block table per group, all drawing on one pool. A windowed group's
table frees each block once no query to come can see it, so a long sequence
holds its full-attention layers' KV for every token but its windowed
layers' KV for about a window of them (plus the step being computed).

Prefix caching over groups. Each group caches its blocks under its own
chain of hashes (``BlockPool.match_prefix(tokens, group)``). A cached prefix
is reused only as far as every group still holds it: the hit is the shortest
of the groups' matches, each counted from the first block (a windowed
group's early blocks stay cached after it frees them, until the pool evicts
them). Of a hit, a windowed group takes only the blocks its window can see
from the resume point.

Hybrid models (recurrent layers beside attention ones) also give each
sequence a recurrent-state slot (``states``, ``engine/state_cache.py``); a
cached prefix is then reusable only up to the longest prefix that also has
a state snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastllm import _core
from fastllm.engine.sequence import Sequence
from fastllm.engine.state_cache import StateCache


@dataclass(frozen=True)
class KVLayout:
    """Which layers share a block table and how many layers a block holds."""

    #: Layer indices of each group, in order (group 0 first); a group may
    #: hold fewer than ``layers_per_block`` layers (its last slots unused).
    groups: tuple[tuple[int, ...], ...]
    #: The window of each group's layers (None: full attention).
    windows: tuple[int | None, ...]
    layers_per_block: int

    @classmethod
    def of(cls, windows: list[int | None]) -> KVLayout:
        """The layout of a model whose layer ``i`` has window ``windows[i]``."""
        full = tuple(i for i, w in enumerate(windows) if w is None)
        local = tuple(i for i, w in enumerate(windows) if w is not None)
        if not full or not local:
            window = max((w for w in windows if w is not None), default=None)
            return cls((tuple(range(len(windows))),), (window,), len(windows))
        k = min(len(full), len(local))
        groups = [full[i : i + k] for i in range(0, len(full), k)]
        groups += [local[i : i + k] for i in range(0, len(local), k)]
        group_windows = tuple(
            None if g[0] in full else max(windows[i] or 0 for i in g) for g in groups
        )
        return cls(tuple(groups), group_windows, k)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def place(self, layer: int) -> tuple[int, int]:
        """(group, slot) of layer ``layer``: its table and its cache tensor."""
        for g, members in enumerate(self.groups):
            if layer in members:
                return g, members.index(layer)
        raise ValueError(f"layer {layer} is in no group")

    def blocks_per_seq(self, num_tokens: int, block_size: int, step_tokens: int) -> int:
        """Blocks one sequence of ``num_tokens`` tokens holds at most, while
        steps add up to ``step_tokens`` tokens to it."""
        total = 0
        whole = -(-num_tokens // block_size)
        for w in self.windows:
            total += whole if w is None else min(whole, -(-(w + step_tokens) // block_size) + 1)
        return total

    def describe(self) -> str:
        """One phrase for the log (empty for the plain layout)."""
        if self.num_groups == 1 and self.windows[0] is None:
            return ""
        windowed = sum(len(g) for g, w in zip(self.groups, self.windows, strict=True) if w)
        return (
            f"; {self.num_groups} block tables of {self.layers_per_block} layers, "
            f"{windowed} windowed layers keep only their window's blocks"
        )


class KVCacheManager:
    """Block tables of the running sequences over one ``_core.BlockPool``."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        windows: tuple[int | None, ...] = (None,),
        states: StateCache | None = None,
    ) -> None:
        self.block_size = block_size
        #: The recurrent-state slots and snapshots of a hybrid model (None: none).
        self.states = states
        self.enable_prefix_caching = enable_prefix_caching
        #: The window of each layer group (``KVLayout.windows``).
        self.windows = tuple(windows)
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
        """Blocks needed to hold num_tokens tokens, in every group."""
        return -(-num_tokens // self.block_size) * len(self.windows)

    def _ensure_tables(self, seq: Sequence) -> None:
        if not seq.block_tables:
            n = len(self.windows)
            seq.block_tables = [[] for _ in range(n)]
            seq.num_registered = [0] * n
            seq.num_freed = [0] * n

    def _first_visible(self, group: int, position: int) -> int:
        """The first block holding a key that a query at ``position`` (or
        later) can see in ``group``."""
        window = self.windows[group]
        if window is None:
            return 0
        return max(0, position + 1 - window) // self.block_size

    def acquire_prefix(self, seq: Sequence) -> None:
        """Gives a new sequence the cached blocks of its longest cached prefix
        (held by every group: module docstring).

        At least one token is left to compute, so the step still yields logits.
        """
        if (
            not self.enable_prefix_caching
            or seq.params.prompt_logprobs is not None
            or (seq.pooling is not None and seq.pooling.needs_every_position)
        ):
            return
        usable = (seq.num_tokens - 1) // self.block_size * self.block_size
        if usable <= 0:
            return
        tokens = seq.token_ids[:usable]
        matches = [self.pool.match_prefix(tokens, g) for g in range(len(self.windows))]
        hit = min(len(m) for m in matches)
        if hit and self.states is not None:
            hit = self.states.resume_point(seq, hit * self.block_size) // self.block_size
        if hit == 0:
            return
        self._ensure_tables(seq)
        for g, blocks in enumerate(matches):
            # The last block stays: the next block registered names it as parent.
            first = min(self._first_visible(g, hit * self.block_size), hit - 1)
            for b in blocks[first:hit]:
                self.pool.incref(b)
            seq.block_tables[g] = [0] * first + list(blocks[first:hit])
            seq.num_registered[g] = hit
            seq.num_freed[g] = first
        seq.num_computed_tokens = hit * self.block_size
        seq.num_cached_tokens = seq.num_computed_tokens

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Makes room for num_new_tokens more computed tokens in every group;
        False (and no change) when the pool cannot provide enough blocks."""
        self._ensure_tables(seq)
        start = seq.num_computed_tokens
        end = start + num_new_tokens
        first = start // self.block_size
        plans = []
        for g, table in enumerate(seq.block_tables):
            missing = max(0, -(-end // self.block_size) - len(table))
            shared = (
                seq.num_freed[g] <= first < len(table)
                and start % self.block_size != 0
                and self.pool.ref_count(table[first]) > 1
            )
            plans.append((table, missing, shared))
        if sum(m + int(s) for _, m, s in plans) > self.pool.num_free_blocks():
            return False
        if self.states is not None and not self.states.ensure_slot(seq):
            return False
        for table, missing, shared in plans:
            if shared:
                src = table[first]
                dst = self.pool.copy_on_write(src)
                table[first] = dst
                self.pending_copies.append((src, dst))
            if missing:
                table.extend(self.pool.allocate_many(missing))
        return True

    def register_computed_blocks(self, seq: Sequence) -> None:
        """Enters every full block whose KV is now computed into the prefix
        cache (each group in its own chain), then frees the blocks no query
        to come can see (``release_out_of_window``)."""
        if self.enable_prefix_caching and seq.block_tables:
            bs = self.block_size
            for g, table in enumerate(seq.block_tables):
                full = min(seq.num_computed_tokens // bs, len(table))
                for i in range(seq.num_registered[g], full):
                    parent = table[i - 1] if i > 0 else None
                    self.pool.register_full_block(
                        table[i], parent, seq.token_ids[i * bs : (i + 1) * bs], g
                    )
                seq.num_registered[g] = max(seq.num_registered[g], full)
        self.release_out_of_window(seq)

    def release_out_of_window(self, seq: Sequence) -> None:
        """Frees the blocks of windowed groups that every query to come (at
        positions from ``num_computed_tokens`` on) sees past; with prefix
        caching a block waits until the block after it is registered (it is
        that block's parent). Its table entry becomes 0 first, never read
        again (attention reads only keys inside the window)."""
        if not seq.block_tables:
            return
        for g, table in enumerate(seq.block_tables):
            if self.windows[g] is None:
                continue
            limit = self._first_visible(g, seq.num_computed_tokens)
            if self.enable_prefix_caching:
                limit = min(limit, seq.num_registered[g] - 1)
            for j in range(seq.num_freed[g], min(limit, len(table))):
                block = table[j]
                table[j] = 0
                seq.num_freed[g] = j + 1
                self.pool.free(block)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Lets child share every block of parent (copy-on-write later)."""
        self._ensure_tables(parent)
        tables = []
        for g, table in enumerate(parent.block_tables):
            for b in table[parent.num_freed[g] :]:
                self.pool.incref(b)
            tables.append(list(table))
        child.block_tables = tables
        child.num_registered = list(parent.num_registered)
        child.num_freed = list(parent.num_freed)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        if self.states is not None:
            self.states.fork(parent, child)

    def free(self, seq: Sequence) -> None:
        """Returns a sequence's blocks; the last ones are freed first so they are
        evicted before the shared prefix they extend. The tables are detached
        first: an interrupt part-way leaves blocks unfreed (which
        ``LLMEngine.reclaim_blocks`` returns once idle), never a table that
        lists a freed block (which a later free would free twice)."""
        if self.states is not None:
            self.states.free(seq)
        tables, freed = seq.block_tables, seq.num_freed
        seq.block_tables = []
        seq.num_registered = []
        seq.num_freed = []
        seq.num_computed_tokens = 0
        for g, table in enumerate(tables):
            for b in reversed(table[freed[g] :]):
                self.pool.free(b)
