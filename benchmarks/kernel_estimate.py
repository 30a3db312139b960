"""Compiler static estimates of the RPA kernel, deviceless, with the paper's MBU / MFU.

Every number printed here is a COMPILER ESTIMATE (libtpu's static LLO profiler, with the
workload's metadata made visible through ``kernel.analysis.lower_for_estimate``), not a
measurement on a TPU. Cycles are converted to time with a derived clock (see
``kernel.metrics.CLOCK_SOURCE``); the time reported is max(estimate, bytes / HBM
bandwidth, FLOPs / peak), and the row says which bound is active.

Examples::

    python benchmarks/kernel_estimate.py --tpu v6e --case decode --seqs 128 --kv-len 2048 --bs 1,1024,1,512
    python benchmarks/kernel_estimate.py --tpu tpu7x --scaling      # the workload-scaling checks
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernel.analysis import estimate  # noqa: E402
from kernel.config import BlockSizes, Case  # noqa: E402
from kernel.metrics import CLOCK_SOURCE, summarize  # noqa: E402
from kernel.workload import ModelShape, ServingLimits, Workload  # noqa: E402

LLAMA3_8B = ModelShape(32, 8, 128)


def run_one(tpu, case, workload, bs, model=LLAMA3_8B, limits=None, label=""):
    limits = limits or ServingLimits(page_size=128, max_num_tokens=max(512, workload.num_tokens),
                                     max_num_seqs=max(128, workload.num_seqs), max_model_len=8192 * 2)
    t0 = time.perf_counter()
    r = estimate(workload, bs, tpu, model, limits, case)
    wall = time.perf_counter() - t0
    if r.get("status") != "ok":
        print(f"{label:<28} {tuple(bs)!s:<22} status={r.get('status')} {r.get('message', '')[-200:]}")
        return None
    s = summarize(r["cycles"], workload, model, tpu, case)
    print(f"{label:<28} {tuple(bs)!s:<22} cycles={r['cycles']:>12,d}  est={s['estimate_s'] * 1e6:9.1f}us  "
          f"mem={s['memory_bound_s'] * 1e6:8.1f}us  flop={s['compute_bound_s'] * 1e6:8.1f}us  "
          f"bound={s['active_bound']:<8}  MBU={s['mbu']:5.1%}  MFU={s['mfu']:5.1%}  "
          f"(compile {r.get('compile_s', 0):.1f}s, wall {wall:.1f}s)")
    if r.get("sample_note"):
        print(f"{'':<28} {r['sample_note']}; sample cycles {r['sample_cycles']:,d}")
    return r["cycles"]


def scaling(tpu):
    print(f"# {tpu}: decode, Llama-3-8B shape, bs (1, 1024, 1, 512): same KV bytes -> same estimate")
    bs = BlockSizes(1, 1024, 1, 512)
    a = run_one(tpu, "decode", Workload.of_case("decode", [1] * 128, [2048] * 128), bs, label="decode 128 x 2048")
    b = run_one(tpu, "decode", Workload.of_case("decode", [1] * 64, [4096] * 64), bs, label="decode 64 x 4096")
    c = run_one(tpu, "decode", Workload.of_case("decode", [1] * 128, [4096] * 128), bs, label="decode 128 x 4096")
    if a and b and c:
        print(f"  ratio (64x4096)/(128x2048) = {b / a:.2f} (expect ~1);  (128x4096)/(128x2048) = {c / a:.2f} (expect ~2)")
    prefill_scaling(tpu)


def prefill_scaling(tpu):
    print(f"# {tpu}: causal prefill, one sequence, bs (128, 512, 128, 256): ~quadratic in length")
    bs = BlockSizes(128, 512, 128, 256)
    prev = None
    for n in (1024, 2048, 4096):
        cyc = run_one(tpu, "prefill", Workload.of_case("prefill", [n], [n]), bs,
                      limits=ServingLimits(128, max(512, n), 128, 16384), label=f"prefill {n}")
        if prev and cyc:
            print(f"  x{cyc / prev:.2f} for 2x length (quadratic -> 4, linear -> 2)")
        prev = cyc


# libtpu static estimates of the public RPA v3 kernel (tpu-and-tuning-notes.md): TPU7x,
# Llama-3-8B shape, 128 decode sequences (128 x 2K and 64 x 4K gave the same), page 256,
# block sizes (1, bkv, 1, bkv), with the metadata made visible to the profiler.
PUBLIC_V3_TPU7X_DECODE = {256: 2_880_000, 512: 2_100_000, 1024: 1_700_000, 2048: 1_510_000}


def compare_public():
    print("# tpu7x decode, 128 x 2048, page 256, (1, bkv, 1, bkv): ours vs public RPA v3 (both estimates)")
    w = Workload.of_case("decode", [1] * 128, [2048] * 128)
    lim = ServingLimits(page_size=256, max_num_tokens=512, max_num_seqs=128, max_model_len=16384)
    for bkv, pub in PUBLIC_V3_TPU7X_DECODE.items():
        ours = run_one("tpu7x", "decode", w, BlockSizes(1, bkv, 1, bkv), limits=lim, label=f"ours bkv={bkv}")
        if ours:
            print(f"  public v3 {pub:,d} cycles; ours / public = {ours / pub:.2f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tpu", default="v6e")
    ap.add_argument("--case", default="decode", choices=[c.value for c in Case])
    ap.add_argument("--seqs", type=int, default=128)
    ap.add_argument("--q-len", type=int, default=None, help="query tokens per sequence (decode: 1)")
    ap.add_argument("--kv-len", type=int, default=2048)
    ap.add_argument("--bs", default="1,1024,1,512", help="bq,bkv,cq,ckv")
    ap.add_argument("--scaling", action="store_true", help="run the workload-scaling checks")
    ap.add_argument("--prefill-scaling", action="store_true", help="only the prefill part of --scaling")
    ap.add_argument("--compare-public", action="store_true",
                    help="tpu7x decode vs the public RPA v3 kernel's recorded estimates")
    a = ap.parse_args()
    print(f"# compiler estimates (libtpu static profiler), deviceless; clock: {CLOCK_SOURCE}")
    if a.scaling:
        scaling(a.tpu)
        return
    if a.prefill_scaling:
        prefill_scaling(a.tpu)
        return
    if a.compare_public:
        compare_public()
        return
    q = 1 if a.case == "decode" else (a.q_len or a.kv_len)
    w = Workload.of_case(a.case, [q] * a.seqs, [a.kv_len] * a.seqs)
    run_one(a.tpu, a.case, w, BlockSizes(*(int(x) for x in a.bs.split(","))),
            label=f"{a.case} {a.seqs} x {a.kv_len}")


if __name__ == "__main__":
    main()
