"""Composed estimates against full compiles: does pricing a workload from a config's probe
compiles (rpa_tune.estimator.compose) agree with compiling the whole workload?

For each generation and case, one config (Llama-3-8B shard: 32 q / 8 KV heads, head_dim
128, bf16) is probed once; then each workload below is compiled whole (same analysis-mode
program, the profiler on) and the composed cycles are compared with the full compile's.
The full compiles are what the composition replaces: they are slow and memory-hungry, so
the workloads are kept to at most 16 decode sequences / one 1K prefill chunk.

    python benchmarks/compose_check.py --tpu v6e --tpu tpu7x --tpu v5e [--out FILE]
    python benchmarks/compose_check.py --kernel tpu-inference --tpu v6e --case decode

``--kernel tpu-inference`` checks the same composition for the public RPA v3 kernel (its
lowering, ``rpa_tune.estimator.public``; its records keyed by the package version).

Full compiles and probe cycles are recorded in ``benchmarks/results/compose_check.jsonl``,
keyed by the kernel's version id (a rerun resumes; a new kernel version re-measures).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernel.config import BlockSizes, Case  # noqa: E402
from kernel.workload import ModelShape, ServingLimits, Workload  # noqa: E402
from rpa_tune.estimator import compose, profiler  # noqa: E402
from rpa_tune.provenance import kernel_hash  # noqa: E402

MODEL = ModelShape(32, 8, 128)
CACHE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "compose_check.jsonl")
PAGE_SIZE = 128
CONFIGS = {Case.DECODE: BlockSizes(1, 1024, 1, 512), Case.PREFILL: BlockSizes(128, 512, 128, 256),
           Case.MIXED: BlockSizes(64, 512, 64, 256)}


def workloads() -> list[tuple[str, Workload]]:
    rng = np.random.default_rng(0)
    ln = lambda n, mu: np.clip(rng.lognormal(np.log(mu), 0.7, n).astype(int), 2, 12000).tolist()
    d = lambda kv: Workload.of_case("decode", [1] * len(kv), kv)
    p = lambda q, kv: Workload.of_case("prefill", q, kv)
    # mixed: no two like sequences in a row (each KV length past the first of its kind one
    # longer): the analysis program loops over each run of like sequences, which serving
    # does not, and such short loops cost it more (benchmarks/README.md, "Composition for
    # many sequences")
    m = lambda q, kv: Workload.of_case("mixed", q, [k + sum(1 for a, b in zip(q[:i], kv[:i]) if (a, b) == (x, k))
                                                    for i, (x, k) in enumerate(zip(q, kv))])
    return [
        ("decode 16 x 2K", d([2049] * 16)), ("decode 8 x 4K", d([4097] * 8)),
        ("decode 16 lognormal ~2K", d(ln(16, 2048))), ("decode 16 lognormal ~512", d(ln(16, 512))),
        ("decode 4 ragged 77..8K", d([513, 3001, 77, 8193])), ("decode 12 x 700", d([700] * 12)),
        ("prefill 1 x 512", p([512], [512])), ("prefill 1 x 1024", p([1024], [1024])),
        ("prefill 256 after 1K", p([256], [1280])), ("prefill 384 after 2.5K", p([384], [2944])),
        ("prefill 2 x 256", p([256, 256], [256, 256])), ("prefill 128 + 200 after 700", p([128, 200], [128, 900])),
        ("mixed 8 x 1 + 128, unlike", m([1] * 8 + [128], [1500] * 8 + [128])),
        ("mixed 4 spec-4 + 256 after 512, unlike", m([4] * 4 + [256], [2048] * 4 + [768])),
        ("mixed 6 x 1 lognormal + 64", m([1] * 6 + [64], ln(6, 1024) + [64])),
        ("mixed 100 + 3 x 1", m([100, 1, 1, 1], [900, 3000, 40, 1200])),
        # added later, after the ones above (so their lognormal draws are unchanged)
        ("decode 32 x 1K", d([1025] * 32)), ("decode 48 lognormal ~1K", d(ln(48, 1024))),
        ("decode 2 x 8K", d([8193] * 2)), ("decode 24 x 300", d([300] * 24)),
    ]


def recorded(cache: dict, gen: str, case: Case) -> tuple[str, dict] | None:
    """``(kernel hash, record)`` of the newest recorded probe set of ``gen`` / ``case`` whose
    probes are today's ``compose.probes`` (older probe shapes cannot be refitted by today's
    ``compose.fit``); the whole compiles of that kernel hash go with it."""
    bs = CONFIGS[case]
    found = None
    for key, r in cache.items():
        g, what, *rest = json.loads(key)
        if not (g == gen and what == "probes" and rest[0] == case.value and rest[1] == list(bs)):
            continue
        want = [[list(p.q_lens), list(p.kv_lens)] for p in compose.probes(case, bs, PAGE_SIZE, recorded_skip(r))]
        if [[p["q_lens"], p["kv_lens"]] for p in r["probes"]] == want:
            found = (rest[-1], r)
    return found


def _canonical(d: dict) -> dict:
    """A record whose key ends in a legacy kernel source hash, keyed by the version id it
    stands for (``kernel.provenance.canonical_kernel_id``)."""
    from kernel.provenance import canonical_kernel_id
    key = json.loads(d["key"])
    if key and canonical_kernel_id(key[-1]) != key[-1]:
        d = dict(d, key=json.dumps(key[:-1] + [canonical_kernel_id(key[-1])]))
    return d


def recorded_skip(rec: dict) -> bool:
    """Whether the recorded kernel skipped dead prefill / mixed chunks (records from before
    the kernel did carry no flag: it computed every chunk)."""
    return bool(rec.get("skip_dead_chunks", False))


def case_of(w: Workload) -> Case:
    return next(c for c in Case if w.case_range(c)[1] > w.case_range(c)[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tpu", action="append", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--case", action="append", choices=[c.value for c in Case], default=None,
                    help="only these cases (repeatable; default all)")
    from rpa_tune.kernels import DEFAULT, get_kernel, kernel_names
    ap.add_argument("--kernel", choices=kernel_names(), default=DEFAULT,
                    help="whose composition to check (default ours)")
    ap.add_argument("--recorded", action="store_true",
                    help="no compile: the table from the recorded probes and whole compiles (per generation "
                         "and case, the newest kernel version recorded with today's probes), refitted "
                         "with today's composition")
    args = ap.parse_args()
    kern = get_kernel(args.kernel)
    builder = kern.builder
    lines = ["| gen | workload | config | full (cycles) | composed | error | full compile | max RSS |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    cache = {}
    if os.path.exists(CACHE):
        with open(CACHE) as f:
            cache = {d["key"]: d for d in map(_canonical, map(json.loads, f))}
    limits = ServingLimits(page_size=PAGE_SIZE, max_num_tokens=2048, max_num_seqs=128, max_model_len=16384)
    for gen in args.tpu or ["v6e"]:
        models, hashes = {}, {}
        for name, w in workloads():
            case = case_of(w)
            bs = CONFIGS[case]
            if args.case and case.value not in args.case:
                continue
            if case not in hashes:
                found = recorded(cache, gen, case) if args.recorded else None
                hashes[case] = found[0] if found else kern.config_version()
                if args.recorded:
                    print(f"{gen} {case.value}: recorded measurements of kernel source hash "
                          f"{hashes[case] if found else '(none with today probes)'}", flush=True)
            kh = hashes[case]
            # (mixed probes with their warm-up, compose.mixed_warm_up, are recorded apart,
            # (and our prefill probes with their long walk, compose.long_walk_probe)
            pkey = json.dumps([gen, "probes", case.value, list(bs)] + (["warm-up"] if case == Case.MIXED else [])
                              + (["long-walk"] if case == Case.PREFILL and kern.probe_plan(
                                  case, bs, gen, MODEL, PAGE_SIZE).long_walk else []) + [kh])
            if case not in models and args.recorded:
                rec = found and found[1]
                models[case] = rec and compose.fit(case, bs, PAGE_SIZE, [
                    compose.Probe(tuple(p["q_lens"]), tuple(p["kv_lens"])) for p in rec["probes"]],
                    [p["cycles"] for p in rec["probes"]], skip_dead_chunks=recorded_skip(rec))
            if case not in models:
                pr = compose.probe_config(builder=builder, writes_kv_cache=kern.writes_kv_cache, case=case, bs=bs,
                                          tpu=gen, model=dataclasses.asdict(MODEL), limits=dataclasses.asdict(limits))
                if pr.get("environment"):     # e.g. a full disk or an edited kernel: not recorded
                    raise SystemExit(f"compose_check: {pr['message'][:300]}")
                if pr["status"] != "ok":
                    print(f"{gen} {case.value}: probes failed: {pr.get('message', '')[:300]}", flush=True)
                    models[case] = None
                    continue
                models[case] = compose.model_from_json(pr["model"])
                if pkey not in cache:     # recorded for tests/test_estimator.py's refit check
                    cache[pkey] = dict(key=pkey, status="ok", skip_dead_chunks=pr["skip_dead_chunks"], probes=[
                        {k: p[k] for k in ("q_lens", "kv_lens", "cycles")} for p in pr["probes"]])
                    with open(CACHE, "a") as f:
                        f.write(json.dumps(cache[pkey]) + "\n")
                print(f"{gen} {case.value}: probes {pr['compile_s']:.0f} s, max RSS "
                      f"{pr['max_rss_bytes'] / 2**30:.1f} GB, audit {pr['audit']}", flush=True)
            if models[case] is None:
                continue
            req = dict(workload=dict(q_lens=list(w.q_lens), kv_lens=list(w.kv_lens),
                                     distribution=list(w.distribution)), block_sizes=list(bs), tpu=gen,
                       model=dataclasses.asdict(MODEL), limits=dataclasses.asdict(limits), case=case.value)
            key = json.dumps([gen, name, list(bs), kh])
            r = cache.get(key)
            if r is None and args.recorded:
                continue
            if r is None:
                t0 = time.time()
                r = profiler.profile(builder, req, timeout=1800, rss_cap=16 << 30,
                                     bundles=False, expect_kernel_hash=kh if kh == kernel_hash() else None)
                if r.get("environment"):     # e.g. a full disk: not the workload's result
                    raise SystemExit(f"compose_check: {r['message'][:300]}")
                r = dict(key=key, status=r["status"], cycles=r.get("cycles"), wall_s=time.time() - t0,
                         max_rss_bytes=r.get("max_rss_bytes") or 0)
                with open(CACHE, "a") as f:
                    f.write(json.dumps(r) + "\n")
            if r["status"] != "ok":
                lines.append(f"| {gen} | {name} | {tuple(bs)} | {r['status']} | | | | |")
                continue
            c = models[case].cycles(w)
            lines.append(f"| {gen} | {name} | {tuple(bs)} | {r['cycles']:,} | {c:,.0f} | "
                         f"{c / r['cycles'] - 1:+.1%} | {r['wall_s']:.0f} s | "
                         f"{r['max_rss_bytes'] / 2**30:.1f} GB |")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
