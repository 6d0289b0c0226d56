"""What ``fastllm env`` reports: the CUDA probe and what to do about it, the
CPU (what it has, what the OS allows, which kernel path each family of CPU
kernels runs), the kernels' threads and the environment switches set."""

from __future__ import annotations

import os
import platform as _os_platform
import sys
from typing import Any

# The instruction sets the CPU kernels use: (label, the cpu_features keys it needs).
_CPU_FEATURE_LABELS = (
    ("AVX2", ("avx2",)),
    ("FMA", ("fma",)),
    ("F16C", ("f16c",)),
    ("AVX-512 (F, BW, VL)", ("avx512f", "avx512bw", "avx512vl")),
    ("AVX-VNNI", ("avxvnni",)),
    ("AVX512-VNNI", ("avx512vnni",)),
    ("AVX512-BF16", ("avx512bf16",)),
    ("AMX-BF16", ("amx_tile", "amx_bf16")),
)


# How each integer kernel path computes its int8 dot products.
_INT_PATH_INSTRUCTIONS = {
    "scalar": "portable Rust",
    "avx2": "vpmaddubsw + vpmaddwd, 256-bit",
    "avxvnni": "vpdpbusd, 256-bit",
    "avx512": "vpmaddubsw + vpmaddwd, 512-bit",
    "avx512vnni": "vpdpbusd, 512-bit",
}


def collect_env() -> dict[str, Any]:
    """Everything ``fastllm env`` reports, as plain JSON-ready values."""
    from fastllm import __version__
    from fastllm.platform import probe

    report = probe()
    info: dict[str, Any] = {
        "fastllm_version": __version__,
        "python_version": sys.version.split()[0],
        "platform": f"{_os_platform.system()} {_os_platform.machine()}",
        "cuda": {
            "available": report.available,
            "device_count": report.device_count,
            "devices": [
                {
                    "index": d.index,
                    "name": d.name,
                    "total_memory": d.total_memory,
                    "compute_capability": list(d.compute_capability),
                }
                for d in report.devices
            ],
            "driver_version": report.driver_version,
            "library": report.library,
            "reason": report.reason,
        },
        "device": "cuda" if report.available else "cpu",
        "advice": cuda_advice(report),
        "env": {
            k: os.environ.get(k)
            for k in (
                "FASTLLM_DEVICE",
                "CUDA_VISIBLE_DEVICES",
                "FASTLLM_LIBCUDA",
                "FASTLLM_PROBE_TIMEOUT",
                "FASTLLM_NUM_THREADS",
            )
        },
    }
    try:
        from fastllm import _core

        info["cpu"] = _cpu_model_name()
        info["cpu_features"] = dict(_core.cpu_features())
        info["num_threads"] = int(_core.num_threads())
        info["gemm_path"] = _gemm_path(_core)
        try:
            info["simd_path"] = _core.simd_path()
        except ValueError as exc:
            info["simd_path"] = f"the fastest this CPU runs ({exc})"
        try:
            info["quant_path"] = _core.quant_default_path()
        except ValueError as exc:
            info["quant_path"] = f"the fastest this CPU runs ({exc})"
        info["quant_formats"] = list(_core.quant_formats())
    except Exception as exc:
        info["cpu_features"] = {}
        info["num_threads"] = None
        info["core_error"] = repr(exc)
    return info


def _gemm_path(core: Any) -> str:
    """The float GEMM's path: ``FASTLLM_CPU_GEMM_PATH``'s where it names one this
    CPU runs (the switch is read where layers are packed), else the fastest."""
    from fastllm import envs  # not fastllm.layers.linear: this report imports no torch

    named = envs.get("FASTLLM_CPU_GEMM_PATH")
    if not named:
        return core.gemm_default_path()
    if named in core.gemm_paths():
        return named
    return f"the fastest this CPU runs (FASTLLM_CPU_GEMM_PATH={named!r} names no path it runs)"


def cuda_advice(report: Any) -> str:
    """One sentence telling the user what to do about the probe's outcome."""
    if report.available:
        return "CUDA will be used by default (device='auto'); pass device='cpu' to force the CPU."
    reason = report.reason or ""
    if "FASTLLM_DEVICE=cpu" in reason:
        return "Unset FASTLLM_DEVICE to let fastllm look for a GPU."
    if "CUDA_VISIBLE_DEVICES" in reason and "hides" in reason:
        return (
            "Unset CUDA_VISIBLE_DEVICES or set it to the GPUs to use, e.g. CUDA_VISIBLE_DEVICES=0."
        )
    if "no NVIDIA kernel driver" in reason or "no CUDA driver on" in reason:
        return "Running on the CPU. To use a GPU, install the NVIDIA driver and check `nvidia-smi`."
    if "did not answer" in reason:
        return "The driver hung; check `nvidia-smi`, or raise FASTLLM_PROBE_TIMEOUT if it is only slow."
    if "crashed" in reason:
        return "The driver crashed in a child process (this one is fine); check `nvidia-smi` and the driver install."
    return "Running on the CPU. Fix the cause above (check `nvidia-smi`) to use a GPU."


def format_env(info: dict[str, Any]) -> str:
    """The human-readable text of ``fastllm env``."""
    cuda = info["cuda"]
    lines = [
        f"fastllm {info['fastllm_version']}, Python {info['python_version']}, {info['platform']}",
        "",
    ]
    if cuda["available"]:
        lines.append(
            f"CUDA: available, {cuda['device_count']} device(s), driver "
            f"{_cuda_version(cuda['driver_version'])}, library {cuda['library']}"
        )
        for d in cuda["devices"]:
            major, minor = d["compute_capability"]
            lines.append(
                f"  [{d['index']}] {d['name']}, {d['total_memory'] / 2**30:.1f} GiB, "
                f"compute capability {major}.{minor}"
            )
    else:
        lines.append("CUDA: not used")
        lines.append(f"  why: {cuda['reason']}")
        if cuda["library"]:
            lines.append(f"  library: {cuda['library']}")
    lines.append(f"  what to do: {info['advice']}")
    lines.append(f"Device for device='auto': {info['device']}")
    lines.append("")
    lines += _format_cpu(info)
    lines.append(f"Threads for CPU kernels: {info['num_threads']} (FASTLLM_NUM_THREADS to change)")
    set_vars = {k: v for k, v in info["env"].items() if v is not None}
    if set_vars:
        lines.append("Environment: " + ", ".join(f"{k}={v!r}" for k, v in set_vars.items()))
    return "\n".join(lines)


def _format_cpu(info: dict[str, Any]) -> list[str]:
    """The CPU part of the report: what the CPU has, what the OS lets a
    process use, and which kernel path each family of CPU kernels runs."""
    features = info["cpu_features"]
    if not features:
        return [f"CPU: unknown ({info.get('core_error')})"]
    lines = [f"CPU: {info.get('cpu') or 'unknown model'}"]
    has = [label for label, keys in _CPU_FEATURE_LABELS if all(features.get(k) for k in keys)]
    lacks = [label for label, keys in _CPU_FEATURE_LABELS if label not in has]
    lines.append(
        f"  has: {', '.join(has) or 'none of the SIMD instruction sets fastllm uses'}"
        " (AVX and AVX-512 counted only where the OS saves their registers)"
    )
    if lacks:
        lines.append(f"  does not have: {', '.join(lacks)}")
    if features.get("amx_tile"):
        lines.append(
            "  AMX: the OS granted this process the tile state"
            if features.get("amx_permitted")
            else "  AMX: the OS did not grant the tile state (Linux >= 5.16 does), so it is not used"
        )
    if info.get("quant_path"):
        gemm = info["gemm_path"]
        quant = info["quant_path"]
        lines.append("CPU kernel paths (chosen at run time from the above):")
        lines.append(f"  float matrix products (f32/bf16 linear layers): {gemm}")
        lines.append(
            f"  integer matrix products ({', '.join(info['quant_formats'])}; quantization="
            f"'int8'/'int4', GGUF files): {quant}"
            + (f" ({_INT_PATH_INSTRUCTIONS[quant]})" if quant in _INT_PATH_INSTRUCTIONS else "")
        )
        simd = info.get("simd_path", gemm)
        lines.append(f"  paged attention, sampling, norms and activations: {simd}")
    return lines


def _cpu_model_name() -> str | None:
    """The CPU's model name as the OS reports it (None where it does not)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return _os_platform.processor() or None


def _cuda_version(version: int | None) -> str:
    if version is None:
        return "?"
    return f"{version // 1000}.{version % 1000 // 10}"
