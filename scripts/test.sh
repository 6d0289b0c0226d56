#!/usr/bin/env bash
# Runs every test: the Rust unit tests, then the Python suite against a fresh
# release build of the extension. Sets the project up first if needed.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  ./scripts/setup.sh --no-run
fi
echo "== cargo test"
cargo test --release
echo "== build extension"
./scripts/build_ext.sh
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
