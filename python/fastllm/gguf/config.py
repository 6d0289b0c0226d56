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
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "phi3": ("Phi3ForCausalLM", "phi3"),
    "granite": ("GraniteForCausalLM", "granite"),
    "granitemoe": ("GraniteMoeForCausalLM", "granitemoe"),
    "granitehybrid": ("GraniteMoeHybridForCausalLM", "granitemoehybrid"),
    "olmo2": ("Olmo2ForCausalLM", "olmo2"),
    "smollm3": ("SmolLM3ForCausalLM", "smollm3"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "olmoe": ("OlmoeForCausalLM", "olmoe"),
    "gpt-oss": ("GptOssForCausalLM", "gpt_oss"),
    "qwen35": ("Qwen3_5ForCausalLM", "qwen3_5_text"),
    "qwen35moe": ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text"),
    "lfm2": ("Lfm2ForCausalLM", "lfm2"),
    "lfm2moe": ("Lfm2MoeForCausalLM", "lfm2_moe"),
}
# general.architecture -> the Hugging Face text encoder it loads as
# (``gguf/encoder.py``: embedding models, not generation)
ENCODER_ARCHITECTURES: dict[str, str] = {
    "bert": "BertModel",
    "nomic-bert": "NomicBertModel",
}
# A ``llama`` file with ``llama.expert_count`` is Mixtral (llama.cpp runs both
# as ``llama``).
MIXTRAL = ("MixtralForCausalLM", "mixtral")

# Architectures read like Llama (RMSNorm eps, rotary base and scaling, window).
_LLAMA_LIKE = (
    "llama",
    "qwen2",
    "qwen3",
    "granite",
    "granitemoe",
    "olmo2",
    "smollm3",
    "qwen3moe",
    "qwen2moe",
    "olmoe",
    "gpt-oss",
)
# Mixture-of-experts architectures (``llama`` when it has experts), and the
# top-k renormalisation llama.cpp's graph for each hard-codes: its converter
# writes no ``expert_weights_norm`` for them (Mixtral, gpt-oss and Granite
# MoE always renormalise, whatever the key says).
_MOE_ARCHS = ("llama", "qwen3moe", "qwen2moe", "olmoe", "gpt-oss", "granitemoe")
# The hybrid families' mixture-of-experts versions (``_hybrid_moe``).
_HYBRID_MOE_ARCHS = ("qwen35moe", "lfm2moe")
# llama.cpp's ``expert_gating_func`` values.
_GATING_SOFTMAX, _GATING_SIGMOID = 1, 2
_NORM_TOPK_DEFAULT = {"qwen3moe": True, "qwen2moe": False, "olmoe": False}
# gpt-oss's clamped SwiGLU: llama.cpp's constants (``swiglu_oai``).
_SWIGLU_LIMIT, _SWIGLU_ALPHA = 7.0, 1.702
# Layers per model at which llama.cpp scales Gemma's queries by
# hidden / heads instead of the head size (the 27B models; GGUF files do not
# store ``query_pre_attn_scalar``).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def architecture(gguf: GGUFFile) -> str:
    """``general.architecture``, checked against the families fastllm runs."""
    arch = gguf.get("general.architecture")
    if arch is None:
        raise GGUFError(f"{gguf.path}: metadata key 'general.architecture' is missing")
    if arch not in ARCHITECTURES:
        if arch in ENCODER_ARCHITECTURES:
            raise GGUFError(
                f"{gguf.path}: general.architecture {arch!r} is a text encoder: it embeds "
                "(runner='pooling', LLM.embed), it does not generate"
            )
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
    p = f"{arch}."
    experts = gguf.get(p + "expert_count")
    hf_arch, model_type = MIXTRAL if arch == "llama" and experts else ARCHITECTURES[arch]
    tensors = gguf.tensors
    if "token_embd.weight" not in tensors:
        raise GGUFError(f"{gguf.path}: tensor 'token_embd.weight' is missing")
    # The embedding's rows are the model's vocabulary: llama.cpp's Gemma 3
    # converter cuts the rows past the tokenizer's tokens but may keep the
    # config's larger vocab_size in the metadata.
    vocab = tensors["token_embd.weight"].shape[0]
    hidden = _int(gguf, p + "embedding_length")
    heads = _int(gguf, p + "attention.head_count")
    if arch in ("lfm2", "lfm2moe"):  # one count per layer: 0 for the convolution layers
        kv_heads, lfm2_types = _lfm2_layers(gguf, p, heads)
    elif arch == "granitehybrid":  # the same: 0 for the Mamba-2 layers
        kv_heads, granite_types = _lfm2_layers(gguf, p, heads, "linear_attention")
    else:
        kv_heads = _int(gguf, p + "attention.head_count_kv", heads)
    hf: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "num_hidden_layers": _int(gguf, p + "block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": _int(gguf, p + "context_length"),
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    # Qwen3.5-MoE has no dense MLP, and its files may leave the width out:
    # the config then takes the shared expert's (``config._text_part``).
    if arch != "qwen35moe" or gguf.get(p + "feed_forward_length") is not None:
        hf["intermediate_size"] = _int(gguf, p + "feed_forward_length")
    head_dim = gguf.get(p + "attention.key_length")
    if head_dim is not None:
        hf["head_dim"] = _int(gguf, p + "attention.key_length")
        value_dim = _int(gguf, p + "attention.value_length", hf["head_dim"])
        if value_dim != hf["head_dim"]:
            raise GGUFError(
                f"{gguf.path}: {p}attention.value_length ({value_dim}) differs from "
                f"{p}attention.key_length ({hf['head_dim']}), which fastllm does not support"
            )
    if experts and arch not in _MOE_ARCHS + _HYBRID_MOE_ARCHS + ("granitehybrid",):
        raise GGUFError(
            f"{gguf.path}: {p}expert_count is {experts}: mixture-of-experts {arch} files are "
            f"not supported; supported: {', '.join(_MOE_ARCHS + _HYBRID_MOE_ARCHS)}"
        )
    head_size = hf.get("head_dim", hidden // heads)

    if arch in _LLAMA_LIKE:
        _llama_like(gguf, arch, p, hf, head_size)
        if experts or arch in _MOE_ARCHS[1:]:
            _moe(gguf, arch, p, hf)
    elif arch in ("gemma2", "gemma3"):
        _gemma(gguf, arch, p, hf, head_size)
    elif arch == "phi3":
        _phi3(gguf, p, hf, head_size)
    elif arch in ("qwen35", "qwen35moe"):
        _qwen35(gguf, p, hf, head_size)
        if arch in _HYBRID_MOE_ARCHS:
            _hybrid_moe(gguf, arch, p, hf)
    elif arch == "granitehybrid":
        _granite_hybrid(gguf, p, hf, granite_types)
    elif arch in ("lfm2", "lfm2moe"):
        _lfm2(gguf, p, hf, head_size, lfm2_types)
        if arch in _HYBRID_MOE_ARCHS:
            _hybrid_moe(gguf, arch, p, hf)
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


def _llama_like(gguf: GGUFFile, arch: str, p: str, hf: dict[str, Any], head_size: int) -> None:
    """The Llama-style families: norm epsilon, rotary base and scaling, the
    window, biases, and Granite's multipliers / SmolLM3's NoPE rule."""
    tensors = gguf.tensors
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
    if arch in ("llama", "granite", "granitemoe", "smollm3"):
        hf["attention_bias"] = "blk.0.attn_q.bias" in tensors
        hf["mlp_bias"] = "blk.0.ffn_up.bias" in tensors
    elif arch in ("qwen2", "qwen3", "qwen2moe", "qwen3moe"):
        hf["use_sliding_window"] = bool(window)
        if arch in ("qwen3", "qwen3moe"):
            hf["attention_bias"] = "blk.0.attn_q.bias" in tensors
        elif arch == "qwen2moe":
            hf["qkv_bias"] = "blk.0.attn_q.bias" in tensors
    if window:
        _layer_types(gguf, p, hf)
    if arch in ("granite", "granitemoe"):
        _granite_multipliers(gguf, p, hf)
    elif arch == "smollm3":
        # llama.cpp's rule for SmolLM3: every 4th layer has no rotary embedding.
        hf["no_rope_layer_interval"] = 4
    elif arch in ("olmo2", "olmoe", "gpt-oss"):
        hf["attention_bias"] = "blk.0.attn_q.bias" in tensors


def _granite_multipliers(gguf: GGUFFile, p: str, hf: dict[str, Any]) -> None:
    """Granite's four multipliers, where the file has them."""
    for key, name in (
        ("embedding_scale", "embedding_multiplier"),
        ("attention.scale", "attention_multiplier"),
        ("residual_scale", "residual_multiplier"),
        ("logit_scale", "logits_scaling"),
    ):
        if gguf.get(p + key) is not None:
            hf[name] = _float(gguf, p + key)


def _granite_hybrid(gguf: GGUFFile, p: str, hf: dict[str, Any], types: list[str]) -> None:
    """Granite 4.0's hybrids (``granitehybrid``): Granite's multipliers; the
    Mamba-2 layers (``attention.head_count_kv`` 0) from the ``ssm.*`` keys
    (``time_step_rank`` heads sharing ``inner_size``, ``group_count`` groups
    of ``state_size``, ``conv_kernel`` taps) and their tensors' biases;
    rotary only where ``rope.scaling.finetuned`` is true or absent
    (llama.cpp's switch: the converter writes false for the hybrids); the
    experts' keys, and the dense MLP's width (the shared expert's with
    experts)."""
    tensors, n = gguf.tensors, hf["num_hidden_layers"]
    hf["rms_norm_eps"] = _float(gguf, p + "attention.layer_norm_rms_epsilon", 1e-5)
    hf["rope_theta"] = _float(gguf, p + "rope.freq_base", 10000.0)
    scaling = _rope_scaling(gguf, p)
    if scaling is not None:
        hf["rope_scaling"] = scaling
    rope = gguf.get(p + "rope.scaling.finetuned", True)
    if not isinstance(rope, bool):
        raise GGUFError(
            f"{gguf.path}: metadata key {p + 'rope.scaling.finetuned'!r} must be a bool, "
            f"got {rope!r}"
        )
    hf["position_embedding_type"] = "rope" if rope else None
    _granite_multipliers(gguf, p, hf)
    hf["layer_types"] = types
    heads, inner = _int(gguf, p + "ssm.time_step_rank"), _int(gguf, p + "ssm.inner_size")
    if inner % heads or inner % hf["hidden_size"]:
        raise GGUFError(
            f"{gguf.path}: {p}ssm.inner_size ({inner}) must be a multiple of "
            f"{p}ssm.time_step_rank ({heads}) and of the embedding length ({hf['hidden_size']})"
        )
    hf.update(
        mamba_n_heads=heads,
        mamba_d_head=inner // heads,
        mamba_expand=inner // hf["hidden_size"],
        mamba_n_groups=_int(gguf, p + "ssm.group_count"),
        mamba_d_state=_int(gguf, p + "ssm.state_size"),
        mamba_d_conv=_int(gguf, p + "ssm.conv_kernel"),
    )
    ssm = next((i for i, t in enumerate(types) if t == "linear_attention"), 0)
    attn = next((i for i, t in enumerate(types) if t == "full_attention"), 0)
    hf["mamba_conv_bias"] = f"blk.{ssm}.ssm_conv1d.bias" in tensors
    hf["mamba_proj_bias"] = f"blk.{ssm}.ssm_in.bias" in tensors
    hf["attention_bias"] = f"blk.{attn}.attn_q.bias" in tensors
    experts = gguf.get(p + "expert_count") or 0
    hf["num_local_experts"] = experts
    if experts:
        hf["num_experts_per_tok"] = _int(gguf, p + "expert_used_count")
        _, first, hf["intermediate_size"] = _experts(gguf, p, n)
        shared = _shared_width(gguf, p, first)
        if shared is None:
            raise GGUFError(f"{gguf.path}: tensor '{first}.ffn_down_shexp.weight' is missing")
        hf["shared_intermediate_size"] = shared
    else:
        down = tensors.get("blk.0.ffn_down.weight")
        if down is None:
            raise GGUFError(f"{gguf.path}: tensor 'blk.0.ffn_down.weight' is missing")
        hf["shared_intermediate_size"] = int(down.shape[-1])


def _moe(gguf: GGUFFile, arch: str, p: str, hf: dict[str, Any]) -> None:
    """The experts: their number, the top-k, their size (the key, or the
    stacked tensors' shape), Qwen's dense layers (those without a router)
    and shared expert, the top-k renormalisation (``expert_weights_norm``, or
    what llama.cpp assumes for the family), OLMoE's q/k/v clip
    (``attention.clamp_kqv``), and gpt-oss's windows, YaRN and SwiGLU clamp."""
    n = hf["num_hidden_layers"]
    experts = _int(gguf, p + "expert_count")
    hf["num_experts" if arch in _NORM_TOPK_DEFAULT else "num_local_experts"] = experts
    hf["num_experts_per_tok"] = _int(gguf, p + "expert_used_count")
    sparse, first, inter = _experts(gguf, p, n)
    if arch in ("qwen3moe", "qwen2moe"):
        hf["moe_intermediate_size"] = inter
        hf["decoder_sparse_step"] = 1
        hf["mlp_only_layers"] = [i for i in range(n) if i not in sparse]
    else:
        hf["intermediate_size"] = inter
    if arch == "qwen2moe":
        hf["shared_expert_intermediate_size"] = _shared_width(gguf, p, first) or 0
    if arch in _NORM_TOPK_DEFAULT:
        norm = gguf.get(p + "expert_weights_norm", _NORM_TOPK_DEFAULT[arch])
        if not isinstance(norm, bool):
            raise GGUFError(
                f"{gguf.path}: metadata key {p + 'expert_weights_norm'!r} must be a bool, "
                f"got {norm!r}"
            )
        hf["norm_topk_prob"] = norm
    if arch == "olmoe" and gguf.get(p + "attention.clamp_kqv") is not None:
        hf["clip_qkv"] = _float(gguf, p + "attention.clamp_kqv")
    if arch == "gpt-oss":
        _gpt_oss(gguf, p, hf)


def _experts(gguf: GGUFFile, p: str, n: int) -> tuple[list[int], str, int]:
    """The layers with a router (``ffn_gate_inp``), the first one's tensor
    prefix, and the experts' width (``expert_feed_forward_length``, or the
    stacked tensors' shape)."""
    tensors = gguf.tensors
    sparse = [i for i in range(n) if f"blk.{i}.ffn_gate_inp.weight" in tensors]
    first = f"blk.{sparse[0] if sparse else 0}"
    down = tensors.get(f"{first}.ffn_down_exps.weight")
    inter = down.shape[-1] if down is not None and len(down.shape) == 3 else None
    return sparse, first, _int(gguf, p + "expert_feed_forward_length", inter)


def _shared_width(gguf: GGUFFile, p: str, first: str) -> int | None:
    """The shared expert's width (``expert_shared_feed_forward_length``, or
    its tensor's shape in layer ``first``); None without a shared expert."""
    shared = gguf.tensors.get(f"{first}.ffn_down_shexp.weight")
    if shared is None:
        return None
    return _int(gguf, p + "expert_shared_feed_forward_length", shared.shape[-1])


def _hybrid_moe(gguf: GGUFFile, arch: str, p: str, hf: dict[str, Any]) -> None:
    """Qwen3.5-MoE and LFM2-MoE: the experts' number, top-k and width (the
    key, or the stacked tensors' shape); Qwen3.5-MoE's shared expert (softmax
    top-k, always renormalised); LFM2-MoE's leading dense layers
    (``leading_dense_block_count``), sigmoid gating (``expert_gating_func``),
    selection bias (``exp_probs_b``), renormalisation (``expert_weights_norm``,
    llama.cpp's graph renormalises) and scale (``expert_weights_scale``)."""
    tensors = gguf.tensors
    n = hf["num_hidden_layers"]
    hf["num_experts"] = _int(gguf, p + "expert_count")
    hf["num_experts_per_tok"] = _int(gguf, p + "expert_used_count")
    sparse, first, hf["moe_intermediate_size"] = _experts(gguf, p, n)
    gating = gguf.get(p + "expert_gating_func")
    want = _GATING_SIGMOID if arch == "lfm2moe" else _GATING_SOFTMAX
    if gating is not None and gating != want:
        raise GGUFError(
            f"{gguf.path}: metadata key {p + 'expert_gating_func'!r} is {gating!r}; "
            f"{arch} routes by {'sigmoid' if want == _GATING_SIGMOID else 'softmax'} ({want})"
        )
    if arch == "qwen35moe":
        key = p + "expert_shared_feed_forward_length"
        hf["shared_expert_intermediate_size"] = _shared_width(gguf, p, first) or _int(gguf, key)
        return
    dense = gguf.get(p + "leading_dense_block_count") or 0
    if isinstance(dense, bool) or not isinstance(dense, int) or dense < 0:
        raise GGUFError(
            f"{gguf.path}: metadata key {p + 'leading_dense_block_count'!r} must be a count, "
            f"got {dense!r}"
        )
    if sparse and sparse != list(range(dense, n)):
        raise GGUFError(
            f"{gguf.path}: routers (ffn_gate_inp) in layers {sparse}, expected layers "
            f"{dense} to {n - 1} after {p}leading_dense_block_count ({dense})"
        )
    hf["num_dense_layers"] = dense
    hf["use_expert_bias"] = f"{first}.exp_probs_b.bias" in tensors
    norm = gguf.get(p + "expert_weights_norm", True)
    if not isinstance(norm, bool):
        raise GGUFError(
            f"{gguf.path}: metadata key {p + 'expert_weights_norm'!r} must be a bool, got {norm!r}"
        )
    hf["norm_topk_prob"] = norm
    hf["routed_scaling_factor"] = _float(gguf, p + "expert_weights_scale", 1.0)


def _gpt_oss(gguf: GGUFFile, p: str, hf: dict[str, Any]) -> None:
    """gpt-oss: sliding and full layers alternating from a sliding one
    (llama.cpp's default pattern, 2) unless the file gives them; YaRN as
    its checkpoints define it, without rounding the ramp's ends
    (``truncate: false``, which no key holds; llama.cpp rounds them); the
    SwiGLU clamp ``swiglu_clamp_exp`` (llama.cpp's 7.0 otherwise) and alpha
    1.702 (no key)."""
    n = hf["num_hidden_layers"]
    hf["sliding_window"] = _int(gguf, p + "attention.sliding_window")
    if "layer_types" not in hf:
        hf["layer_types"] = [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)
        ]
    scaling = hf.get("rope_scaling")
    if scaling is not None and scaling.get("rope_type") == "yarn":
        scaling["truncate"] = False
    key = p + "swiglu_clamp_exp"
    limit = gguf.get(key)
    if isinstance(limit, np.ndarray):
        if limit.size != n or not (limit == limit.flat[0]).all():
            raise GGUFError(
                f"{gguf.path}: metadata key {key!r} must be one value for every layer, "
                f"got {limit.tolist()}"
            )
        limit = float(limit.flat[0])
    else:
        limit = _float(gguf, key, _SWIGLU_LIMIT)
    # 0 is llama.cpp's "no clamp set" for this key: gpt-oss's own clamp then.
    hf["swiglu_limit"] = limit or _SWIGLU_LIMIT
    hf["swiglu_alpha"] = _SWIGLU_ALPHA


def _layer_types(gguf: GGUFFile, p: str, hf: dict[str, Any]) -> None:
    """``layer_types`` from ``{arch}.attention.sliding_window_pattern``: one
    flag per layer, or a period (the last layer of each period is global).
    Without it the family's default holds (``ModelConfig.layer_attention_types``:
    Gemma 2 alternates, Gemma 3 has a period of 6, as llama.cpp assumes; the
    others window every layer)."""
    n = hf["num_hidden_layers"]
    key = p + "attention.sliding_window_pattern"
    value = gguf.get(key)
    if value is None:
        return
    if isinstance(value, (np.ndarray, list)):
        flags = [bool(v) for v in np.asarray(value).reshape(-1).tolist()]
        if len(flags) != n:
            raise GGUFError(
                f"{gguf.path}: metadata key {key!r} has {len(flags)} entries for {n} layers"
            )
    else:
        period = _int(gguf, key)
        flags = [(i % period) < period - 1 for i in range(n)]
    hf["layer_types"] = ["sliding_attention" if f else "full_attention" for f in flags]


def _gemma(gguf: GGUFFile, arch: str, p: str, hf: dict[str, Any], head_size: int) -> None:
    """Gemma 2 / 3: soft-caps, windows, the query scale llama.cpp infers, the
    local layers' rotary base; what the file leaves out takes the family's
    defaults (``config._FAMILY_DEFAULTS``, llama.cpp's too). The converter
    stores the norms as ``1 + w``; the loader reads GGUF norms as stored."""
    hf["rms_norm_eps"] = _float(gguf, p + "attention.layer_norm_rms_epsilon", 1e-6)
    hf["rope_theta"] = _float(gguf, p + "rope.freq_base", 10000.0)
    hf["head_dim"] = head_size
    for key, name in (
        ("attn_logit_softcapping", "attn_logit_softcapping"),
        ("final_logit_softcapping", "final_logit_softcapping"),
        ("attention.sliding_window", "sliding_window"),
        ("rope.freq_base_swa", "rope_local_base_freq"),
    ):
        if gguf.get(p + key):
            hf[name] = _float(gguf, p + key)
    if "sliding_window" in hf:
        hf["sliding_window"] = _int(gguf, p + "attention.sliding_window")
        _layer_types(gguf, p, hf)
    elif arch == "gemma3":  # no window: every layer global
        hf["sliding_window"] = None
    if arch == "gemma3":
        hf["final_logit_softcapping"] = hf.get("final_logit_softcapping")
        scaling = _rope_scaling(gguf, p)  # the global layers' (legacy fields)
        if scaling is not None:
            hf["rope_scaling"] = scaling
    if hf["num_hidden_layers"] == _GEMMA_27B_LAYERS[arch]:
        hf["query_pre_attn_scalar"] = hf["hidden_size"] // hf["num_attention_heads"]
    else:
        hf["query_pre_attn_scalar"] = head_size


def _phi3(gguf: GGUFFile, p: str, hf: dict[str, Any], head_size: int) -> None:
    """Phi-3 / Phi-4-mini: partial rotary, the window, LongRoPE's factor
    tensors with the attention factor and original context the converter wrote."""
    hf["rms_norm_eps"] = _float(gguf, p + "attention.layer_norm_rms_epsilon", 1e-5)
    rope_dim = _int(gguf, p + "rope.dimension_count", head_size)
    hf["partial_rotary_factor"] = rope_dim / head_size
    window = gguf.get(p + "attention.sliding_window")
    if window:
        hf["sliding_window"] = _int(gguf, p + "attention.sliding_window")
    rope: dict[str, Any] = {"rope_theta": _float(gguf, p + "rope.freq_base", 10000.0)}
    if "rope_factors_long.weight" in gguf.tensors:
        rope["rope_type"] = "longrope"
        for name, key in (("long", "long_factor"), ("short", "short_factor")):
            tensor = f"rope_factors_{name}.weight"
            info = gguf.tensors.get(tensor)
            if info is None or info.type.name != "F32" or info.shape != (rope_dim // 2,):
                raise GGUFError(
                    f"{gguf.path}: tensor {tensor!r} must be F32 with {rope_dim // 2} values"
                )
            rope[key] = np.frombuffer(gguf.data(tensor), dtype="<f4").tolist()
        rope["original_max_position_embeddings"] = _int(
            gguf, p + "rope.scaling.original_context_length"
        )
        factor = gguf.get(p + "rope.scaling.attn_factor")
        if factor is not None:
            rope["attention_factor"] = _float(gguf, p + "rope.scaling.attn_factor")
    hf["rope_parameters"] = rope


def _flags(gguf: GGUFFile, key: str, n: int) -> list[bool] | None:
    """Metadata ``key`` as one flag per layer (its first ``n`` entries: a
    Qwen3.5 file lists its multi-token-prediction layers after the model's),
    or None when the file lacks it."""
    value = gguf.get(key)
    if value is None:
        return None
    flags = [bool(v) for v in np.asarray(value).reshape(-1).tolist()]
    if len(flags) < n:
        raise GGUFError(
            f"{gguf.path}: metadata key {key!r} has {len(flags)} entries for {n} layers"
        )
    return flags[:n]


def _qwen35(gguf: GGUFFile, p: str, hf: dict[str, Any], head_size: int) -> None:
    """Qwen3.5 (text): the Gated DeltaNet layers' sizes from the ``ssm.*``
    keys as llama.cpp names them (``group_count`` key heads of
    ``state_size``, ``time_step_rank`` value heads sharing ``inner_size``,
    ``conv_kernel`` taps), which layers are recurrent
    (``attention.recurrent_layers``, else every ``full_attention_interval``-th
    layer attends), partial rotary from ``rope.dimension_count``. The blocks
    past ``block_count - nextn_predict_layers`` are multi-token-prediction
    heads, which fastllm does not run. ``rope.dimension_sections`` (MRoPE)
    is left out: a text prompt's positions are equal on every axis, where
    MRoPE is the plain rotary embedding."""
    nextn = gguf.get(p + "nextn_predict_layers") or 0
    if isinstance(nextn, bool) or not isinstance(nextn, int) or nextn < 0:
        raise GGUFError(
            f"{gguf.path}: metadata key {p + 'nextn_predict_layers'!r} must be a count, "
            f"got {nextn!r}"
        )
    n = hf["num_hidden_layers"] - nextn
    if n <= 0:
        raise GGUFError(
            f"{gguf.path}: {p}nextn_predict_layers ({nextn}) leaves no layers of "
            f"{p}block_count ({hf['num_hidden_layers']})"
        )
    hf["num_hidden_layers"] = n
    hf["rms_norm_eps"] = _float(gguf, p + "attention.layer_norm_rms_epsilon", 1e-6)
    hf["rope_theta"] = _float(gguf, p + "rope.freq_base", 10000.0)
    rope_dim = _int(gguf, p + "rope.dimension_count", head_size)
    if rope_dim > head_size or rope_dim % 2:
        raise GGUFError(
            f"{gguf.path}: {p}rope.dimension_count ({rope_dim}) must be even and at most the "
            f"head size ({head_size})"
        )
    hf["partial_rotary_factor"] = rope_dim / head_size
    scaling = _rope_scaling(gguf, p)
    if scaling is not None:
        hf["rope_scaling"] = scaling
    value_heads = _int(gguf, p + "ssm.time_step_rank")
    inner = _int(gguf, p + "ssm.inner_size")
    if inner % value_heads:
        raise GGUFError(
            f"{gguf.path}: {p}ssm.inner_size ({inner}) is not a multiple of "
            f"{p}ssm.time_step_rank ({value_heads}), the value heads"
        )
    hf["linear_num_key_heads"] = _int(gguf, p + "ssm.group_count")
    hf["linear_num_value_heads"] = value_heads
    hf["linear_key_head_dim"] = _int(gguf, p + "ssm.state_size")
    hf["linear_value_head_dim"] = inner // value_heads
    hf["linear_conv_kernel_dim"] = _int(gguf, p + "ssm.conv_kernel")
    interval = _int(gguf, p + "full_attention_interval", 4)
    hf["full_attention_interval"] = interval
    recurrent = _flags(gguf, p + "attention.recurrent_layers", n)
    if recurrent is None:
        recurrent = [(i + 1) % interval != 0 for i in range(n)]
    hf["layer_types"] = ["linear_attention" if r else "full_attention" for r in recurrent]
    attn = [i for i, r in enumerate(recurrent) if not r]
    hf["attention_bias"] = bool(attn) and any(
        f"blk.{attn[0]}.{t}.bias" in gguf.tensors for t in ("attn_q", "attn_qkv")
    )


def _lfm2_layers(
    gguf: GGUFFile, p: str, heads: int, recurrent: str = "conv"
) -> tuple[int, list[str]]:
    """LFM2's (and Granite 4.0's) key/value heads and layer types from
    ``attention.head_count_kv``, which the converter writes per layer: 0 for
    a convolution (``recurrent``) layer, as llama.cpp reads it, the count for
    an attention layer."""
    key = p + "attention.head_count_kv"
    n = _int(gguf, p + "block_count")
    value = _value(gguf, key, None)
    counts = np.asarray(value).reshape(-1).tolist()
    if isinstance(value, np.ndarray | list):
        if len(counts) != n:
            raise GGUFError(
                f"{gguf.path}: metadata key {key!r} has {len(counts)} entries for {n} layers"
            )
    else:
        counts = counts * n
    if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts):
        raise GGUFError(f"{gguf.path}: metadata key {key!r} must hold counts, got {counts}")
    attention = sorted({c for c in counts if c})
    if len(attention) > 1:
        raise GGUFError(
            f"{gguf.path}: metadata key {key!r} gives the attention layers different "
            f"key/value head counts ({counts}), which fastllm does not support"
        )
    types = ["full_attention" if c else recurrent for c in counts]
    return (attention[0] if attention else heads), types


def _lfm2(gguf: GGUFFile, p: str, hf: dict[str, Any], head_size: int, types: list[str]) -> None:
    """LFM2: the convolution width (``shortconv.l_cache``), which layers
    attend (``_lfm2_layers``), biases of the convolution layers, and the MLP
    width as the file stores it (the converter writes the adjusted one)."""
    hf["norm_eps"] = _float(gguf, p + "attention.layer_norm_rms_epsilon", 1e-5)
    hf["rope_theta"] = _float(gguf, p + "rope.freq_base", 10000.0)
    rope_dim = gguf.get(p + "rope.dimension_count")
    if rope_dim is not None and _int(gguf, p + "rope.dimension_count") != head_size:
        raise GGUFError(
            f"{gguf.path}: {p}rope.dimension_count ({rope_dim}) differs from the head size "
            f"({head_size}): partial rotary is not supported for lfm2"
        )
    if gguf.get(p + "attention.sliding_window"):
        raise GGUFError(
            f"{gguf.path}: {p}attention.sliding_window is set: windowed LFM2 attention "
            "is not supported"
        )
    scaling = _rope_scaling(gguf, p)
    if scaling is not None:
        hf["rope_scaling"] = scaling
    hf["conv_L_cache"] = _int(gguf, p + "shortconv.l_cache")
    hf["layer_types"] = types
    hf["full_attn_idxs"] = [i for i, t in enumerate(types) if t == "full_attention"]
    conv = [i for i, t in enumerate(types) if t == "conv"]
    hf["conv_bias"] = bool(conv) and f"blk.{conv[0]}.shortconv.in_proj.bias" in gguf.tensors
    hf["block_auto_adjust_ff_dim"] = False


def _rope_scaling(gguf: GGUFFile, p: str) -> dict[str, Any] | None:
    """rope scaling from ``{arch}.rope.scaling.*`` (linear, YaRN) and a
    ``rope_freqs.weight`` tensor."""
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
    if kind == "yarn":  # Qwen2.5 / Qwen3 long context, as the converter writes it
        scaling: dict[str, Any] = {
            "rope_type": "yarn",
            "factor": _float(gguf, p + "rope.scaling.factor"),
            "original_max_position_embeddings": _int(
                gguf, p + "rope.scaling.original_context_length"
            ),
        }
        for key, name in (
            ("yarn_beta_fast", "beta_fast"),
            ("yarn_beta_slow", "beta_slow"),
            ("yarn_attn_factor", "attention_factor"),
        ):
            if gguf.get(p + "rope.scaling." + key) is not None:
                scaling[name] = _float(gguf, p + "rope.scaling." + key)
        return scaling
    raise GGUFError(
        f"{gguf.path}: {p}rope.scaling.type {kind!r} is not supported; supported: none, linear, "
        "yarn (and Llama 3 rope_freqs)"
    )


# Matrices the converter writes in F32 whatever the file's type.
_F32_MATRICES = (".ssm_conv1d.weight", ".shortconv.conv.weight")


def _float_dtype(gguf: GGUFFile) -> str | None:
    """The float type of the matrices when the file holds float matrices (the
    convolutions, which the converter always writes in F32, aside)."""
    kinds = {
        t.type.name
        for name, t in gguf.tensors.items()
        if len(t.shape) == 2 and not name.endswith(_F32_MATRICES)
    }
    if kinds == {"BF16"}:
        return "bfloat16"
    if kinds == {"F32"}:
        return "float32"
    if kinds == {"F16"}:
        return "float16"
    return None
