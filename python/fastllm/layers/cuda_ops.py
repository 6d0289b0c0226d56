"""CUDA kernels (``kernels/*.cu``, compiled by NVRTC, launched from Rust) on torch tensors.

Each function mirrors a CPU op or a torch expression for CUDA tensors and runs
on torch's current stream. They are used only for tensors already on a CUDA
device, i.e. after ``resolve_device`` chose CUDA because the probe succeeded;
nothing here is imported on the CPU path.

When compiling or launching fails (no NVRTC, a driver that rejects the image,
...) the kernels are switched off for the process with one warning, and every
function returns ``None`` so the caller runs its torch fallback.
``FASTLLM_CUDA_KERNELS=0`` switches them off from the start.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import torch

from fastllm import _core, envs

_R = TypeVar("_R")
_disabled: str | None = (
    "FASTLLM_CUDA_KERNELS=0 is set" if envs.off("FASTLLM_CUDA_KERNELS") else None
)
_warned = False


def enabled() -> bool:
    """Whether the CUDA kernels are in use (not switched off, nor disabled by a failure)."""
    return _disabled is None


def disabled_reason() -> str | None:
    """Why the kernels are off, or None while they are in use."""
    return _disabled


def _disable(reason: str) -> None:
    global _disabled, _warned
    _disabled = reason
    if not _warned:
        _warned = True
        logging.getLogger("fastllm").warning(
            "CUDA kernels disabled, using torch operations instead: %s", reason
        )


def _run(what: str, launch: Callable[[], _R]) -> _R | None:
    """Runs a launch; a failure disables the kernels (warning once) and gives None."""
    if _disabled is not None:
        return None
    try:
        return launch()
    except (RuntimeError, ValueError, OSError) as exc:
        _disable(f"{what}: {exc}")
        return None


def _stream(t: torch.Tensor) -> int:
    return int(torch.cuda.current_stream(t.device).cuda_stream)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> bool:
    """Stores key/value [T, kv_heads, head] into their cache slots; False if the kernels are off."""

    def launch() -> bool:
        _core.cuda_reshape_and_cache(
            key, value, key_cache, value_cache, slot_mapping, _stream(key_cache)
        )
        return True

    return _run("reshape_and_cache", launch) is not None


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Paged attention of query [T, heads, head] (CPU kernel's contract, ``sinks``
    float32 [heads] on the query's device or None); None if the kernels are off."""
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    query = query.contiguous()

    def launch() -> torch.Tensor:
        _core.cuda_paged_attention(
            out,
            query,
            key_cache,
            value_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            float(scale),
            int(sliding_window),
            float(softcap),
            _stream(query),
            None if sinks is None else sinks.contiguous(),
        )
        return out

    return _run("paged_attention", launch)


def _rows(x: torch.Tensor, width: int) -> torch.Tensor:
    """x as [rows, width] with contiguous rows (a view when possible)."""
    if x.dim() == 2 and x.stride(-1) == 1:
        return x
    return x.reshape(-1, width)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """``weight * T(x * rsqrt(mean(x^2) + eps))`` over the last dimension; None if the kernels are off."""
    dim = x.shape[-1]
    x2 = _rows(x, dim)
    out = torch.empty((x2.shape[0], dim), dtype=x.dtype, device=x.device)

    def launch() -> torch.Tensor:
        _core.cuda_rms_norm(out, x2, weight, float(eps), _stream(x))
        return out.reshape(x.shape)

    return _run("rms_norm", launch)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """Neox rotary of x [T, heads, head] by cos/sin [T, 1, half]; None if the kernels are off."""
    if x.dim() != 3 or cos.dim() != 3 or cos.shape[1] != 1 or sin.shape != cos.shape:
        return None
    if x.stride(-1) != 1 or x.stride(-2) != x.shape[-1]:
        x = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    c, s = cos[:, 0], sin[:, 0]
    if c.stride(-1) != 1 or s.stride(-1) != 1 or c.stride(0) != s.stride(0):
        c, s = c.contiguous(), s.contiguous()

    def launch() -> torch.Tensor:
        _core.cuda_rotary(out, x, c, s, _stream(x))
        return out

    return _run("rotary", launch)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """``silu(x[..., :d]) * x[..., d:]``; None if the kernels are off."""
    width = x.shape[-1]
    x2 = _rows(x, width)
    out = torch.empty((x2.shape[0], width // 2), dtype=x.dtype, device=x.device)

    def launch() -> torch.Tensor:
        _core.cuda_silu_and_mul(out, x2, _stream(x))
        return out.reshape(*x.shape[:-1], width // 2)

    return _run("silu_and_mul", launch)


def _u64_as_i64(v: int) -> int:
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >= 1 << 63 else v


def sample(
    logits: torch.Tensor, batch: _core.SamplingBatch
) -> tuple[list[int], list[float], list[int]] | None:
    """One token per row of float32 CUDA ``logits`` [B, V] with the CPU sampler's semantics.

    Returns (tokens, their raw logprobs, their ranks), or None if the kernels are off.
    The draw is the CPU sampler's counter-based race, so a seeded row given
    identical logits draws the same token as ``_core.sample`` on the same batch.
    """
    rows, vocab = logits.shape
    if batch.rows != rows:
        raise ValueError(f"batch: has {batch.rows} rows, logits has {rows}")
    dev = logits.device
    temperature, rep = batch.temperature, batch.repetition_penalty
    freq, pres = batch.frequency_penalty, batch.presence_penalty
    fparams = torch.tensor(
        [temperature, batch.top_p, batch.min_p, rep, freq, pres], dtype=torch.float32
    ).T.reshape(rows, 6)
    seeds = [_u64_as_i64(s) for s in batch.seed]
    iparams = torch.tensor([batch.top_k, seeds, batch.position], dtype=torch.int64).T.reshape(
        rows, 3
    )
    prompt_offsets, output_offsets = batch.prompt_offsets, batch.output_offsets
    offsets = torch.tensor([prompt_offsets, output_offsets], dtype=torch.int64)
    fparams_d = fparams.contiguous().to(dev)
    iparams_d = iparams.contiguous().to(dev)
    offsets_d = offsets.to(dev)
    prompt_d = _tokens_on(batch.prompt_tokens, dev)
    output_d = _tokens_on(batch.output_tokens, dev)
    logits = logits.float().contiguous()
    # Workspaces only when some row uses them (they are [rows, vocab] each).
    penalised = [
        (rep[r] != 1.0 or freq[r] != 0.0 or pres[r] != 0.0)
        and (prompt_offsets[r + 1] > prompt_offsets[r] or output_offsets[r + 1] > output_offsets[r])
        for r in range(rows)
    ]
    # 5e-6, not 1e-5: a margin so the kernel (comparing in f32) never disagrees.
    needs_w = any(penalised[r] or temperature[r] >= 5e-6 for r in range(rows))
    w = torch.empty((rows if needs_w else 0, vocab), dtype=torch.float32, device=dev)
    counts = torch.empty((rows if any(penalised) else 0, vocab), dtype=torch.int32, device=dev)
    out_token = torch.empty(rows, dtype=torch.int32, device=dev)
    out_logprob = torch.empty(rows, dtype=torch.float32, device=dev)
    out_rank = torch.empty(rows, dtype=torch.int32, device=dev)

    def launch() -> tuple[list[int], list[float], list[int]]:
        _core.cuda_sample(
            logits,
            fparams_d,
            iparams_d,
            prompt_d,
            offsets_d[0],
            output_d,
            offsets_d[1],
            w,
            counts,
            out_token,
            out_logprob,
            out_rank,
            _stream(logits),
        )
        packed = torch.stack([out_token, out_rank]).cpu()
        return packed[0].tolist(), out_logprob.cpu().tolist(), packed[1].tolist()

    return _run("sample", launch)


def _tokens_on(tokens: list[int], dev: torch.device) -> torch.Tensor:
    """A flat token history on the device (one dummy id when empty: no null pointer)."""
    return torch.tensor(tokens or [0], dtype=torch.int32).to(dev)
