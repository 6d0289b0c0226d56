"""Hybrid recurrent GGUF files: Qwen3.5 (``qwen35``: Gated DeltaNet and
gated attention) and LFM2 (``lfm2``: short convolutions and attention),
written as llama.cpp's converter writes them, against transformers.

``write_hybrid_gguf`` writes each tiny random model of
``test_hybrid_models.CONFIGS`` with llama.cpp's ``gguf`` package (its
tensor-name map, writer and quantizers) in the converter's layout:

* Qwen3.5: in_proj as ``attn_qkv``, ``attn_gate``, ``ssm_beta``,
  ``ssm_alpha``; ``ssm_a = -exp(A_log)``; ``dt_bias`` as ``ssm_dt.bias``;
  the convolution squeezed to [channels, taps]; every RMSNorm but
  ``linear_attn.norm`` stored as ``1 + w``; where value heads share key
  heads, the value heads reordered from grouped by key head to tiled in
  every tensor with a value-head axis (``out_proj``'s columns too); the
  recurrent layers as ``attention.recurrent_layers`` and the ``ssm.*`` keys;
* LFM2: the convolution squeezed to [channels, taps], the final norm as
  ``token_embd_norm``, ``attention.head_count_kv`` per layer (0 for a
  convolution layer), the MLP width as adjusted, ``shortconv.l_cache``;
* their MoE versions (``qwen35moe``, ``lfm2moe``): each layer's experts
  stacked in ``ffn_{gate,up,down}_exps``, routers (``ffn_gate_inp``) and
  Qwen3.5-MoE's shared-expert gate in F32, LFM2-MoE's expert bias as
  ``exp_probs_b.bias``, the expert keys (``expert_count``,
  ``expert_used_count``, ``expert_feed_forward_length``,
  ``expert_shared_feed_forward_length``, ``leading_dense_block_count``,
  ``expert_gating_func``; ``expert_weights_norm`` / ``expert_weights_scale``
  where the config differs from llama.cpp's graph);
* 1-D tensors, norms and convolutions in F32, a matrix whose rows are not
  whole blocks in F16 (the converter's fallback).

Then: F32 files give transformers' logits (chunked prefill and decode, the
tolerance of ``tests/test_hybrid_models.py``), also with multi-token-prediction
blocks after the model's and with only ``full_attention_interval``; Q8_0
files run on ``_core.QuantizedLinear`` (out_proj's tiled value heads put
back as whole blocks, or through q8_0 when a head is not whole blocks),
equal to the folder quantized at load and close to transformers holding the
file's weights; K-quant out_proj columns go back in order too; broken
tensors are errors naming them; ``LLM(file)`` generates transformers'
greedy tokens; the ``qwen35`` and ``lfm2`` pre-tokenizers split as their
tokenizers do.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from fastllm import _core  # noqa: E402
from fastllm.config import ModelConfig  # noqa: E402
from fastllm.gguf.config import hf_config  # noqa: E402
from fastllm.gguf.reader import GGUFError, GGUFFile  # noqa: E402
from fastllm.layers.quantization import quantize_model  # noqa: E402
from fastllm.models.loader import load_model  # noqa: E402
from gguf_models import K_QUANTS, random_k_blocks, unpermute  # noqa: E402
from test_gguf import _load_gguf  # noqa: E402
from test_hybrid_models import (  # noqa: E402
    CONFIGS,
    _chunked_then_decode,
    _close,
    _expert_biases,
)
from test_models import (  # noqa: E402
    _build,
    _one_thread,  # noqa: F401 - the autouse fixture: one torch thread for tiny models
    _reference,
    _sequences,
    check_greedy_generation,
)

transformers.logging.set_verbosity_error()

ARCH = {
    "qwen3_5": gguf.MODEL_ARCH.QWEN35,
    "lfm2": gguf.MODEL_ARCH.LFM2,
    "qwen3_5_moe": gguf.MODEL_ARCH.QWEN35MOE,
    "lfm2_moe": gguf.MODEL_ARCH.LFM2MOE,
    "granite4": gguf.MODEL_ARCH.GRANITE_HYBRID,
    "granite4_moe": gguf.MODEL_ARCH.GRANITE_HYBRID,  # one architecture with or without experts
}
# median over positions of max |fastllm - reference with the file's weights| /
# max|reference| (the int8 activations; observed 1-2% for LFM2, 4.5% for the
# tiny Qwen3.5 models, which amplify rounding: _assert_quantized_close)
QUANT_BOUND = 0.06
# the same for the MoE versions: 8-bit activations also move the routers'
# near ties (observed median 6.7% for the tiny Qwen3.5-MoE)
QUANT_BOUND_MOE = 0.10
LENGTHS = [14, 9, 21, 5]


def _kind(name: str) -> str:
    """The family of a config name: "qwen3_5", "lfm2" or "granite4" (their MoE
    versions too)."""
    return next(k for k in ("qwen3_5", "lfm2", "granite4") if name.startswith(k))


def _arch(name: str):
    """The file's architecture of a config name (the MoE versions their own)."""
    return ARCH[_kind(name) + ("_moe" if "_moe" in name else "")]


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """HF's rotate-half rows -> llama.cpp's interleaved rows (its converter's permutation)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _granite_layout(model, hf_name: str, t: np.ndarray) -> Layout | None:
    """Granite 4.0's tensors the gguf package's map does not name as the
    converter writes them: the router, the dense MLP's gate/up (split; the
    shared expert's with experts) and down, q/k rows permuted, Mamba-2's
    ``A = -exp(A_log)`` and ``D`` as [heads, 1], its norm as [groups, inner / groups]."""
    cfg, blk = model.config, f"blk.{hf_name.split('.')[2]}" if ".layers." in hf_name else ""
    shexp = "_shexp" if cfg.num_local_experts else ""
    one = lambda a: a[0]  # noqa: E731
    if hf_name.endswith("block_sparse_moe.router.weight"):
        return [f"{blk}.ffn_gate_inp.weight"], [t], one
    if hf_name.endswith("shared_mlp.input_linear.weight"):
        m = t.shape[0] // 2
        names = [f"{blk}.ffn_gate{shexp}.weight", f"{blk}.ffn_up{shexp}.weight"]
        return names, [t[:m], t[m:]], lambda a: np.concatenate(a)
    if hf_name.endswith("shared_mlp.output_linear.weight"):
        return [f"{blk}.ffn_down{shexp}.weight"], [t], one
    for proj, heads in (("q", cfg.num_attention_heads), ("k", cfg.num_key_value_heads)):
        if hf_name.endswith(f"self_attn.{proj}_proj.weight"):
            back = lambda a, h=heads: unpermute(a[0], h)  # noqa: E731
            return [f"{blk}.attn_{proj}.weight"], [_permute(t, heads)], back
    if hf_name.endswith(".mamba.A_log"):
        return [f"{blk}.ssm_a"], [-np.exp(t)[:, None]], lambda a: np.log(-a[0][:, 0])
    if hf_name.endswith(".mamba.D"):
        return [f"{blk}.ssm_d"], [t[:, None]], lambda a: a[0][:, 0]
    if hf_name.endswith(".mamba.norm.weight"):
        g = cfg.mamba_n_groups
        return [f"{blk}.ssm_norm.weight"], [t.reshape(g, -1)], lambda a: a[0].reshape(-1)
    if hf_name.endswith(".mamba.conv1d.weight"):
        return [f"{blk}.ssm_conv1d.weight"], [t[:, 0]], lambda a: a[0][:, None]
    return None


def _variant(name: str, **changes) -> object:
    """``CONFIGS[name]`` with ``changes``."""
    config = copy.deepcopy(CONFIGS[name])
    for key, value in changes.items():
        setattr(config, key, value)
    return config


# Qwen3.5 variants for the quantized out_proj: two value heads per key head
# of 32 values (whole q8_0 blocks: the tiled heads go back as blocks) or of 16
# (half blocks: the matrix goes through q8_0).
EXTRA = {
    "qwen3_5_dv32": _variant("qwen3_5", linear_value_head_dim=32),
    "qwen3_5_dv16": _variant("qwen3_5", linear_value_head_dim=16),
    # out_proj 256 wide: one K-quant super-block per row, two value heads per block
    "qwen3_5_dv64": _variant("qwen3_5", linear_value_head_dim=64),
}
ALL = {**CONFIGS, **EXTRA}
# A GGUF file has no key for Mamba-2's time_step_limit (llama.cpp clamps
# nothing): its files are of the model without one.
ALL["granite4_h_moe"] = _variant("granite4_h_moe", time_step_limit=(0.0, float("inf")))


def _moved(a: np.ndarray, axis: int, offset: int, heads: tuple[int, int, int], tile: bool):
    """``a`` with the value heads after ``offset`` along ``axis`` reordered:
    ``heads`` = (key heads, value heads, values per head); ``tile``: from
    grouped by key head to tiled (the converter's order), else back."""
    hk, hv, d = heads
    a = np.moveaxis(a, axis, 0)
    part = a[offset:]
    shape = (hk, hv // hk, d) if tile else (hv // hk, hk, d)
    part = part.reshape(*shape, *part.shape[1:]).swapaxes(0, 1).reshape(part.shape)
    return np.moveaxis(np.concatenate([a[:offset], part]), 0, axis)


# One parameter of the transformers model as the file holds it: (GGUF names,
# the arrays in the file's layout, the inverse that rebuilds the parameter
# from them). Stacked experts' gate/up is two tensors, as the converter
# writes them (``ffn_gate_exps``, ``ffn_up_exps``).
Layout = tuple[list[str], list[np.ndarray], Callable[[list[np.ndarray]], np.ndarray]]


def _value_head_axis(cfg, hf_name: str) -> tuple[int, int, int] | None:
    """(axis, offset, values per head) of a Qwen3.5 tensor's value heads."""
    dv, kd = cfg.linear_value_head_dim, cfg.linear_num_key_heads * cfg.linear_key_head_dim
    for suffix, where in (
        ("in_proj_qkv.weight", (0, 2 * kd, dv)),
        ("conv1d.weight", (0, 2 * kd, dv)),
        ("in_proj_z.weight", (0, 0, dv)),
        ("in_proj_b.weight", (0, 0, 1)),
        ("in_proj_a.weight", (0, 0, 1)),
        ("A_log", (0, 0, 1)),
        ("dt_bias", (0, 0, 1)),
        ("out_proj.weight", (1, 0, dv)),
    ):
        if hf_name.endswith(".linear_attn." + suffix):
            return where
    return None


def _layout(model, name: str, hf_name: str, t: np.ndarray) -> Layout:
    """Parameter ``hf_name`` as the converter writes it (module docstring)."""
    cfg, kind = model.config, _kind(name)
    if ".experts." in hf_name:  # [E, 2m, hidden] gate rows then up rows; [E, hidden, m]
        blk = f"blk.{hf_name.split('.')[2]}"
        if hf_name.endswith("down_proj"):
            return [f"{blk}.ffn_down_exps.weight"], [t], lambda a: a[0]
        m = t.shape[1] // 2
        return (
            [f"{blk}.ffn_gate_exps.weight", f"{blk}.ffn_up_exps.weight"],
            [t[:, :m], t[:, m:]],
            lambda a: np.concatenate(a, axis=1),
        )
    if kind == "granite4" and (special := _granite_layout(model, hf_name, t)) is not None:
        return special
    if hf_name.endswith(".expert_bias"):  # LFM2-MoE's (the converter's ``.bias`` suffix)
        return [f"blk.{hf_name.split('.')[2]}.exp_probs_b.bias"], [t], lambda a: a[0]
    names = gguf.TensorNameMap(_arch(name), cfg.num_hidden_layers)
    gname = names.get_name(
        hf_name.replace(".dt_bias", ".dt_proj.bias"), try_suffixes=(".weight", ".bias")
    )
    if gname is None and hf_name == "lm_head.weight":
        gname = "output.weight"  # gguf-py's LFM2MOE map lacks it; llama.cpp reads it
    assert gname is not None, hf_name
    steps: list[tuple[Callable, Callable]] = []  # (to the file, back)
    if kind == "qwen3_5":
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        where = _value_head_axis(cfg, hf_name)
        if hk != hv and where is not None:
            axis, offset, d = where
            heads = (hk, hv, d)
            steps.append(
                (
                    lambda a: _moved(a, axis, offset, heads, True),
                    lambda a: _moved(a, axis, offset, heads, False),
                )
            )
        if hf_name.endswith(".A_log"):
            steps.append((lambda a: -np.exp(a), lambda a: np.log(-a)))
        if hf_name.endswith("norm.weight") and ".linear_attn." not in hf_name:
            steps.append((lambda a: a + 1, lambda a: a - 1))
    if hf_name.endswith(("linear_attn.conv1d.weight", "conv.conv.weight")):
        steps.append((lambda a: a[:, 0], lambda a: a[:, None]))
    arr = t
    for forward, _ in steps:
        arr = forward(arr)

    def inverse(arrays: list[np.ndarray]) -> np.ndarray:
        (a,) = arrays
        for _, back in reversed(steps):
            a = back(a)
        return a

    return [gname], [np.ascontiguousarray(arr, dtype=np.float32)], inverse


def _type(gname: str, arr: np.ndarray, types: str | Callable) -> str:
    """The converter's rule: 1-D tensors, norms, convolutions and names not
    ending in ``.weight`` (``ssm_a``, biases) in F32; a matrix whose rows are
    not whole blocks in F16."""
    if (
        arr.ndim <= 1
        or gname.endswith("_norm.weight")
        or ".ffn_gate_inp" in gname  # routers and the shared expert's gate
        or not gname.endswith(".weight")
        or ".ssm_conv1d." in gname
        or ".shortconv.conv." in gname
    ):
        return "F32"
    kind = types if isinstance(types, str) else types(gname, arr.shape)
    block = gguf.GGML_QUANT_SIZES[getattr(gguf.GGMLQuantizationType, kind)][0]
    return kind if arr.shape[-1] % block == 0 else "F16"


def _file_tensors(
    model, name: str, types
) -> list[tuple[str, list[tuple[str, np.ndarray, str]], Callable]]:
    """(parameter, its (GGUF name, array, type) tensors, inverse) of every
    parameter (and LFM2-MoE's expert-bias buffers)."""
    out = []
    for hf_name, t in model.state_dict().items():
        if model.config.tie_word_embeddings and hf_name == "lm_head.weight":
            continue
        gnames, arrays, inverse = _layout(model, name, hf_name, t.detach().float().numpy())
        parts = [
            (g, np.ascontiguousarray(a, dtype=np.float32), _type(g, a, types))
            for g, a in zip(gnames, arrays, strict=True)
        ]
        out.append((hf_name, parts, inverse))
    return out


def _metadata(w, model, name: str, variant: str) -> None:
    """The keys llama.cpp's converter writes for the family."""
    cfg, kind = model.config, _kind(name)
    arch = gguf.MODEL_ARCH_NAMES[_arch(name)]
    n = cfg.num_hidden_layers
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    moe = "_moe" in name
    if kind == "granite4":  # GraniteHybridModel.set_gguf_parameters
        w.add_block_count(n)
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_head_count_kv(
            [0 if "linear" in t else cfg.num_key_value_heads for t in cfg.layer_types]
        )
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
        w.add_vocab_size(cfg.vocab_size)
        w.add_embedding_scale(cfg.embedding_multiplier)
        w.add_attention_scale(cfg.attention_multiplier)
        w.add_residual_scale(cfg.residual_multiplier)
        w.add_logit_scale(cfg.logits_scaling)
        w.add_expert_shared_feed_forward_length(cfg.shared_intermediate_size)
        if cfg.num_local_experts:
            w.add_expert_count(cfg.num_local_experts)
            w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_ssm_conv_kernel(cfg.mamba_d_conv)
        w.add_ssm_state_size(cfg.mamba_d_state)
        w.add_ssm_group_count(cfg.mamba_n_groups)
        w.add_ssm_inner_size(cfg.mamba_n_heads * cfg.mamba_d_head)
        w.add_ssm_time_step_rank(cfg.mamba_n_heads)
        # the converter writes false for every hybrid (the released models have
        # no rotary); here the config decides, so that both ways are read
        w.add_rope_scaling_finetuned(cfg.position_embedding_type == "rope")
        return
    if moe:
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if kind == "lfm2" and moe:  # LFM2MoeModel.set_gguf_parameters; llama.cpp's graph
        # renormalises and does not scale: keys for the configs that differ
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_leading_dense_block_count(cfg.num_dense_layers)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        if not cfg.norm_topk_prob:
            w.add_expert_weights_norm(False)
        if cfg.routed_scaling_factor != 1.0:
            w.add_expert_weights_scale(cfg.routed_scaling_factor)
    elif moe:
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if kind == "lfm2":
        w.add_block_count(n)
        if not moe:
            w.add_feed_forward_length(model.model.layers[0].feed_forward.w1.weight.shape[0])
        kv = [cfg.num_key_value_heads if t != "conv" else 0 for t in cfg.layer_types]
        w.add_head_count_kv(kv)
        w.add_layer_norm_rms_eps(cfg.norm_eps)
        w.add_vocab_size(cfg.vocab_size)
        w.add_shortconv_l_cache(cfg.conv_L_cache)
        return
    mtp = 1 if variant == "mtp" else 0
    w.add_block_count(n + mtp)
    if not moe:  # Qwen3.5-MoE's config has no intermediate_size
        w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    w.add_ssm_state_size(cfg.linear_key_head_dim)
    w.add_ssm_group_count(cfg.linear_num_key_heads)
    w.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    w.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    if variant != "interval":
        recurrent = [t == "linear_attention" for t in cfg.layer_types] + [False] * mtp
        w.add_array(f"{arch}.attention.recurrent_layers", recurrent)
    w.add_full_attention_interval(getattr(cfg, "full_attention_interval", 4))
    partial = cfg.rope_parameters.get("partial_rotary_factor", 0.25)
    w.add_rope_dimension_count(int(cfg.head_dim * partial))
    w.add_rope_dimension_sections([11, 11, 10, 0])
    if mtp:
        w.add_nextn_predict_layers(mtp)


def write_hybrid_gguf(
    model,
    path: str,
    name: str,
    types: str | Callable = "F32",
    *,
    variant: str = "",
    edit: Callable | None = None,
) -> str:
    """Writes the transformers hybrid ``model`` (config ``name``) to ``path``:
    matrices in ``types`` (a GGML type name, or a function of (GGUF name,
    shape)); ``variant`` "mtp" adds a multi-token-prediction block after the
    model's (as the converter writes Qwen3.5 checkpoints that have one),
    "interval" leaves ``attention.recurrent_layers`` out; ``edit`` may change,
    or drop (None), any (name, array, type) before it is written."""
    w = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[_arch(name)])
    _metadata(w, model, name, variant)
    tensors = [part for _, parts, _ in _file_tensors(model, name, types) for part in parts]
    if variant == "mtp":  # the converter's nextn block: fastllm does not read it
        n, h = model.config.num_hidden_layers, model.config.hidden_size
        rng = np.random.default_rng(0)
        tensors.append((f"blk.{n}.attn_norm.weight", np.ones(h, np.float32), "F32"))
        tensors.append((f"blk.{n}.nextn.eh_proj.weight", rng.random((h, 2 * h), np.float32), "F32"))
    for tensor in tensors:
        if edit is not None:
            tensor = edit(*tensor)
            if tensor is None:
                continue
        gname, arr, kind = tensor
        qtype = getattr(gguf.GGMLQuantizationType, kind)
        if kind == "F32":
            w.add_tensor(gname, np.ascontiguousarray(arr, dtype=np.float32))
        elif kind in K_QUANTS:  # random valid blocks, which then define the weights
            blocks = random_k_blocks(*arr.shape, kind, np.random.default_rng(1))
            w.add_tensor(gname, blocks, raw_dtype=qtype)
        else:
            w.add_tensor(gname, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _with_file_weights(model, name: str, types):
    """A copy of the transformers model holding the weights the file of
    ``types`` holds: each tensor quantized and dequantized by the ``gguf``
    package in the file's layout, then put back in the model's."""
    ref = copy.deepcopy(model)
    params = {**dict(ref.named_parameters()), **dict(ref.named_buffers())}
    with torch.no_grad():
        for hf_name, parts, inverse in _file_tensors(model, name, types):
            arrays = []
            for _, arr, kind in parts:
                if kind != "F32":
                    qtype = getattr(gguf.GGMLQuantizationType, kind)
                    blocks = gguf.quants.quantize(arr, qtype)
                    arr = gguf.quants.dequantize(blocks, qtype).reshape(arr.shape)
                arrays.append(arr)
            params[hf_name].copy_(torch.from_numpy(np.ascontiguousarray(inverse(arrays))))
    return ref


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, tuple[str, torch.nn.Module]]:
    out = {}
    for name, config in ALL.items():
        folder = str(tmp_path_factory.mktemp(f"gguf-{name}"))
        out[name] = (folder, _build("", folder, 0, config))
    return out


F32_CASES = [*CONFIGS, "qwen3_5-mtp", "qwen3_5-interval"]


@pytest.mark.parametrize("case", F32_CASES)
def test_f32_file_matches_transformers(case, saved, tmp_path):
    name, _, variant = case.partition("-")
    _, ref_model = saved[name]
    path = write_hybrid_gguf(ref_model, str(tmp_path / "m.gguf"), name, variant=variant)
    model, report = _load_gguf(path)
    assert report.tensor_types == {"F32": len(GGUFFile(path).tensors)}
    assert model.recurrent_layers()
    seqs = _sequences(1, LENGTHS)
    ref = _reference(ref_model, seqs)
    for i, (ours, expected) in enumerate(zip(_chunked_then_decode(model, seqs), ref, strict=True)):
        _close(ours, expected, f"{case} sequence {i}")


def test_expert_bias_stays_float32_in_a_bfloat16_model(saved, tmp_path):
    """LFM2-MoE's ``exp_probs_b.bias`` (float32 in the file) loads bit for bit
    into a bfloat16 model, as the folder's does (transformers keeps it float32)."""
    _, ref_model = saved["lfm2_moe"]
    path = write_hybrid_gguf(ref_model, str(tmp_path / "m.gguf"), "lfm2_moe")
    model, _ = _load_gguf(path, torch.bfloat16)
    ours, theirs = _expert_biases(model, ref_model)
    assert theirs and len(ours) == len(theirs)
    # Values bfloat16 would round: the check is not met by zeros.
    assert any(not torch.equal(b, b.bfloat16().float()) for b in theirs)
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == torch.float32 and torch.equal(a, b.float())


def test_config_from_the_file(saved, tmp_path):
    """The keys as the folder's config.json fields, or the fields that mean
    the same (LFM2's MLP width as adjusted, no longer adjusted)."""
    for name in CONFIGS:
        _, ref_model = saved[name]
        cfg = ref_model.config
        with GGUFFile(write_hybrid_gguf(ref_model, str(tmp_path / f"{name}.gguf"), name)) as g:
            hf = hf_config(g)
        assert hf["tie_word_embeddings"] == cfg.tie_word_embeddings, name
        if name.startswith("granite4"):
            _check_granite4_config(hf, cfg)
            continue
        assert hf["layer_types"] == cfg.layer_types, name
        if "_moe" in name:
            keys = ["num_experts", "num_experts_per_tok", "moe_intermediate_size"]
            if name.startswith("lfm2"):
                keys += ["num_dense_layers", "use_expert_bias", "norm_topk_prob"]
                keys += ["routed_scaling_factor", "intermediate_size"]
            else:
                keys += ["shared_expert_intermediate_size"]
            for key in keys:  # the scale is a float32 key
                assert hf[key] == pytest.approx(getattr(cfg, key), rel=1e-7), (name, key)
        if name.startswith("lfm2"):
            if "_moe" not in name:
                width = ref_model.model.layers[0].feed_forward.w1.weight.shape[0]
                assert hf["intermediate_size"] == width and not hf["block_auto_adjust_ff_dim"]
            assert hf["conv_L_cache"] == cfg.conv_L_cache and hf["conv_bias"] == cfg.conv_bias
            assert hf["num_key_value_heads"] == cfg.num_key_value_heads
            continue
        for key in (
            "linear_num_key_heads",
            "linear_num_value_heads",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_conv_kernel_dim",
            "attention_bias",
            "head_dim",
        ):
            assert hf[key] == getattr(cfg, key), (name, key)
        assert hf["partial_rotary_factor"] == cfg.rope_parameters["partial_rotary_factor"]
        assert hf["rope_theta"] == cfg.rope_parameters["rope_theta"]


def _check_granite4_config(hf: dict, cfg) -> None:
    """A Granite 4.0 file's config against the folder's: layers, Mamba-2
    shapes and biases, multipliers, the MLP widths, experts, rotary."""
    assert hf["layer_types"] == cfg.layer_types
    keys = ["mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_d_conv"]
    keys += ["mamba_expand", "mamba_conv_bias", "mamba_proj_bias", "attention_bias"]
    keys += ["shared_intermediate_size", "num_local_experts", "position_embedding_type"]
    keys += ["num_key_value_heads"]
    if cfg.num_local_experts:
        keys += ["num_experts_per_tok", "intermediate_size"]
    for key in keys:
        assert hf[key] == getattr(cfg, key), key
    for key in ("embedding_multiplier", "attention_multiplier", "residual_multiplier"):
        assert hf[key] == pytest.approx(getattr(cfg, key), rel=1e-7), key  # float32 keys
    assert hf["logits_scaling"] == pytest.approx(cfg.logits_scaling, rel=1e-7)


def _assert_quantized_close(ours, refs, what: str) -> None:
    """Each position's max error against transformers holding the file's
    weights (the int8 activations): within ``QUANT_BOUND`` of max|ref| at the
    median, and nowhere far off. (The tiny random Qwen3.5 models amplify any
    rounding: their logits move by ~5% with the weights alone rounded to
    q8_0, 39% at one position of 49; ``test_q8_0_file`` tells the loader
    from that by comparing with the folder quantized at load.)"""
    errs = torch.cat(
        [(a - b).abs().max(-1).values / b.abs().max() for a, b in zip(ours, refs, strict=True)]
    )
    bound = QUANT_BOUND_MOE if "_moe" in what else QUANT_BOUND
    assert errs.median() <= bound and errs.max() <= 0.5, f"{what}: errors {errs.tolist()}"


def _converted(cfg) -> dict[str, int]:
    """What a Q8_0 file's load converts: Qwen3.5's quantized out_proj whose
    tiled value heads are not whole q8_0 blocks, one per DeltaNet layer."""
    if not hasattr(cfg, "linear_value_head_dim"):
        return {}
    dv, hk, hv = cfg.linear_value_head_dim, cfg.linear_num_key_heads, cfg.linear_num_value_heads
    if hk == hv or (dv * hv) % 32 or dv % 32 == 0:
        return {}
    return {"Q8_0": cfg.layer_types.count("linear_attention")}


def _table_rows(linear, fmt: str = "q8_0") -> torch.Tensor:
    table = linear.packed
    assert isinstance(table, _core.QuantizedLinear) and table.format == fmt
    rows = torch.empty(table.out_features, table.in_features)
    table.embed(rows, torch.arange(table.out_features))
    return rows


@pytest.mark.parametrize("name", [*CONFIGS, *EXTRA])
def test_q8_0_file(name, saved, tmp_path):
    """A Q8_0 file's matrices run as stored on the q8_0 kernel (in_proj's
    four parts, the value heads' rows put back in order): the logits of the
    folder quantized at load (the same blocks, where every matrix is whole
    blocks and none is converted), close to transformers
    holding the file's weights, the argmax mostly the float model's.
    out_proj's tiled columns: whole blocks moved back (value heads of 32),
    or the matrix dequantized, reordered and quantized again (16)."""
    folder, ref_model = saved[name]
    path = write_hybrid_gguf(ref_model, str(tmp_path / "m.gguf"), name, "Q8_0")
    model, report = _load_gguf(path)
    assert report.tensor_types["Q8_0"] > 0
    converted = _converted(ref_model.config)
    assert report.reordered == converted and report.converted == {}
    mixer = model.recurrent_layers()[0]  # the first recurrent layer's (qwen3_5's: layer 0's)
    assert isinstance(mixer.in_proj.packed, _core.QuantizedLinear)
    if name == "qwen3_5_dv32":  # exactly the file's blocks, columns back in order
        want = _with_file_weights(ref_model, name, "Q8_0").model.layers[0].linear_attn
        np.testing.assert_array_equal(
            _table_rows(mixer.out_proj).numpy(), want.out_proj.weight.detach().numpy()
        )
        parts = [getattr(want, f"in_proj_{p}").weight for p in ("qkv", "z", "b", "a")]
        np.testing.assert_array_equal(
            _table_rows(mixer.in_proj).numpy(), torch.cat(parts).detach().numpy()
        )
    seqs = _sequences(4, LENGTHS)
    ours = _chunked_then_decode(model, seqs)
    if not converted and "F16" not in report.tensor_types:  # every matrix whole blocks
        config = ModelConfig.from_pretrained(folder)
        at_load = load_model(config, folder, torch.float32, "cpu")
        # The file stores norms as 1 + w and A_log as -exp(A_log): read back,
        # they differ from the folder's in the last float32 bit, which the
        # 8-bit activations can amplify; the comparison is of the matrices.
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if p.ndim == 1:
                    at_load.get_parameter(pname).copy_(p)
        quantize_model(at_load, "q8_0", config.vocab_size)
        for i, (a, b) in enumerate(zip(ours, _chunked_then_decode(at_load, seqs), strict=True)):
            _close(a, b, f"{name} sequence {i} against the folder quantized at load")
    _assert_quantized_close(
        ours, _reference(_with_file_weights(ref_model, name, "Q8_0"), seqs), name
    )
    refs = _reference(ref_model, seqs)
    same = sum((a.argmax(-1) == b.argmax(-1)).sum().item() for a, b in zip(ours, refs, strict=True))
    assert same >= 0.75 * sum(LENGTHS), (name, same)


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_k_quant_out_proj_columns_back_in_order(kind, saved, tmp_path):
    """A K-quant out_proj (super-blocks of 256 columns, four value heads of
    64 each) whose tiled value heads go back in order: Q4_K as q4_1 blocks
    (32 columns) and Q6_K converted to q8_0, the blocks then moved back; the
    rows hold the file's weights, columns in fastllm's order."""
    name = "qwen3_5_dv64"
    _, ref_model = saved[name]

    def types(gname: str, shape) -> str:
        return kind if ".ssm_out." in gname else "F32"

    path = write_hybrid_gguf(ref_model, str(tmp_path / "m.gguf"), name, types)
    model, report = _load_gguf(path)
    assert report.tensor_types[kind] == 3
    (t,) = [t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.ssm_out.weight"]
    deq = gguf.quants.dequantize(t.data, t.tensor_type).reshape(64, 256)
    cfg = ref_model.config
    heads = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, 64)
    want = torch.from_numpy(_moved(deq, 1, 0, heads, False))
    fmt = "q4_1" if kind == "Q4_K" else "q8_0"
    rows = _table_rows(model.model.layers[0].linear_attn.out_proj, fmt)
    # Q4_K: each sub-block's scale and minimum rounded to f16; Q6_K: q8_0's rounding
    bound = 1e-3 if kind == "Q4_K" else 1 / 200
    assert ((rows - want).abs().max() / want.abs().max()).item() <= bound
    assert ((rows - torch.from_numpy(deq)).abs().max() / want.abs().max()).item() > 0.1


def test_llm_greedy_tokens_from_a_hybrid_file(saved, tmp_path):
    """``LLM(file)``: transformers' greedy tokens and logprobs (``check_greedy_generation``)."""
    for name in ("qwen3_5", "lfm2", "qwen3_5_moe", "lfm2_moe"):
        _, ref_model = saved[name]
        path = write_hybrid_gguf(ref_model, str(tmp_path / f"{name}.gguf"), name)
        check_greedy_generation(path, ref_model, name)


def test_hybrid_moe_keys_checked(saved, tmp_path):
    """An LFM2-MoE file whose gating is not sigmoid, or whose routers do not
    start at ``leading_dense_block_count``: an error naming the key."""
    _, model = saved["lfm2_moe"]
    path = write_hybrid_gguf(model, str(tmp_path / "m.gguf"), "lfm2_moe")
    with GGUFFile(path) as g:
        assert hf_config(g)["num_dense_layers"] == 1
        g.metadata["lfm2moe.expert_gating_func"] = 1
        with pytest.raises(GGUFError, match=r"expert_gating_func.*sigmoid"):
            hf_config(g)
        g.metadata["lfm2moe.expert_gating_func"] = 2
        g.metadata["lfm2moe.leading_dense_block_count"] = 2
        with pytest.raises(GGUFError, match=r"routers .* in layers \[1, 2, 3\]"):
            hf_config(g)


# ---- broken files ---------------------------------------------------------


def test_broken_hybrid_tensors(saved, tmp_path):
    """A missing or misshapen recurrent tensor, or an ``ssm_a`` that is not
    ``-exp(A_log)``: an error naming the file and the tensor."""
    _, qwen = saved["qwen3_5"]
    _, lfm2 = saved["lfm2"]

    def drop(gname, arr, kind):
        return None if gname == "blk.1.ssm_a" else (gname, arr, kind)

    def short_conv(gname, arr, kind):
        return (gname, arr[:, 1:] if gname == "blk.2.shortconv.conv.weight" else arr, kind)

    def positive_a(gname, arr, kind):
        return (gname, -arr if gname == "blk.0.ssm_a" else arr, kind)

    def no_gate(gname, arr, kind):
        return None if gname == "blk.2.attn_gate.weight" else (gname, arr, kind)

    cases = [
        (qwen, "qwen3_5", drop, r"a\.gguf: tensor 'blk\.1\.ssm_a' is missing"),
        (
            lfm2,
            "lfm2",
            short_conv,
            r"b\.gguf: tensor 'blk\.2\.shortconv\.conv\.weight' has shape \[64, 2\], "
            r"expected \[64, 1, 3\]",
        ),
        (qwen, "qwen3_5", positive_a, r"c\.gguf: tensor 'blk\.0\.ssm_a' holds -exp\(A_log\)"),
        (qwen, "qwen3_5", no_gate, r"d\.gguf: tensor 'blk\.2\.attn_gate\.weight' is missing"),
    ]
    for (model, name, edit, message), file in zip(cases, "abcd", strict=True):
        path = write_hybrid_gguf(model, str(tmp_path / f"{file}.gguf"), name, "Q8_0", edit=edit)
        with pytest.raises(GGUFError, match=message):
            _load_gguf(path)


def test_lfm2_attention_layers_of_different_head_counts(saved, tmp_path):
    """LFM2's per-layer key/value head counts: one count for every attention layer."""
    _, model = saved["lfm2_bias"]
    path = write_hybrid_gguf(model, str(tmp_path / "m.gguf"), "lfm2_bias")
    with GGUFFile(path) as g:
        assert g.metadata["lfm2.attention.head_count_kv"].tolist() == [2, 0, 2]
        g.metadata["lfm2.attention.head_count_kv"] = np.array([2, 0, 4], dtype=np.uint32)
        with pytest.raises(GGUFError, match=r"head_count_kv.*different key/value head counts"):
            hf_config(g)


# ---- the families' pre-tokenizers -------------------------------------------

# Qwen3.5's tokenizer.json split (transformers' Qwen3_5Tokenizer): Qwen2's,
# combining marks kept in words; NFC first.
QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _file_tokenizer(tok, folder: str, pre: str):
    """``tok`` saved in ``folder``, written to a GGUF file with ``pre``, and the
    tokenizer fastllm builds from that file."""
    import json
    import os

    from fastllm.gguf.tokenizer import tokenizer_from_metadata
    from gguf_writer import add_tokenizer_metadata, read_metadata

    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}, f)
    path = os.path.join(folder, "t.gguf")
    w = gguf.GGUFWriter(path, "llama")
    add_tokenizer_metadata(w, folder, pre=pre)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tokenizer_from_metadata(read_metadata(path), path)


def test_qwen35_and_lfm2_pre_tokenizers(tmp_path):
    """``qwen35`` splits as Qwen3.5's tokenizer.json (NFC, combining marks
    kept in words: not as ``qwen2``, which cuts a Devanagari word at each
    vowel sign), ``lfm2`` as llama.cpp reads it (Llama 3's split)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN35_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = ["हिन्दी भाषा, हिमालय की नदियाँ; it's 12345 x = f(y)  # ok\n"] * 50
    tok.train_from_iterator(corpus, trainer=trainer)
    text = "हिन्दी भाषा, नदियाँ cafe\u0301 naïve 12345 it's\n\n  x = f(y)"
    want = tok.encode(text).ids
    ours = _file_tokenizer(tok, str(tmp_path / "qwen35"), "qwen35")
    assert list(ours.encode(text, add_special_tokens=False)) == want
    qwen2 = _file_tokenizer(tok, str(tmp_path / "qwen2"), "qwen2")
    assert list(qwen2.encode(text, add_special_tokens=False)) != want  # the marks matter
    lfm2 = _file_tokenizer(tok, str(tmp_path / "lfm2"), "lfm2")
    llama3 = _file_tokenizer(tok, str(tmp_path / "llama3"), "llama-bpe")
    assert list(lfm2.encode(text)) == list(llama3.encode(text))
