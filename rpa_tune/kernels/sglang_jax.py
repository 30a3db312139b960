"""SGLang-JAX's RPA v3 (PyPI ``sglang-jax``, pinned in ``rpa_tune.public_kernel.SGLANG_JAX``),
the copy of the v3 kernel SGLang-JAX's servers run, as a tuned kernel.

* Its kernel module (``sgl_jax/srt/kernels/ragged_paged_attention/ragged_paged_attention_v3.py``)
  is imported without the server (``rpa_tune.public_kernel.PinnedPackage``) and lowered for
  the static profiler by ``rpa_tune.estimator.sglang``, with the probing of tpu-inference's
  copy (the same kernel design: ``TpuInference.probe_plan``, its profiled VMEM override).
* Its legality rules are its ``static_validate_inputs`` block-size checks (``bq % cq``,
  ``bkv % ckv``, ``bkv`` and ``ckv`` multiples of the page size), plus the tuner's decode
  rule (its decode kernel clamps the q block to one token, so only ``bq == 1`` is a
  candidate).
* Its baseline is its own ``get_default_block_sizes`` for the key's generation, called as
  its wrapper calls it (its VMEM limit, the key's tokens and pages per sequence): the q
  block capped at 32 outside decode, a KV-block halving loop under 30 % of the limit. None
  on v4 (it raises ``NotImplementedError``). The verify stage's baseline is the mixed
  heuristic: without a verify entry the server runs the mixed kernel with its mixed sizes.
* Its VMEM limit is its ``get_vmem_limit``: all of VMEM on v7, half on v5 / v6 (and v4).
* Stages: decode, prefill, mixed and verify (``Case.VERIFY``: SGLang-JAX's target-verify
  stage ``"v"``, a few draft tokens per sequence on long contexts, run by its mixed kernel
  with the verify entry's sizes; its bq is a cap the server clamps to the draft-token
  count). Its server passes no ``chunk_prefill_size``, so it runs prefill sequences in the
  mixed kernel: a prefill entry is read only by callers that pass one.
* Its tables live in ``<tables>/sglang-jax/``; they reach servers through ``rpa-tune
  export --kernel sglang-jax --format sglang`` (``rpa_tune.server_formats``).
"""
from __future__ import annotations

from kernel.config import BlockSizes, Case, TuningKey, get_generation

from . import DeviceCall, KernelError
from .tpu_inference import TpuInference, public_block_size_errors

NAME = "sglang-jax"
STAGES = {"decode": "d", "prefill": "p", "mixed": "m", "verify": "v"}


def _package():
    from ..public_kernel import SGLANG_JAX
    return SGLANG_JAX


def tpu_version(generation: str) -> int:
    """The TPU version SGLang-JAX's ``get_tpu_version`` reads for ``generation``."""
    from ..public_kernel import TPU_VERSION
    return TPU_VERSION[get_generation(generation).name]


def program_case(case) -> Case:
    """The kernel of SGLang-JAX's that runs ``case``: verify runs in its mixed kernel."""
    c = Case.parse(case)
    return Case.MIXED if c == Case.VERIFY else c


class SglangJax(TpuInference):
    name = NAME
    doc = "SGLang-JAX's RPA v3 (its own copy of the kernel, with a target-verify stage)"
    builder = "rpa_tune.estimator.sglang:lower"
    writes_kv_cache = False
    interpretable = False
    table_subdir = NAME
    server_formats = ("sglang",)
    baseline_may_be_missing = True
    cases = ("decode", "prefill", "mixed", "verify")

    def check_available(self) -> None:
        from ..public_kernel import PublicKernelMissing
        try:
            _package().load_kernel_module()
        except PublicKernelMissing as e:
            raise KernelError(str(e)) from None

    def version(self) -> str | None:
        v = _package().installed_version()
        return None if v is None else f"{NAME}=={v}"

    def block_size_errors(self, case, bs: BlockSizes, page_size: int) -> list[str]:
        errs = public_block_size_errors(bs, page_size)
        if Case.parse(case) == Case.DECODE and bs.bq != 1:
            errs.append(f"bq={bs.bq}: SGLang-JAX's decode kernel clamps the q block to one token "
                        f"(only bq == 1 is a candidate)")
        return errs

    def heuristic(self, key: TuningKey, *, max_num_seqs: int = 128) -> BlockSizes | None:
        return default_block_sizes(key, max_num_seqs=max_num_seqs)

    def vmem_limit(self, capacity: int, predicted: int | None = None, generation: str | None = None) -> int:
        """Its ``get_vmem_limit``: all of ``capacity`` on v7, half of it on the others. Without
        ``generation`` the capacity names it (TPU7x's 64 MiB is v5p's too: there the
        estimator's builder, which knows the generation, applies the rule itself)."""
        if generation is None:
            from kernel.hardware import tpu_info
            seven = int(tpu_info("tpu7x").vmem_capacity_bytes) == int(capacity)
        else:
            seven = tpu_version(generation) == 7
        return int(capacity) if seven else int(capacity) // 2

    def device_call(self, case: str, bs: BlockSizes, page_size: int, capacity: int, *, task=None) -> DeviceCall:
        mod = _package().load_kernel_module()
        kw, kv_dtype, gen = ({}, None, None) if task is None else (device_kwargs(task), task.model.kv_dtype,
                                                                   task.generation)
        sym = {"decode": "d", "prefill": "p"}.get(Case.parse(case).value, "m")
        return DeviceCall(mod.ragged_paged_attention, f"RPA{sym}-p_{page_size}-bq_{bs.bq}_{bs.cq}-bkv_",
                          vmem_limit_bytes=self.vmem_limit(capacity, generation=gen),
                          kwargs=kw, new_kv_dtype=kv_dtype)


def device_kwargs(task) -> dict:
    """The keyword arguments of SGLang-JAX's call for ``task`` (as its attention backend
    calls it: no ``chunk_prefill_size`` unless the case is prefill, the case's block sizes,
    None for the others)."""
    from .tpu_inference import chunk_prefill_size
    case = Case.parse(task.case)
    bst = tuple(int(v) for v in task.bs)
    run = program_case(case)
    kw = dict(sm_scale=task.model.head_dim ** -0.5, chunk_prefill_size=chunk_prefill_size(run, task.workload),
              d_block_sizes=bst if run == Case.DECODE else None,
              p_block_sizes=bst if run == Case.PREFILL else None,
              m_block_sizes=bst if run == Case.MIXED else None)
    if task.sliding_window is not None:
        kw["sliding_window"] = int(task.sliding_window)
    if task.soft_cap is not None:
        kw["soft_cap"] = float(task.soft_cap)
    return kw


def default_block_sizes(key: TuningKey, *, max_num_seqs: int = 128) -> BlockSizes | None:
    """What SGLang-JAX runs for ``key`` without a table entry: its ``get_default_block_sizes``
    for the key's generation, with the VMEM limit its wrapper passes (``get_vmem_limit``);
    verify: its mixed heuristic. None where it has none (v4)."""
    import jax.numpy as jnp
    from kernel.hardware import tpu_info
    mod = _package().load_kernel_module()
    version = tpu_version(key.generation)
    case = {"decode": mod.RpaCase.DECODE, "prefill": mod.RpaCase.PREFILL,
            "mixed": mod.RpaCase.MIXED}[program_case(key.case).value]
    limit = KERNEL.vmem_limit(int(tpu_info(key.generation).vmem_capacity_bytes), generation=key.generation)
    old = mod.get_tpu_version
    mod.get_tpu_version = lambda: version
    try:
        d = mod.get_default_block_sizes(jnp.dtype(key.q_dtype), jnp.dtype(key.kv_dtype), key.num_q_heads,
                                        key.num_kv_heads, key.head_dim, key.page_size, key.max_num_tokens,
                                        max_num_seqs, key.max_model_len // key.page_size, case=case,
                                        vmem_limit_bytes=limit)
    except NotImplementedError:
        return None
    finally:
        mod.get_tpu_version = old
    return BlockSizes(d["bq_sz"], d["bkv_sz"], d["bq_csz"], d["bkv_csz"])


KERNEL = SglangJax()
