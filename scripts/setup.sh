#!/usr/bin/env bash
# One command on a fresh machine: creates .venv, installs fastllm with its
# run-time dependencies (building the Rust core once, in place, through
# maturin's editable install), then runs the main job. The test dependencies
# come with the test command (scripts/test.sh).
#   ./scripts/setup.sh            set up, then run the main job
#   ./scripts/setup.sh --no-run   set up only
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip maturin
# --no-build-isolation: the build uses the maturin just installed (no second
# copy in a throwaway environment); the editable install writes the extension
# to python/fastllm/_core.abi3.so, the same file scripts/build_ext.sh rebuilds.
.venv/bin/python -m pip install -q --no-build-isolation -e .
if [ "${1:-}" != "--no-run" ]; then
  # The main job: what fastllm sees here, then text from the embedded demo model.
  .venv/bin/fastllm env
  exec .venv/bin/fastllm generate --prompt "def fibonacci(n):" --max-tokens 64 --temperature 0
fi
