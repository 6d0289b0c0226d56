"""Linear and embedding layers whose parameters start uninitialised.

The loader always assigns every parameter, so initialising them here would only
cost time (seconds for a 7B model) and memory.

On the CPU the engine packs every linear layer once after loading
(``pack_linears``): the weights move into the Rust GEMM's panel layout
(``_core.PackedLinear``, same values: float32 weights that hold only
bfloat16 values are stored as bfloat16) and every call, from batch-1
decode to prefill chunks, runs the Rust kernel on the kernels' thread team.
Elsewhere (CUDA, or ``FASTLLM_CPU_GEMM=torch``) layers call torch.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from fastllm import _core, envs
from fastllm.layers import CPU_KERNEL_DTYPES, Module

logger = logging.getLogger("fastllm")

GEMM_ENV = "FASTLLM_CPU_GEMM"
GEMM_PATH_ENV = "FASTLLM_CPU_GEMM_PATH"


def _packed_forward(packed, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Runs a ``_core.PackedLinear`` on the last dimension of ``x``."""
    if x.dim() == 2 and x.is_contiguous():
        # The models' case ([tokens, features]): no reshaping (this runs
        # about a hundred times per decode step).
        out = torch.empty(x.shape[0], packed.out_features, dtype=dtype)
        packed.forward(out, x)
        return out
    rows = x.reshape(-1, packed.in_features)
    if not rows.is_contiguous():
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], packed.out_features, dtype=dtype)
    packed.forward(out, rows)
    return out.view(*x.shape[:-1], packed.out_features)


class Linear(Module):
    """``y = x @ weight.T + bias`` with ``weight`` of shape [out_features, in_features]."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.packed = None

    def pack(self, packed=None) -> None:
        """Moves the weight (and bias) into the Rust GEMM's layout, or adopts
        ``packed`` (a ``_core.PackedLinear`` of this same weight), and frees
        the torch copy."""
        if packed is None:
            packed = packed_linear(self.weight, self.bias)
        self.packed = packed
        self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Applies the affine map to the last dimension of ``x``."""
        if self.packed is not None:
            return _packed_forward(self.packed, x, x.dtype)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        packed = ""
        if self.packed is not None:
            packed = f", {getattr(self.packed, 'format', 'packed')}"
        return f"in_features={self.in_features}, out_features={self.out_features}{packed}"


class Embedding(Module):
    """Token (or position) embedding table of shape [num_embeddings, dim]."""

    def __init__(self, num_embeddings: int, dim: int) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.dim = dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim), requires_grad=False)
        self.quantized = None
        self.dtype = None

    def quantize(self, table, dtype: torch.dtype | None = None) -> None:
        """Reads rows from ``table`` (a ``_core.QuantizedLinear`` of this
        table's weights, e.g. the tied head) from now on, and frees the float
        copy; rows come out in ``dtype`` (default: the table's former dtype)."""
        self.dtype = dtype if dtype is not None else self.weight.dtype
        self.quantized = table
        self.weight = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Looks up the rows ``ids``."""
        if self.quantized is not None:
            flat = ids.reshape(-1)
            if flat.dtype != torch.int64 or not flat.is_contiguous():
                flat = flat.to(torch.int64).contiguous()
            out = torch.empty(flat.shape[0], self.dim, dtype=self.dtype)
            self.quantized.embed(out, flat)
            return out.view(*ids.shape, self.dim)
        return F.embedding(ids, self.weight)

    def extra_repr(self) -> str:
        quantized = f", {self.quantized.format}" if self.quantized is not None else ""
        return f"{self.num_embeddings}, {self.dim}{quantized}"


def _detached(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().contiguous()


def head_logits(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """float32 logits of the language-model head (``model.head_weights()``),
    computed in float32 by the packed kernel when the model was packed."""
    packed = getattr(model, "packed_head", None)
    if packed is not None:
        return _packed_forward(packed, hidden, torch.float32)
    weight, bias = model.head_weights()
    return F.linear(hidden, weight, bias).float()


def gemm_path() -> str | None:
    """``FASTLLM_CPU_GEMM_PATH``: the float GEMM's kernel path, or None for
    the CPU's fastest (``_core.gemm_default_path()``)."""
    return envs.get(GEMM_PATH_ENV)


def packed_linear(weight: torch.Tensor, bias: torch.Tensor | None):
    """``weight`` (and ``bias``) packed for the float GEMM, on
    ``FASTLLM_CPU_GEMM_PATH``'s path (an error naming the switch when this
    CPU has no such path). A float32 weight of bf16 values (a bf16
    checkpoint run in float32) is packed as bf16 (``_core.PackedLinear``)."""
    path = gemm_path()
    try:
        return _core.PackedLinear(weight.detach().contiguous(), _detached(bias), path=path)
    except ValueError as e:
        if path is None:
            raise
        raise ValueError(f"{GEMM_PATH_ENV}={path!r}: {e}") from None


def gemm_mode() -> str:
    """``FASTLLM_CPU_GEMM``: ``auto`` (default: pack where a SIMD kernel
    runs), ``rust`` (always pack) or ``torch`` (never)."""
    return envs.choice(GEMM_ENV, ("auto", "rust", "torch"))


def should_pack(device: str, dtype: torch.dtype) -> bool:
    """Whether the engine packs a model of ``dtype`` on ``device``."""
    mode = gemm_mode()
    if device != "cpu" or dtype not in CPU_KERNEL_DTYPES or mode == "torch":
        return False
    if mode == "rust":
        return True
    # The portable scalar kernel is slower than torch: keep torch there.
    return _core.gemm_default_path() != "scalar"


def adopt_packed_head(model: nn.Module, head) -> None:
    """Gives ``model`` a ready head table (a GGUF file's quantized head), which
    ``pack_linears`` and ``quantize_model`` then keep."""
    model.packed_head = head


def pack_linears(model: nn.Module, make=None) -> int:
    """Packs every ``Linear`` of ``model`` and its language-model head (also
    when tied to the embedding, which keeps its own table here); returns the
    bytes of packed weights. ``make(weight, bias)`` builds one packed layer
    (default: ``_core.PackedLinear`` of the same dtype); the head is
    ``model.packed_head`` (kept when the loader already made it); the
    caller of a custom ``make`` says what it did."""
    default = make is None
    if default:
        make = packed_linear

    head = getattr(model, "packed_head", None)  # a GGUF file's quantized head is ready
    head_weight = None
    total = 0
    if head is None:
        head_weight, head_bias = model.head_weights()
        head = make(head_weight, head_bias)
        total = head.nbytes
    for module in model.modules():
        if isinstance(module, Linear) and module.weight is not None:
            if module.weight is head_weight:
                module.pack(head)
            else:
                module.pack(make(module.weight, module.bias))
                total += module.packed.nbytes
        elif isinstance(module, Linear) and module.packed is not None and not default:
            total += module.packed.nbytes  # quantized by the loader as it read it
    model.packed_head = head
    if default:
        logger.info("packed %.1f MB of linear weights for the %s kernel", total / 1e6, head.path)
    return total
