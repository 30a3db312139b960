"""The kernels rpa-tune tunes, behind one interface: ``TunedKernel``.

One implementation per kernel, one module each: ``ours`` (this project's kernel,
``rpa-tune``) and ``tpu_inference`` (tpu-inference's RPA v3, the kernel vLLM-TPU and
SGLang-JAX run). Everything the tuner does differently for a kernel is a method or an
attribute of its ``TunedKernel``: how the estimator lowers and probes it, its legality
rules, its baseline, its VMEM limits, its version, how it is called on a device, where its
tables live and which server formats it exports. Nothing outside the implementations asks
which kernel it is. Adding a kernel is one module with a ``TunedKernel`` subclass, named in
``BUILT_IN`` or registered with ``register`` (``$RPA_TUNE_EXTRA_KERNELS``: ``module:attr``
entries, comma-separated, are registered on import, in every process of a sweep).
"""
from __future__ import annotations

import dataclasses
import importlib
import os

from kernel.config import BlockSizes, Case, TuningKey

EXTRA_KERNELS_ENV = "RPA_TUNE_EXTRA_KERNELS"


class KernelError(ValueError):
    """A kernel name that is not known, or a kernel that cannot be used here (one line)."""


@dataclasses.dataclass(frozen=True)
class ProbePlan:
    """How the estimator (``rpa_tune.estimator.compose.probe_config``) probes one config of
    a kernel: which probe workloads, which profiler options, what the audit asks for, and
    the cache-key tags that keep verdicts of differently probed programs apart."""
    skip_dead_chunks: bool = True      # the kernel runs no compute chunk past a sequence's KV
    mixed_warm_up: bool = False        # mixed probes start with the warm-up decode sequences
    long_walk: bool = False            # prefill probes include the long-walk probe
    fast_forward: bool = False         # the profiler may fast-forward loops (audited, retried)
    walk_new: bool = False             # decode probes walk the new token's KV separately
    padded_twin: bool = False          # a head_dim below 128 lanes may read its padded twin's probes
    place_new_kv_on_no_estimate: bool = False   # profiled again with the new K/V in VMEM
    page_bound_audit: bool = False     # the audit counts the cache's page DMAs at one page each
    cache_tags: tuple = ()             # (key, value) pairs added to the probe-cache key


@dataclasses.dataclass(frozen=True)
class DeviceCall:
    """How the TPU evaluator calls a kernel, in one place: the function (the serving
    signature), the kernel-name prefix its device trace is read by, the scoped VMEM limit
    to call it with (None: the tuner's own limit search), the keyword arguments of the call
    (``kwargs``: the attention options and the block sizes of every case, the same the
    estimator lowers the kernel with; the VMEM limit is passed apart) and the dtype the new
    tokens' K/V are passed in (``new_kv_dtype``; None: as ``kernel.workload.make_inputs``
    builds them, the queries' dtype)."""
    fn: object
    prefix: str
    vmem_limit_bytes: int | None = None
    kwargs: dict = dataclasses.field(default_factory=dict)
    new_kv_dtype: str | None = None


class TunedKernel:
    """One kernel the tuner tunes. Subclasses set the class attributes and implement the
    methods that raise ``NotImplementedError``."""

    name: str = ""
    doc: str = ""
    builder: str = ""                 # "module:function" the profiler child lowers (rpa_tune.estimator)
    writes_kv_cache: bool = True      # the lowered program writes the new tokens' K/V into the cache
    interpretable: bool = False       # runs in the Pallas TPU interpreter (the interpret backend)
    table_subdir: str | None = None   # its tables' folder under a tables directory (None: the top)
    server_formats: tuple = ()        # `rpa-tune export --format` values that write for its servers
    records_vmem_limit: bool = False  # a table entry records the scoped VMEM limit it was tuned with
    baseline_may_be_missing: bool = False   # no default block sizes for some keys (none runs then)
    rejudgeable: bool = False         # its estimate rows can be re-audited (rpa_tune.estimator.rejudge)
    cases: tuple = ("decode", "prefill", "mixed")   # the `--case` values it is tuned for

    # -- identity -------------------------------------------------------------------------
    def check_available(self) -> None:
        """Raise ``KernelError`` (one line with the install command) if it cannot be used."""

    def version(self) -> str | None:
        """What a result row and a table record as the kernel's version (None: unknown here)."""
        raise NotImplementedError

    def config_version(self) -> str | None:
        """The kernel's part of a result's resume id (``store.config_id``); None when it
        cannot be known here."""
        return self.version()

    def fingerprint(self, version: str | None, jax_version: str | None) -> str | None:
        """The recorded program fingerprint of ``version`` of this kernel under ``jax_version``
        (``rpa_tune.fingerprint``), or None when none is recorded."""
        return None

    def row_provenance(self, prov: dict) -> dict:
        """The provenance columns of a results row of this kernel (``provenance.provenance``
        with the kernel's own version where it differs)."""
        return dict(prov, kernel_hash=self.config_version(), kernel_source_hash=None)

    # -- rules and baseline -----------------------------------------------------------------
    def block_size_errors(self, case: Case | str, bs: BlockSizes, page_size: int) -> list[str]:
        raise NotImplementedError

    def heuristic(self, key: TuningKey, *, max_num_seqs: int = 128) -> BlockSizes | None:
        """The key's baseline: what the kernel runs without tuned sizes (None: it has none)."""
        raise NotImplementedError

    def table_block_sizes(self, key: TuningKey):
        """What the kernel's own lookup at serving time resolves for ``key`` from the tables it
        ships: ``(block sizes, where from, the entry's VMEM limit or None)``, or None (no
        table of its own, or no entry: its baseline applies)."""
        return None

    # -- VMEM --------------------------------------------------------------------------------
    def predicted_vmem_bytes(self, model, limits, bs: BlockSizes, case) -> int | None:
        """The kernel's own VMEM need for ``bs`` (the pre-filter's prediction), None if unknown."""
        return None

    def vmem_limit(self, capacity: int, predicted: int | None = None) -> int:
        """The scoped VMEM limit the kernel runs with on a chip of ``capacity`` bytes of VMEM
        (for a config of ``predicted`` scratch bytes): the limit its configs are judged at."""
        return capacity // 2

    def compile_vmem_limit(self, predicted: int | None, capacity: int) -> int:
        """The scoped VMEM limit a deviceless compile starts at."""
        return self.vmem_limit(capacity, predicted)

    def profiled_vmem_bytes(self, limit: int, capacity: int, plain_bytes: int | None = None) -> int | None:
        """The VMEM size a profiled deviceless compile at scoped ``limit`` is given (libtpu's
        VMEM-size override) so that it passes exactly when the plain compile does, or None:
        no override (the kernel's limit leaves room beside it for the profiler's reservation)."""
        return None

    # -- estimator ---------------------------------------------------------------------------
    def probe_plan(self, case: Case, bs: BlockSizes, tpu: str, model, page_size: int) -> ProbePlan:
        return ProbePlan()

    def walk(self, workload, model, case, bs: BlockSizes, page_size: int, sliding_window=None):
        """The bytes the kernel's KV walk fetches beyond the model's need, for the audit's
        rate check (``audit.walk_bytes``), or None when not modelled."""
        return None

    def refused_estimate(self, key: TuningKey) -> str | None:
        """Why an estimate of ``key`` cannot promote an entry (a device must time it), or None."""
        return None

    def composition_error(self, case, bs: BlockSizes, evaluator_version: str | None) -> float:
        """How far below whole compiles its composed estimates may be for ``bs`` (a fraction)."""
        return 0.0

    # -- device ------------------------------------------------------------------------------
    def device_call(self, case: str, bs: BlockSizes, page_size: int, capacity: int, *, task=None) -> DeviceCall:
        """The device call of ``bs`` for ``case``; with ``task`` (``evaluators.base.Task``),
        its complete keyword arguments for the task's key and workload."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<TunedKernel {self.name}>"


# ------------------------------------------------------------------------------ registry
# (name, "module:attr") of the kernels built in; the first is the default.
BUILT_IN = (("rpa-tune", "rpa_tune.kernels.ours:KERNEL"),
            ("tpu-inference", "rpa_tune.kernels.tpu_inference:KERNEL"),
            ("sglang-jax", "rpa_tune.kernels.sglang_jax:KERNEL"))
DEFAULT = BUILT_IN[0][0]          # this project's kernel
REFERENCE = BUILT_IN[1][0]        # the public kernel side-by-side comparisons hold ours against
KERNELS: dict[str, TunedKernel] = {}


def _load(spec: str) -> TunedKernel:
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)


def register(kern: TunedKernel) -> TunedKernel:
    """Add a kernel (by its ``name``); returns it."""
    if not kern.name:
        raise KernelError("a tuned kernel needs a name")
    KERNELS[kern.name] = kern
    return kern


def _register_all() -> None:
    for _, spec in BUILT_IN:
        register(_load(spec))
    for spec in filter(None, (s.strip() for s in os.environ.get(EXTRA_KERNELS_ENV, "").split(","))):
        try:
            register(_load(spec))
        except (ImportError, AttributeError, ValueError) as e:
            raise KernelError(f"{EXTRA_KERNELS_ENV}: cannot load {spec!r} ({e})") from None


def get_kernel(name: str | None) -> TunedKernel:
    if not KERNELS:
        _register_all()
    try:
        return KERNELS[name or DEFAULT]
    except KeyError:
        raise KernelError(f"unknown kernel {name!r}; valid: {', '.join(KERNELS)}") from None


def kernel_names() -> list[str]:
    if not KERNELS:
        _register_all()
    return list(KERNELS)


def kernel_for_builder(builder: str) -> TunedKernel | None:
    """The kernel whose estimator builder is ``builder`` (None: no registered kernel's)."""
    return next((k for k in (get_kernel(n) for n in kernel_names()) if k.builder == builder), None)


def row_kernel(value) -> str:
    """The kernel a results row names (its ``kernel`` column); null, NaN or missing (rows
    written before there were two kernels) is the default kernel."""
    return value if isinstance(value, str) and value else DEFAULT


def key_id(key: TuningKey, kernel: str) -> str:
    """A results row's ``key_id``: the key's id, prefixed by the kernel unless it is the
    default one (whose rows keep the ids they always had)."""
    return key.id() if kernel in (None, DEFAULT) else f"{kernel}:{key.id()}"


def table_dir(out_dir, kernel: str):
    """Where ``kernel``'s tables live under a tables directory (its ``table_subdir``)."""
    from pathlib import Path
    out = Path(out_dir)
    sub = get_kernel(kernel).table_subdir
    return out if sub is None or out.name == sub else out / sub
