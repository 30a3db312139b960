"""Fake evaluators injected into rpa-tune workers by tests (``RPA_TUNE_EVALUATOR_OVERRIDE``).

``RPA_TUNE_FAKE_BEHAVIOUR`` maps config labels to what happens when they are evaluated,
``label=action;label=action``, action one of ``crash`` (the worker aborts: SIGABRT),
``exit`` (the worker exits with code 3), ``hang`` (sleeps forever), ``block`` (sleeps with
SIGTERM blocked in the main thread, as a long native compile keeps Python's handler from
running), ``oom`` (a VMEM OOM
verdict), ``raise`` (the evaluator raises). ``RPA_TUNE_FAKE_DELAY`` seconds are spent
on every evaluation. The metric is a deterministic function of the block sizes whose
minimum is at ``bkv = 1024, ckv = 256`` (``bq = 64, cq = 16`` for prefill / mixed).
``RPA_TUNE_FAKE_LOG``: a file to which every evaluated label is appended (one line each).
"""
from __future__ import annotations

import math
import os
import signal
import time

from rpa_tune.evaluators.base import OK, VMEM_OOM, EvalResult, Evaluator


def fake_metric(bs) -> float:
    m = 1.0 + abs(math.log2(bs.bkv / 1024)) + 0.5 * abs(math.log2(bs.ckv / 256))
    if bs.bq > 1:
        m += 0.3 * abs(math.log2(bs.bq / 64)) + 0.2 * abs(math.log2(bs.cq / 16))
    return m * 1e-4


class FakeEvaluator(Evaluator):
    name = "fake"
    method = "estimate"
    version = "1"

    def evaluate(self, task):
        label = task.bs.label()
        log = os.environ.get("RPA_TUNE_FAKE_LOG")
        if log:
            with open(log, "a") as f:
                f.write(label + "\n")
        actions = dict(item.split("=", 1) for item in os.environ.get("RPA_TUNE_FAKE_BEHAVIOUR", "").split(";")
                       if "=" in item)
        time.sleep(float(os.environ.get("RPA_TUNE_FAKE_DELAY", "0")))
        action = actions.get(label, actions.get("*"))   # '*': every other config
        if action == "crash":
            os.abort()
        if action == "exit":
            os._exit(3)
        if action == "hang":
            time.sleep(10_000)
        if action == "block":
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
            time.sleep(10_000)
        if action == "raise":
            raise RuntimeError("fake evaluator failure")
        if action == "oom":
            return EvalResult(VMEM_OOM, self.method, vmem_reported_bytes=123 << 20, vmem_limit_bytes=64 << 20,
                              message="fake scoped OOM")
        m = fake_metric(task.bs)
        return EvalResult(OK, self.method, metric=m, cycles=m * 1e9, estimate_s=m, active_bound="estimate",
                          samples=1, compile_s=0.01, vmem_limit_bytes=16 << 20, audit="complete",
                          clock_hz=1.5e9, clock_source="fake clock",
                          message=f"fake estimate (sliding_window={task.sliding_window})"
                          + (f" soft_cap={task.soft_cap:g}" if task.soft_cap is not None else ""))


def make_evaluator(backend):
    return FakeEvaluator()


make_evaluator_v2 = make_evaluator      # the same evaluator under another version (the override string)


# ------------------------------------------------------------------ profiler-child builders
def disk_full_builder(**_):
    """Fails the way libtpu does when the disk is full while it writes its profile."""
    import sys
    sys.stderr.write("F bundle_analysis.cc:157] Check failed: WriteTextProto(...) is OK "
                     "(RESOURCE_EXHAUSTED: fclose: No space left on device\n")
    sys.stderr.flush()
    os._exit(1)


def sleeping_builder(**_):
    """Compiles for a long time (a minute), as a large probe does."""
    import time
    time.sleep(60)
    os._exit(0)


def reporting_sleeper_builder(**_):
    """Writes its pid and libtpu log folder (inside the folder its parent gave it) to the
    file ``RPA_TEST_PID_FILE`` names, then compiles for a long time (two minutes)."""
    import json
    import time
    path = os.environ["RPA_TEST_PID_FILE"]
    with open(path + ".tmp", "w") as f:
        json.dump({"pid": os.getpid(), "tpu_log_dir": os.environ.get("TPU_LOG_DIR")}, f)
    os.replace(path + ".tmp", path)
    time.sleep(120)
    os._exit(0)


def env_report_builder(**_):
    """Reports where the child's libtpu logs would go, then exits like a finished child."""
    import json
    print(json.dumps({"status": "ok", "tpu_log_dir": os.environ.get("TPU_LOG_DIR")}), flush=True)
    os._exit(0)


class _NothingToCompile:
    def compile(self):
        return None


def no_kernel_builder(**_):
    """Lowers nothing: the child's compile makes no kernel, so no profile, and it reports
    as usual (with the kernel source hash it saw)."""
    return _NothingToCompile(), "no_such_kernel"


class _RejectedByTheCompiler:
    def compile(self):
        raise RuntimeError("INVALID_ARGUMENT: a compiler verdict on the config")


def compile_error_builder(**_):
    """A program the compiler rejects (a verdict: the child that compiled it stays usable)."""
    return _RejectedByTheCompiler(), "rpa_"


def hbm_to_hbm_copy_builder(*, tpu: str):
    """A Pallas kernel that is one DMA from one HBM buffer to another (rows 2-4 of its
    input into page 7 of its output), lowered for ``tpu``."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu
    from kernel.analysis import _sharding

    def kernel(src, dst, sem):
        copy = pltpu.make_async_copy(src.at[pl.ds(2, 3)], dst.at[7, pl.ds(5, 3)], sem.at[0])
        copy.start()
        copy.wait()

    call = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((64, 128, 2, 2, 128), jnp.bfloat16),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)], out_specs=pl.BlockSpec(memory_space=pl.ANY),
        scratch_shapes=[pltpu.SemaphoreType.DMA((1,))], name="hbm_to_hbm_copy")
    arg = jax.ShapeDtypeStruct((16, 2, 2, 128), jnp.bfloat16, sharding=_sharding(tpu))
    return jax.jit(call).lower(arg), "hbm_to_hbm_copy"

