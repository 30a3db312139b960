#!/usr/bin/env bash
# Set up (idempotent) and run the default test suite (slow tests excluded; see README).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -m "not slow" "$@"
