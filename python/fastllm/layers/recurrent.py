"""Recurrent token mixers of hybrid models: a fixed-size state per sequence
beside (not in) the paged KV cache.

Two ops, both over the step's packed rows (sequence ``i`` owns rows
``query_start_loc[i]:query_start_loc[i+1]`` and its state lives at index
``state_slots[i]`` of every state tensor, ``AttentionMetadata.state_slots``):

* ``causal_conv1d``: a depthwise causal convolution whose state is the last
  ``K - 1`` input rows (LFM2's short convolutions, Qwen3.5's q/k/v
  convolution), optionally followed by SiLU;
* ``gated_delta_rule``: Gated DeltaNet's linear attention (Qwen3.5), whose
  state is one ``[Dk, Dv]`` float32 matrix per value head; with ``linear``
  the same scan without the delta step, Mamba-2's SSD (Granite 4.0's
  hybrids): ``S = exp(g) S + beta k v^T``.

The state at a slot is the state before the sequence's first row of the step
(the engine zeroes it for a new sequence or copies a snapshot into it,
``engine/state_cache.py``) and is overwritten with the state after its last
row. The Rust kernels (``_core.causal_conv1d`` / ``_core.gated_delta_rule``)
run them on the CPU; the torch functions here are the reference and the
backend everywhere else.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastllm import _core

Tensor = torch.Tensor


def _spans(query_start_loc: Tensor, state_slots: Tensor) -> list[tuple[int, int, int]]:
    """(first row, end row, state slot) of each sequence."""
    qsl = query_start_loc.tolist()
    return [(qsl[i], qsl[i + 1], s) for i, s in enumerate(state_slots.tolist())]


def causal_conv1d_torch(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    conv_state: Tensor,
    query_start_loc: Tensor,
    state_slots: Tensor,
    silu: bool,
) -> Tensor:
    """x [T, C] through the depthwise causal convolution weight [C, K] of each
    sequence, preceded by its state conv_state[slot] [C, K - 1] (the last
    inputs seen, oldest first), which is updated in place."""
    out = torch.empty_like(x)
    channels, width = weight.shape
    for first, end, slot in _spans(query_start_loc, state_slots):
        if first == end:
            continue
        xin = torch.cat([conv_state[slot].t().to(x.dtype), x[first:end]], dim=0)
        y = F.conv1d(xin.t().unsqueeze(0), weight.unsqueeze(1), bias, groups=channels)[0].t()
        out[first:end] = F.silu(y) if silu else y
        if width > 1:
            conv_state[slot] = xin[-(width - 1) :].t()
    return out


def _l2norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def gated_delta_rule_torch(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Tensor,
    query_start_loc: Tensor,
    state_slots: Tensor,
    scale: float,
    l2norm: bool,
    linear: bool = False,
) -> Tensor:
    """The gated delta rule (``linear``: the linear rule, no ``S^T k`` term),
    one row at a time in float32.

    q, k [T, Hk, Dk]; v [T, Hv, Dv]; g (log decay), beta [T, Hv] float32;
    state [S, Hv, Dk, Dv] float32, updated in place. Value head ``h`` reads
    q/k head ``h // (Hv // Hk)``. Returns [T, Hv, Dv] in v's dtype.
    """
    rep = v.shape[1] // k.shape[1]
    qf = q.float().repeat_interleave(rep, dim=1)
    kf = k.float().repeat_interleave(rep, dim=1)
    if l2norm:
        qf, kf = _l2norm(qf), _l2norm(kf)
    qf = qf * scale
    vf = v.float()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for first, end, slot in _spans(query_start_loc, state_slots):
        s = state[slot].float()
        for t in range(first, end):
            s = s * g[t].exp()[:, None, None]
            delta = vf[t] if linear else vf[t] - (s * kf[t][:, :, None]).sum(dim=1)
            delta = delta * beta[t][:, None]
            s = s + kf[t][:, :, None] * delta[:, None, :]
            out[t] = (s * qf[t][:, :, None]).sum(dim=1)
        state[slot] = s
    return out.to(v.dtype)


def causal_conv1d_rust(x, weight, bias, conv_state, query_start_loc, state_slots, silu):
    """``causal_conv1d_torch`` by the Rust kernel (the kernels' dtypes, contiguous)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    _core.causal_conv1d(out, x, weight, bias, conv_state, query_start_loc, state_slots, silu)
    return out


def gated_delta_rule_rust(
    q, k, v, g, beta, state, query_start_loc, state_slots, scale, l2norm, linear=False
):
    """``gated_delta_rule_torch`` by the Rust kernel."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty_like(v)
    _core.gated_delta_rule(
        out,
        q,
        k,
        v,
        g.float().contiguous(),
        beta.float().contiguous(),
        state,
        query_start_loc,
        state_slots,
        scale,
        l2norm,
        linear,
    )
    return out


# ---- Qwen3.5's elementwise parts (torch reference and Rust kernels) -------------


def sigmoid_mul_torch(x: Tensor, gate: Tensor) -> Tensor:
    """``x * sigmoid(gate)`` (the attention output gate of Qwen3.5)."""
    return x * torch.sigmoid(gate)


def gated_rms_norm_torch(x: Tensor, z: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Qwen3.5's gated head norm: ``weight * round(x / rms(x))`` (as the model's
    other RMSNorms), times ``silu(z)`` in float32, rounded to x's dtype once."""
    xf = x.float()
    normed = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (normed * F.silu(z.float())).to(x.dtype)


def delta_gates_torch(
    a: Tensor, b: Tensor, a_log: Tensor, dt_bias: Tensor
) -> tuple[Tensor, Tensor]:
    """Gated DeltaNet's gates: ``g = -exp(A_log) * softplus(a + dt_bias)`` (the log
    decay) and ``beta = sigmoid(b)`` (rounded to b's dtype), both float32."""
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, b.sigmoid().float()


def sigmoid_mul_rust(x: Tensor, gate: Tensor) -> Tensor:
    """``sigmoid_mul_torch`` by the Rust kernel."""
    x, gate = x.contiguous(), gate.reshape(x.shape).contiguous()
    out = torch.empty_like(x)
    _core.sigmoid_mul(out, x, gate)
    return out


def gated_rms_norm_rust(x: Tensor, z: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``gated_rms_norm_torch`` by the Rust kernel (x, z [rows, dim])."""
    x, z = x.contiguous(), z.contiguous()
    out = torch.empty_like(x)
    _core.gated_rms_norm(out, x, z, weight, eps)
    return out


def delta_gates_rust(a: Tensor, b: Tensor, a_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    """``delta_gates_torch`` by the Rust kernel."""
    a, b = a.contiguous(), b.contiguous()
    g = torch.empty(a.shape, dtype=torch.float32)
    beta = torch.empty(a.shape, dtype=torch.float32)
    _core.delta_gates(g, beta, a, b, a_log.float().contiguous(), dt_bias.float().contiguous())
    return g, beta


# ---- Mamba-2's elementwise parts (Granite 4.0; torch reference and Rust kernels) ----


def mamba_gates_torch(
    dt: Tensor, a_log: Tensor, dt_bias: Tensor, limit: tuple[float, float]
) -> tuple[Tensor, Tensor]:
    """Mamba-2's time steps: ``beta = clamp(softplus(dt + dt_bias), *limit)`` and
    ``g = -exp(A_log) * beta`` (the linear rule's write strength and log decay),
    both float32 [T, H]."""
    beta = F.softplus(dt.float() + dt_bias.float()).clamp(*limit)
    return -a_log.float().exp() * beta, beta


def mamba_norm_torch(
    y: Tensor, x: Tensor, z: Tensor, d: Tensor, weight: Tensor, groups: int, eps: float
) -> Tensor:
    """Mamba-2's gated group norm of the scan ``y`` [T, H*P]: ``(y + D x) *
    silu(z)`` in float32, RMS-normalised over each of ``groups`` slices of a
    row, times the weight, rounded to y's dtype once."""
    n, heads = y.shape[0], d.shape[0]
    v = y.float().reshape(n, heads, -1) + d.float()[:, None] * x.float().reshape(n, heads, -1)
    v = v.reshape(y.shape) * F.silu(z.float())
    g = v.view(v.shape[0], groups, -1)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * g.view_as(v)).to(y.dtype)


def mamba_gates_rust(
    dt: Tensor, a_log: Tensor, dt_bias: Tensor, limit: tuple[float, float]
) -> tuple[Tensor, Tensor]:
    """``mamba_gates_torch`` by the Rust kernel."""
    dt = dt.contiguous()
    g = torch.empty(dt.shape, dtype=torch.float32)
    beta = torch.empty(dt.shape, dtype=torch.float32)
    _core.mamba_gates(g, beta, dt, a_log.float().contiguous(), dt_bias.float().contiguous(), *limit)
    return g, beta


def mamba_norm_rust(
    y: Tensor, x: Tensor, z: Tensor, d: Tensor, weight: Tensor, groups: int, eps: float
) -> Tensor:
    """``mamba_norm_torch`` by the Rust kernel."""
    y, x, z = y.contiguous(), x.contiguous(), z.contiguous()
    out = torch.empty_like(y)
    _core.mamba_norm(out, y, x, z, d.float().contiguous(), weight, groups, eps)
    return out
