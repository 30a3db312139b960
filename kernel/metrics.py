"""Work counted per workload, roofline bounds, and the paper's MBU / MFU.

Definitions (RPA paper, section 4):

* bytes moved by one call: every sequence reads its ``kv_len`` tokens of merged K+V for
  all KV heads (``2 * Hkv * D * kv_bytes`` per token), writes its ``q_len`` new tokens
  into the cache, reads Q and writes O (``2 * Hq * D * q_bytes`` per query token). For
  decode with equal context lengths this is exactly the paper's
  ``n * dk * [(ctx + 1) * 2 * hkv + 2 * hq] * bytes``.
* FLOPs: ``4 * Hq * D`` per (query, visible key) pair (QK^T and PV), counting only the
  causal / sliding-window visible pairs.
* MBU = (bytes / time) / peak HBM bandwidth; MFU = (FLOPs / time) / (peak bf16 FLOP/s x
  max MXU utilisation), where max MXU utilisation = min(1, head_dim / MXU columns)
  (head_dim 128 on a 256-wide MXU: 50%, as in the paper).

Cycles from libtpu's static profiler carry no clock. ``clock_hz`` derives one from JAX's
hardware table: peak bf16 FLOP/s / (2 x num_mxus x mxu_columns^2) (one MAC per MXU cell
per cycle). This is a derived figure, stated as such wherever a time is shown. Caveat:
the table lists 2 MXUs per core for v6e and TPU7x, which gives 3.5 / 4.4 GHz; Google's
own v6e page has said both 2 and 4 MXUs, so absolute times derived from cycles on those
two generations may be optimistic by up to 2x. Rankings within a generation (what the
tuner uses) do not depend on the clock.
"""
from __future__ import annotations

import numpy as np

from .config import Case, round_up
from .hardware import tpu_info
from .workload import ModelShape, Workload

CLOCK_SOURCE = "derived: jax tpu_info peak bf16 FLOP/s / (2 * num_mxus * mxu_columns^2)"


def clock_hz(generation: str) -> float:
    i = tpu_info(generation)
    return i.bf16_ops_per_second / (2 * i.num_mxus * i.mxu_column_size ** 2)


def _seqs(workload: Workload, case: Case | None):
    lo, hi = (0, workload.num_seqs) if case is None else workload.case_range(Case.parse(case))
    return list(zip(workload.q_lens[lo:hi], workload.kv_lens[lo:hi]))


def hbm_bytes(workload: Workload, model: ModelShape, case: Case | None = None) -> int:
    kvb = np.dtype(model.kv_dtype).itemsize
    qb = np.dtype(model.q_dtype).itemsize
    d = model.head_dim
    total = 0
    for q, kv in _seqs(workload, case):
        total += (kv + q) * 2 * model.num_kv_heads * d * kvb   # read all KV, write the new tokens
        total += q * 2 * model.num_q_heads * d * qb             # read Q, write O
    return int(total)


def visible_pairs(q_len: int, kv_len: int, sliding_window: int | None = None) -> int:
    ctx = kv_len - q_len
    t = np.arange(q_len, dtype=np.int64)
    vis = ctx + t + 1
    if sliding_window:
        vis = np.minimum(vis, sliding_window)
    return int(vis.sum())


def flops(workload: Workload, model: ModelShape, case: Case | None = None,
          sliding_window: int | None = None) -> int:
    pairs = sum(visible_pairs(q, kv, sliding_window) for q, kv in _seqs(workload, case))
    return int(4 * model.num_q_heads * model.head_dim * pairs)


def mxu_utilisation_cap(model: ModelShape, generation: str) -> float:
    return min(1.0, round_up(model.head_dim, 128) / tpu_info(generation).mxu_column_size)


def summarize(cycles: float, workload: Workload, model: ModelShape, generation: str,
              case: Case | None = None, sliding_window: int | None = None) -> dict:
    """Time from cycles, the roofline bounds, which bound is active, MBU and MFU."""
    info = tpu_info(generation)
    b = hbm_bytes(workload, model, case)
    f = flops(workload, model, case, sliding_window)
    est_s = cycles / clock_hz(generation)
    mem_s = b / info.mem_bw_bytes_per_second
    peak = info.bf16_ops_per_second * mxu_utilisation_cap(model, generation)
    cmp_s = f / peak
    time_s = max(est_s, mem_s, cmp_s)
    bound = {est_s: "estimate", mem_s: "memory", cmp_s: "compute"}[time_s]
    return dict(cycles=float(cycles), estimate_s=est_s, memory_bound_s=mem_s, compute_bound_s=cmp_s,
                time_s=time_s, active_bound=bound, hbm_bytes=b, flops=f,
                mbu=(b / time_s) / info.mem_bw_bytes_per_second if time_s else 0.0,
                mfu=(f / time_s) / peak if time_s else 0.0, clock_hz=clock_hz(generation),
                clock_source=CLOCK_SOURCE)
