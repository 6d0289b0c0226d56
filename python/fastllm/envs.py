"""Every ``FASTLLM_*`` environment switch in one table: its default, what it
does, and who reads it. The Python side reads them only through this module;
the Rust core reads its own (``rust/cpu/threads.rs``, ``rust/cuda/``) before
any Python runs, and they are listed here so that one page documents all.
``docs/architecture.md`` prints this table and a test keeps them equal.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Switch:
    """One environment switch."""

    name: str
    default: str
    doc: str
    #: ``python`` or ``rust``: the side that reads it.
    reader: str = "python"


SWITCHES: tuple[Switch, ...] = (
    Switch("FASTLLM_DEVICE", "", "`cpu`: never touch a GPU driver (the probe reports why)", "rust"),
    Switch("FASTLLM_LIBCUDA", "", "path of the CUDA driver library the probe loads", "rust"),
    Switch("FASTLLM_PROBE_TIMEOUT", "15", "seconds the probe's child may take in cuInit", "rust"),
    Switch("FASTLLM_NUM_THREADS", "all cores", "threads of the CPU kernels", "rust"),
    Switch("FASTLLM_NVRTC", "", "path of libnvrtc for the CUDA kernels", "rust"),
    Switch(
        "FASTLLM_CACHE_DIR",
        "~/.cache/fastllm",
        "where compiled CUDA kernels and GGUF packed-weight caches live",
    ),
    Switch("FASTLLM_GGUF_CACHE", "1", "`0`: no packed-weight cache for GGUF files"),
    Switch(
        "FASTLLM_CPU_GEMM",
        "auto",
        "`auto`: pack linear layers where a SIMD kernel runs; `rust`: always; `torch`: never",
    ),
    Switch(
        "FASTLLM_CPU_GEMM_PATH",
        "",
        "float GEMM kernel path (`avx2`, `avx512`, `avx512bf16`, `scalar`); default: the CPU's fastest",
    ),
    Switch(
        "FASTLLM_CPU_SIMD_PATH",
        "",
        "SIMD path of attention, sampling, norms and activations (`avx2`, `avx512`, `scalar`);"
        " default: the CPU's fastest",
        "rust",
    ),
    Switch(
        "FASTLLM_CPU_INT_PATH",
        "",
        "integer kernel path of quantized weights (`avx2`, `avxvnni`, `avx512`, `avx512vnni`,"
        " `scalar`); default: the CPU's fastest",
        "rust",
    ),
    Switch("FASTLLM_CPU_FUSED", "1", "`0`: run decoder layers one by one, not as one fused call"),
    Switch("FASTLLM_CUDA_KERNELS", "1", "`0`: run torch instead of fastllm's CUDA kernels"),
    Switch("FASTLLM_CONFIGURE_LOGGING", "1", "`0`: leave the `fastllm` logger as it is"),
    Switch("FASTLLM_LOGGING_LEVEL", "info", "level of the `fastllm` logger"),
    Switch("FASTLLM_API_KEY", "", "the key `fastllm serve` requires (as `--api-key`)"),
)

_BY_NAME = {s.name: s for s in SWITCHES}
_OFF = ("0", "false", "no", "off")
_ON = ("", "1", "true", "yes", "on")


def get(name: str) -> str | None:
    """The switch's value as set (stripped), or None when unset or empty."""
    if name not in _BY_NAME:
        raise KeyError(f"{name} is not one of fastllm's environment switches")
    value = os.environ.get(name, "").strip()
    return value or None


def flag(name: str) -> bool:
    """A 0/1 switch: False for 0/false/no/off, True for 1/true/yes/on or unset;
    anything else is a ValueError naming the switch."""
    value = (get(name) or _BY_NAME[name].default).lower()
    if value in _OFF:
        return False
    if value in _ON:
        return True
    raise ValueError(f"{name} must be 0 or 1, got {value!r}")


def off(name: str) -> bool:
    """Whether a switch that is on by default is turned off (0/false/no/off);
    any other value leaves it on."""
    return (get(name) or "").lower() in _OFF


def choice(name: str, allowed: tuple[str, ...]) -> str:
    """A switch with a few named values (its default when unset)."""
    value = (get(name) or _BY_NAME[name].default).lower()
    if value not in allowed:
        expected = ", ".join(repr(a) for a in allowed)
        raise ValueError(f"{name}={value!r}: expected one of {expected}")
    return value


def cpu_fused() -> bool:
    """``FASTLLM_CPU_FUSED``: whether decoder layers may run as one fused call."""
    return flag("FASTLLM_CPU_FUSED")


def cache_root() -> str:
    """``FASTLLM_CACHE_DIR``, else ``$XDG_CACHE_HOME/fastllm`` or ``~/.cache/fastllm``."""
    root = get("FASTLLM_CACHE_DIR")
    if root:
        return root
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "fastllm")


def set_num_threads(threads: int) -> None:
    """Sets ``FASTLLM_NUM_THREADS`` for the Rust core of this process (read once,
    when the kernels' thread pool starts)."""
    os.environ["FASTLLM_NUM_THREADS"] = str(threads)


def markdown_table() -> str:
    """The switches as a Markdown table (docs/architecture.md holds it)."""
    rows = ["| switch | default | what it does | read by |", "|---|---|---|---|"]
    for s in SWITCHES:
        default = f"`{s.default}`" if s.default else "unset"
        rows.append(f"| `{s.name}` | {default} | {s.doc} | {s.reader} |")
    return "\n".join(rows)
