"""Type stubs for the compiled Rust core, ``fastllm._core``."""

import torch

__version__: str

def num_threads() -> int:
    """Number of threads the Rust kernels use (``FASTLLM_NUM_THREADS`` or the cores)."""

# ---- attention ----

def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Stores new K/V rows into their cache slots (a negative slot skips the token).

    ``key``/``value``: ``[num_tokens, num_kv_heads, head_size]``, the caches' dtype
    (float32 or bfloat16); caches: ``[num_blocks, num_kv_heads, block_size, head_size]``;
    ``slot_mapping``: int64 ``[num_tokens]``, ``slot = block_id * block_size + offset``.
    Raises ValueError on a wrong dtype, shape, device or layout, or a slot out of range.
    """

def paged_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
) -> None:
    """Attention of packed new tokens over the paged KV cache, written into ``out``.

    ``query``/``out``: ``[num_tokens, num_heads, head_size]`` in the caches' dtype;
    ``block_tables``: int32 ``[num_seqs, max_blocks_per_seq]``; ``seq_lens``: int32
    ``[num_seqs]`` (context length including the new tokens); ``query_start_loc``:
    int32 ``[num_seqs + 1]``. Sequence ``i``'s new tokens are the last of its
    ``seq_lens[i]`` tokens and attend causally; ``sliding_window > 0`` limits a
    query at position ``p`` to keys in ``(p - sliding_window, p]``.
    """
