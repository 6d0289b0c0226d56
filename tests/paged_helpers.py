"""Test helper: runs a fastllm model step by step over a paged KV cache.

It plays the model runner's part in miniature: one cache pair per attention
layer, blocks handed out from a shuffled free list (so block tables are not
contiguous), the decoder stack where the engine would build one, and the
``AttentionMetadata`` of each step built from scratch.
"""

from __future__ import annotations

import random

import torch

from fastllm.forward_context import AttentionMetadata, set_context


class PagedRunner:
    """Feeds chunks of tokens of several sequences through a model, one step at a time."""

    def __init__(
        self,
        model: torch.nn.Module,
        dtype: torch.dtype,
        device: str = "cpu",
        block_size: int = 4,
        num_blocks: int = 64,
        seed: int = 0,
        fuse: bool = True,
        num_slots: int = 16,
    ) -> None:
        self.model = model
        self.device = torch.device(device)
        self.block_size = block_size
        for layer in model.attention_layers():
            shape = (num_blocks, layer.num_kv_heads, block_size, layer.head_size)
            # NaN-filled so that reading a slot never written is caught by the comparison.
            layer.k_cache = torch.full(shape, float("nan"), dtype=dtype, device=self.device)
            layer.v_cache = torch.full(shape, float("nan"), dtype=dtype, device=self.device)
        self.free = list(range(1, num_blocks))  # block 0 only pads block tables
        random.Random(seed).shuffle(self.free)
        self.blocks: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}
        # A hybrid model's recurrent layers: one state slot per sequence id,
        # NaN until the sequence's first step zeroes it.
        self.states: list[torch.Tensor] = []
        recurrent = getattr(model, "recurrent_layers", lambda: [])()
        for layer in recurrent:
            layer.states = [
                torch.full((num_slots, *shape), float("nan"), dtype=dt, device=self.device)
                for shape, dt in layer.state_shapes(dtype)
            ]
            self.states.extend(layer.states)
        # As the engine's model runner, once the caches and states exist: a
        # packed CPU model of a fused family runs its decoder layers as one Rust
        # stack (``fuse=False`` keeps them one by one).
        self.fused = False
        if fuse and hasattr(model, "fuse_decoder_layers"):
            self.fused = model.fuse_decoder_layers()
        elif hasattr(model, "decoder_stack"):
            model.decoder_stack = None

    def step(self, chunks: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """Runs one step; ``chunks`` are (sequence id, new tokens); returns logits per chunk."""
        ids, positions, slots, seq_lens, starts, tables = [], [], [], [], [0], []
        for seq, tokens in chunks:
            blocks = self.blocks.setdefault(seq, [])
            start = self.lengths.get(seq, 0)
            if start == 0:
                for state in self.states:
                    state[seq] = 0
            end = start + len(tokens)
            while len(blocks) * self.block_size < end:
                blocks.append(self.free.pop())
            for p in range(start, end):
                slots.append(blocks[p // self.block_size] * self.block_size + p % self.block_size)
            ids += tokens
            positions += range(start, end)
            seq_lens.append(end)
            starts.append(starts[-1] + len(tokens))
            tables.append(blocks)
            self.lengths[seq] = end
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            max_query_len=max(len(t) for _, t in chunks),
            max_seq_len=max(seq_lens),
            state_slots=torch.tensor([seq for seq, _ in chunks], dtype=torch.int64, device=dev)
            if self.states
            else None,
        )
        set_context(meta)
        try:
            with torch.inference_mode():
                hidden = self.model(
                    torch.tensor(ids, dtype=torch.int64, device=dev),
                    torch.tensor(positions, dtype=torch.int64, device=dev),
                )
                logits = self.model.compute_logits(hidden)
        finally:
            set_context(None)
        return [logits[starts[i] : starts[i + 1]].cpu() for i in range(len(chunks))]
