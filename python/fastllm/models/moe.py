"""Mixture-of-experts families: Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, gpt-oss
and Granite MoE.

Each is its dense family's decoder (``models/llama.py``) with the MLP of
some or all layers replaced by a ``SparseMoeBlock`` (``layers/moe.py``):

* Qwen3-MoE: Qwen3's attention (per-head q/k norms); layer ``i`` is sparse
  unless it is in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step``;
  dense layers keep an MLP of ``intermediate_size``, experts have
  ``moe_intermediate_size``; ``norm_topk_prob`` renormalises the top-k.
* Qwen2-MoE: Qwen2's attention (q/k/v biases) and Qwen3-MoE's layer rule,
  plus a shared expert (``shared_expert_intermediate_size``) behind a
  sigmoid gate.
* Mixtral: Mistral's attention; every layer sparse, the top-k always
  renormalised; checkpoints name the experts ``w1`` (gate), ``w3`` (up)
  and ``w2`` (down) under ``block_sparse_moe``.
* OLMoE: OLMo 2's attention (RMSNorm over the whole q and k projections),
  optionally clipped (``clip_qkv``), in pre-norm blocks.
* Granite MoE: Granite's multipliers (``models/llama.py``) over Mixtral's
  routing, experts stacked as ``input_linear`` / ``output_linear``.
* gpt-oss: attention with biases and per-head sinks, sliding and full
  layers alternating, every layer sparse with a biased router, experts with
  biases and a clamped SwiGLU (``layers/moe.swiglu_oai``).

Checkpoints store experts one by one (``experts.{j}.gate_proj``) or stacked
in one tensor per layer (``experts.gate_up_proj`` [experts, 2 x inter,
hidden], ``experts.down_proj`` [experts, hidden, inter]); both load.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fastllm.config import ModelConfig
from fastllm.layers.moe import SparseMoeBlock
from fastllm.models.llama import (
    GraniteForCausalLM,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    Olmo2Attention,
)
from fastllm.models.weights import WeightSpec


def _positive_int(hf: dict[str, Any], name: str, default: Any = None) -> int:
    value = hf.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"config.json: {name} must be a positive integer, got {value!r}")
    return value


def moe_flags(config: ModelConfig, intermediate: str, every_layer: bool = False) -> dict[str, Any]:
    """The MoE fields of a config whose expert size is ``intermediate``:
    experts (``num_experts``, or ``num_local_experts`` as transformers 5 and
    Mixtral write it), top-k, expert size, and which layers are sparse
    (``every_layer``, or Qwen's ``mlp_only_layers`` / ``decoder_sparse_step``;
    LFM2-MoE's first ``num_dense_layers`` are dense in any case)."""
    hf = config.hf
    experts = "num_experts" if hf.get("num_experts") is not None else "num_local_experts"
    num_experts = _positive_int(hf, experts)
    step = _positive_int(hf, "decoder_sparse_step", 1)
    dense = hf.get("mlp_only_layers") or []
    if not isinstance(dense, list) or any(not isinstance(i, int) for i in dense):
        raise ValueError(f"config.json: mlp_only_layers must be a list of layers, got {dense!r}")
    first_dense = hf.get("num_dense_layers", 0)
    if not isinstance(first_dense, int) or isinstance(first_dense, bool) or first_dense < 0:
        raise ValueError(
            f"config.json: num_dense_layers must be a non-negative integer, got {first_dense!r}"
        )
    n = config.num_hidden_layers
    return {
        "num_experts": num_experts,
        "top_k": _positive_int(hf, "num_experts_per_tok"),
        "moe_intermediate": _positive_int(hf, intermediate, config.intermediate_size),
        "sparse_layers": tuple(
            i >= first_dense and (every_layer or (i not in dense and (i + 1) % step == 0))
            for i in range(n)
        ),
    }


def mlp_weights_per_token(config: ModelConfig) -> int | None:
    """Weights of the MLPs one token runs through, over all layers, for a
    mixture-of-experts config (its ``top_k`` experts, the shared expert and
    the router of each sparse layer; dense layers whole); None for a dense
    config. What a batch-1 decode step reads of them."""
    hf = config.hf
    if not (hf.get("num_experts") or hf.get("num_local_experts")):
        return None
    size = "moe_intermediate_size" if hf.get("moe_intermediate_size") else "intermediate_size"
    flags = moe_flags(config, size)
    h = config.hidden_size
    shared = int(hf.get("shared_expert_intermediate_size") or 0)
    sparse = (
        flags["top_k"] * 3 * h * flags["moe_intermediate"]
        + (3 * h * shared + h if shared else 0)  # the shared expert and its gate
        + h * flags["num_experts"]
    )
    dense = 3 * h * config.intermediate_size
    return sum(sparse if s else dense for s in flags["sparse_layers"])


def expert_weight_specs(
    block: SparseMoeBlock,
    ours: str,
    theirs: str,
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
) -> dict[str, WeightSpec]:
    """Where a sparse block's router and experts come from: the block is
    ``ours`` in the model, ``theirs`` in the checkpoint, whose experts are
    stored one by one under their gate, up and down ``names``
    (``experts.{j}.gate_proj``), or stacked under ``ours`` as transformers 5
    holds them (``experts.gate_up_proj`` [experts, 2 x inter, hidden],
    ``experts.down_proj`` [experts, hidden, inter]); and a shared expert's
    gate and up, fused."""
    gate, up, down = names
    specs = {
        f"{ours}.gate.weight": WeightSpec(
            (f"{theirs}.gate.weight",), alternatives=(WeightSpec((f"{ours}.gate.weight",)),)
        )
    }
    m = block.experts[0].down_proj.in_features
    for j in range(len(block.experts)):
        e = f"{theirs}.experts.{j}"
        specs[f"{ours}.experts.{j}.gate_up_proj.weight"] = WeightSpec(
            (f"{e}.{gate}.weight", f"{e}.{up}.weight"),
            (m, m),
            alternatives=(WeightSpec((f"{ours}.experts.gate_up_proj",), select=j),),
        )
        specs[f"{ours}.experts.{j}.down_proj.weight"] = WeightSpec(
            (f"{e}.{down}.weight",),
            alternatives=(WeightSpec((f"{ours}.experts.down_proj",), select=j),),
        )
    if block.shared_expert is not None:
        s = f"{theirs}.shared_expert"
        m = block.shared_expert.down_proj.in_features
        specs[f"{ours}.shared_expert.gate_up_proj.weight"] = WeightSpec(
            (f"{s}.gate_proj.weight", f"{s}.up_proj.weight"), (m, m)
        )
    return specs


def is_sparse(flags: dict[str, Any], layer: int) -> bool:
    """Whether layer ``layer``'s MLP is a sparse block (``moe_flags``'
    ``sparse_layers``; a dense family's flags have none)."""
    layers = flags.get("sparse_layers")
    return bool(layers) and bool(layers[layer])


def sparse_block(
    config: ModelConfig, flags: dict[str, Any], act: str | None = None
) -> SparseMoeBlock:
    """The ``SparseMoeBlock`` of a family's ``flags`` (``moe_flags`` plus
    ``renormalize`` and the optional routing fields)."""
    return SparseMoeBlock(
        config.hidden_size,
        flags["moe_intermediate"],
        flags["num_experts"],
        flags["top_k"],
        flags["renormalize"],
        act or config.hf.get("hidden_act", "silu"),
        shared_intermediate=flags.get("shared_intermediate", 0),
        shared_gated=flags.get("shared_gated", True),
        scoring=flags.get("scoring", "softmax"),
        selection_bias=flags.get("selection_bias", False),
        renorm_eps=flags.get("renorm_eps", 0.0),
        scale=flags.get("scale", 1.0),
    )


class MoeDecoderLayer(LlamaDecoderLayer):
    """A Llama-family pre-norm block whose MLP is a ``SparseMoeBlock`` where
    the family's flags say the layer is sparse."""

    def __init__(self, config: ModelConfig, layer: int, flags: dict[str, Any]) -> None:
        super().__init__(config, layer, flags)
        attention = flags.get("attention_class")
        if attention is not None:
            eps = float(config.hf.get("rms_norm_eps", 1e-6))
            self.self_attn = attention(config, layer, flags["qkv_bias"], eps)
        if flags["sparse_layers"][layer]:
            self.mlp = sparse_block(config, flags)


class MoeForCausalLM(LlamaForCausalLM):
    """The shared loader rules of the MoE families (subclasses set ``_flags``)."""

    LAYER_CLASS = MoeDecoderLayer
    #: The layer classes whose maths ``rust/models/llama.rs`` implements
    #: (a layer's MLP dense or sparse; ``llama_stack.FUSED_ARCHITECTURES``
    #: says which families).
    FUSED_LAYER_TYPES = (MoeDecoderLayer, LlamaAttention, (LlamaMLP, SparseMoeBlock))
    #: The checkpoint's module name of the sparse block, and of its experts'
    #: gate, up and down matrices.
    MOE_PREFIX = "mlp"
    EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")

    def weight_specs(self) -> dict[str, WeightSpec]:
        """The Llama family's fused q/k/v and gate/up, and every expert's
        gate/up and down, one by one or from stacked tensors."""
        specs = super().weight_specs()
        for i, layer in enumerate(self.model.layers):
            if isinstance(layer.mlp, SparseMoeBlock):
                specs.update(
                    expert_weight_specs(
                        layer.mlp,
                        f"model.layers.{i}.mlp",
                        f"model.layers.{i}.{self.MOE_PREFIX}",
                        self.EXPERT_NAMES,
                    )
                )
        return specs


class Qwen3MoeForCausalLM(MoeForCausalLM):
    """Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B)."""

    @staticmethod
    def _flags(config: ModelConfig) -> dict[str, Any]:
        bias = bool(config.hf.get("attention_bias", False))
        return {
            "qkv_bias": bias,
            "o_bias": bias,
            "qk_norm": True,
            "mlp_bias": False,
            "renormalize": bool(config.hf.get("norm_topk_prob", False)),
            **moe_flags(config, "moe_intermediate_size"),
        }


class Qwen2MoeForCausalLM(MoeForCausalLM):
    """Qwen1.5-MoE / Qwen2-MoE: q/k/v biases and a gated shared expert."""

    @staticmethod
    def _flags(config: ModelConfig) -> dict[str, Any]:
        hf = config.hf
        return {
            "qkv_bias": bool(hf.get("qkv_bias", True)),
            "o_bias": False,
            "qk_norm": False,
            "mlp_bias": False,
            "renormalize": bool(hf.get("norm_topk_prob", False)),
            "shared_intermediate": int(hf.get("shared_expert_intermediate_size") or 0),
            **moe_flags(config, "moe_intermediate_size"),
        }


class MixtralForCausalLM(MoeForCausalLM):
    """Mixtral 8x7B / 8x22B: every layer sparse, top-k renormalised."""

    MOE_PREFIX = "block_sparse_moe"
    EXPERT_NAMES = ("w1", "w3", "w2")

    @staticmethod
    def _flags(config: ModelConfig) -> dict[str, Any]:
        flags = moe_flags(config, "intermediate_size", every_layer=True)
        return {
            "qkv_bias": False,
            "o_bias": False,
            "qk_norm": False,
            "mlp_bias": False,
            "renormalize": True,
            **flags,
        }


class OlmoeAttention(Olmo2Attention):
    """OLMoE's attention: OLMo 2's whole-projection q/k norms, then q, k and
    v clipped to ``[-clip_qkv, clip_qkv]`` where the config sets it."""

    def __init__(self, config: ModelConfig, layer: int, bias: bool, eps: float) -> None:
        super().__init__(config, layer, bias, eps)
        clip = config.hf.get("clip_qkv")
        if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float))):
            raise ValueError(f"config.json: clip_qkv must be a number or null, got {clip!r}")
        self.clip = None if clip is None else float(clip)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        n = x.shape[0]
        q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        q, k = self.ops.rotary(q, cos, sin), self.ops.rotary(k, cos, sin)
        return self.o_proj(self.attn(q, k, v.contiguous()))


class OlmoeForCausalLM(MoeForCausalLM):
    """OLMoE-1B-7B: 64 experts, 8 active, every layer sparse."""

    @staticmethod
    def _flags(config: ModelConfig) -> dict[str, Any]:
        bias = bool(config.hf.get("attention_bias", False))
        flags = moe_flags(config, "intermediate_size", every_layer=True)
        return {
            "qkv_bias": bias,
            "o_bias": bias,
            "qk_norm": False,
            "mlp_bias": False,
            "attention_class": OlmoeAttention,
            "renormalize": bool(config.hf.get("norm_topk_prob", False)),
            **flags,
        }


class GptOssAttention(LlamaAttention):
    """gpt-oss's attention: Llama's with biases and a learned sink logit per
    head (``sinks``), which joins each softmax denominator with no value."""

    def __init__(self, config: ModelConfig, layer: int, bias: bool, eps: float) -> None:
        super().__init__(config, layer, bias, bias, False, eps)
        self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        if self.attn.sinks is None or self.attn.sinks.device != self.sinks.device:
            self.attn.sinks = self.sinks.detach().float().contiguous()
        return super().forward(x, cos, sin)


class GptOssDecoderLayer(LlamaDecoderLayer):
    """gpt-oss's block: pre-norm attention with sinks (sliding and full
    layers alternate, ``layer_types``) and experts with biases, a biased
    router and the clamped SwiGLU."""

    def __init__(self, config: ModelConfig, layer: int, flags: dict[str, Any]) -> None:
        super().__init__(config, layer, flags)
        hf = config.hf
        eps = float(hf.get("rms_norm_eps", 1e-5))
        self.self_attn = GptOssAttention(config, layer, flags["qkv_bias"], eps)
        self.mlp = SparseMoeBlock(
            config.hidden_size,
            flags["moe_intermediate"],
            flags["num_experts"],
            flags["top_k"],
            True,
            "swiglu_oai",
            router_bias=True,
            expert_bias=True,
            alpha=float(hf.get("swiglu_alpha", 1.702)),
            limit=float(hf.get("swiglu_limit", 7.0)),
        )


class GptOssForCausalLM(MoeForCausalLM):
    """gpt-oss-20b / -120b: experts stacked in the checkpoint as
    ``gate_up_proj`` [experts, hidden, 2 x inter] with gate and up
    interleaved, and ``down_proj`` [experts, inter, hidden], each with a bias;
    or, as the released checkpoints hold them (``quantization_config``'s
    ``quant_method`` "mxfp4"), in MXFP4: ``gate_up_proj_blocks`` /
    ``_scales`` [experts, 2 x inter, hidden / 32, (16)] (rows interleaved
    alike) and ``down_proj_blocks`` / ``_scales`` [experts, hidden, inter /
    32, (16)], which run as stored on the ``mxfp4`` kernel (CPU)."""

    LAYER_CLASS = GptOssDecoderLayer
    #: The layer classes whose maths ``rust/models/llama.rs`` implements.
    FUSED_LAYER_TYPES = (GptOssDecoderLayer, GptOssAttention, (SparseMoeBlock,))

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        #: "mxfp4" when the checkpoint stores the experts quantized.
        self.stored_quantization = "mxfp4" if self._mxfp4(config) else None

    @staticmethod
    def _mxfp4(config: ModelConfig) -> bool:
        """Whether the checkpoint's experts are MXFP4; an error for any other
        ``quantization_config``."""
        quantized = config.hf.get("quantization_config")
        if not isinstance(quantized, dict) or not quantized.get("quant_method"):
            return False
        if quantized["quant_method"] != "mxfp4":
            raise ValueError(
                f"config.json: quantization_config.quant_method "
                f"{quantized['quant_method']!r} is not supported for gpt-oss; expected "
                "'mxfp4' (the released checkpoints' experts) or none (bf16)"
            )
        return True

    @staticmethod
    def _flags(config: ModelConfig) -> dict[str, Any]:
        GptOssForCausalLM._mxfp4(config)
        flags = moe_flags(config, "intermediate_size")
        bias = bool(config.hf.get("attention_bias", True))
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": False, "mlp_bias": False, **flags}

    def weight_specs(self) -> dict[str, WeightSpec]:
        """q/k/v fused; the router under ``router``; each expert's rows of the
        stacked tensors, transposed, gate and up de-interleaved."""
        specs = LlamaForCausalLM.weight_specs(self)
        for i in range(len(self.model.layers)):
            p = f"model.layers.{i}.mlp"
            specs[f"{p}.gate.weight"] = WeightSpec((f"{p}.router.weight",))
            specs[f"{p}.gate.bias"] = WeightSpec((f"{p}.router.bias",))
            for j in range(len(self.model.layers[i].mlp.experts)):
                e, stacked = f"{p}.experts.{j}", f"{p}.experts"
                gate_up = WeightSpec(
                    (f"{stacked}.gate_up_proj",), select=j, transpose=True, deinterleave=True
                )
                down = WeightSpec((f"{stacked}.down_proj",), select=j, transpose=True)
                if self.stored_quantization == "mxfp4":
                    gate_up, down = (
                        WeightSpec(
                            (f"{stacked}.{proj}_blocks", f"{stacked}.{proj}_scales"),
                            select=j,
                            deinterleave=proj == "gate_up_proj",
                            mxfp4=True,
                        )
                        for proj in ("gate_up_proj", "down_proj")
                    )
                specs[f"{e}.gate_up_proj.weight"] = gate_up
                specs[f"{e}.gate_up_proj.bias"] = WeightSpec(
                    (f"{stacked}.gate_up_proj_bias",), select=j, deinterleave=True
                )
                specs[f"{e}.down_proj.weight"] = down
                specs[f"{e}.down_proj.bias"] = WeightSpec((f"{stacked}.down_proj_bias",), select=j)
        return specs


class GraniteMoeForCausalLM(MoeForCausalLM):
    """Granite 3.x MoE (1B-A400M, 3B-A800M): Granite's multipliers on the
    embeddings, attention scores, residual branches and logits; every layer
    sparse, the top-k logits' softmax (the top-k renormalised); experts
    stacked as ``input_linear`` [experts, 2 x inter, hidden] (gate rows
    first) and ``output_linear`` [experts, hidden, inter]."""

    @staticmethod
    def _flags(config: ModelConfig) -> dict[str, Any]:
        flags = moe_flags(config, "intermediate_size", every_layer=True)
        return {**GraniteForCausalLM._flags(config), "renormalize": True, **flags}

    def weight_specs(self) -> dict[str, WeightSpec]:
        """q/k/v fused; the router and each expert's rows of the stacked tensors."""
        specs = LlamaForCausalLM.weight_specs(self)
        for i, layer in enumerate(self.model.layers):
            ours, theirs = f"model.layers.{i}.mlp", f"model.layers.{i}.block_sparse_moe"
            specs[f"{ours}.gate.weight"] = WeightSpec((f"{theirs}.router.layer.weight",))
            for j in range(len(layer.mlp.experts)):
                specs[f"{ours}.experts.{j}.gate_up_proj.weight"] = WeightSpec(
                    (f"{theirs}.input_linear.weight",), select=j
                )
                specs[f"{ours}.experts.{j}.down_proj.weight"] = WeightSpec(
                    (f"{theirs}.output_linear.weight",), select=j
                )
        return specs
