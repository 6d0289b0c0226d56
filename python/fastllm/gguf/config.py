"""A model's configuration from GGUF metadata, as a Hugging Face ``config.json`` dict.

The dict goes through ``ModelConfig.from_dict`` like any folder's config, so a
GGUF model and the same model's folder configure the same way. Keys are read
per ``general.architecture`` (``{arch}.block_count`` and so on); a missing or
ill-typed key is an error naming the file and the key.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fastllm.gguf.reader import GGUFError, GGUFFile

# general.architecture -> (Hugging Face architecture, model_type)
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "phi2": ("PhiForCausalLM", "phi"),
    "gpt2": ("GPT2LMHeadModel", "gpt2"),
}


def architecture(gguf: GGUFFile) -> str:
    """``general.architecture``, checked against the families fastllm runs."""
    arch = gguf.get("general.architecture")
    if arch is None:
        raise GGUFError(f"{gguf.path}: metadata key 'general.architecture' is missing")
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"{gguf.path}: general.architecture {arch!r} is not supported; "
            f"supported: {', '.join(ARCHITECTURES)}"
        )
    return arch


def _value(gguf: GGUFFile, key: str, default: Any) -> Any:
    """Metadata ``key``, or ``default`` when the file lacks it (an error when
    ``default`` is None: the key is required)."""
    value = gguf.get(key)
    if value is not None:
        return value
    if default is None:
        raise GGUFError(f"{gguf.path}: metadata key {key!r} is missing")
    return default


def _int(gguf: GGUFFile, key: str, default: int | None = None) -> int:
    value = _value(gguf, key, default)
    if isinstance(value, np.ndarray):
        # Per-layer values (some files store head counts per layer): all equal here.
        if value.size == 0 or not (value == value.flat[0]).all():
            raise GGUFError(
                f"{gguf.path}: metadata key {key!r} varies per layer ({value.tolist()}), "
                "which fastllm does not support"
            )
        value = value.flat[0].item()
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise GGUFError(
            f"{gguf.path}: metadata key {key!r} must be a positive integer, got {value!r}"
        )
    return value


def _float(gguf: GGUFFile, key: str, default: float | None = None) -> float:
    value = _value(gguf, key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise GGUFError(f"{gguf.path}: metadata key {key!r} must be a number, got {value!r}")
    return float(value)


def hf_config(gguf: GGUFFile) -> dict[str, Any]:
    """The ``config.json`` dict of the model in ``gguf``."""
    arch = architecture(gguf)
    hf_arch, model_type = ARCHITECTURES[arch]
    p = f"{arch}."
    tensors = gguf.tensors
    if "token_embd.weight" not in tensors:
        raise GGUFError(f"{gguf.path}: tensor 'token_embd.weight' is missing")
    tokens = gguf.get("tokenizer.ggml.tokens")
    vocab = gguf.get(p + "vocab_size") or (len(tokens) if tokens is not None else None)
    vocab = vocab or tensors["token_embd.weight"].shape[0]
    hidden = _int(gguf, p + "embedding_length")
    heads = _int(gguf, p + "attention.head_count")
    kv_heads = _int(gguf, p + "attention.head_count_kv", heads)
    hf: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "num_hidden_layers": _int(gguf, p + "block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "intermediate_size": _int(gguf, p + "feed_forward_length"),
        "max_position_embeddings": _int(gguf, p + "context_length"),
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    head_dim = gguf.get(p + "attention.key_length")
    if head_dim is not None:
        hf["head_dim"] = _int(gguf, p + "attention.key_length")
        value_dim = _int(gguf, p + "attention.value_length", hf["head_dim"])
        if value_dim != hf["head_dim"]:
            raise GGUFError(
                f"{gguf.path}: {p}attention.value_length ({value_dim}) differs from "
                f"{p}attention.key_length ({hf['head_dim']}), which fastllm does not support"
            )
    experts = gguf.get(p + "expert_count")
    if experts:
        raise GGUFError(
            f"{gguf.path}: {p}expert_count is {experts}: mixture-of-experts models are not supported"
        )
    head_size = hf.get("head_dim", hidden // heads)

    if arch in ("llama", "qwen2", "qwen3"):
        hf["rms_norm_eps"] = _float(gguf, p + "attention.layer_norm_rms_epsilon", 1e-5)
        hf["rope_theta"] = _float(gguf, p + "rope.freq_base", 10000.0)
        rope_dim = gguf.get(p + "rope.dimension_count")
        if rope_dim is not None and _int(gguf, p + "rope.dimension_count") != head_size:
            raise GGUFError(
                f"{gguf.path}: {p}rope.dimension_count ({rope_dim}) differs from the head size "
                f"({head_size}): partial rotary is not supported for {arch}"
            )
        scaling = _rope_scaling(gguf, p)
        if scaling is not None:
            hf["rope_scaling"] = scaling
        window = gguf.get(p + "attention.sliding_window")
        if window:
            hf["sliding_window"] = _int(gguf, p + "attention.sliding_window")
        if arch == "llama":
            hf["attention_bias"] = "blk.0.attn_q.bias" in tensors
            hf["mlp_bias"] = "blk.0.ffn_up.bias" in tensors
        else:
            hf["use_sliding_window"] = bool(window)
            if arch == "qwen3":
                hf["attention_bias"] = "blk.0.attn_q.bias" in tensors
    elif arch == "phi2":
        hf["layer_norm_eps"] = _float(gguf, p + "attention.layernorm_epsilon", 1e-5)
        hf["rope_theta"] = _float(gguf, p + "rope.freq_base", 10000.0)
        rope_dim = _int(gguf, p + "rope.dimension_count", head_size)
        hf["partial_rotary_factor"] = rope_dim / head_size
        hf["hidden_act"] = "gelu_new"
    else:  # gpt2
        hf["layer_norm_epsilon"] = _float(gguf, p + "attention.layernorm_epsilon", 1e-5)
        hf["activation_function"] = "gelu_new"
        # GPT-2's config names.
        hf["n_embd"] = hf.pop("hidden_size")
        hf["n_layer"] = hf.pop("num_hidden_layers")
        hf["n_head"] = hf.pop("num_attention_heads")
        hf["n_positions"] = hf.pop("max_position_embeddings")
        hf["n_inner"] = hf.pop("intermediate_size")
        hf.pop("num_key_value_heads")

    for gguf_key, hf_key in (
        ("tokenizer.ggml.bos_token_id", "bos_token_id"),
        ("tokenizer.ggml.eos_token_id", "eos_token_id"),
    ):
        value = gguf.get(gguf_key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab:
                raise GGUFError(
                    f"{gguf.path}: metadata key {gguf_key!r} must be a token id, got {value!r}"
                )
            hf[hf_key] = value
    eot = [
        gguf.get(k)
        for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        if isinstance(gguf.get(k), int)
    ]
    if eot:
        eos = hf.get("eos_token_id")
        hf["eos_token_id"] = ([eos] if eos is not None else []) + [t for t in eot if t != eos]
    dtype = _float_dtype(gguf)
    if dtype is not None:
        hf["torch_dtype"] = dtype
    return hf


def _rope_scaling(gguf: GGUFFile, p: str) -> dict[str, Any] | None:
    """rope scaling from ``{arch}.rope.scaling.*`` and a ``rope_freqs.weight`` tensor."""
    kind = gguf.get(p + "rope.scaling.type")
    factor = gguf.get(p + "rope.scaling.factor")
    if "rope_freqs.weight" in gguf.tensors:
        # Llama 3.1-style scaling stored as one divisor per frequency.
        info = gguf.tensors["rope_freqs.weight"]
        if info.type.name != "F32":
            raise GGUFError(
                f"{gguf.path}: tensor 'rope_freqs.weight' must be F32, got {info.type.name}"
            )
        factors = np.frombuffer(gguf.data("rope_freqs.weight"), dtype="<f4").tolist()
        return {"rope_type": "freq_factors", "factors": factors}
    if kind in (None, "none") or (kind == "linear" and factor in (None, 1.0)):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": _float(gguf, p + "rope.scaling.factor")}
    raise GGUFError(
        f"{gguf.path}: {p}rope.scaling.type {kind!r} is not supported; supported: none, linear "
        "(and Llama 3 rope_freqs)"
    )


def _float_dtype(gguf: GGUFFile) -> str | None:
    """The float type of the matrices when the file holds float matrices."""
    kinds = {t.type.name for t in gguf.tensors.values() if len(t.shape) == 2}
    if kinds == {"BF16"}:
        return "bfloat16"
    if kinds == {"F32"}:
        return "float32"
    if kinds == {"F16"}:
        return "float16"
    return None
