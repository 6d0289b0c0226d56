"""Import and probe costs, measured side by side in one run.

    python benches/import_probe.py [--repeats 7] [--loops 100]

Reports, each the median over fresh interpreters:
  - `import fastllm` against `import torch` (time inside the process), and the ratio;
  - `fastllm.probe()` when no driver is present (the platform check stops it);
  - `fastllm.probe()` through the isolated child with the fake driver of
    tests/fake_cuda.c, and the cached second call;
then starts `python -c "import fastllm._core"` --loops times and counts failures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROBE_VARS = ("FASTLLM_DEVICE", "CUDA_VISIBLE_DEVICES", "FASTLLM_LIBCUDA", "FAKE_CUDA_MODE")


def env_with(**extra: str) -> dict[str, str]:
    """This environment with fastllm's sources importable and the probe variables cleared."""
    env = {k: v for k, v in os.environ.items() if k not in PROBE_VARS}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT / "python"), env.get("PYTHONPATH")) if p
    )
    env.update(extra)
    return env


def timed_in_child(setup: str, stmt: str, env: dict[str, str]) -> float:
    """Seconds `stmt` takes in a fresh interpreter, measured inside it."""
    code = (
        f"import time\n{setup}\nt = time.perf_counter()\n{stmt}\nprint(time.perf_counter() - t)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return float(out.stdout.strip().splitlines()[-1])


def median_ms(setup: str, stmt: str, env: dict[str, str], repeats: int) -> float:
    return 1000 * statistics.median(timed_in_child(setup, stmt, env) for _ in range(repeats))


def build_fake_driver(out_dir: Path) -> Path:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("a C compiler is needed to build the fake driver")
    lib = out_dir / "libfakecuda.so"
    subprocess.run(
        [cc, "-shared", "-fPIC", "-O1", "-o", lib, ROOT / "tests" / "fake_cuda.c"], check=True
    )
    return lib


def main() -> None:
    """Runs every measurement and prints a table (and JSON with --json)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7, help="fresh interpreters per median")
    ap.add_argument("--loops", type=int, default=100, help="fresh `import fastllm._core` runs")
    ap.add_argument("--json", action="store_true", help="also print the figures as JSON")
    args = ap.parse_args()

    env = env_with()
    results: dict[str, float | int | str] = {}
    results["python"] = sys.version.split()[0]
    results["import_fastllm_ms"] = median_ms("", "import fastllm", env, args.repeats)
    results["import_fastllm_core_ms"] = median_ms(
        "", "import fastllm, fastllm._core", env, args.repeats
    )
    results["import_torch_ms"] = median_ms("", "import torch", env, args.repeats)
    results["ratio_fastllm_to_torch"] = results["import_fastllm_ms"] / results["import_torch_ms"]
    results["import_fastllm_platform_ms"] = median_ms(
        "import fastllm, fastllm._core", "import fastllm.platform", env, args.repeats
    )
    results["probe_no_driver_ms"] = median_ms(
        "import fastllm, fastllm._core, fastllm.platform", "fastllm.probe()", env, args.repeats
    )
    with tempfile.TemporaryDirectory() as tmp:
        lib = build_fake_driver(Path(tmp))
        fake = env_with(FASTLLM_LIBCUDA=str(lib), FAKE_CUDA_DEVICES="2")
        results["probe_isolated_fake_driver_ms"] = median_ms(
            "import fastllm, fastllm._core, fastllm.platform", "fastllm.probe()", fake, args.repeats
        )
        results["probe_cached_call_ms"] = median_ms(
            "import fastllm, fastllm._core, fastllm.platform\nfastllm.probe()",
            "fastllm.probe()",
            fake,
            args.repeats,
        )
        crash = env_with(FASTLLM_LIBCUDA=str(lib), FAKE_CUDA_MODE="segv")
        results["probe_isolated_crashing_driver_ms"] = median_ms(
            "import fastllm, fastllm._core, fastllm.platform",
            "fastllm.probe()",
            crash,
            args.repeats,
        )

    failures = 0
    start = time.perf_counter()
    for _ in range(args.loops):
        proc = subprocess.run(
            [sys.executable, "-c", "import fastllm._core"], env=env, capture_output=True
        )
        failures += proc.returncode != 0
    results["import_core_loops"] = args.loops
    results["import_core_failures"] = failures
    results["import_core_loop_s"] = time.perf_counter() - start

    print(f"Python {results['python']}, medians of {args.repeats} fresh interpreters")
    rows = [
        ("import fastllm", results["import_fastllm_ms"]),
        ("import fastllm, fastllm._core", results["import_fastllm_core_ms"]),
        ("import torch", results["import_torch_ms"]),
        ("first fastllm.probe() imports fastllm.platform", results["import_fastllm_platform_ms"]),
        ("probe(), no driver present", results["probe_no_driver_ms"]),
        ("probe(), isolated child, fake driver", results["probe_isolated_fake_driver_ms"]),
        ("probe(), isolated child, crashing driver", results["probe_isolated_crashing_driver_ms"]),
        ("probe(), cached second call", results["probe_cached_call_ms"]),
    ]
    for name, ms in rows:
        print(f"  {name:<48} {ms:10.3f} ms")
    print(f"  {'import fastllm / import torch':<48} {results['ratio_fastllm_to_torch']:10.4f}")
    print(
        f"  {args.loops} fresh `python -c 'import fastllm._core'`: {failures} failures "
        f"({results['import_core_loop_s']:.1f} s)"
    )
    if args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
