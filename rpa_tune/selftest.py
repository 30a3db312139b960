"""``rpa-tune selftest``: one command a TPU user runs to check the kernel and the tool on the
chip, writing one report to attach to an issue.

Two parts, both on JAX device 0 of this machine's TPU:

1. **Correctness** (``CHECKS``): our kernel (``kernel.ragged_paged_attention``, called as the
   tpu backend calls it: ``TunedKernel.device_call``, block sizes of all three cases given)
   compiled for the chip, on seeded ragged batches, against the vectorised NumPy reference
   (``kernel.reference.ragged_paged_attention_fast``): decode, prefill, mixed and a batch of
   all three; head_dim 64 / 128 / 256; bf16 and fp8 KV (packed 2 and 4 heads to a word);
   pages of 128 and 256 tokens; sliding window and logit soft cap; the heuristic's block
   sizes and small explicit ones (several KV blocks per sequence, q-chunk loops). These run
   the compiled-only paths the interpreter only emulates (docs/kernel.md, "What is
   verified without a TPU"). A row passes when the output is within the evaluators' rule
   (``evaluators.interpret.reference_mismatches``: ``atol = rtol = 2e-2``, 3e-2 with fp8)
   and the updated cache equals the reference's bit for bit; it reports the max abs error.
2. **Probes** (``probes``): a short set of keys timed for both kernels (ours ``rpa-tune`` and
   ``tpu-inference``) at their default block sizes by the tpu backend itself
   (``TpuEvaluator.evaluate``: the kernel's device call, its check against the reference,
   one timing method, ``measured``), beside the compile backend's deviceless price of the
   same task (``CompileEvaluator`` in worker processes on the CPU, started before the device
   work and running beside it): an ``estimate``, or ``modelled`` where libtpu's profiler
   cannot price the programs (v4, TPU7x prefill / mixed: ``coverage.compile_method``); a
   probe with neither says why.

Per core / per chip: both kernels' grids are sequential (dimension semantics "arbitrary"),
so a call runs on one TensorCore of device 0, and libtpu's profiler prices one TensorCore:
both figures are one core's, and the report says how many TensorCores the chip has.

Without a TPU the command says so in one line (exit 2). Exit 1 when a check or a probe's
device run failed, else 0. ``--quick`` runs a few rows of each part (what CI runs on the
test-only stand-in device, ``RPA_TUNE_FAKE_TPU``).
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import platform
import sys
import threading
import time
from pathlib import Path

import numpy as np

from kernel.config import BlockSizes, Case, get_generation
from kernel.workload import ModelShape, ServingLimits, Workload

SCHEMA = "rpa-tune-selftest/1"
PASS, FAIL, ERROR = "PASS", "FAIL", "ERROR"
# TensorCores per chip (Cloud TPU's system architecture pages); a JAX device of v4 / v5p is
# a megacore chip, of TPU7x one of the chip's two cores
TENSORCORES_PER_CHIP = {"v4": 2, "v5e": 1, "v5p": 2, "v6e": 1, "tpu7x": 2}
SCOPE = ("per core: both kernels' grids are sequential (dimension semantics \"arbitrary\"), so one call runs "
         "on one TensorCore of device 0; the measured time is that core's, and the estimate is libtpu's "
         "profile of one TensorCore. No per-chip conversion is applied.")


class SelftestError(RuntimeError):
    """The self-test cannot run here (one line: why)."""


class NoTpu(SelftestError):
    """No TPU here (one line: what was found)."""


# ------------------------------------------------------------------ the correctness matrix
def _w(case, q, kv) -> Workload:
    return Workload.of_case(case, q, kv)


# seeded ragged batches: lengths on and beside page boundaries, a sequence longer than the
# heuristic's KV block, short and long prompts with and without context
DECODE = _w("decode", [1] * 6, [1, 17, 128, 129, 700, 1900])
PREFILL = _w("prefill", [5, 130, 250], [5, 1230, 500])
MIXED = _w("mixed", [1, 3, 90, 200], [600, 132, 1090, 200])
RAGGED = Workload.concat(_w("decode", [1, 1, 1], [33, 256, 1500]), _w("prefill", [100, 37], [700, 37]),
                         _w("mixed", [2, 60], [702, 120]))
# the small batch of the quick rows (the interpreter of the stand-in device is slow)
RAGGED_SMALL = Workload.concat(_w("decode", [1, 1], [130, 300]), _w("prefill", [40], [300]),
                               _w("mixed", [5, 20], [5, 300]))
# explicit sizes smaller than the batches (several KV blocks and compute chunks per sequence,
# q-chunk loops), per page size
SMALL = {128: {"decode": BlockSizes(2, 256, 2, 128), "prefill": BlockSizes(32, 256, 16, 128),
               "mixed": BlockSizes(16, 256, 8, 128)},
         256: {"decode": BlockSizes(2, 512, 2, 256), "prefill": BlockSizes(32, 512, 16, 256),
               "mixed": BlockSizes(16, 512, 8, 256)}}


@dataclasses.dataclass(frozen=True)
class Check:
    """One correctness row: a shape, page size, batch, attention options and block sizes."""
    name: str
    model: ModelShape
    page_size: int
    workload: Workload
    sliding_window: int | None = None
    soft_cap: float | None = None
    block_sizes: tuple = ()          # ((case, BlockSizes), ...) given; other cases: the heuristic
    max_num_tokens: int = 512
    max_num_seqs: int = 16
    max_model_len: int = 2048
    quick: bool = False              # one of the --quick rows

    @property
    def limits(self) -> ServingLimits:
        return ServingLimits(self.page_size, self.max_num_tokens, self.max_num_seqs, self.max_model_len)

    @property
    def cases(self) -> list[str]:
        """The cases the batch holds sequences of."""
        return [c.value for c in (Case.DECODE, Case.PREFILL, Case.MIXED)
                if self.workload.case_range(c)[1] > self.workload.case_range(c)[0]]

    @property
    def case(self) -> str:
        """The case the row is filed under (a task names one): its first non-empty case."""
        return self.cases[0]

    def task(self, generation: str):
        from .evaluators.base import Task
        bs = dict(self.block_sizes).get(self.case) or heuristic_sizes(self, generation)[self.case]
        return Task(backend="tpu", generation=generation, case=self.case, model=self.model, limits=self.limits,
                    workload=self.workload, bs=bs, sliding_window=self.sliding_window, soft_cap=self.soft_cap,
                    kernel="rpa-tune", seed=0)


def heuristic_sizes(check: Check, generation: str) -> dict:
    """The heuristic's block sizes of every case for the row's call (as the tpu backend's
    device call resolves the cases it is not given: ``heuristic_block_sizes_for``)."""
    from kernel.analysis import serving_dims
    from kernel.api import heuristic_block_sizes_for
    dims = serving_dims(check.model, check.limits)
    return {c.value: heuristic_block_sizes_for(c, generation=get_generation(generation).name, dims=dims,
                                               sliding_window=check.sliding_window is not None)
            for c in (Case.DECODE, Case.PREFILL, Case.MIXED)}


def _shape(q, kv, d, kv_dtype="bfloat16") -> ModelShape:
    return ModelShape(q, kv, d, "bfloat16", kv_dtype)


FP8 = "float8_e4m3fn"


def _checks() -> tuple[Check, ...]:
    rows = []
    for case, w in (("decode", DECODE), ("prefill", PREFILL), ("mixed", MIXED)):
        rows += [
            Check(f"{case} h8x1 d128 bf16 p128", _shape(8, 1, 128), 128, w),
            Check(f"{case} h32x8 d64 bf16 p128", _shape(32, 8, 64), 128, w),
            Check(f"{case} h16x8 d256 bf16 p128", _shape(16, 8, 256), 128, w),
            Check(f"{case} h16x2 d128 fp8 p128", _shape(16, 2, 128, FP8), 128, w),
            Check(f"{case} h8x1 d128 bf16 p256", _shape(8, 1, 128), 256, w),
            Check(f"{case} h16x2 d128 bf16 p128 window 256 cap 50", _shape(16, 2, 128), 128, w,
                  sliding_window=256, soft_cap=50.0),
            Check(f"{case} h16x2 d128 bf16 p128 small blocks", _shape(16, 2, 128), 128, w,
                  block_sizes=tuple(SMALL[128].items())),
        ]
    rows += [
        Check("ragged h8x1 d128 bf16 p128", _shape(8, 1, 128), 128, RAGGED),
        Check("ragged h48x1 d128 fp8 p256 small blocks", _shape(48, 1, 128, FP8), 256, RAGGED,
              block_sizes=tuple(SMALL[256].items())),
        Check("ragged h32x8 d64 fp8 p128 window 512", _shape(32, 8, 64, FP8), 128, RAGGED, sliding_window=512),
        Check("ragged h16x8 d256 fp8 p256 cap 50", _shape(16, 8, 256, FP8), 256, RAGGED, soft_cap=50.0),
        # the quick rows: every case in one call each, the two packings, both page sizes,
        # head_dim 64 and 128, window and soft cap, heuristic and small explicit blocks
        Check("quick ragged h8x1 d128 bf16 p256", _shape(8, 1, 128), 256, RAGGED_SMALL, max_num_tokens=128,
              max_num_seqs=8, max_model_len=512, quick=True),
        Check("quick ragged h8x2 d64 fp8 p128 window 200 cap 50 small blocks", _shape(8, 2, 64, FP8), 128,
              RAGGED_SMALL, sliding_window=200, soft_cap=50.0, block_sizes=tuple(SMALL[128].items()),
              max_num_tokens=128, max_num_seqs=8, max_model_len=512, quick=True),
    ]
    return tuple(rows)


CHECKS = _checks()


def checks(quick: bool) -> list[Check]:
    return [c for c in CHECKS if c.quick] if quick else [c for c in CHECKS if not c.quick]


# ------------------------------------------------------------------ the probes
@dataclasses.dataclass(frozen=True)
class Probe:
    """One timed key: a kernel at its default block sizes on one workload."""
    kernel: str
    case: str
    model: ModelShape
    limits: ServingLimits
    workload: Workload
    shape: str                       # what the model is (a preset name or the heads)

    def key(self, generation: str):
        from .engine import problem_key
        return problem_key(generation, self.case, self.model, self.limits)


def probes(quick: bool) -> list[Probe]:
    """Full: both kernels, each case, Llama-3-70B's TP8 shard (8 q / 1 KV heads, head_dim 128)
    at token bucket 2048, page 128, model length 8192: a key of the coverage matrix, on the
    batch its sweep prices (``coverage.sweep_workload``; the cheapest shape to estimate).
    Quick: a decode key of the same heads, 4 sequences of about 200 tokens."""
    from .kernels import DEFAULT, REFERENCE
    kernels = (DEFAULT, REFERENCE)
    if quick:
        lim = ServingLimits(128, 64, 4, 512)
        w = _w("decode", [1] * 4, [201] * 4)
        return [Probe(k, "decode", _shape(8, 1, 128), lim, w, "h8x1 d128") for k in kernels]
    from . import coverage
    from .presets import get_preset
    lim = ServingLimits(128, 2048, coverage.MAX_NUM_SEQS, coverage.MAX_MODEL_LEN)
    model = get_preset("llama3-70b-tp8").model()
    return [Probe(k, c, model, lim, coverage.sweep_workload(c, 128, 2048), "llama3-70b-tp8")
            for k in kernels for c in coverage.CASES]


def probe_task(p: Probe, generation: str, bs: BlockSizes, backend: str, timeout: float = 900.0):
    from .evaluators.base import Task
    return Task(backend=backend, generation=generation, case=p.case, model=p.model, limits=p.limits,
                workload=p.workload, bs=bs, timeout=timeout, kernel=p.kernel, heuristic=True)


class Estimates:
    """The compile backend's estimates of the probes, in worker processes on the CPU (they
    never touch the TPU), run on a thread beside the device work: ``start`` then
    ``results()`` (waits)."""

    def __init__(self, tasks: dict, jobs: int):
        self.tasks, self.jobs = tasks, max(1, int(jobs))
        self.out: dict = {}
        self._thread: threading.Thread | None = None

    def start(self) -> "Estimates":
        if self.tasks:
            self._thread = threading.Thread(target=self._run, name="rpa-tune-selftest-estimates", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        from .evaluators.base import EvalResult
        from .pool import WorkerPool
        todo = list(self.tasks.items())
        try:
            with WorkerPool("compile", self.jobs) as pool:
                while todo or pool.busy:
                    while todo and pool.free_slots():
                        name, task = todo.pop(0)
                        pool.submit(task, payload=name)
                    for name, _task, res, _s in pool.wait(timeout=5.0):
                        self.out[name] = res
        except Exception as e:  # noqa: BLE001 - a missing estimate is reported, never fatal
            for name, _ in list(self.tasks.items()):
                self.out.setdefault(name, EvalResult("crash", "estimate", message=f"{type(e).__name__}: {e}"))

    def results(self) -> dict:
        if self._thread is not None:
            self._thread.join()
        return self.out


# ------------------------------------------------------------------ the device
@dataclasses.dataclass
class Device:
    jax_device: object
    platform: str
    device_kind: str
    generation: str
    count: int
    fake: object = None               # the test-only stand-in (``evaluators.tpu.fake_device``)

    def describe(self) -> dict:
        d = self.jax_device
        attrs = {a: _jsonable(getattr(d, a)) for a in ("id", "coords", "core_on_chip", "num_cores")
                 if getattr(d, a, None) is not None} if self.fake is None else {}
        return dict(platform=self.platform, device_kind=self.device_kind, generation=self.generation,
                    devices=self.count, tensorcores_per_chip=TENSORCORES_PER_CHIP.get(self.generation),
                    device_0=attrs, stand_in=None if self.fake is None else
                    f"test-only stand-in device ({type(self.fake).__module__}: CPU, the Pallas interpreter; "
                    "not a TPU)")


def _jsonable(v):
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return v if isinstance(v, (int, float, str, bool)) or v is None else str(v)


def find_device() -> Device:
    """This machine's TPU (device 0), or ``NoTpu``: the device probe first (a child process),
    so without a TPU nothing here imports JAX's TPU backend."""
    import os
    from .evaluators.tpu import fake_device, probe_devices, tpu_generation_present
    fake = fake_device()
    probe = probe_devices()
    gen = tpu_generation_present(probe)
    if gen is None:
        if probe.get("platform") == "tpu":
            raise NoTpu(f"found a TPU of kind {probe.get('device_kind')!r}, which is none of the generations "
                        f"this tool knows ({', '.join(TENSORCORES_PER_CHIP)})")
        why = "" if probe.get("probed") else "; no /dev/accel* or /dev/vfio device nodes"
        err = f"; {probe['error']}" if probe.get("error") else ""
        raise NoTpu(f"no TPU here (platform {probe.get('platform')}{why}{err}): rpa-tune selftest runs on a TPU VM")
    if fake is not None:
        return Device(fake.device(), fake.platform, fake.device_kind, fake.generation, 1, fake)
    os.environ.pop("JAX_PLATFORMS", None)         # as the tpu backend's workers (worker_env)
    import jax
    devs = jax.devices()
    if devs[0].platform != "tpu":
        raise NoTpu(f"the device probe found a TPU {gen}, but JAX in this process runs on {devs[0].platform} "
                    "(is JAX_PLATFORMS set, or does another process hold the TPU?)")
    return Device(devs[0], "tpu", devs[0].device_kind, get_generation(devs[0].device_kind).name, len(devs))


def versions() -> dict:
    from . import provenance
    from .public_kernel import installed_version
    v = dict(provenance.versions())
    v.update(python=platform.python_version(), tpu_inference=installed_version(),
             kernel_id=provenance.kernel_source_hash(), git_sha=provenance.git_sha())
    return v


# ------------------------------------------------------------------ running
def run_check(check: Check, dev: Device) -> dict:
    """One correctness row on the device: its result as a report row."""
    import jax
    import jax.numpy as jnp
    from kernel.hardware import tpu_info
    from kernel.reference import ragged_paged_attention_fast
    from .evaluators.interpret import block_sizes_arg, reference_mismatches
    from .evaluators.tpu import ARG_ORDER, device_arguments
    from .kernels import get_kernel
    task = check.task(dev.generation)
    sizes = dict(heuristic_sizes(check, dev.generation), **dict(check.block_sizes))
    row = dict(name=check.name, case="+".join(check.cases), num_q_heads=check.model.num_q_heads,
               num_kv_heads=check.model.num_kv_heads, head_dim=check.model.head_dim, kv_dtype=check.model.kv_dtype,
               page_size=check.page_size, sliding_window=check.sliding_window, soft_cap=check.soft_cap,
               block_sizes={c: list(bs) for c, bs in sizes.items()},
               block_sizes_from="explicit" if check.block_sizes else "heuristic",
               workload=dict(q_lens=list(check.workload.q_lens), kv_lens=list(check.workload.kv_lens),
                             distribution=list(check.workload.distribution)),
               tolerance=3e-2 if "float8" in check.model.kv_dtype else 2e-2)
    t0 = time.perf_counter()
    try:
        dc, inp = device_arguments(task, get_kernel("rpa-tune"), int(tpu_info(dev.generation).vmem_capacity_bytes))
        kwargs = dict(dc.kwargs, **{block_sizes_arg(c): tuple(int(v) for v in bs) for c, bs in sizes.items()})
        dc = dataclasses.replace(dc, kwargs=kwargs)
        if dev.fake is not None:
            dc = dev.fake.device_call(dc, task)
        ref_out, ref_cache = ragged_paged_attention_fast(**inp, sm_scale=check.model.head_dim ** -0.5,
                                                         sliding_window=check.sliding_window, soft_cap=check.soft_cap)
        args = [jax.device_put(jnp.asarray(inp[k]), dev.jax_device) for k in ARG_ORDER]
        out, cache = dc.fn(*args, **dc.kwargs)
        out, cache = np.asarray(out), np.asarray(cache)
    except Exception as e:  # noqa: BLE001 - a path that does not compile or run is a failed row
        msg = " ".join(str(e).split())
        return dict(row, status=ERROR, seconds=time.perf_counter() - t0, max_abs_err=None,
                    cache_bytes_differing=None, problems=[f"{type(e).__name__}: {msg[-600:]}"])
    n = check.workload.num_tokens
    got, want = out[:n].astype(np.float32), np.asarray(ref_out)[:n].astype(np.float32)
    err = float(np.max(np.abs(got - want))) if np.all(np.isfinite(got)) else None
    ref_cache = np.asarray(ref_cache)
    differing = int(np.count_nonzero(cache.view(np.uint8) != ref_cache.view(np.uint8))) \
        if cache.shape == ref_cache.shape else None
    problems = reference_mismatches(out, cache, ref_out, ref_cache, n, check.model.kv_dtype)
    return dict(row, status=FAIL if problems else PASS, seconds=time.perf_counter() - t0, max_abs_err=err,
                cache_bytes_differing=differing, problems=problems)


def _result_dict(res) -> dict:
    keep = ("status", "method", "metric", "spread", "samples", "compile_s", "vmem_limit_bytes", "audit",
            "active_bound", "static_s", "calibration", "message")
    d = res.to_json()
    return {k: d.get(k) for k in keep}


def run_probe(p: Probe, dev: Device, bs: BlockSizes | None) -> dict:
    """One probe timed on the device by the tpu backend (its ``evaluate``)."""
    from .evaluators.tpu import TpuEvaluator
    if bs is None:
        return dict(status="skipped", message=f"{p.kernel} has no default block sizes for this key: not run")
    t0 = time.perf_counter()
    try:
        res = TpuEvaluator().evaluate(probe_task(p, dev.generation, bs, "tpu"))
        d = _result_dict(res)
    except Exception as e:  # noqa: BLE001 - reported as the probe's failure
        d = dict(status="crash", method="measured", message=f"{type(e).__name__}: {' '.join(str(e).split())[-600:]}")
    d["seconds"] = time.perf_counter() - t0
    return d


def run(*, quick: bool = False, estimate: bool = True, jobs: int = 2, log=None) -> dict:
    """The whole self-test on this machine's TPU: the report (``NoTpu`` without one)."""
    from .evaluators.tpu import timing_method
    from .kernels import get_kernel
    log = log or (lambda msg: None)
    t_start = time.perf_counter()
    try:
        timing = timing_method()
    except ValueError as e:                       # a bad $RPA_TUNE_TPU_TIMING
        raise SelftestError(str(e)) from None
    dev = find_device()
    gen = dev.generation
    plan = []
    for p in probes(quick):
        kern = get_kernel(p.kernel)
        key = p.key(gen)
        try:
            kern.check_available()
            bs = kern.heuristic(key, max_num_seqs=p.limits.max_num_seqs)
            why_not = None
        except Exception as e:  # noqa: BLE001 - the public kernel missing here
            bs, why_not = None, f"{type(e).__name__}: {e}"
        no_est = "not computed (--no-estimate)" if not estimate else (
            why_not or ("no default block sizes for this key" if bs is None else None))
        plan.append((p, key, bs, why_not, no_est))
    est = Estimates({i: probe_task(p, gen, bs, "compile", timeout=1800.0)
                     for i, (p, key, bs, why_not, no_est) in enumerate(plan) if no_est is None}, jobs).start()
    if est.tasks:
        log(f"estimating {len(est.tasks)} probe(s) deviceless in {est.jobs} compile worker(s), beside the device")
    rows = []
    todo = checks(quick)
    for i, c in enumerate(todo, 1):
        r = run_check(c, dev)
        err = "-" if r["max_abs_err"] is None else f"{r['max_abs_err']:.3g}"
        log(f"check [{i}/{len(todo)}] {r['status']}  {c.name}  (max abs err {err}, {r['seconds']:.1f} s)")
        rows.append(r)
    measured = []
    for i, (p, key, bs, why_not, _) in enumerate(plan, 1):
        m = run_probe(p, dev, bs) if why_not is None else dict(status="skipped", message=why_not)
        t = f"{m['metric'] * 1e6:.1f} us" if m.get("metric") else m.get("message", "")[:120]
        log(f"probe [{i}/{len(plan)}] {p.kernel} {p.case}: {m['status']} {t}")
        measured.append(m)
    if est.tasks:
        log("waiting for the estimates")
    done = est.results()
    probe_rows = []
    for i, ((p, key, bs, why_not, no_est), m) in enumerate(zip(plan, measured)):
        e = dict(status="unavailable", reason=no_est) if no_est is not None else _result_dict(done[i]) \
            if i in done else dict(status="unavailable", reason="the estimate did not finish")
        if e.get("status") not in ("ok", "unavailable"):
            e["reason"] = f"estimate failed ({e['status']}): {(e.get('message') or '')[-400:]}"
        ratio = e["metric"] / m["metric"] if e.get("status") == "ok" and e.get("metric") and m.get("metric") else None
        probe_rows.append(dict(kernel=p.kernel, case=p.case, shape=p.shape, key=key.id(),
                               workload=dict(num_seqs=p.workload.num_seqs, num_tokens=p.workload.num_tokens,
                                             kv_tokens=sum(p.workload.kv_lens)),
                               block_sizes=None if bs is None else list(bs), measured=m, estimate=e,
                               estimate_over_measured=ratio))
    failed_checks = [r["name"] for r in rows if r["status"] != PASS]
    failed_probes = [f"{r['kernel']} {r['case']}" for r in probe_rows if r["measured"]["status"] not in ("ok", "skipped")]
    return dict(schema=SCHEMA, verdict=FAIL if failed_checks or failed_probes else PASS, quick=quick,
                created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                device=dev.describe(), versions=versions(), timing_method=timing, scope=SCOPE,
                checks=rows, probes=probe_rows, failed_checks=failed_checks, failed_probes=failed_probes,
                elapsed_s=time.perf_counter() - t_start)


# ------------------------------------------------------------------ the report
def _us(s) -> str:
    return "-" if s is None else f"{s * 1e6:,.1f}"


def markdown(rep: dict) -> str:
    """The report as Markdown (what a user pastes into an issue)."""
    dev, v = rep["device"], rep["versions"]
    n_pass = sum(r["status"] == PASS for r in rep["checks"])
    lines = [f"# rpa-tune selftest: {rep['verdict']}", "",
             f"{n_pass} of {len(rep['checks'])} correctness checks passed; "
             f"{sum(p['measured']['status'] == 'ok' for p in rep['probes'])} of {len(rep['probes'])} probes timed"
             + (" (quick)" if rep["quick"] else "") + f"; {rep['elapsed_s']:.0f} s; {rep['created']}.", ""]
    if dev.get("stand_in"):
        lines += [f"**Not a TPU: {dev['stand_in']}.**", ""]
    lines += ["| | |", "|---|---|",
              f"| device | {dev['device_kind']} ({dev['generation']}), {dev['devices']} device(s); device 0: "
              f"{json.dumps(dev['device_0']) if dev['device_0'] else '-'} |",
              f"| TensorCores per chip | {dev['tensorcores_per_chip']} |",
              *(f"| {k} | {v[k] or '-'} |" for k in ("jax_version", "jaxlib_version", "libtpu_version",
                                                      "tpu_inference", "rpa_tune_version", "kernel_id",
                                                      "git_sha", "python")),
              f"| timing | {rep['timing_method']} (`$RPA_TUNE_TPU_TIMING`) |", "",
              "## Correctness: our kernel on the device against `kernel.reference`", "",
              "| check | case | heads q/kv | head_dim | KV | page | window | cap | block sizes | max abs err "
              "| tol | cache | result |",
              "|---|---|---|---:|---|---:|---:|---:|---|---:|---:|---|---|"]
    for r in rep["checks"]:
        bs = "; ".join(f"{c[0]} {tuple(b)}" for c, b in r["block_sizes"].items())
        cache = "-" if r["cache_bytes_differing"] is None else (
            "bit-exact" if r["cache_bytes_differing"] == 0 else f"{r['cache_bytes_differing']} bytes differ")
        err = "-" if r["max_abs_err"] is None else f"{r['max_abs_err']:.3g}"
        cap = "-" if r["soft_cap"] is None else f"{r['soft_cap']:g}"
        lines.append(f"| {r['name']} | {r['case']} | {r['num_q_heads']}/{r['num_kv_heads']} | {r['head_dim']} | "
                     f"{r['kv_dtype']} | {r['page_size']} | {r['sliding_window'] or '-'} | {cap} | "
                     f"{bs} ({r['block_sizes_from']}) | {err} | {r['tolerance']:g} | {cache} | **{r['status']}** |")
    bad = [r for r in rep["checks"] if r["problems"]]
    if bad:
        lines += ["", "Failures:", ""] + [f"* {r['name']}: {'; '.join(r['problems'])}" for r in bad]
    lines += ["", "## Probes: device time (`measured`) beside the deviceless `estimate`", "",
              f"{rep['scope']}", "",
              "| kernel | case | key | block sizes | measured µs | spread | samples | deviceless µs | method, audit, "
              "calibration | deviceless / measured |",
              "|---|---|---|---|---:|---:|---:|---:|---|---:|"]
    notes = []
    for p in rep["probes"]:
        m, e = p["measured"], p["estimate"]
        meas = _us(m.get("metric")) if m["status"] == "ok" else f"{m['status']}"
        spread = "-" if m.get("spread") is None else f"{m['spread']:.1%}"
        est = _us(e.get("metric")) if e["status"] == "ok" else e["status"]
        ratio = "-" if p["estimate_over_measured"] is None else f"{p['estimate_over_measured']:.2f}"
        bs = "-" if p["block_sizes"] is None else str(tuple(p["block_sizes"]))
        how = ", ".join(f"`{x}`" if i == 0 else x for i, x in enumerate(
            (e.get("method"), e.get("audit"), e.get("calibration"))) if x) or "-"
        lines.append(f"| {p['kernel']} | {p['case']} | `{p['key']}` | {bs} | {meas} | {spread} | "
                     f"{m.get('samples') or '-'} | {est} | {how} | {ratio} |")
        if m["status"] != "ok":
            notes.append(f"* {p['kernel']} {p['case']}, measured: {m['status']}: {(m.get('message') or '')[-300:]}")
        if e["status"] != "ok":
            notes.append(f"* {p['kernel']} {p['case']}, deviceless: {e.get('reason') or e['status']}")
        elif e.get("method") != "estimate":
            notes.append(f"* {p['kernel']} {p['case']}, deviceless: {(e.get('message') or '')[-300:]}")
    if notes:
        lines += ["", "Notes:", ""] + notes
    lines += ["", "Labels: `measured` = device time by the tpu backend (median of the samples, spread = "
              "interquartile range / median); `estimate` = the compile backend's deviceless estimate (its "
              "audit verdict, an `incomplete` one never ranks, and the device-cost calibration it is priced "
              "with; `static_s` in the JSON: the static estimate alone); `modelled` = the compile backend's "
              "price where no static estimate is possible (the device-cost model of the config's walk alone; "
              "the note says why). Full rows: `selftest.json`.", ""]
    return "\n".join(lines)


def write_report(rep: dict, out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    j, m = out / "selftest.json", out / "selftest.md"
    j.write_text(json.dumps(rep, indent=1, default=str) + "\n")
    m.write_text(markdown(rep))
    return j, m


def main(*, quick: bool, out: Path, estimate: bool, jobs: int, json_out: bool) -> int:
    """The command: run, write the report, print where; the exit code (``SelftestError``,
    ``NoTpu`` among them: raised before anything is written)."""
    def log(msg):
        print(msg, file=sys.stderr, flush=True)
    rep = run(quick=quick, estimate=estimate, jobs=jobs, log=log)
    j, m = write_report(rep, out)
    if json_out:
        print(json.dumps(rep, indent=1, default=str))
    else:
        n_pass = sum(r["status"] == PASS for r in rep["checks"])
        print(f"selftest {rep['verdict']}: {n_pass}/{len(rep['checks'])} checks passed on "
              f"{rep['device']['device_kind']}" + (f"; failed: {', '.join(rep['failed_checks'])}"
                                                    if rep["failed_checks"] else "")
              + (f"; probes failed on the device: {', '.join(rep['failed_probes'])}" if rep["failed_probes"] else ""))
        print(f"report: {m} and {j}")
    return 0 if rep["verdict"] == PASS else 1
