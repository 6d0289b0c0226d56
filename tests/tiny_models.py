"""Test helper: the tiny Qwen3 shape several test modules build (a reasoning
model, decoder embedders), and the sentence-transformers files of an
embedding folder, written as sentence-transformers writes them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def tiny_qwen3_config(vocab_size: int, eos: int, **overrides: Any):
    """A transformers Qwen3Config: 2 layers of 64, 4 heads and 2 KV heads of 16."""
    import transformers

    kw = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        initializer_range=0.1,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
        tie_word_embeddings=True,
    )
    kw.update(overrides)
    return transformers.Qwen3Config(**kw)


def write_sentence_transformers(
    out: Path, pooling: str, dim: int, matryoshka: list[int] | None = None, prompts=None
) -> None:
    """modules.json (Transformer, Pooling, Normalize), 1_Pooling/config.json
    with ``pooling`` ("cls", "mean" or "last") and config_sentence_transformers.json."""
    kinds = [("", "Transformer"), ("1_Pooling", "Pooling"), ("2_Normalize", "Normalize")]
    modules = [
        {"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
        for i, (path, kind) in enumerate(kinds)
    ]
    (out / "modules.json").write_text(json.dumps(modules))
    (out / "1_Pooling").mkdir(exist_ok=True)
    modes = {
        "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean",
        "pooling_mode_lasttoken": pooling == "last",
    }
    (out / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": dim, **modes})
    )
    (out / "2_Normalize").mkdir(exist_ok=True)
    st: dict[str, Any] = {"prompts": dict(prompts or {})}
    if matryoshka:
        st["matryoshka_dimensions"] = list(matryoshka)
    (out / "config_sentence_transformers.json").write_text(json.dumps(st))
