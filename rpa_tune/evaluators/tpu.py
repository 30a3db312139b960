"""``tpu`` backend: time one config on a real TPU.

Per config: build the workload's inputs (``kernel.workload.make_inputs``, seeded) and the
kernel's call (``device_arguments``: ``TunedKernel.device_call``, the same keyword
arguments the estimator lowers the kernel with; for ours the other two cases take the
heuristic's block sizes, never a table's or ``RPA_*``); jit it with an explicit
``vmem_limit_bytes`` (same policy as the compile backend: the kernel's default, raised to
the compiler's reported need after a scoped-limit OOM); compile once (compile time
recorded); warm up; then time calls, each blocked on its result. The KV cache argument is
donated, so every call is fed the cache the previous call returned. Before timing, the
first call's output and updated cache are compared with ``kernel.reference`` (its
vectorised form, computed once per workload in the process; same rule as the interpret
backend); a mismatch is ``wrong_result``.

One timing method for the whole sweep (``timing_method``, never chosen per config): the
kernel's device time read by name from a profiler trace (``jax.profiler.trace``; the ``XLA
Ops`` events of the kernel on the TPU plane), or, as the stated fallback where no trace can
be read, host wall clock per call (``$RPA_TUNE_TPU_TIMING=wallclock``). A config whose trace
holds no kernel event is not timed (``crash``, disqualifying nothing), never timed the other
way. The row reports the median, the spread relative to it (IQR / median) and the number of
samples; its message names the method.

Only one process can own a TPU, so the engine runs this backend with one worker.

Test only: ``$RPA_TUNE_FAKE_TPU`` names a stand-in device (``fake_device``; CI's is
``tests/fake_tpu.py``) that the device probe reports and this evaluator runs on, the one
seam by which the whole path is exercised on CPU. Unset on a TPU VM.

tpu-inference's RPA v3 (task kernel ``tpu-inference``) is timed the same way (its KV
layout is ours), its scoped VMEM limit its own default (all of
VMEM), and checked against the same reference. Its device events are those named like its
pallas_call for the case (``RPA<d|p|m>-p_<page>-bq_<bq>_<cq>-bkv_...``, from its source; not
checked without a TPU). It is called with ``chunk_prefill_size`` for prefill (its prefill
kernel runs only then) and the new K/V in the cache's dtype (it requires them so).
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


# ------------------------------------------------------------------ timing method
TIMING_ENV = "RPA_TUNE_TPU_TIMING"
TRACE, WALLCLOCK = "trace", "wallclock"


class NoDeviceEvents(RuntimeError):
    """The profiler trace holds no event of the kernel (the trace timing cannot time it)."""


def _env_timing() -> str:
    return (os.environ.get(TIMING_ENV) or TRACE).strip().lower()


def timing_method() -> str:
    """How every config of a sweep is timed (one method for a whole key, never chosen per
    config): ``trace`` (default), the kernel's device time read by name from a profiler
    trace; ``wallclock`` (``$RPA_TUNE_TPU_TIMING=wallclock``), host wall clock per call
    blocked on its result, the stated fallback where no trace can be read. The method tags
    the evaluator version (``TpuEvaluator.version``), so rows of the two never stand side
    by side in a key."""
    t = _env_timing()
    if t not in (TRACE, WALLCLOCK):
        raise ValueError(f"{TIMING_ENV}={t!r}: valid values are {TRACE}, {WALLCLOCK}")
    return t


def measure(step, timing: str, prefix: str, *, trace=None, timer=time.perf_counter) -> tuple[TimingStats, str]:
    """Time ``step`` by ``timing`` (``timing_method``): ``(statistics, how)``. Trace timing:
    wall-clock calls first (they size the sample), then as many traced calls, whose device
    events named ``prefix`` are the samples; none raises ``NoDeviceEvents``."""
    trace = trace_device_times if trace is None else trace
    times = time_calls(step, timer=timer)
    if timing == WALLCLOCK:
        return summarize_times(times), f"timing {WALLCLOCK}: host wall clock per call (blocked on the result; " \
                                       f"{TIMING_ENV}={WALLCLOCK}, the whole sweep)"
    if timing != TRACE:
        raise ValueError(f"unknown timing {timing!r}")
    dev_times = trace(step, max(MIN_ITERS, min(len(times), 200)), prefix)
    if not dev_times:
        raise NoDeviceEvents(f"no device events named {prefix}* in the profiler trace: not timed (no per-config "
                             f"fallback); time the whole sweep by wall clock with {TIMING_ENV}={WALLCLOCK}")
    return summarize_times(dev_times), f"timing {TRACE}: device time of {prefix}* from a profiler trace"


# ------------------------------------------------------------------ call arguments, reference
ARG_ORDER = ("queries", "keys", "values", "kv_cache", "kv_lens", "page_indices", "cu_q_lens", "distribution")


def device_arguments(task: Task, kern, capacity: int):
    """``(DeviceCall, inputs)`` of ``task`` on the device: the kernel's call with the same
    keyword arguments its estimate is lowered with (``TunedKernel.device_call``; for ours
    the other cases padded for the heuristic's sizes, never a table's or an override's),
    and the seeded inputs (NumPy) with the new K/V in the dtype the call requires."""
    from kernel.workload import make_inputs
    dc = kern.device_call(task.case, task.bs, task.limits.page_size, capacity, task=task)
    inp = make_inputs(task.model, task.limits, task.workload, seed=task.seed)
    if dc.new_kv_dtype is not None and np.dtype(dc.new_kv_dtype) != inp["keys"].dtype:
        from kernel.reference import _to_dtype
        for k in ("keys", "values"):
            inp[k] = _to_dtype(inp[k], np.dtype(dc.new_kv_dtype), None)
    return dc, inp


_REFERENCE_CACHE: dict = {}


def reference_output(task: Task, inp: dict):
    """``kernel.reference`` (its vectorised form) of ``task``'s inputs, computed once per
    workload, seed, shape and attention options in this process (every config of a key
    shares it)."""
    import dataclasses as dc_
    from kernel.reference import ragged_paged_attention_fast
    k = (dc_.astuple(task.model), dc_.astuple(task.limits), task.workload, task.seed, task.sliding_window,
         task.soft_cap, str(inp["keys"].dtype))
    if k not in _REFERENCE_CACHE:
        _REFERENCE_CACHE.clear()          # one workload at a time: a key's configs come together
        _REFERENCE_CACHE[k] = ragged_paged_attention_fast(
            **inp, sm_scale=task.model.head_dim ** -0.5, sliding_window=task.sliding_window,
            soft_cap=task.soft_cap)
    return _REFERENCE_CACHE[k]


# ------------------------------------------------------------------ stand-in device (tests only)
FAKE_ENV = "RPA_TUNE_FAKE_TPU"


def fake_device():
    """TEST ONLY: the stand-in device named by ``$RPA_TUNE_FAKE_TPU`` (``module:attr``, a
    factory called with no argument), or None (the real device: always so outside tests).
    The stand-in is the one seam through which CI runs ``--backend tpu`` on CPU
    (``tests/fake_tpu.py``): it has ``generation``, ``device_kind`` and ``platform``
    (``"tpu"``, as the real device reports it), ``device()`` (the JAX device the inputs are
    put on), ``device_call(dc, task)`` (the call it can run in place of ``dc``),
    ``trace(step, n, prefix)`` (the trace reader's samples) and ``step(step)`` (the
    timing loop's call). Nothing else of this evaluator changes under it."""
    spec = (os.environ.get(FAKE_ENV) or "").strip()
    if not spec:
        return None
    import importlib
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ValueError(f"{FAKE_ENV}={spec!r}: expected module:factory (test only)")
    return getattr(importlib.import_module(module), attr)()


# ------------------------------------------------------------------ TPU detection
def _accelerator_nodes() -> list[str]:
    return sorted(glob.glob("/dev/accel*") + glob.glob("/dev/vfio/[0-9]*"))


def probe_devices(timeout: float = 180) -> dict:
    """``{"platform", "device_kind", "count"}`` of JAX's default backend, probed in a child
    process so this process never holds the TPU. Without accelerator device nodes
    (``/dev/accel*``, ``/dev/vfio/N``) there is no TPU and no probe is run. Under the
    test-only ``$RPA_TUNE_FAKE_TPU`` the stand-in device is reported."""
    fake = fake_device()
    if fake is not None:
        return {"platform": fake.platform, "device_kind": fake.device_kind, "count": 1, "probed": False,
                "fake": True}
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
    # 3: one timing method per sweep (tagged: a key's rows never mix the two), heuristic
    # padding of the other cases, the estimator's call arguments, relative spread
    version = "3" + ("" if _env_timing() == TRACE else f"-{WALLCLOCK}")

    def evaluate(self, task: Task) -> EvalResult:
        import jax
        import jax.numpy as jnp
        from kernel.analysis import parse_vmem_oom
        from kernel.hardware import tpu_info

        fake = fake_device()              # tests only (``fake_device``); None on a real TPU
        dev = jax.devices()[0] if fake is None else fake.device()
        platform, device_kind = (dev.platform, dev.device_kind) if fake is None else (fake.platform,
                                                                                          fake.device_kind)
        if platform != "tpu":
            return EvalResult(base.COMPILE_ERROR, self.method, message=f"no TPU here (platform {platform})")
        here = get_generation(device_kind).name
        if here != task.generation:
            return EvalResult(base.COMPILE_ERROR, self.method, device_kind=device_kind,
                              message=f"this TPU is {here} ({device_kind}), the task is for {task.generation}")
        cap = int(tpu_info(task.generation).vmem_capacity_bytes)
        try:
            timing = timing_method()
        except ValueError as e:
            return EvalResult(base.COMPILE_ERROR, self.method, device_kind=device_kind, message=str(e))
        from ..kernels import get_kernel
        kern = get_kernel(task.kernel)
        dc, inp = device_arguments(task, kern, cap)
        if fake is not None:
            dc = fake.device_call(dc, task)
        args = [jax.device_put(jnp.asarray(inp[k]), dev) for k in ARG_ORDER]
        notes = []
        compile_s = None
        call, prefix = dc.fn, dc.prefix
        # the kernel's own limit on a device, else where the compile backend starts
        limit = dc.vmem_limit_bytes if dc.vmem_limit_bytes is not None else base.task_vmem_limit(task, kern, cap)
        while True:
            fn = jax.jit(functools.partial(call, vmem_limit_bytes=limit, **dc.kwargs), donate_argnums=(3,))
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
                return EvalResult(status, self.method, vmem_limit_bytes=limit, device_kind=device_kind,
                                  vmem_reported_bytes=oom["used_bytes"] if oom else None,
                                  compile_s=time.perf_counter() - t0, message="; ".join(notes + [msg[-1500:]]))
        # The compiled kernel takes paths the interpreter cannot run (the strided uint32
        # view of the KV block), so every config is checked against the reference on the
        # device before it is timed: a wrong config is recorded as wrong_result and never
        # wins.
        from .interpret import reference_mismatches
        ref_out, ref_cache = reference_output(task, inp)
        out0, cache0 = compiled(*args)
        problems = reference_mismatches(out0, cache0, ref_out, ref_cache, task.workload.num_tokens,
                                        task.model.kv_dtype)
        if problems:
            return EvalResult(base.WRONG_RESULT, self.method, compile_s=compile_s, vmem_limit_bytes=limit,
                              device_kind=device_kind, samples=1,
                              message="; ".join(notes + problems + ["(checked on the device against kernel.reference)"]))
        state = {"cache": cache0}

        def step():
            out, state["cache"] = compiled(*args[:3], state["cache"], *args[4:])
            jax.block_until_ready((out, state["cache"]))

        try:
            if fake is None:
                stats, how = measure(step, timing, prefix)
            else:
                stats, how = measure(fake.step(step), timing, prefix, trace=fake.trace)
                how += f" (stand-in device {fake.device_kind}: {FAKE_ENV})"
        except NoDeviceEvents as e:
            # never a per-config fallback: the key's configs are all timed one way
            return EvalResult(base.CRASH, self.method, compile_s=compile_s, vmem_limit_bytes=limit,
                              device_kind=device_kind, message="; ".join(notes + [str(e)]))
        return timed_result(stats, how=how, notes=notes, task=task, compile_s=compile_s,
                            vmem_limit_bytes=limit, device_kind=device_kind)


def timed_result(stats: TimingStats, *, how: str, notes=(), task: Task | None = None, **fields) -> EvalResult:
    """The ``ok`` row of a timed config: the median (s), the number of samples and their
    spread, relative (IQR / median, a fraction of the metric: export's margin reads it so)."""
    extra = {}
    if task is not None:
        from rpa_tune.estimator import audit
        from rpa_tune.estimator.calibration import calibration
        # the measured time as cycles at the calibrated clock: 0 cycles divided by zero in
        # the model's rate note (found by the stand-in device's end-to-end test)
        cycles = stats.median * calibration(task.generation).clock_hz
        s = audit.time_model(cycles, task.workload, task.model, task.generation, task.case,
                             sliding_window=task.sliding_window)
        # the roofline's binding resource for this workload (the larger bound)
        extra = dict(memory_bound_s=s["memory_bound_s"], compute_bound_s=s["compute_bound_s"],
                     active_bound="memory" if s["memory_bound_s"] >= s["compute_bound_s"] else "compute")
    return EvalResult(base.OK, TpuEvaluator.method, metric=stats.median, samples=stats.samples,
                      spread=stats.spread, message="; ".join(list(notes) + [how]), **extra, **fields)
