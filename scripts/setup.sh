#!/usr/bin/env bash
# One command on a fresh machine: creates .venv, installs fastllm (building the
# Rust core) with its test dependencies, then runs the main job.
#   ./scripts/setup.sh            set up, then run the main job
#   ./scripts/setup.sh --no-run   set up only
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q maturin
.venv/bin/python -m pip install -q -e ".[test]"
./scripts/build_ext.sh >/dev/null 2>&1 || ./scripts/build_ext.sh
if [ "${1:-}" != "--no-run" ]; then
  # The main job: what fastllm sees here, then text from the embedded demo model.
  .venv/bin/fastllm env
  exec .venv/bin/fastllm generate --prompt "def fibonacci(n):" --max-tokens 64 --temperature 0
fi
