"""Cost of the block-size lookup a kernel call pays, next to the kernel itself.

Measured on the host (no TPU needed): every ``kernel.ragged_paged_attention`` call
resolves block sizes for the three cases in Python before dispatching the jitted program
(``kernel.api.build_options``). Reported:

* load: reading and indexing the tables (once per process, at the first call);
* lookup, cached: ``kernel.tables.lookup_block_sizes`` for a key seen before (every call
  after the first of a bucket);
* lookup, uncached: the index search itself (exact, bucketed, miss), cache cleared;
* resolve 3 cases: ``build_options`` (env check + lookup or heuristic per case, the
  legality checks, the frozen options), i.e. all the per-call work the tables add to;
* the kernel: the compiler estimate of the Llama-3-8B v6e entries in the shipped table,
  and the HBM-bandwidth lower bound of a decode step (64 seqs x 2048 context).

    python benchmarks/tables_lookup.py [--out benchmarks/results/tables_lookup.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def per_call(fn, n: int) -> float:
    fn()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "tables_lookup.json"))
    args = ap.parse_args()
    from kernel import tables as kt
    from kernel.api import build_options
    from kernel.config import Case
    from kernel.hardware import tpu_info
    from kernel.metrics import hbm_bytes
    from kernel.workload import ModelShape, Workload

    t0 = time.perf_counter()
    state = kt.reload()
    load_s = time.perf_counter() - t0
    n_entries = len(state.index)
    model = ModelShape(32, 8, 128)
    dims = dict(max_num_tokens=256, num_q_heads=32, num_kv_heads=8, head_dim=128, num_pages=8192,
                page_size=128, max_num_seqs=128, pages_per_seq=64, kv_dtype="bfloat16", q_dtype="bfloat16")
    res = {"tables": [f for f, _ in state.files], "entries": n_entries, "load_s": load_s}
    res["lookup_cached_s"] = per_call(lambda: kt.lookup_block_sizes(Case.DECODE, generation="v6e", dims=dims), 20000)

    def uncached():
        kt._lookup_cached.cache_clear()
        kt.lookup_block_sizes(Case.DECODE, generation="v6e", dims=dims)
    res["lookup_uncached_s"] = per_call(uncached, 2000)
    miss = dict(dims, num_q_heads=40, num_kv_heads=8)

    def uncached_miss():
        kt._lookup_cached.cache_clear()
        kt.lookup_block_sizes(Case.DECODE, generation="v6e", dims=miss)
    res["lookup_uncached_miss_s"] = per_call(uncached_miss, 2000)
    res["resolve_3_cases_s"] = per_call(lambda: build_options(dims, "v6e", {}, sm_scale=0.088), 5000)
    res["sources"] = {c.value: kt.lookup_block_sizes(c, generation="v6e", dims=dims) is not None for c in Case}

    # the kernel it sits next to
    w = Workload.of_case("decode", [1] * 64, [2048] * 64)
    bw = tpu_info("v6e").mem_bw_bytes_per_second
    bound = hbm_bytes(w, model, Case.DECODE) / bw if bw else None
    res["decode_64x2048_hbm_bound_s"] = bound
    ests = [e.metric for e in state.index._exact.values() if e.key.generation == "v6e"
            and (e.key.num_q_heads, e.key.num_kv_heads, e.key.head_dim) == (32, 8, 128)] if n_entries else []
    res["v6e_llama3_8b_table_metric_min_s"] = min(ests) if ests else None
    res["v6e_llama3_8b_table_metric_max_s"] = max(ests) if ests else None

    us = lambda v: "-" if v is None else f"{v * 1e6:10.2f} us"
    print(f"tables loaded: {n_entries} entries from {len(res['tables'])} file(s) in {load_s * 1e3:.1f} ms (once per process)")
    print(f"lookup, cached (per case per call)      {us(res['lookup_cached_s'])}")
    print(f"lookup, uncached hit                    {us(res['lookup_uncached_s'])}")
    print(f"lookup, uncached miss                   {us(res['lookup_uncached_miss_s'])}")
    print(f"build_options, 3 cases (per call)       {us(res['resolve_3_cases_s'])}")
    print(f"decode 64x2048 Llama-3-8B v6e HBM bound {us(bound)}")
    if ests:
        print(f"v6e Llama-3-8B table metrics (estimate) {us(min(ests))} .. {us(max(ests))}")
    if bound:
        print(f"=> cached lookup / decode HBM bound = {res['lookup_cached_s'] / bound:.2e}; "
              f"build_options / bound = {res['resolve_3_cases_s'] / bound:.2e}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2, sort_keys=True)
        f.write("\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
