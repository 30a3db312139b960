"""TEST ONLY: a stand-in TPU for the ``tpu`` backend on CPU (issue #102, item 2).

Named to the TPU evaluator by ``RPA_TUNE_FAKE_TPU=fake_tpu:<generation>`` (this directory on
``PYTHONPATH``); ``rpa_tune.evaluators.tpu.fake_device`` is the one seam, read in the CLI's
device probe and in the evaluator. What is real and what stands in:

- the device: JAX's CPU device, reported as a TPU of the generation (its ``device_kind``);
- our kernel: its own device call (``TunedKernel.device_call``, the evaluator's arguments)
  run in the Pallas TPU interpreter (``interpret=True``); compiled, checked against the
  reference and called by the evaluator as on a chip;
- the public kernel (it cannot run in the interpreter): a jitted stand-in with its
  signature that first checks the evaluator's call against the real function (every
  keyword is a parameter of it, ``chunk_prefill_size`` given for prefill, the new K/V in
  the cache's dtype), then computes the attention and cache update with
  ``kernel.reference.ragged_paged_attention_fast`` (a host callback). Its correctness
  check therefore holds the reference against itself: it tests the plumbing, not the kernel;
- the profiler trace: a synthetic ``ProfileData``-shaped object (a host plane, a TPU plane
  whose ``XLA Ops`` line holds the kernel's events named by the call's prefix among other
  ops) read by the evaluator's own ``device_times_from_profile``. Each event's duration is
  ``device_time(bs)`` times seeded noise of relative IQR ``REL_IQR``;
- the timing loop's calls: the first runs the kernel; later ones return at once (an
  interpreter call costs about a second, the loop makes 20+ of them per config).
"""
from __future__ import annotations

import functools
import inspect
import math
import types
import zlib

import numpy as np

REL_IQR = 0.01          # relative IQR of the synthetic device samples (a TPU's is ~0.5-2 %)


def device_time(bs) -> float:
    """The stand-in's device time (s) of block sizes ``bs``: least at ``bkv = ckv = 128``
    (``bq = 16, cq = 8`` for prefill / mixed), every factor of two away 5-12 % slower."""
    m = 1.0 + 0.12 * abs(math.log2(bs.bkv / 128)) + 0.08 * abs(math.log2(bs.ckv / 128))
    if bs.bq > 1:
        m += 0.1 * abs(math.log2(bs.bq / 16)) + 0.05 * abs(math.log2(bs.cq / 8))
    return 400e-6 * m


def synthetic_profile(prefix_name: str, seconds: float, n: int, seed: int):
    """A profile with ``n`` kernel events named ``prefix_name`` around ``seconds`` (normal
    noise of relative IQR ``REL_IQR``), interleaved with other device ops and a host plane."""
    rng = np.random.default_rng(seed)
    d = seconds * (1 + rng.standard_normal(n) * REL_IQR / 1.349)
    ev, t = [], 0
    for i in range(n):
        ev.append(types.SimpleNamespace(name="copy-start.3", start_ns=t, duration_ns=2000.0))
        t += 3000
        ev.append(types.SimpleNamespace(name=f"{prefix_name}.{i % 2}", start_ns=t, duration_ns=float(d[i] * 1e9)))
        t += int(d[i] * 1e9) + 1000
    ev.reverse()                 # the reader orders them by start
    tpu = types.SimpleNamespace(name="/device:TPU:0", lines=[
        types.SimpleNamespace(name="XLA Modules", events=[types.SimpleNamespace(name="jit_fn", start_ns=0,
                                                                                duration_ns=float(t))]),
        types.SimpleNamespace(name="XLA Ops", events=ev)])
    other = types.SimpleNamespace(name="/device:TPU:1", lines=[types.SimpleNamespace(name="XLA Ops", events=[
        types.SimpleNamespace(name=f"{prefix_name}.0", start_ns=0, duration_ns=1e9)])])
    host = types.SimpleNamespace(name="/host:CPU", lines=[types.SimpleNamespace(name="python", events=[
        types.SimpleNamespace(name=prefix_name, start_ns=0, duration_ns=5e9)])])
    return types.SimpleNamespace(planes=[host, other, tpu])


class PublicArgumentError(TypeError):
    """The evaluator called the public kernel as the real one would refuse (or misread)."""


def public_stand_in(real_fn, case: str, offset: float = 0.0):
    """A function with the public kernel's call that checks its arguments against
    ``real_fn`` and computes the reference's result (see the module doc), its output
    shifted by ``offset`` (a wrong kernel, for the check)."""
    params = inspect.signature(real_fn).parameters

    def fn(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, **kw):
        import jax
        unknown = sorted(set(kw) - set(params))
        if unknown:
            raise PublicArgumentError(f"not parameters of the public kernel: {unknown}")
        if case == "prefill" and not kw.get("chunk_prefill_size"):
            raise PublicArgumentError("prefill without chunk_prefill_size: the public prefill kernel would not run")
        if keys.dtype != kv_cache.dtype or values.dtype != kv_cache.dtype:
            raise PublicArgumentError(f"new K/V in {keys.dtype}, the cache in {kv_cache.dtype}")
        from kernel.reference import ragged_paged_attention_fast
        opts = {k: kw.get(k) for k in ("sm_scale", "sliding_window", "soft_cap")}

        def host(*a):
            out, cache = ragged_paged_attention_fast(*a, **opts)
            out = np.asarray(out, np.float32) + offset
            return out.astype(queries.dtype), np.asarray(cache, kv_cache.dtype)
        shapes = (jax.ShapeDtypeStruct(queries.shape, queries.dtype), jax.ShapeDtypeStruct(kv_cache.shape,
                                                                                          kv_cache.dtype))
        return jax.pure_callback(host, shapes, queries, keys, values, kv_cache, kv_lens, page_indices,
                                 cu_q_lens, distribution)
    return fn


class FakeTpu:
    platform = "tpu"

    def __init__(self, generation: str, offset: float = 0.0):
        from kernel.config import get_generation
        g = get_generation(generation)
        self.generation, self.device_kind = g.name, g.device_kind
        self._bs = self._prefix = None
        self.offset = offset

    def device(self):
        import jax
        return jax.devices("cpu")[0]

    def device_call(self, dc, task):
        import dataclasses
        self._bs, self._prefix = task.bs, dc.prefix
        if task.kernel == "rpa-tune":
            fn = functools.partial(dc.fn, interpret=True)
        else:
            fn = public_stand_in(dc.fn, task.case, self.offset)
        return dataclasses.replace(dc, fn=fn)

    def step(self, step):
        done = []

        def once():
            if not done:
                step()
                done.append(1)
        return once

    def trace(self, step, n, prefix):
        from rpa_tune.evaluators.tpu import device_times_from_profile
        step()
        seed = zlib.crc32(self._prefix.encode())
        # the events are named as the device names them: the call's prefix and a suffix
        return device_times_from_profile(synthetic_profile(self._prefix + "x", device_time(self._bs), n, seed),
                                         prefix)


def _factory(generation, offset=0.0):
    return lambda: FakeTpu(generation, offset)


v4, v5e, v5p, v6e, tpu7x = (_factory(g) for g in ("v4", "v5e", "v5p", "v6e", "tpu7x"))
v6e_off = _factory("v6e", 1.0)       # the public stand-in's output off by 1 (wrong_result)


# ------------------------------------------------------------------ for `rpa-tune selftest` (tests/test_selftest.py)
class WrongHeadDimTpu(FakeTpu):
    """The stand-in whose run of our kernel is wrong for one head_dim: its output is off by
    ``offset`` in calls of that head_dim (a broken compiled path), right for the others; the
    public kernel's stand-in off by ``public_offset`` (0: right)."""

    def __init__(self, generation: str, head_dim: int, offset: float = 1.0, public_offset: float = 0.0):
        super().__init__(generation, public_offset)
        self.bad_head_dim, self.bad_offset = head_dim, offset

    def device_call(self, dc, task):
        import dataclasses
        dc = super().device_call(dc, task)
        if task.kernel != "rpa-tune" or task.model.head_dim != self.bad_head_dim:
            return dc
        fn, off = dc.fn, self.bad_offset

        def wrong(*args, **kw):
            out, cache = fn(*args, **kw)
            return (out.astype("float32") + off).astype(out.dtype), cache
        return dataclasses.replace(dc, fn=wrong)


v6e_wrong = lambda: WrongHeadDimTpu("v6e", 64, public_offset=1.0)      # noqa: E731

ESTIMATE_FACTOR = 1.25      # the stand-in estimate: this many times the stand-in's device time


def estimate_evaluator(backend):
    """``RPA_TUNE_EVALUATOR_OVERRIDE`` factory for the compile workers of `rpa-tune selftest`:
    an audited estimate of ``ESTIMATE_FACTOR`` x ``device_time`` (no libtpu compile)."""
    from rpa_tune.evaluators.base import OK, EvalResult, Evaluator

    class StandInEstimate(Evaluator):
        name, method, version = "stand-in-estimate", "estimate", "1"

        def evaluate(self, task):
            assert backend == "compile" and task.backend == "compile" and task.heuristic, (backend, task)
            m = ESTIMATE_FACTOR * device_time(task.bs)
            return EvalResult(OK, self.method, metric=m, estimate_s=m, audit="complete", samples=1,
                              message="stand-in estimate (tests/fake_tpu.py)")
    return StandInEstimate()


# ------------------------------------------------------ the device-cost model's stand-in device
# ``rpa-tune calibrate`` on CPU (tests/test_calibrate.py): a stand-in whose device times are
# ``rpa_tune.estimator.device_model.device_time`` of each call under KNOWN constants (given in
# ``$RPA_TUNE_FAKE_DEVICE_CONSTANTS`` as JSON), times a per-call noise of at most
# ``CALL_NOISE``, so a fit must recover the constants. Everything else is ``FakeTpu``'s.
CONSTANTS_ENV = "RPA_TUNE_FAKE_DEVICE_CONSTANTS"
CALL_NOISE = 0.01


def recorded_static(task) -> float | None:
    """The static estimate the calibrate test stands in for the compile backend's (each
    probe's deviceless compiles take minutes): the public kernel's decode at 60 % of the
    time its bytes take at the HBM peak, ours at 140 % (above the HBM term: the static
    estimate binds), prefill unpriced (as the public prefill's estimate is on TPU7x:
    ``modelled`` rows)."""
    from rpa_tune.estimator import device_model
    if task.case != "decode":
        return None
    f = _features(task)
    share = 0.6 if task.kernel == "tpu-inference" else 1.4
    return share * f.hbm_bytes / device_model.rates(task.generation)[0]


def _features(task):
    from rpa_tune.estimator import device_model
    from rpa_tune.kernels import get_kernel
    return device_model.features(get_kernel(task.kernel), task.workload, task.model, task.case, task.bs,
                                 task.limits.page_size, task.generation, task.sliding_window)


def modelled_device_time(task, constants: dict) -> float:
    """The stand-in's device time of ``task`` under ``constants`` (with its noise)."""
    from rpa_tune.estimator import device_model
    t = device_model.device_time(recorded_static(task), _features(task), task.generation, constants)["time_s"]
    u = zlib.crc32(f"{task.kernel}:{task.case}:{task.workload.kv_lens[0]}:{len(task.workload.kv_lens)}".encode())
    return t * (1 + CALL_NOISE * (2 * u / 2**32 - 1))


class ModelledTpu(FakeTpu):
    """``FakeTpu`` timed by the device-cost model under known constants (section doc)."""

    def device_call(self, dc, task):
        self._task = task
        return super().device_call(dc, task)

    def trace(self, step, n, prefix):
        import json
        import os
        from rpa_tune.evaluators.tpu import device_times_from_profile
        step()
        t = modelled_device_time(self._task, json.loads(os.environ[CONSTANTS_ENV]))
        return device_times_from_profile(synthetic_profile(self._prefix + "x", t, n, zlib.crc32(self._prefix.encode())),
                                         prefix)


def modelled_tpu7x():
    return ModelledTpu("tpu7x")
