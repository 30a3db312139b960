"""Analytic VMEM pre-filter: reject configs the compiler would reject, before compiling.

The formula is the kernel's (``kernel.vmem.scratch_bytes``: its scratch buffers with
Mosaic tile padding and one compute step's f32 tiles). The rule is the tuner's:

    reject  <=>  predicted scratch bytes > SLACK x VMEM capacity per core

Why capacity and not half of it: measured with libtpu 0.0.50.1 on this kernel, the
compiler accepts any ``vmem_limit_bytes`` up to the chip's capacity and fails with "Ran
out of memory in memory space vmem" only when the kernel's own scoped use exceeds the
capacity (the evaluators raise the limit up to the capacity when a scoped-limit OOM
says more is needed). Why a slack above 1: the formula is not a strict lower bound of
the compiler's scoped use (it also counts f32 tiles the compiler may keep in vregs;
measured up to a few percent above the compiler's figure), so rejecting exactly at the
capacity could reject a config that compiles. ``benchmarks/vmem_prefilter.py``
measures the false-reject and false-accept rates against the compiler.
"""
from __future__ import annotations

from kernel.config import BlockSizes, cdiv, kv_packing
from kernel.workload import ModelShape, ServingLimits

SLACK = 1.10


def predicted_bytes(model: ModelShape, limits: ServingLimits, bs: BlockSizes, case=None) -> int:
    """``case`` None: a prefill / mixed kernel's (decode with bq 1 has the same bytes)."""
    from kernel.config import Case
    from kernel.vmem import scratch_bytes
    pk = kv_packing(model.kv_dtype)
    return int(scratch_bytes(BlockSizes.coerce(bs), num_kv_heads=model.num_kv_heads, group=model.group,
                             head_dim=model.head_dim, page_size=limits.page_size,
                             kv_rows=cdiv(2 * model.num_kv_heads, pk), kv_pack=pk,
                             q_dtype=model.q_dtype, kv_dtype=model.kv_dtype,
                             decode=case is not None and Case.parse(case) == Case.DECODE))


def capacity(generation: str) -> int:
    from kernel.hardware import tpu_info
    return int(tpu_info(generation).vmem_capacity_bytes)


def rejects(predicted: int, generation: str, slack: float = SLACK) -> bool:
    """True when the config cannot fit under any scoped limit the compiler accepts."""
    return predicted > slack * capacity(generation)


def compiler_verdict(model: ModelShape, limits: ServingLimits, generation: str, case, bs: BlockSizes,
                     vmem_limit_bytes: int | None = None) -> dict:
    """Compile one case's kernel deviceless (no profiler, in this process) and return
    ``{"status": "ok" | "vmem_oom" | "compile_error", "vmem": parsed OOM or None, "seconds"}``.
    ``vmem_limit_bytes`` defaults to the chip's capacity: the most permissive limit, so a
    ``vmem_oom`` here means no limit makes the config fit."""
    import time
    from kernel.analysis import lower_deviceless, parse_vmem_oom
    from kernel.config import Case
    case = Case.parse(case)
    limit = capacity(generation) if vmem_limit_bytes is None else int(vmem_limit_bytes)
    t0 = time.perf_counter()
    try:
        # the other cases pad as in an estimate (rpa_tune.estimator.ours): the heuristic's sizes
        lowered = lower_deviceless(model, limits, generation, {case: tuple(bs)}, cases=(case.value,),
                                   vmem_limit_bytes=limit, heuristic_only=True)
        lowered.compile()
    except Exception as e:  # noqa: BLE001 - the verdict is the point
        msg = str(e)
        oom = parse_vmem_oom(msg)
        return {"status": "vmem_oom" if oom else "compile_error", "vmem": oom, "message": msg[-1000:],
                "seconds": time.perf_counter() - t0}
    return {"status": "ok", "vmem": None, "seconds": time.perf_counter() - t0}
