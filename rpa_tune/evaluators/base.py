"""The evaluator interface: one ``Task`` (a config on a problem) in, one ``EvalResult`` out.

Evaluators run inside worker subprocesses (``rpa_tune.worker``); a task and its result
cross the process boundary as JSON. Statuses:

* ``ok``: evaluated; ``metric`` holds seconds (``compile``/``tpu``) or is empty
  (``interpret``: correctness only).
* ``vmem_oom``: the compiler rejected the config for VMEM (bytes parsed from its message).
* ``compile_error``: any other lowering / compile failure.
* ``timeout``: the evaluation exceeded ``--timeout`` (the worker was killed).
* ``wrong_result``: the output differs from the reference; such a config never wins.
* ``crash``: the worker process died (e.g. a libtpu CHECK failure), or the static
  profiler crashed on a config that compiles.
"""
from __future__ import annotations

import abc
import dataclasses
import math
import os

from kernel.config import BlockSizes, Case
from kernel.workload import ModelShape, ServingLimits, Workload

OK, VMEM_OOM, COMPILE_ERROR, TIMEOUT, WRONG_RESULT, CRASH = (
    "ok", "vmem_oom", "compile_error", "timeout", "wrong_result", "crash")
STATUSES = (OK, VMEM_OOM, COMPILE_ERROR, TIMEOUT, WRONG_RESULT, CRASH)
BACKENDS = ("tpu", "compile", "interpret")

# Test-only hook: "module:callable" returning an Evaluator, used by workers instead of
# the named backend (tests inject fakes that crash, hang or corrupt outputs).
EVALUATOR_OVERRIDE_ENV = "RPA_TUNE_EVALUATOR_OVERRIDE"


@dataclasses.dataclass(frozen=True)
class Task:
    """One evaluation request (JSON-serialisable)."""

    backend: str
    generation: str
    case: str
    model: ModelShape
    limits: ServingLimits
    workload: Workload
    bs: BlockSizes
    timeout: float = 600.0
    seed: int = 0
    vmem_predicted_bytes: int | None = None
    sliding_window: int | None = None        # the attention window the kernel runs with
    kernel: str = "rpa-tune"                 # the tuned kernel (rpa_tune.kernels)
    soft_cap: float | None = None            # the logit soft cap the kernel runs with
    heuristic: bool = False                  # the key's heuristic (its baseline)

    def to_json(self) -> dict:
        return dict(backend=self.backend, generation=self.generation, case=self.case,
                    model=dataclasses.asdict(self.model), limits=dataclasses.asdict(self.limits),
                    workload=dict(q_lens=list(self.workload.q_lens), kv_lens=list(self.workload.kv_lens),
                                  distribution=list(self.workload.distribution)),
                    bs=list(self.bs), timeout=self.timeout, seed=self.seed,
                    vmem_predicted_bytes=self.vmem_predicted_bytes, sliding_window=self.sliding_window,
                    kernel=self.kernel, soft_cap=self.soft_cap, heuristic=self.heuristic)

    @classmethod
    def from_json(cls, d: dict) -> "Task":
        w = d["workload"]
        return cls(backend=d["backend"], generation=d["generation"], case=Case.parse(d["case"]).value,
                   model=ModelShape(**d["model"]), limits=ServingLimits(**d["limits"]),
                   workload=Workload(tuple(w["q_lens"]), tuple(w["kv_lens"]), tuple(w["distribution"])),
                   bs=BlockSizes(*d["bs"]), timeout=float(d["timeout"]), seed=int(d["seed"]),
                   vmem_predicted_bytes=d.get("vmem_predicted_bytes"), sliding_window=d.get("sliding_window"),
                   kernel=d.get("kernel") or "rpa-tune", soft_cap=d.get("soft_cap"),
                   heuristic=bool(d.get("heuristic", False)))


@dataclasses.dataclass
class EvalResult:
    status: str
    method: str                             # "estimate" | "measured" | "correctness"
    metric: float | None = None             # seconds, lower is better
    unit: str = "s"
    cycles: float | None = None
    estimate_s: float | None = None
    memory_bound_s: float | None = None
    compute_bound_s: float | None = None
    active_bound: str | None = None
    samples: int | None = None
    spread: float | None = None             # relative spread of the samples (IQR / median)
    compile_s: float | None = None
    vmem_limit_bytes: int | None = None
    vmem_reported_bytes: int | None = None  # bytes the compiler reported (OOM messages)
    device_kind: str | None = None
    message: str = ""
    audit: str | None = None                # compile: complete | incomplete (estimator.audit)
    clock_hz: float | None = None           # compile: the calibrated clock cycles are converted at
    clock_source: str | None = None
    static_s: float | None = None           # the static estimate's time (metric: the device-cost model's)
    calibration: str | None = None          # the device-cost model's calibration version ("none": static)
    walk: dict | None = None                # device_model.Features of the config's walk (re-pricing)

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"unknown status {self.status!r}; valid: {STATUSES}")
        if self.metric is not None and not math.isfinite(self.metric):
            self.metric = None

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "EvalResult":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


class Evaluator(abc.ABC):
    """Evaluates one config. Implementations must classify their own failures into a
    status; anything they raise is recorded as ``compile_error`` by the worker, and a
    process death as ``crash`` by the engine."""

    name: str = ""
    method: str = ""
    version: str = "1"   # bump when the evaluator's semantics change (part of config_id)
    # a case whose pricing alone changed: its own version, so a new one re-prices that
    # case's keys only (``rpa_tune.evaluators.evaluator_version``)
    case_versions: dict = {}
    # a generation whose pricing alone changed: its own version, appended to the case's, so
    # a new one re-prices that generation's keys only
    generation_versions: dict = {}

    @abc.abstractmethod
    def evaluate(self, task: Task) -> EvalResult: ...


_LIBTPU_QUIET = {"TPU_WORKER_HOSTNAMES": "localhost", "TF_CPP_MIN_LOG_LEVEL": "3",
                 "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


def worker_env(backend: str, base: dict | None = None, jobs: int = 1) -> dict:
    """The environment of a worker process for ``backend`` (set before JAX loads).

    compile / interpret: JAX on CPU (libtpu still compiles deviceless), parallel libtpu
    loads allowed, and no persistent compilation cache: a cache hit would skip the
    compile whose static profile and VMEM verdict the compile backend needs. compile: each
    of the ``jobs`` workers compiles its config's probes on an equal share of the cores
    (``$RPA_TUNE_PROBE_WORKERS`` if set).
    tpu: JAX picks the TPU; the persistent compilation cache is on (``$JAX_COMPILATION_CACHE_DIR``
    or ``~/.cache/rpa-tune/jax``) so re-runs do not recompile.
    """
    env = dict(os.environ if base is None else base)
    if backend in ("compile", "interpret"):
        env.update(_LIBTPU_QUIET)
        env["JAX_PLATFORMS"] = "cpu"
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
        env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
        if backend == "compile":
            from rpa_tune.estimator.compose import PROBE_WORKERS_ENV
            env.setdefault(PROBE_WORKERS_ENV, str(max(1, (os.cpu_count() or 1) // max(1, int(jobs)))))
    elif backend == "tpu":
        env.pop("JAX_PLATFORMS", None)
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        env.setdefault("JAX_COMPILATION_CACHE_DIR", compilation_cache_dir())
    return env


def compilation_cache_dir() -> str:
    return os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "rpa-tune", "jax")


# ------------------------------------------------------------------ VMEM limit policy
def initial_vmem_limit(predicted_bytes: int, capacity: int) -> int:
    """The scoped VMEM limit first requested for a config: the kernel's own default for
    its predicted scratch (``kernel.vmem.default_vmem_limit``), i.e. what the kernel uses
    when a table gives no limit."""
    from kernel.vmem import default_vmem_limit
    return int(default_vmem_limit(int(predicted_bytes), int(capacity)))


def task_vmem_limit(task: "Task", kern, capacity: int) -> int:
    """The scoped VMEM limit a task's first compile asks for: the one ``kern`` runs with
    (``TunedKernel.compile_vmem_limit``; all of VMEM for tpu-inference, ours' own default
    for its scratch) for the task's predicted scratch (the sweep's prediction, else the
    kernel's own, ``TunedKernel.predicted_vmem_bytes``). The one rule the compile and tpu
    backends, ``rpa_tune.estimator.public``'s default and ``benchmarks/vs_public.py`` share;
    a profiled compile at it gets the VMEM size override its kernel needs
    (``rpa_tune.estimator.profiler.deviceless_vmem_args``)."""
    predicted = task.vmem_predicted_bytes
    if predicted is None:
        predicted = kern.predicted_vmem_bytes(task.model, task.limits, task.bs, task.case)
    return kern.compile_vmem_limit(predicted, capacity)


def raised_vmem_limit(reported_bytes: int, current_limit: int, capacity: int) -> int | None:
    """A larger limit to retry with after a scoped-limit OOM that reported
    ``reported_bytes``: 5% + 1 MiB headroom, MiB-aligned, at most the chip's capacity
    (the compiler accepts limits up to the capacity and fails with "Ran out of memory in
    memory space vmem" only when the kernel's own use exceeds it).
    None when no larger limit can help."""
    want = min(_with_headroom(reported_bytes), int(capacity))
    return want if want > current_limit and reported_bytes <= capacity else None


def _with_headroom(nbytes: int) -> int:
    """``nbytes`` + 5% + 1 MiB, MiB-aligned."""
    mib = 1 << 20
    return -(-int(nbytes * 1.05 + mib) // mib) * mib


def lowered_vmem_limit(scoped_bytes: int, capacity: int) -> int | None:
    """A smaller limit to retry with after a whole-program OOM ("Used X of <capacity>")
    of a compile under libtpu's static profiler: the program's scoped allocations (the
    kernel's scratch and spill slots, ``profiler.scoped_allocation_bytes``) + 1%,
    MiB-aligned: the least limit they fit in.

    A plain compile can fit at the kernel's default limit while, with the profiler on,
    the program needs the scoped limit plus the scoped allocations plus its "HLO temp"
    (docs/estimator.md, "Lowering deviceless"; figures in notebook.md), so a smaller limit
    can fit where the default does not. None when the smaller limit would not be below
    capacity."""
    mib = 1 << 20
    want = -(-int(scoped_bytes * 1.01) // mib) * mib
    return want if 0 < scoped_bytes and want < capacity else None


def next_vmem_limit(vmem: dict, limit: int | None, capacity: int, tried: set) -> int | None:
    """The scoped limit to retry a VMEM OOM with (``vmem``: the parsed OOM; ``limit``: the
    limit it failed at, None for the kernel's default), or None: raised after a
    scoped-limit OOM, lowered after a whole-program one under the profiler, never a limit
    already ``tried`` (so the two rules cannot alternate)."""
    kind, used = vmem.get("kind"), int(vmem.get("used_bytes") or 0)
    new = None
    if kind == "scoped_limit" and used:
        new = raised_vmem_limit(used, int(vmem.get("limit_bytes") or 0) if limit is None else limit, capacity)
    elif kind == "capacity" and vmem.get("scoped_bytes"):
        new = lowered_vmem_limit(int(vmem["scoped_bytes"]), capacity)
    return None if new is None or new in tried or new == limit else new
