#!/usr/bin/env bash
# Create .venv with Python 3.12 and install the project (editable) with its test extras.
set -euo pipefail
cd "$(dirname "$0")/.."
find_python() {
  for c in "${PYTHON:-}" python3.12 "$(command -v pyenv >/dev/null 2>&1 && pyenv root)/versions/3.12"*/bin/python3.12; do
    [ -n "$c" ] || continue
    if "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then echo "$c"; return 0; fi
  done
  return 1
}
PY=$(find_python) || { echo "setup: Python 3.12 not found (set PYTHON=/path/to/python3.12)" >&2; exit 1; }
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e ".[test]"
# The public RPA v3 kernel (compared side by side by rpa_tune.estimator.public). No deps:
# tpu-inference's dependencies pull in vllm; its kernel module needs only jax.
.venv/bin/python -m pip install -q --no-deps tpu-inference==0.32.0
echo "setup: .venv ready ($(.venv/bin/python --version))" >&2
