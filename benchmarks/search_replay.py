"""How close does a budgeted search get to the exhaustive best, replayed on swept keys?

Method:

1. The landscapes: every key of ``benchmarks/coverage_check.py`` whose exhaustive grid has
   finished (``benchmarks/results/exhaustive/complete.json``): each config's recorded
   outcome (status, audited estimate) under the newest evaluator version. A grid a newer
   evaluator version is still pricing again is skipped and named (its landscape would lack
   the configs not re-priced yet; ``coverage_check.repriced_in_part``).
2. Each strategy is replayed offline against those outcomes, sequentially (one job), for
   ``--seeds`` seeds: an evaluation is a look-up of the recorded outcome of the asked
   config, exactly what the engine's resume path does. Strategies: TPE with the budgets
   and climbs (``--refine``) of ``STRATEGIES``, the heuristic first and the sweep's default
   patience (10), as ``rpa-tune sweep`` runs them.
3. Per key and strategy: evaluations used (mean, worst), and the gap of the best config
   found to the exhaustive best (median, worst, and how many seeds end within 2 %).

One bucket, no seeds from other buckets: ``tables/generate.sh`` also prices what the key's
other buckets evaluated, so it sees at least as many configs as this replay.

Writes ``benchmarks/results/search_replay.md``.

    python benchmarks/search_replay.py [--seeds 20]
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.coverage_check import repriced_in_part  # noqa: E402
from kernel.config import BlockSizes  # noqa: E402
from rpa_tune import coverage  # noqa: E402
from rpa_tune.search import make_search  # noqa: E402
from rpa_tune.store import ResultStore  # noqa: E402

STRATEGIES = ((12, 0), (24, 0), (12, 32), (8, 32))       # (budget, refine)


def landscape(df, key):
    """The recorded outcomes of one key's grid: {config: (status, metric)} and its heuristic."""
    m = df["backend"] == "compile"
    for c, v in key.as_dict().items():
        m &= df[c] == v
    out, heur = {}, None
    for r in df[m].sort_values("timestamp").itertuples():
        bs = BlockSizes(int(r.bq), int(r.bkv), int(r.cq), int(r.ckv))
        metric = None if r.metric is None or r.metric != r.metric else float(r.metric)
        out[bs] = (r.status, metric)
        if r.is_heuristic:
            heur = bs
    return out, heur


def replay(out, heur, budget: int, refine: int, seed: int) -> tuple[int, float]:
    """Evaluations used and the best metric found by one seeded run."""
    s = make_search("tpe", sorted(out), budget=budget, seed=seed, first=heur, patience=10, refine=refine)
    best, n = math.inf, 0
    while n < budget + refine and not s.should_stop():
        bs = s.ask()
        if bs is None:
            break
        status, metric = out[bs]
        s.tell(bs, status, metric)
        n += 1
        if metric is not None:
            best = min(best, metric)
    return n, best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results" / "exhaustive")
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "search_replay.md")
    a = ap.parse_args()
    complete = json.loads((a.results / "complete.json").read_text())
    df = ResultStore(a.results).read_current()
    lines = ["# Budgeted search replayed on exhaustively swept keys (compile backend, audited estimates)", "",
             f"`benchmarks/search_replay.py`, {a.seeds} seeds per strategy; TPE with the heuristic first and "
             "patience 10; gap = best found / exhaustive best - 1.", "",
             "| key | configs | strategy (budget + refine) | evaluations mean / worst | gap median | gap worst "
             "| seeds within 2 % |", "|---|---|---|---|---|---|---|"]
    keys = {k.id(): k for k in coverage.expected_keys()}
    partial = repriced_in_part(a.results, [keys[k] for k in complete])
    for key_id in complete:
        if key_id in partial:
            continue
        out, heur = landscape(df, keys[key_id])
        ok = [m for s, m in out.values() if m is not None]
        if not ok:
            continue
        exhaustive = min(ok)
        for budget, refine in STRATEGIES:
            runs = [replay(out, heur, budget, refine, seed) for seed in range(a.seeds)]
            gaps = [b / exhaustive - 1 for _, b in runs]
            ns = [n for n, _ in runs]
            lines.append(f"| {key_id} | {len(out)} | {budget} + {refine} | {statistics.mean(ns):.1f} / {max(ns)} | "
                         f"{statistics.median(gaps):+.1%} | {max(gaps):+.1%} | "
                         f"{sum(g <= 0.02 for g in gaps)} / {a.seeds} |")
    if partial:
        lines += ["", "Skipped, being priced again by a newer evaluator version: " + ", ".join(sorted(partial))]
    a.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
