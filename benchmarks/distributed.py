"""Many workers on one sweep (``rpa-tune sweep --storage``): throughput with 1 and 2
workers, and what the storage costs per evaluation, on SQLite, a journal file and
PostgreSQL (a throwaway local server, tests/pg_server.py), next to the plain local sweep.

Method: real ``rpa-tune sweep`` processes (``--backend compile``, grid over the first
``--budget`` planned configs of the llama3-8b ``--case`` space, ``--jobs 1`` each) whose
evaluators are the fake of tests/tune_fakes.py sleeping ``--delays`` s per config (no
compile: the numbers isolate the coordination, not libtpu). Workers start together; wall =
first start to last exit (process start-up included). Storage time = the wall time each
worker spends in storage calls on its main thread after joining (claiming configs, asking
about the configs another worker holds, recording rows and tells, stale checks; the
heartbeat thread is not counted), reported by ``sweep --json`` (``storage_s``; joining the
study and reading its rows is ``storage_join_s``), summed over workers and divided by the
evaluations. Each run also checks that no config was evaluated twice.

``--real``: the same with the real deviceless evaluator (``--backend compile``: libtpu's
static profiler on the CPU, each run with an empty probe cache), written to
``results/distributed_real.*``; there the two workers share this machine's cores, so it
shows what a second worker buys when the evaluator itself is CPU-bound.

Usage::

    python benchmarks/distributed.py --budget 40 --delays 1 0
    python benchmarks/distributed.py --real --case decode --budget 4 --storages local journal
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(TESTS))

RPA_TUNE = str(Path(sys.executable).with_name("rpa-tune"))


def run_workers(n: int, storage: str | None, d: Path, args, delay: float) -> dict:
    if args.real:       # the real evaluator, every run from an empty probe cache
        from rpa_tune.estimator.compose import CACHE_ENV
        env = {**os.environ, CACHE_ENV: str(d / "probes")}
    else:
        env = dict(os.environ, RPA_TUNE_EVALUATOR_OVERRIDE="tune_fakes:make_evaluator",
                   RPA_TUNE_KERNEL_HASH="bench-distributed", RPA_TUNE_FAKE_DELAY=str(delay),
                   PYTHONPATH=os.pathsep.join([str(TESTS), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    base = [RPA_TUNE, "sweep", "--tpu", "v6e", "--case", args.case, "--backend", "compile", "--search", "grid",
            "--budget", str(args.budget), "--jobs", str(args.jobs), "--json"]
    if storage:
        base += ["--storage", storage]
    procs = []
    t0 = time.monotonic()
    for i in range(n):
        e = dict(env, RPA_TUNE_FAKE_LOG=str(d / f"eval-{i}.log"))
        procs.append(subprocess.Popen(base + ["--results", str(d / f"res-{i}")], env=e, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=1800) for p in procs]
    wall = time.monotonic() - t0
    docs = []
    for p, (out, err) in zip(procs, outs):
        if p.returncode != 0:
            raise SystemExit(f"worker failed ({p.returncode}): {err[-2000:]}")
        docs.append(json.loads(out)[0])
    evaluated = []
    for i in range(n):
        if args.real:        # the configs each worker's results store holds (it evaluated them)
            from rpa_tune.store import ResultStore
            res = d / f"res-{i}"
            evaluated += list(ResultStore(res).read().config_id) if res.exists() else []
            continue
        f = d / f"eval-{i}.log"
        evaluated += f.read_text().split() if f.exists() else []
    storage_s = sum(doc.get("storage_s") or 0.0 for doc in docs)
    join_s = sum(doc.get("storage_join_s") or 0.0 for doc in docs)
    calls = sum(doc.get("storage_calls") or 0 for doc in docs)
    return dict(delay_s=delay, workers=n, evaluations=len(evaluated), duplicates=len(evaluated) - len(set(evaluated)),
                wall_s=round(wall, 2), evals_per_s=round(len(evaluated) / wall, 3),
                per_worker=[doc["evaluated"] for doc in docs],
                storage_s=round(storage_s, 3) if storage else None, storage_calls=calls if storage else None,
                join_s=round(join_s, 3) if storage else None,
                storage_ms_per_eval=round(1000 * storage_s / max(1, len(evaluated)), 2) if storage else None)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", default="prefill")
    ap.add_argument("--budget", type=int, default=40)
    ap.add_argument("--delays", type=float, nargs="+", default=[1.0, 0.0],
                    help="seconds the fake evaluator sleeps per config (one table block each)")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--storages", nargs="+", default=["local", "sqlite", "journal", "postgres"])
    ap.add_argument("--real", action="store_true",
                    help="the real deviceless evaluator (compile) instead of the fake; --delays is ignored")
    ap.add_argument("--out", default=None, help="default: results/distributed (--real: distributed_real)")
    args = ap.parse_args()
    if args.out is None:
        args.out = str(ROOT / "benchmarks" / "results" / ("distributed_real" if args.real else "distributed"))
    if args.real:
        args.delays = [0.0]
    from pg_server import create_database, find_pg_bin, postgres_server
    import contextlib
    machine = (f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}, "
               f"load average {os.getloadavg()[0]:.1f} at start")
    rows = []
    with contextlib.ExitStack() as stack:
        pg = None
        if "postgres" in args.storages:
            if find_pg_bin() is None:
                raise SystemExit("postgres: no PostgreSQL binaries (scripts/setup.sh installs them)")
            pg = stack.enter_context(postgres_server())
        for delay in args.delays:
            for kind in args.storages:
                for n in ([1] if kind == "local" else [1, 2]):
                    with tempfile.TemporaryDirectory(prefix="rpa_tune_bench_dist_") as tmp:
                        d = Path(tmp)
                        url = {"local": None, "sqlite": f"sqlite:///{d / 'study.db'}",
                               "journal": str(d / "study.journal"),
                               "postgres": create_database(pg, "b" + uuid.uuid4().hex[:10]) if pg else None}[kind]
                        r = dict(storage=kind, **run_workers(n, url, d, args, delay))
                        print(json.dumps(r), flush=True)
                        rows.append(r)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    head = (f"{stamp}; machine: {machine}; `rpa-tune sweep --case {args.case} --search grid --budget "
            f"{args.budget} --jobs {args.jobs}` per worker (llama3-8b, v6e), evaluator: "
            + ("the real deviceless one (`--backend compile`, libtpu's static profiler on this machine's CPU; "
               "an empty probe cache per run; the delay column does not apply)" if args.real else
               "the fake of tests/tune_fakes.py sleeping `delay` s per config (no compile)")
            + "; wall includes process start-up; storage time excludes joining the study (its own column, "
              "summed over workers)")
    lines = ["# Many workers on one sweep (`benchmarks/distributed.py`)", "", head, "",
             "| delay (s) | storage | workers | evaluations | duplicates | per worker | wall (s) | evaluations / s | "
             "join s | storage s (all workers) | storage calls | storage ms / evaluation |",
             "|---:|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['delay_s']:g} | {r['storage']} | {r['workers']} | {r['evaluations']} | {r['duplicates']} | "
                     f"{' + '.join(map(str, r['per_worker']))} | {r['wall_s']:.1f} | {r['evals_per_s']:.2f} | "
                     + (f"{r['join_s']:.2f} | {r['storage_s']:.2f} | {r['storage_calls']} | "
                        f"{r['storage_ms_per_eval']:.1f} |" if r["storage_s"] is not None else "- | - | - | - |"))
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    with open(args.out + ".jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(dict(r, when=stamp, machine=machine, case=args.case, budget=args.budget,
                                    jobs=args.jobs)) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
