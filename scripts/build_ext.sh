#!/usr/bin/env bash
# Rebuilds the Rust extension in place (python/fastllm/_core.abi3.so) with the
# same maturin build as the editable install, so the two share one cargo
# build: nothing is recompiled when the Rust sources did not change. Needs
# the virtual environment of scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
VIRTUAL_ENV="$PWD/.venv" .venv/bin/maturin develop --release --skip-install "$@"
