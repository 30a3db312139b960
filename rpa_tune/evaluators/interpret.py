"""``interpret`` backend: correctness of one config, Pallas TPU interpreter vs the reference.

The problem is the task's attention shape and page size with a small seeded workload
built around the block sizes, so that every config walks more than one KV fetch block,
ends on a partial compute chunk and (prefill / mixed) spans more than one q block:

* decode: KV lengths ``[1, bkv + ckv // 2 + 3, max(1, ckv - 5)]``;
* prefill: ``q = bq + max(1, cq // 2)`` after ``bkv + ckv // 2 + 3`` tokens of context, and
  a short chunk ``max(1, cq - 1)`` without context;
* mixed: ``q = [1, cq + 1, bq + 1]`` with contexts ``[bkv + 5, ckv // 2, bkv // 2 + 1]``.

The output must match ``kernel.reference`` (``atol = rtol = 2e-2``, 3e-2 with an fp8
cache) on every valid token, and the updated KV cache must equal the reference update
bit for bit. Anything else is ``wrong_result``.

Test-only hook: ``RPA_TUNE_TEST_CORRUPT=<label>`` (a ``BlockSizes.label()`` such as
``bq1_bkv256_cq1_ckv128``, or ``*``) adds 1.0 to the kernel's output for that config
before the comparison, to exercise ``wrong_result`` end to end without breaking the kernel.
"""
from __future__ import annotations

import os
import time

import numpy as np

from kernel.config import Case, round_up
from kernel.workload import ServingLimits, Workload

from . import base
from .base import EvalResult, Evaluator, Task

CORRUPT_ENV = "RPA_TUNE_TEST_CORRUPT"
# Measured (jax 0.12.0.1): its DMAs reshape refs, which the interpreter cannot follow
# ("'ReshapeTransform' object has no attribute 'indices'").
INTERPRET_UNSUPPORTED = ("the {} kernel does not run in the Pallas TPU interpreter (its DMAs use ref reshapes "
                         "the interpreter does not support); check it with --backend tpu on a TPU")


def interpret_problem(task: Task) -> tuple[ServingLimits, Workload]:
    bq, bkv, cq, ckv = task.bs
    ps = task.limits.page_size
    case = Case.parse(task.case)
    if case == Case.DECODE:
        q = [1, 1, 1]
        kv = [1, bkv + ckv // 2 + 3, max(1, ckv - 5)]
    elif case == Case.PREFILL:
        q1, q2 = bq + max(1, cq // 2), max(1, cq - 1)
        q, kv = [q1, q2], [bkv + ckv // 2 + 3 + q1, q2]
    else:
        q = [1, cq + 1, bq + 1]
        kv = [bkv + 5 + 1, ckv // 2 + cq + 1, bkv // 2 + 1 + bq + 1]
    w = Workload.of_case(case, q, kv)
    limits = ServingLimits(page_size=ps, max_num_tokens=round_up(max(sum(q), bq), 8),
                           max_num_seqs=len(q) + 1, max_model_len=round_up(max(kv), ps))
    return limits, w


def reference_mismatches(out, cache, ref_out, ref_cache, num_tokens: int, kv_dtype) -> list[str]:
    """What differs between a kernel call and the reference: outputs of the first
    ``num_tokens`` rows beyond ``atol = rtol = 2e-2`` (3e-2 for an fp8 cache), non-finite
    outputs, or a KV cache not bit-identical to the reference update. Empty when they
    agree."""
    out, cache = np.asarray(out), np.asarray(cache)
    got, want = out[:num_tokens].astype(np.float32), np.asarray(ref_out)[:num_tokens].astype(np.float32)
    tol = 3e-2 if "float8" in str(kv_dtype) else 2e-2
    problems = []
    if not np.all(np.isfinite(got)):
        problems.append("non-finite outputs")
    else:
        err = np.abs(got - want)
        bad = err > tol + tol * np.abs(want)
        if bad.any():
            problems.append(f"{int(bad.sum())} of {bad.size} outputs off (max abs err {float(err.max()):.3g})")
    ref_cache = np.asarray(ref_cache)
    u8 = lambda a: a.view(np.uint8)
    if cache.shape != ref_cache.shape or not np.array_equal(u8(cache), u8(ref_cache)):
        problems.append("KV cache differs from the reference update")
    return problems


def block_sizes_arg(case) -> str:
    """The ``kernel.ragged_paged_attention`` keyword of a case's block sizes."""
    return {"decode": "d", "prefill": "p", "mixed": "m"}[Case.parse(case).value] + "_block_sizes"


class InterpretEvaluator(Evaluator):
    name = "interpret"
    method = "correctness"
    version = "1"

    def evaluate(self, task: Task) -> EvalResult:
        import jax.numpy as jnp
        import kernel
        from kernel.workload import make_inputs
        from ..kernels import get_kernel

        if not get_kernel(task.kernel).interpretable:
            return EvalResult(base.COMPILE_ERROR, self.method, message=INTERPRET_UNSUPPORTED.format(task.kernel))
        limits, w = interpret_problem(task)
        inp = make_inputs(task.model, limits, w, seed=task.seed)
        sm_scale = task.model.head_dim ** -0.5
        window = task.sliding_window
        ref_out, ref_cache = kernel.reference.ragged_paged_attention(**inp, sm_scale=sm_scale,
                                                                     sliding_window=window,
                                                                     soft_cap=task.soft_cap)
        kw = {block_sizes_arg(task.case): tuple(task.bs)}
        t0 = time.perf_counter()
        try:
            out, cache = kernel.ragged_paged_attention(**{k: jnp.asarray(v) for k, v in inp.items()},
                                                       sm_scale=sm_scale, sliding_window=window,
                                                       soft_cap=task.soft_cap,
                                                       interpret=True, **kw)
            out, cache = np.asarray(out), np.asarray(cache)
        except Exception as e:  # noqa: BLE001 - a config the kernel cannot run
            return EvalResult(base.COMPILE_ERROR, self.method, device_kind="cpu (interpret)",
                              message=f"{type(e).__name__}: {str(e)[-1500:]}")
        run_s = time.perf_counter() - t0
        corrupt = os.environ.get(CORRUPT_ENV)
        if corrupt and corrupt in ("*", task.bs.label()):
            out = (out.astype(np.float32) + 1.0).astype(out.dtype)
        problems = reference_mismatches(out, cache, ref_out, ref_cache, w.num_tokens, task.model.kv_dtype)
        desc = f"workload q={list(w.q_lens)} kv={list(w.kv_lens)}, page {limits.page_size}" + (
            f", sliding window {window}" if window is not None else "")
        if problems:
            return EvalResult(base.WRONG_RESULT, self.method, compile_s=run_s, device_kind="cpu (interpret)",
                              samples=1, message="; ".join(problems) + f" ({desc})")
        return EvalResult(base.OK, self.method, compile_s=run_s, device_kind="cpu (interpret)", samples=1,
                          message=f"matches the reference ({desc})")
