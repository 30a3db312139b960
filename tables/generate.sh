#!/usr/bin/env bash
# Regenerate the shipped tables from scratch-or-resume:
#   1. compile-backend sweeps (deviceless libtpu compiles ranked by the static cost estimate,
#      recorded as method "estimate") into tables/results/ (resumable: a config already
#      recorded is not evaluated again);
#   2. compact the per-evaluation Parquet files into tables/results/results.parquet;
#   3. rpa-tune export --results tables/results --out tables.
# Budgets are small because the machine that produced the shipped tables had 2 cores:
# llama3-8b (8 KV heads per shard) costs about a minute of profiler time per prefill /
# mixed config, the 1- and 2-KV-head shards a few seconds. The cheap presets go first, so
# a cut-short run still covers them. Every knob is an env variable:
#   GENS="v6e tpu7x v5e" PRESETS="llama3-70b-tp8 ..." CASES="decode prefill mixed" BUCKETS="2048"
#   BUDGETS="llama3-8b=4 llama3-70b-tp8=12 qwen3-32b-tp4=12" BUDGET=5 JOBS=2 TIMEOUT=900
#   SKIP="v5e/mixed" bash tables/generate.sh
# (v5e and TPU7x prefill / mixed used to be skipped: libtpu's static profiler aborted on
# them until the kernel's analysis mode stopped scalar-prefetching its metadata (v5e) and
# stopped skipping chunks inside the step (TPU7x); see kernel/rpa.py.)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
GENS=${GENS:-"v6e tpu7x v5e"}
PRESETS=${PRESETS:-"llama3-70b-tp8 qwen3-32b-tp4 llama3-8b"}
CASES=${CASES:-"decode prefill mixed"}
BUCKETS=${BUCKETS:-"2048"}
BUDGETS=${BUDGETS:-"llama3-8b=4 llama3-70b-tp8=12 qwen3-32b-tp4=12"}
BUDGET=${BUDGET:-5}
JOBS=${JOBS:-2}
TIMEOUT=${TIMEOUT:-900}
SKIP=${SKIP:-""}
RESULTS=tables/results
budget_of() {
  for kv in $BUDGETS; do [ "${kv%%=*}" = "$1" ] && { echo "${kv#*=}"; return; }; done
  echo "$BUDGET"
}
for t in $BUCKETS; do
  for m in $PRESETS; do
    b=$(budget_of "$m")
    for g in $GENS; do
      for c in $CASES; do
        case " $SKIP " in *" $g/$c "*) echo "=== skip $g $c (SKIP)"; continue ;; esac
        echo "=== sweep $g $c $m max_num_tokens=$t budget=$b"
        $PY -m rpa_tune.cli sweep --tpu "$g" --case "$c" --model "$m" --max-num-tokens "$t" \
          --backend compile --budget "$b" --jobs "$JOBS" --timeout "$TIMEOUT" --results "$RESULTS" \
          || echo "sweep $g $c $m t$t failed (exit $?); continuing"
      done
    done
  done
done
$PY -c "import sys; from rpa_tune.export import compact_results; compact_results(sys.argv[1])" "$RESULTS"
$PY -m rpa_tune.cli export --results "$RESULTS" --out tables
