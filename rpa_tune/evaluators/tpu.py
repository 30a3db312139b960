"""``tpu`` backend: time one config on a real TPU.

Per config: build the workload's inputs (``kernel.workload.make_inputs``, seeded) on the
device; jit ``kernel.ragged_paged_attention`` with the case's block sizes and an explicit
``vmem_limit_bytes`` (same policy as the compile backend: the kernel's default, raised
to the compiler's reported need after a scoped-limit OOM); compile once (compile time
recorded); warm up; then time calls, each blocked on its result. The KV cache argument
is donated, so every call is fed the cache the previous call returned. Before timing, the
first call's output and updated cache are compared with ``kernel.reference`` (same rule as
the interpret backend); a mismatch is ``wrong_result``.

Host wall-clock per call is used when the median call takes at least
``DEVICE_TIME_BELOW_S`` (1 ms); shorter calls are dominated by dispatch overhead, so the
kernel's device time is read from a profiler trace (``jax.profiler.trace``; the
``XLA Ops`` events of the kernel's custom call on the TPU plane). The row reports the
median, the relative spread (IQR / median) and the number of samples.

Only one process can own a TPU, so the engine runs this backend with one worker.

tpu-inference's RPA v3 (task kernel ``tpu-inference``) is timed the same way, called with
the same arguments (its KV layout is ours), its scoped VMEM limit its own default (all of
VMEM), and checked against the same reference. Its device events are those named like its
pallas_call for the case (``RPA<d|p|m>-p_<page>-bq_<bq>_<cq>-bkv_...``, from its source; not
checked without a TPU: if none match, the wall-clock is kept and the row says so).
"""
from __future__ import annotations

import dataclasses
import functools
import glob
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from kernel.config import get_generation

from . import base
from .base import EvalResult, Evaluator, Task

DEVICE_TIME_BELOW_S = 1e-3
WARMUP = 3
MIN_ITERS, MAX_ITERS, TARGET_TIMING_S = 20, 1000, 1.0


# ------------------------------------------------------------------ statistics
@dataclasses.dataclass(frozen=True)
class TimingStats:
    median: float
    mean: float
    p10: float
    p90: float
    q25: float
    q75: float
    samples: int

    @property
    def spread(self) -> float:
        """Interquartile range relative to the median."""
        return (self.q75 - self.q25) / self.median if self.median > 0 else math.inf


def summarize_times(times) -> TimingStats:
    t = np.asarray(list(times), np.float64)
    if t.size == 0:
        raise ValueError("no timing samples")
    if np.any(t < 0) or not np.all(np.isfinite(t)):
        raise ValueError("timing samples must be finite and non-negative")
    q = np.percentile(t, [10, 25, 50, 75, 90])
    return TimingStats(median=float(q[2]), mean=float(t.mean()), p10=float(q[0]), p90=float(q[4]),
                       q25=float(q[1]), q75=float(q[3]), samples=int(t.size))


def iterations_for(first_call_s: float, *, target_s: float = TARGET_TIMING_S,
                   lo: int = MIN_ITERS, hi: int = MAX_ITERS) -> int:
    """How many timed calls fill about ``target_s`` (between ``lo`` and ``hi``)."""
    if first_call_s <= 0:
        return hi
    return int(min(hi, max(lo, math.ceil(target_s / first_call_s - 1e-9))))


def time_calls(step, *, warmup: int = WARMUP, iters: int | None = None, timer=time.perf_counter) -> list[float]:
    """Run ``step()`` (one call that blocks on its result) ``warmup`` times untimed, then
    time ``iters`` calls (chosen from the first timed call when None). Seconds per call."""
    for _ in range(warmup):
        step()
    t0 = timer()
    step()
    first = timer() - t0
    n = iterations_for(first) if iters is None else iters
    times = [first]
    for _ in range(n - 1):
        t0 = timer()
        step()
        times.append(timer() - t0)
    return times


def device_times_from_profile(profile, name_prefix: str) -> list[float]:
    """Durations (s) of the kernel's events on the first TPU device plane of a
    ``jax.profiler.ProfileData``, in trace order."""
    out = []
    planes = [p for p in profile.planes if p.name.startswith("/device:TPU:")]
    planes.sort(key=lambda p: p.name)
    for plane in planes[:1]:
        for line in plane.lines:
            if line.name != "XLA Ops":
                continue
            for ev in line.events:
                if ev.name.startswith(name_prefix):
                    out.append((ev.start_ns, ev.duration_ns * 1e-9))
    return [d for _, d in sorted(out)]


def trace_device_times(step, n: int, name_prefix: str) -> list[float]:
    import jax
    from jax.profiler import ProfileData
    with tempfile.TemporaryDirectory(prefix="rpa_tune_trace_") as d:
        with jax.profiler.trace(d):
            for _ in range(n):
                step()
        files = sorted(glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True))
        if not files:
            return []
        return device_times_from_profile(ProfileData.from_file(files[-1]), name_prefix)


# ------------------------------------------------------------------ TPU detection
def _accelerator_nodes() -> list[str]:
    return sorted(glob.glob("/dev/accel*") + glob.glob("/dev/vfio/[0-9]*"))


def probe_devices(timeout: float = 180) -> dict:
    """``{"platform", "device_kind", "count"}`` of JAX's default backend, probed in a child
    process so this process never holds the TPU. Without accelerator device nodes
    (``/dev/accel*``, ``/dev/vfio/N``) there is no TPU and no probe is run."""
    if not _accelerator_nodes():
        return {"platform": "cpu", "device_kind": "cpu", "count": 0, "probed": False}
    code = ("import json, jax; d = jax.devices(); "
            "print(json.dumps({'platform': d[0].platform, 'device_kind': d[0].device_kind, 'count': len(d)}))")
    env = dict(os.environ)
    env.pop("JAX_PLATFORMS", None)
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env)
        line = [l for l in p.stdout.splitlines() if l.startswith("{")]
        if p.returncode == 0 and line:
            return dict(json.loads(line[-1]), probed=True)
        return {"platform": "unknown", "device_kind": None, "count": 0, "probed": True,
                "error": p.stderr.strip().splitlines()[-1:] or ""}
    except (OSError, subprocess.SubprocessError) as e:
        return {"platform": "unknown", "device_kind": None, "count": 0, "probed": True, "error": str(e)}


def tpu_generation_present(probe: dict) -> str | None:
    """The generation name of the probed TPU, else None."""
    if probe.get("platform") != "tpu" or not probe.get("device_kind"):
        return None
    try:
        return get_generation(probe["device_kind"]).name
    except ValueError:
        return None


# ------------------------------------------------------------------ evaluator
class TpuEvaluator(Evaluator):
    name = "tpu"
    method = "measured"
    version = "2"

    def evaluate(self, task: Task) -> EvalResult:
        import jax
        import jax.numpy as jnp
        import kernel
        from kernel.analysis import parse_vmem_oom
        from kernel.hardware import tpu_info
        from kernel.workload import make_inputs
        from .. import prefilter
        from .interpret import block_sizes_arg

        dev = jax.devices()[0]
        if dev.platform != "tpu":
            return EvalResult(base.COMPILE_ERROR, self.method, message=f"no TPU here (platform {dev.platform})")
        here = get_generation(dev.device_kind).name
        if here != task.generation:
            return EvalResult(base.COMPILE_ERROR, self.method, device_kind=dev.device_kind,
                              message=f"this TPU is {here} ({dev.device_kind}), the task is for {task.generation}")
        cap = int(tpu_info(task.generation).vmem_capacity_bytes)
        predicted = task.vmem_predicted_bytes or prefilter.predicted_bytes(task.model, task.limits, task.bs, task.case)
        limit = base.initial_vmem_limit(predicted, cap)
        inp = make_inputs(task.model, task.limits, task.workload, seed=task.seed)
        order = ("queries", "keys", "values", "kv_cache", "kv_lens", "page_indices", "cu_q_lens", "distribution")
        args = [jax.device_put(jnp.asarray(inp[k]), dev) for k in order]
        sm_scale = task.model.head_dim ** -0.5
        notes = []
        compile_s = None
        from ..kernels import get_kernel
        kern = get_kernel(task.kernel)
        dc = kern.device_call(task.case, task.bs, task.limits.page_size, cap)    # the serving signature
        call, prefix = dc.fn, dc.prefix
        if dc.vmem_limit_bytes is not None:
            limit = dc.vmem_limit_bytes
        while True:
            fn = jax.jit(functools.partial(call, sm_scale=sm_scale,
                                           sliding_window=task.sliding_window, soft_cap=task.soft_cap,
                                           vmem_limit_bytes=limit,
                                           **{block_sizes_arg(task.case): tuple(task.bs)}),
                         donate_argnums=(3,))
            t0 = time.perf_counter()
            try:
                compiled = fn.lower(*args).compile()
                compile_s = time.perf_counter() - t0
                break
            except Exception as e:  # noqa: BLE001 - classify the compiler's verdict
                msg = str(e)
                oom = parse_vmem_oom(msg)
                if oom and oom["kind"] == "scoped_limit":
                    new = base.raised_vmem_limit(oom["used_bytes"], limit, cap)
                    if new is not None:
                        notes.append(f"scoped OOM at limit {limit} (used {oom['used_bytes']}): retried with {new}")
                        limit = new
                        continue
                status = base.VMEM_OOM if oom else base.COMPILE_ERROR
                return EvalResult(status, self.method, vmem_limit_bytes=limit, device_kind=dev.device_kind,
                                  vmem_reported_bytes=oom["used_bytes"] if oom else None,
                                  compile_s=time.perf_counter() - t0, message="; ".join(notes + [msg[-1500:]]))
        # The compiled kernel takes paths the interpreter cannot run (the strided uint32
        # view of the KV block), so every config is checked against the reference on the
        # device before it is timed: a wrong config is recorded as wrong_result and never
        # wins.
        from .interpret import reference_mismatches
        ref_out, ref_cache = kernel.reference.ragged_paged_attention(**inp, sm_scale=sm_scale,
                                                                     sliding_window=task.sliding_window,
                                                                     soft_cap=task.soft_cap)
        out0, cache0 = compiled(*args)
        problems = reference_mismatches(out0, cache0, ref_out, ref_cache, task.workload.num_tokens,
                                        task.model.kv_dtype)
        if problems:
            return EvalResult(base.WRONG_RESULT, self.method, compile_s=compile_s, vmem_limit_bytes=limit,
                              device_kind=dev.device_kind, samples=1,
                              message="; ".join(notes + problems + ["(checked on the device against kernel.reference)"]))
        state = {"cache": cache0}

        def step():
            out, state["cache"] = compiled(*args[:3], state["cache"], *args[4:])
            jax.block_until_ready((out, state["cache"]))

        times = time_calls(step)
        how = "host wall-clock per call (blocked on the result)"
        stats = summarize_times(times)
        if stats.median < DEVICE_TIME_BELOW_S:
            dev_times = trace_device_times(step, min(len(times), 200), prefix)
            if dev_times:
                stats = summarize_times(dev_times)
                how = f"device time of {prefix} from a profiler trace (host overhead would dominate)"
            else:
                notes.append("no kernel events in the profiler trace; wall-clock kept")
        return timed_result(stats, how=how, notes=notes, task=task, compile_s=compile_s,
                            vmem_limit_bytes=limit, device_kind=dev.device_kind)


def timed_result(stats: TimingStats, *, how: str, notes=(), task: Task | None = None, **fields) -> EvalResult:
    """The ``ok`` row of a timed config: the median (s), the number of samples and their
    spread, relative (IQR / median, a fraction of the metric: export's margin reads it so)."""
    extra = {}
    if task is not None:
        from rpa_tune.estimator import audit
        s = audit.time_model(0.0, task.workload, task.model, task.generation, task.case,
                             sliding_window=task.sliding_window)
        # the roofline's binding resource for this workload (the larger bound)
        extra = dict(memory_bound_s=s["memory_bound_s"], compute_bound_s=s["compute_bound_s"],
                     active_bound="memory" if s["memory_bound_s"] >= s["compute_bound_s"] else "compute")
    return EvalResult(base.OK, TpuEvaluator.method, metric=stats.median, samples=stats.samples,
                      spread=stats.spread, message="; ".join(list(notes) + [how]), **extra, **fields)
