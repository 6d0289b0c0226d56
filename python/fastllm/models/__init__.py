"""fastllm.models: model implementations and the registry of supported architectures.

Every model is a ``torch.nn.Module`` with

* ``forward(input_ids [T] int64, positions [T] int64) -> hidden [T, hidden_size]``
  for the packed tokens of one step (attention metadata from
  ``fastllm.forward_context.get_context()``),
* ``compute_logits(hidden [n, hidden_size]) -> float32 [n, vocab_size]``,
* ``attention_layers() -> list[PagedAttention]`` (the runner assigns their caches),
* ``weight_specs() -> dict[str, WeightSpec]`` (how the loader finds parameters).
"""

from __future__ import annotations

import importlib
from typing import Any

# architecture name in config.json -> (module, class)
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("fastllm.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("fastllm.models.llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("fastllm.models.llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("fastllm.models.llama", "Qwen3ForCausalLM"),
    "GraniteForCausalLM": ("fastllm.models.llama", "GraniteForCausalLM"),
    "GraniteMoeHybridForCausalLM": ("fastllm.models.hybrid", "GraniteMoeHybridForCausalLM"),
    "SmolLM3ForCausalLM": ("fastllm.models.llama", "SmolLM3ForCausalLM"),
    "Olmo2ForCausalLM": ("fastllm.models.llama", "Olmo2ForCausalLM"),
    "Phi3ForCausalLM": ("fastllm.models.llama", "Phi3ForCausalLM"),
    "Gemma2ForCausalLM": ("fastllm.models.gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("fastllm.models.gemma", "Gemma3ForCausalLM"),
    "Gemma3ForConditionalGeneration": ("fastllm.models.gemma", "Gemma3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("fastllm.models.moe", "Qwen3MoeForCausalLM"),
    "Qwen2MoeForCausalLM": ("fastllm.models.moe", "Qwen2MoeForCausalLM"),
    "MixtralForCausalLM": ("fastllm.models.moe", "MixtralForCausalLM"),
    "OlmoeForCausalLM": ("fastllm.models.moe", "OlmoeForCausalLM"),
    "GraniteMoeForCausalLM": ("fastllm.models.moe", "GraniteMoeForCausalLM"),
    "GptOssForCausalLM": ("fastllm.models.moe", "GptOssForCausalLM"),
    "Qwen3_5ForCausalLM": ("fastllm.models.hybrid", "Qwen3_5ForCausalLM"),
    "Qwen3_5ForConditionalGeneration": ("fastllm.models.hybrid", "Qwen3_5ForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("fastllm.models.hybrid", "Qwen3_5MoeForCausalLM"),
    "Qwen3_5MoeForConditionalGeneration": ("fastllm.models.hybrid", "Qwen3_5MoeForCausalLM"),
    "Lfm2ForCausalLM": ("fastllm.models.hybrid", "Lfm2ForCausalLM"),
    "Lfm2MoeForCausalLM": ("fastllm.models.hybrid", "Lfm2MoeForCausalLM"),
    "PhiForCausalLM": ("fastllm.models.phi", "PhiForCausalLM"),
    "GPT2LMHeadModel": ("fastllm.models.gpt2", "GPT2LMHeadModel"),
}


def get_model_class(architecture: str) -> Any:
    """The model class for ``architecture``; a ValueError listing the supported ones."""
    entry = ARCHITECTURES.get(architecture)
    if entry is None:
        raise ValueError(
            f"Unsupported architecture {architecture!r}; supported: {', '.join(ARCHITECTURES)}"
        )
    module, name = entry
    return getattr(importlib.import_module(module), name)
