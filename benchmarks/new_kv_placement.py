"""Does the estimator's new-K/V placement (``rpa_tune.estimator.ours.places_new_kv``) change
any estimate recorded before it? Seeded sample of recorded configs of one generation.

For each sampled (shape, case, config) of the results store whose estimate places the
operand, the config's largest probe (``rpa_tune.estimator.compose.probes``, at the token
bucket the probes are compiled at) is profiled twice: as the estimate lowers it now, and
with the operand where XLA puts it (``place_new_kv=False``, how every recorded estimate
was made). The static profiler's cycles are compared (estimates, not device times); a
config XLA's placement cannot estimate (the v5p decode programs of 2+ KV heads) is the
case the placement fixes.

    python benchmarks/new_kv_placement.py --tpu v5p --per-case 4 [--seed 3] [--out FILE]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def sample(results: str, tpu: str, per_case: int, seed: int):
    """``per_case`` recorded ok configs per case whose estimate places the operand."""
    from kernel.workload import ModelShape
    from rpa_tune.estimator.ours import places_new_kv
    from rpa_tune.store import ResultStore
    df = ResultStore(results).read_current()
    df = df[(df.generation == tpu) & (df.status == "ok")]
    cols = ["case", "num_q_heads", "num_kv_heads", "head_dim", "kv_dtype", "page_size", "bq", "bkv", "cq", "ckv"]
    out = []
    for case, g in df[cols].drop_duplicates().groupby("case"):
        shape = lambda r: ModelShape(int(r.num_q_heads), int(r.num_kv_heads), int(r.head_dim), kv_dtype=r.kv_dtype)
        g = g[[places_new_kv(tpu, case, shape(r)) for r in g.itertuples()]]
        out += [(case, shape(r), int(r.page_size), (int(r.bq), int(r.bkv), int(r.cq), int(r.ckv)))
                for r in g.sample(min(per_case, len(g)), random_state=seed).itertuples()]
    return out


def check(tpu: str, case: str, model, page_size: int, bs) -> dict:
    from kernel.config import BlockSizes
    from rpa_tune.estimator import compose, profiler
    plist = compose.probes(case, BlockSizes(*bs), page_size)
    p = max(plist, key=lambda p: (sum(p.q_lens), sum(p.kv_lens)))
    w = p.workload(case)
    req = dict(workload=dict(q_lens=list(w.q_lens), kv_lens=list(w.kv_lens), distribution=list(w.distribution)),
               block_sizes=list(bs), tpu=tpu, model=dataclasses.asdict(model), case=case,
               limits=dict(page_size=page_size, max_num_tokens=compose.probe_tokens(plist), max_num_seqs=128,
                           max_model_len=max(8192, max(w.kv_lens))))
    placed = profiler.profile(compose.OURS_BUILDER, req, timeout=900)
    xla = profiler.profile(compose.OURS_BUILDER, dict(req, place_new_kv=False), timeout=900)
    return dict(probe=f"{len(w.q_lens)} seqs, {sum(w.q_lens)} q / {sum(w.kv_lens)} kv tokens",
                placed=placed.get("cycles") if placed["status"] == "ok" else placed["status"],
                xla=xla.get("cycles") if xla["status"] == "ok" else xla["status"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tpu", default="v5p")
    ap.add_argument("--results", default=os.path.join(ROOT, "tables", "results"))
    ap.add_argument("--per-case", type=int, default=4)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "new_kv_placement.md"))
    a = ap.parse_args()
    rows = []
    for case, model, page, bs in sample(a.results, a.tpu, a.per_case, a.seed):
        r = check(a.tpu, case, model, page, bs)
        same = ("yes" if r["placed"] == r["xla"] else "XLA's: no estimate" if not isinstance(r["xla"], int)
                else "**no**")
        rows.append(f"| {case} | {model.num_q_heads}/{model.num_kv_heads}/{model.head_dim} | {page} | {bs} | "
                    f"{r['probe']} | {r['placed']} | {r['xla']} | {same} |")
        print(rows[-1], flush=True)
    text = "\n".join([
        f"# New-K/V placement against XLA's, {a.tpu} (static-profiler estimates, cycles)", "",
        f"`python benchmarks/new_kv_placement.py --tpu {a.tpu} --per-case {a.per_case} --seed {a.seed}`: "
        "recorded configs whose estimate now places the new K/V operand in VMEM, each config's largest "
        "probe profiled with the placement and with XLA's (how the estimates recorded before it were made; 'no "
        "estimate': the configs it fixes).", "",
        "| case | q/kv heads/head_dim | page | config | probe | placed | XLA's | same |",
        "|---|---|---|---|---|---|---|---|", *rows, ""])
    with open(a.out, "w") as f:
        f.write(text)
    return 0 if all("**no**" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
