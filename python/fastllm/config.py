"""Configuration: the model's ``config.json``, the engine's settings, and the
dtype rules of DESIGN.md.

This module does not import torch: the engine reads the configuration before it
decides on a device or a dtype.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("fastllm")

# GPT-2 spells the common fields differently; these map them to the usual names.
_GPT2_NAMES = {
    "hidden_size": "n_embd",
    "num_hidden_layers": "n_layer",
    "num_attention_heads": "n_head",
    "max_position_embeddings": "n_positions",
    "intermediate_size": "n_inner",
}
#: DistilBERT's names for the same fields
DISTILBERT_NAMES = {
    "hidden_size": "dim",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "intermediate_size": "hidden_dim",
}


def _field_names(model_type: str, hf: dict[str, Any]) -> dict[str, str]:
    """The config's own names of the fields it names unlike Llama's: GPT-2's
    (which the original Nomic BERT release uses too) or DistilBERT's."""
    if model_type == "gpt2" or (model_type == "nomic_bert" and "n_embd" in hf):
        return _GPT2_NAMES
    return DISTILBERT_NAMES if model_type == "distilbert" else {}


# Multimodal checkpoints whose text part fastllm runs, with the text model's
# ``model_type``: the ``text_config`` becomes the model's config (fields it
# leaves out take the text model's defaults below), and the weights are found
# under the text model's prefix.
TEXT_PART_ARCHITECTURES = {
    "Gemma3ForConditionalGeneration": "gemma3_text",
    "Qwen3_5ForConditionalGeneration": "qwen3_5_text",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe_text",
}

# Fields a multimodal checkpoint's top level decides for its text part (with
# the multimodal configuration class's default): Qwen3.5 ties the head by the
# top-level flag, whatever ``text_config`` says.
_TOP_LEVEL_FIELDS: dict[str, dict[str, Any]] = {
    "Qwen3_5ForConditionalGeneration": {"tie_word_embeddings": False},
    "Qwen3_5MoeForConditionalGeneration": {"tie_word_embeddings": False},
}

#: ``layer_types`` entries of a hybrid model's recurrent layers (no KV cache:
#: ``layers/recurrent.py``): Qwen3.5's Gated DeltaNet, LFM2's short convolutions.
RECURRENT_LAYER_TYPES = ("linear_attention", "conv")


def causal_lm_architecture(arch: str) -> str:
    """The architecture a checkpoint runs as: a base model saved without its
    head (``Qwen3Model``: an embedder such as Qwen3-Embedding) as its family's
    ``...ForCausalLM``, when fastllm has that one; anything else as it is."""
    from fastllm.models import ARCHITECTURES

    if arch.endswith("Model") and arch not in ARCHITECTURES:
        causal = arch[: -len("Model")] + "ForCausalLM"
        if causal in ARCHITECTURES:
            return causal
    return arch


# Defaults of fields a config may leave out, by ``model_type``: the values
# the family's reference configuration class uses (Gemma 3's multimodal
# checkpoints list only the text fields that differ from these).
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3_text": {
        "vocab_size": 262_208,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131_072,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "tie_word_embeddings": True,
    },
    "gemma2": {
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0,
        "tie_word_embeddings": True,
    },
}
_FAMILY_DEFAULTS["gemma3"] = _FAMILY_DEFAULTS["gemma3_text"]
_FAMILY_DEFAULTS["qwen3_5_text"] = {
    "head_dim": 256,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
}
_FAMILY_DEFAULTS["qwen3_5_moe_text"] = {
    **_FAMILY_DEFAULTS["qwen3_5_text"],
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
}
_FAMILY_DEFAULTS["lfm2"] = {
    "rope_theta": 1_000_000.0,
    "max_position_embeddings": 128_000,
    "tie_word_embeddings": True,
}
_FAMILY_DEFAULTS["lfm2_moe"] = {
    **_FAMILY_DEFAULTS["lfm2"],
    "intermediate_size": 7168,
    "moe_intermediate_size": 1792,
    "num_experts": 32,
    "num_experts_per_tok": 4,
    "num_dense_layers": 2,
    "use_expert_bias": True,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.0,
}
# Older names of fields, by ``model_type`` (LFM2's first configs).
_FAMILY_ALIASES: dict[str, dict[str, str]] = {
    "lfm2": {"tie_embedding": "tie_word_embeddings", "block_ff_dim": "intermediate_size"},
    "lfm2_moe": {"tie_embedding": "tie_word_embeddings"},
}


def _text_part(hf: dict[str, Any], path: str) -> dict[str, Any]:
    """The config of the model fastllm runs: ``hf`` itself, or the text part
    of a multimodal checkpoint (``TEXT_PART_ARCHITECTURES``), with the
    family's defaults filled in for the fields it leaves out."""
    archs = hf.get("architectures")
    if isinstance(archs, list) and archs and archs[0] in TEXT_PART_ARCHITECTURES:
        text = hf.get("text_config")
        if not isinstance(text, dict):
            raise ValueError(f"{path}: {archs[0]} needs a 'text_config' object")
        merged = dict(text)
        merged.setdefault("model_type", TEXT_PART_ARCHITECTURES[archs[0]])
        for key in ("eos_token_id", "bos_token_id", "pad_token_id", "dtype", "torch_dtype"):
            if merged.get(key) is None and hf.get(key) is not None:
                merged[key] = hf[key]
        for key, default in _TOP_LEVEL_FIELDS.get(archs[0], {}).items():
            merged[key] = hf.get(key, default)
        merged["architectures"] = [archs[0]]
        merged["text_part_of"] = archs[0]
        hf = merged
    if hf.get("model_type") == "granitemoehybrid":
        hf = _granite4(hf, path)
    aliases = _FAMILY_ALIASES.get(str(hf.get("model_type")), {})
    if any(old in hf and new not in hf for old, new in aliases.items()):
        hf = {**hf, **{new: hf[old] for old, new in aliases.items() if old in hf and new not in hf}}
    defaults = _FAMILY_DEFAULTS.get(str(hf.get("model_type")))
    if defaults:
        hf = {**{k: v for k, v in defaults.items() if k not in hf}, **hf}
    if hf.get("intermediate_size") is None:
        # Qwen3.5-MoE has no dense MLP and no intermediate_size: its shared
        # expert's (or an expert's) width stands in for it.
        for key in ("shared_expert_intermediate_size", "moe_intermediate_size"):
            if hf.get(key):
                hf = {**hf, "intermediate_size": hf[key]}
                break
    return hf


def _granite4(hf: dict[str, Any], path: str) -> dict[str, Any]:
    """Granite 4.0 (``granitemoehybrid``) with its ``layer_types`` (or
    ``layers_block_type``) in the common words: ``"mamba"`` layers as
    ``"linear_attention"``, ``"attention"`` ones as ``"full_attention"``.
    Without the list every layer is Mamba-2, as transformers builds it."""
    types = hf.get("layer_types", hf.get("layers_block_type"))
    if types is None:
        n = hf.get("num_hidden_layers", 32)
        types = ["mamba"] * n if isinstance(n, int) else types
    words = {
        "mamba": "linear_attention",
        "linear_attention": "linear_attention",
        "attention": "full_attention",
        "full_attention": "full_attention",
    }
    if not isinstance(types, list) or any(not isinstance(t, str) or t not in words for t in types):
        raise ValueError(
            f"{path}: Granite 4.0's layer_types must be a list of 'mamba' and 'attention', "
            f"got {types!r}"
        )
    if "shared_intermediate_size" not in hf:
        raise ValueError(f"{path}: Granite 4.0 needs 'shared_intermediate_size'")
    return {**hf, "layer_types": [words[t] for t in types]}


def _non_finite(obj: dict[str, Any]) -> Any:
    """transformers 5 writes a non-finite float as ``{"__float__": "Infinity"}``
    (Granite 4.0's ``time_step_limit``): read back as the float."""
    if len(obj) == 1 and isinstance(obj.get("__float__"), str):
        try:
            return float(obj["__float__"])
        except ValueError:
            return obj
    return obj


def _read_json(path: str, what: str) -> dict[str, Any]:
    """Reads one JSON object from ``path``; errors name the file."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f, object_hook=_non_finite)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} not found: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{what} is not valid JSON: {path}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what} must hold a JSON object, got {type(data).__name__}: {path}")
    return data


def _token_ids(value: Any, name: str, path: str) -> list[int]:
    """Normalises an eos/bos id field (None, int or list of ints) to a list."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    for v in values:
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(
                f"{path}: {name!r} must be a non-negative integer or a list of them, got {value!r}"
            )
    return list(values)


@dataclass
class ModelConfig:
    """The fields of a Hugging Face ``config.json`` that fastllm's models use."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    sliding_window: int | None
    tie_word_embeddings: bool
    torch_dtype: str | None
    eos_token_ids: list[int]
    bos_token_id: int | None
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # None or a dict with "rope_type"
    partial_rotary_factor: float = 1.0
    hf: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_pretrained(cls, folder: str) -> ModelConfig:
        """Reads ``config.json`` (and ``generation_config.json`` if present) from ``folder``."""
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"model folder not found: {folder}")
        path = os.path.join(folder, "config.json")
        hf = _read_json(path, "config.json")
        gen_path = os.path.join(folder, "generation_config.json")
        gen = _read_json(gen_path, "generation_config.json") if os.path.isfile(gen_path) else {}
        return cls.from_dict(hf, path=path, generation_config=gen, generation_path=gen_path)

    @classmethod
    def from_dict(
        cls,
        hf: dict[str, Any],
        path: str = "config.json",
        generation_config: dict[str, Any] | None = None,
        generation_path: str = "generation_config.json",
    ) -> ModelConfig:
        """Builds the configuration from an already parsed ``config.json`` dict."""
        hf = _text_part(hf, path)
        archs = hf.get("architectures")
        if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
            raise ValueError(f"{path}: field 'architectures' is missing or not a list of names")
        model_type = hf.get("model_type")
        if not isinstance(model_type, str):
            raise ValueError(f"{path}: field 'model_type' is missing or not a string")
        is_gpt2 = model_type == "gpt2"
        names = _field_names(model_type, hf)

        def get(name: str, default: Any = None, required: bool = True) -> Any:
            key = names.get(name, name)
            value = hf.get(key)
            if value is None and is_gpt2 and name == "max_position_embeddings":
                value = hf.get("n_ctx")
            if value is None:
                if required and default is None:
                    raise ValueError(f"{path}: required field {key!r} is missing")
                return default
            return value

        def positive_int(name: str, value: Any) -> int:
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(
                    f"{path}: field {name!r} must be a positive integer, got {value!r}"
                )
            return value

        vocab_size = positive_int("vocab_size", get("vocab_size"))
        hidden_size = positive_int("hidden_size", get("hidden_size"))
        num_layers = positive_int("num_hidden_layers", get("num_hidden_layers"))
        num_heads = positive_int("num_attention_heads", get("num_attention_heads"))
        num_kv_heads = positive_int(
            "num_key_value_heads", get("num_key_value_heads", default=num_heads, required=False)
        )
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"{path}: num_attention_heads ({num_heads}) must be a multiple of "
                f"num_key_value_heads ({num_kv_heads})"
            )
        head_dim = hf.get("head_dim")
        if head_dim is None:
            if hidden_size % num_heads != 0:
                raise ValueError(
                    f"{path}: hidden_size ({hidden_size}) is not divisible by "
                    f"num_attention_heads ({num_heads}) and no 'head_dim' is given"
                )
            head_dim = hidden_size // num_heads
        head_dim = positive_int("head_dim", head_dim)
        inner = get("intermediate_size", default=4 * hidden_size if names else None)
        intermediate_size = positive_int("intermediate_size", inner)
        max_pos = positive_int("max_position_embeddings", get("max_position_embeddings"))

        sliding_window = hf.get("sliding_window")
        if hf.get("use_sliding_window") is False:
            sliding_window = None  # Qwen2/Qwen3 keep the field but switch it off
        if sliding_window is not None:
            sliding_window = positive_int("sliding_window", sliding_window)

        dtype = hf.get("dtype") or hf.get("torch_dtype")
        if dtype is not None and not isinstance(dtype, str):
            raise ValueError(f"{path}: field 'torch_dtype' must be a string, got {dtype!r}")

        gen = generation_config or {}
        eos = _token_ids(hf.get("eos_token_id"), "eos_token_id", path)
        for t in _token_ids(gen.get("eos_token_id"), "eos_token_id", generation_path):
            if t not in eos:
                eos.append(t)
        bos = hf.get("bos_token_id")
        if bos is None:
            bos = gen.get("bos_token_id")
        bos_ids = _token_ids(bos, "bos_token_id", path)

        rope_theta, rope_scaling, partial = _rope_parameters(hf, path)
        if rope_scaling is not None and rope_scaling["rope_type"] == "longrope":
            # Phi-3 keeps the pretraining context at the config's top level and
            # derives the factor from the two lengths when none is given.
            if rope_scaling.get("original_max_position_embeddings") is None:
                rope_scaling["original_max_position_embeddings"] = hf.get(
                    "original_max_position_embeddings", max_pos
                )
            if rope_scaling.get("factor") is None:
                rope_scaling["factor"] = max_pos / rope_scaling["original_max_position_embeddings"]
            rope_scaling["max_position_embeddings"] = max_pos
        if rope_scaling is not None and rope_scaling["rope_type"] == "yarn":
            # transformers' default: the context the model was trained with
            if rope_scaling.get("original_max_position_embeddings") is None:
                rope_scaling["original_max_position_embeddings"] = max_pos
            if rope_scaling.get("factor") is None:  # a config that gives both lengths instead
                rope_scaling["factor"] = max_pos / rope_scaling["original_max_position_embeddings"]
        return cls(
            architecture=causal_lm_architecture(archs[0]),
            model_type=model_type,
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            intermediate_size=intermediate_size,
            max_position_embeddings=max_pos,
            sliding_window=sliding_window,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", is_gpt2)),
            torch_dtype=dtype,
            eos_token_ids=eos,
            bos_token_id=bos_ids[0] if bos_ids else None,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            partial_rotary_factor=partial,
            hf=hf,
        )

    def layer_attention_types(self) -> list[str] | None:
        """Each decoder layer's attention, ``"sliding_attention"`` or
        ``"full_attention"`` (or a hybrid model's recurrent layer,
        ``RECURRENT_LAYER_TYPES``), where the config says (``layer_types``, or the
        Gemma families' patterns: Gemma 2 alternates from a sliding first
        layer, Gemma 3 has ``sliding_window_pattern - 1`` sliding layers
        before each full one); None where it does not."""
        n = self.num_hidden_layers
        types = self.hf.get("layer_types")
        if types is not None:
            ok = ("sliding_attention", "full_attention", *RECURRENT_LAYER_TYPES)
            if not isinstance(types, list) or len(types) != n or any(t not in ok for t in types):
                raise ValueError(
                    f"config.json: layer_types must list {n} of "
                    f"{', '.join(repr(t) for t in ok)}, got {types!r}"
                )
            return list(types)
        if self.model_type == "gemma2":
            pattern = 2
        elif self.model_type in ("gemma3", "gemma3_text"):
            pattern = self.hf.get("sliding_window_pattern", 6)
            if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern <= 0:
                raise ValueError(
                    f"config.json: sliding_window_pattern must be a positive integer, got {pattern!r}"
                )
        else:
            return None
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]

    def layer_sliding_window(self, layer: int) -> int | None:
        """The sliding window of decoder layer ``layer`` (None: full attention)."""
        if self.sliding_window is None:
            return None
        layer_types = self.layer_attention_types()
        if layer_types is not None:
            return self.sliding_window if layer_types[layer] == "sliding_attention" else None
        if self.model_type == "qwen2_moe":
            # Qwen2-MoE's default pattern: every other layer below max_window_layers.
            first = self.hf.get("max_window_layers", 28)
            return self.sliding_window if (layer + 1) % 2 and layer < first else None
        if self.model_type in ("qwen2", "qwen3"):
            # Qwen applies the window only from layer max_window_layers on.
            first = self.hf.get("max_window_layers", 0) or 0
            return self.sliding_window if layer >= first else None
        return self.sliding_window


def rope_of_layer_type(config: ModelConfig, layer_type: str) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) of the layers of ``layer_type`` in a model
    whose layer types rotate differently (Gemma 3): ``rope_parameters`` with
    one entry per layer type, or the older fields (the full-attention layers
    take ``rope_theta`` and ``rope_scaling``, the sliding ones
    ``rope_local_base_freq`` and no scaling)."""
    hf = config.hf
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get(layer_type), dict):
        nested = {"rope_parameters": params[layer_type]}
        theta, scaling, _ = _rope_parameters(nested, "config.json")
        return theta, scaling
    if layer_type == "sliding_attention":
        theta = hf.get("rope_local_base_freq", 10_000.0)
        if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
            raise ValueError(
                f"config.json: 'rope_local_base_freq' must be a positive number, got {theta!r}"
            )
        return float(theta), None
    return config.rope_theta, config.rope_scaling


def _rope_parameters(hf: dict[str, Any], path: str) -> tuple[float, dict[str, Any] | None, float]:
    """Reads (rope_theta, rope_scaling, partial_rotary_factor) from either config layout.

    transformers 5 writes one ``rope_parameters`` dict; older configs have
    top-level ``rope_theta``, ``rope_scaling`` and ``partial_rotary_factor``.
    """
    params = hf.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"{path}: field 'rope_parameters' must be an object, got {params!r}")
    if params is not None and isinstance(params.get("full_attention"), dict):
        # One set per layer type (Gemma 3): the full-attention layers' here;
        # ``rope_of_layer_type`` reads the others.
        params = params["full_attention"]
    params = dict(params or {})
    legacy = hf.get("rope_scaling")
    if legacy is not None:
        if not isinstance(legacy, dict):
            raise ValueError(f"{path}: field 'rope_scaling' must be an object, got {legacy!r}")
        for k, v in legacy.items():
            params.setdefault(k, v)
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if not isinstance(theta, (int, float)) or theta <= 0:
        raise ValueError(f"{path}: 'rope_theta' must be a positive number, got {theta!r}")
    if not isinstance(partial, (int, float)) or not 0 < partial <= 1:
        raise ValueError(f"{path}: 'partial_rotary_factor' must be in (0, 1], got {partial!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "su":  # LongRoPE's name in the first Phi-3 long-context configs
        rope_type = "longrope"
    scaling = None
    if rope_type != "default":
        scaling = {
            k: v
            for k, v in params.items()
            if k not in ("rope_theta", "partial_rotary_factor", "type")
        }
        scaling["rope_type"] = rope_type
    return float(theta), scaling, float(partial)


# vLLM's task names that mean a pooling model.
POOLING_TASKS = ("embed", "embedding", "score", "classify", "reward")


#: ``kv_cache_dtype`` values: the model's own dtype, or 8-bit rows with a scale each.
KV_CACHE_DTYPES = ("auto", "int8")


def check_kv_cache_dtype(value: object) -> None:
    """A ValueError naming ``kv_cache_dtype`` unless it is one fastllm has."""
    if value in KV_CACHE_DTYPES:
        return
    if isinstance(value, str) and value.startswith("fp8"):
        raise ValueError(
            f"kv_cache_dtype={value!r} is not supported: fastllm's 8-bit KV cache is "
            "kv_cache_dtype='int8' (int8 values with a float32 scale per row, on every device)"
        )
    raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {value!r}")


@dataclass
class EngineConfig:
    """Every setting of an LLM, as passed to ``LLM(...)`` (vLLM's names)."""

    model: str
    tokenizer: str | None = None
    dtype: Any = "auto"
    device: str = "auto"
    tensor_parallel_size: int = 1
    max_model_len: int | None = None
    seed: int = 0
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    kv_cache_memory_bytes: int | None = None
    # "auto": the model's dtype; "int8": 8-bit rows with a float32 scale each
    # (layers/attention_torch.py, rust/attention/rows.rs)
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    load_format: str = "auto"
    max_logprobs: int = 20
    revision: str | None = None
    tokenizer_revision: str | None = None
    download_dir: str | None = None
    quantization: str | None = None
    task: str = "generate"
    # "generate" (text) or "pooling" (embeddings, scores, classes: LLM.embed,
    # score, classify); vLLM's older task="embed"/"score"/"classify"/"reward"
    # mean "pooling"
    runner: str = "auto"
    tokenizer_mode: str = "auto"
    trust_remote_code: bool = False
    enforce_eager: bool = False  # accepted for vLLM scripts: fastllm has no graphs to capture
    skip_tokenizer_init: bool = False
    # how replies mark their thinking (fastllm.reasoning: "qwen3", "deepseek_r1");
    # needed by thinking_token_budget, by structured outputs that apply to the
    # answer after the thinking, and by the reasoning_content split
    reasoning_parser: str | None = None
    # Hybrid models (recurrent layers): the prefix lengths, in tokens (a
    # multiple of block_size), at which sequences' recurrent states are
    # snapshotted for the prefix cache, and how many snapshots are kept
    # (each costs one sequence's recurrent state; engine/state_cache.py)
    state_snapshot_interval: int = 256
    max_state_snapshots: int = 32
    # fields merged into the model's config.json before it is read (vLLM's
    # ``hf_overrides``): e.g. a Qwen3-Reranker run as a classifier of its
    # "no" / "yes" logits (pooling/decoder.py)
    hf_overrides: dict[str, Any] | None = None

    def validate(self) -> None:
        """Checks every field, naming the field in the error."""

        def positive(name: str) -> None:
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")

        for name in ("tensor_parallel_size", "block_size", "max_num_seqs"):
            positive(name)
        positive("state_snapshot_interval")
        m = self.max_state_snapshots
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise ValueError(f"max_state_snapshots must be an integer >= 0, got {m!r}")
        if self.state_snapshot_interval % self.block_size:
            raise ValueError(
                f"state_snapshot_interval ({self.state_snapshot_interval}) must be a multiple "
                f"of block_size ({self.block_size})"
            )
        for name in ("max_model_len", "max_num_batched_tokens", "kv_cache_memory_bytes"):
            positive(name)
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int):
            raise ValueError(f"max_logprobs must be an integer, got {self.max_logprobs!r}")
        if self.max_logprobs < -1:
            raise ValueError(
                f"max_logprobs must be -1 (no limit) or at least 0, got {self.max_logprobs}"
            )
        o = self.hf_overrides
        if o is not None and (not isinstance(o, dict) or not all(isinstance(k, str) for k in o)):
            raise ValueError(f"hf_overrides must be a dict of config.json fields, got {o!r}")
        check_kv_cache_dtype(self.kv_cache_dtype)
        from fastllm.layers.quantization import resolve_quantization

        resolve_quantization(self.quantization)
        from fastllm.reasoning import reasoning_parser

        reasoning_parser(self.reasoning_parser)
        if self.task not in ("generate", "auto", *POOLING_TASKS):
            raise ValueError(
                f"task={self.task!r} is not supported: task must be 'generate', 'auto' or a "
                f"pooling task ({', '.join(POOLING_TASKS)})"
            )
        if self.runner not in ("auto", "generate", "pooling"):
            raise ValueError(f"runner must be 'auto', 'generate' or 'pooling', got {self.runner!r}")
        if self.runner == "generate" and self.task in POOLING_TASKS:
            raise ValueError(f"task={self.task!r} needs runner='pooling', not runner='generate'")
        if self.tokenizer_mode not in ("auto", "hf", "slow"):
            raise ValueError(
                f"tokenizer_mode must be 'auto', 'hf' or 'slow' (all read tokenizer.json), "
                f"got {self.tokenizer_mode!r}"
            )
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0.0 < u <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {u!r}")
        if self.block_size > 1024:
            raise ValueError(f"block_size must be at most 1024, got {self.block_size}")
        if self.load_format not in ("auto", "safetensors", "dummy", "gguf"):
            raise ValueError(
                "load_format must be one of 'auto', 'safetensors', 'dummy', 'gguf', "
                f"got {self.load_format!r}"
            )

    @property
    def pooling(self) -> bool:
        """Whether this engine pools (runner='pooling', or a pooling task)."""
        return self.runner == "pooling" or self.task in POOLING_TASKS


_DTYPE_NAMES = {
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "fp16": "float16",
}


def cpu_has_native_bf16() -> bool:
    """Whether this CPU (and OS) runs bfloat16 natively (AVX512-BF16 or AMX-BF16)."""
    from fastllm import _core

    feats = _core.cpu_features()
    return bool(feats.get("avx512bf16") or feats.get("amx"))


def resolve_dtype(dtype: Any, device: str, config_dtype: str | None) -> Any:
    """The torch dtype to run in, following DESIGN.md's rules per device."""
    import torch

    if isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
    elif isinstance(dtype, str):
        if dtype != "auto" and dtype not in _DTYPE_NAMES:
            raise ValueError(
                f"dtype must be 'auto' or one of {sorted(_DTYPE_NAMES)}, got {dtype!r}"
            )
        name = _DTYPE_NAMES.get(dtype, "auto")
    else:
        raise ValueError(f"dtype must be a string or torch.dtype, got {dtype!r}")
    if name not in ("auto", "float32", "bfloat16", "float16"):
        raise ValueError(f"dtype {name} is not supported; use float32, bfloat16 or float16")
    if device == "cpu":
        if name == "auto":
            name = "bfloat16" if cpu_has_native_bf16() else "float32"
        elif name == "float16":
            logger.warning("float16 is not served on the CPU; using bfloat16 instead")
            name = "bfloat16"
    elif name == "auto":
        cfg = _DTYPE_NAMES.get(config_dtype or "", None)
        name = cfg if cfg in ("bfloat16", "float16") else "bfloat16"
    return getattr(torch, name)
