#!/usr/bin/env bash
# Runs every test: the Rust unit tests, then the Python suite against the
# extension rebuilt from this tree. Sets the project up first if needed, and
# installs the test dependencies (the `test` extra of pyproject.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  ./scripts/setup.sh --no-run
fi
echo "== test dependencies"
# Installs what is missing (nothing after the first run) and rebuilds the
# extension through maturin: incremental, and a no-op when no Rust changed.
.venv/bin/python -m pip install -q --no-build-isolation -e ".[test]"
echo "== cargo test"
# The library is an rlib here and a cdylib only in maturin's build, so this
# build and the extension's never overwrite each other's output.
cargo test --release
echo "== pytest"
# Test this tree's sources with the extension just built, whatever else the
# virtual environment has installed.
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
set +e
.venv/bin/python -m pytest -q "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure" >&2
  exit 1
fi
exit "$rc"
