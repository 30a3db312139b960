"""Sweep throughput of the compile backend: configs per minute on this machine, per --jobs.

Method: for each ``--jobs`` value, a fresh results directory and the same fixed sweep (grid
over the first ``--budget`` candidates of the shipped space for ``--tpu``/``--case``,
``--model`` preset, default serving limits and the case's default generated workload) run
through the real engine (worker processes, deviceless libtpu compiles with the static
profiler). Throughput = evaluated configs / wall time of the sweep (worker start-up
included). Also printed: the mean evaluation time per config and the statuses.

Usage::

    python benchmarks/sweep_throughput.py --tpu v6e --case decode --budget 6 --jobs 1 2
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernel.workload import ServingLimits  # noqa: E402
from rpa_tune.engine import SweepSpec, problem_key, run_sweep  # noqa: E402
from rpa_tune.presets import get_preset  # noqa: E402
from rpa_tune.space import load_space  # noqa: E402
from rpa_tune.store import ResultStore  # noqa: E402
from rpa_tune.workloads import describe, make_workload  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tpu", default="v6e")
    ap.add_argument("--case", default="decode")
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--budget", type=int, default=6)
    ap.add_argument("--jobs", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--timeout", type=float, default=1800)
    args = ap.parse_args()

    model = get_preset(args.model).model()
    limits = ServingLimits(page_size=128, max_num_tokens=2048, max_num_seqs=128, max_model_len=8192)
    w, origin = make_workload(args.case, limits)
    key = problem_key(args.tpu, args.case, model, limits)
    print(f"sweep: {key.id()}, workload {describe(w)} [{origin}], grid, budget {args.budget}, "
          f"compile backend; machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}", flush=True)
    rows = []
    for jobs in args.jobs:
        with tempfile.TemporaryDirectory(prefix="rpa_tune_bench_") as d:
            spec = SweepSpec(key=key, model=model, limits=limits, workload=w, workload_desc=origin,
                             case_space=load_space(args.tpu).for_case(args.case), backend="compile",
                             search="grid", budget=args.budget, jobs=jobs, timeout=args.timeout)
            t0 = time.monotonic()
            o = run_sweep(spec, ResultStore(d))
            wall = time.monotonic() - t0
            df = ResultStore(d).read()
            per = df["eval_s"].mean()
            counts = {k: v for k, v in o.counts.items() if v}
            rows.append((jobs, o.evaluated, wall, 60 * o.evaluated / wall, per, counts))
            print(f"--jobs {jobs}: {o.evaluated} configs in {wall:.0f} s = {60 * o.evaluated / wall:.2f} configs/min; "
                  f"mean evaluation {per:.1f} s; {counts}; load average now {os.getloadavg()[0]:.1f}", flush=True)
    print("\n| --jobs | configs | wall (s) | configs / min | mean s per config | statuses |")
    print("|---|---|---|---|---|---|")
    for jobs, n, wall, cpm, per, counts in rows:
        print(f"| {jobs} | {n} | {wall:.0f} | {cpm:.2f} | {per:.1f} | {counts} |")


if __name__ == "__main__":
    main()
