"""A config's cost for any workload, from a few small probe compiles.

libtpu's static profiler simulates what it compiles, so its time and memory grow with the
workload (a full 128 x 2K decode on v6e: 56 s and 3.9 GB; prefill chunks more). The kernel's
cost is, up to pipeline fill at the ends, a sum over what it walks: a fixed cost per call,
per sequence, per q block, per KV step (from the cache or from the new tokens), per page
DMA and per ``ckv`` chunk computed (``kernel.steps.features``). So per config we compile a
handful of small *probe* workloads, each a real program of the kernel (the same code path
as serving: one pipeline across all sequences), fit those per-item costs by least squares
(the probes are chosen so that their differences isolate each item: pipeline fill cancels
in the differences), and price any workload by counting its items. The same probes price
every workload and token bucket of a key. ``benchmarks/README.md`` has the check against
full compiles.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from kernel.config import BlockSizes, Case
from kernel.steps import FEATURES, features
from kernel.workload import Workload


@dataclasses.dataclass(frozen=True)
class Probe:
    q_lens: tuple
    kv_lens: tuple

    def workload(self, case: Case) -> Workload:
        return Workload.of_case(case, list(self.q_lens), list(self.kv_lens))


def probes(case: Case | str, bs: BlockSizes, page_size: int) -> list[Probe]:
    """The probe workloads of one config (small: at most three sequences, two q blocks)."""
    case = Case.parse(case)
    bq, bkv, _, ckv = bs
    P = page_size
    if case == Case.DECODE:
        part = ckv if ckv < bkv else max(P, (bkv // 2) // P * P)
        shapes = [(1, bkv), (2, bkv), (2, 2 * bkv), (2, bkv + P), (2, bkv + part), (3, 2 * bkv)]
        return [Probe((1,) * n, (ctx + 1,) * n) for n, ctx in shapes]
    one = [(bq, bq)]
    return [Probe(*zip(*s)) for s in (
        one, [(bq, bq + bkv)], [(bq, bq + 2 * bkv)], [(2 * bq, 2 * bq)], one * 2, [(bq, bq + P)],
        [(bq, bq + bkv + P)])]


def design(case: Case | str, bs: BlockSizes, page_size: int, workloads, sliding_window=None) -> np.ndarray:
    case = Case.parse(case)
    rows = []
    for w in workloads:
        lo, hi = w.case_range(case)
        f = features(case, bs, page_size, w.q_lens[lo:hi], w.kv_lens[lo:hi], sliding_window)
        rows.append([f[k] for k in FEATURES])
    return np.asarray(rows, dtype=np.float64)


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Cycles = sum of per-item costs x item counts (``kernel.steps.FEATURES``)."""

    case: str
    block_sizes: tuple
    page_size: int
    coef: tuple                 # cycles per item, FEATURES order
    probe_cycles: tuple
    probe_fit_error: float      # largest relative residual of a probe
    sliding_window: int | None = None

    def cycles(self, workload: Workload) -> float:
        x = design(self.case, BlockSizes(*self.block_sizes), self.page_size, [workload], self.sliding_window)[0]
        return float(x @ np.asarray(self.coef))

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def fit(case: Case | str, bs: BlockSizes, page_size: int, probe_list: list[Probe], cycles: list[float],
        sliding_window=None) -> CostModel:
    """Least-squares per-item costs from the probes' cycles. Items that never vary across
    the probes (always collinear with another, e.g. decode's q blocks with its sequences)
    get the minimum-norm share, which prices workloads of the same structure exactly."""
    case = Case.parse(case)
    X = design(case, bs, page_size, [p.workload(case) for p in probe_list], sliding_window)
    y = np.asarray(cycles, dtype=np.float64)
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    resid = np.abs(X @ coef - y) / y
    return CostModel(case.value, tuple(bs), page_size, tuple(float(c) for c in coef),
                     tuple(float(c) for c in y), float(resid.max()), sliding_window)
