"""Type stubs for the compiled Rust core, ``fastllm._core``."""

import torch

__version__: str

def num_threads() -> int:
    """Number of threads the Rust kernels use (``FASTLLM_NUM_THREADS`` or the cores)."""

def linear(
    out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    path: str | None = None,
) -> None:
    """Writes ``x @ weight.T (+ bias)`` into ``out``: x [M, K], weight [N, K], bias [N], out [M, N].

    bf16 or f32 tensors, contiguous, on the CPU; ``out`` has x's dtype; f32
    accumulation. ``path`` forces a kernel (one of ``linear_paths()``); by
    default ``FASTLLM_LINEAR_PATH`` or the fastest one. Releases the GIL.
    """

def linear_paths() -> list[str]:
    """Names of the linear kernel paths this CPU runs (subset of scalar, avx2, avx512, avx512bf16)."""

def linear_default_path(m: int = 1, x_bf16: bool = True) -> str:
    """The path ``linear`` uses when none is named, for ``m`` rows of bf16 (or f32) x.

    ``FASTLLM_LINEAR_PATH`` if set; else avx512bf16 for up to 4 rows of bf16 x
    (memory-bound), avx512 beyond, or the best path this CPU has.
    """

def stream_triad_gbs(bytes: int = 200_000_000, repeats: int = 5) -> float:
    """STREAM-triad bandwidth in GB/s (best pass) over f32 arrays of ``bytes`` each, on the Rust pool."""
