"""tpu-inference's RPA v3 (PyPI ``tpu-inference``, pinned in ``rpa_tune.public_kernel``),
the kernel vLLM-TPU and SGLang-JAX run, as a tuned kernel.

* Lowered for the static profiler by ``rpa_tune.estimator.public`` with its KV-cache
  write-back off (the audit does not ask for those bytes; that module's doc).
* Its legality rules are those its own ``static_validate_inputs`` checks (``bq % cq``,
  ``bkv % ckv``, ``bkv`` and ``ckv`` multiples of the page size), plus a tuner rule for
  decode (one sequence's one token per q block).
* Its baseline is its own ``get_default_block_sizes``, computed by the installed package
  for the target generation (None where it has none, e.g. v4).
* Its VMEM limit is all of the chip's VMEM on every generation (its own default,
  ``pltpu.get_tpu_info().vmem_capacity_bytes``, which vLLM-TPU's call leaves in place):
  ``vmem_limit``, the one rule its compile verdicts, its device call and
  ``benchmarks/vs_public.py`` use. Deviceless, the static profiler's compile reserves the
  whole limit beside the kernel's scoped allocations, so its profiled compiles get libtpu's
  VMEM size override (``profiled_vmem_bytes``; ``rpa_tune.estimator.profiler``).
* Its version is its package version: editing our kernel does not touch its results.
* Its tables live in ``<tables>/tpu-inference/``; its block sizes reach servers through
  ``rpa-tune export --format vllm-env`` / ``sglang``.
"""
from __future__ import annotations

from kernel.config import BlockSizes, Case, TuningKey, get_generation

from . import DeviceCall, KernelError, ProbePlan, TunedKernel

NAME = "tpu-inference"


class TpuInference(TunedKernel):
    name = NAME
    doc = "tpu-inference's RPA v3 (the kernel vLLM-TPU and SGLang-JAX run)"
    builder = "rpa_tune.estimator.public:lower"
    writes_kv_cache = False
    interpretable = False
    table_subdir = NAME
    server_formats = ("vllm-env", "sglang")
    baseline_may_be_missing = True

    def check_available(self) -> None:
        from ..public_kernel import PublicKernelMissing, load_kernel_module
        try:
            load_kernel_module()     # installed, the pinned version, and importable here
        except PublicKernelMissing as e:
            raise KernelError(str(e)) from None

    def version(self) -> str | None:
        from ..public_kernel import installed_version
        v = installed_version()
        return None if v is None else f"{NAME}=={v}"

    def block_size_errors(self, case, bs: BlockSizes, page_size: int) -> list[str]:
        errs = public_block_size_errors(bs, page_size)
        if Case.parse(case) == Case.DECODE and bs.bq != 1:
            # (a tuner rule, not the package's: its decode q block holds one sequence's
            # tokens, so a larger one only pads; our decode's bq is sequences per step)
            errs.append(f"bq={bs.bq}: the public kernel's decode q block holds one sequence's one token "
                        f"(only bq == 1 is a candidate)")
        return errs

    def heuristic(self, key: TuningKey, *, max_num_seqs: int = 128) -> BlockSizes | None:
        return public_default_block_sizes(key, max_num_seqs=max_num_seqs)

    def vmem_limit(self, capacity: int, predicted: int | None = None) -> int:
        """The scoped VMEM limit it runs with on a chip of ``capacity`` bytes of VMEM: all of
        it, on every generation (its ``ragged_paged_attention`` defaults ``vmem_limit_bytes``
        to the chip's VMEM capacity), whatever its scratch (``predicted``)."""
        return int(capacity)

    def compile_vmem_limit(self, predicted, capacity: int) -> int:
        return self.vmem_limit(capacity, predicted)     # its configs are judged at the limit it runs with

    def profiled_vmem_bytes(self, limit: int, capacity: int, plain_bytes: int | None = None) -> int:
        """The VMEM size (libtpu's ``--xla_tpu_override_vmem_size_kib``) a profiled
        deviceless compile at scoped ``limit`` is given so that it passes exactly when the
        plain compile does with ``plain_bytes`` of VMEM (default ``capacity``): ``plain_bytes +
        limit``. With the static profiler on, the compiler reserves the whole scoped limit as
        "HLO temp" and places the kernel's scoped allocations (scratch, spill slots) beside
        it; the plain compile (a server's) places them inside the limit. The scoped-limit
        check is the same in both. (Measured on TPU7x: docs/estimator.md, "Lowering
        deviceless".)"""
        return int(plain_bytes if plain_bytes is not None else capacity) + int(limit)

    def probe_plan(self, case: Case, bs: BlockSizes, tpu: str, model, page_size: int) -> ProbePlan:
        # its probes' audit counts run-time-sized page DMAs at one page (audit doc), and its
        # decode probes walk the new token separately (compose.pipeline_steps)
        walk_new = case == Case.DECODE
        tags = [("public_audit", "page-bound")] + ([("walk_new", True)] if walk_new else [])
        return ProbePlan(skip_dead_chunks=True, walk_new=walk_new, page_bound_audit=True, cache_tags=tuple(tags))

    def device_call(self, case: str, bs: BlockSizes, page_size: int, capacity: int, *, task=None) -> DeviceCall:
        from ..public_kernel import load_kernel_module
        kw, kv_dtype = ({}, None) if task is None else (device_kwargs(task), task.model.kv_dtype)
        return DeviceCall(load_kernel_module().ragged_paged_attention,
                          f"RPA{case[0]}-p_{page_size}-bq_{bs.bq}_{bs.cq}-bkv_",
                          vmem_limit_bytes=self.vmem_limit(capacity),
                          kwargs=kw, new_kv_dtype=kv_dtype)   # it requires K/V in the cache's dtype


def chunk_prefill_size(case, workload) -> int | None:
    """The public kernel's ``chunk_prefill_size`` for ``case`` of ``workload``: its prefill
    kernel is launched only when it is given, and runs fixed-size chunks, so every prefill
    sequence must have the same ``q_len`` (it is that length); None for the other cases."""
    if Case.parse(case) != Case.PREFILL:
        return None
    lo, hi = workload.case_range(Case.PREFILL)
    q = set(workload.q_lens[lo:hi])
    if len(q) != 1:
        raise ValueError(f"the public kernel's prefill case is fixed-size chunks: every prefill "
                         f"sequence needs the same q_len, got {sorted(q)}")
    return q.pop()


def device_kwargs(task) -> dict:
    """The keyword arguments of the public kernel's device call for ``task``: those the
    estimator lowers it with (``rpa_tune.estimator.public.lower``: ``sm_scale``,
    ``chunk_prefill_size``, the case's block sizes, None for the other cases (its own
    defaults), ``sliding_window`` / ``soft_cap`` when the key has them), without the
    estimator's deviceless-only choice (``update_kv_cache=False``); the VMEM limit is passed
    apart (``TpuInference.vmem_limit``)."""
    case = Case.parse(task.case)
    bst = tuple(int(v) for v in task.bs)
    kw = dict(sm_scale=task.model.head_dim ** -0.5, chunk_prefill_size=chunk_prefill_size(case, task.workload),
              d_block_sizes=bst if case == Case.DECODE else None,
              p_block_sizes=bst if case == Case.PREFILL else None,
              m_block_sizes=bst if case == Case.MIXED else None)
    if task.sliding_window is not None:
        kw["sliding_window"] = int(task.sliding_window)
    if task.soft_cap is not None:
        kw["soft_cap"] = float(task.soft_cap)
    return kw


def public_block_size_errors(bs: BlockSizes, page_size: int) -> list[str]:
    """The block-size checks of tpu-inference's ``static_validate_inputs`` (0.32.0): ``bq %
    cq``, ``bkv % ckv``, ``bkv`` and ``ckv`` multiples of the page size. They are ours without
    our decode-only rule (``bq == cq``, sequences per step), so ours for a non-decode case state
    them (``tests/test_public_backend.py`` checks them against the package)."""
    from kernel.config import block_size_errors
    return block_size_errors(Case.PREFILL, bs, page_size)


def public_default_block_sizes(key: TuningKey, *, max_num_seqs: int = 128) -> BlockSizes | None:
    """What the public kernel runs for ``key`` without block sizes: its own
    ``get_default_block_sizes``, evaluated by the installed package with its TPU version
    set to the key's generation. None where it has no default (it raises, e.g. on v4)."""
    from ..public_kernel import TPU_VERSION, load_kernel_module
    mod = load_kernel_module()
    version = TPU_VERSION.get(get_generation(key.generation).name)
    case = {"decode": mod.RpaCase.DECODE, "prefill": mod.RpaCase.PREFILL, "mixed": mod.RpaCase.MIXED}[key.case]
    old = mod.get_tpu_version
    mod.get_tpu_version = lambda: version
    try:
        d = mod.get_default_block_sizes(key.q_dtype, key.kv_dtype, key.num_q_heads, key.num_kv_heads,
                                        key.head_dim, key.page_size, key.max_num_tokens, max_num_seqs,
                                        key.max_model_len // key.page_size, case=case)
    except NotImplementedError:
        return None
    finally:
        mod.get_tpu_version = old
    return BlockSizes(d["bq_sz"], d["bkv_sz"], d["bq_csz"], d["bkv_csz"])


KERNEL = TpuInference()
