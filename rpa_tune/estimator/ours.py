"""Builders for the profiler child: this project's kernel, lowered for one workload.

On v5p the new tokens' K/V operand is placed in VMEM (``PLACE_NEW_KV``). The
kernel's KV-cache update copies the new rows from that operand into the cache pages, and
libtpu's static profiler marks a copy between two HBM buffers *remote*: on v5e, v5p and
v6e a kernel with one gets 0 estimated cycles (``NO_HBM_TO_HBM_PRICE``; a one-DMA Pallas
kernel, HBM -> HBM: 0 cycles and DMA_INSTRUCTION_TYPE_REMOTE, on TPU7x 620 cycles, local).
Where the operand goes is XLA's choice, and XLA put it in VMEM in every program estimated
so far: on v5e and v6e, and on v5p for one KV head. On v5p with two or more KV heads its
decode programs made the operand with an unfused pad, in HBM, so every config crashed
("no estimate"). Placed in VMEM they are estimated; v5p programs with one KV head get the
same cycles (12 of 12 sampled probes of recorded configs, and ``tests/test_estimator.py``).
v5e and v6e keep XLA's placement: the explicit one moved the q operand out of VMEM in a
v5p prefill program of 8 KV heads (43,830 -> 42,292 cycles), and their recorded estimates
would no longer compare with new ones. Serving keeps the operand in HBM, so the estimates
of every generation but TPU7x price the cache update as a VMEM -> HBM write and the new
rows' reads as VMEM -> VMEM copies (``docs/estimator.md``).
"""
from __future__ import annotations

import contextlib

from kernel.config import BlockSizes, Case
from kernel.workload import ModelShape, ServingLimits, Workload

# Generations whose static profiler gives a kernel with an HBM -> HBM DMA 0 cycles
# (tests/test_estimator.py, on a one-DMA kernel; TPU7x the control). v4's profiler
# aborts on our programs whatever the placement ("Dma latency model is currently only
# supported on VF/VL/GF/GL", on the XLA ops before the kernel).
NO_HBM_TO_HBM_PRICE = frozenset({"v5e", "v5p", "v6e"})
# Generations whose estimates place the new K/V operand in VMEM (module doc).
PLACE_NEW_KV = frozenset({"v5p"})
# ... and the largest new-K/V operand placed, as a fraction of the VMEM:
# a larger one is left to XLA (in HBM it cannot be estimated; forced into VMEM beside the
# kernel's own buffers it could fail the compile as if the config did not fit).
NEW_KV_VMEM_FRACTION = 0.25


def lower(*, workload: dict, block_sizes, tpu: str, model: dict, limits: dict, case: str,
          options: dict | None = None):
    """``(Lowered, kernel name prefix)`` of one case of ``kernel`` with ``workload``'s
    metadata visible to the static profiler (``kernel.analysis.lower_for_estimate``), the
    new K/V operand in VMEM on the generations of ``PLACE_NEW_KV`` (module doc)."""
    from kernel import analysis
    from kernel.config import get_generation
    from kernel.hardware import tpu_info
    w = Workload(tuple(workload["q_lens"]), tuple(workload["kv_lens"]), tuple(workload["distribution"]))
    bs = BlockSizes(*block_sizes)
    case = Case.parse(case)
    gen = get_generation(tpu).name
    placement = (new_kv_in_vmem(int(tpu_info(gen).vmem_capacity_bytes * NEW_KV_VMEM_FRACTION))
                 if gen in PLACE_NEW_KV else contextlib.nullcontext())
    with placement:
        lowered = analysis.lower_for_estimate(w, bs, tpu, ModelShape(**model), ServingLimits(**limits), case,
                                              **(options or {}))
    return lowered, f"rpa_{case.value}_{bs.label()}"


@contextlib.contextmanager
def new_kv_in_vmem(max_bytes: int):
    """While lowering: the case kernels' new K/V operand (``kernel.api.run_cases``' second
    argument) constrained to VMEM when it is at most ``max_bytes``. JAX's caches are
    cleared on entry and exit, so no trace made outside (or inside) leaks across."""
    import jax
    from jax.experimental.pallas import tpu as pltpu
    from kernel import api
    run = api.run_cases

    def run_cases(q, newkv, *args, **kwargs):
        if newkv.size * newkv.dtype.itemsize <= max_bytes:
            newkv = pltpu.with_memory_space_constraint(newkv, pltpu.VMEM)
        return run(q, newkv, *args, **kwargs)

    jax.clear_caches()
    api.run_cases = run_cases
    try:
        yield
    finally:
        api.run_cases = run
        jax.clear_caches()
