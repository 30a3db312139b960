"""The kernels rpa-tune tunes: this project's (``rpa-tune``) and tpu-inference's RPA v3
(``tpu-inference``), the one vLLM-TPU and SGLang-JAX run.

One ``TunedKernel`` per kernel says everything the tuner does differently for it:

* how the compile backend lowers it for the static profiler (``builder``) and whether its
  program writes the KV cache (the public one is lowered with its write-back off, so the
  audit does not ask for those bytes; ``rpa_tune.estimator.public`` module doc);
* its legality rules (``block_size_errors``): ours are ``kernel.block_size_errors``; the
  public kernel's are those its own ``static_validate_inputs`` checks (``bq % cq``,
  ``bkv % ckv``, ``bkv`` and ``ckv`` multiples of the page size);
* its baseline (``heuristic``): ours is ``kernel.heuristics``; the public kernel's is its
  own ``get_default_block_sizes``, computed by the installed package for the target
  generation (None where it has none, e.g. v4);
* its version (``version``, recorded in every result row and table) and the part of the
  resume id that stands for it (``config_version``): for ours the hash of the files that
  shape a result (``rpa_tune.provenance.kernel_hash``); for the public kernel its package
  version, so editing our kernel does not discard its results. (For both, a change to
  how the estimator prices a kernel bumps the evaluator's version, as before.)

A table holds the entries of one kernel (``kernel.tables.table_kernel``): ours in
``<tables>/<generation>.json``, the public kernel's in ``<tables>/tpu-inference/``.
"""
from __future__ import annotations

import dataclasses

from kernel.config import BlockSizes, Case, TuningKey, get_generation
from kernel.tables import DEFAULT_KERNEL, KERNEL_NAMES, PUBLIC_KERNEL

OURS, PUBLIC = DEFAULT_KERNEL, PUBLIC_KERNEL
assert set(KERNEL_NAMES) == {OURS, PUBLIC}


class KernelError(ValueError):
    """A kernel name that is not known, or a kernel that cannot be used here (one line)."""


@dataclasses.dataclass(frozen=True)
class TunedKernel:
    name: str
    builder: str              # "module:function" the profiler child lowers (rpa_tune.estimator)
    writes_kv_cache: bool     # the lowered program writes the new tokens' K/V into the cache
    interpretable: bool       # runs in the Pallas TPU interpreter (the interpret backend)
    doc: str

    @property
    def is_ours(self) -> bool:
        return self.name == OURS

    def check_available(self) -> None:
        """Raise ``KernelError`` (one line with the install command) if it cannot be used."""
        if self.is_ours:
            return
        from .public_kernel import PublicKernelMissing, load_kernel_module
        try:
            load_kernel_module()     # installed, the pinned version, and importable here
        except PublicKernelMissing as e:
            raise KernelError(str(e)) from None

    def version(self) -> str | None:
        """What a result row and a table record as the kernel's version (None: the public
        package is not installed here)."""
        if self.is_ours:
            from kernel.provenance import kernel_id
            return kernel_id()
        from .public_kernel import installed_version
        v = installed_version()
        return None if v is None else f"{PUBLIC}=={v}"

    def config_version(self) -> str | None:
        """The kernel's part of a result's resume id (``store.config_id``); None when it
        cannot be known here (then no row of that kernel counts as stale)."""
        if self.is_ours:
            from .provenance import kernel_hash
            return kernel_hash()
        return self.version()

    def block_size_errors(self, case: Case | str, bs: BlockSizes, page_size: int) -> list[str]:
        from kernel.config import block_size_errors
        if self.is_ours:
            return block_size_errors(Case.parse(case), bs, page_size)
        errs = public_block_size_errors(bs, page_size)
        if Case.parse(case) == Case.DECODE and bs.bq != 1:
            # (a tuner rule, not the package's: its decode q block holds one sequence's
            # tokens, so a larger one only pads; our decode's bq is sequences per step)
            errs.append(f"bq={bs.bq}: the public kernel's decode q block holds one sequence's one token "
                        f"(only bq == 1 is a candidate)")
        return errs

    def heuristic(self, key: TuningKey, *, max_num_seqs: int = 128) -> BlockSizes | None:
        if self.is_ours:
            from kernel.heuristics import heuristic_for_key
            return heuristic_for_key(key)
        return public_default_block_sizes(key, max_num_seqs=max_num_seqs)


KERNELS: dict[str, TunedKernel] = {
    OURS: TunedKernel(OURS, "rpa_tune.estimator.ours:lower", True, True,
                      "this project's kernel (kernel.ragged_paged_attention)"),
    PUBLIC: TunedKernel(PUBLIC, "rpa_tune.estimator.public:lower", False, False,
                        "tpu-inference's RPA v3 (the kernel vLLM-TPU and SGLang-JAX run)"),
}


def get_kernel(name: str | None) -> TunedKernel:
    try:
        return KERNELS[name or OURS]
    except KeyError:
        raise KernelError(f"unknown kernel {name!r}; valid: {', '.join(KERNELS)}") from None


def row_kernel(value) -> str:
    """The kernel a results row names (its ``kernel`` column); null, NaN or missing (rows
    written before there were two kernels) is ours."""
    return value if isinstance(value, str) and value else OURS


def key_id(key: TuningKey, kernel: str) -> str:
    """A results row's ``key_id``: the key's id, prefixed by the kernel unless it is ours
    (our rows keep the ids they always had)."""
    return key.id() if kernel in (None, OURS) else f"{kernel}:{key.id()}"


# ----------------------------------------------------------------- the public kernel's rules
def public_block_size_errors(bs: BlockSizes, page_size: int) -> list[str]:
    """The block-size checks of tpu-inference's ``static_validate_inputs`` (0.32.0): ``bq %
    cq``, ``bkv % ckv``, ``bkv`` and ``ckv`` multiples of the page size. They are ours without
    our decode-only rule (``bq == cq``, sequences per step), so ours for a non-decode case state them
    (``tests/test_public_backend.py`` checks them against the package)."""
    from kernel.config import block_size_errors
    return block_size_errors(Case.PREFILL, bs, page_size)


def public_default_block_sizes(key: TuningKey, *, max_num_seqs: int = 128) -> BlockSizes | None:
    """What the public kernel runs for ``key`` without block sizes: its own
    ``get_default_block_sizes``, evaluated by the installed package with its TPU version
    set to the key's generation. None where it has no default (it raises, e.g. on v4)."""
    from .estimator.public import TPU_VERSION
    from .public_kernel import load_kernel_module
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

