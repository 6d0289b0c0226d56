"""Gemma 2 and Gemma 3 (text): the Llama layers with Gemma's differences.

* RMSNorm scales by ``1 + w``: the loader adds the 1 once (``WeightSpec.offset``),
  so the layers run the plain RMSNorm kernels.
* The token embeddings are multiplied by sqrt(hidden_size), rounded to the
  model's dtype as the reference does.
* Each block is normalised before *and* after attention and the MLP (four
  norms), and the MLP is GeGLU (tanh GELU, ``hidden_activation``).
* Attention scores are scaled by ``query_pre_attn_scalar ** -0.5``; Gemma 2
  soft-caps them (``attn_logit_softcapping``: ``c * tanh(s / c)``, in the
  attention kernels) and both soft-cap the final logits
  (``final_logit_softcapping``).
* Layers alternate between a sliding window and full attention
  (``ModelConfig.layer_attention_types``: Gemma 2 alternates, Gemma 3 has five local
  layers per global one); Gemma 3 normalises q and k per head and rotates its
  local layers with their own base frequency (``rope_local_base_freq``)
  while only the global layers take the rope scaling.

On the CPU, once packed, every layer runs in one ``_core.DecoderStack`` call
per step (``llama_stack``: the four norms, GeGLU, the soft-caps, the local
layers' rotary tables and their KV group's block tables), bit-identical to
the layers run one by one.

``Gemma3ForConditionalGeneration`` checkpoints run as their text model: the
config's ``text_config`` is read (``config.TEXT_PART_ARCHITECTURES``) and the
weights are found under the language model's prefix; the vision tower is not
read.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from fastllm.config import ModelConfig, rope_of_layer_type
from fastllm.layers import Module
from fastllm.layers.norm import RMSNorm
from fastllm.layers.rotary import RotaryEmbedding
from fastllm.models import llama_stack
from fastllm.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, positive_number
from fastllm.models.weights import WeightSpec

logger = logging.getLogger("fastllm")


class GemmaDecoderLayer(Module):
    """Gemma's block: norms before and after attention and before and after the MLP."""

    def __init__(self, config: ModelConfig, layer: int, flags: dict[str, Any]) -> None:
        super().__init__()
        hf = config.hf
        eps = float(hf.get("rms_norm_eps", 1e-6))
        self.self_attn = LlamaAttention.of(config, layer, flags, eps)
        act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, act, False)
        h = config.hidden_size
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.pre_feedforward_layernorm = RMSNorm(h, eps)
        self.post_feedforward_layernorm = RMSNorm(h, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2: alternating local and global layers, soft-capped attention scores and logits."""

    LAYER_CLASS = GemmaDecoderLayer
    #: The layer classes whose maths ``rust/models/llama.rs`` implements for
    #: Gemma (its four norms, GeGLU, soft-caps, local tables and KV groups).
    FUSED_LAYER_TYPES = (GemmaDecoderLayer, LlamaAttention, (LlamaMLP,))
    #: Whether the family normalises q and k per head (Gemma 3).
    QK_NORM = False

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.final_logit_softcap = positive_number(config.hf, "final_logit_softcapping")
        self.embed_scale = config.hidden_size**0.5
        types = config.layer_attention_types() or ["full_attention"] * config.num_hidden_layers
        #: Layers rotated by ``rotary_local`` (None: every layer by ``rotary``).
        self.local_layers = [t == "sliding_attention" for t in types]
        self.rotary_local: RotaryEmbedding | None = None
        if config.hf.get("text_part_of"):
            # Older multimodal checkpoints put the text model under
            # ``language_model.model``, newer ones under ``model.language_model``.
            self.checkpoint_prefix_aliases = (
                ("model.", "model.language_model."),
                ("model.", "language_model.model."),
                ("lm_head.", "language_model.lm_head."),
            )

    @classmethod
    def _flags(cls, config: ModelConfig) -> dict[str, Any]:
        hf = config.hf
        bias = bool(hf.get("attention_bias", False))
        scalar = positive_number(hf, "query_pre_attn_scalar") or float(config.head_dim)
        return {
            "qkv_bias": bias,
            "o_bias": bias,
            "qk_norm": cls.QK_NORM,
            "attention_scale": scalar**-0.5,
            "logit_softcap": cls._attention_softcap(config),
        }

    @staticmethod
    def _attention_softcap(config: ModelConfig) -> float | None:
        return positive_number(config.hf, "attn_logit_softcapping")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states [T, hidden] of the step's packed tokens."""
        x = self.model.embed_tokens(input_ids)
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        local = cos, sin
        if self.rotary_local is not None:
            local = self.rotary_local.cos_sin(positions, x.dtype)
        if self.decoder_stack is not None:
            llama_stack.run(self.decoder_stack, x, cos, sin, local)
            return self.model.norm(x)
        for layer, is_local in zip(self.model.layers, self.local_layers, strict=True):
            x = layer(x, *(local if is_local else (cos, sin)))
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits, soft-capped where the config says."""
        logits = super().compute_logits(hidden)
        cap = self.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def weight_specs(self) -> dict[str, WeightSpec]:
        """The fused q/k/v and gate/up, and every norm read as ``1 + w``."""
        specs = super().weight_specs()
        for name, module in self.named_modules():
            if isinstance(module, RMSNorm):
                specs[f"{name}.weight"] = WeightSpec((f"{name}.weight",), offset=1.0)
        return specs


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 (text): per-head q/k norms, local layers with their own rotary
    base, rope scaling on the global layers only."""

    QK_NORM = True

    def __init__(self, config: ModelConfig) -> None:
        if config.hf.get("use_bidirectional_attention"):
            raise ValueError(
                "config.json: use_bidirectional_attention (an embedding model) is not supported "
                "by Gemma3ForCausalLM"
            )
        super().__init__(config)
        theta, scaling = rope_of_layer_type(config, "sliding_attention")
        rotary_dim = int(config.head_dim * config.partial_rotary_factor)
        self.rotary_local = RotaryEmbedding(
            config.head_dim, rotary_dim, config.max_position_embeddings, theta, scaling
        )

    @staticmethod
    def _attention_softcap(config: ModelConfig) -> float | None:
        if config.hf.get("attn_logit_softcapping") is not None:
            # As the reference implementation: Gemma 3 does not soft-cap its
            # attention scores (the released configs leave the field null).
            logger.warning(
                "config.json: attn_logit_softcapping is set, but Gemma 3 does not soft-cap "
                "attention scores; ignoring it"
            )
        return None
