"""Per-step attention metadata, set once per step by the model runner.

The model's attention layers read it with ``get_context()`` instead of
receiving it through every ``forward`` signature.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import torch


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the paged KV cache and what they attend to.

    Tokens of all sequences are packed into one flat batch, sequence after
    sequence. Sequence ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]``;
    those new tokens are the last ones of its ``seq_lens[i]`` context tokens and
    attend causally to everything before them.
    """

    slot_mapping: torch.Tensor  # int64 [num_tokens]: block_id * block_size + offset
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq], padded with 0
    seq_lens: torch.Tensor  # int32 [num_seqs]: context length including new tokens
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]: cumulative query lengths
    max_query_len: int
    max_seq_len: int
    # Models whose layers keep one block table per layer group
    # (``KVCacheManager``): each group's slot mapping and block tables (group
    # 0's are the two above); None when every layer shares them.
    group_slot_mappings: list[torch.Tensor] | None = None
    group_block_tables: list[torch.Tensor] | None = None
    # Hybrid models: the recurrent-state slot of each sequence, int64 [num_seqs]
    # (``engine/state_cache.py``); None for models without recurrent layers.
    state_slots: torch.Tensor | None = None

    def for_group(self, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot_mapping, block_tables) of the layers of ``group``."""
        if group == 0 or self.group_slot_mappings is None or self.group_block_tables is None:
            return self.slot_mapping, self.block_tables
        return self.group_slot_mappings[group], self.group_block_tables[group]


_CONTEXT: AttentionMetadata | None = None


def set_context(metadata: AttentionMetadata | None) -> None:
    """Installs the metadata of the step about to run (None clears it)."""
    global _CONTEXT
    _CONTEXT = metadata


def get_context() -> AttentionMetadata:
    """The metadata of the running step; an error if no step is running."""
    if _CONTEXT is None:
        raise RuntimeError(
            "no attention metadata set: the model must run inside a model-runner step"
        )
    return _CONTEXT
