"""What the shipped tables gain over the heuristic, per generation and case.

Per table entry of our kernel: speedup = heuristic's metric / the metric of what the kernel
runs for the key (the entry's block sizes when promoted, else the heuristic's, speedup 1).
Both metrics are the entry's own (one sweep, one workload, one method: the compile
backend's audited estimate, or a device time). Entries without a heuristic metric (the
heuristic failed, e.g. out of VMEM) are counted apart. Per generation x case: keys,
promoted, geometric mean, worst and best speedup. The issue's goal: geomean >= 1.15x,
worst >= 1.00x. Then the coverage of the matrix (``rpa_tune.coverage``) per generation x
shape x case: the keys with a current entry out of the keys the plan expects.

    python benchmarks/table_gains.py [--tables tables] [--out benchmarks/results/table_gains.md]
"""
from __future__ import annotations

import argparse
import math
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kernel import tables as kt  # noqa: E402
from rpa_tune import coverage  # noqa: E402


def speedup(e) -> float | None:
    if e.heuristic_metric is None or not e.metric:
        return None
    return e.heuristic_metric / e.metric if e.promoted else 1.0


def coverage_lines(have: dict) -> list[str]:
    """Per generation x shape of the matrix and case: the current entries (``have``: key ->
    entry tuned for the current kernel source) / keys expected (``coverage.expected_keys``),
    and how many of those are promoted."""
    lines = ["## Coverage of the matrix", "",
             "Keys with an entry tuned for the current kernel source, not on a retired sweep workload / "
             "keys the plan expects "
             "(`rpa_tune.coverage.expected_keys`: every page size and token bucket), and how many of "
             "them are promoted. " + ", ".join(f"{g}: needs a device" for g in coverage.NEEDS_A_DEVICE) + ".", "",
             "| generation | shape | " + " | ".join(coverage.CASES) + " |",
             "|---|---|" + "---|" * len(coverage.CASES)]
    total = [0, 0, 0]        # current entries of estimable keys, estimable keys, keys that need a device
    for g in coverage.ESTIMABLE:
        for s in coverage.SHAPES:
            cells = []
            for c in coverage.CASES:
                keys = coverage.expected_keys(coverage.plan(generations=(g,), shapes=(s,), cases=(c,)))
                got = [have[k] for k in keys if k in have]
                cell = f"{len(got)}/{len(keys)} ({sum(e.promoted for e in got)} promoted)"
                if coverage.needs_a_device(g, c):
                    cell = f"needs a device ({len(got)}/{len(keys)} estimated)"
                    total[2] += len(keys)
                else:
                    total[0] += len(got)
                    total[1] += len(keys)
                cells.append(cell)
            lines.append(f"| {g} | {s.name} | " + " | ".join(cells) + " |")
    lines += ["", f"In all: {total[0]} of the {total[1]} keys an estimate can cover have a current entry; "
                  f"{total[2]} more keys of the estimable generations need a device."]
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tables", type=Path, default=ROOT / "tables")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "table_gains.md")
    a = ap.parse_args()
    from kernel.provenance import kernel_id
    current = kernel_id()
    groups: dict = defaultdict(list)
    stale: dict = defaultdict(int)
    methods = set()
    for p in sorted(a.tables.glob("*.json")):
        for e in kt.Table.read(p).entries:
            if coverage.is_stale(e, current):
                stale[(e.key.generation, e.key.case)] += 1      # an earlier kernel or sweep workload
                continue
            groups[(e.key.generation, e.key.case)].append(e)
            methods.add(e.method)
    lines = ["# Shipped tables against the heuristic", "",
             f"From `{a.tables.relative_to(ROOT) if a.tables.is_relative_to(ROOT) else a.tables}` "
             f"(`benchmarks/table_gains.py`): method {', '.join(sorted(methods))} (the compile backend's audited "
             f"static estimate: not a device time), entries tuned for the current kernel source ({current}), "
             "not on a sweep workload the plan has retired (`rpa_tune.coverage.on_retired_workload`; "
             "entries of an earlier kernel or a retired workload are only counted, in the last column). "
             "Speedup = "
             "heuristic's time / the time of what the kernel runs (1 where the entry is not promoted), both "
             "from the entry's own sweep. Generations and cases whose estimates are refused "
             "(`rpa_tune.coverage.NEEDS_A_DEVICE_CASES`) have no gain here.", "",
             "| generation | case | keys | promoted | geomean | worst | best | heuristic failed | stale entries |",
             "|---|---|---|---|---|---|---|---|---|"]
    order = {g: i for i, g in enumerate(coverage.GENERATIONS)}
    for g, c in sorted(set(groups) | set(stale), key=lambda x: (order.get(x[0], 99), coverage.CASES.index(x[1]))):
        es = groups.get((g, c), [])
        s = [x for x in map(speedup, es) if x is not None]
        failed = sum(1 for e in es if e.heuristic_metric is None and e.promoted)
        x = lambda v: f"{v:.3f}x"
        gains = (x(math.exp(sum(map(math.log, s)) / len(s))), x(min(s)), x(max(s))) if s else ("-",) * 3
        if coverage.needs_a_device(g, c) and all(e.method == "estimate" for e in es):
            gains = ("needs a device: estimates refused", "-", "-")    # rpa_tune.coverage.NEEDS_A_DEVICE_CASES
        lines.append(f"| {g} | {c} | {len(es)} | {sum(e.promoted for e in es)} | " + " | ".join(gains)
                     + f" | {failed} | {stale[(g, c)]} |")
    lines += [""] + coverage_lines({e.key: e for es in groups.values() for e in es})
    a.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
