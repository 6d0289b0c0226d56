"""A folder's sentence-transformers files: how its model pools, and the Dense
layers after the pooling.

``modules.json`` lists the modules in order: the Transformer, a Pooling module
(``1_Pooling/config.json``), optional ``Dense`` modules (a linear layer and an
activation, applied to the pooled vector) and an optional ``Normalize``.
``config_sentence_transformers.json`` holds the ``prompts``. A folder without
``modules.json`` is a plain transformers model, which sentence-transformers
wraps with MEAN pooling and no normalisation: so does fastllm.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from fastllm.layers import Module
from fastllm.layers.linear import Linear
from fastllm.pooling.runner import PoolerConfig

#: sentence-transformers pooling modes fastllm runs, by both of its spellings
_POOLING_MODES = {"cls": "CLS", "mean": "MEAN", "lasttoken": "LAST"}
_LEGACY_MODE_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_lasttoken": "lasttoken",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
}
#: Dense activations (``activation_function``'s class name) and what computes them
_DENSE_ACTIVATIONS = {
    "Identity": lambda x: x,
    "Tanh": torch.tanh,
    "ReLU": torch.relu,
    "GELU": torch.nn.functional.gelu,
    "Sigmoid": torch.sigmoid,
    "SiLU": torch.nn.functional.silu,
}


class DenseLayer(Module):
    """A sentence-transformers ``Dense`` module: ``activation(linear(x))``, run
    in float32 (what the pooled vectors are) whatever the encoder's dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool, activation: str) -> None:
        super().__init__()
        self.linear = Linear(in_features, out_features, bias=bias)
        self.activation = activation
        self.act = _DENSE_ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Projects pooled vectors [B, in_features] to [B, out_features]."""
        return self.act(self.linear(x))


def read_json(path: str) -> dict[str, Any]:
    """One JSON object from ``path``; errors name the file."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def read_st_pooling(
    folder: str, hidden_size: int, default_type: str = "MEAN", hf: dict[str, Any] | None = None
) -> tuple[PoolerConfig, list[DenseLayer]]:
    """The folder's ``PoolerConfig`` and its Dense layers (weights loaded, float32).

    Without sentence-transformers files: ``default_type`` pooling (MEAN for
    encoders: what sentence-transformers wraps a plain transformers model
    with), not normalised, ``dimensions`` the hidden size. ``hf``: the
    model's config.json, whose ``matryoshka_dimensions`` count too."""
    pooling_type, normalize, dense = default_type, False, []
    modules_path = os.path.join(folder, "modules.json")
    if os.path.isfile(modules_path):
        pooling_type, normalize, dense = _read_modules(
            folder, modules_path, hidden_size, default_type
        )
    dimensions = dense[-1].linear.out_features if dense else hidden_size
    st_path = os.path.join(folder, "config_sentence_transformers.json")
    st = read_json(st_path) if os.path.isfile(st_path) else {}
    prompts = st.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in prompts.items()
    ):
        raise ValueError(f"{st_path}: 'prompts' must map names to strings, got {prompts!r}")
    matryoshka: list[int] = []
    for source, path in ((hf or {}, "config.json"), (st, st_path)):
        dims = source.get("matryoshka_dimensions")
        if dims is None:
            continue
        if not isinstance(dims, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and 0 < d <= dimensions for d in dims
        ):
            raise ValueError(
                f"{path}: matryoshka_dimensions must list sizes from 1 to {dimensions}, "
                f"got {dims!r}"
            )
        matryoshka = sorted(set(matryoshka) | set(dims))
    config = PoolerConfig(
        pooling_type=pooling_type,
        normalize=normalize,
        dimensions=dimensions,
        matryoshka_dimensions=matryoshka,
        prompts=dict(prompts),
    )
    return config, dense


def _read_modules(
    folder: str, modules_path: str, hidden_size: int, default_type: str
) -> tuple[str, bool, list[DenseLayer]]:
    """(pooling type, normalize, Dense layers) of ``modules.json``; a ValueError
    naming any module fastllm cannot run."""
    try:
        with open(modules_path, encoding="utf-8") as f:
            modules = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {modules_path}: {e}") from None
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ValueError(f"{modules_path} must hold a list of module objects")
    pooling_type, normalize, dense = default_type, False, []
    width = hidden_size
    for i, module in enumerate(modules):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        path = os.path.join(folder, str(module.get("path", "")))
        if normalize:
            raise ValueError(
                f"{modules_path}: module {i} ({kind}) comes after Normalize; fastllm "
                "normalises last"
            )
        if kind == "Transformer":
            if module.get("path", "") != "":
                raise ValueError(
                    f"{modules_path}: a Transformer module in a subfolder "
                    f"({module.get('path')!r}) is not supported; it must be the folder itself"
                )
        elif kind == "Pooling":
            pooling_type = read_pooling_mode(os.path.join(path, "config.json"))
        elif kind == "Dense":
            dense.append(_read_dense(path, width))
            width = dense[-1].linear.out_features
        elif kind == "Normalize":
            normalize = True
        else:
            raise ValueError(
                f"{modules_path}: module {i} of type {module.get('type')!r} is not supported "
                "(fastllm runs Transformer, Pooling, Dense and Normalize modules)"
            )
    return pooling_type, normalize, dense


def read_pooling_mode(path: str) -> str:
    """ "CLS", "MEAN" or "LAST" from a Pooling module's ``config.json`` (its
    ``pooling_mode`` or the older ``pooling_mode_*`` flags); a ValueError
    naming the file and key for any other mode."""
    cfg = read_json(path)
    if cfg.get("include_prompt", True) is not True:
        raise ValueError(
            f"{path}: include_prompt={cfg['include_prompt']!r} is not supported "
            "(fastllm pools every token, prompt included)"
        )
    key = "pooling_mode"
    modes = cfg.get(key)
    if modes is None:
        flags = [k for k in _LEGACY_MODE_KEYS if cfg.get(k)]
        for k in flags:
            if _LEGACY_MODE_KEYS[k] not in _POOLING_MODES:
                raise ValueError(f"{path}: {k}=true is not supported (only cls, mean, lasttoken)")
        if len(flags) > 1:
            raise ValueError(f"{path}: {', '.join(flags)}: combined pooling is not supported")
        modes, key = (_LEGACY_MODE_KEYS[flags[0]], flags[0]) if flags else ("mean", key)
    if isinstance(modes, list) and len(modes) == 1:
        modes = modes[0]
    if not isinstance(modes, str) or modes not in _POOLING_MODES:
        raise ValueError(
            f"{path}: {key}={modes!r} is not supported (one of "
            f"{', '.join(repr(m) for m in _POOLING_MODES)})"
        )
    return _POOLING_MODES[modes]


def _read_dense(path: str, in_width: int) -> DenseLayer:
    """A ``Dense`` module's layer from its folder (config and float32 weights)."""
    cfg_path = os.path.join(path, "config.json")
    cfg = read_json(cfg_path)
    act = str(cfg.get("activation_function") or "Identity").rsplit(".", 1)[-1]
    unsupported = [
        f"{k}={cfg[k]!r}"
        for k, ok in (
            ("module_input_name", "sentence_embedding"),
            ("module_output_name", "sentence_embedding"),
            ("use_residual", False),
        )
        if k in cfg and cfg[k] not in (ok, None)
    ]
    if act not in _DENSE_ACTIVATIONS:
        unsupported.append(f"activation_function={cfg.get('activation_function')!r}")
    n_in, n_out = cfg.get("in_features"), cfg.get("out_features")
    if n_in != in_width or not isinstance(n_out, int) or n_out < 1:
        unsupported.append(f"in_features={n_in!r} (input {in_width}), out_features={n_out!r}")
    if unsupported:
        raise ValueError(
            f"{cfg_path}: this Dense module is not supported: {', '.join(unsupported)}"
        )
    layer = DenseLayer(n_in, n_out, bool(cfg.get("bias", True)), act)
    state = _dense_weights(path)
    expected = {"linear.weight": (n_out, n_in)} | (
        {"linear.bias": (n_out,)} if cfg.get("bias", True) else {}
    )
    for name, shape in expected.items():
        if name not in state or tuple(state[name].shape) != shape:
            raise ValueError(f"{path}: Dense weight {name!r} missing or not of shape {list(shape)}")
    layer.linear.weight.data = state["linear.weight"].float().contiguous()
    if layer.linear.bias is not None:
        layer.linear.bias.data = state["linear.bias"].float().contiguous()
    return layer


def _dense_weights(path: str) -> dict[str, torch.Tensor]:
    """A Dense folder's tensors: ``model.safetensors`` or ``pytorch_model.bin``."""
    st = os.path.join(path, "model.safetensors")
    if os.path.isfile(st):
        from safetensors.torch import load_file

        try:
            return load_file(st)
        except Exception as e:  # safetensors raises its own error type
            raise ValueError(f"cannot read {st}: {e}") from None
    binary = os.path.join(path, "pytorch_model.bin")
    if os.path.isfile(binary):
        try:
            return torch.load(binary, map_location="cpu", weights_only=True)
        except Exception as e:
            raise ValueError(f"cannot read {binary}: {e}") from None
    raise ValueError(f"{path}: no model.safetensors or pytorch_model.bin for the Dense module")
