"""Prefill compositions of small q blocks against whole compiles.

For each (generation, shape, page size) below, a config of a small ``bq`` and one of 128 or
more (the heuristic's size) are probed (``rpa_tune.estimator.compose``), and two prefill
workloads are compiled whole with the static profiler on (one chunk of 256 queries after
1024 cached tokens, one of 128 after 2048): the composed cycles against the whole
compile's. The new K/V operand is placed in VMEM in every program (as the estimator does
on v5p; on v5e and v6e XLA puts it there anyway), so both sides price the same program.

    python benchmarks/small_q_check.py [--out benchmarks/results/small_q_check.md]

``rpa_tune.estimator.compose.PREFILL_UNDERPRICED`` holds the worst error seen per bq.
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

LLAMA3_8B, QWEN3_32B_TP4 = ModelShape(32, 8, 128), ModelShape(16, 2, 128)
CASES = [  # generation, model, label, page size, configs (small bq first)
    ("v5e", QWEN3_32B_TP4, "Qwen3-32B TP4", 256, [(32, 512, 16, 512), (256, 512, 16, 256)]),
    ("v5p", LLAMA3_8B, "Llama-3-8B", 128, [(32, 256, 16, 256), (64, 256, 32, 256), (64, 512, 32, 512),
                                           (128, 512, 32, 256)]),
    ("v6e", LLAMA3_8B, "Llama-3-8B", 256, [(32, 512, 32, 512), (64, 512, 64, 512), (256, 512, 64, 256)]),
]
WORKLOADS = [([256], [1280]), ([128], [2176])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="write the Markdown table here")
    args = ap.parse_args()
    kern = get_kernel("rpa-tune")
    lines = ["| gen | shape | page | config | workload | whole compile (cycles) | composed | error |",
             "|---|---|---:|---|---|---:|---:|---:|"]
    for gen, model, label, page, configs in CASES:
        limits = ServingLimits(page_size=page, max_num_tokens=2048, max_num_seqs=128, max_model_len=8192)
        for c in configs:
            bs = BlockSizes(*c)
            pr = compose.probe_config(builder=kern.builder, writes_kv_cache=kern.writes_kv_cache, case="prefill",
                                      bs=bs, tpu=gen, model=dataclasses.asdict(model),
                                      limits=dataclasses.asdict(limits))
            if pr["status"] != "ok":
                lines.append(f"| {gen} | {label} | {page} | {c} | | probes {pr['status']} | | |")
                continue
            m = compose.model_from_json(pr["model"])
            for q, kv in WORKLOADS:
                w = Workload.of_case("prefill", q, kv)
                req = dict(workload=dict(q_lens=q, kv_lens=kv, distribution=list(w.distribution)),
                           block_sizes=list(bs), tpu=gen, model=dataclasses.asdict(model),
                           limits=dataclasses.asdict(limits), case="prefill", place_new_kv=True)
                t0 = time.time()
                r = profiler.profile(kern.builder, req, timeout=1800, rss_cap=8 << 30, bundles=False)
                name = f"{q[0]} after {kv[0] - q[0]}"
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
