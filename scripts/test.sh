#!/usr/bin/env bash
# Set up (idempotent) and run the default test suite (slow tests excluded; see README).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Two workers: most of the time is single-threaded interpret-mode kernels and deviceless
# compiles. A module-scoped fixture is built once per worker that runs its module's tests.
exec .venv/bin/python -m pytest -q -m "not slow" -n 2 "$@"
