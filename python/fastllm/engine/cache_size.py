"""How many KV-cache blocks an engine gets: from what the machine has and what
the job can use.

* ``kv_cache_memory_bytes`` set: exactly that many bytes.
* otherwise ``gpu_memory_utilization`` (vLLM's name, default 0.9): on a GPU,
  the fraction of the device's memory the whole engine may hold, weights
  included; on the CPU, the fraction of the memory still available after the
  weights are loaded (``MemAvailable``) that the KV cache may take.

Either way the cache never exceeds what the job can use: ``max_num_seqs``
sequences of ``max_model_len`` tokens. The cache's tensors are allocated
uninitialised, so on the CPU the operating system commits their pages only as
blocks are first written: a small job stays small however large the budget.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger("fastllm")

# A budget that holds fewer tokens than this is an error, not a cache.
MIN_CACHE_TOKENS = 256


@dataclass(frozen=True)
class CachePlan:
    """The KV cache chosen for an engine."""

    num_blocks: int
    block_size: int
    block_bytes: int
    max_model_len: int  # the longest sequence (maybe lowered to fit, see plan_kv_cache)
    budget_from: str  # what set the budget, in words
    layout: str = ""  # how layers share blocks (``KVLayout.describe``), for the log
    groups: int = 1  # block tables per sequence (``KVLayout.num_groups``)
    state_bytes: int = 0  # hybrid models: the recurrent-state slots, taken from the budget
    state_slots: int = 0

    @property
    def num_bytes(self) -> int:
        """Bytes of K and V of every block, all layers."""
        return self.num_blocks * self.block_bytes

    @property
    def num_tokens(self) -> int:
        """Tokens the cache holds in all (of short sequences, which take a
        block in every group; long ones free their windowed groups' blocks)."""
        return self.num_blocks * self.block_size // self.groups

    def describe(self) -> str:
        """One line for the log and the server's startup block."""
        states = ""
        if self.state_slots:
            states = (
                f"; recurrent states: {self.state_slots} slots (running sequences and "
                f"snapshots), {self.state_bytes / 2**20:.1f} MiB"
            )
        return (
            f"{self.num_blocks} blocks of {self.block_size} tokens, "
            f"{self.num_bytes / 2**20:.1f} MiB, {self.num_tokens} tokens in all; "
            f"longest sequence {self.max_model_len} tokens ({self.budget_from}){self.layout}"
            f"{states}"
        )


def available_cpu_memory() -> int:
    """Bytes the kernel says can be allocated without swapping (``MemAvailable``)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:  # not Linux: free physical pages
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 4 << 30


def _budget(device: str, utilization: float) -> tuple[int, str]:
    if device == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info()
        used = total - free
        return int(utilization * total) - used, f"gpu_memory_utilization={utilization:g}"
    avail = available_cpu_memory()
    return (
        int(utilization * avail),
        f"gpu_memory_utilization={utilization:g} of {avail / 2**30:.1f} GiB available",
    )


def plan_kv_cache(
    *,
    device: str,
    block_bytes: int,
    block_size: int,
    max_model_len: int,
    max_model_len_is_explicit: bool,
    max_num_seqs: int,
    kv_cache_memory_bytes: int | None,
    gpu_memory_utilization: float,
    seq_blocks: Callable[[int], int] | None = None,
    layout: str = "",
    groups: int = 1,
    state_bytes: int = 0,
    state_slots: int = 0,
) -> CachePlan:
    """The cache for this engine; a ``ValueError`` naming the settings to change
    when even one sequence cannot fit. ``seq_blocks(n)``: the blocks a
    sequence of ``n`` tokens holds at most (default: one per ``block_size``
    tokens; fewer where windowed layers free theirs, ``KVLayout``). A hybrid
    model's recurrent states (``state_bytes`` for ``state_slots`` slots) come
    out of the budget first."""
    if kv_cache_memory_bytes is not None:
        budget, source = kv_cache_memory_bytes, f"kv_cache_memory_bytes={kv_cache_memory_bytes}"
    else:
        budget, source = _budget(device, gpu_memory_utilization)
    if state_bytes:
        if state_bytes >= budget:
            raise ValueError(
                f"the recurrent states ({state_slots} slots: max_num_seqs plus "
                f"max_state_snapshots, {_size(state_bytes)}) do not fit in the "
                f"cache budget ({source}); lower max_num_seqs or max_state_snapshots"
            )
        budget -= state_bytes
    per_seq = seq_blocks or (lambda n: -(-n // block_size))
    blocks_per_seq = per_seq(max_model_len)
    wanted = blocks_per_seq * max_num_seqs + 1
    # A model without attention layers (a hybrid of recurrent layers only)
    # keeps nothing in its blocks: every sequence gets its blocks for free.
    num_blocks = wanted if block_bytes == 0 else max(0, min(wanted, budget // block_bytes))
    # The longest sequence that fits (per_seq grows with n).
    lo, hi = 0, max_model_len
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if per_seq(mid) <= num_blocks else (lo, mid - 1)
    fits = lo
    if num_blocks < blocks_per_seq:
        if (
            max_model_len_is_explicit
            or kv_cache_memory_bytes is not None
            or fits < max(MIN_CACHE_TOKENS, block_size)
        ):
            raise ValueError(
                f"the KV cache ({source}: {num_blocks} blocks of {block_size} tokens) cannot "
                f"hold one sequence of max_model_len={max_model_len} tokens "
                f"({blocks_per_seq} blocks of {block_bytes} bytes); lower max_model_len, or "
                f"raise kv_cache_memory_bytes or gpu_memory_utilization"
            )
        logger.warning(
            "the model's context of %d tokens does not fit in the KV cache (%s); "
            "max_model_len is lowered to %d (set max_model_len or kv_cache_memory_bytes "
            "to choose)",
            max_model_len,
            source,
            fits,
        )
        max_model_len = fits
    return CachePlan(
        num_blocks,
        block_size,
        block_bytes,
        max_model_len,
        source,
        layout,
        groups,
        state_bytes,
        state_slots,
    )


def _size(n: int) -> str:
    """``n`` bytes in words: MiB from 1 MiB, else bytes (a tiny model's states)."""
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n} bytes"
