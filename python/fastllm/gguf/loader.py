"""Builds a model from a GGUF file's tensors.

Every tensor is checked first (present, right shape, a type fastllm reads)
and nothing is assigned until every parameter is ready, as for a safetensors
folder. Tensors are read from the file's memory map:

- F32, F16, BF16: float weights, converted to the model's dtype;
- Q8_0, Q4_0, IQ4_NL, Q4_1, MXFP4 (gpt-oss's experts): repacked bit for bit
  into the integer kernels' panels (``_core.QuantizedLinear.from_blocks``),
  never re-quantized (an MXFP4 tensor with a block scale that the kernel's
  f16 scales cannot hold, below 2^-24 or above 2^15, is converted as below);
- Q4_K: its super-blocks rewritten as q4_1 blocks (``_core.gguf_q4_k_to_q4_1``:
  the same codes, every 32 weights' scale and minimum rounded to f16);
- Q5_0, Q5_1, Q5_K, Q6_K: no kernel runs them, so they are
  converted to ``q8_0`` block by block in the core (``_core.gguf_to_q8_0``):
  Q5_0 (and MXFP4) exactly (their weights are a scale times integers in
  -16..15, or MXFP4's power-of-two scale times doubled E2M1 levels),
  the others dequantized and quantized again, the nearest kernel format,
  which loses nothing measurable; a warning names those tensors, the extra
  memory and the error the conversion adds. A fused matrix (q/k/v, gate/up)
  whose parts have different types is converted the same way as a whole.

Mixture-of-experts files stack each layer's experts in one tensor per
matrix (``blk.N.ffn_gate_exps.weight`` [experts, inter, hidden], ``ffn_up_exps``,
``ffn_down_exps`` [experts, hidden, inter]; gpt-oss's biases likewise): each
expert's parameter reads its own run of rows, for a quantized tensor a slice
of the file's blocks handed to the kernels uncopied. Routers stay float (a
quantized one is dequantized).

llama.cpp's converter permutes the rows of Llama-family q and k weights for
its rotary layout; the permutation is undone here (a reordering of whole
block rows, exact for quantized tensors too).

Hybrid recurrent families: Qwen3.5 (``qwen35``) files hold the Gated
DeltaNet's projections apart (``attn_qkv``, ``attn_gate``, ``ssm_beta``,
``ssm_alpha``: fastllm's one ``in_proj``), ``ssm_a`` as ``-exp(A_log)`` (its
log is taken back), the convolution as [channels, taps], every RMSNorm but
``ssm_norm`` as the ``1 + w`` that the model scales by (``w`` is the file's
value minus 1, ``_ONE_PLUS_NORM_ARCHS``), and, where value heads share key heads, the value heads reordered from
grouped by key head to tiled (``_qwen35_v_order``): rows of the projections,
the convolution's value channels and ``out_proj``'s columns are put back,
whole kernel blocks for a quantized ``out_proj`` (the head size a multiple
of 32), else through q8_0. LFM2 (``lfm2``) files hold the short
convolution as [channels, taps] and the final norm as ``token_embd_norm``.

After the first load of a file its quantized matrices are cached on disk in
the kernels' layout, and later loads map them instead (``gguf/cache.py``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch import nn

from fastllm import _core
from fastllm.config import ModelConfig
from fastllm.gguf.cache import PanelCache, cache_dir
from fastllm.gguf.reader import GGUFError, GGUFFile, TensorInfo, readonly_tensor
from fastllm.layers import load_dtype
from fastllm.layers.linear import Embedding, Linear, adopt_packed_head
from fastllm.layers.moe import Router, SparseMoeBlock
from fastllm.layers.norm import ZeroCenteredRMSNorm
from fastllm.models import get_model_class
from fastllm.models.weights import WeightSpec

logger = logging.getLogger("fastllm")

FLOAT_TYPES = ("F32", "F16", "BF16")
# GGUF type -> the kernel format that runs it as it is.
KERNEL_TYPES = {
    "Q8_0": "q8_0",
    "Q4_0": "q4_0",
    "IQ4_NL": "iq4_nl",
    "Q4_1": "q4_1",
    "MXFP4": "mxfp4",
}
# Q4_K super-blocks are rewritten as q4_1 blocks: the same codes, each
# sub-block's scale and minimum rounded to f16.
REWRITTEN_TYPES = {"Q4_K": "q4_1"}
# GGUF types without a kernel: converted to this format, exactly for the
# types whose weights are a scale times int8 codes (``EXACT_TYPES``, as
# ``rust/quant/gguf.rs: converts_exactly``), otherwise dequantized and
# quantized again.
CONVERTED_TYPES = ("Q5_0", "Q5_1", "Q5_K", "Q6_K")
CONVERSION_FORMAT = "q8_0"
EXACT_TYPES = ("Q8_0", "Q4_0", "IQ4_NL", "Q5_0", "MXFP4")
SUPPORTED_TYPES = FLOAT_TYPES + tuple(KERNEL_TYPES) + tuple(REWRITTEN_TYPES) + CONVERTED_TYPES

_LLAMA_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_LLAMA_GLOBAL = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
}
# The sparse blocks' routers and Qwen2-MoE's shared expert (the experts
# themselves: ``_expert_sources``).
_MOE_LAYER = {
    **_LLAMA_LAYER,
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
# gpt-oss's norm before the experts; its attention sinks (``_PARAM_NAMES``).
_GPT_OSS_LAYER = {**_MOE_LAYER, "post_attention_layernorm": "post_attention_norm"}
# Per-layer parameters named whole: fastllm's name -> GGUF's.
_PARAM_NAMES = {
    "self_attn.sinks": "attn_sinks.weight",
    "linear_attn.A_log": "ssm_a",  # stored as -exp(A_log)
    "linear_attn.dt_bias": "ssm_dt.bias",
    "feed_forward.expert_bias": "exp_probs_b.bias",  # LFM2-MoE's selection bias
    "mamba.A_log": "ssm_a",  # stored as -exp(A_log)
    "mamba.dt_bias": "ssm_dt.bias",
    "mamba.D": "ssm_d",
}
# Gemma's four norms per block and OLMo 2's two post-norms.
_GEMMA_LAYER = {
    **_LLAMA_LAYER,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_OLMO2_LAYER = {
    **{k: v for k, v in _LLAMA_LAYER.items() if k != "input_layernorm"},
    "post_attention_layernorm": "post_attention_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
# Phi-3 stores q/k/v and gate/up fused, as its checkpoints do.
_PHI3_LAYER = {
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
# Qwen3.5: gated attention layers (q_proj yields each head's query and gate,
# as the checkpoint stores it) and Gated DeltaNet layers, whose in_proj is
# four tensors in the file; the norm after the mixer is ``post_attention_norm``.
_QWEN35_LAYER = {
    **{k: v for k, v in _LLAMA_LAYER.items() if k != "post_attention_layernorm"},
    "post_attention_layernorm": "post_attention_norm",
    "linear_attn.in_proj_qkv": "attn_qkv",
    "linear_attn.in_proj_z": "attn_gate",
    "linear_attn.in_proj_b": "ssm_beta",
    "linear_attn.in_proj_a": "ssm_alpha",
    "linear_attn.conv1d": "ssm_conv1d",
    "linear_attn.norm": "ssm_norm",
    "linear_attn.out_proj": "ssm_out",
}
# Qwen3.5-MoE: Qwen3.5's layers, the sparse blocks' routers and shared expert.
_QWEN35MOE_LAYER = {
    **_QWEN35_LAYER,
    **{k: v for k, v in _MOE_LAYER.items() if k.startswith("mlp.")},
}
# LFM2, by its checkpoints' names (``Lfm2ForCausalLM.weight_specs``).
_LFM2_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.out_proj": "attn_output",
    "self_attn.q_layernorm": "attn_q_norm",
    "self_attn.k_layernorm": "attn_k_norm",
    "operator_norm": "attn_norm",
    "ffn_norm": "ffn_norm",
    "feed_forward.w1": "ffn_gate",
    "feed_forward.w3": "ffn_up",
    "feed_forward.w2": "ffn_down",
    "conv.in_proj": "shortconv.in_proj",
    "conv.conv": "shortconv.conv",
    "conv.out_proj": "shortconv.out_proj",
}
# LFM2-MoE: LFM2's layers and the sparse blocks' routers (the selection
# bias: ``_PARAM_NAMES``).
_LFM2MOE_LAYER = {**_LFM2_LAYER, "feed_forward.gate": "ffn_gate_inp"}
# Granite 4.0's hybrids: Granite's attention, Mamba-2 layers, and the dense MLP
# as a dense MLP's or (with experts) a shared expert's tensors, the routers.
_GRANITE_HYBRID_LAYER = {
    **_MOE_LAYER,
    "mamba.in_proj": "ssm_in",
    "mamba.conv1d": "ssm_conv1d",
    "mamba.norm": "ssm_norm",
    "mamba.out_proj": "ssm_out",
}
_LFM2_GLOBAL = {
    "model.embed_tokens": "token_embd",
    "model.embedding_norm": "token_embd_norm",  # the final norm
    "lm_head": "output",
}
# general.architecture -> (global names, per-layer names, the layers' prefix in fastllm)
_NAMES: dict[str, tuple[dict[str, str], dict[str, str], str]] = {
    "llama": (_LLAMA_GLOBAL, _MOE_LAYER, "model.layers"),  # Mixtral too
    "qwen2": (_LLAMA_GLOBAL, _LLAMA_LAYER, "model.layers"),
    "qwen3": (_LLAMA_GLOBAL, _LLAMA_LAYER, "model.layers"),
    "granite": (_LLAMA_GLOBAL, _LLAMA_LAYER, "model.layers"),
    "granitemoe": (_LLAMA_GLOBAL, _MOE_LAYER, "model.layers"),
    "smollm3": (_LLAMA_GLOBAL, _LLAMA_LAYER, "model.layers"),
    "olmo2": (_LLAMA_GLOBAL, _OLMO2_LAYER, "model.layers"),
    "gemma2": (_LLAMA_GLOBAL, _GEMMA_LAYER, "model.layers"),
    "gemma3": (_LLAMA_GLOBAL, _GEMMA_LAYER, "model.layers"),
    "phi3": (_LLAMA_GLOBAL, _PHI3_LAYER, "model.layers"),
    "qwen3moe": (_LLAMA_GLOBAL, _MOE_LAYER, "model.layers"),
    "qwen2moe": (_LLAMA_GLOBAL, _MOE_LAYER, "model.layers"),
    "olmoe": (_LLAMA_GLOBAL, _MOE_LAYER, "model.layers"),
    "gpt-oss": (_LLAMA_GLOBAL, _GPT_OSS_LAYER, "model.layers"),
    "qwen35": (_LLAMA_GLOBAL, _QWEN35_LAYER, "model.layers"),
    "qwen35moe": (_LLAMA_GLOBAL, _QWEN35MOE_LAYER, "model.layers"),
    "lfm2": (_LFM2_GLOBAL, _LFM2_LAYER, "model.layers"),
    "lfm2moe": (_LFM2_GLOBAL, _LFM2MOE_LAYER, "model.layers"),
    "granitehybrid": (_LLAMA_GLOBAL, _GRANITE_HYBRID_LAYER, "model.layers"),
    "phi2": (
        {
            "model.embed_tokens": "token_embd",
            "model.final_layernorm": "output_norm",
            "lm_head": "output",
        },
        {
            "self_attn.q_proj": "attn_q",
            "self_attn.k_proj": "attn_k",
            "self_attn.v_proj": "attn_v",
            "self_attn.dense": "attn_output",
            "input_layernorm": "attn_norm",
            "mlp.fc1": "ffn_up",
            "mlp.fc2": "ffn_down",
        },
        "model.layers",
    ),
    "gpt2": (
        {
            "transformer.wte": "token_embd",
            "transformer.wpe": "position_embd",
            "transformer.ln_f": "output_norm",
            "lm_head": "output",
        },
        {
            "ln_1": "attn_norm",
            "attn.c_attn": "attn_qkv",
            "attn.c_proj": "attn_output",
            "ln_2": "ffn_norm",
            "mlp.c_fc": "ffn_up",
            "mlp.c_proj": "ffn_down",
        },
        "transformer.h",
    ),
}
# llama.cpp's converter permutes these families' q/k rows into its
# interleaved rotary layout (the others rotate neox-style, rows as stored).
_PERMUTED_ARCHS = ("llama", "granite", "granitemoe", "smollm3", "granitehybrid")


def gguf_name(arch: str, name: str) -> str | None:
    """The GGUF tensor name of fastllm's / Hugging Face's tensor ``name``."""
    global_names, layer_names, prefix = _NAMES[arch]
    module, _, kind = name.rpartition(".")
    if module in global_names:
        return f"{global_names[module]}.{kind}"
    whole = re.fullmatch(re.escape(prefix) + r"\.(\d+)\.(.+)", name)
    if whole and whole.group(2) in _PARAM_NAMES:
        return f"blk.{whole.group(1)}.{_PARAM_NAMES[whole.group(2)]}"
    m = re.fullmatch(re.escape(prefix) + r"\.(\d+)\.(.+)", module)
    if m and m.group(2) in layer_names:
        return f"blk.{m.group(1)}.{layer_names[m.group(2)]}.{kind}"
    return None


# One expert's parameter in fastllm.
_EXPERT = re.compile(
    r"(.+)\.(\d+)\.(?:mlp|feed_forward)\.experts\.(\d+)\.(gate_up_proj|down_proj)\.(weight|bias)"
)


def _expert_sources(
    gguf: GGUFFile, name: str, shape: tuple[int, ...]
) -> list[tuple[str, tuple[int, ...], int]] | None:
    """The stacked GGUF tensors of expert parameter ``name`` (None for any
    other parameter): (tensor, the shape of one expert's part, the expert).
    gate/up is ``ffn_gate_exps`` then ``ffn_up_exps`` (gpt-oss's converter
    de-interleaves them so), or one ``ffn_gate_up_exps`` tensor where the
    converter fused them."""
    m = _EXPERT.fullmatch(name)
    if m is None:
        return None
    _, layer, j, proj, kind = m.groups()
    blk, expert = f"blk.{layer}", int(j)
    if proj == "down_proj":
        return [(f"{blk}.ffn_down_exps.{kind}", shape, expert)]
    fused = f"{blk}.ffn_gate_up_exps.{kind}"
    if fused in gguf.tensors:
        return [(fused, shape, expert)]
    half = (shape[0] // 2, *shape[1:])
    return [
        (f"{blk}.ffn_gate_exps.{kind}", half, expert),
        (f"{blk}.ffn_up_exps.{kind}", half, expert),
    ]


@dataclass(frozen=True)
class _Source:
    """A GGUF tensor, or expert ``expert``'s part of a stacked expert tensor
    (its ``shape`` and ``rows`` are that part's); ``row_order`` / ``col_order``:
    the file's row / column of each of fastllm's (None: as stored)."""

    info: TensorInfo
    expert: int | None = None
    row_order: np.ndarray | None = field(default=None, compare=False)
    col_order: np.ndarray | None = field(default=None, compare=False)

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def type(self) -> Any:
        return self.info.type

    @property
    def shape(self) -> tuple[int, ...]:
        return self.info.shape if self.expert is None else self.info.shape[1:]

    @property
    def rows(self) -> int:
        return int(np.prod(self.shape[:-1], dtype=np.int64)) if len(self.shape) > 1 else 1


@dataclass
class _Param:
    """One parameter of the model and the GGUF tensors it is made of."""

    name: str
    shape: tuple[int, ...]
    sources: list[_Source]
    # what the converter did to the values, undone on the float tensor (Qwen3.5's A_log)
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None

    @property
    def quantized(self) -> bool:
        return any(s.type.name not in FLOAT_TYPES for s in self.sources)


@dataclass
class LoadReport:
    """What the load did, for ``repr``, ``fastllm env`` and ``/v1/models``."""

    tensor_types: dict[str, int]  # GGUF type -> tensors of that type in the file
    converted: dict[str, int] = field(default_factory=dict)  # GGUF type -> tensors converted
    # kernel-type tensors converted too, being fused into one matrix with converted ones
    fused_with: dict[str, int] = field(default_factory=dict)
    rewritten: dict[str, int] = field(default_factory=dict)  # Q4_K -> q4_1 tensors
    # tensors converted to q8_0 exactly (the same weights), by type
    exact: dict[str, int] = field(default_factory=dict)
    # quantized tensors whose columns move within blocks (Qwen3.5's tiled
    # value heads in ``ssm_out``), dequantized, reordered and quantized to q8_0
    reordered: dict[str, int] = field(default_factory=dict)
    quantized_bytes: int = 0
    # the packed-weight cache file (``gguf/cache.py``), and whether every
    # quantized matrix was mapped from it
    cache: str | None = None
    from_cache: bool = False
    # tensors counted above (a stacked expert tensor feeds every expert's matrix)
    counted: set[str] = field(default_factory=set, repr=False)

    def count(self, counts: dict[str, int], source: _Source) -> None:
        """Counts ``source``'s tensor in ``counts`` by its type, once per tensor."""
        if source.name not in self.counted:
            self.counted.add(source.name)
            counts[source.type.name] = counts.get(source.type.name, 0) + 1

    def summary(self, path: str) -> dict[str, Any]:
        """The engine's ``gguf`` info (JSON-ready): the file, its tensor types and
        what was converted (``fastllm.gguf.describe_tensor_types`` words it)."""
        return {
            "file": path,
            "tensor_types": self.tensor_types,
            "converted": _sum_counts(self.converted, self.fused_with, self.reordered),
            "rewritten": self.rewritten,
            "exact": self.exact,
            "cache": self.cache,
            "from_cache": self.from_cache,
        }


def _sum_counts(*counts: dict[str, int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in counts:
        for kind, n in c.items():
            out[kind] = out.get(kind, 0) + n
    return out


def _plan(model: nn.Module, gguf: GGUFFile, arch: str, config: ModelConfig) -> list[_Param]:
    specs: dict[str, WeightSpec] = model.weight_specs()
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    # Routers read under their own names; the experts of each sparse block.
    modules = dict(model.named_modules())
    routers = {n for n, m in modules.items() if isinstance(m, Router)}
    num_experts = {n: m.num_experts for n, m in modules.items() if isinstance(m, SparseMoeBlock)}
    plan = []
    for pname, param in model.named_parameters():
        shape = tuple(param.shape)
        experts = _expert_sources(gguf, pname, shape)
        if experts is not None:
            n = num_experts[pname.split(".experts.")[0]]
            sources = [_source(gguf, name, s, j, n) for name, s, j in experts]
            plan.append(_Param(pname, shape, sources))
            continue
        spec = specs.get(pname, WeightSpec((pname,)))
        if pname.rpartition(".")[0] in routers:
            spec = WeightSpec((pname,))
        spec = _file_spec(gguf, arch, spec)
        names = [gguf_name(arch, s) for s in spec.sources]
        # GGUF stores every matrix [out, in]: GPT-2's transposed checkpoints included.
        shapes = WeightSpec(spec.sources, spec.splits).source_shapes(shape)
        if len(names) == 3 and all(n is not None for n in names) and names[0] not in gguf.tensors:
            fused = names[0].replace(".attn_q.", ".attn_qkv.")
            if fused in gguf.tensors:  # q, k and v stored as one tensor
                names, shapes = [fused], [shape]
        labels = spec.sources if len(names) == len(spec.sources) else (pname,)
        sources = []
        for label, name, want in zip(labels, names, shapes, strict=True):
            if name is None:
                raise GGUFError(f"{gguf.path}: no GGUF tensor is known for {label!r} ({arch})")
            source = _source(gguf, name, tuple(want))
            kind = name.split(".")[-2]
            if arch in _PERMUTED_ARCHS and kind in heads:
                n = source.shape[0]  # a matrix's rows, or a bias's values
                source = replace(source, row_order=_unpermute_rows(n, heads[kind]))
            elif arch in ("qwen35", "qwen35moe"):
                rows, cols = _qwen35_v_order(label, modules)
                source = replace(source, row_order=rows, col_order=cols)
            sources.append(source)
        transform = None
        if pname.endswith((".linear_attn.A_log", ".mamba.A_log")):
            transform = _a_log_from_ssm_a(gguf.path, sources[0].name)
        elif arch in _ONE_PLUS_NORM_ARCHS and isinstance(
            modules.get(pname.rpartition(".")[0]), ZeroCenteredRMSNorm
        ):
            transform = _minus_one  # the file's 1 + w, the module's w
        plan.append(_Param(pname, shape, sources, transform))
    return plan


def _file_spec(gguf: GGUFFile, arch: str, spec: WeightSpec) -> WeightSpec:
    """``spec``, or the first of its ``alternatives`` the file has (Granite
    4.0's dense MLP, stored as a checkpoint's ``input_linear`` but as gate
    and up apart in a file); else the first the file's names cover, so that
    a missing tensor is named."""
    candidates = (spec, *spec.alternatives)
    names = [[gguf_name(arch, s) for s in c.sources] for c in candidates]
    for candidate, known in zip(candidates, names, strict=True):
        if all(n is not None and n in gguf.tensors for n in known):
            return candidate
    for candidate, known in zip(candidates, names, strict=True):
        if all(n is not None for n in known):
            return candidate
    return spec


def _qwen35_v_order(label: str, modules: dict[str, nn.Module]) -> tuple[Any, Any]:
    """(rows, columns) of Qwen3.5's tensor ``label`` (a checkpoint name) in the
    file, for each of fastllm's: where value heads share key heads, the
    converter reorders the value heads from grouped by key head (``[k0v0,
    k0v1, k1v0, k1v1]``, as the checkpoint and fastllm have them) to tiled
    (``[k0v0, k1v0, k0v1, k1v1]``), in every tensor of the DeltaNet layer
    with a value-head axis: the value rows of q/k/v and its convolution's
    channels, z, b, a, A_log, dt_bias, and out_proj's columns."""
    prefix, _, kind = label.partition(".linear_attn.")
    layer = modules.get(prefix + ".linear_attn")
    if not kind or layer is None:
        return None, None
    hk, hv = layer.num_k_heads, layer.num_v_heads
    if hk == hv:
        return None, None

    def grouped(dim: int) -> np.ndarray:
        # fastllm's value head k*rep + r is the file's head r*hk + k
        return np.arange(hv * dim).reshape(hv // hk, hk, dim).transpose(1, 0, 2).reshape(-1)

    if kind in ("in_proj_qkv.weight", "conv1d.weight"):
        qk = 2 * layer.key_dim
        return np.concatenate([np.arange(qk), qk + grouped(layer.head_v_dim)]), None
    if kind == "in_proj_z.weight":
        return grouped(layer.head_v_dim), None
    if kind in ("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias"):
        return grouped(1), None
    if kind == "out_proj.weight":
        return None, grouped(layer.head_v_dim)
    return None, None


# Families whose converter stores each ``1 + w``-scaled RMSNorm as ``1 + w``
# (Gemma's, Qwen3.5's but its DeltaNet output norm): read as stored by an
# ``RMSNorm``; a ``ZeroCenteredRMSNorm``, which holds ``w``, gets the file's value
# minus 1 (in float32, exact for any scale of at least 0.5: the ``1 + w`` it
# computes is then the file's value again).
_ONE_PLUS_NORM_ARCHS = ("gemma2", "gemma3", "qwen35", "qwen35moe")


def _minus_one(t: torch.Tensor) -> torch.Tensor:
    return t - 1


def _a_log_from_ssm_a(path: str, name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """``A_log`` from the file's ``ssm_a = -exp(A_log)``, which must be negative."""

    def undo(t: torch.Tensor) -> torch.Tensor:
        if not bool((t < 0).all()):
            raise GGUFError(
                f"{path}: tensor {name!r} holds -exp(A_log), which is negative, "
                f"got {t.flatten().tolist()}"
            )
        return torch.log(-t.double()).to(t.dtype)

    return undo


def _source(
    gguf: GGUFFile,
    name: str,
    shape: tuple[int, ...],
    expert: int | None = None,
    num_experts: int = 0,
) -> _Source:
    """Tensor ``name`` checked: present, of ``shape`` (with ``num_experts``
    stacked before it when it is expert ``expert``'s part), of a type fastllm
    reads, quantized only as a matrix (or a stack of experts' matrices)."""
    info = gguf.tensors.get(name)
    if info is None:
        raise GGUFError(f"{gguf.path}: tensor {name!r} is missing")
    want = shape if expert is None else (num_experts, *shape)
    # A parameter with axes of 1 may be stored without them: Qwen2-MoE's [1, n]
    # shared-expert gate 1-D, a depthwise convolution's [C, 1, K] as [C, K].
    squeezed = tuple(d for d in want if d != 1)
    # A vector may be stored as a matrix of its groups (Mamba-2's group norm).
    grouped = len(want) == 1 and int(np.prod(info.shape)) == want[0]
    flat = expert is None and info.shape != want and (info.shape == squeezed or grouped)
    if info.shape != want and not flat:
        raise GGUFError(
            f"{gguf.path}: tensor {name!r} has shape {list(info.shape)}, expected {list(want)}"
        )
    if info.type.name not in SUPPORTED_TYPES:
        raise GGUFError(
            f"{gguf.path}: tensor {name!r} has type {info.type.name}, which fastllm does not "
            f"read; supported: {', '.join(SUPPORTED_TYPES)}"
        )
    if info.type.name not in FLOAT_TYPES and len(want) - (expert is not None) != 2:
        raise GGUFError(
            f"{gguf.path}: tensor {name!r} is a {len(info.shape)}-D {info.type.name} tensor; "
            "only matrices may be quantized"
        )
    return _Source(info, expert)


def _unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """Row order that turns llama.cpp's interleaved rotary rows back into halves."""
    head_dim = rows // heads
    return np.arange(rows).reshape(heads, head_dim // 2, 2).transpose(0, 2, 1).reshape(-1)


def _blocks(gguf: GGUFFile, source: _Source) -> torch.Tensor:
    """A tensor's bytes (one expert's part of a stacked one) as a flat uint8
    CPU tensor, rows in fastllm's order (``row_order``); it views the file's
    mapping (read-only) unless its rows were reordered."""
    data = gguf.data(source.name)
    if source.expert is not None:  # each expert's rows lie together: whole blocks
        size = len(data) // source.info.shape[0]
        data = data[source.expert * size : (source.expert + 1) * size]
    if source.row_order is not None:
        n = source.shape[0] if len(source.shape) == 1 else source.rows  # a bias: one value a row
        data = data.reshape(n, -1)[source.row_order].reshape(-1)
    return readonly_tensor(data)


# Values of one block of every kernel format (``rust/quant``).
KERNEL_BLOCK = 32


def _block_order(cols: np.ndarray) -> np.ndarray | None:
    """The order of whole kernel blocks (``KERNEL_BLOCK`` columns) that the
    column order ``cols`` is, or None when it moves columns within a block."""
    if cols.size % KERNEL_BLOCK:
        return None
    groups = cols.reshape(-1, KERNEL_BLOCK)
    starts = groups[:, 0]
    if (starts % KERNEL_BLOCK).any() or (groups != starts[:, None] + np.arange(KERNEL_BLOCK)).any():
        return None
    return starts // KERNEL_BLOCK


def _reorder_blocks(blocks: torch.Tensor, rows: int, cols: np.ndarray | None) -> torch.Tensor:
    """Kernel-format blocks (each row's blocks together) with each row's blocks
    in the order of ``cols`` (a whole-block column order, ``_block_order``)."""
    if cols is None:
        return blocks
    order = torch.from_numpy(_block_order(cols))
    return blocks.reshape(rows, order.numel(), -1)[:, order].reshape(-1).contiguous()


_FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _float_tensor(gguf: GGUFFile, source: _Source) -> torch.Tensor:
    """A float tensor (any GGUF type) as a CPU tensor owning its memory: its own
    float type, or float32 dequantized; rows and columns in fastllm's order."""
    raw = _blocks(gguf, source)
    if source.type.name in FLOAT_TYPES:
        out = raw.view(_FLOAT_DTYPES[source.type.name]).reshape(source.shape).clone()
    else:
        out = torch.empty(source.shape, dtype=torch.float32)
        _core.dequantize_gguf(raw, source.type.name, out)
    if source.col_order is not None:
        out = out[..., torch.from_numpy(source.col_order)].contiguous()
    return out


def _split_blocks(param: _Param) -> bool:
    """Whether a quantized source's columns must move within its kernel blocks
    (then the matrix is converted through float)."""
    return any(
        s.col_order is not None
        and s.type.name not in FLOAT_TYPES
        and _block_order(s.col_order) is None
        for s in param.sources
    )


def _kernel_format(param: _Param, report: LoadReport) -> tuple[str, bool]:
    """The kernel format the parameter runs in, and whether its sources go in as
    stored (else they are converted); counts what its sources become."""
    formats = {
        KERNEL_TYPES.get(s.type.name) or REWRITTEN_TYPES.get(s.type.name) for s in param.sources
    }
    if _split_blocks(param):
        for s in param.sources:
            if s.type.name not in FLOAT_TYPES:
                report.count(report.reordered, s)
        return CONVERSION_FORMAT, False
    if len(formats) == 1 and None not in formats:
        for s in param.sources:
            if s.type.name in REWRITTEN_TYPES:
                report.count(report.rewritten, s)
        return formats.pop(), True
    # No kernel for a source's type, or a mix of types in one fused matrix.
    exact = all(s.type.name in EXACT_TYPES for s in param.sources)
    for s in param.sources:
        if exact:
            counts = report.exact
        elif s.type.name in KERNEL_TYPES:
            counts = report.fused_with
        else:
            counts = report.converted
        report.count(counts, s)
    return CONVERSION_FORMAT, False


def _quantized(
    gguf: GGUFFile,
    param: _Param,
    bias: torch.Tensor | None,
    report: LoadReport,
    cache: PanelCache | None = None,
) -> object:
    """A ``_core.QuantizedLinear`` of the parameter's sources (its panels from
    ``cache`` when the cache file has them)."""
    fmt, as_stored = _kernel_format(param, report)
    out_features, in_features = param.shape
    b = None if bias is None else bias.float().contiguous()
    if cache is not None:
        table = cache.table(param.name, fmt, out_features, in_features, b)
        if table is not None:
            return table
    if as_stored:
        parts = []
        for s in param.sources:
            blocks = _blocks(gguf, s)
            if s.type.name in REWRITTEN_TYPES:
                rewritten = torch.empty(blocks.numel() // 144 * 160, dtype=torch.uint8)
                _core.gguf_q4_k_to_q4_1(blocks, rewritten)
                blocks = rewritten
            parts.append(_reorder_blocks(blocks, s.rows, s.col_order))
        # The parts of a fused matrix (q, k, v) go in as they are, uncopied.
        try:
            return _core.QuantizedLinear.from_blocks(parts, out_features, in_features, fmt, b)
        except ValueError:
            if fmt != "mxfp4":
                raise
            # A block scale no f16 holds: converted exactly to q8_0 below.
            for s in param.sources:
                report.count(report.exact, s)
    if _split_blocks(param) or any(s.type.name in FLOAT_TYPES for s in param.sources):
        weight = torch.cat([_float_tensor(gguf, s).float() for s in param.sources])
        return _core.QuantizedLinear(weight, b, format=CONVERSION_FORMAT)
    # Block by block in the core: the same q8_0 blocks as dequantizing the
    # whole matrix and quantizing it, without the float copy.
    parts = []
    for s in param.sources:
        blocks = _blocks(gguf, s)
        if s.type.name != "Q8_0":
            q8 = torch.empty(s.rows * (s.shape[-1] // 32) * 34, dtype=torch.uint8)
            _core.gguf_to_q8_0(blocks, s.type.name, q8)
            blocks = q8
        parts.append(_reorder_blocks(blocks, s.rows, s.col_order))
    return _core.QuantizedLinear.from_blocks(parts, out_features, in_features, CONVERSION_FORMAT, b)


def load_gguf_model(
    config: ModelConfig, gguf: GGUFFile, dtype: torch.dtype, device: str | torch.device
) -> tuple[nn.Module, LoadReport]:
    """The model of ``config`` with its weights from ``gguf``; float tensors in ``dtype``."""
    from fastllm.gguf.config import architecture
    from fastllm.layers.ops import bind_ops, select_ops

    arch = architecture(gguf)
    device = torch.device(device)
    cls = get_model_class(config.architecture)
    with torch.device("meta"):
        model = cls(config)
    plan = _plan(model, gguf, arch, config)
    report = LoadReport(tensor_types={})
    for info in gguf.tensors.values():
        report.tensor_types[info.type.name] = report.tensor_types.get(info.type.name, 0) + 1
    modules = dict(model.named_modules())
    # Routers stay float: a quantized one is dequantized with the float tensors.
    quantized = [
        p
        for p in plan
        if p.quantized and not isinstance(modules.get(p.name.rpartition(".")[0]), Router)
    ]
    if quantized and device.type != "cpu":
        raise ValueError(
            f"{gguf.path}: quantized GGUF tensors ({quantized[0].sources[0].type.name}, ...) run on "
            f"the CPU's integer kernels, not on device {str(device)!r}: pass device='cpu'"
        )
    owners: dict[str, nn.Module] = {}
    for p in quantized:
        module_name = p.name.rpartition(".")[0]
        module = modules.get(module_name)
        if not isinstance(module, (Linear, Embedding)) or not p.name.endswith(".weight"):
            raise GGUFError(
                f"{gguf.path}: tensor {p.sources[0].name!r} is quantized "
                f"({p.sources[0].type.name}), which fastllm supports only for matrices of "
                "linear layers and embeddings"
            )
        owners[p.name] = module

    # Every tensor is read before anything is assigned to the model.
    state: dict[str, torch.Tensor] = {}
    for p in plan:
        if p.name in owners:
            continue
        parts = [_float_tensor(gguf, s) for s in p.sources]
        t = parts[0] if len(parts) == 1 else torch.cat(parts)
        if p.transform is not None:
            t = p.transform(t)
        pdtype = load_dtype(model, p.name, dtype)
        state[p.name] = t.reshape(p.shape).to(device=device, dtype=pdtype).contiguous()
    directory = cache_dir() if quantized else None
    cache = PanelCache(gguf.path, directory) if directory is not None else None
    tables: dict[str, object] = {}
    for p in quantized:
        bias_name = p.name[: -len("weight")] + "bias"
        module = owners[p.name]
        bias = state.get(bias_name) if isinstance(module, Linear) else None
        table = _quantized(gguf, p, bias, report, cache)
        tables[p.name] = table
        report.quantized_bytes += table.nbytes

    head_name = _head_weight_name(model)
    head_bias = model.head_weights()[1]
    if head_name in tables and head_bias is not None and head_name != "lm_head.weight":
        # A tied head with a bias of its own (phi): the head's table carries it.
        p = next(p for p in quantized if p.name == head_name)
        head_table = _quantized(gguf, p, state["lm_head.bias"], report, cache)
    else:
        head_table = tables.get(head_name)
    # The quantized modules adopt their tables (their weights are not in ``state``).
    for pname, module in owners.items():
        if isinstance(module, Linear):
            module.pack(tables[pname])
        else:
            module.quantize(tables[pname], dtype)
    model.load_state_dict(state, strict=True, assign=True)
    if head_table is not None:
        adopt_packed_head(model, head_table)
    bind_ops(model, select_ops(device, dtype))
    if cache is not None:
        report.cache, report.from_cache = cache.path, cache.misses == 0
        if cache.misses:
            cache.write_in_background(tables)
        else:
            logger.info("%s: packed weights mapped from the cache %s", gguf.path, cache.path)
    _log_conversions(gguf.path, report)
    return model.eval(), report


def _log_conversions(path: str, report: LoadReport) -> None:
    """What the load converted: logged (exact conversions), or a warning
    naming the memory and rounding it costs."""
    exact = {k: n for k, n in report.exact.items() if k != "MXFP4"}
    if "MXFP4" in report.exact:
        logger.warning(
            "%s: %d MXFP4 tensor(s) hold block scales outside what the mxfp4 kernel's f16 "
            "scales hold (2^-24 to 2^15); converted them to q8_0 at load, exactly where an "
            "f16 holds the scale (each block's power-of-two scale and E2M1 codes), "
            "8.5 bits per weight in memory instead of 4.25",
            path,
            report.exact["MXFP4"],
        )
    if exact:
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(exact.items()))
        logger.info(
            "%s: %s tensor(s) run on the q8_0 kernel, converted exactly (the same weights; "
            "8.5 bits per weight in memory)",
            path,
            kinds,
        )
    if report.reordered:
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(report.reordered.items()))
        logger.warning(
            "%s: %s tensor(s) hold columns in another order than fastllm's, which moves "
            "columns within quantized blocks (value heads not a multiple of 32); dequantized, "
            "reordered and quantized to q8_0 at load (8.5 bits per weight in memory; the "
            "rounding adds an error of at most 1/254 of each group's largest weight)",
            path,
            kinds,
        )
    if report.rewritten:
        logger.warning(
            "%s: %d Q4_K tensor(s) run as q4_1 (the same 4-bit codes; each 32 weights' scale "
            "and minimum rounded to f16, a relative change of at most 2^-11; 5.0 bits per "
            "weight in memory instead of 4.5)",
            path,
            report.rewritten["Q4_K"],
        )
    if report.converted or report.fused_with:
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(report.converted.items()))
        fused = ", ".join(f"{n} {k}" for k, n in sorted(report.fused_with.items()))
        if kinds:
            what = f"fastllm has no kernel for {kinds} tensor(s); converted them to q8_0 at load"
            if fused:
                what += f", and {fused} tensor(s) fused with them into one matrix"
        else:
            what = (
                f"{fused} tensor(s) are fused into matrices that mix kernel formats; "
                "converted those matrices to q8_0 at load"
            )
        logger.warning(
            "%s: %s (8.5 bits per weight in memory; the conversion's rounding adds an error "
            "of at most 1/254 of each group's largest weight)",
            path,
            what,
        )


def _head_weight_name(model: nn.Module) -> str:
    """The parameter name of the language-model head's weight (the embedding when tied)."""
    lm_head = getattr(model, "lm_head", None)
    if isinstance(lm_head, Linear) and lm_head.weight is not None:
        return "lm_head.weight"
    for name, module in model.named_modules():
        if isinstance(module, Embedding) and module.num_embeddings == model.config.vocab_size:
            return f"{name}.weight"
    raise GGUFError("the model has no language-model head")
