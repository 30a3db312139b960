"""Work counted per workload, roofline bounds, and the paper's MBU / MFU.

Definitions (RPA paper, section 4):

* bytes moved by one call: every sequence reads its ``kv_len`` tokens (with a sliding
  window, the ones its queries see) of merged K+V for all KV heads
  (``2 * Hkv * D * kv_bytes`` per token), writes its ``q_len`` new tokens into the cache,
  reads Q and writes O (``2 * Hq * D * q_bytes`` per query token). For decode with equal
  context lengths this is exactly the paper's
  ``n * dk * [(ctx + 1) * 2 * hkv + 2 * hq] * bytes``.
* FLOPs: ``4 * Hq * D`` per (query, visible key) pair (QK^T and PV), counting only the
  causal / sliding-window visible pairs.
* MBU = (bytes / time) / peak HBM bandwidth. MFU, as the paper defines it (section
  4.2.1), = (FLOPs / time) / (peak bf16 FLOP/s x the largest MXU utilisation the
  head_dim allows, min(1, head_dim / MXU width)): 50 % of the plain peak for head_dim 128
  on 256-wide MXUs, which is how the paper can report an MFU of 73 %. This module only counts the work;
  ``rpa_tune.estimator.audit.time_model`` reports both that MFU and the plain-peak one.

Turning profiler cycles into a time (the calibrated clock, the roofline and the audit)
is the estimator's job: ``rpa_tune.estimator.audit.time_model``.
"""
from __future__ import annotations

import numpy as np

from .config import Case
from .workload import ModelShape, Workload


def _seqs(workload: Workload, case: Case | None):
    lo, hi = (0, workload.num_seqs) if case is None else workload.case_range(Case.parse(case))
    return list(zip(workload.q_lens[lo:hi], workload.kv_lens[lo:hi]))


def hbm_bytes(workload: Workload, model: ModelShape, case: Case | None = None,
              sliding_window: int | None = None) -> int:
    """Bytes moved (module doc). With a sliding window a sequence reads only the keys some
    query of it sees, the last ``min(kv_len, q_len + window - 1)`` tokens."""
    kvb = np.dtype(model.kv_dtype).itemsize
    qb = np.dtype(model.q_dtype).itemsize
    d = model.head_dim
    total = 0
    for q, kv in _seqs(workload, case):
        read = min(kv, q + sliding_window - 1) if sliding_window else kv
        total += (read + q) * 2 * model.num_kv_heads * d * kvb  # read the visible KV, write the new tokens
        total += q * 2 * model.num_q_heads * d * qb              # read Q, write O
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
