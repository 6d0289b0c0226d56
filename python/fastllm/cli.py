"""The ``fastllm`` command.

Each subcommand is one ``add_<name>_parser`` function that registers its
arguments and one ``cmd_<name>`` function that runs it; ``main`` wires them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform as _os_platform
import sys
from typing import Any

_CPU_FEATURE_LABELS = (
    ("avx2", "AVX2"),
    ("fma", "FMA"),
    ("avx512f", "AVX-512F"),
    ("avx512bf16", "AVX512-BF16"),
    ("amx", "AMX-BF16 (usable)"),
)


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

        info["cpu_features"] = dict(_core.cpu_features())
        info["num_threads"] = int(_core.num_threads())
    except Exception as exc:
        info["cpu_features"] = {}
        info["num_threads"] = None
        info["core_error"] = repr(exc)
    return info


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
    features = info["cpu_features"]
    if features:
        present = [label for key, label in _CPU_FEATURE_LABELS if features.get(key)]
        absent = [label for key, label in _CPU_FEATURE_LABELS if not features.get(key)]
        lines.append(f"CPU features: {', '.join(present) or 'none of the SIMD paths'}")
        if absent:
            lines.append(f"  not available: {', '.join(absent)}")
        if features.get("amx_tile") and not features.get("amx_permitted"):
            lines.append(
                "  the CPU has AMX but the OS did not grant the tile state (Linux >= 5.16)"
            )
    else:
        lines.append(f"CPU features: unknown ({info.get('core_error')})")
    lines.append(f"Threads for CPU kernels: {info['num_threads']} (FASTLLM_NUM_THREADS to change)")
    set_vars = {k: v for k, v in info["env"].items() if v is not None}
    if set_vars:
        lines.append("Environment: " + ", ".join(f"{k}={v!r}" for k, v in set_vars.items()))
    return "\n".join(lines)


def _cuda_version(version: int | None) -> str:
    if version is None:
        return "?"
    return f"{version // 1000}.{version % 1000 // 10}"


def add_env_parser(sub: Any) -> None:
    """Registers ``fastllm env``."""
    p = sub.add_parser("env", help="show what fastllm sees on this machine and why")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_env)


def cmd_env(args: argparse.Namespace) -> int:
    """Runs ``fastllm env``."""
    info = collect_env()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(format_env(info))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand registered."""
    parser = argparse.ArgumentParser(prog="fastllm", description="fastllm command line")
    sub = parser.add_subparsers(dest="command", required=True)
    add_env_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fastllm`` console script."""
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
