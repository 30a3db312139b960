"""Deviceless lowering of the kernel: for the VMEM verdict and for static cost estimates.

* ``lower_deviceless(model, limits, tpu, block_sizes, cases)`` lowers the real kernel for a
  TPU generation with abstract inputs (no TPU needed); ``.compile()`` on the result is the
  VMEM judge (``RESOURCE_EXHAUSTED`` when a config does not fit). The KV cache is donated
  as in a serving call.
* Its ``static_meta`` parameter (``static_meta_for(workload, limits)``) asks for the
  *analysis program*: the same program with a workload's metadata visible to libtpu's
  static profiler (``KernelSpec.static_meta``): ``kv_lens`` and ``cu_q_lens`` are stored
  into SMEM at static addresses at kernel entry, and the sequence loop is cut into one loop
  per run of like sequences (same q and KV length) whose metadata the kernel computes in
  closed form, so every trip count and SMEM address the profiler has to follow is known to
  it. It is the serving pipeline otherwise: one pass over all the case's sequences with
  cross-sequence prefetch, the same q-block, KV-step and chunk loops, the cache in HBM.
  ``heuristic_only`` and ``new_kv_in_vmem`` are the analysis program's other choices.

Which program the estimator lowers for a workload (its limits, cache size, operands) and
how it compiles, audits and composes the estimates is tuner code:
``rpa_tune.estimator.ours.lower_for_estimate``. Kernel correctness never depends on this
module.
"""
from __future__ import annotations

import os
import re

from .config import BlockSizes, CASES, Case, get_generation, get_kv_cache_shape, get_kv_cache_shape_hd64
from .workload import ModelShape, ServingLimits, Workload

def _quiet_libtpu_env(env=None):
    env = dict(os.environ if env is None else env)
    env.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    env.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    return env


def quiet_libtpu():
    """Silence libtpu's 'no TPU here' warnings and allow parallel libtpu processes."""
    os.environ.update(_quiet_libtpu_env())


def _sharding(tpu: str):
    import jax
    from jax.experimental import topologies
    topo = topologies.get_topology_desc(platform="tpu", topology_name=get_generation(tpu).topology)
    return jax.sharding.SingleDeviceSharding(topo.devices[0])


def abstract_inputs(model: ModelShape, limits: ServingLimits, tpu: str | None,
                    num_pages: int | None = None, *, sharding=None, layout: str = "merged") -> dict:
    """``ShapeDtypeStruct``s of every kernel argument, placed on the deviceless TPU
    generation ``tpu`` (or given ``sharding`` when ``tpu`` is None: a local device, or
    None for uncommitted arguments). ``layout="hd64"``: the head_dim-64 cache layout."""
    import jax
    import jax.numpy as jnp
    sh = _sharding(tpu) if tpu is not None else sharding
    T, S = limits.max_num_tokens, limits.max_num_seqs
    if num_pages is None:
        num_pages = S * limits.pages_per_seq
    sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, jnp.dtype(dt), sharding=sh)
    return dict(
        queries=sds((T, model.num_q_heads, model.head_dim), model.q_dtype),
        keys=sds((T, model.num_kv_heads, model.head_dim), model.q_dtype),
        values=sds((T, model.num_kv_heads, model.head_dim), model.q_dtype),
        kv_cache=sds(get_kv_cache_shape_hd64(num_pages, limits.page_size, model.num_kv_heads,
                                             jnp.dtype(model.kv_dtype), model.head_dim) if layout == "hd64"
                     else get_kv_cache_shape(num_pages, limits.page_size, model.num_kv_heads,
                                             model.head_dim, jnp.dtype(model.kv_dtype)), model.kv_dtype),
        kv_lens=sds((S,), "int32"),
        page_indices=sds((S * limits.pages_per_seq,), "int32"),
        cu_q_lens=sds((S + 1,), "int32"),
        distribution=sds((3,), "int32"),
    )


def serving_dims(model: ModelShape, limits: ServingLimits, num_pages: int = 0) -> dict:
    """The dims of a serving call of ``model`` within ``limits`` (what ``kernel.api`` resolves
    block sizes and VMEM from); ``num_pages``: the cache's pages."""
    return dict(max_num_tokens=limits.max_num_tokens, num_q_heads=model.num_q_heads,
                num_kv_heads=model.num_kv_heads, head_dim=model.head_dim, num_pages=num_pages,
                page_size=limits.page_size, max_num_seqs=limits.max_num_seqs,
                pages_per_seq=limits.pages_per_seq, kv_dtype=model.kv_dtype, q_dtype=model.q_dtype)


def _block_dict(block_sizes) -> dict:
    if block_sizes is None:
        return {}
    if isinstance(block_sizes, dict):
        return {Case.parse(k): (None if v is None else BlockSizes.coerce(v)) for k, v in block_sizes.items()}
    raise ValueError(f"block_sizes must be a dict case -> (bq, bkv, cq, ckv), got {block_sizes!r}")


def lower_deviceless(model: ModelShape, limits: ServingLimits, tpu: str, block_sizes=None,
                     cases=("decode", "prefill", "mixed"), *, vmem_limit_bytes=None,
                     static_meta=None, num_pages: int | None = None, prepared_operands: bool = False,
                     heuristic_only: bool = False, new_kv_in_vmem: bool = False, **attn_options):
    """Lower the kernel for TPU generation ``tpu`` without a TPU. Returns ``jax.stages.Lowered``.

    ``prepared_operands``: lower the case kernels on operands already in the kernel's
    layout (``api.prepare_inputs``' q / merged new K/V / output arrays as parameters), so
    the program holds no XLA op before the kernels. For fp8 caches libtpu's static profiler
    aborts on XLA's bf16 -> fp8 conversion and fp8 pad fusions on v5e and TPU7x (the kernel
    itself profiles); the kernel's cycles do not depend on where its operands came from.

    ``heuristic_only``: the cases without explicit sizes take the heuristic's (they pad the
    operands), never a table's or ``RPA_{D,P,M}_BLOCK_SIZES``: the program depends on its
    arguments only. ``new_kv_in_vmem``: the new K/V operand of the case kernels placed in
    VMEM (``kernel.api.Options``).

    RPA v3's options by its names: ``use_causal_mask``, ``update_kv_cache``,
    ``attention_sink`` (True: a sinks operand), ``kv_layout`` (``"hd64"``: the head_dim-64
    cache layout of ``ragged_paged_attention_hd64``)."""
    import jax
    from .api import _rpa_jit, build_options, prepare_inputs, run_cases
    cases = tuple(Case.parse(c).value for c in cases)
    layout = attn_options.pop("kv_layout", "merged")
    v3 = dict(causal=attn_options.pop("use_causal_mask", True), update_cache=attn_options.pop("update_kv_cache", True),
              sinks=bool(attn_options.pop("attention_sink", False)), layout=layout)
    v3 = {k: v for k, v in v3.items() if v != dict(causal=True, update_cache=True, sinks=False, layout="merged")[k]}
    args = abstract_inputs(model, limits, tpu, num_pages, layout=layout)
    dims = serving_dims(model, limits, args["kv_cache"].shape[0])
    options = build_options(dims, get_generation(tpu).name, _block_dict(block_sizes),
                            vmem_limit_bytes=vmem_limit_bytes, static_meta=static_meta,
                            cases=cases, heuristic_only=heuristic_only, new_kv_in_vmem=new_kv_in_vmem,
                            **v3, **attn_options)
    sinks = ()
    if options.sinks:
        sinks = (jax.ShapeDtypeStruct((model.num_kv_heads, model.group, 128), jax.numpy.float32,
                                      sharding=args["kv_cache"].sharding),)
    order = ("queries", "keys", "values", "kv_cache", "kv_lens", "page_indices", "cu_q_lens", "distribution")
    if prepared_operands:
        shapes = jax.eval_shape(lambda q, k, v, c: prepare_inputs(q, k, v, c, options),
                                *(args[k] for k in order[:4]))
        sh = args["kv_cache"].sharding
        # q / o with as many rows as the new K/V (which prefill / mixed read a KV block at
        # a time, so it has bkv rows of padding where q / o need bq): with a few-token
        # decode's q / o (4 rows) the static profiler gives the kernel 0 cycles on v5e and
        # v6e, and the rows it needs to profile depend on the dtype and head_dim; with the
        # new K/V's rows it profiles on every generation. The kernel never reads past the
        # workload's tokens, so the rows cost it nothing.
        rows = shapes[1].shape[0]
        shapes = [x if i == 1 else jax.ShapeDtypeStruct((max(x.shape[0], rows),) + x.shape[1:], x.dtype)
                  for i, x in enumerate(shapes)]
        prepped = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh) for x in shapes]
        fn = lambda q, nkv, o, cache, kl, pi, cu, dist, *sk: run_cases(
            q, nkv, o, cache, kl, pi, cu, dist, num_kv_heads=model.num_kv_heads, group=model.group,
            head_dim=model.head_dim, options=options, interpret=None, sinks=sk[0] if sk else None)
        # Only the cache is donated: with the output donated too, the static profiler
        # reports 0 cycles for the kernel on v5e and v6e.
        return jax.jit(fn, donate_argnums=(3,)).lower(*prepped, *(args[k] for k in order[3:]), *sinks)
    fn = lambda *a: _rpa_jit(*a, options=options, interpret=None)
    # donate the cache as the serving call does (_rpa_jit donates kv_cache): without it XLA
    # adds a full copy of the cache that production does not have.
    return jax.jit(fn, donate_argnums=(order.index("kv_cache"),)).lower(*(args[k] for k in order), *sinks)


# ----------------------------------------------------------------- static workloads
def static_meta_for(workload: Workload, limits: ServingLimits) -> tuple:
    """Per case: ``((lo, hi), kv_lens, cu_q_lens)``: the case's sequence range and the
    metadata the kernel stores at static SMEM addresses."""
    meta, _ = workload.metadata(limits, shuffle_pages=False)
    kv = tuple(int(x) for x in meta["kv_lens"])
    cu = tuple(int(x) for x in meta["cu_q_lens"])
    out = []
    for case in CASES:
        lo, hi = workload.case_range(case)
        out.append(((lo, hi), kv, cu))
    return tuple(out)


# ------------------------------------------------------------------ compile verdicts
_OOM_PATTERNS = (
    re.compile(r"Scoped allocation with size ([\d.]+)([KMG]?)(?:i?B)? and limit ([\d.]+)([KMG]?)"),
    re.compile(r"Used ([\d.]+)([KMG]?)(?:i?B)? of ([\d.]+)([KMG]?)(?:i?B)? vmem"),
    re.compile(r"Allocation \(size=(\d+)()\) would exceed memory \(size=(\d+)()\)"),
)
_UNIT = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_vmem_oom(message: str) -> dict | None:
    """``{"used_bytes", "limit_bytes", "kind"}`` from a VMEM RESOURCE_EXHAUSTED message, else None."""
    if "vmem" not in message.lower() and "would exceed memory" not in message:
        return None
    for kind, pat in zip(("scoped_limit", "capacity", "allocation"), _OOM_PATTERNS):
        m = pat.search(message)
        if m:
            used = float(m.group(1)) * _UNIT[m.group(2)]
            limit = float(m.group(3)) * _UNIT[m.group(4)]
            return {"used_bytes": int(used), "limit_bytes": int(limit), "kind": kind}
    return None
