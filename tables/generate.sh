#!/usr/bin/env bash
# Regenerate the shipped tables from scratch-or-resume:
#   1. compile-backend sweeps (deviceless libtpu compiles ranked by the static cost estimate,
#      recorded as method "estimate") into tables/results/ (resumable: a config already
#      recorded is not evaluated again);
#   2. compact the per-evaluation Parquet files into tables/results/results.parquet;
#   3. rpa-tune export --results tables/results --out tables.
# Budgets are small because the machine that produced the shipped tables had 2 cores;
# raise BUDGET (and add BUCKETS) for better tables. Every knob is an env variable:
#   GENS="v6e tpu7x v5e" PRESETS="llama3-8b ..." CASES="decode prefill mixed"
#   BUCKETS="2048" BUDGET=5 JOBS=1 TIMEOUT=1800 bash tables/generate.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
GENS=${GENS:-"v6e tpu7x v5e"}
PRESETS=${PRESETS:-"llama3-8b llama3-70b-tp8 qwen3-32b-tp4"}
CASES=${CASES:-"decode prefill mixed"}
BUCKETS=${BUCKETS:-"2048"}
BUDGET=${BUDGET:-5}
JOBS=${JOBS:-1}
TIMEOUT=${TIMEOUT:-1800}
RESULTS=tables/results
for t in $BUCKETS; do
  for m in $PRESETS; do
    for g in $GENS; do
      for c in $CASES; do
        echo "=== sweep $g $c $m max_num_tokens=$t budget=$BUDGET"
        $PY -m rpa_tune.cli sweep --tpu "$g" --case "$c" --model "$m" --max-num-tokens "$t" \
          --backend compile --budget "$BUDGET" --jobs "$JOBS" --timeout "$TIMEOUT" --results "$RESULTS" \
          || echo "sweep $g $c $m t$t failed (exit $?); continuing"
      done
    done
  done
done
$PY -c "import sys; from rpa_tune.export import compact_results; compact_results(sys.argv[1])" "$RESULTS"
$PY -m rpa_tune.cli export --results "$RESULTS" --out tables
