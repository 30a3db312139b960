"""Builders for the profiler child: this project's kernel, lowered for one workload."""
from __future__ import annotations

from kernel.config import BlockSizes, Case
from kernel.workload import ModelShape, ServingLimits, Workload


def lower(*, workload: dict, block_sizes, tpu: str, model: dict, limits: dict, case: str,
          options: dict | None = None):
    """``(Lowered, kernel name prefix)`` of one case of ``kernel`` with ``workload``'s
    metadata visible to the static profiler (``kernel.analysis.lower_for_estimate``)."""
    from kernel import analysis
    w = Workload(tuple(workload["q_lens"]), tuple(workload["kv_lens"]), tuple(workload["distribution"]))
    bs = BlockSizes(*block_sizes)
    case = Case.parse(case)
    lowered = analysis.lower_for_estimate(w, bs, tpu, ModelShape(**model), ServingLimits(**limits), case,
                                          **(options or {}))
    return lowered, f"rpa_{case.value}_{bs.label()}"
