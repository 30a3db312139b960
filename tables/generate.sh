#!/usr/bin/env bash
# Regenerate the shipped tables, resumably: the whole coverage matrix of rpa_tune/coverage.py
# (generations x shapes x cases x page sizes, every token bucket in one sweep each).
#   1. compile-backend sweeps (deviceless libtpu compiles, audited static estimates, method
#      "estimate") into tables/results/. Rerunning resumes: a config already recorded for a
#      key is not evaluated again, and a config's probe compiles are cached on disk
#      (~/.cache/rpa-tune/probes) and shared by all token buckets of its key;
#   2. compact the per-evaluation Parquet files into new append-only parts
#      tables/results/compact-*.parquet (rpa_tune.store.compact: an existing part is never
#      rewritten);
#   3. rpa-tune export --results tables/results --out tables (REPLACE=1 adds --replace: the
#      tables then hold only these results' keys).
# Knobs (env): GENS="v6e tpu7x" SHAPES="llama3-8b,qwen3-32b-tp4" CASES="decode prefill"
#   (subsets of the plan; default all), DECODE_BUDGET=30 BUDGET=12 (new configs per key; a
#   space no larger than its budget is swept whole; each bucket also evaluates, outside its
#   budget, the SEEDS=8 best configs of every other bucket of its key, priced from their
#   cached probes: `rpa-tune sweep --seeds`, 0 for all of them). Only the explore buckets
#   (rpa_tune/coverage.py: 128, 2048, 8192, less those whose batch a smaller one prices:
#   decode 128 only) search; the others ("fill" sweeps, --budget 1)
#   evaluate their heuristic and those seeds. REFINE=32: after its budget, each explore sweep
#   climbs from its best config (`rpa-tune sweep --refine`: neighbours one or two block sizes
#   doubled or halved, while one beats it, at most REFINE more). JOBS=2, TIMEOUT=900 (s per
#   config), EXPORT=0 (sweep only). SHARD=K/N: only part K of N of the plan (its keys
#   spread evenly, each with its explore and fill sweeps and Llama-3.2-1B's with Llama-3-8B's,
#   whose probe records it reads: rpa_tune/coverage.py shard), to split the matrix over N machines;
#   run it with EXPORT=0 on each, then copy every machine's tables/results/part-*.parquet into one
#   tables/results and run the last two steps there (docs/tables.md, "Regenerating").
# Wall time: docs/tables.md ("Regenerating"); the recorded runs' wall times are in notebook.md
# and, per sweep, in benchmarks/results/tables_generate_sweeps.log.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
DECODE_BUDGET=${DECODE_BUDGET:-30}
BUDGET=${BUDGET:-12}
REFINE=${REFINE:-32}
SEEDS=${SEEDS:-8}
JOBS=${JOBS:-2}
TIMEOUT=${TIMEOUT:-900}
RESULTS=tables/results
filters=()
for g in ${GENS:-}; do filters+=(--gen "$g"); done
for c in ${CASES:-}; do filters+=(--case "$c"); done
IFS=, read -r -a shapes <<< "${SHAPES:-}"
for s in "${shapes[@]}"; do filters+=(--shape "$s"); done
[ -n "${SHARD:-}" ] && filters+=(--shard "$SHARD")
plan=$($PY -m rpa_tune.coverage plan "${filters[@]}")
start=$(date +%s)
n=$(printf '%s\n' "$plan" | grep -c .)
i=0
while IFS=' ' read -r role line; do
  i=$((i + 1))
  eval "args=($line)"
  b=$BUDGET
  r=$REFINE
  [ "${args[3]}" = decode ] && b=$DECODE_BUDGET
  [ "$role" = fill ] && b=1 && r=0
  elapsed=$(( ($(date +%s) - start) / 60 ))
  echo "=== [$i/$n] $role: sweep $line --budget $b --refine $r --seeds $SEEDS ($elapsed min so far)"
  $PY -m rpa_tune.cli sweep "${args[@]}" --backend compile --budget "$b" --refine "$r" --seeds "$SEEDS" \
    --jobs "$JOBS" --timeout "$TIMEOUT" --results "$RESULTS" </dev/null \
    || echo "sweep [$i/$n] failed (exit $?); continuing"
done <<< "$plan"
echo "=== sweeps done in $(( ($(date +%s) - start) / 60 )) min"
[ "${EXPORT:-1}" = 0 ] && exit 0
$PY -c "import sys; from rpa_tune.export import compact_results; compact_results(sys.argv[1])" "$RESULTS"
$PY -m rpa_tune.cli export --results "$RESULTS" --out tables ${REPLACE:+--replace}
