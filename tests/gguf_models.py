"""Test helper: writes a Hugging Face model folder as a GGUF file, as llama.cpp's
converter lays it out, with the ``gguf`` package (llama.cpp's own Python
library): its tensor-name map, its writer and its quantizers.

- tensor names from ``gguf.TensorNameMap`` (llama.cpp's table, not fastllm's);
- Llama-family q/k rows permuted into llama.cpp's rotary layout;
- GPT-2's Conv1D weights transposed to [out, in];
- matrices in the requested type (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0,
  Q5_1 quantized by ``gguf.quants``; K-quants, which that library cannot
  quantize, as random valid blocks that then *define* the model's weights);
- 1-D tensors (norms, biases) in F32, as the converter writes them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

ARCH = {
    "llama": gguf.MODEL_ARCH.LLAMA,
    "mistral": gguf.MODEL_ARCH.LLAMA,
    "qwen2": gguf.MODEL_ARCH.QWEN2,
    "qwen3": gguf.MODEL_ARCH.QWEN3,
    "phi": gguf.MODEL_ARCH.PHI2,
    "gpt2": gguf.MODEL_ARCH.GPT2,
    "gemma2": gguf.MODEL_ARCH.GEMMA2,
    "gemma3": gguf.MODEL_ARCH.GEMMA3,
    "phi3": gguf.MODEL_ARCH.PHI3,
    "granite": gguf.MODEL_ARCH.GRANITE,
    "olmo2": gguf.MODEL_ARCH.OLMO2,
    "smollm3": gguf.MODEL_ARCH.SMOLLM3,
}
# Families whose q/k rows llama.cpp's converter permutes (LlamaModel subclasses).
PERMUTED = ("llama", "mistral", "granite", "smollm3")
GEMMA = ("gemma2", "gemma3")
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """HF's rotate-half rows -> llama.cpp's interleaved rows (its converter's permutation)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _llama3_factors(rope: dict, head_dim: int) -> np.ndarray:
    """Llama 3's rope scaling as one divisor per frequency (what the converter stores)."""
    import math

    base = rope.get("rope_theta", 10000.0)
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of ``_permute``."""
    return (
        w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def random_k_blocks(rows: int, cols: int, kind: str, rng: np.random.Generator) -> np.ndarray:
    """Random but valid K-quant blocks [rows, bytes]: random codes and scales, f16
    super-block scales set to small finite values."""
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n = rows * cols // block
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)

    def f16(lo: float, hi: float) -> np.ndarray:
        return rng.uniform(lo, hi, size=n).astype(np.float16).view(np.uint8).reshape(n, 2)

    if kind == "Q6_K":
        raw[:, 208:210] = f16(0.0005, 0.002)
    else:
        raw[:, 0:2] = f16(0.001, 0.004)  # d
        raw[:, 2:4] = f16(0.001, 0.004)  # dmin
    return raw.reshape(rows, -1)


def write_gguf(
    folder: str,
    path: str,
    kind: str,
    types: str | Callable[[str, tuple[int, ...]], str] = "F32",
    tokenizer: bool = False,
    seed: int = 0,
    fuse_qkv: bool = False,
) -> str:
    """Writes the model in ``folder`` (config.json + model.safetensors) to ``path``.

    ``kind`` is the test's model name ("llama", "qwen2", "qwen3", "phi", "gpt2",
    "gemma2", "gemma3", "phi3", "granite", "olmo2", "smollm3"), written with
    the converter's conventions for that family (Gemma's norms as ``1 + w``,
    its soft-caps and windows; Phi-3's fused tensors and LongRoPE factor
    tensors; Granite's multipliers);
    ``types`` a GGML type name for every matrix, or a function of (GGUF name,
    shape) giving one. With ``tokenizer``, the folder's tokenizer is written
    too (``gguf_writer.add_tokenizer_metadata``). ``fuse_qkv`` stores each
    layer's q, k and v as one ``attn_qkv`` tensor (as some phi2 files do).
    A Llama 3 rope scaling is written as llama.cpp's converter writes it: one
    divisor per frequency in a ``rope_freqs.weight`` tensor."""
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    state = load_file(os.path.join(folder, "model.safetensors"))
    arch = ARCH[kind]
    arch_name = gguf.MODEL_ARCH_NAMES[arch]
    is_gpt2 = kind == "gpt2"
    n_layers = cfg["n_layer"] if is_gpt2 else cfg["num_hidden_layers"]
    hidden = cfg["n_embd"] if is_gpt2 else cfg["hidden_size"]
    heads = cfg["n_head"] if is_gpt2 else cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    names = gguf.TensorNameMap(arch, n_layers)
    w = gguf.GGUFWriter(path, arch_name)
    w.add_context_length(cfg["n_positions"] if is_gpt2 else cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(cfg.get("n_inner") or cfg.get("intermediate_size") or 4 * hidden)
    w.add_head_count(heads)
    if not is_gpt2:
        w.add_head_count_kv(kv_heads)
    if kind in ("phi", "gpt2"):
        w.add_layer_norm_eps(cfg.get("layer_norm_eps", cfg.get("layer_norm_epsilon", 1e-5)))
    else:
        w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = {**(cfg.get("rope_parameters") or {}), **(cfg.get("rope_scaling") or {})}
    local_rope = None
    if isinstance(rope.get("full_attention"), dict):  # Gemma 3: one set per layer type
        rope, local_rope = rope["full_attention"], rope.get("sliding_attention")
    if not is_gpt2:
        w.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
        partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        w.add_rope_dimension_count(int(head_dim * partial))
    if local_rope is not None:
        w.add_rope_freq_base_swa(float(local_rope["rope_theta"]))
    if cfg.get("sliding_window") and cfg.get("use_sliding_window", True):
        w.add_sliding_window(cfg["sliding_window"])
        layer_types = cfg.get("layer_types")
        # OLMo 2's converter writes one flag per layer; Gemma 3's writes no
        # pattern (llama.cpp assumes 6) unless the config gives a period.
        if layer_types and kind in ("olmo2", "smollm3"):
            w.add_sliding_window_pattern([t == "sliding_attention" for t in layer_types])
        elif cfg.get("sliding_window_pattern"):  # a period, as older Gemma 3 configs give it
            w.add_sliding_window_pattern(int(cfg["sliding_window_pattern"]))
    elif kind == "phi3":
        w.add_sliding_window(0)
    if kind in GEMMA:
        if cfg.get("attn_logit_softcapping") and kind == "gemma2":
            w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        if cfg.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if kind == "granite":
        for key, add in (
            ("attention_multiplier", w.add_attention_scale),
            ("embedding_multiplier", w.add_embedding_scale),
            ("residual_multiplier", w.add_residual_scale),
            ("logits_scaling", w.add_logit_scale),
        ):
            if cfg.get(key):
                add(cfg[key])
    if kind == "phi3":
        orig = rope.get("original_max_position_embeddings") or cfg.get(
            "original_max_position_embeddings", cfg["max_position_embeddings"]
        )
        w.add_rope_scaling_orig_ctx_len(orig)
        if rope.get("rope_type") == "longrope":
            import math

            scale = cfg["max_position_embeddings"] / orig
            attn = math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0
            w.add_rope_scaling_attn_factors(attn)
            w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
            w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))
    if cfg.get("head_dim") is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rope["factor"]))
    elif rope.get("rope_type") == "yarn":  # the converter's keys
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(rope["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
        if rope.get("attention_factor") is not None:
            w.add_rope_scaling_yarn_attn_factor(float(rope["attention_factor"]))
        if rope.get("beta_fast") is not None:
            w.add_rope_scaling_yarn_beta_fast(float(rope["beta_fast"]))
        if rope.get("beta_slow") is not None:
            w.add_rope_scaling_yarn_beta_slow(float(rope["beta_slow"]))
    w.add_vocab_size(cfg["vocab_size"])
    if not tokenizer:  # otherwise the tokenizer's keys carry them
        if cfg.get("bos_token_id") is not None:
            w.add_bos_token_id(cfg["bos_token_id"])
        if cfg.get("eos_token_id") is not None:
            w.add_eos_token_id(cfg["eos_token_id"])
    else:
        from gguf_writer import add_tokenizer_metadata

        add_tokenizer_metadata(w, folder)
    rng = np.random.default_rng(seed)
    tied = cfg.get("tie_word_embeddings", is_gpt2)
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", _llama3_factors(rope, head_dim))
    if fuse_qkv:
        for i in range(n_layers):
            for kind_ in ("weight", "bias"):
                names_qkv = [f"model.layers.{i}.self_attn.{p}_proj.{kind_}" for p in "qkv"]
                if names_qkv[0] in state:
                    fused = torch.cat([state.pop(n) for n in names_qkv])
                    state[f"model.layers.{i}.self_attn.qkv_proj.{kind_}"] = fused
    for hf_name, t in state.items():
        if is_gpt2 and hf_name.endswith((".attn.bias", ".attn.masked_bias")):
            continue
        if tied and hf_name == "lm_head.weight":
            continue
        if ".qkv_proj." in hf_name:  # fused above
            layer = hf_name.split(".")[2]
            name = f"blk.{layer}.attn_qkv.{hf_name.rsplit('.', 1)[1]}"
        else:
            name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        arr = t.float().numpy()
        if kind in GEMMA and hf_name.endswith("norm.weight"):
            arr = arr + 1  # Gemma's norms scale by 1 + w: the converter stores the sum
        if is_gpt2 and hf_name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
            arr = arr.T.copy()
        if kind in PERMUTED:
            if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
                arr = _permute(arr, heads)
            elif hf_name.endswith(("k_proj.weight", "k_proj.bias")):
                arr = _permute(arr, kv_heads)
        kind_of = (
            "F32"
            if arr.ndim == 1
            else (types if isinstance(types, str) else types(name, arr.shape))
        )
        qtype = getattr(gguf.GGMLQuantizationType, kind_of)
        if kind_of == "F32":
            w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
        elif kind_of == "F16":
            w.add_tensor(name, arr.astype(np.float16))
        elif kind_of in K_QUANTS:
            w.add_tensor(name, random_k_blocks(*arr.shape, kind_of, rng), raw_dtype=qtype)
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def dequantized_state(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a GGUF file dequantized by the ``gguf`` package (numpy)."""
    reader = gguf.GGUFReader(path)
    out = {}
    for t in reader.tensors:
        out[t.name] = torch.from_numpy(
            gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        )
    return out
