"""The layer-op table: which backend runs each layer op, chosen once per model.

A model's layers never ask at call time which device or dtype they run on.
``load_model`` calls ``select_ops(device, dtype)`` once and ``bind_ops`` hands
the resulting ``LayerOps`` to every layer that has an ``ops`` attribute, so a
layer's ``forward`` calls one function:

* ``rust``: CPU with float32/bfloat16 weights. RMSNorm, SiLU-and-mul, the QKV
  split with rotary, the KV-cache write and paged attention run the Rust
  kernels of ``fastllm._core`` on the kernels' thread team.
* ``cuda``: a CUDA device. The NVRTC kernels of ``kernels/`` (``cuda_ops``);
  when they are switched off or fail (which warns once), each op runs its
  torch expression instead.
* ``torch``: anything else (e.g. float16 on the CPU): plain torch.

Linear layers are chosen the same way, once, by ``linear.pack_linears``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fastllm import _core
from fastllm.forward_context import AttentionMetadata
from fastllm.layers import CPU_KERNEL_DTYPES, attention_torch, recurrent
from fastllm.layers.attention_torch import PagedLayer

Tensor = torch.Tensor


@dataclass(frozen=True)
class LayerOps:
    """One backend's implementation of every layer op."""

    backend: str  # "rust", "cuda" or "torch"
    # (x [..., d], weight [d], eps) -> weight * T(x * rsqrt(mean(x^2) + eps))
    rms_norm: Callable[[Tensor, Tensor, float], Tensor]
    # x [..., 2d] -> silu(x[..., :d]) * x[..., d:]
    silu_and_mul: Callable[[Tensor], Tensor]
    # x [..., 2d] -> gelu_tanh(x[..., :d]) * x[..., d:] (GeGLU: Gemma)
    gelu_tanh_and_mul: Callable[[Tensor], Tensor]
    # (x [T, heads, head], cos, sin [T, 1, half]) -> x with its first 2*half dims rotated
    rotary: Callable[[Tensor, Tensor, Tensor], Tensor]
    # (qkv [T, (h + 2 kv) d], heads, kv_heads, d, cos, sin) -> q [T, h, d], k [T, kv, d], v [T, kv d]
    split_qkv_rotary: Callable[[Tensor, int, int, int, Tensor, Tensor], tuple[Tensor, ...]]
    # (layer, q [T, h, d], k/v [T, kv, d], meta): writes k/v to the cache, returns [T, h, d]
    attention: Callable[[PagedLayer, Tensor, Tensor, Tensor, AttentionMetadata], Tensor]
    # Recurrent mixers over packed rows with a state per sequence (``layers/recurrent.py``):
    # (x [T, C], weight [C, K], bias, conv_state [S, C, K-1], query_start_loc, state_slots, silu)
    causal_conv1d: Callable[..., Tensor] = recurrent.causal_conv1d_torch
    # (q, k [T, Hk, Dk], v [T, Hv, Dv], g, beta [T, Hv], state [S, Hv, Dk, Dv],
    #  query_start_loc, state_slots, scale, l2norm, linear=False) -> [T, Hv, Dv]
    gated_delta_rule: Callable[..., Tensor] = recurrent.gated_delta_rule_torch
    # Qwen3.5's elementwise parts, so that the fused CPU stack and the layers share kernels:
    # (x, gate) -> x * sigmoid(gate), the sigmoid rounded to x's dtype first
    sigmoid_mul: Callable[[Tensor, Tensor], Tensor] = recurrent.sigmoid_mul_torch
    # (x [T, d], z [T, d], weight [d], eps) -> rms_norm(x) * silu(z) in float32, rounded once
    gated_rms_norm: Callable[..., Tensor] = recurrent.gated_rms_norm_torch
    # (a, b [T, H], A_log, dt_bias [H]) -> (g, beta) [T, H] float32
    delta_gates: Callable[..., tuple[Tensor, Tensor]] = recurrent.delta_gates_torch
    # Mamba-2's parts (Granite 4.0): (dt [T, H], A_log, dt_bias [H], (lo, hi)) -> (g, beta)
    mamba_gates: Callable[..., tuple[Tensor, Tensor]] = recurrent.mamba_gates_torch
    # (y, x, z [T, H*P], D [H], weight [H*P], groups, eps) -> the gated group norm
    mamba_norm: Callable[..., Tensor] = recurrent.mamba_norm_torch


# ---- torch ----------------------------------------------------------------


def rms_norm_torch(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm computed in float32; the weight multiplies after the cast back,
    which matches the reference models' rounding."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def silu_and_mul_torch(x: Tensor) -> Tensor:
    """``silu(x[..., :d]) * x[..., d:]``."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def gelu_tanh_and_mul_torch(x: Tensor) -> Tensor:
    """``gelu_tanh(x[..., :d]) * x[..., d:]``."""
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]


def rotary_torch(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Neox rotary of the first ``2 * cos.shape[-1]`` dims of each head of x [T, heads, head]."""
    half = cos.shape[-1]
    x1 = x[..., :half]
    x2 = x[..., half : 2 * half]
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    if 2 * half == x.shape[-1]:
        return rotated
    return torch.cat((rotated, x[..., 2 * half :]), dim=-1)


def split_qkv(qkv: Tensor, heads: int, kv_heads: int, d: int) -> tuple[Tensor, Tensor, Tensor]:
    """Views of a fused QKV projection: q [T, heads, d], k [T, kv_heads, d], v [T, kv_heads * d]."""
    n = qkv.shape[0]
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    return q.reshape(n, heads, d), k.reshape(n, kv_heads, d), v


def _split_qkv_rotary_with(rotary: Callable[[Tensor, Tensor, Tensor], Tensor]) -> Callable:
    def split_qkv_rotary(qkv, heads, kv_heads, d, cos, sin):
        q, k, v = split_qkv(qkv, heads, kv_heads, d)
        return rotary(q, cos, sin), rotary(k, cos, sin), v

    return split_qkv_rotary


TORCH_OPS = LayerOps(
    backend="torch",
    rms_norm=rms_norm_torch,
    silu_and_mul=silu_and_mul_torch,
    gelu_tanh_and_mul=gelu_tanh_and_mul_torch,
    rotary=rotary_torch,
    split_qkv_rotary=_split_qkv_rotary_with(rotary_torch),
    attention=attention_torch.attend,
)


# ---- Rust CPU kernels -----------------------------------------------------


def _rows(x: Tensor, width: int) -> Tensor:
    """x as contiguous rows [-1, width]; x itself in the models' case (2-D, contiguous)."""
    if x.dim() == 2 and x.is_contiguous():
        return x
    return x.reshape(-1, width).contiguous()


def rms_norm_rust(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm by the Rust kernel (same roundings as ``rms_norm_torch``)."""
    rows = _rows(x, x.shape[-1])
    out = torch.empty_like(rows)
    _core.rms_norm(out, rows, weight, eps)
    return out if rows is x else out.view(x.shape)


def _gated_rust(kernel: Callable[[Tensor, Tensor], None]) -> Callable[[Tensor], Tensor]:
    def op(x: Tensor) -> Tensor:
        d = x.shape[-1] // 2
        rows = _rows(x, 2 * d)
        out = torch.empty(rows.shape[0], d, dtype=x.dtype)
        kernel(out, rows)
        return out if rows is x else out.view(*x.shape[:-1], d)

    return op


#: SiLU-and-mul by the Rust kernel.
silu_and_mul_rust = _gated_rust(_core.silu_and_mul)
#: GeGLU (tanh GELU) by the Rust kernel.
gelu_tanh_and_mul_rust = _gated_rust(_core.gelu_tanh_and_mul)


def split_qkv_rotary_rust(qkv, heads, kv_heads, d, cos, sin):
    """The QKV split and rotary in one Rust pass (bit-exact with the torch expression)."""
    if qkv.dim() != 2 or not qkv.is_contiguous():
        return _split_qkv_rotary_with(rotary_torch)(qkv, heads, kv_heads, d, cos, sin)
    n = qkv.shape[0]
    q = torch.empty(n, heads, d, dtype=qkv.dtype)
    k = torch.empty(n, kv_heads, d, dtype=qkv.dtype)
    v = torch.empty(n, kv_heads * d, dtype=qkv.dtype)
    half = cos.shape[-1]
    _core.qkv_rotary(q, k, v, qkv, cos.view(n, half), sin.view(n, half))
    return q, k, v


def attention_rust(
    layer: PagedLayer, q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata
) -> Tensor:
    """The Rust cache write and paged attention, reading the torch tensors in place."""
    slots, tables = meta.for_group(layer.kv_group)
    _core.reshape_and_cache(k.contiguous(), v.contiguous(), layer.k_cache, layer.v_cache, slots)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    _core.paged_attention(
        out,
        q.contiguous(),
        layer.k_cache,
        layer.v_cache,
        tables,
        meta.seq_lens,
        meta.query_start_loc,
        layer.scale,
        layer.sliding_window or 0,
        layer.logit_softcap or 0.0,
        layer.sinks,
    )
    return out


RUST_OPS = LayerOps(
    backend="rust",
    rms_norm=rms_norm_rust,
    silu_and_mul=silu_and_mul_rust,
    gelu_tanh_and_mul=gelu_tanh_and_mul_rust,
    rotary=rotary_torch,
    split_qkv_rotary=split_qkv_rotary_rust,
    attention=attention_rust,
    causal_conv1d=recurrent.causal_conv1d_rust,
    gated_delta_rule=recurrent.gated_delta_rule_rust,
    sigmoid_mul=recurrent.sigmoid_mul_rust,
    gated_rms_norm=recurrent.gated_rms_norm_rust,
    delta_gates=recurrent.delta_gates_rust,
    mamba_gates=recurrent.mamba_gates_rust,
    mamba_norm=recurrent.mamba_norm_rust,
)


# ---- CUDA kernels (torch when they are off) --------------------------------


def _cuda_or_torch(
    kernel: str, fallback: Callable[..., Tensor], usable: Callable[..., bool]
) -> Callable[..., Tensor]:
    """An op that runs ``cuda_ops.<kernel>`` and, when the kernels are off or
    fail (``None``), the torch ``fallback`` on the same arguments."""

    def op(*args):
        from fastllm.layers import cuda_ops

        if usable(*args) and cuda_ops.enabled():
            out = getattr(cuda_ops, kernel)(*args)
            if out is not None:
                return out
        return fallback(*args)

    op.__name__ = f"{kernel}_cuda"
    op.__doc__ = f"``cuda_ops.{kernel}``, or ``{fallback.__name__}``."
    return op


rms_norm_cuda = _cuda_or_torch("rms_norm", rms_norm_torch, lambda x, w, eps: w.dtype == x.dtype)
silu_and_mul_cuda = _cuda_or_torch("silu_and_mul", silu_and_mul_torch, lambda x: True)
rotary_cuda = _cuda_or_torch("rotary", rotary_torch, lambda x, cos, sin: cos.dtype == x.dtype)


def attention_cuda(
    layer: PagedLayer, q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata
) -> Tensor:
    """The CUDA cache write and paged attention, or torch."""
    from fastllm.layers import cuda_ops

    k_cache, v_cache = layer.k_cache, layer.v_cache
    slots, tables = meta.for_group(layer.kv_group)
    if (
        cuda_ops.enabled()
        and q.dtype == k_cache.dtype
        and cuda_ops.reshape_and_cache(k, v, k_cache, v_cache, slots)
    ):
        out = cuda_ops.paged_attention(
            q,
            k_cache,
            v_cache,
            tables,
            meta.seq_lens,
            meta.query_start_loc,
            layer.scale,
            layer.sliding_window or 0,
            layer.logit_softcap or 0.0,
            None if layer.sinks is None else layer.sinks.to(q.device, torch.float32),
        )
        if out is not None:
            return out
    return attention_torch.attend(layer, q, k, v, meta)


CUDA_OPS = LayerOps(
    backend="cuda",
    rms_norm=rms_norm_cuda,
    silu_and_mul=silu_and_mul_cuda,
    gelu_tanh_and_mul=gelu_tanh_and_mul_torch,
    rotary=rotary_cuda,
    split_qkv_rotary=_split_qkv_rotary_with(rotary_cuda),
    attention=attention_cuda,
)


# ---- choosing and binding --------------------------------------------------


def select_ops(device: str | torch.device, dtype: torch.dtype) -> LayerOps:
    """The op table for a model of ``dtype`` on ``device``."""
    kind = torch.device(device).type
    if kind == "cuda":
        return CUDA_OPS
    if kind == "cpu" and dtype in CPU_KERNEL_DTYPES:
        return RUST_OPS
    return TORCH_OPS


def bind_ops(model: torch.nn.Module, ops: LayerOps) -> None:
    """Gives ``ops`` to every submodule of ``model`` that has an ``ops`` attribute."""
    for module in model.modules():
        if isinstance(getattr(module, "ops", None), LayerOps):
            module.ops = ops
