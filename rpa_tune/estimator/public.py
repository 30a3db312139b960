"""Builder for the profiler child: the public RPA v3 kernel, lowered for one workload.

``lower(...)`` has the signature of ``rpa_tune.estimator.ours.lower`` and returns
``(jax.stages.Lowered, kernel name prefix)`` for ``profiler.profile("rpa_tune.estimator.
public:lower", request)``. The kernel is ``ragged_paged_attention`` of ``tpu-inference``
0.32.0 (imported by ``rpa_tune.public_kernel``; its source is not copied or edited),
lowered deviceless for ``tpu``. While it is traced, a few names of its module are
replaced (``pl``, ``lax``, ``jnp``, ``cdiv``, ``get_tpu_version``); everything below is
done through them and restored afterwards.

Making the workload visible to libtpu's static profiler
------------------------------------------------------
As shipped, the kernel reads ``kv_lens``, ``cu_q_lens``, ``page_indices`` and
``distribution`` from scalar-prefetch SMEM operands; the profiler takes their unknown
values as 0, so its sequence loop runs zero times and the estimate is the prologue. So
the body handed to the public ``pallas_call`` is wrapped:

* At kernel entry, static-address SMEM stores write the case's ``distribution`` and the
  initial values of the kernel's SMEM state (semaphore slots 0, output / cache-update
  bookkeeping -1, what the public wrapper passes). The state, which the kernel indexes
  with run-time slots (``bo_ids[sem]``), is read through a select over its static
  addresses and written by a select-and-store at each address (the profiler does not
  follow dynamic SMEM addresses).
* ``kv_lens[i]``, ``cu_q_lens[i]`` and ``page_indices[i]`` are closed forms of the index
  over compile-time constants: the case's sequences, sorted by ``(q_len, kv_len)``, form
  segments of equal sequences; ``kv_lens`` is a select over the segment bounds (a constant
  for one segment), ``cu_q_lens`` a sum of clipped linear terms, and each sequence owns
  consecutive pages. (Lengths stored in SMEM do not work: measured, the compiler spilled
  a KV-loop bound derived from them to an SMEM slot that the profiler read back as 0.)

Where the profiler still loses the work, the lowering changes how, not what, the kernel
computes (each found by reading the simulated bundle trace):

* Loops whose trip count is computed inside an enclosing loop (the q-block loop of the
  mixed case, the KV-block loop whose causal end depends on the q block, the compute-chunk
  loop over a KV block, the cache write-back page loop) run to a static bound (the longest
  sequence's q / KV blocks, ``bkv / ckv``, ``bkv / page_size``) with each iteration under
  ``index < trip count``: the same iterations, a trip count the profiler knows. Without
  it the compute-chunk loop was costed as 0 iterations whenever its count was not a
  compile-time constant: no matmul reached the estimate (so, measured, the shared
  reference tool's figures hold DMAs and bookkeeping only). The compute-chunk loop is also unrolled (at most
  ``MAX_UNROLL`` chunks): rolled and guarded, some causal configurations aborted the
  profiler ("Cannot schedule FIFO pop instruction when the FIFO is empty ... vpop.f32.mrf");
  where both ran, rolled and unrolled cost the same.
* The kernel's ``cdiv`` of a run-time value is computed with a shift (or a truncating
  division): its numerators are never negative, and ``jnp``'s floor division compiles to a
  sign fix-up around an unsigned min (``smin.u32``) that the profiler reads as 0.
* Score masks are built in int32 (as the kernel does on v5e) rather than int16, the bf16
  ``exp`` of the running-max correction (a (rows, 128) tile) in f32, and on v5e the
  select that zeroes V rows past the KV length in f32: the profiler aborts simulating
  them ("Expected vector-int16, got vector-int32 ... vadd.s16", "Expected
  vector-bf16packed, got vector-int32 ... vmul.bf16", "Expected vector-int16, got
  vector-int32 ... vunpack.i.l.s16.s32"); the compiler accepts all three. They are small
  VPU costs next to the f32 score tile (and v5e computes bf16 element-wise ops in f32).
* On v5e the seven scalar-prefetch operands are pinned to HBM (XLA puts small ones in
  VMEM, and v5e's profiler aborts on the VMEM -> SMEM copy: "Unsupported DMA direction:
  10 on VL/VLP"); their values are unused.

Other choices:

* Only the requested case's kernel is lowered: the public wrapper always runs the decode
  and mixed kernels (and prefill with ``chunk_prefill_size``); the others become their
  aliased pass-through (on TPU7x, whose wrapper pins q and the cache to HBM, an empty
  kernel named ``skipped_public_rpa_<case>``). The distribution is that of the case's own
  sequences.
* Prefill is the public kernel's fixed-size chunked-prefill kernel (``RPAp``): every
  prefill sequence must have the same ``q_len`` (it becomes ``chunk_prefill_size``).
* The kernel is named ``public_rpa_<case>_bq.._bkv.._cq.._ckv..`` (the returned prefix).
* Serving limits are cut to the workload, as ``rpa_tune.estimator.ours.lower_for_estimate`` does
  (tokens: the case's own, at least ``bq``, rounded to 8; sequences: the case's own); the
  cache holds the workload's pages and at least twice the chip's VMEM, so that XLA keeps
  it in HBM. The outer jit donates the cache (and q / k / v, as the public jit does):
  without it XLA adds a copy of the cache (placed in VMEM when small), and the page DMAs
  are costed from there.
* ``vmem_limit_bytes`` defaults to the limit the kernel runs with, all of the chip's VMEM
  (``rpa_tune.kernels.tpu_inference``: ``vmem_limit``). A plain deviceless compile at it is
  a server's; with the static profiler on, the compiler reserves the whole limit ("HLO
  temp") and places the kernel's scratch and spills beside it, so at all of VMEM the
  profiled compile never fits the chip. ``profiler.profile`` therefore gives it libtpu's
  VMEM size override, sized to the chip's VMEM plus the limit
  (``profiler.deviceless_vmem_args``). It then fails wherever the plain compile fails, and
  fits wherever that one does but within the profiler's own few tens of KiB of the
  capacity, where the compile backend's plain compile decides (measured on TPU7x at and
  beside the capacity: notebook.md, docs/estimator.md); its cycles and trace are those of
  the same program at half the VMEM.

KV-cache write-back is off (``update_kv_cache=False``, the kernel's KV-sharing mode). With
it on, the profiler aborts: "Static LLO profiling of ... failed: INTERNAL: No DMA issue
node found for sync flag" (the trace shows the write-back waits but none of its VMEM->HBM
DMAs), with or without the static loop bounds. Missing work: writing each sequence's new
K/V into the cache (``q_len`` tokens per sequence, VMEM -> HBM; one token per decode
sequence, the whole prompt for prefill). The new tokens' K/V are read from the cache
instead of the new-KV array (the same bytes into VMEM).

What the estimate is not (measured with probe kernels): the profiler costs a DMA whose
size is a run-time value by that value, but does not share HBM bandwidth between
concurrent DMAs (benchmarks/README.md, "Calibration": 8 DMAs in flight against 1), so a
kernel with several pages in flight can be estimated below
bytes / HBM bandwidth. The trace's ``size_in_granules`` is printed only for DMAs of
static size; most page DMAs here have run-time sizes.

Known failures (jax 0.12.0.1, libtpu 0.0.50.1): on TPU7x a prefill sequence of several q
blocks aborts the profiler ("No DMA issue node found for sync flag": a semaphore wait
without a DMA issue it can match) while its single-q-block pieces and the mixed case run;
on v5e prefill aborts it ("Expected vector-int16, got vector-bf16packed ...
vunpack.c.l.s16.s32") and a mixed step of many sequences passes the profiler's memory
cap; decode runs on v5e, v6e and TPU7x. The profiler's memory grows with the simulated
work: a whole long prefill passes the cap too. Estimate such sequences as the sum of their
q blocks (a q block of ``r`` rows ending at ``e`` does the work of a sequence with
``q_len = r``, ``kv_len = e``); the sum is above the whole sequence's cost, which pipelines
across blocks and has one prologue.

``options``: ``update_kv_cache`` (False), ``vmem_limit_bytes``, ``bounded_loops`` (True),
``unrolled_loops`` (("attention_loop",)), ``nonneg_div`` (True), ``int16_masks`` (False),
``bf16_exp`` (False), ``bf16_where`` (False): the switches above, to reproduce the shipped forms; and kernel
arguments passed through: ``sm_scale``, ``sliding_window``, ``soft_cap``, ``q_scale``,
``k_scale``, ``v_scale``, ``use_causal_mask``, ``mask_value``.
"""
from __future__ import annotations

import contextlib
import functools
import types
import warnings

from kernel.config import BlockSizes, Case, cdiv, get_generation, get_kv_cache_shape, round_up
from kernel.workload import ModelShape, ServingLimits, Workload

PREFIX = "public_rpa"
MAX_UNROLL = 8
from ..public_kernel import TPU_VERSION  # noqa: E402  (tpu-inference's version numbers)
_KERNEL_OPTIONS = ("sm_scale", "sliding_window", "soft_cap", "q_scale", "k_scale", "v_scale",
                   "use_causal_mask", "mask_value")
_PUBLIC_CASE = {Case.DECODE: "DECODE", Case.PREFILL: "PREFILL", Case.MIXED: "MIXED"}


def kernel_name(case: Case | str, block_sizes) -> str:
    """HLO name of the public kernel lowered for ``case`` (the prefix ``lower`` returns)."""
    return f"{PREFIX}_{Case.parse(case).value}_{BlockSizes.coerce(block_sizes).label()}"


# --------------------------------------------------------------------- the workload
def _segments(q_lens, kv_lens) -> list[tuple[int, int, int, int]]:
    """``(first sequence, count, q_len, kv_len)`` runs of equal sequences, sorted."""
    segs: list[list[int]] = []
    for q, kv in sorted(zip(q_lens, kv_lens)):
        if segs and segs[-1][2:] == [q, kv]:
            segs[-1][1] += 1
        else:
            segs.append([(segs[-1][0] + segs[-1][1]) if segs else 0, 1, q, kv])
    return [tuple(s) for s in segs]


def _num_pages(segs, model: ModelShape, page_size: int, vmem_bytes: int) -> int:
    import numpy as np
    dt = np.dtype(model.kv_dtype)
    shape = get_kv_cache_shape(1, page_size, model.num_kv_heads, model.head_dim, dt)
    page_bytes = int(np.prod(shape)) * dt.itemsize
    used = sum(c * cdiv(kv, page_size) for _, c, _, kv in segs)
    return max(used + 1, cdiv(2 * vmem_bytes, page_bytes))


class _Formula:
    """Read-only stand-in for an SMEM metadata ref: element ``i`` is ``fn(i)``."""

    def __init__(self, shape, fn):
        import jax.numpy as jnp
        self.shape, self.dtype, self._fn = tuple(shape), jnp.int32, fn

    def __getitem__(self, idx):
        import jax.numpy as jnp
        return self._fn(jnp.asarray(idx, jnp.int32))


class _StaticAddresses:
    """An SMEM state ref whose run-time-indexed accesses go through static addresses."""

    def __init__(self, ref):
        self._ref, self.shape, self.dtype = ref, ref.shape, ref.dtype

    @staticmethod
    def _static(idx):
        import numpy as np
        return isinstance(idx, (int, np.integer)) and not isinstance(idx, bool)

    def __getitem__(self, idx):
        import jax.numpy as jnp
        if self._static(idx):
            return self._ref[int(idx)]
        idx = jnp.asarray(idx, jnp.int32)
        val = self._ref[0]
        for a in range(1, self.shape[0]):
            val = jnp.where(idx == a, self._ref[a], val)
        return val

    def __setitem__(self, idx, value):
        import jax.numpy as jnp
        if self._static(idx):
            self._ref[int(idx)] = value
            return
        idx = jnp.asarray(idx, jnp.int32)
        value = jnp.asarray(value, self.dtype)
        for a in range(self.shape[0]):
            self._ref[a] = jnp.where(idx == a, value, self._ref[a])


def _metadata_formulas(segs, pages_per_seq: int, page_size: int, num_pages: int):
    """Closed forms ``(kv_lens, cu_q_lens, page_indices)`` of a sequence / page-table index.

    The segments' lengths are compile-time constants: the profiler follows constants and
    scalar arithmetic on them everywhere, but loses values the compiler keeps in SMEM
    across a loop (measured: a KV-loop bound computed from lengths stored in SMEM at
    kernel entry was spilled to an SMEM slot and read back as 0, so no KV block ran)."""
    import jax.numpy as jnp
    last = len(segs) - 1

    def kv_lens(i):
        val = jnp.int32(segs[last][3])
        for st, c, _, kv in reversed(segs[:last]):
            val = jnp.where(i < st + c, jnp.int32(kv), val)
        return val

    def cu_q_lens(i):
        tot = jnp.int32(0)
        for st, c, q, _ in segs:
            tot = tot + jnp.clip(i - st, 0, c) * q
        return tot

    def page_indices(i):
        seq = _div_nonneg(i, pages_per_seq)
        first = jnp.int32(0)
        for st, c, _, kv in segs:
            first = first + jnp.clip(seq - st, 0, c) * cdiv(kv, page_size)
        return jnp.minimum(first + (i - seq * pages_per_seq), num_pages - 1)

    return kv_lens, cu_q_lens, page_indices


def _div_nonneg(a, b: int):
    """``a // b`` for a traced ``a >= 0`` and a static ``b > 0``, in scalar code libtpu's
    profiler evaluates. ``jnp``'s floor division of a signed int compiles to a sign fix-up
    around an unsigned min (``smin.u32``) that the profiler does not evaluate (the result
    reads 0: a causal KV block's compute-chunk count came out 0, so its matmuls were never
    costed); for ``a >= 0`` a shift (``b`` a power of two) or a truncating division is equal."""
    from jax import lax
    import jax.numpy as jnp
    a = jnp.asarray(a, jnp.int32)
    if b & (b - 1) == 0:
        return lax.shift_right_logical(a, jnp.int32(b.bit_length() - 1))
    return lax.div(a, jnp.int32(b))


def _cdiv_fn(cdiv_orig):
    """The kernel's ``cdiv`` (util): Python ints as before; a traced numerator (always >= 0
    in the kernel: lengths, clipped block sizes) through ``_div_nonneg``."""
    import numpy as np

    def cdiv(a, b):
        if isinstance(a, (int, np.integer)) and isinstance(b, (int, np.integer)):
            return cdiv_orig(a, b)
        return _div_nonneg(a + (int(b) - 1), int(b))
    return cdiv


def _pinned_body(body, segs, distribution, layout):
    """``body`` (the public kernel function, a partial) with the case's distribution and
    the kernel's SMEM state stored at static addresses at entry, and the per-sequence
    metadata read as closed forms."""
    import jax.numpy as jnp
    kv_lens, cu_q_lens, page_indices = _metadata_formulas(segs, *layout)

    def pinned(*refs, **kw):
        kv_ref, pages_ref, cu_ref, dist_ref, sem_ids_ref, bo_ids_ref, upd_ids_ref = refs[:7]
        for a, v in enumerate(distribution):
            dist_ref[a] = jnp.int32(v)
        for ref, v in ((sem_ids_ref, 0), (bo_ids_ref, -1), (upd_ids_ref, -1)):
            for a in range(ref.shape[0]):
                ref[a] = jnp.int32(v)
        meta = (_Formula(kv_ref.shape, kv_lens), _Formula(pages_ref.shape, page_indices),
                _Formula(cu_ref.shape, cu_q_lens), dist_ref, _StaticAddresses(sem_ids_ref),
                _StaticAddresses(bo_ids_ref), _StaticAddresses(upd_ids_ref))
        return body(*meta, *refs[7:], **kw)

    return pinned


def _bounded_loop(loop_fn, when, cap: int):
    """``loop_fn(lower, upper)(body)`` as a loop of static trip count ``cap`` whose
    iteration ``k`` runs ``body(lower + k)`` under ``lower + k < upper``: the same
    iterations, but a trip count the profiler knows (it evaluates the guards per iteration)."""

    def make(lower, upper, **kw):
        def deco(body):
            def guarded(k):
                idx = lower + k

                @when(idx < upper)
                def _():
                    body(idx)

            guarded.__name__ = f"bounded_{body.__name__}"
            return loop_fn(0, cap, **kw)(guarded)
        return deco
    return make


def _jnp_proxy(jnp, exp_bf16_in_f32: bool, where_bf16_in_f32: bool):
    """The kernel module's ``jnp`` while lowering, with two ops moved out of bf16 where
    libtpu's profiler aborts simulating them (the compiler accepts both):

    * ``exp_bf16_in_f32``: ``exp`` of a bf16 array in f32, rounded back (the kernel's
      ``exp(m_prev - m_curr)`` on the (rows, 128) running-max tile): "Expected
      vector-bf16packed, got vector-int32 ... vmul.bf16 1069105081" (log2 e);
    * ``where_bf16_in_f32`` (v5e, no bf16 VPU): ``where`` selecting a bf16 array in f32,
      rounded back (the kernel zeroes V rows past the KV length): its packed 16-bit mask
      aborts the profiler ("Expected vector-int16, got vector-int32 ... vunpack.i.l.s16.s32").
      v5e computes bf16 element-wise ops in f32 anyway.
    """
    proxy = types.SimpleNamespace(**{k: getattr(jnp, k) for k in dir(jnp) if not k.startswith("__")})

    def exp(x, *a, **kw):
        if exp_bf16_in_f32 and getattr(x, "dtype", None) == jnp.bfloat16:
            return jnp.exp(x.astype(jnp.float32), *a, **kw).astype(jnp.bfloat16)
        return jnp.exp(x, *a, **kw)

    def where(cond, *xy, **kw):
        if where_bf16_in_f32 and len(xy) == 2 and getattr(xy[0], "dtype", None) == jnp.bfloat16:
            x, y = xy
            return jnp.where(cond, x.astype(jnp.float32), y, **kw).astype(jnp.bfloat16)
        return jnp.where(cond, *xy, **kw)

    proxy.exp = exp
    proxy.where = where
    return proxy


def _lowering_proxies(pl, lax, *, target_case: str, name: str, segs, distribution, layout, caps: dict,
                      bounded: bool, unrolled=(), pinned_hbm: bool = False, hbm_metadata: bool = False):
    """Stand-ins for the kernel module's ``pl`` and ``lax`` while lowering.

    ``pl.pallas_call`` pins the target case's kernel body, names it, and turns the other
    cases' kernels into their aliased pass-through. With ``bounded``, ``pl.loop`` and
    ``lax.fori_loop`` give the loops named in ``caps`` a static trip count (``_bounded_loop``):
    libtpu's profiler does not follow a loop whose trip count depends on an enclosing loop's
    index (measured: the compute loop over a KV block, whose count depends on the KV-block
    index, was costed as 0 iterations, so no matmul reached the estimate).
    """
    from jax.experimental.pallas import tpu as pltpu
    pl_proxy = types.SimpleNamespace(**{k: getattr(pl, k) for k in dir(pl) if not k.startswith("__")})
    lax_proxy = types.SimpleNamespace(**{k: getattr(lax, k) for k in dir(lax) if not k.startswith("__")})

    def pallas_call(kernel, *args, **kwargs):
        case = kernel.keywords["case"]
        if case.name != target_case:
            if not pinned_hbm:
                # Its outputs are its inputs (input_output_aliases {q: out, cache: cache}).
                return lambda *operands: (operands[7], operands[9])
            # TPU7x: the wrapper has pinned q and the cache to HBM, and the pinned values
            # cannot be passed on as outputs: an empty kernel with the same specs and
            # aliases, named outside the target's prefix (a few cycles).
            kwargs["name"] = f"skipped_{PREFIX}_{case.name.lower()}"
            call = pl.pallas_call(lambda *refs: None, *args, **kwargs)
        else:
            kwargs["name"] = name
            call = pl.pallas_call(_pinned_body(kernel, segs, distribution, layout), *args, **kwargs)

        if not hbm_metadata:
            return call

        def with_hbm_metadata(*operands):
            # v5e: the seven scalar-prefetch operands (metadata and state) kept in HBM.
            # XLA places small ones in VMEM, and v5e's profiler aborts on the VMEM -> SMEM
            # copy ("Unsupported DMA direction: 10 on VL/VLP"). Their values are unused.
            # (On TPU7x the constraint fails to compile in prefill: "backend_config-specified
            # color S(0) conflicts with existing color S(6) assigned by layout".)
            meta = [pltpu.with_memory_space_constraint(x, pltpu.HBM) for x in operands[:7]]
            return call(*meta, *operands[7:])
        return with_hbm_metadata

    loop, fori_loop = bounded_loops(pl, lax, caps, bounded=bounded, unrolled=unrolled)
    pl_proxy.pallas_call = pallas_call
    pl_proxy.loop = loop
    lax_proxy.fori_loop = fori_loop
    return pl_proxy, lax_proxy


def bounded_loops(pl, lax, caps: dict, *, bounded: bool, unrolled) -> tuple:
    """``(pl.loop, lax.fori_loop)`` stand-ins for the lowering proxies: a loop whose body is
    named in ``caps`` and whose bounds are run-time values runs to that static cap with each
    iteration under ``index < upper`` (the bodies named in ``unrolled`` unrolled, at most
    ``MAX_UNROLL``); other loops, and all of them without ``bounded``, are the kernel's own
    (module doc)."""
    def loop(lower, upper, **kw):
        def deco(body):
            cap = caps.get(body.__name__)
            static = all(isinstance(b, int) for b in (lower, upper))
            plain = kw.get("step", 1) != 1 or kw.get("init_carry") is not None
            if not bounded or cap is None or static or plain:
                return pl.loop(lower, upper, **kw)(body)
            if body.__name__ in unrolled and cap <= MAX_UNROLL:
                kw["unroll"] = True
            return _bounded_loop(pl.loop, pl.when, cap)(lower, upper, **kw)(body)
        return deco

    def fori_loop(lower, upper, body_fun, init_val, **kw):
        cap = caps.get(getattr(body_fun, "__name__", ""))
        if not bounded or cap is None or all(isinstance(b, int) for b in (lower, upper)):
            return lax.fori_loop(lower, upper, body_fun, init_val, **kw)

        def guarded(k, carry):
            idx = lower + k
            return lax.cond(idx < upper, lambda c: body_fun(idx, c), lambda c: c, carry)
        return lax.fori_loop(0, cap, guarded, init_val, **kw)
    return loop, fori_loop


def _tpu_version_fn(version: int, int16_masks: bool):
    """The kernel's ``get_tpu_version`` for the target. Unless ``int16_masks``, its score
    masks are built in int32 (as on v5e) instead of int16 (v6e+): libtpu's profiler aborts
    simulating the int16 mask code ("Expected vector-int16, got vector-int32 ... vadd.s16")."""
    import sys

    def get_tpu_version():
        if not int16_masks and sys._getframe(1).f_code.co_name == "flash_attention_step1_qk_softmax":
            return min(version, 5)
        return version
    return get_tpu_version


@contextlib.contextmanager
def _patched(module, **attrs):
    old = {k: getattr(module, k) for k in attrs}
    try:
        for k, v in attrs.items():
            setattr(module, k, v)
        yield module
    finally:
        for k, v in old.items():
            setattr(module, k, v)


# -------------------------------------------------------------------------- builder
def case_sequences(workload: dict, case: Case, run: Case, lim: ServingLimits, bs: BlockSizes, who: str):
    """The checked sequences of ``workload``'s ``case`` for a lowering of the ``run`` kernel
    (the kernel's case that runs them): ``(q_lens, kv_lens, chunk_prefill_size (prefill:
    the one q_len of every sequence, else None), segments, distribution, token rows, sequence
    slots)``. ``who`` names the kernel in the errors."""
    w = Workload(tuple(workload["q_lens"]), tuple(workload["kv_lens"]), tuple(workload["distribution"]))
    lo, hi = w.case_range(case)
    if hi == lo:
        raise ValueError(f"workload has no {case.value} sequences (distribution={w.distribution})")
    q_lens, kv_lens = w.q_lens[lo:hi], w.kv_lens[lo:hi]
    if max(kv_lens) > lim.max_model_len:
        raise ValueError(f"kv_len {max(kv_lens)} > max_model_len={lim.max_model_len}")
    chunk = None
    if run == Case.PREFILL:
        if len(set(q_lens)) != 1:
            raise ValueError(f"{who} prefill case is fixed-size chunks: every prefill sequence needs the same "
                             f"q_len, got {sorted(set(q_lens))}")
        chunk = q_lens[0]
    n = hi - lo
    distribution = {Case.DECODE: (n, n, n), Case.PREFILL: (0, n, n), Case.MIXED: (0, 0, n)}[run]
    return (q_lens, kv_lens, chunk, _segments(q_lens, kv_lens), distribution,
            round_up(max(sum(q_lens), bs.bq, 8), 8), n)


def lower(*, workload: dict, block_sizes, tpu: str, model: dict, limits: dict, case: str,
          options: dict | None = None):
    """``(Lowered, kernel name prefix)``: the public RPA v3 kernel's ``case`` kernel for
    ``workload``, with the workload's metadata visible to the static profiler (module doc)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import topologies

    from kernel.hardware import tpu_info
    from rpa_tune.public_kernel import load_kernel_module

    K = load_kernel_module()
    opts = dict(options or {})
    update_kv_cache = bool(opts.pop("update_kv_cache", False))
    bounded = bool(opts.pop("bounded_loops", True))
    int16_masks = bool(opts.pop("int16_masks", False))
    bf16_exp = bool(opts.pop("bf16_exp", False))
    unrolled = tuple(opts.pop("unrolled_loops", ("attention_loop",)))
    nonneg_div = bool(opts.pop("nonneg_div", True))
    vmem_limit = opts.pop("vmem_limit_bytes", None)
    bf16_where = bool(opts.pop("bf16_where", False))
    kernel_opts = {k: opts.pop(k) for k in _KERNEL_OPTIONS if k in opts}
    if opts:
        raise ValueError(f"unknown options {sorted(opts)}; valid: update_kv_cache, vmem_limit_bytes, "
                         f"bounded_loops, unrolled_loops, nonneg_div, int16_masks, bf16_exp, bf16_where, "
                         f"{', '.join(_KERNEL_OPTIONS)}")

    case = Case.parse(case)
    bs = BlockSizes.coerce(block_sizes)
    gen = get_generation(tpu)
    if gen.name not in TPU_VERSION:
        raise ValueError(f"the public kernel has no TPU version for {gen.name!r}")
    m = ModelShape(**model)
    lim = ServingLimits(**limits)
    q_lens, kv_lens, chunk, segs, distribution, T, S = case_sequences(workload, case, case, lim, bs,
                                                                      "the public kernel's")
    pages_per_seq = lim.pages_per_seq
    vmem_bytes = int(tpu_info(gen.name).vmem_capacity_bytes)
    num_pages = _num_pages(segs, m, lim.page_size, vmem_bytes)
    if vmem_limit is None:
        from rpa_tune.kernels.tpu_inference import KERNEL as TUNED
        vmem_limit = TUNED.vmem_limit(vmem_bytes)

    topo = topologies.get_topology_desc(platform="tpu", topology_name=gen.topology)
    sharding = jax.sharding.SingleDeviceSharding(topo.devices[0])
    sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, jnp.dtype(dt), sharding=sharding)
    q_dt, kv_dt = m.q_dtype, m.kv_dtype
    args = (sds((T, m.num_q_heads, m.head_dim), q_dt),
            sds((T, m.num_kv_heads, m.head_dim), kv_dt),
            sds((T, m.num_kv_heads, m.head_dim), kv_dt),
            sds(K.get_kv_cache_shape(num_pages, lim.page_size, m.num_kv_heads, m.head_dim, jnp.dtype(kv_dt)),
                kv_dt),
            sds((S,), "int32"), sds((S * pages_per_seq,), "int32"), sds((S + 1,), "int32"),
            sds((3,), "int32"))

    bst = tuple(bs)
    # The other cases' kernels become pass-throughs (below), but the wrapper still asks its
    # default block sizes for them, which it has none of on v4 (it raises): there they get
    # the target's sizes, which nothing runs.
    other = bst if TPU_VERSION[gen.name] < 5 else None
    call_kw = dict(sm_scale=m.head_dim ** -0.5, update_kv_cache=update_kv_cache,
                   vmem_limit_bytes=int(vmem_limit), chunk_prefill_size=chunk,
                   d_block_sizes=bst if case == Case.DECODE else other,
                   p_block_sizes=bst if case == Case.PREFILL else other,
                   m_block_sizes=bst if case == Case.MIXED else other)
    call_kw.update(kernel_opts)
    name = kernel_name(case, bs)
    # The un-jitted function: the public jit's trace cache would outlive the patches below.
    rpa = getattr(K.ragged_paged_attention, "__wrapped__", K.ragged_paged_attention)
    # Static bounds of the loops whose trip count is computed inside an enclosing loop, by
    # the name of their body: q blocks (mixed), KV blocks, compute chunks of a KV block,
    # pages written back per KV block.
    caps = {"compute_with_bq": cdiv(max(q_lens), bs.bq), "compute_with_bkv": cdiv(max(kv_lens), bs.bkv),
            "attention_loop": bs.bkv // bs.ckv, "loop_body": bs.bkv // lim.page_size}
    pl_proxy, lax_proxy = _lowering_proxies(K.pl, K.lax, target_case=_PUBLIC_CASE[case], name=name,
                                            segs=segs, distribution=distribution,
                                            layout=(pages_per_seq, lim.page_size, num_pages), caps=caps,
                                            bounded=bounded, unrolled=unrolled,
                                            pinned_hbm=TPU_VERSION[gen.name] >= 7,
                                            hbm_metadata=TPU_VERSION[gen.name] <= 5)
    fn = jax.jit(functools.partial(rpa, **call_kw), donate_argnums=(0, 1, 2, 3))
    mesh = jax.sharding.Mesh(np.array([topo.devices[0]]), ("x",)).abstract_mesh
    version = TPU_VERSION[gen.name]
    patches = dict(pl=pl_proxy, lax=lax_proxy,
                   jnp=_jnp_proxy(K.jnp, not bf16_exp, version <= 5 and not bf16_where),
                   cdiv=_cdiv_fn(K.cdiv) if nonneg_div else K.cdiv,
                   get_tpu_version=_tpu_version_fn(version, int16_masks))
    with _patched(K, **patches), \
            jax.sharding.use_abstract_mesh(mesh), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        lowered = fn.lower(*args)
    return lowered, name
