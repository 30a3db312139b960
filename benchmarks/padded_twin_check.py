"""Head_dim 64 against its 128-lane twin: the probes of a config compiled for both shapes.

The kernel pads head_dim to 128 lanes in its cache layout and its q / new K/V operands
(``kernel.api``), so Llama-3.2-1B (32 q / 8 KV heads, head_dim 64) and Llama-3-8B (32 / 8 /
128) compile the same kernel program but for ``sm_scale``. ``compose.padded_twin`` lets the
narrower shape read the wider one's complete probe record instead of compiling it; this
compiles every probe of each listed config for both shapes (no probe cache) and compares
the static profiler's cycles per probe.

    python benchmarks/padded_twin_check.py [--tpu v6e] [--out FILE.md]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernel.config import BlockSizes  # noqa: E402
from kernel.workload import ModelShape, ServingLimits  # noqa: E402
from rpa_tune.estimator import compose  # noqa: E402

WIDE, NARROW = ModelShape(32, 8, 128), ModelShape(32, 8, 64)
CONFIGS = [  # case, page size, config: v6e page-128 prefill heuristic; a small-q mixed config
    ("prefill", 128, (256, 512, 64, 256)),
    ("mixed", 128, (32, 512, 32, 512)),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tpu", action="append", help="generation (repeatable; default v6e)")
    ap.add_argument("--out", default=None, help="markdown file to write (default: print)")
    a = ap.parse_args(argv)
    lines = ["| gen | case | page | config | probes | same cycles | head_dim 128: cycles (sum) | "
             "head_dim 64: cycles (sum) | audit 128 / 64 |", "|---|---|---:|---|---:|---:|---:|---:|---|"]
    same_all = True
    for tpu in a.tpu or ["v6e"]:
        for case, page, cfg in CONFIGS:
            lim = dataclasses.asdict(ServingLimits(page_size=page, max_num_tokens=2048, max_num_seqs=128,
                                                   max_model_len=8192))
            got = {}
            for m in (WIDE, NARROW):
                t0 = time.monotonic()
                got[m.head_dim] = compose.probe_config(builder=compose.OURS_BUILDER, case=case, bs=BlockSizes(*cfg), tpu=tpu,
                                                       model=dataclasses.asdict(m), limits=lim, use_cache=False,
                                                       timeout=3600)
                print(f"{tpu} {case} {cfg} head_dim {m.head_dim}: {got[m.head_dim]['status']} "
                      f"({time.monotonic() - t0:.0f} s)", flush=True)
            w, n = got[128], got[64]
            if w["status"] != "ok" or n["status"] != "ok":
                lines.append(f"| {tpu} | {case} | {page} | {cfg} | - | - | {w['status']} | {n['status']} | |")
                same_all = False
                continue
            cw, cn = [p["cycles"] for p in w["probes"]], [p["cycles"] for p in n["probes"]]
            same = sum(x == y for x, y in zip(cw, cn))
            same_all &= same == len(cw) == len(cn)
            lines.append(f"| {tpu} | {case} | {page} | {cfg} | {len(cw)} | {same} | {sum(cw):,} | {sum(cn):,} | "
                         f"{w['audit']} / {n['audit']} |")
    text = ("Static-profiler cycles (libtpu's estimate, not a device time), every probe of each config "
            "compiled for both shapes, no probe cache.\n\n" + "\n".join(lines) + "\n")
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(text)
    return 0 if same_all else 1


if __name__ == "__main__":
    sys.exit(main())
