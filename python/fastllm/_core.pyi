"""Type stubs for the compiled Rust core, ``fastllm._core``."""

from collections.abc import Sequence

from torch import Tensor

__version__: str

def num_threads() -> int:
    """Number of threads the Rust kernels use (``FASTLLM_NUM_THREADS`` or the cores)."""

# ---- sampling ----

def sample(
    logits: Tensor,
    temperature: Sequence[float],
    top_k: Sequence[int],
    top_p: Sequence[float],
    min_p: Sequence[float],
    repetition_penalty: Sequence[float],
    frequency_penalty: Sequence[float],
    presence_penalty: Sequence[float],
    seed: Sequence[int],
    position: Sequence[int],
    prompt_tokens: Tensor,
    prompt_offsets: Sequence[int],
    output_tokens: Tensor,
    output_offsets: Sequence[int],
    num_logprobs: Sequence[int],
) -> tuple[list[int], list[float], list[int], list[list[tuple[int, float]]]]:
    """Samples one token per row; returns (tokens, their raw logprobs, their ranks, top-N (id, logprob) per row).

    ``logits`` is float32 ``[B, V]``, CPU, contiguous, read only. Per-row sequences have
    length B; ``prompt_tokens`` / ``output_tokens`` are flat int32 tensors indexed by
    ``B + 1`` offsets. Order (vLLM's): logprobs of the raw logits, penalties, greedy if
    temperature < 1e-5, temperature, min_p, top-k, top-p, then an exponential race whose
    randomness is a function of (seed, position, token) only.
    """

def sampling_support(
    logits: Tensor,
    temperature: Sequence[float],
    top_k: Sequence[int],
    top_p: Sequence[float],
    min_p: Sequence[float],
    repetition_penalty: Sequence[float],
    frequency_penalty: Sequence[float],
    presence_penalty: Sequence[float],
    prompt_tokens: Tensor,
    prompt_offsets: Sequence[int],
    output_tokens: Tensor,
    output_offsets: Sequence[int],
) -> list[list[int]]:
    """The ascending token ids each row may draw after penalties and filters (debugging aid)."""

def sampling_uniform(seed: int, position: int, token: int) -> float:
    """The sampler's counter-based uniform draw in (0, 1) for (seed, position, token)."""
