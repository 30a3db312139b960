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
# PostgreSQL server binaries for the tests of many workers on one sweep (tests/pg_server.py
# starts a throwaway server). Optional: without them those tests skip, saying why.
have_initdb() { command -v initdb >/dev/null 2>&1 || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; }
if ! have_initdb; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "setup: installing PostgreSQL (apt-get install postgresql) for the distributed-sweep tests" >&2
    (export DEBIAN_FRONTEND=noninteractive; apt-get update -qq && apt-get install -y -qq --no-install-recommends postgresql >/dev/null) \
      || echo "setup: could not install postgresql; the PostgreSQL tests will be skipped" >&2
  else
    echo "setup: no PostgreSQL (initdb) found and apt-get as root unavailable; the PostgreSQL tests will be skipped" >&2
  fi
fi
PY=$(find_python) || { echo "setup: Python 3.12 not found (set PYTHON=/path/to/python3.12)" >&2; exit 1; }
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# PyPI downloads here are sometimes cut mid-file (libtpu is 200+ MB): pip resumes
# partial downloads, and a failed install is retried whole a few times before giving up.
pip_install() {
  local attempt
  for attempt in 1 2 3 4; do
    if .venv/bin/python -m pip install -q --timeout 60 $RESUME "$@"; then return 0; fi
    echo "setup: pip install $* failed (attempt $attempt of 4); retrying in $((attempt * 10)) s" >&2
    sleep $((attempt * 10))
  done
  echo "setup: pip install $* failed 4 times; check the network and run scripts/setup.sh again" >&2
  return 1
}
RESUME=""
pip_install --upgrade pip >/dev/null
# --resume-retries exists from pip 25.1 on (the line above installs a newer pip).
if .venv/bin/python -m pip install --help 2>/dev/null | grep -q -- --resume-retries; then
  RESUME="--resume-retries 30"
fi
pip_install -e ".[test]"
# The public RPA v3 kernel (compared side by side by rpa_tune.estimator.public). No deps:
# tpu-inference's dependencies pull in vllm; its kernel module needs only jax.
pip_install --no-deps tpu-inference==0.32.0
# SGLang-JAX's copy of the v3 kernel (`--kernel sglang-jax`; rpa_tune.public_kernel.SGLANG_JAX).
# No deps either: they pull its server; its kernel module needs only jax.
pip_install --no-deps sglang-jax==0.1.0rc0
echo "setup: .venv ready ($(.venv/bin/python --version))" >&2
