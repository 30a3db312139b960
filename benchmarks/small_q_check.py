"""Prefill and mixed compositions of small q blocks against whole compiles.

For each (generation, shape, page size) below, configs of a small ``bq`` and the heuristic
(bq 128 or more) are probed (``rpa_tune.estimator.compose``), and workloads are compiled
whole with the static profiler on: the composed cycles against the whole compile's.

* prefill: one chunk of 256 queries after 1024 cached tokens, one of 128 after 2048.
* mixed: the batches a coverage sweep prices at token buckets 128 and 256
  (``rpa_tune.workloads.mixed_workload``, seed 0: 7 and 27 sequences, a prefill chunk,
  two extends, spec-decode and decode steps over 0.7-3.8 k cached tokens each), each like
  sequence's KV length one more than the one before ("unlike"): the analysis program
  runs like sequences in a row as one loop, which serving does not have
  (``kernel.analysis``), and its cycles for them are not serving's (figures in
  notebook.md). The bucket-256 step fills its bucket (a 128-token chunk).
* mixed-filled: the steps that fill buckets 2048 and 4096 (28 and 30 sequences: prefill
  chunks of at most 1024 tokens beside the extends, spec-decode and decode sequences),
  like sequences made unlike as above.

The new K/V operand is placed in VMEM in every program (as the estimator does on v5p; on
v5e and v6e XLA puts it there anyway), so both sides price the same program.

    python benchmarks/small_q_check.py [--case prefill|mixed|mixed-filled] [--out FILE.md]

``rpa_tune.estimator.compose.PREFILL_UNDERPRICED`` holds the worst prefill error seen per bq.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernel.config import BlockSizes  # noqa: E402
from kernel.workload import ModelShape, ServingLimits, Workload  # noqa: E402
from rpa_tune.estimator import compose, profiler  # noqa: E402
from rpa_tune.kernels import get_kernel  # noqa: E402
from rpa_tune.workloads import mixed_workload  # noqa: E402

LLAMA3_8B, QWEN3_32B_TP4 = ModelShape(32, 8, 128), ModelShape(16, 2, 128)
LLAMA3_70B_TP8, STARCODER = ModelShape(8, 1, 128), ModelShape(48, 1, 128)
PREFILL = [  # generation, model, label, page size, configs (small bq first)
    ("v5e", QWEN3_32B_TP4, "Qwen3-32B TP4", 256, [(32, 512, 16, 512), (256, 512, 16, 256)]),
    ("v5p", LLAMA3_8B, "Llama-3-8B", 128, [(32, 256, 16, 256), (64, 256, 32, 256), (64, 512, 32, 512),
                                           (128, 512, 32, 256)]),
    ("v6e", LLAMA3_8B, "Llama-3-8B", 256, [(32, 512, 32, 512), (64, 512, 64, 512), (256, 512, 64, 256)]),
]
PREFILL_WORKLOADS = [([256], [1280]), ([128], [2176])]
MIXED = [  # the shipped mixed winners of these keys (tables/*.json), the heuristic, and
    # (16, 512, 16, 512), whose v5p rows the walk's memory bound refused
    ("v5p", LLAMA3_70B_TP8, "Llama-3-70B TP8", 256, [(16, 2048, 16, 1024), (32, 2048, 32, 512),
                                                     (128, 512, 16, 256), (16, 512, 16, 512)]),
    ("v6e", QWEN3_32B_TP4, "Qwen3-32B TP4", 128, [(16, 1024, 16, 1024), (32, 512, 32, 512),
                                                  (128, 512, 32, 256)]),
    ("v5e", STARCODER, "StarCoder-15B", 128, [(16, 512, 4, 512), (128, 512, 2, 256)]),
]
MIXED_BUCKETS = (128, 256)
MIXED_FILLED = [  # the heuristic, the winner shipped from the 640-token step, prefill-like configs
    ("v6e", LLAMA3_70B_TP8, "Llama-3-70B TP8", 128, [(128, 512, 32, 256), (32, 1024, 16, 1024),
                                                     (128, 2048, 64, 512), (256, 2048, 64, 512)]),
]
MIXED_FILLED_BUCKETS = (2048, 4096)


def runs(case: str):
    """(generation, model, label, page, config, limits, [(name, Workload)]) to check."""
    if case == "prefill":
        for gen, model, label, page, configs in PREFILL:
            limits = ServingLimits(page_size=page, max_num_tokens=2048, max_num_seqs=128, max_model_len=8192)
            loads = [(f"{q[0]} after {kv[0] - q[0]}", Workload.of_case("prefill", q, kv))
                     for q, kv in PREFILL_WORKLOADS]
            for c in configs:
                yield gen, model, label, page, c, limits, loads
        return
    table, buckets = (MIXED_FILLED, MIXED_FILLED_BUCKETS) if case == "mixed-filled" else (MIXED, MIXED_BUCKETS)
    for gen, model, label, page, configs in table:
        for c in configs:
            for t in buckets:
                limits = ServingLimits(page_size=page, max_num_tokens=t, max_num_seqs=128, max_model_len=8192)
                w, _ = mixed_workload(limits)
                w = Workload.of_case("mixed", w.q_lens,
                                     [kv for _, kv in compose.unlike_in_a_row(list(zip(w.q_lens, w.kv_lens)))])
                yield gen, model, label, page, c, limits, [(f"bucket {t}: {len(w.q_lens)} seqs, unlike", w)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", choices=("prefill", "mixed", "mixed-filled"), default="prefill")
    ap.add_argument("--out", default=None, help="write the Markdown table here")
    args = ap.parse_args()
    kern = get_kernel("rpa-tune")
    lines = ["| gen | shape | page | config | workload | whole compile (cycles) | composed | error |",
             "|---|---|---:|---|---|---:|---:|---:|"]
    case = "mixed" if args.case == "mixed-filled" else args.case
    for gen, model, label, page, c, limits, loads in runs(args.case):
        bs = BlockSizes(*c)
        pr = compose.probe_config(builder=kern.builder, writes_kv_cache=kern.writes_kv_cache, case=case,
                                  bs=bs, tpu=gen, model=dataclasses.asdict(model),
                                  limits=dataclasses.asdict(limits))
        if pr["status"] != "ok":
            lines.append(f"| {gen} | {label} | {page} | {c} | | probes {pr['status']} | | |")
            continue
        m = compose.model_from_json(pr["model"])
        for name, w in loads:
            req = dict(workload=dict(q_lens=list(w.q_lens), kv_lens=list(w.kv_lens),
                                     distribution=list(w.distribution)),
                       block_sizes=list(bs), tpu=gen, model=dataclasses.asdict(model),
                       limits=dataclasses.asdict(limits), case=case, place_new_kv=True)
            t0 = time.time()
            r = profiler.profile(kern.builder, req, timeout=1800, rss_cap=8 << 30, bundles=False)
            if r["status"] != "ok":
                lines.append(f"| {gen} | {label} | {page} | {c} | {name} | {r['status']} | | |")
                continue
            composed = m.cycles(w)
            lines.append(f"| {gen} | {label} | {page} | {c} | {name} | {r['cycles']:,} | {composed:,.0f} | "
                         f"{composed / r['cycles'] - 1:+.1%} |")
            print(lines[-1], f"({time.time() - t0:.0f} s)", flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
