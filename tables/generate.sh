#!/usr/bin/env bash
# Regenerate the shipped tables, resumably: the whole coverage matrix of rpa_tune/coverage.py
# (generations x shapes x cases x page sizes, every token bucket in one sweep each).
#   1. compile-backend sweeps (deviceless libtpu compiles, audited static estimates, method
#      "estimate"; "modelled" where no estimate is possible: v4, TPU7x prefill / mixed, priced
#      by the device-cost model, the plain compile judging VMEM) into tables/results/.
#      Rerunning resumes: a config already recorded for a key is not evaluated again, and a
#      config's probe compiles are cached on disk (~/.cache/rpa-tune/probes) and shared by
#      all token buckets of its key;
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
# Options: --backend compile|tpu (default compile), --storage URL, --dry-run.
#   --backend tpu times the plan on this machine's TPU (`rpa-tune sweep --backend tpu`): every
#   key of the matrix for its generation (v4's and TPU7x prefill / mixed timed, not
#   modelled), every bucket searched (no fill sweeps: --seeds is
#   for cached probes); without a TPU it says so in one line (exit 2). GENS narrows the plan
#   as above but must name this TPU's generation.
#   --storage URL (any backend) shares every sweep with the workers started with the same
#   URL (`rpa-tune sweep --storage`: Optuna's storage, a config evaluated once across them);
#   export then reads tables/results and the storage. A fleet: one generate.sh per chip
#   (CHIP=K pins the process to chip K of its VM: TPU_VISIBLE_CHIPS and the process bounds,
#   unless already set), all with the same URL (docs/tpu-vm.md).
#   --dry-run prints the sweeps it would run (with their exact options) and exits: on any
#   machine, --backend tpu lists every generation's plan (GENS to narrow it).
#   Resumable either way: rerun the same command after an interruption or preemption.
# Wall time: docs/tables.md ("Regenerating"); the recorded runs' wall times are in notebook.md
# and, per sweep, in benchmarks/results/tables_generate_sweeps.log.
set -euo pipefail
cd "$(dirname "$0")/.."
BACKEND=compile
STORAGE=
STORAGE_GIVEN=
DRY_RUN=0
usage="usage: tables/generate.sh [--backend compile|tpu] [--storage URL] [--dry-run]"
while [ $# -gt 0 ]; do
  case "$1" in
    --backend) BACKEND=${2:-}; shift 2 || { echo "generate.sh: error: --backend needs a value; $usage" >&2; exit 2; } ;;
    --backend=*) BACKEND=${1#*=}; shift ;;
    --storage) STORAGE=${2:-}; STORAGE_GIVEN=1; shift 2 || { echo "generate.sh: error: --storage needs a URL; $usage" >&2; exit 2; } ;;
    --storage=*) STORAGE=${1#*=}; STORAGE_GIVEN=1; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) echo "$usage (knobs: the header of tables/generate.sh)"; exit 0 ;;
    *) echo "generate.sh: error: unknown argument '$1'; $usage" >&2; exit 2 ;;
  esac
done
case "$BACKEND" in
  compile|tpu) ;;
  *) echo "generate.sh: error: --backend '$BACKEND': valid are compile, tpu" >&2; exit 2 ;;
esac
PY=${PYTHON:-python}
if [ -n "$STORAGE_GIVEN" ]; then
  # the URL is checked before any sweep (rpa-tune sweep's own check); a relative path is
  # relative to the checkout's root, where this script runs
  $PY -c 'import sys
from rpa_tune.distributed import StorageError, parse_storage
try:
    parse_storage(sys.argv[1])
except StorageError as e:
    print(f"generate.sh: error: {e}", file=sys.stderr)
    sys.exit(2)' "$STORAGE"
fi
DECODE_BUDGET=${DECODE_BUDGET:-30}
BUDGET=${BUDGET:-12}
REFINE=${REFINE:-32}
SEEDS=${SEEDS:-8}
JOBS=${JOBS:-2}
TIMEOUT=${TIMEOUT:-900}
RESULTS=tables/results
if [ -n "${CHIP:-}" ]; then
  # one process per chip of a multi-chip TPU VM: the variables the TPU runtime reads to give
  # a process one chip (each left alone when already set)
  export TPU_VISIBLE_CHIPS=${TPU_VISIBLE_CHIPS:-$CHIP}
  export TPU_CHIPS_PER_PROCESS_BOUNDS=${TPU_CHIPS_PER_PROCESS_BOUNDS:-1,1,1}
  export TPU_PROCESS_BOUNDS=${TPU_PROCESS_BOUNDS:-1,1,1}
  export TPU_PROCESS_PORT=${TPU_PROCESS_PORT:-$((8476 + CHIP))}
fi
filters=(--backend "$BACKEND")
[ "$BACKEND" = tpu ] && [ "$DRY_RUN" = 0 ] && filters+=(--here)
for g in ${GENS:-}; do filters+=(--gen "$g"); done
for c in ${CASES:-}; do filters+=(--case "$c"); done
IFS=, read -r -a shapes <<< "${SHAPES:-}"
for s in "${shapes[@]}"; do filters+=(--shape "$s"); done
[ -n "${SHARD:-}" ] && filters+=(--shard "$SHARD")
plan=$($PY -m rpa_tune.coverage plan "${filters[@]}")
start=$(date +%s)
n=$(printf '%s\n' "$plan" | grep -c .)
[ "$DRY_RUN" = 1 ] && echo "=== dry run: $n sweeps, backend $BACKEND${STORAGE_GIVEN:+, shared through --storage}"
i=0
while IFS=' ' read -r role line; do
  i=$((i + 1))
  eval "args=($line)"
  b=$BUDGET
  r=$REFINE
  [ "${args[3]}" = decode ] && b=$DECODE_BUDGET
  [ "$role" = fill ] && b=1 && r=0
  cmd=(sweep "${args[@]}" --backend "$BACKEND" --budget "$b" --refine "$r")
  # seeds are the compile backend's (cached probes); the tpu backend runs one worker per chip
  [ "$BACKEND" = compile ] && cmd+=(--seeds "$SEEDS" --jobs "$JOBS")
  cmd+=(--timeout "$TIMEOUT" --results "$RESULTS")
  [ -n "$STORAGE_GIVEN" ] && cmd+=(--storage "$STORAGE")
  if [ "$DRY_RUN" = 1 ]; then
    echo "[$i/$n] $role: rpa-tune ${cmd[*]}"
    continue
  fi
  elapsed=$(( ($(date +%s) - start) / 60 ))
  echo "=== [$i/$n] $role: rpa-tune ${cmd[*]} ($elapsed min so far)"
  $PY -m rpa_tune.cli "${cmd[@]}" </dev/null || echo "sweep [$i/$n] failed (exit $?); continuing"
done <<< "$plan"
[ "$DRY_RUN" = 1 ] && exit 0
echo "=== sweeps done in $(( ($(date +%s) - start) / 60 )) min"
[ "${EXPORT:-1}" = 0 ] && exit 0
$PY -c "import sys; from rpa_tune.export import compact_results; compact_results(sys.argv[1])" "$RESULTS"
sources=(--results "$RESULTS")
[ -n "$STORAGE_GIVEN" ] && sources+=(--results "$STORAGE")
$PY -m rpa_tune.cli export "${sources[@]}" --out tables ${REPLACE:+--replace}
