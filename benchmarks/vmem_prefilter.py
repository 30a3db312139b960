"""How good is the analytic VMEM pre-filter? False-reject / false-accept rates vs the compiler.

Method: per TPU generation, configs are sampled (seeded) from a space *wider* than the
shipped ones (so that many lie near or beyond the VMEM capacity), over several model
shapes and all three cases. Sampling is stratified by predicted scratch / capacity
(``rpa_tune.prefilter.predicted_bytes``) so the boundary region is well covered. Each
config is compiled deviceless for its generation (no profiler) in rpa-tune worker
processes with the same VMEM-limit policy as the compile backend: the kernel's default
limit first, then, after a scoped-limit OOM, the limit the compiler asked for (capped at
the chip's capacity). Verdict ``fits`` = some limit compiles; ``oom`` = the compiler
reported VMEM exhaustion at every limit tried.

* false reject: the pre-filter rejects, the compiler fits it (must be 0).
* false accept: the pre-filter accepts, the compiler runs out of VMEM (costs one compile).

Usage::

    python benchmarks/vmem_prefilter.py --per-generation 60 --jobs 2 [--out results.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from kernel.config import GENERATIONS, BlockSizes, Case, block_size_errors  # noqa: E402
from kernel.workload import ModelShape, ServingLimits, Workload  # noqa: E402
from rpa_tune import prefilter  # noqa: E402
from rpa_tune.evaluators import base  # noqa: E402
from rpa_tune.evaluators.base import EvalResult, Evaluator, Task  # noqa: E402

MODELS = {
    "llama3-8b": ModelShape(32, 8, 128),
    "llama3-70b-tp8": ModelShape(8, 1, 128),
    "gemma2-9b": ModelShape(16, 8, 256),
    "llama3.2-1b-fp8kv": ModelShape(32, 8, 64, kv_dtype="float8_e4m3fn"),
}
LIMITS = ServingLimits(page_size=128, max_num_tokens=1024, max_num_seqs=8, max_model_len=16384)


class VmemVerdict(Evaluator):
    """Deviceless compile without the profiler, with the compile backend's limit policy."""

    name = "vmem-verdict"
    method = "compile"
    version = "1"

    def evaluate(self, task: Task) -> EvalResult:
        cap = prefilter.capacity(task.generation)
        limit = base.initial_vmem_limit(task.vmem_predicted_bytes, cap)
        tried = []
        while True:
            v = prefilter.compiler_verdict(task.model, task.limits, task.generation, task.case, task.bs, limit)
            tried.append(limit)
            vm = v.get("vmem") or {}
            new = (base.raised_vmem_limit(vm["used_bytes"], limit, cap)
                   if v["status"] == "vmem_oom" and vm.get("kind") == "scoped_limit" else None)
            if new is None:
                break
            limit = new
        status = {"ok": base.OK, "vmem_oom": base.VMEM_OOM}.get(v["status"], base.COMPILE_ERROR)
        return EvalResult(status, "compile", vmem_limit_bytes=limit, vmem_reported_bytes=vm.get("used_bytes"),
                          compile_s=v["seconds"], message=json.dumps({"tried": tried, "kind": vm.get("kind"),
                                                                      "error": v.get("message", "")[-300:]}))


def make_evaluator(backend):
    return VmemVerdict()


def wide_space(case: Case):
    if case == Case.DECODE:
        bkv = [128 * k for k in (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 256)]
        return [BlockSizes(1, b, 1, c) for b in bkv for c in (128, 256, 512, 1024, 2048, 4096) if b % c == 0]
    # as the shipped spaces (prefill bq <= 512, mixed bq <= 256), with KV blocks up to 8192 tokens;
    # bq / cq <= 32 bounds the compile time of the compute loop
    bq = [16, 32, 64, 128, 256, 512] if case == Case.PREFILL else [16, 32, 64, 128, 256]
    cq = [8, 16, 32, 64, 128, 256]
    bkv = [128, 256, 512, 1024, 2048, 4096, 8192]
    ckv = [128, 256, 512, 1024, 2048]
    return [BlockSizes(a, b, c, d) for a in bq for c in cq for b in bkv for d in ckv
            if a % c == 0 and b % d == 0 and a // c <= 32]


def sample(per_generation: int, seed: int):
    rng = np.random.default_rng(seed)
    out = []
    for gen in GENERATIONS:
        cap = prefilter.capacity(gen)
        pool = []
        for mname, model in MODELS.items():
            for case in Case:
                for bs in wide_space(case):
                    if block_size_errors(case, bs, LIMITS.page_size) or bs.bq > LIMITS.max_num_tokens:
                        continue
                    p = prefilter.predicted_bytes(model, LIMITS, bs)
                    pool.append((p / cap, mname, case, bs, p))
        ratios = np.array([x[0] for x in pool])
        # strata of predicted / capacity: most samples near the boundary
        edges = [(0.0, 0.5, 0.15), (0.5, 0.9, 0.2), (0.9, 1.25, 0.35), (1.25, 2.0, 0.2), (2.0, 1e9, 0.1)]
        chosen = []
        for lo, hi, frac in edges:
            idx = np.nonzero((ratios >= lo) & (ratios < hi))[0]
            k = min(len(idx), max(1, round(frac * per_generation)))
            chosen += list(rng.choice(idx, size=k, replace=False)) if len(idx) else []
        for i in chosen:
            r, mname, case, bs, p = pool[i]
            out.append(dict(generation=gen, model=mname, case=case.value, bs=tuple(bs), predicted=p, ratio=r))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-generation", type=int, default=60)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--out", default=None, help="write every verdict as JSON here")
    args = ap.parse_args()

    os.environ["RPA_TUNE_EVALUATOR_OVERRIDE"] = "vmem_prefilter:make_evaluator"
    os.environ["PYTHONPATH"] = str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", "")
    from rpa_tune.engine import WorkerPool

    configs = sample(args.per_generation, args.seed)
    print(f"{len(configs)} configs over {len(GENERATIONS)} generations, {len(MODELS)} shapes, 3 cases; "
          f"pre-filter rule: reject iff predicted > {prefilter.SLACK} x VMEM capacity", flush=True)
    results = []
    t0 = time.monotonic()
    pending = list(configs)
    with WorkerPool("compile", args.jobs) as pool:
        while pending or pool.busy:
            while pending and pool.free_slots():
                c = pending.pop(0)
                w = Workload.of_case(c["case"], [1], [1])
                task = Task(backend="compile", generation=c["generation"], case=c["case"],
                            model=MODELS[c["model"]], limits=LIMITS, workload=w, bs=BlockSizes(*c["bs"]),
                            timeout=args.timeout, vmem_predicted_bytes=c["predicted"])
                pool.submit(task, c)
            for c, task, res, secs in pool.wait():
                c = dict(c, status=res.status, limit=res.vmem_limit_bytes, reported=res.vmem_reported_bytes,
                         seconds=secs, detail=res.message)
                results.append(c)
                n = len(results)
                if n % 10 == 0:
                    print(f"  {n}/{len(configs)} compiled ({time.monotonic() - t0:.0f} s)", flush=True)
    elapsed = time.monotonic() - t0
    report(results, elapsed)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1, default=str))


def report(results, elapsed):
    judged = [r for r in results if r["status"] in ("ok", "vmem_oom")]
    other = [r for r in results if r["status"] not in ("ok", "vmem_oom")]
    rej = [r for r in judged if prefilter.rejects(r["predicted"], r["generation"])]
    acc = [r for r in judged if not prefilter.rejects(r["predicted"], r["generation"])]
    fr = [r for r in rej if r["status"] == "ok"]
    fa = [r for r in acc if r["status"] == "vmem_oom"]
    print(f"\n{len(results)} configs compiled in {elapsed:.0f} s; {len(other)} without a VMEM verdict "
          f"({', '.join(sorted({r['status'] for r in other})) or '-'})")
    print(f"pre-filter rejected {len(rej)}, accepted {len(acc)}")
    print(f"false rejects (rejected, compiler fits):     {len(fr)}/{len(rej)} = {len(fr) / max(1, len(rej)):.1%}")
    print(f"false accepts (accepted, compiler OOMs):      {len(fa)}/{len(acc)} = {len(fa) / max(1, len(acc)):.1%}")
    ratios = [r["predicted"] / r["reported"] for r in judged if r.get("reported")]
    if ratios:
        print(f"predicted / compiler-reported bytes on OOMs: min {min(ratios):.3f}, median {np.median(ratios):.3f}, "
              f"max {max(ratios):.3f} (n={len(ratios)})")
    print("\nper generation: rejected / false rejects / accepted / false accepts")
    for gen in GENERATIONS:
        g = [r for r in judged if r["generation"] == gen]
        gr = [r for r in g if prefilter.rejects(r["predicted"], gen)]
        ga = [r for r in g if not prefilter.rejects(r["predicted"], gen)]
        print(f"  {gen:6s} {len(gr):4d} {sum(r['status'] == 'ok' for r in gr):4d} {len(ga):4d} "
              f"{sum(r['status'] == 'vmem_oom' for r in ga):4d}")
    fits = [r for r in judged if r["status"] == "ok"]
    if fits:
        worst = max(fits, key=lambda r: r["ratio"])
        print(f"\nlargest predicted/capacity that compiled: {worst['ratio']:.3f} ({worst['generation']} "
              f"{worst['case']} {worst['model']} {worst['bs']})")
    ooms = [r for r in judged if r["status"] == "vmem_oom"]
    if ooms:
        best = min(ooms, key=lambda r: r["ratio"])
        print(f"smallest predicted/capacity that ran out of VMEM: {best['ratio']:.3f} ({best['generation']} "
              f"{best['case']} {best['model']} {best['bs']})")


if __name__ == "__main__":
    main()
