#!/usr/bin/env bash
# Builds the Rust extension in release mode and places it beside the Python
# sources (python/fastllm/_core.abi3.so), the same file an editable install
# makes. Reuses target/ between runs.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYO3_BUILD_EXTENSION_MODULE=1
cargo build --release --features python --lib "$@"
case "$(uname -s)" in
  Darwin) src=target/release/libfastllm.dylib ;;
  *) src=target/release/libfastllm.so ;;
esac
cp -f "$src" python/fastllm/_core.abi3.so
