"""How many evaluations does TPE need to get within 2% of the exhaustive best?

Method:

1. Exhaustive grid over one fixed space with the compile backend (resumable: the results
   go to ``--results``, rerun to continue). Default space: v6e decode for the
   ``llama3-70b-tp8`` shard (8 q / 1 KV heads per shard), whose caps allow 27 candidates.
2. The exhaustive best metric ``m*`` is read from those results.
3. ``rpa_tune.search`` strategies are replayed offline against the recorded metrics
   (an evaluation = looking up the recorded outcome of the asked config, exactly what
   the engine's resume path does), for ``--seeds`` seeds each, sequentially (one job):
   the number of evaluations until a config with metric <= 1.02 m* has been evaluated.
   TPE runs with its production settings (heuristic first, ``n_startup_trials`` from the
   budget, no early stop here); random = seeded permutation; grid = enumeration order.

Usage::

    python benchmarks/tpe_vs_grid.py --results /tmp/tpe_grid --jobs 2 [--seeds 20]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernel.config import BlockSizes  # noqa: E402
from kernel.workload import ServingLimits  # noqa: E402
from rpa_tune.engine import SweepSpec, problem_key, plan_sweep, run_sweep  # noqa: E402
from rpa_tune.presets import get_preset  # noqa: E402
from rpa_tune.search import make_search  # noqa: E402
from rpa_tune.space import load_space  # noqa: E402
from rpa_tune.store import ResultStore  # noqa: E402
from rpa_tune.workloads import make_workload, workload_id  # noqa: E402


def evals_to_target(kind, candidates, outcomes, target, *, seed, first, budget):
    s = make_search(kind, candidates, budget=budget, seed=seed, first=first, patience=0)
    for n in range(1, len(candidates) + 1):
        bs = s.ask()
        if bs is None:
            return None
        status, metric = outcomes[bs]
        s.tell(bs, status, metric)
        if status == "ok" and metric is not None and metric <= target:
            return n
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tpu", default="v6e")
    ap.add_argument("--case", default="decode")
    ap.add_argument("--model", default="llama3-70b-tp8")
    ap.add_argument("--results", default="benchmarks/results/tpe_vs_grid")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--tolerance", type=float, default=0.02)
    ap.add_argument("--tpe-budget", type=int, default=20, help="budget TPE is configured with (sets n_startup_trials)")
    args = ap.parse_args()

    model = get_preset(args.model).model()
    limits = ServingLimits(page_size=128, max_num_tokens=2048, max_num_seqs=128, max_model_len=8192)
    w, origin = make_workload(args.case, limits)
    key = problem_key(args.tpu, args.case, model, limits)
    spec = SweepSpec(key=key, model=model, limits=limits, workload=w, workload_desc=origin,
                     case_space=load_space(args.tpu).for_case(args.case), backend="compile", search="grid",
                     budget=10_000, jobs=args.jobs, timeout=args.timeout)
    plan = plan_sweep(spec)
    print(f"space: {key.id()}, {len(plan.candidates)} candidates; workload {origin}", flush=True)
    t0 = time.monotonic()
    o = run_sweep(spec, ResultStore(args.results))
    print(f"grid: {o.evaluated} evaluated now, {o.resumed} recorded before, {time.monotonic() - t0:.0f} s; "
          f"{ {k: v for k, v in o.counts.items() if v} }", flush=True)
    df = ResultStore(args.results).read()
    from rpa_tune import provenance
    df = df[(df.key_id == key.id()) & (df.workload_id == workload_id(w)) & (df.backend == "compile")
            & (df.kernel_hash == provenance.kernel_hash())]
    df = df.sort_values("timestamp").drop_duplicates("config_id", keep="last")
    outcomes = {BlockSizes(int(r.bq), int(r.bkv), int(r.cq), int(r.ckv)):
                (r.status, None if r.status != "ok" else float(r.metric)) for r in df.itertuples()}
    cands = [c for c in plan.candidates if c in outcomes]
    ok = {c: m for c, (s, m) in outcomes.items() if s == "ok" and c in cands}
    if not ok:
        print("no ok results: nothing to compare")
        return
    best_bs = min(ok, key=ok.get)
    best = ok[best_bs]
    target = best * (1 + args.tolerance)
    near = sum(1 for m in ok.values() if m <= target)
    print(f"exhaustive best {tuple(best_bs)} = {best * 1e6:.2f} us; {near} of {len(cands)} configs within "
          f"{args.tolerance:.0%}; heuristic {tuple(plan.heuristic) if plan.heuristic else '-'}")
    res = {}
    for kind in ("grid", "random", "tpe"):
        seeds = [0] if kind == "grid" else list(range(args.seeds))
        ns = [evals_to_target("tpe" if kind == "tpe" else kind, cands, outcomes, target, seed=s,
                              first=plan.heuristic, budget=args.tpe_budget if kind == "tpe" else len(cands))
              for s in seeds]
        res[kind] = ns
        ns_ok = [n for n in ns if n is not None]
        print(f"{kind:6s}: evaluations to within {args.tolerance:.0%}: median {statistics.median(ns_ok):.1f}, "
              f"mean {statistics.mean(ns_ok):.1f}, max {max(ns_ok)} over {len(ns)} seed(s)")
    print(f"\n| strategy | median | mean | worst | of {len(cands)} candidates |")
    print("|---|---|---|---|---|")
    for kind, ns in res.items():
        ns = [n for n in ns if n is not None]
        print(f"| {kind} | {statistics.median(ns):.1f} | {statistics.mean(ns):.1f} | {max(ns)} | {len(cands)} |")


if __name__ == "__main__":
    main()
