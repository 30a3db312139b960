"""Builder for the profiler child: SGLang-JAX's RPA v3 kernel, lowered for one workload.

``lower(...)`` has the signature of ``rpa_tune.estimator.public.lower`` and returns
``(jax.stages.Lowered, kernel name prefix)``. The kernel is ``ragged_paged_attention`` of
``sglang-jax`` (``sgl_jax/srt/kernels/ragged_paged_attention/ragged_paged_attention_v3.py``,
imported by ``rpa_tune.public_kernel.SGLANG_JAX``; its source is not copied or edited),
lowered deviceless for ``tpu``.

It is SGLang-JAX's copy of tpu-inference's v3 kernel (its header: adapted from
tpu-inference v0.11.1): the same pipeline, loops (``compute_with_bq``,
``compute_with_bkv``, ``attention_loop``, the write-back ``loop_body``), SMEM state and
module names (``pl``, ``lax``, ``jnp``, ``cdiv``), so the lowering of
``rpa_tune.estimator.public`` applies (its module doc says why each step is there) and its
pieces are reused: the closed-form metadata (``_Formula``, ``_metadata_formulas``), the
static-address SMEM state, the bounded loops, the non-negative ``cdiv`` and the bf16 ``exp`` /
``where`` moves. What differs is SGLang-JAX's own:

* nine scalar-prefetch operands, not seven: ``kv_lens, page_indices, cu_q_lens,
  cu_kv_lens, cu_seq_mask_lens, distribution`` and the three state refs. A sequence's pages
  start at ``cdiv(cu_kv_lens[i], page_size)`` in a flat page table (not ``i *
  pages_per_seq``): ``cu_kv_lens`` is the closed form of the page-aligned KV lengths'
  prefix sums, and the page table the identity (each sequence owns consecutive pages);
* the fused, head-interleaved K/V cache (its ``get_kv_cache_shape``), its three extra
  operands (custom mask, zero mask, attention sink: the first and last None, as a causal
  call passes them) and its aliases (q -> out at operand 9, cache -> cache at 11);
* the kernel receives ``tpu_version`` as an argument: the int16 score masks that abort the
  profiler are avoided by passing ``min(version, 5)`` to the kernel body only (its only use
  there), the wrapper keeping the real version (TPU7x's separate output and ``m`` scratch);
* its KV-cache write-back has no switch: with ``update_kv_cache`` off (the default, as for
  the public kernel, whose write-back aborts the profiler) the write-back loop issues no
  DMA and its pending-update state reads as none, so nothing waits on it. Missing work:
  each sequence's new K/V written into the cache (``q_len`` tokens per sequence);
* its VMEM limit: ``get_vmem_limit``'s rule (all of VMEM on v7, half on the others), by the
  generation (``rpa_tune.kernels.sglang_jax``), whatever limit the options ask for;
* the verify case is its mixed kernel (``Case.VERIFY`` runs there, as SGLang-JAX's
  target-verify does), on the verify workload's sequences.

The kernel is named ``sglang_rpa_<case>_bq.._bkv.._cq.._ckv..`` (the returned prefix).
"""
from __future__ import annotations

import functools
import types
import warnings

from kernel.config import BlockSizes, Case, cdiv, get_generation, round_up
from kernel.workload import ModelShape, ServingLimits

from ..public_kernel import TPU_VERSION
from .public import (bounded_loops, case_sequences, _cdiv_fn, _Formula, _jnp_proxy,
                     _metadata_formulas, _patched, _StaticAddresses)

PREFIX = "sglang_rpa"
_KERNEL_OPTIONS = ("sm_scale", "sliding_window", "soft_cap", "q_scale", "k_scale", "v_scale", "mask_value")
_NUM_PREFETCH = 9
_Q_OPERAND, _CACHE_OPERAND = _NUM_PREFETCH, _NUM_PREFETCH + 2


def kernel_name(case: Case | str, block_sizes) -> str:
    return f"{PREFIX}_{Case.parse(case).value}_{BlockSizes.coerce(block_sizes).label()}"


def _cu_kv_lens(segs, page_size: int):
    """Prefix sums of the sequences' page-aligned KV lengths (where SGLang-JAX's kernel
    finds a sequence's first page: ``cdiv(cu_kv_lens[i], page_size)``)."""
    import jax.numpy as jnp

    def cu(i):
        tot = jnp.int32(0)
        for st, c, _, kv in segs:
            tot = tot + jnp.clip(i - st, 0, c) * round_up(kv, page_size)
        return tot
    return cu


class _NoUpdates:
    """The pending cache-update state with the write-back off: writes are dropped and every
    entry reads as its initial value (-1: no update pending)."""

    def __init__(self, ref):
        self.shape, self.dtype = ref.shape, ref.dtype

    def __getitem__(self, idx):
        import jax.numpy as jnp
        return jnp.int32(-1)

    def __setitem__(self, idx, value):
        pass


def _pinned_body(body, segs, distribution, page_size: int, num_pages: int, update_kv_cache: bool):
    import jax.numpy as jnp
    kv_lens, cu_q_lens, _ = _metadata_formulas(segs, 1, page_size, num_pages)
    cu_kv_lens = _cu_kv_lens(segs, page_size)

    def pinned(*refs, **kw):
        kv_ref, pages_ref, cu_ref, cu_kv_ref, mask_lens_ref, dist_ref, sem_ref, bo_ref, upd_ref = refs[:_NUM_PREFETCH]
        for a, v in enumerate(distribution):
            dist_ref[a] = jnp.int32(v)
        for ref, v in ((sem_ref, 0), (bo_ref, -1), (upd_ref, -1)):
            for a in range(ref.shape[0]):
                ref[a] = jnp.int32(v)
        meta = (_Formula(kv_ref.shape, kv_lens), _Formula(pages_ref.shape, lambda i: jnp.minimum(i, num_pages - 1)),
                _Formula(cu_ref.shape, cu_q_lens), _Formula(cu_kv_ref.shape, cu_kv_lens), mask_lens_ref, dist_ref,
                _StaticAddresses(sem_ref), _StaticAddresses(bo_ref),
                _StaticAddresses(upd_ref) if update_kv_cache else _NoUpdates(upd_ref))
        return body(*meta, *refs[_NUM_PREFETCH:], **kw)

    return pinned


def _proxies(pl, lax, *, target_case: str, name: str, segs, distribution, page_size: int, num_pages: int,
             caps: dict, bounded: bool, unrolled, pinned_hbm: bool, body_version: int, update_kv_cache: bool):
    """The module's ``pl`` and ``lax`` while lowering (``public._lowering_proxies`` for
    SGLang-JAX's operands): the target case's kernel pinned and named, the others their
    aliased pass-through, the loops named in ``caps`` bounded, the write-back loop empty
    when ``update_kv_cache`` is off."""
    pl_proxy = types.SimpleNamespace(**{k: getattr(pl, k) for k in dir(pl) if not k.startswith("__")})
    lax_proxy = types.SimpleNamespace(**{k: getattr(lax, k) for k in dir(lax) if not k.startswith("__")})

    def pallas_call(kernel, *args, **kwargs):
        case = kernel.keywords["case"]
        if case.name != target_case:
            if not pinned_hbm:
                return lambda *operands: (operands[_Q_OPERAND], operands[_CACHE_OPERAND])
            kwargs["name"] = f"skipped_{PREFIX}_{case.name.lower()}"
            return pl.pallas_call(lambda *refs: None, *args, **kwargs)
        kwargs["name"] = name
        body = functools.partial(kernel.func, *kernel.args, **dict(kernel.keywords, tpu_version=body_version))
        return pl.pallas_call(_pinned_body(body, segs, distribution, page_size, num_pages, update_kv_cache),
                              *args, **kwargs)

    loop, bounded_fori_loop = bounded_loops(pl, lax, caps, bounded=bounded, unrolled=unrolled)

    def fori_loop(lower, upper, body_fun, init_val, **kw):
        if getattr(body_fun, "__name__", "") == "loop_body" and not update_kv_cache:
            return init_val                       # the write-back issues nothing
        return bounded_fori_loop(lower, upper, body_fun, init_val, **kw)

    pl_proxy.pallas_call = pallas_call
    pl_proxy.loop = loop
    lax_proxy.fori_loop = fori_loop
    return pl_proxy, lax_proxy


def lower(*, workload: dict, block_sizes, tpu: str, model: dict, limits: dict, case: str,
          options: dict | None = None):
    """``(Lowered, kernel name prefix)``: SGLang-JAX's ``case`` kernel for ``workload``
    (verify: its mixed kernel), metadata visible to the static profiler (module doc)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import topologies

    from kernel.hardware import tpu_info
    from rpa_tune.kernels.sglang_jax import KERNEL as TUNED, program_case
    from rpa_tune.public_kernel import SGLANG_JAX

    K = SGLANG_JAX.load_kernel_module()
    opts = dict(options or {})
    update_kv_cache = bool(opts.pop("update_kv_cache", False))
    bounded = bool(opts.pop("bounded_loops", True))
    int16_masks = bool(opts.pop("int16_masks", False))
    bf16_exp = bool(opts.pop("bf16_exp", False))
    bf16_where = bool(opts.pop("bf16_where", False))
    unrolled = tuple(opts.pop("unrolled_loops", ("attention_loop",)))
    nonneg_div = bool(opts.pop("nonneg_div", True))
    opts.pop("vmem_limit_bytes", None)         # its own rule decides (module doc)
    kernel_opts = {k: opts.pop(k) for k in _KERNEL_OPTIONS if k in opts}
    if opts:
        raise ValueError(f"unknown options {sorted(opts)}; valid: update_kv_cache, vmem_limit_bytes, "
                         f"bounded_loops, unrolled_loops, nonneg_div, int16_masks, bf16_exp, bf16_where, "
                         f"{', '.join(_KERNEL_OPTIONS)}")

    own = Case.parse(case)
    run = program_case(own)
    bs = BlockSizes.coerce(block_sizes)
    gen = get_generation(tpu)
    if gen.name not in TPU_VERSION:
        raise ValueError(f"SGLang-JAX's kernel has no TPU version for {gen.name!r}")
    version = TPU_VERSION[gen.name]
    m = ModelShape(**model)
    lim = ServingLimits(**limits)
    q_lens, kv_lens, chunk, segs, distribution, T, S = case_sequences(workload, own, run, lim, bs, "SGLang-JAX's")
    capacity = int(tpu_info(gen.name).vmem_capacity_bytes)
    vmem_limit = TUNED.vmem_limit(capacity, generation=gen.name)
    page_size = lim.page_size
    kv_dt = jnp.dtype(m.kv_dtype)
    cache_shape = K.get_kv_cache_shape(1, page_size, m.num_kv_heads, m.head_dim, kv_dt)
    page_bytes = int(np.prod(cache_shape)) * kv_dt.itemsize
    used = sum(c * cdiv(kv, page_size) for _, c, _, kv in segs)
    num_pages = max(used + 1, cdiv(2 * capacity, page_bytes))

    topo = topologies.get_topology_desc(platform="tpu", topology_name=gen.topology)
    sharding = jax.sharding.SingleDeviceSharding(topo.devices[0])
    sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, jnp.dtype(dt), sharding=sharding)
    args = (sds((T, m.num_q_heads, m.head_dim), m.q_dtype),
            sds((T, m.num_kv_heads, m.head_dim), m.kv_dtype),
            sds((T, m.num_kv_heads, m.head_dim), m.kv_dtype),
            sds(K.get_kv_cache_shape(num_pages, page_size, m.num_kv_heads, m.head_dim, kv_dt), m.kv_dtype),
            sds((S,), "int32"), sds((S * lim.pages_per_seq,), "int32"), sds((S + 1,), "int32"),
            sds((S + 1,), "int32"), sds((3,), "int32"))

    bst = tuple(bs)
    call_kw = dict(sm_scale=m.head_dim ** -0.5, vmem_limit_bytes=int(vmem_limit), chunk_prefill_size=chunk,
                   d_block_sizes=bst if run == Case.DECODE else None,
                   p_block_sizes=bst if run == Case.PREFILL else None,
                   m_block_sizes=bst if run == Case.MIXED else None)
    call_kw.update(kernel_opts)
    name = kernel_name(own, bs)
    rpa = getattr(K.ragged_paged_attention, "__wrapped__", K.ragged_paged_attention)
    caps = {"compute_with_bq": cdiv(max(q_lens), bs.bq), "compute_with_bkv": cdiv(max(kv_lens), bs.bkv),
            "attention_loop": bs.bkv // bs.ckv, "loop_body": bs.bkv // page_size}
    pl_proxy, lax_proxy = _proxies(K.pl, K.lax, target_case=run.name, name=name, segs=segs,
                                   distribution=distribution, page_size=page_size, num_pages=num_pages, caps=caps,
                                   bounded=bounded, unrolled=unrolled, pinned_hbm=version >= 7,
                                   body_version=version if int16_masks else min(version, 5),
                                   update_kv_cache=update_kv_cache)

    def call(q, k, v, cache, *meta):
        return rpa(q, k, v, cache, *meta, None, None, **call_kw)

    fn = jax.jit(call, donate_argnums=(0, 1, 2, 3))
    mesh = jax.sharding.Mesh(np.array([topo.devices[0]]), ("x",)).abstract_mesh
    patches = dict(pl=pl_proxy, lax=lax_proxy,
                   jnp=_jnp_proxy(K.jnp, not bf16_exp, version <= 5 and not bf16_where),
                   cdiv=_cdiv_fn(K.cdiv) if nonneg_div else K.cdiv,
                   get_tpu_version=lambda: version)
    with _patched(K, **patches), jax.sharding.use_abstract_mesh(mesh), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        lowered = fn.lower(*args)
    return lowered, name
