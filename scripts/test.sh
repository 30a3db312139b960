#!/usr/bin/env bash
# Set up (idempotent) and run the default test suite (slow tests excluded; see README).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Two workers: most of the time is single-threaded interpret-mode kernels and deviceless
# compiles (see tests/conftest.py for the modules kept on one worker).
exec .venv/bin/python -m pytest -q -m "not slow" -n 2 --dist loadgroup "$@"
