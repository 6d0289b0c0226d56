"""Rotary position embedding (neox style: the two halves of the rotated dims pair up).

Supports the rope types Hugging Face calls "default", "linear", "llama3",
"yarn", "longrope" and "dynamic" (and "freq_factors": one divisor per
frequency, as GGUF files store Llama 3's), and partial rotary (only the first
``rotary_dim`` dims of each head rotate, as in Phi).

Two types depend on a sequence length, which the reference implementation
takes from the sequence being run; here it is the context the engine serves
(``max_model_len``, given by ``limit_positions``), so every position of every
sequence rotates by one table and cached keys never mix two:

* ``longrope`` (Phi-3/3.5, Phi-4-mini) divides each frequency by its
  ``long_factor`` when the context is longer than
  ``original_max_position_embeddings`` and by its ``short_factor`` otherwise,
  and scales cos/sin by the attention factor (given, or
  ``sqrt(1 + ln(factor) / ln(original))``). Equal to the reference for every
  sequence longer than the original context (and for every sequence when the
  engine's context is within it).
* ``dynamic`` (NTK) raises the base only for sequences longer than
  ``max_position_embeddings``, which no sequence here passes: the default
  frequencies, as the reference uses for every length up to there.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fastllm.layers import Module
from fastllm.layers.ops import TORCH_OPS, LayerOps, rotary_torch, split_qkv

# The neox rotary as a torch expression (the reference of the Rust and CUDA kernels).
apply_rotary = rotary_torch

SUPPORTED_ROPE_TYPES = (
    "default",
    "linear",
    "llama3",
    "yarn",
    "longrope",
    "dynamic",
    "freq_factors",
)


def rope_inv_freq(
    rotary_dim: int, theta: float, scaling: dict[str, Any] | None, context: int | None = None
) -> torch.Tensor:
    """Inverse frequencies [rotary_dim // 2] (float32) for the given rope
    scaling, for a model serving ``context`` positions (LongRoPE's choice of
    factors; None: the model's whole context)."""
    # Explicit CPU device: models are built under ``torch.device("meta")``.
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim
    inv_freq = 1.0 / (theta**exponents)
    rope_type = "default" if scaling is None else scaling.get("rope_type", "default")
    if rope_type in ("default", "dynamic"):
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(_scaling_field(scaling, "factor"))
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, rotary_dim, theta, scaling)
    if rope_type == "longrope":
        return _longrope_inv_freq(inv_freq, scaling, context)
    if rope_type == "freq_factors":
        # One divisor per frequency, as GGUF files store Llama 3's scaling.
        factors = torch.tensor(
            _scaling_field(scaling, "factors"), dtype=torch.float32, device="cpu"
        )
        if factors.shape != inv_freq.shape:
            raise ValueError(
                f"rope frequency factors: {factors.numel()} values for {inv_freq.numel()} frequencies"
            )
        return inv_freq / factors
    raise ValueError(
        f"unsupported rope scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


def _scaling_field(scaling: dict[str, Any], name: str) -> Any:
    if name not in scaling:
        raise ValueError(f"rope scaling {scaling.get('rope_type')!r} needs the field {name!r}")
    return scaling[name]


def _longrope_original(scaling: dict[str, Any]) -> float:
    old_len = _scaling_field(scaling, "original_max_position_embeddings")
    if isinstance(old_len, bool) or not isinstance(old_len, (int, float)) or old_len <= 1:
        raise ValueError(
            f"rope scaling 'longrope': original_max_position_embeddings must be a number > 1, "
            f"got {old_len!r}"
        )
    return float(old_len)


def _longrope_inv_freq(
    inv_freq: torch.Tensor, scaling: dict[str, Any], context: int | None
) -> torch.Tensor:
    """LongRoPE: one divisor per frequency, the long set for a context past
    the original one, the short set otherwise."""
    old_len = _longrope_original(scaling)
    if context is None:
        context = int(_scaling_field(scaling, "max_position_embeddings"))
    name = "long_factor" if context > old_len else "short_factor"
    factors = _scaling_field(scaling, name)
    if not isinstance(factors, list) or len(factors) != inv_freq.numel():
        raise ValueError(
            f"rope scaling 'longrope': {name} must list {inv_freq.numel()} numbers "
            f"(one per rotary frequency), got {factors!r}"
        )
    return inv_freq / torch.tensor(factors, dtype=torch.float32, device="cpu")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's scaling: long wavelengths divided by ``factor``, a smooth blend in between."""
    factor = float(_scaling_field(scaling, "factor"))
    low = float(_scaling_field(scaling, "low_freq_factor"))
    high = float(_scaling_field(scaling, "high_freq_factor"))
    old_len = float(_scaling_field(scaling, "original_max_position_embeddings"))
    low_wavelen = old_len / low
    high_wavelen = old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_factor(scaling: dict[str, Any]) -> float:
    factor = float(_scaling_field(scaling, "factor"))
    if factor <= 0:
        raise ValueError(f"rope scaling 'yarn': factor must be positive, got {factor}")
    return factor


def _yarn_inv_freq(
    inv_freq: torch.Tensor, rotary_dim: int, theta: float, scaling: dict[str, Any]
) -> torch.Tensor:
    """YaRN (Qwen2.5 / Qwen3 long context): frequencies that turn fewer than
    ``beta_slow`` times over the original context are divided by ``factor``,
    those that turn more than ``beta_fast`` times are kept, with a linear ramp
    between (by dimension index)."""
    factor = _yarn_factor(scaling)
    old_len = float(_scaling_field(scaling, "original_max_position_embeddings"))
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (rotary_dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = (torch.arange(rotary_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)
    keep = 1 - ramp.clamp(0, 1)  # 1: the original frequency, 0: divided by factor
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """The factor on cos and sin (YaRN's and LongRoPE's attention
    temperature; 1 otherwise)."""
    rope_type = None if scaling is None else scaling.get("rope_type")
    if scaling is None or rope_type not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    if rope_type == "longrope":
        old_len = _longrope_original(scaling)
        factor = float(_scaling_field(scaling, "factor"))
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    factor = _yarn_factor(scaling)

    def mscale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if m and m_all:
        return float(mscale(float(m)) / mscale(float(m_all)))
    return mscale(1.0)


class RotaryEmbedding(Module):
    """Rotates q/k heads by their tokens' positions.

    The cos/sin table is computed in float32 on first use on each device (so a
    model built on the meta device needs no special care) and covers
    ``max_position`` positions.
    """

    def __init__(
        self,
        head_dim: int,
        rotary_dim: int,
        max_position: int,
        theta: float,
        scaling: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if rotary_dim % 2 != 0 or not 0 < rotary_dim <= head_dim:
            raise ValueError(
                f"rotary_dim must be even and in (0, head_dim={head_dim}], got {rotary_dim}"
            )
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.max_position = max_position
        # Positions the cos/sin table covers (``limit_positions``).
        self.table_positions = max_position
        self.theta = theta
        self.scaling = scaling
        # Plain attribute: stays on CPU; rebuilt when the context changes (LongRoPE).
        self.inv_freq = rope_inv_freq(rotary_dim, theta, scaling, max_position)
        self.attention_factor = rope_attention_factor(scaling)
        self._table: torch.Tensor | None = None  # [table_positions, rotary_dim]: cos | sin
        self.ops = TORCH_OPS  # the model's op table (``layers/ops.py``), bound at load

    def limit_positions(self, n: int) -> None:
        """Builds the cos/sin table for positions below ``n`` only (the engine's
        ``max_model_len``, which no sequence passes): a 32k-position table
        costs 16 ms at load, for rows no request can reach. The rows it has
        are the same either way, except under LongRoPE, whose factor set
        follows the context served (module docstring)."""
        n = max(1, min(self.max_position, n))
        if n != self.table_positions:
            self.table_positions = n
            self.inv_freq = rope_inv_freq(self.rotary_dim, self.theta, self.scaling, n)
            self._table = None

    def _cos_sin_table(self, device: torch.device) -> torch.Tensor:
        table = self._table
        if table is None or table.device != device:
            t = torch.arange(self.table_positions, dtype=torch.float32, device="cpu")
            freqs = torch.outer(t, self.inv_freq)
            cos, sin = freqs.cos(), freqs.sin()
            if self.attention_factor != 1.0:
                cos, sin = cos * self.attention_factor, sin * self.attention_factor
            table = torch.cat((cos, sin), dim=-1).to(device)
            self._table = table
        return table

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [num_tokens, 1, rotary_dim // 2] for ``positions``, cast to ``dtype``."""
        table = self._cos_sin_table(positions.device)[positions].to(dtype)
        cos, sin = table.unsqueeze(1).chunk(2, dim=-1)
        # Contiguous (made once per step, used by every layer): the CPU kernel
        # reads them as plain [num_tokens, rotary_dim // 2] rows.
        return cos.contiguous(), sin.contiguous()

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotates q [num_tokens, heads, head_dim] and k [num_tokens, kv_heads, head_dim]."""
        cos, sin = self.cos_sin(positions, q.dtype)
        return self.ops.rotary(q, cos, sin), self.ops.rotary(k, cos, sin)


def qkv_with_rotary(
    ops: LayerOps,
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm: torch.nn.Module | None = None,
    k_norm: torch.nn.Module | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Splits a fused QKV projection [T, (h + 2 kv) * d], normalises q and k per
    head when the model has q/k norms, and rotates them; v stays flat."""
    if q_norm is None or k_norm is None:
        return ops.split_qkv_rotary(qkv, num_heads, num_kv_heads, head_dim, cos, sin)
    q, k, v = split_qkv(qkv, num_heads, num_kv_heads, head_dim)
    return ops.rotary(q_norm(q), cos, sin), ops.rotary(k_norm(k), cos, sin), v


def limit_positions(model: torch.nn.Module, n: int) -> None:
    """Every rotary embedding of ``model`` builds its table for positions below ``n``."""
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.limit_positions(n)
