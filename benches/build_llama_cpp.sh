#!/usr/bin/env bash
# Builds the llama.cpp reference that benches/vs_llama_cpp.py compares fastllm against,
# and the GGUF files of the benchmark model (BF16, then Q8_0, Q4_0 and IQ4_NL from it).
#
# llama.cpp comes from the PyPI sdist of llama-cpp-python (its C++ source is vendored
# under vendor/llama.cpp), so only a package registry is needed. The build is CPU only,
# Release, with GGML_NATIVE=ON (the ISA of this machine: AVX-512, VNNI, BF16 where the
# CPU has them), static, and only the tools the comparisons need: llama-bench,
# llama-quantize, llama-batched-bench, and llama-server (with llama-cli, which shares
# its code) for benches/multi_turn_vs_llama_cpp.py; the server's web UI is left out
# (an empty asset table: nothing is downloaded or built with npm).
#
# Usage: benches/build_llama_cpp.sh [STEP...]    steps: fetch build convert quantize (default all)
# Environment (defaults in brackets):
#   LLAMA_DIR     working folder, outside the repo         [/work/llamacpp]
#   LLAMA_BUILD   cmake build folder                       [$LLAMA_DIR/build]
#                 (keep one folder per configuration: on an AMX CPU the build below
#                 turns GGML_NATIVE off, so a folder configured natively recompiles all)
#   LLAMA_ISA     native: this CPU's ISA; avx2: AVX2, FMA and F16C only (no AVX-512 or
#                 VNNI), to compare with fastllm's forced AVX2 paths on an AVX-512
#                 machine (FASTLLM_CPU_INT_PATH / _GEMM_PATH / _SIMD_PATH=avx2)  [native]
#   LLAMA_CPP_PY  llama-cpp-python version to take it from [0.3.36]
#   MODEL         HF folder of the benchmark model         [/work/benchmodels/qwen2-0.5b-random]
#   GGUF_DIR      where the GGUF files go                  [/work/benchmodels/gguf]
#   JOBS          parallel compile jobs                    [2]
#   TORCH_PY      a Python with torch, transformers, numpy, safetensors, pyyaml that
#                 runs the converter (nothing is installed into it)  [repo's .venv/bin/python]
# The model folder is made by benches/make_bench_model.py when missing.
# Binaries: $LLAMA_BUILD/bin/{llama-bench,llama-quantize,llama-batched-bench,llama-server,
#   llama-cli}; GGUF files:
#   $GGUF_DIR/NAME-{bf16,q8_0,q4_0,iq4_nl}.gguf and $GGUF_DIR/pure/ (see quantize)
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
LLAMA_DIR=${LLAMA_DIR:-/work/llamacpp}
LLAMA_CPP_PY=${LLAMA_CPP_PY:-0.3.36}
MODEL=${MODEL:-/work/benchmodels/qwen2-0.5b-random}
GGUF_DIR=${GGUF_DIR:-/work/benchmodels/gguf}
JOBS=${JOBS:-2}
TORCH_PY=${TORCH_PY:-$REPO/.venv/bin/python}
[ -x "$TORCH_PY" ] || TORCH_PY=python3
VENV=$LLAMA_DIR/venv
SRC=$LLAMA_DIR/src/llama_cpp_python-$LLAMA_CPP_PY/vendor/llama.cpp
BUILD=${LLAMA_BUILD:-$LLAMA_DIR/build}
NAME=$(basename "$MODEL")
STEPS=("$@")
[ ${#STEPS[@]} -gt 0 ] || STEPS=(fetch build convert quantize)

fetch() {
  mkdir -p "$LLAMA_DIR/src"
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  # cmake and scikit-build-core as wheels: pip needs the latter to read the sdist's
  # metadata, and without --no-build-isolation it would compile cmake from source.
  "$VENV/bin/pip" install -q --only-binary :all: cmake scikit-build-core
  local tgz=$LLAMA_DIR/src/llama_cpp_python-$LLAMA_CPP_PY.tar.gz
  [ -f "$tgz" ] || "$VENV/bin/pip" download --no-binary :all: --no-deps --no-build-isolation \
    "llama-cpp-python==$LLAMA_CPP_PY" -d "$LLAMA_DIR/src"
  [ -d "$SRC" ] || tar -xzf "$tgz" -C "$LLAMA_DIR/src"
}

build() {
  # On a CPU with AMX, -march=native compiles llama.cpp's AMX buffer type, and
  # llama-bench then dies (SIGSEGV while repacking, seen on a 2-core Xeon with
  # AMX-INT8 in a VM): build for the same ISA without AMX instead.
  local isa=(-DGGML_NATIVE=ON)
  if [ "${LLAMA_ISA:-native}" = avx2 ]; then
    isa=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
      -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF
      -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF
      -DGGML_AMX_BF16=OFF)
  elif grep -qw amx_int8 /proc/cpuinfo 2>/dev/null; then
    isa=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
      -DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON
      -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF
      -DGGML_AMX_BF16=OFF)
  fi
  "$VENV/bin/cmake" -S "$SRC" -B "$BUILD" \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF \
    "${isa[@]}" -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
  nice -n 19 "$VENV/bin/cmake" --build "$BUILD" --config Release -j "$JOBS" \
    --target llama-bench llama-quantize llama-batched-bench llama-server llama-cli
  # the ISA the CPU backend was compiled for: GGML_NATIVE passes -march=native
  grep -ho 'march=[a-z0-9-]*\|-mamx[a-z0-9-]*' "$BUILD/ggml/src/CMakeFiles/ggml-cpu.dir/flags.make" | sort -u || true
  echo "-march=native enables:" $(${CC:-cc} -march=native -Q --help=target 2>/dev/null |
    awk '$2 == "[enabled]" && $1 ~ /^-m(avx|fma|f16c|bmi2|amx)/ {print $1}')
  "$BUILD/bin/llama-bench" --help >/dev/null
  "$BUILD/bin/llama-server" --version
}

convert() {
  if [ ! -d "$MODEL" ]; then
    # make_bench_model.py builds qwen2-0.5b-random by default, any other NAME-random
    # folder when --models names it
    local which=()
    case "$NAME" in
      qwen2-0.5b-random | llama-tiny-random) ;;
      *) which=(--models="${NAME%-random}") ;;
    esac
    "$TORCH_PY" "$REPO/benches/make_bench_model.py" "$(dirname "$MODEL")" ${which[@]+"${which[@]}"}
  fi
  # The converter runs on TORCH_PY (torch, transformers, numpy, safetensors, yaml), used
  # read-only; gguf comes from the vendored gguf-py and sentencepiece (imported
  # unconditionally by the Qwen2 vocab path) from a --target folder of our own.
  [ -d "$LLAMA_DIR/pylib/sentencepiece" ] ||
    "$VENV/bin/pip" install -q --only-binary :all: --target "$LLAMA_DIR/pylib" sentencepiece
  mkdir -p "$GGUF_DIR"
  # The benchmark model's tokenizer is trained by make_bench_model.py, so the converter
  # does not know its pre-tokenizer hash; it is a plain ByteLevel one (GPT-2 regex), so
  # an unknown hash is mapped to "gpt-2". This only affects text tokenization in
  # llama.cpp, never the speed figures (llama-bench feeds token ids).
  # Qwen3.5's converter expects multi-token-prediction layers unless told there are
  # none (--no-mtp); the benchmark models have none.
  local extra=()
  if grep -q '"Qwen3_5' "$MODEL/config.json" && ! grep -q '"mtp_num_hidden_layers": *[1-9]' "$MODEL/config.json"; then
    extra=(--no-mtp)
  fi
  PYTHONPATH="$SRC:$SRC/gguf-py:$LLAMA_DIR/pylib" nice -n 19 "$TORCH_PY" - "$MODEL" \
    --outtype bf16 --outfile "$GGUF_DIR/$NAME-bf16.gguf" ${extra[@]+"${extra[@]}"} <<PY
import runpy, sys
from conversion import base
orig = base.TextModel.get_vocab_base_pre
def pre(self, tokenizer):
    try:
        return orig(self, tokenizer)
    except NotImplementedError:
        print("pre-tokenizer hash unknown: using gpt-2 (ByteLevel)", file=sys.stderr)
        return "gpt-2"
base.TextModel.get_vocab_base_pre = pre
sys.argv[0] = "$SRC/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
PY
}

quantize() {
  # GGUF_DIR/NAME-FMT.gguf: llama-quantize's default mix (for these shapes: Q8_0 all
  # q8_0; Q4_0 q4_0 but token_embd, the tied output matrix, q8_0; IQ4_NL iq4_nl but
  # token_embd q8_0, attn_v q5_1, 3 ffn_down q5_K). GGUF_DIR/pure/NAME-FMT.gguf: --pure,
  # every matrix in FMT.
  mkdir -p "$GGUF_DIR/pure"
  for q in Q8_0 Q4_0 IQ4_NL; do
    local lower
    lower=$(echo "$q" | tr '[:upper:]' '[:lower:]')
    nice -n 19 "$BUILD/bin/llama-quantize" "$GGUF_DIR/$NAME-bf16.gguf" \
      "$GGUF_DIR/$NAME-$lower.gguf" "$q" "$JOBS"
    nice -n 19 "$BUILD/bin/llama-quantize" --pure "$GGUF_DIR/$NAME-bf16.gguf" \
      "$GGUF_DIR/pure/$NAME-$lower.gguf" "$q" "$JOBS"
  done
  ln -sf "../$NAME-bf16.gguf" "$GGUF_DIR/pure/$NAME-bf16.gguf"
  ls -l "$GGUF_DIR" "$GGUF_DIR/pure"
}

for s in "${STEPS[@]}"; do
  "$s"
done
