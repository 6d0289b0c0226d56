#!/usr/bin/env bash
# GPU check of the CUDA path, for a GPU machine with no Rust toolchain and no
# network: Python 3.12 with torch (CUDA), transformers and nvidia-cuda-nvrtc.
#
# Build the wheel HERE first (`maturin build --release -o dist`) and carry the
# repository with dist/. On the GPU machine, from the repository root:
#
#     bash benches/gpu_check.sh [MODEL_DIR]
#
# 1. installs the carried wheel (pip --no-deps, into a throwaway target dir),
# 2. prints the probe report and compiles + loads every kernel on device 0,
# 3. runs tests/gpu (each kernel vs torch; tiny model end to end, CUDA == CPU),
# 4. a throughput run of the benchmark model on the GPU, side by side with
#    transformers on the same GPU (MODEL_DIR, else the embedded demo model,
#    else a random Llama built with transformers).
# Each stage has its own time limit; the whole script stays under 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d)}
status=0
stage() { echo; echo "==== $* ===="; }

stage "install the carried wheel"
wheel=$(ls -t dist/fastllm-*.whl 2>/dev/null | head -1)
if [ -z "$wheel" ]; then
    echo "no dist/fastllm-*.whl: build one with 'maturin build --release -o dist' before carrying" >&2
    exit 2
fi
site="$OUT/site"
timeout 120 "$PY" -m pip install --no-deps --no-index --quiet --target "$site" "$wheel" || exit 2
# The installed package, not the source tree, is what runs.
export PYTHONPATH="$site"
export FASTLLM_CACHE_DIR="$OUT/kernel-cache"
"$PY" - <<'PYEOF' || exit 2
import fastllm, torch
from fastllm import _core
print("fastllm", fastllm.__version__, "from", fastllm.__file__)
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
print(fastllm.probe())
print("nvrtc", _core.nvrtc_version(), _core.nvrtc_library())
PYEOF

stage "compile and load every kernel on device 0"
timeout 180 "$PY" - <<'PYEOF' || status=1
import time
import torch
from fastllm import _core
torch.cuda.init()
t = time.perf_counter()
print(_core.cuda_load_kernels(0), f"{time.perf_counter() - t:.1f} s (cold cache)")
PYEOF

stage "tests/gpu"
# conftest.py (tiny model fixtures) lives in tests/; run against the installed wheel.
timeout 240 "$PY" -m pytest tests/gpu -q -p no:cacheprovider --rootdir . || status=1

stage "throughput: fastllm vs transformers on the GPU"
model=${1:-}
if [ -z "$model" ]; then
    model=$("$PY" -c 'import fastllm, os; d = os.path.join(os.path.dirname(fastllm.__file__), "demo_model"); print(d if os.path.isdir(d) else "")')
fi
if [ -z "$model" ]; then
    model="$OUT/bench-model"
    timeout 120 "$PY" benches/gpu_bench_model.py "$model" || status=1
fi
timeout 180 "$PY" - "$model" <<'PYEOF' || status=1
import argparse, sys
from fastllm import benchmark
p = argparse.ArgumentParser()
benchmark.add_arguments(p)
args = p.parse_args([
    "throughput", sys.argv[1], "--device", "cuda", "--dtype", "bfloat16", "--compare", "transformers",
    "--num-prompts", "64", "--input-len", "128", "--output-len", "128", "--batch", "64",
])
rc = benchmark.run(args)
from fastllm.layers import cuda_ops
print("CUDA kernels in use:", cuda_ops.enabled(), cuda_ops.disabled_reason() or "")
raise SystemExit(rc)
PYEOF

echo
echo "gpu_check: $([ $status -eq 0 ] && echo PASSED || echo FAILED)"
exit $status
