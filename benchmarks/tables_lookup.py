"""Cost of the block-size lookup a kernel call pays, next to the kernel itself.

Measured on the host (no TPU needed): every ``kernel.ragged_paged_attention`` call
resolves block sizes for the three cases in Python before dispatching the jitted program
(``kernel.api.build_options``). Reported:

* load: reading and indexing the shipped tables (once per process, at the first call);
* lookup, cached: ``kernel.tables.lookup_block_sizes`` for a key seen before (every call
  after the first of a bucket);
* lookup, uncached: the index search itself (exact, bucketed, miss), cache cleared, on a
  synthetic 216-entry table (the intended shipped size; written to a temp file, used for
  timing only);
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


def synthetic_table(path):
    """A table of the size the shipped set aims at (3 generations x 3 cases x 3 models x 8
    token buckets), written to a temporary file: for timing the index only, never shipped."""
    from kernel.config import TuningKey
    from kernel.tables import Entry, Table
    entries = []
    for g in ("v5e", "v6e", "tpu7x"):
        for c in ("decode", "prefill", "mixed"):
            for hq, hkv in ((32, 8), (8, 1), (16, 2)):
                for t in (16, 32, 64, 128, 256, 512, 1024, 2048):
                    bs = (1, 1024, 1, 512) if c == "decode" else (min(t, 128), 512, min(t, 64), 256)
                    entries.append(Entry(TuningKey(g, c, "bfloat16", "bfloat16", hq, hkv, 128, 128, t, 8192),
                                         bs, True, "synthetic (timing only)", 1e-4, "s", "estimate"))
    Table(tuple(entries), info={"note": "synthetic, benchmarks/tables_lookup.py timing only"}).write_json(path)
    return len(entries)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "tables_lookup.json"))
    args = ap.parse_args()
    import tempfile
    from kernel import tables as kt
    from kernel.api import build_options
    from kernel.config import Case
    from kernel.hardware import tpu_info
    from kernel.metrics import hbm_bytes
    from kernel.workload import ModelShape, Workload

    # 1. the shipped tables: load time (once per process) and their v6e Llama-3-8B metrics
    os.environ.pop("RPA_TABLE", None)
    t0 = time.perf_counter()
    shipped = kt.reload()
    res = {"shipped_files": [f for f, _ in shipped.files], "shipped_entries": len(shipped.index),
           "shipped_load_s": time.perf_counter() - t0}
    ests = [e.metric for e, _ in shipped.index._exact.values() if e.key.generation == "v6e"
            and (e.key.num_q_heads, e.key.num_kv_heads, e.key.head_dim) == (32, 8, 128)]

    # 2. the lookup path, on a table of the intended size (synthetic, timing only)
    tmp = tempfile.mkdtemp(prefix="rpa_lookup_bench_")
    n = synthetic_table(os.path.join(tmp, "synthetic.json"))
    os.environ["RPA_TABLE"] = os.path.join(tmp, "synthetic.json")
    os.environ["RPA_SHIPPED_TABLES"] = "0"
    t0 = time.perf_counter()
    kt.reload()
    res.update(index_entries=n, index_load_s=time.perf_counter() - t0)
    model = ModelShape(32, 8, 128)
    dims = dict(max_num_tokens=256, num_q_heads=32, num_kv_heads=8, head_dim=128, num_pages=8192,
                page_size=128, max_num_seqs=128, pages_per_seq=64, kv_dtype="bfloat16", q_dtype="bfloat16")
    bucket = dict(dims, max_num_tokens=200, pages_per_seq=40)
    miss = dict(dims, num_q_heads=40)
    assert kt.lookup_block_sizes(Case.DECODE, generation="v6e", dims=dims)[1].startswith("table:")
    assert kt.lookup_block_sizes(Case.DECODE, generation="v6e", dims=bucket)[1].endswith("(bucket)")
    assert kt.lookup_block_sizes(Case.DECODE, generation="v6e", dims=miss) is None
    res["lookup_cached_s"] = per_call(lambda: kt.lookup_block_sizes(Case.DECODE, generation="v6e", dims=dims), 20000)
    for name, d in (("exact", dims), ("bucket", bucket), ("miss", miss)):
        def uncached(d=d):
            kt._lookup_cached.cache_clear()
            kt.lookup_block_sizes(Case.DECODE, generation="v6e", dims=d)
        res[f"lookup_uncached_{name}_s"] = per_call(uncached, 2000)
    res["build_options_3_cases_s"] = per_call(lambda: build_options(dims, "v6e", {}, sm_scale=0.088), 5000)

    # 3. the kernel it sits next to
    w = Workload.of_case("decode", [1] * 64, [2048] * 64)
    bound = hbm_bytes(w, model, Case.DECODE) / tpu_info("v6e").mem_bw_bytes_per_second
    res["decode_64x2048_hbm_bound_s"] = bound
    res["v6e_llama3_8b_shipped_metric_min_s"] = min(ests) if ests else None
    res["v6e_llama3_8b_shipped_metric_max_s"] = max(ests) if ests else None

    us = lambda v: "-" if v is None else f"{v * 1e6:10.2f} us"
    print(f"shipped tables: {res['shipped_entries']} entries from {len(res['shipped_files'])} file(s), "
          f"read in {res['shipped_load_s'] * 1e3:.1f} ms (once per process)")
    print(f"timing index: {n} entries (synthetic, timing only), read in {res['index_load_s'] * 1e3:.1f} ms")
    print(f"lookup, cached (every call after a bucket's first) {us(res['lookup_cached_s'])}")
    for name in ("exact", "bucket", "miss"):
        print(f"lookup, uncached {name:<6} (first call of a bucket) {us(res[f'lookup_uncached_{name}_s'])}")
    print(f"build_options, 3 cases, per call                    {us(res['build_options_3_cases_s'])}")
    print(f"decode 64 x 2048 Llama-3-8B v6e, HBM lower bound    {us(bound)}")
    if ests:
        print(f"v6e Llama-3-8B shipped table metrics (estimates)   {us(min(ests))} .. {us(max(ests))}")
    print(f"=> cached lookup = {res['lookup_cached_s'] / bound:.2%} of the decode bound; "
          f"all per-call block-size resolution (build_options) = {res['build_options_3_cases_s'] / bound:.2%}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2, sort_keys=True)
        f.write("\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
