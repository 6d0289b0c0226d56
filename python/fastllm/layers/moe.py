"""The mixture-of-experts block: a router picks ``top_k`` of ``num_experts``
gated MLPs for each token, and the block's output is their weighted sum.

The router is a float matrix (never quantized: a quantized router changes
which experts run), computed in the model's dtype and turned into
probabilities in float32 as the reference implementations do. Each expert
is a gated MLP with fused gate/up (``ExpertMLP``), so the engine packs or
quantizes experts like any other linear layer. On the CPU, once the experts
are packed, one ``_core.MoeBlock`` call runs the router, the routing, the
step's tokens grouped by expert (``_core.MoeExperts``, ``rust/moe/``: each
active expert's weights stream once per step, and experts that no token
chose are never read) and the shared expert. Elsewhere the block runs the
same maths in torch, expert by expert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastllm import _core
from fastllm.layers import CPU_KERNEL_DTYPES, Module, float32_parameter
from fastllm.layers.activation import get_activation
from fastllm.layers.linear import Linear, packed_linear

#: Expert activations the Rust kernel runs, by config name.
KERNEL_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "swiglu_oai": "swiglu_oai",
}


def swiglu_oai(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU of a fused ``[gate | up]`` row:
    ``(clamp(up) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``."""
    d = x.shape[-1] // 2
    gate = x[..., :d].clamp(max=limit)
    up = x[..., d:].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class ExpertMLP(Module):
    """One expert: ``down(act(gate(x)) * up(x))``, gate and up fused."""

    def __init__(
        self, hidden: int, intermediate: int, act: str, bias: bool, alpha: float, limit: float
    ) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.alpha, self.limit = alpha, limit
        self.act = None if act == "swiglu_oai" else get_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        h = self.gate_up_proj(x)
        if self.act is None:
            h = swiglu_oai(h, self.alpha, self.limit)
        else:
            d = h.shape[-1] // 2
            h = self.act(h[..., :d]) * h[..., d:]
        return self.down_proj(h)


class Router(Module):
    """The router's logits ``x W^T (+ b)``, a float matrix of [experts, hidden].

    On the CPU the block's ``_core.MoeBlock`` runs it from float panels of
    the same weights (``pack``), with float32 logits: a torch GEMV between
    two Rust kernel calls leaves torch's worker threads spinning on the cores
    the kernels' team needs (0.3 ms per layer on 2 cores)."""

    def __init__(self, hidden: int, num_experts: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(num_experts), requires_grad=False) if bias else None
        self.packed = None

    def pack(self) -> None:
        """The router's float panels (``packed``), for ``_core.MoeBlock``."""
        self.packed = packed_linear(self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """float32 logits [T, experts], computed in the model's dtype (the torch path)."""
        return F.linear(x, self.weight, self.bias).float()


def route_torch(
    logits: torch.Tensor,
    top_k: int,
    scoring: str,
    renormalize: bool,
    selection_bias: torch.Tensor | None = None,
    renorm_eps: float = 0.0,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids int32 [T, k], weights float32 [T, k]) of float32 logits:
    softmax (or sigmoid) scores, the top ``top_k`` (chosen on ``score +
    selection_bias`` where given; the weights stay the scores), divided by
    ``sum + renorm_eps`` where asked, times ``scale`` (``_core.moe_route``)."""
    scores = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
    if selection_bias is None:
        weights, ids = torch.topk(scores, top_k, dim=-1)
    else:
        ids = torch.topk(scores + selection_bias, top_k, dim=-1).indices
        weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + renorm_eps)
    if scale != 1.0:
        weights = weights * scale
    return ids.to(torch.int32), weights


class SparseMoeBlock(Module):
    """Router, experts and (Qwen2-MoE, Qwen3.5-MoE) a shared expert behind a
    sigmoid gate (``shared_gated``; Granite 4.0's dense MLP beside its
    experts is a shared expert added ungated). ``selection_bias``
    (LFM2-MoE's ``expert_bias``, a float32 buffer of one value per expert)
    shifts which experts are chosen but not their weights; ``renorm_eps``
    joins the renormalising sum and ``scale`` multiplies the weights
    (``route_torch``)."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        act: str = "silu",
        *,
        scoring: str = "softmax",
        router_bias: bool = False,
        expert_bias: bool = False,
        alpha: float = 1.702,
        limit: float = 7.0,
        shared_intermediate: int = 0,
        shared_gated: bool = True,
        selection_bias: bool = False,
        renorm_eps: float = 0.0,
        scale: float = 1.0,
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(
                f"config.json: num_experts_per_tok ({top_k}) must be between 1 and the "
                f"number of experts ({num_experts})"
            )
        if act not in KERNEL_ACTIVATIONS:
            raise ValueError(
                f"config.json: unsupported expert activation {act!r}; supported: "
                f"{', '.join(sorted(KERNEL_ACTIVATIONS))}"
            )
        self.num_experts, self.top_k = num_experts, top_k
        self.renormalize, self.scoring = renormalize, scoring
        self.renorm_eps, self.scale = float(renorm_eps), float(scale)
        self.selection_bias = (
            float32_parameter(torch.zeros(num_experts)) if selection_bias else None
        )
        self.gate = Router(hidden, num_experts, router_bias)
        self.experts = nn.ModuleList(
            ExpertMLP(hidden, intermediate, act, expert_bias, alpha, limit)
            for _ in range(num_experts)
        )
        self.kernel_act = KERNEL_ACTIVATIONS[act]
        self.alpha, self.limit = alpha, limit
        self.shared_expert: ExpertMLP | None = None
        self.shared_expert_gate: Router | None = None
        if shared_intermediate:
            self.shared_expert = ExpertMLP(hidden, shared_intermediate, act, False, alpha, limit)
            if shared_gated:
                self.shared_expert_gate = Router(hidden, 1, False)
        # The Rust block (``_core.MoeBlock``) over the packed experts (``packed_kernel``).
        self.kernel = None
        self._kernel_of = None

    def packed_kernel(self):
        """The ``_core.MoeBlock`` of this block (router, routing, experts and
        shared expert in one call; built once the experts are packed), or
        None while any part runs torch."""
        first = self.experts[0].gate_up_proj.packed
        if first is None:
            return None
        if self._kernel_of is not first:
            self.kernel = self._build_kernel()
            self._kernel_of = first
        return self.kernel

    def _build_kernel(self):
        routers = [r for r in (self.gate, self.shared_expert_gate) if r is not None]
        if any(r.weight.dtype not in CPU_KERNEL_DTYPES for r in routers):
            return None
        for router in routers:
            router.pack()
        experts = _core.MoeExperts(
            [e.gate_up_proj.packed for e in self.experts],
            [e.down_proj.packed for e in self.experts],
            activation=self.kernel_act,
            alpha=self.alpha,
            limit=self.limit,
        )
        shared = {}
        if self.shared_expert is not None:
            shared = {
                "shared_gate_up": self.shared_expert.gate_up_proj.packed,
                "shared_down": self.shared_expert.down_proj.packed,
            }
            if self.shared_expert_gate is not None:
                shared["shared_gate"] = self.shared_expert_gate.packed
            if any(v is None for v in shared.values()):
                return None
        bias = self.selection_bias
        return _core.MoeBlock(
            self.gate.packed,
            experts,
            self.top_k,
            self.scoring,
            self.renormalize,
            **shared,
            selection_bias=None if bias is None else bias.float().tolist(),
            renorm_eps=self.renorm_eps,
            scale=self.scale,
        )

    def _experts_torch(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in torch.unique(ids).tolist():
            tokens, slot = torch.where(ids == e)
            y = self.experts[e](x[tokens])
            out.index_add_(0, tokens, y.float() * w[tokens, slot, None])
        return out.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        kernel = self.packed_kernel() if x.device.type == "cpu" else None
        if kernel is not None:
            x = x.contiguous()
            out = torch.empty_like(x)
            kernel.forward(out, x)
            return out
        bias = None if self.selection_bias is None else self.selection_bias.float()
        ids, w = route_torch(
            self.gate(x),
            self.top_k,
            self.scoring,
            self.renormalize,
            bias,
            self.renorm_eps,
            self.scale,
        )
        out = self._experts_torch(x, ids, w)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            gate = torch.sigmoid(self.shared_expert_gate(x)).to(x.dtype)
            out = out + gate * self.shared_expert(x)
        elif self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return out
