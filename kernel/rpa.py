"""Ragged Paged Attention (RPA) for TPU in Pallas: one specialised kernel per case.

Design (after the RPA paper, written for this project):

* Layouts. Ragged token dimensions are never tiled. Q is pre-arranged as
  ``[tokens, kv_heads, group, head_dim_padded]`` so that the query group of one KV
  head is loaded as one ``(cq * group, head_dim)`` MXU operand (GQA/MQA/MHA share one
  path). The KV cache is the merged, packed layout ``[pages, page_size, ceil(2*Hkv/pk),
  pk, Dp]`` (K and V interleaved), and the new tokens' K/V are packed the same way
  (``[tokens, ceil(2*Hkv/pk), pk, Dp]``) so a KV block is always the same VMEM shape.
* Per (sequence, q block), the KV range needed is walked as a list of *steps*: first the
  cached context ``[0, kv_len - q_len)`` gathered page by page from the cache, then the
  new tokens ``[kv_len - q_len, kv_len)`` read straight from the packed new-KV array
  (causal blocks only). Decode copies its one new token's row into the last step's
  buffer instead (``place_new_token``). The cache update (HBM -> HBM DMAs, issued when
  a sequence starts and awaited when it ends) runs overlapped with attention; the one
  step that reads new tokens back from the cache (a merged step, ``_Steps``) awaits it
  first.
* Double-buffered software pipeline with explicit async DMAs: while step ``k`` computes,
  step ``k+1`` (or the next q block / next sequence's first step) is being fetched;
  the Q block of the next (sequence, q block) is prefetched the same way; the O block
  is written back asynchronously (in order, so a tail write that spills into the next
  sequence's rows is always overwritten by that sequence's own write).
* Every DMA has a static shape (a page, a q block): the interpreter runs it on CPU, and
  rows beyond a sequence's end are masked rather than sliced. Dynamic-length cache
  writes are decomposed into power-of-two row counts.
* Compute: for each KV chunk (``ckv``) and KV head, K and V are split out of the merged
  block once (one sublane-strided load of uint32 words per packed row, then integer ops:
  bf16 a shift and two packs, fp8 a bit-exact conversion to bf16), then every q chunk
  (``cq``) of the block runs one online-softmax (FlashAttention-2) update in f32.

The analysis mode (``static_meta``) replaces the scalar metadata by a concrete workload's,
stored at static SMEM addresses (and in closed form inside a loop over like sequences),
so libtpu's static profiler sees the real trip counts; see ``kernel.analysis``.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import typing

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .config import BlockSizes, Case, cdiv
from .vmem import kv_buffer_rows, q_buffer_heads

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
LANES = 128


class _Sem:
    """Rows of the DMA semaphore array ``sems`` (rows x 2 slots)."""
    Q = 0          # q block -> q_buf[slot]
    KV = 1         # a KV step's pages -> kv_buf[slot]
    O = 2          # o_buf[slot] -> output (slot 0 only: writes are awaited in order)
    CACHE = 3      # new tokens' K/V -> cache pages (slot 0 only)
    NEW_KV = 4     # decode: the new token's K/V row -> nkv_buf[slot]
    ROWS = 5


class _Word:
    """Words of the SMEM scalar scratch ``cnt_ref``. KV_PAGES_0 / KV_PAGES_1: pages in
    flight into KV slot 0 / 1, at static addresses (libtpu's static profiler does not
    follow SMEM at a dynamic address; a wait count read that way makes its estimate depend
    on the order of the sequences)."""
    KV_PAGES_0 = 0
    KV_PAGES_1 = 1
    Q_SLOT = 2         # q_buf slot of the current q block
    KV_SLOT = 3        # kv_buf slot of the current KV step
    O_SLOT = 4         # o_buf slot the next output goes through
    O_PENDING = 5      # output writes in flight (1 once one is; decode: its group's rows)
    COUNT = 6


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """Everything static about one case's kernel (hashable: it keys compilation)."""

    case: Case
    bs: BlockSizes
    num_kv_heads: int
    group: int              # q heads per kv head
    head_dim_p: int          # padded head dim (multiple of 128)
    page_size: int
    pages_per_seq: int
    kv_rows: int             # ceil(2 * Hkv / pk)
    kv_pack: int             # pk
    max_num_seqs: int
    sm_scale: float
    sliding_window: int | None
    soft_cap: float | None
    k_scale: float | None
    v_scale: float | None
    q_scale: float | None
    # analysis mode: ((first_seq, end_seq), kv_lens, cu_q_lens) of a concrete workload,
    # the metadata the kernel reads (see ``kernel.analysis``), or None.
    static_meta: tuple | None = None
    skip_dead_chunks: bool = True   # prefill / mixed: skip chunks with no visible key
    score_tile_vregs: int = 256     # see _row_tile and TpuGeneration.score_tile_vregs
    bf16_exp: bool = False          # see TpuGeneration.bf16_exp
    # False: every query sees all kv_len keys of its sequence (prefill / mixed; decode's one
    # token sees them all either way)
    causal: bool = True
    # False: K/V of every position are read from the cache (the new tokens' included, as
    # another layer wrote them) and the cache is left as it is (KV sharing across layers)
    update_cache: bool = True
    # "merged": K and V of head h are entries 2h and 2h + 1 of the packed rows; "hd64":
    # head_dim 64, head h is entry h with K in lanes 0-63 and V in lanes 64-127
    kv_layout: str = "merged"
    sinks: bool = False             # an attention-sink logit per query head (one more operand)

    @property
    def name(self) -> str:
        return f"rpa_{self.case.value}_{self.bs.label()}"


def _unsigned_scalar_op(op, a, b):
    """``op`` on non-negative int32 scalars, computed in uint32 (same result for them).

    Analysis mode: signed scalar division / remainder by a constant lowers to an absolute
    value taken with ``smin.u32``, an instruction libtpu's static profiler does not
    evaluate, so the quotient (and every trip count, position or predicate derived from
    it) would be unknown to it. Unsigned division lowers to shifts / multiply-high, which it
    evaluates."""
    u = lambda x: (jnp.asarray(x, jnp.int32) if isinstance(x, int) else x).astype(jnp.uint32)
    return op(u(a), u(b)).astype(jnp.int32)


def _div(a, b):
    """Floor division of non-negative ints (lax.div avoids jnp's sign-based floor_divide,
    which needs a concrete TPU to lower)."""
    if isinstance(a, int) and isinstance(b, int):
        return a // b
    if jnp.ndim(a) == 0 and jnp.ndim(b) == 0:
        return _unsigned_scalar_op(jax.lax.div, a, b)
    return jax.lax.div(a, jnp.asarray(b, jnp.int32) if isinstance(b, int) else b)


def _rem(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return a % b
    if jnp.ndim(a) == 0 and jnp.ndim(b) == 0:
        return _unsigned_scalar_op(jax.lax.rem, a, b)
    return jax.lax.rem(a, jnp.asarray(b, jnp.int32) if isinstance(b, int) else b)


def _cdiv(a, b):
    return _div(a + b - 1, b)


# Scalar min / max / select are computed branch-free (sub, arithmetic shift, and, add)
# rather than with jnp.minimum / jnp.maximum / jnp.where: same values (operands are
# positions / lengths far below 2**31), but libtpu's static profiler follows them. The
# compiler turns scalar selects into predicated moves (``dst = smov (p, old), new``); when
# p is false the profiler leaves ``dst`` undefined instead of keeping ``old``, and drops
# every instruction computed from it from its simulated trace. In analysis mode that hit
# the KV block index ``blk`` -> key positions -> score mask -> p -> the P@V ``vmatmul``,
# whose result pops (operand-free) stayed: "Cannot schedule FIFO pop instruction when the
# FIFO is empty ... vpop.f32.mrf.mxu1".
def _i32(x):
    return jnp.asarray(x, jnp.int32) if isinstance(x, int) else x


def _lt_mask(a, b):
    """-1 (all ones) where a < b, else 0."""
    return jax.lax.shift_right_arithmetic(_i32(a) - _i32(b), jnp.int32(31))


def _select_lt(a, b, x, y):
    """``x if a < b else y`` for int32 scalars."""
    if all(isinstance(v, int) for v in (a, b, x, y)):
        return x if a < b else y
    return _i32(y) + ((_i32(x) - _i32(y)) & _lt_mask(a, b))


def _all_lt(*pairs):
    """-1 (all ones) when a < b for every (a, b) of ``pairs``, else 0."""
    if all(isinstance(v, int) for pair in pairs for v in pair):
        return -int(all(a < b for a, b in pairs))
    out = _lt_mask(*pairs[0])
    for a, b in pairs[1:]:
        out = out & _lt_mask(a, b)
    return out


def _min(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return min(a, b)
    if jnp.ndim(a) or jnp.ndim(b):
        return jnp.minimum(a, b)
    return _select_lt(a, b, a, b)


def _max(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return max(a, b)
    if jnp.ndim(a) or jnp.ndim(b):
        return jnp.maximum(a, b)
    return _select_lt(a, b, b, a)


def _and(mask, other):
    """``mask & other``, where a None mask means all true."""
    return other if mask is None else jnp.logical_and(mask, other)


def _when(cond, fn):
    if isinstance(cond, bool):
        if cond:
            fn()
    else:
        pl.when(cond)(fn)


def _like_runs(lo: int, hi: int, kv_lens, cu_q_lens, n: int = 1) -> list[tuple[int, int]]:
    """Sequences ``lo .. hi - 1``, in groups of n from lo (the last may be short), cut into
    maximal runs of whole groups whose sequences all have the same q and KV length;
    a group that is short or unlike is a run of its own."""
    shape = lambda s: (cu_q_lens[s + 1] - cu_q_lens[s], kv_lens[s])     # (q_len, kv_len)
    runs = []       # (first, end, alike)
    for s in range(lo, hi, n):
        e = min(s + n, hi)
        alike = e - s == n and all(shape(t) == shape(s) for t in range(s, e))
        if runs and alike and runs[-1][2] and shape(s) == shape(runs[-1][0]):
            runs[-1] = (runs[-1][0], e, True)
        else:
            runs.append((s, e, alike))
    return [(a, b) for a, b, _ in runs]


def _run_chunk(chunk, x):
    """``pl.when`` body: one chunk, returning nothing."""
    chunk(x, 0)


def _loop(lo, hi, body, carry, *, unroll_static=False):
    """fori_loop, or a Python loop when bounds are static and unrolling is asked for."""
    if unroll_static and isinstance(lo, int) and isinstance(hi, int):
        for i in range(lo, hi):
            carry = body(i, carry)
        return carry
    return jax.lax.fori_loop(lo, hi, body, carry)


def _pow2_copies(n, max_rows: int, issue):
    """Issue static-size row copies whose sizes add up to the dynamic count ``n`` (< 2*max_rows).

    ``issue(offset, size)`` is called under a ``pl.when`` for each set bit of ``n``.
    """
    off = 0 * n if not isinstance(n, int) else 0
    for b in reversed(range(max(1, max_rows).bit_length())):
        size = 1 << b
        if size > max_rows:
            continue
        o = off
        _when((n & size) != 0 if not isinstance(n, int) else bool(n & size),
              functools.partial(issue, o, size))
        off = off + (n & size)
    return off


# ---------------------------------------------------------------------------- kernel
def _lanes(x, n: int):
    """A lane-replicated ``(rows, 128)`` array widened (or cut) to ``(rows, n)``."""
    if n == LANES:
        return x
    if n < LANES:
        return x[:, :n]
    wide = jnp.tile(x, (1, cdiv(n, LANES)))
    return wide if n % LANES == 0 else wide[:, :n]


def _bf16_of_low_bits(w):
    """bf16 whose bits are the low 16 bits of each uint32 in ``w``."""
    return pltpu.bitcast(w.astype(jnp.uint16), jnp.bfloat16)


def _split_words(w, v_ok=None):
    """bf16 K/V pairs packed in uint32 words -> (K, V) bf16.

    A word holds the K element (low 16 bits) and the V element (high 16 bits) of one
    head at one lane, as the merged layout interleaves them (k_h, v_h) along the packing
    dim. Truncating the word to 16 bits gives K's bits, truncating it shifted right by 16
    gives V's: two integer packs and one shift per word vreg, and no float conversion
    (its rounding costs several VPU ops per vreg). ``v_ok`` (rows, 1) zeroes the invalid
    rows (their bits may be any value, NaN included, and a NaN times a zero weight is
    NaN). The mask goes on the words: a select on the bf16 V fails v5e's compiler
    (LLO type check: "Expected vector-int16, got vector-int32" at a vunpack)."""
    if v_ok is not None:
        w = jnp.where(v_ok, w, jnp.zeros_like(w))
    return _bf16_of_low_bits(w), _bf16_of_low_bits(w >> 16)


def _strided_words(words, row0, count: int, stride: int, Dp: int, interpret: bool):
    """uint32 (count, Dp): word rows ``row0, row0 + stride, ...`` of ``words`` ((rows, Dp):
    a ref viewed as uint32 when compiled, an equal value in the interpreter, which cannot
    load through a reshaped / bitcast ref). Mosaic's strided load needs a 128-lane last
    dim: for Dp > 128 the rows are viewed as Dp / 128 rows of 128 lanes (row-major) and
    each lane tile is one strided load, from the same start and stride in both modes."""
    def strided(rows, start, step):
        if interpret:
            return jax.lax.dynamic_slice_in_dim(rows, start, (count - 1) * step + 1, axis=0)[::step]
        return rows[pl.ds(start, count, stride=step), :]
    if Dp == LANES:
        return strided(words, row0, stride)
    nt = Dp // LANES                     # word row r, lane tile j -> row r * nt + j
    tiles = words.reshape(words.shape[0] * nt, LANES)
    return jnp.concatenate([strided(tiles, row0 * nt + j, stride * nt) for j in range(nt)], axis=1)


def _store_strided_words(words, row0: int, stride: int, w, Dp: int, interpret: bool):
    """``_strided_words``' rows of ``words`` set to ``w`` (count, Dp): a strided store into
    the ref when compiled; in the interpreter the updated value is returned."""
    count = w.shape[0]
    nt = Dp // LANES
    tiles = words.reshape(words.shape[0] * nt, LANES) if nt > 1 else words
    for j in range(nt):
        start, step, part = row0 * nt + j, stride * nt, w[:, j * LANES:(j + 1) * LANES]
        if interpret:
            tiles = tiles.at[start:start + (count - 1) * step + 1:step].set(part)
        else:
            tiles[pl.ds(start, count, stride=step), :] = part
    return tiles.reshape(words.shape) if interpret else None


def _f32_of_word_halves(w):
    """The two bf16 values packed in uint32 words (low half, high half) as exact f32."""
    return pltpu.bitcast(w << 16, jnp.float32), pltpu.bitcast(w & jnp.uint32(0xFFFF0000), jnp.float32)


def _bf16_word(lo, hi):
    """uint32 words packing bf16(lo) (low half) and bf16(hi) (high half), lo / hi f32."""
    bits = lambda x: pltpu.bitcast(x.astype(jnp.bfloat16).astype(jnp.float32), jnp.uint32)
    return (bits(lo) >> 16) | (bits(hi) & jnp.uint32(0xFFFF0000))


# float8_e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; bf16: sign, 8 (bias 127), 7.
_E4M3_REBIAS = (127 - 7) << 7          # the exponent bias difference, at bf16's exponent field


def _e4m3_bf16_bits(t):
    """uint32 whose low 8 bits are a float8_e4m3fn -> uint32 holding the same value's bf16
    bits in its low 16 bits (exact: bf16 holds every e4m3 value, subnormals included).

    Integer ops only, but for the subnormals: a normal e4m3 (exponent field 1-15) moves its
    exponent and mantissa fields up by 4 bits and re-biases the exponent; a subnormal (field
    0) is its 3-bit mantissa times 2^-9, converted from the integer (exact in f32, whose top
    16 bits are then its bf16). Every byte maps to a finite value: the NaN encodings
    (0x7f / 0xff) become +-480, so rows past a sequence's end (any bytes) never put a NaN
    into the PV product and need no mask. Why not the compiler's fp8 conversion: the K / V
    bytes of one head are every 4th byte of the block, and a strided fp8 load or a
    bitcast to fp8 of integer bytes fails libtpu's LLO type check with the static profiler
    on ("Expected vector-f8e4m3b11, got vector-int8" at a vunpack), so such a kernel could
    not be estimated; an f32 op on an integer bitcast fails it too, hence the conversion
    for the subnormal mantissa."""
    m = t & 0x7F                                            # exponent and mantissa fields
    normal = (m << 4) + _E4M3_REBIAS
    tiny = jax.lax.bitcast_convert_type(m, jnp.int32).astype(jnp.float32) * (2.0 ** -9)
    tiny = jax.lax.bitcast_convert_type(tiny, jnp.uint32) >> 16
    return jnp.where(m < 8, tiny, normal) | ((t & 0x80) << 8)


# float8_e5m2: sign, 5 exponent bits (bias 15), 2 mantissa bits.
_E5M2_REBIAS = (127 - 15) << 7


def _e5m2_bf16_bits(t):
    """``_e4m3_bf16_bits`` for float8_e5m2: a normal byte (exponent field 1-30) moves its
    exponent and mantissa fields up by 5 bits and re-biases the exponent; a subnormal
    (field 0) is its 2-bit mantissa times 2^-16. The infinities and NaNs (field 31) map to
    finite values (+-65536 .. 114688), so rows past a sequence's end need no mask here
    either. Exact for every finite e5m2 value."""
    m = t & 0x7F
    normal = (m << 5) + _E5M2_REBIAS
    tiny = jax.lax.bitcast_convert_type(m, jnp.int32).astype(jnp.float32) * (2.0 ** -16)
    tiny = jax.lax.bitcast_convert_type(tiny, jnp.uint32) >> 16
    return jnp.where(m < 4, tiny, normal) | ((t & 0x80) << 8)


def _split_e4m3_words(w, j: int, convert=_e4m3_bf16_bits):
    """fp8 K/V of two heads packed in uint32 words -> (K, V) bf16 of head ``j`` (0 or 1): a
    word holds (k_0, v_0, k_1, v_1) of one lane, lowest byte first (``convert``: the fp8
    format's byte -> bf16 bits)."""
    t = w >> (16 * j) if j else w
    return _bf16_of_low_bits(convert(t)), _bf16_of_low_bits(convert(t >> 8))


def _row_tile(rows: int, ckv: int, budget_vregs: int) -> int:
    """Rows of q per online-softmax update: the largest divisor of ``rows`` that is a
    multiple of 16 (a bf16 q tile) and keeps the f32 score tile (rows x ckv) within
    ``budget_vregs`` vregs; ``rows`` itself when it has no such divisor (small decode
    tiles). Every tile pushes the chunk's K into the MXU as weights again, and the score
    tile is spilled either way (the register file holds 64 vregs). The best budget in the
    static profiler's estimates differs by generation (tall tiles on the 256-wide MXUs,
    short ones on the 128-wide), hence a budget per generation
    (``TpuGeneration.score_tile_vregs``; estimates in notebook.md)."""
    budget = max(16, (budget_vregs * 8 * LANES) // max(LANES, ckv))
    best = None
    for t in range(16, min(rows, budget) + 1, 16):
        if rows % t == 0:
            best = t
    return best or rows


@dataclasses.dataclass(frozen=True)
class _Geometry:
    """Static sizes and choices of one case's kernel, derived from its ``KernelSpec``."""

    spec: KernelSpec
    bq: int
    bkv: int
    cq: int
    ckv: int
    ps: int                  # page size
    pk: int                  # KV packing (entries per packed row)
    Hkv: int
    G: int                   # q heads per KV head
    Dp: int                  # padded head dim
    pages_per_block: int
    n_chunks: int            # ckv chunks per KV block
    n_qchunks: int           # cq chunks per q block
    decode: bool
    nseq: int                # sequences per q block: decode bq (one token each), else 1
    window: int | None
    q_fold: float            # folded into q once per q block (see load_q)
    cap_fold: float | None   # soft cap: scores are cap_fold * tanh(s / cap) (base 2, see of)
    row_tile: int            # q rows per online-softmax update
    buf_rows: int            # packed rows per token in the KV block buffer

    @classmethod
    def of(cls, spec: KernelSpec) -> "_Geometry":
        bq, bkv, cq, ckv = spec.bs
        pk, Dp = spec.kv_pack, spec.head_dim_p
        scale = spec.sm_scale * (spec.q_scale or 1.0) * (spec.k_scale or 1.0)
        # The score scale is folded into q once per q block, and so is log2(e) without a
        # soft cap (with one, into the cap's own multiply after the tanh): scores are in
        # base 2 and exp2 replaces exp, which costs the same as exp minus its multiply by
        # log2(e). (A bf16 exp of a capped score also broke libtpu's static profiler on
        # v6e: an LLO type check on the multiply by log2(e) that exp lowers to.)
        log2e = math.log2(math.e)
        cap_fold = None if spec.soft_cap is None else spec.soft_cap * log2e
        return cls(spec=spec, bq=bq, bkv=bkv, cq=cq, ckv=ckv, ps=spec.page_size, pk=pk, Hkv=spec.num_kv_heads,
                   G=spec.group, Dp=Dp, pages_per_block=bkv // spec.page_size,
                   n_chunks=bkv // ckv, n_qchunks=bq // cq, decode=spec.case == Case.DECODE,
                   nseq=bq if spec.case == Case.DECODE else 1,
                   window=spec.sliding_window, q_fold=scale * (log2e if cap_fold is None else 1.0),
                   cap_fold=cap_fold, row_tile=_row_tile(cq * spec.group, ckv, spec.score_tile_vregs),
                   buf_rows=kv_buffer_rows(spec.kv_rows))

    def exp(self, x):
        return jnp.exp2(x)


class _Refs(typing.NamedTuple):
    """The kernel's operands and scratch, in ``pallas_call`` order."""

    kv_lens: object          # scalar prefetch (SMEM)
    page_idx: object
    cu_q_lens: object
    dist: object
    q_hbm: object            # inputs (HBM)
    newkv_hbm: object
    cache_in_hbm: object     # aliased to cache_hbm
    o_in_hbm: object         # aliased to o_hbm
    o_hbm: object            # outputs
    cache_hbm: object
    q_buf: object            # VMEM scratch (build_case_call)
    kv_buf: object
    nkv_buf: object
    o_buf: object
    qh: object
    acc: object
    m: object
    l: object
    cnt: object              # SMEM words (_Word)
    meta: object             # SMEM: analysis mode's metadata
    sems: object             # DMA semaphores (_Sem)
    sinks: object = None     # VMEM (Hkv, G, 128): base-2 sink logits (KernelSpec.sinks), an input


class _Metadata:
    """The scalar metadata the kernel reads, per sequence: from the scalar-prefetch arrays
    when serving; in analysis mode (``spec.static_meta``) from a concrete workload's values
    stored at static SMEM addresses, and in closed form for a traced sequence index.

    libtpu's static profiler reads an SMEM address it cannot resolve statically as 0. A
    static sequence index reads the stored metadata; a traced one (the loop over a run of
    like sequences, the next sequence a q block prefetches for) is at most one past the
    run being traced (``run``), so its metadata is a closed form of it, as branch-free
    scalar arithmetic the profiler follows."""

    def __init__(self, g: _Geometry, refs: _Refs):
        self.g, self.refs, spec = g, refs, g.spec
        self.run = None            # analysis mode: (first, end) of the run being traced
        if spec.static_meta is not None:
            self.seq_range, self.kv_lens_c, self.cu_c = spec.static_meta
            for i, v in enumerate(self.kv_lens_c):
                refs.meta[i] = v
            for i, v in enumerate(self.cu_c):
                refs.meta[spec.max_num_seqs + i] = v
        else:
            lo_idx, hi_idx = {Case.DECODE: (None, 0), Case.PREFILL: (0, 1), Case.MIXED: (1, 2)}[spec.case]
            self.seq_range = (0 if lo_idx is None else refs.dist[lo_idx], refs.dist[hi_idx])

    @property
    def analysis(self) -> bool:
        return self.g.spec.static_meta is not None

    def kv_len(self, s):
        if not self.analysis:
            return self.refs.kv_lens[s]
        if isinstance(s, int):
            return self.refs.meta[s]
        r0, r1 = self.run
        kv = self.kv_lens_c
        return _select_lt(s, r1, kv[r0], kv[min(r1, len(kv) - 1)])

    def cu(self, s):
        if not self.analysis:
            return self.refs.cu_q_lens[s]
        if isinstance(s, int):
            return self.refs.meta[self.g.spec.max_num_seqs + s]
        r0, r1 = self.run
        cu = self.cu_c
        q_len = cu[r0 + 1] - cu[r0]
        return _select_lt(s, r1 + 1, cu[r0] + (_i32(s) - r0) * q_len, cu[min(r1 + 1, len(cu) - 1)])

    def page(self, i):
        # Analysis mode does not read the scalar-prefetch inputs (they stay in HBM, see
        # build_case_call); which page a DMA reads does not change its cost: page 0.
        return 0 if self.analysis else self.refs.page_idx[i]

    def clamp(self, s):
        return _min(s, self.g.spec.max_num_seqs - 1)

    def members(self, s):
        """(b, sequence, valid) of the q block's sequences from s: decode's group of ``nseq``
        (its last group may be short: ``valid`` is a bool, traced or not), else s alone."""
        hi = self.seq_range[1]
        return [(b, s + b, True if b == 0 else s + b < hi) for b in range(self.g.nseq)]

    def seq_info(self, s):
        """(q_start, q_len, kv_len, ctx, number of q blocks) of sequence s."""
        sc = self.clamp(s)
        q_start = self.cu(sc)
        q_len = self.cu(sc + 1) - q_start
        kv_len = self.kv_len(sc)
        nq = 1 if self.g.decode else _max(1, _cdiv(q_len, self.g.bq))
        return q_start, q_len, kv_len, kv_len - q_len, nq

    def qblock_steps(self, info, i) -> "_Steps":
        """The KV steps of q block i (see ``_Steps``)."""
        g = self.g
        q_start, q_len, kv_len, ctx, nq = info
        q_first = ctx + i * g.bq                       # position of the block's first row
        q_last = ctx + _min((i + 1) * g.bq, q_len) - 1  # position of its last valid row
        lo = _max(0, q_first - g.window + 1) if g.window else 0
        c0 = _div(lo, g.bkv)
        if not g.spec.causal and not g.decode:
            q_last = kv_len - 1                        # the last key any of its rows sees
        if not g.spec.update_cache:
            # every key from the cache: cached steps only, up to the block's last visible key
            return _Steps(c0, _max(1, _cdiv(q_last + 1, g.bkv) - c0), 0, 0, 0, q_last + 1)
        if g.decode:
            # merged: the new token's position is in the last step's block (it is unless
            # it starts a block: ctx a multiple of bkv). It is then attended with the
            # cached keys (_Attention.place_new_token), else apart on the VPU (a step of
            # its own would cost far more; estimates in notebook.md).
            nc = _max(1, _cdiv(ctx, g.bkv) - c0)
            merged = _select_lt(ctx, (c0 + nc) * g.bkv, 1, 0)
            return _Steps(c0, nc, 0, 0, merged, ctx + merged)
        nc = _max(0, _cdiv(ctx, g.bkv) - c0)
        n_lo = _div(_max(0, lo - ctx), g.bkv)
        nn = _max(1, _cdiv(q_last - ctx + 1, g.bkv) - n_lo)
        # Merged: the sequence's only q block, at least two cached steps, and every new
        # token in the last cached step's block (a spec-decode sequence after 2044 cached
        # tokens, bkv 512: tokens 2044 .. 2047). Then the new tokens are read from the
        # cache with that step's pages, once the sequence's cache update (started with the
        # sequence) has landed, instead of as a step of their own: one step and, where
        # dead chunks are not skipped, its chunks fewer.
        merged = -_all_lt((nq, 2), (1, nc), (_div(q_last, g.bkv), _div(_max(0, ctx - 1), g.bkv) + 1))
        return _Steps(c0, nc, n_lo, nn - nn * merged, merged, ctx + q_len * merged)


class _Steps(typing.NamedTuple):
    """The KV steps of one q block: ``nc`` cached steps (blocks ``c0 ..``, gathered page by
    page from the cache; keys below ``cached_limit``), then ``nn`` steps of new tokens
    (blocks ``n0 ..`` of the new-KV array). ``merged`` (0 / 1): the new tokens are in the
    last cached step (``cached_limit`` is then kv_len, else the context length); prefill /
    mixed then await the sequence's cache update before that step is fetched, decode
    copies its new token's row into it (``_Attention.place_new_token``)."""
    c0: object
    nc: object
    n0: object
    nn: object
    merged: object
    cached_limit: object


class _Dmas:
    """Every async copy of the kernel, by what it moves (semaphores: ``_Sem``)."""

    def __init__(self, g: _Geometry, refs: _Refs, meta: _Metadata):
        self.g, self.refs, self.meta = g, refs, meta

    def q_block(self, q_start, i, slot):
        r = self.refs
        return pltpu.make_async_copy(r.q_hbm.at[pl.ds(q_start + i * self.g.bq, self.g.bq)],
                                     r.q_buf.at[slot, :, pl.ds(0, self.g.Hkv)], r.sems.at[_Sem.Q, slot])

    def q_row(self, q_start, slot, b):
        """Decode: the q token of the group's sequence b."""
        r = self.refs
        return pltpu.make_async_copy(r.q_hbm.at[pl.ds(q_start, 1)], r.q_buf.at[slot, pl.ds(b, 1), pl.ds(0, self.g.Hkv)],
                                     r.sems.at[_Sem.Q, slot])

    def new_kv_row(self, q_start, slot, b):
        """Decode: the new token's K/V row of the group's sequence b."""
        r = self.refs
        return pltpu.make_async_copy(r.newkv_hbm.at[pl.ds(q_start, 1)], r.nkv_buf.at[slot, pl.ds(b, 1)],
                                     r.sems.at[_Sem.NEW_KV, slot])

    def o_row(self, q_start, slot, b):
        """Decode: the output token of the group's sequence b."""
        r = self.refs
        return pltpu.make_async_copy(r.o_buf.at[slot, pl.ds(b, 1), pl.ds(0, self.g.Hkv)],
                                     r.o_hbm.at[pl.ds(q_start, 1)], r.sems.at[_Sem.O, 0])

    def kv_page(self, src, slot, p):
        """One page (or page-sized run of new tokens) into page p of KV slot ``slot`` (the
        buffer may have a padding row per token: see kernel.vmem.kv_buffer_rows)."""
        r = self.refs
        return pltpu.make_async_copy(src, r.kv_buf.at[slot, p, :, pl.ds(0, self.g.spec.kv_rows)],
                                     r.sems.at[_Sem.KV, slot])

    def o_block(self, q_start, i, slot):
        r = self.refs
        return pltpu.make_async_copy(r.o_buf.at[slot, :, pl.ds(0, self.g.Hkv)],
                                     r.o_hbm.at[pl.ds(q_start + i * self.g.bq, self.g.bq)], r.sems.at[_Sem.O, 0])

    def cache_rows(self, s, src_row, pos, rows):
        """New tokens' K/V rows [src_row, + rows) -> sequence s's cache at position pos."""
        g, r = self.g, self.refs
        page = self.meta.page(self.meta.clamp(s) * g.spec.pages_per_seq + _div(pos, g.ps))
        return pltpu.make_async_copy(r.newkv_hbm.at[pl.ds(src_row, rows)],
                                     r.cache_hbm.at[page, pl.ds(_rem(pos, g.ps), rows)], r.sems.at[_Sem.CACHE, 0])

    def fetch_q(self, s, i, slot):
        """Start the copy of q block i of sequence s (decode: of the group from s, and its
        new K/V rows) into ``slot``."""
        meta = self.meta
        if not self.g.decode:
            self.q_block(meta.seq_info(s)[0], i, slot).start()
            return
        for b, seq, valid in meta.members(s):
            def start(b=b, seq=seq):
                q_start = meta.cu(meta.clamp(seq))
                self.q_row(q_start, slot, b).start()
                self.new_kv_row(q_start, slot, b).start()
            _when(valid, start)

    def wait_q(self, slot, n=1):
        """Await the q block in ``slot`` (decode: its first n sequences' rows)."""
        if not self.g.decode:
            self.q_block(0, 0, slot).wait()
            return
        for b in range(self.g.nseq):
            def wait(b=b):
                self.q_row(0, slot, b).wait()
                self.new_kv_row(0, slot, b).wait()
            _when(True if b == 0 else b < n, wait)

    def set_kv_pages(self, slot, n):
        """Pages in flight into KV slot ``slot`` (static addresses: see _Word)."""
        r = self.refs
        r.cnt[_Word.KV_PAGES_0] = _select_lt(slot, 1, n, r.cnt[_Word.KV_PAGES_0])
        r.cnt[_Word.KV_PAGES_1] = _select_lt(slot, 1, r.cnt[_Word.KV_PAGES_1], n)

    def fetch_kv_group(self, s, k, slot):
        """Decode: start the page copies of KV step k of the group from s into ``slot``,
        sequence b's into pages ``[b * pages_per_block, ...)``; a sequence with fewer
        steps (or past the last) fetches nothing."""
        g, r, meta = self.g, self.refs, self.meta
        total = 0
        for b, seq, valid in meta.members(s):
            info = meta.seq_info(seq)
            ctx = info[3] if g.spec.update_cache else info[2]     # the cached keys' end
            blk = meta.qblock_steps(info, 0).c0 + k
            limit = ctx if valid is True else _select_lt(seq, meta.seq_range[1], ctx, 0)
            npages = _cdiv(_max(0, _min(g.bkv, limit - blk * g.bkv)), g.ps)
            total = total + npages
            sc = meta.clamp(seq)

            def one_page(p, carry, b=b, blk=blk, npages=npages, sc=sc):
                @pl.when(p < npages)
                def _():
                    page = meta.page(sc * g.spec.pages_per_seq + blk * g.pages_per_block + p)
                    self.kv_page(r.cache_hbm.at[page], slot, b * g.pages_per_block + p).start()
                return carry

            jax.lax.fori_loop(0, g.pages_per_block, one_page, 0)
        self.set_kv_pages(slot, total)

    def fetch_kv(self, s, i, k, slot):
        """Start the page copies of KV step k of (sequence s, q block i) into ``slot``
        (decode: of the group from s)."""
        g, r, meta = self.g, self.refs, self.meta
        if g.decode:
            self.fetch_kv_group(s, k, slot)
            return
        info = meta.seq_info(s)
        q_start, q_len, kv_len, ctx, _ = info
        st = meta.qblock_steps(info, i)
        c0, nc, n0 = st.c0, st.nc, st.n0
        cached = k < nc
        blk = _select_lt(k, nc, c0 + k, n0 + k - nc)
        # a new step's rows past the q block's last row are seen by none of its rows: not
        # fetched (so a causal q block's first step is its own rows' pages, not the whole
        # block)
        limit = _select_lt(k, nc, st.cached_limit, _min((i + 1) * g.bq, q_len) if g.spec.causal else q_len)
        npages = _cdiv(_max(0, _min(g.bkv, limit - blk * g.bkv)), g.ps)
        self.set_kv_pages(slot, npages)
        sc = meta.clamp(s)

        def cached_page(p):
            page = meta.page(sc * g.spec.pages_per_seq + blk * g.pages_per_block + p)
            self.kv_page(r.cache_hbm.at[page], slot, p).start()

        def new_rows(p):
            self.kv_page(r.newkv_hbm.at[pl.ds(q_start + blk * g.bkv + p * g.ps, g.ps)], slot, p).start()

        def one_page(p, carry):
            @pl.when(p < npages)
            def _():
                pl.when(cached)(functools.partial(cached_page, p))
                pl.when(jnp.logical_not(cached))(functools.partial(new_rows, p))
            return carry

        jax.lax.fori_loop(0, g.pages_per_block, one_page, 0)

    def wait_kv(self, slot):
        r = self.refs
        n = _select_lt(slot, 1, r.cnt[_Word.KV_PAGES_0], r.cnt[_Word.KV_PAGES_1])

        def one_page(p, carry):
            @pl.when(p < n)
            def _():
                self.kv_page(r.cache_hbm.at[0], slot, p).wait()
            return carry

        jax.lax.fori_loop(0, self.g.nseq * self.g.pages_per_block, one_page, 0)

    def cache_update(self, s, info, do_wait: bool):
        """KV-cache update of sequence s: its new rows [ctx, kv_len) -> its pages, HBM ->
        HBM; started (``do_wait`` False) when the sequence starts, awaited when it ends."""
        g = self.g
        q_start, q_len, kv_len, ctx, _ = info
        if not g.spec.update_cache:
            return
        if g.decode:
            c = self.cache_rows(s, q_start, ctx, 1)
            (c.wait if do_wait else c.start)()
            return

        def one_page(p, carry):
            lo = _max(ctx, p * g.ps)
            n = _min(kv_len, (p + 1) * g.ps) - lo

            def issue(off, size):
                c = self.cache_rows(s, q_start + lo - ctx + off, lo + off, size)
                (c.wait if do_wait else c.start)()

            _pow2_copies(n, g.ps, issue)
            return carry

        _loop(_div(ctx, g.ps), _cdiv(kv_len, g.ps), one_page, 0)


class _Attention:
    """The compute of a q block: q in, online-softmax state (m, l, acc in VMEM) updated per
    KV step, the output block out. Nothing here issues or awaits a DMA."""

    def __init__(self, g: _Geometry, refs: _Refs, interpret: bool):
        self.g, self.refs, self.interpret = g, refs, interpret

    def init_state(self):
        """Once per kernel: l and acc zero (VMEM scratch starts with any bits, NaN
        included), m as ``reset_max``."""
        r = self.refs
        r.l[...] = jnp.zeros(r.l.shape, jnp.float32)
        r.acc[...] = jnp.zeros(r.acc.shape, jnp.float32)
        self.reset_max()

    def reset_max(self):
        """Per q block: only m is reset. l and acc keep the previous block's values, which
        are finite (sums of p * V over zeroed or valid V rows); a row's first update with
        a visible key has alpha = exp(MASK_VALUE - m) = 0, which zeroes both, and a row
        that sees none is padding either way. Zeroing them per q block would add work to
        the serial stretch between two q blocks' compute (estimates in notebook.md)."""
        r = self.refs
        r.m[...] = jnp.full(r.m.shape, MASK_VALUE, jnp.float32)

    # q and o blocks, (bq, heads, G, Dp) in q_buf / o_buf, against the head-major rows of
    # qh / acc / m / l: row y * G * cq + j * cq + t of KV head h is token y * cq + t of
    # query head j (q chunk, then query head, then token), so each query head's tokens are
    # aligned row slabs. A bf16 q with an even G is read and written as uint32 words, two
    # query heads per word (``_strided_words``; the buffers may have a padding head,
    # ``kernel.vmem.q_buffer_heads``). Token-then-head rows would cost a sublane shuffle
    # per vreg to turn q into them (and back for o).
    def _words_mode(self) -> bool:
        # (decode: each token's G rows are already a (G, Dp) slab)
        return self.refs.q_buf.dtype == jnp.bfloat16 and self.g.G % 2 == 0 and not self.g.decode

    def _buf_words(self, buf, slot):
        """``buf[slot]`` ((bq, heads, G, Dp) bf16) as uint32 word rows: a ref view when
        compiled, a value in the interpreter."""
        n = self.g.bq * buf.shape[2] * self.g.G
        if self.interpret:
            return pltpu.bitcast(buf[slot].reshape(n, self.g.Dp), jnp.uint32)
        return buf.at[slot].reshape(n, self.g.Dp).bitcast(jnp.uint32)

    def _rows_of(self, heads):
        """The head-major rows of one KV head from its query heads' (bq, Dp) values."""
        g = self.g
        return jnp.concatenate([heads[j][y * g.cq:(y + 1) * g.cq] for y in range(g.n_qchunks) for j in range(g.G)],
                               axis=0)

    def load_q(self, qslot):
        """The q block into qh, head-major and scaled by q_fold (bf16, the MXU operand
        dtype). Done once per q block; every step, chunk and row tile then reads its rows
        as one aligned 2-D slab."""
        g, r = self.g, self.refs
        if g.decode:        # qh is (Hkv, nseq, G, Dp): sequence b's G rows are one slab
            for h in range(g.Hkv):
                for b in range(g.nseq):
                    r.qh[h, b] = (r.q_buf[qslot, b, h].astype(jnp.float32) * g.q_fold).astype(r.qh.dtype)
            return
        words_mode = self._words_mode()
        if words_mode:
            words, stride = self._buf_words(r.q_buf, qslot), r.q_buf.shape[2] * g.G // 2
        for h in range(g.Hkv):
            if words_mode:
                heads = []
                for j in range(g.G // 2):
                    heads += _f32_of_word_halves(
                        _strided_words(words, h * g.G // 2 + j, g.bq, stride, g.Dp, self.interpret))
            else:
                q = r.q_buf[qslot, :, h].astype(jnp.float32)             # (bq, G, Dp)
                heads = [q[:, j] for j in range(g.G)]
            r.qh[h] = (self._rows_of(heads) * g.q_fold).astype(r.qh.dtype)

    def q_pos(self, q_first, row):
        """Positions (row_tile, 1) of q rows [row, row + row_tile), which lie in one q
        chunk (``row`` is traced in a q-chunk loop)."""
        g = self.g
        y = _div(row, g.G * g.cq)
        t = jax.lax.broadcasted_iota(jnp.int32, (g.row_tile, 1), 0) + (row - y * (g.G * g.cq))
        return q_first + y * g.cq + (t if g.G == 1 else jax.lax.rem(t, jnp.int32(g.cq)))

    def scores(self, h, row, q_first, k, k_pos, key_end):
        """Masked scores (scaled by q_fold) of q rows [row, row + row_tile) of head h against
        k, whose keys are at ``k_pos`` (1, ckv); keys at ``key_end`` or later are masked
        (``key_end`` None: none is). Decode: ``row`` is the group's sequence, whose token
        is at ``q_first``."""
        g, soft_cap = self.g, self.g.spec.soft_cap
        q = self.refs.qh[h, row] if g.decode else self.refs.qh[h, pl.ds(row, g.row_tile)]
        s = jax.lax.dot_general(q.astype(k.dtype), k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        if soft_cap is not None:
            s = g.cap_fold * jnp.tanh(s / soft_cap)
        mask = None
        if g.window:
            q_pos = q_first if g.decode else self.q_pos(q_first, row)
        elif not g.decode and g.spec.causal:
            q_pos = self.q_pos(q_first, row)
        if not g.decode and not g.spec.causal:
            mask = None if key_end is None else k_pos < key_end
        elif not g.decode:
            # causal and below key_end: one compare per score vreg, against the row's last
            # visible position
            last = q_pos if key_end is None else jnp.minimum(q_pos, key_end - 1)
            mask = k_pos <= last
        elif key_end is not None:
            mask = k_pos < key_end
        if g.window:
            mask = _and(mask, k_pos > q_pos - g.window)
        return s if mask is None else jnp.where(mask, s, MASK_VALUE)

    def online_softmax(self, s, m_prev, l_prev):
        """One online-softmax step: (p, alpha, m, l). m and l stay lane-replicated (rows,
        128) end to end: no lane slicing and re-broadcasting through the permute unit on
        every update."""
        m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
        d = s - _lanes(m_new, s.shape[1])
        p = self.g.exp(d.astype(jnp.bfloat16) if self.g.spec.bf16_exp else d)
        alpha = self.g.exp(m_prev - m_new)
        return p, alpha, m_new, alpha * l_prev + p.astype(jnp.float32).sum(axis=1, keepdims=True)

    def qk_softmax(self, h, row, q_first, k, k_pos, key_end):
        """Scores of a row tile of head h against k and the update of its m and l (in
        VMEM): returns (p, alpha)."""
        r, rows = self.refs, pl.ds(row, self.g.row_tile)
        s = self.scores(h, row, q_first, k, k_pos, key_end)
        p, alpha, r.m[h, rows], r.l[h, rows] = self.online_softmax(s, r.m[h, rows], r.l[h, rows])
        return p, alpha

    def pv_update(self, h, row, p, alpha, v):
        r, rows = self.refs, pl.ds(row, self.g.row_tile)
        pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        r.acc[h, rows] = _lanes(alpha, self.g.Dp) * r.acc[h, rows] + pv

    def row_tiles(self, y):
        g = self.g
        return [y * (g.cq * g.G) + r0 for r0 in range(0, g.cq * g.G, g.row_tile)]

    def flash_update(self, h, y, q_first, k, v, k_pos, key_end):
        """One online-softmax update of q chunk y of head h against (k, v), in row tiles."""
        for row in self.row_tiles(y):
            self.pv_update(h, row, *self.qk_softmax(h, row, q_first, k, k_pos, key_end), v)

    # K / V from uint32 words. bf16 KV (packing 2): each (K, V) pair of a head is one
    # word; fp8 KV (packing 4): each word holds the (K, V) pairs of two heads. So one packed
    # row's K and V rows of a chunk are one sublane-strided load (stride = packed rows per
    # token) of the block viewed as uint32 (Mosaic's ref bitcast, like pltpu.bitcast, packs
    # rows pk*i .. pk*i + pk - 1 into word i, the first lowest; ``_strided_words``).
    # tests/test_kernel_interpret.py runs the interpreter's equivalent;
    # tests/test_kernel_deviceless.py checks the compiled path's Mosaic ops and shapes.
    def kv_words(self, kvslot, x, kv_row, b=0):
        """uint32 (ckv, Dp): word t = packed row ``kv_row`` of token t of chunk x (decode:
        of the group's sequence b)."""
        g, kv_buf = self.g, self.refs.kv_buf
        bkv, ckv, Dp, buf_rows = g.bkv, g.ckv, g.Dp, g.buf_rows
        n = g.nseq * bkv * buf_rows * g.pk
        if self.interpret:
            words = pltpu.bitcast(kv_buf[kvslot].reshape(n, Dp), jnp.uint32)
        else:
            words = kv_buf.at[kvslot].reshape(n, Dp).bitcast(jnp.uint32)
        row0 = (b * bkv + x * ckv) * buf_rows + kv_row     # word row of packed row kv_row, token 0
        return _strided_words(words, row0, ckv, buf_rows, Dp, self.interpret)

    def kv_of_head(self, kvslot, x, h: int, row_ok, b=0):
        """bf16 (K, V) of head h in chunk x (decode: of the group's sequence b), unscaled
        (k_scale is folded into q, v_scale into the output). bf16: V's rows not ``row_ok``
        are zeroed (their bits may be a NaN); an fp8 byte is never a NaN here
        (``_e4m3_bf16_bits``)."""
        g = self.g
        dtype = self.refs.kv_buf.dtype
        convert = _e5m2_bf16_bits if dtype == jnp.float8_e5m2 else _e4m3_bf16_bits
        if g.spec.kv_layout == "hd64":
            # head h is entry h: K in lanes 0-63, V in 64-127; q's lanes 64-127 are zero, so
            # the scores see K only and the PV product's lanes 64-127 are V's (finalize)
            w = self.kv_words(kvslot, x, h // g.pk, b)
            if g.pk == 1:
                kv = pltpu.bitcast(w, jnp.float32)
                kv = (kv if row_ok is None else jnp.where(row_ok, kv, 0.0)).astype(jnp.bfloat16)
            elif g.pk == 2:
                w = w if row_ok is None else jnp.where(row_ok, w, jnp.zeros_like(w))
                kv = _bf16_of_low_bits(w >> 16 if h % 2 else w)
            else:
                j = h % 4
                kv = _bf16_of_low_bits(convert(w >> (8 * j) if j else w))
            return kv, kv
        if g.pk == 2:
            return _split_words(self.kv_words(kvslot, x, h, b), row_ok)
        if g.pk == 1:       # float32: K and V of head h are packed rows 2h and 2h + 1
            k = pltpu.bitcast(self.kv_words(kvslot, x, 2 * h, b), jnp.float32)
            v = pltpu.bitcast(self.kv_words(kvslot, x, 2 * h + 1, b), jnp.float32)
            if row_ok is not None:
                k, v = jnp.where(row_ok, k, 0.0), jnp.where(row_ok, v, 0.0)
            return k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
        if convert is _e4m3_bf16_bits:
            return _split_e4m3_words(self.kv_words(kvslot, x, h // 2, b), h % 2)
        return _split_e4m3_words(self.kv_words(kvslot, x, h // 2, b), h % 2, convert)

    def compute_step(self, info, i, k_step, kvslot, st: "_Steps"):
        """Prefill / mixed: attend q block i of the sequence (``info``) to KV step k_step, in
        KV slot kvslot."""
        g, spec = self.g, self.g.spec
        bq, bkv, ckv, Hkv, window = g.bq, g.bkv, g.ckv, g.Hkv, g.window
        q_start, q_len, kv_len, ctx, _ = info
        nc = st.nc
        blk = _select_lt(k_step, nc, st.c0 + k_step, st.n0 + k_step - nc)
        base = _select_lt(k_step, nc, blk * bkv, ctx + blk * bkv)       # position of row 0
        q_first = ctx + i * bq
        q_hi = ctx + _min((i + 1) * bq, q_len)                 # one past last valid pos
        if not spec.causal:
            q_hi = kv_len                                      # (one past the last key seen)
        limit = _select_lt(k_step, nc, st.cached_limit, q_hi)          # first invalid (fetched) position
        lo_pos = _max(0, q_first - window + 1) if window else 0

        def chunk_keys(x, masked=True):
            """Positions of chunk x's keys (1, ckv), the position keys must be below (the
            limit) and which rows (ckv, 1) are (both None when not ``masked``)."""
            start = base + x * ckv
            k_pos = start + jax.lax.broadcasted_iota(jnp.int32, (1, ckv), 1)
            if not masked:
                return k_pos, None, None
            rows = start + jax.lax.broadcasted_iota(jnp.int32, (ckv, 1), 0)
            return k_pos, limit, rows < limit

        def chunk(x, carry):
            k_pos, key_end, row_ok = chunk_keys(x)

            def attend(h, kk, vv):
                def qc(y, carry3):
                    self.flash_update(h, y, q_first, kk, vv, k_pos, key_end)
                    return carry3

                # Up to MAX_UNROLLED_Q_CHUNKS q chunks are unrolled, more are a loop, in
                # serving and in analysis alike (the estimate prices the program that
                # serves). As a loop the chunks cost far more in the estimate (figures in
                # notebook.md).
                _loop(0, g.n_qchunks, qc, 0, unroll_static=not spec.bs.q_chunk_loop)

            if spec.bs.q_chunk_loop:
                for h in range(Hkv):
                    attend(h, *self.kv_of_head(kvslot, x, h, row_ok))
                return carry
            # The heads' and q chunks' tiles are software-pipelined in program order,
            # the PV product of one tile issued after the scores of the next, so the
            # MXU has independent work while a tile's softmax runs. Holding more tiles'
            # scores (as decode does) does not fit: a prefill tile is up to 256 vregs.
            pending = None
            for h in range(Hkv):
                kk, vv = self.kv_of_head(kvslot, x, h, row_ok)
                for y in range(g.n_qchunks):
                    for row in self.row_tiles(y):
                        p, alpha = self.qk_softmax(h, row, q_first, kk, k_pos, key_end)
                        if pending is not None:
                            pending()
                        pending = functools.partial(self.pv_update, h, row, p, alpha, vv)
            pending()
            return carry

        # Prefill / mixed: the chunks of a step are unrolled; each runs under a
        # ``pl.when`` on whether it holds a visible key, so the chunks past the causal
        # diagonal, past a cached step's valid tokens or before the window cost nothing.
        # On TPU7x libtpu's static profiler aborts on that
        # branch ("Cannot schedule FIFO push ... FIFO name: kErf", at a vexp2), as on a
        # loop over the live range, so there every chunk is computed, masked
        # (``TpuGeneration.skip_dead_chunks``).
        for x in range(g.n_chunks):
            if not spec.skip_dead_chunks:
                chunk(x, 0)
                continue
            # a chunk is live when it holds a position below both the step's limit and
            # the q block's last position (and, windowed, above the window's start)
            live = base + x * ckv < _min(limit, q_hi)
            if window:
                live = jnp.logical_and(live, base + (x + 1) * ckv > lo_pos)
            pl.when(live)(functools.partial(_run_chunk, chunk, x))

    def compute_group(self, group, k_step, kvslot):
        """Decode: attend each sequence of the group to its KV step k_step, in KV slot
        kvslot. ``group``: per sequence b, (info, steps, live) with ``live`` None (b = 0)
        or 1 / 0 (the group's last may be short). Only the chunks that hold a visible
        key of some sequence run, [x_lo, x_hi), computed from the steps' bounds, so the
        loop body has no branch; every sequence's work on a chunk is in one body, so the
        scheduler overlaps their dependent chains (a sequence with no visible key in a
        chunk, a shorter one or one past the last, is computed with every key masked,
        which leaves its state as it was: see ``reset_max``)."""
        g, r = self.g, self.refs
        ckv, Dp, Hkv, window, n_chunks = g.ckv, g.Dp, g.Hkv, g.window, g.n_chunks
        seqs = []
        for info, st, live in group:
            ctx = info[3]                                    # the new token's position
            base = (st.c0 + k_step) * g.bkv                  # position of row 0
            limit = st.cached_limit          # with the new token when merged (place_new_token)
            if g.nseq > 1:                   # a sequence with fewer steps sees nothing
                limit = _select_lt(k_step, st.nc, limit, 0)
            if live is not None:
                limit = _select_lt(0, live, limit, 0)
            lo_pos = _max(0, ctx - window + 1) if window else 0
            x_hi = _min(n_chunks, _cdiv(_max(0, _min(limit, ctx + 1) - base), ckv))
            x_lo = _min(x_hi, _div(_max(0, lo_pos - base), ckv)) if window else 0
            # the chunks wholly below the limit need no key mask and no V-row mask (their
            # rows are all cached tokens); only the last one can be partial
            x_full = _min(x_hi, _max(x_lo, _div(_max(0, limit - base), ckv)))
            seqs.append((ctx, base, limit, x_lo, x_hi, x_full))
        _, _, _, x_lo, x_hi, x_full = seqs[0]
        if len(seqs) > 1:
            # (a sequence with no chunk to compute does not lower x_lo)
            first = lambda lo, hi: _select_lt(lo, hi, lo, n_chunks)
            x_lo = first(x_lo, x_hi) if window else 0
            for _, _, _, lo_b, hi_b, full_b in seqs[1:]:
                if window:
                    x_lo = _min(x_lo, first(lo_b, hi_b))
                x_hi, x_full = _max(x_hi, hi_b), _min(x_full, full_b)
            x_lo = _min(x_lo, x_hi)
            x_full = _min(x_hi, _max(x_lo, x_full))

        def chunk(x, state, masked=True):
            """Chunk x against every sequence and head; state = per (sequence, head) (m, l,
            acc)."""
            # Every head's scores and softmax are issued before any head's PV product. The
            # MXU hands results back in issue order, so a PV issued right after its own
            # head's scores leaves the MXU idle through that head's softmax (estimates in
            # notebook.md).
            stats = []
            for b, (ctx, base, limit, *_) in enumerate(seqs):
                start = base + x * ckv
                k_pos = start + jax.lax.broadcasted_iota(jnp.int32, (1, ckv), 1)
                key_end = row_ok = None
                if masked:
                    key_end = limit
                    row_ok = start + jax.lax.broadcasted_iota(jnp.int32, (ckv, 1), 0) < limit
                for h in range(Hkv):
                    m, l, _ = state[b * Hkv + h]
                    kk, vv = self.kv_of_head(kvslot, x, h, row_ok, b)
                    p, alpha, m, l = self.online_softmax(self.scores(h, b, ctx, kk, k_pos, key_end), m, l)
                    stats.append((p, alpha, m, l, vv))
            return tuple(
                (m, l, _lanes(alpha, Dp) * acc + jnp.dot(p.astype(vv.dtype), vv, preferred_element_type=jnp.float32))
                for (p, alpha, m, l, vv), (_, _, acc) in zip(stats, state))

        # the heads' m, l and acc (a few vregs each) are carried through the chunk loop as
        # values and stored once per step
        state = tuple((r.m[h, b], r.l[h, b], r.acc[h, b]) for b in range(len(seqs)) for h in range(Hkv))
        state = jax.lax.fori_loop(x_lo, x_full, functools.partial(chunk, masked=False), state)
        state = jax.lax.fori_loop(x_full, x_hi, chunk, state)
        for j, (m, l, acc) in enumerate(state):
            b, h = divmod(j, Hkv)
            r.m[h, b], r.l[h, b], r.acc[h, b] = m, l, acc

    def place_new_token(self, info, blk, kvslot, nslot, b):
        """Decode, merged (``_Steps``): the new token's K/V row of the group's sequence b
        (``nkv_buf[nslot, b]``) into its block in KV slot ``kvslot``, at its position, once
        the slot's pages have landed: the last step then attends to it with the cached
        keys. Its cache write is in flight meanwhile; the page copies read only the cached
        positions. Attending to it apart on the VPU would put a lane reduction and a second
        softmax update on every sequence's critical path."""
        g, r = self.g, self.refs
        off = info[3] - blk * g.bkv                             # ctx: the new token's position
        p, t = b * g.pages_per_block + _div(off, g.ps), _rem(off, g.ps)
        r.kv_buf[kvslot, p, t, pl.ds(0, g.spec.kv_rows)] = r.nkv_buf[nslot, b]

    def decode_new_token(self, nslot, b):
        """Decode, when the new token of the group's sequence b starts a block no step
        fetches (``_Steps``): attend to it on the VPU."""
        g, r, spec = self.g, self.refs, self.g.spec
        row = r.nkv_buf[nslot, b].astype(jnp.float32)         # (kv_rows, pk, Dp)
        for h in range(g.Hkv):
            kv_row, j = divmod(h if spec.kv_layout == "hd64" else 2 * h, g.pk)
            kk = row[kv_row, j:j + 1, :]                       # (1, Dp)
            if spec.kv_layout == "hd64":
                vv = kk                                        # V in lanes 64-127 (kv_of_head)
            else:
                v_row, jv = divmod(2 * h + 1, g.pk)
                vv = row[v_row, jv:jv + 1, :]                  # unscaled, as the cache's V
            q = r.qh[h, b].astype(jnp.float32)
            s = jnp.sum(q * kk, axis=1, keepdims=True)                   # (G, 1), scaled
            if spec.soft_cap is not None:
                s = spec.soft_cap * jnp.tanh(s / spec.soft_cap)
            m_prev = r.m[h, b]
            m_new = jnp.maximum(m_prev, s)                     # (G, 128)
            p = g.exp(s - m_new)
            alpha = g.exp(m_prev - m_new)
            r.l[h, b] = alpha * r.l[h, b] + p
            r.m[h, b] = m_new
            r.acc[h, b] = _lanes(alpha, g.Dp) * r.acc[h, b] + _lanes(p, g.Dp) * vv

    def sink_scale(self, m, l, sink, v_scale):
        """Attention sinks: the output scale (rows, 128) that adds the sink's logit (base 2,
        lane-replicated like m and l) to each row's softmax denominator, as one more key
        with no value: acc / (l + 2^(sink - m)), computed at max(m, sink) so that neither
        exponent overflows (a row that saw no key gets 0)."""
        top = jnp.maximum(m, sink)
        a = self.g.exp(m - top)
        return (v_scale * a) / (a * l + self.g.exp(sink - top))

    def finalize(self, oslot):
        """The output block: acc / l, times v_scale (every V entered the PV products
        unscaled: one multiply per output row instead of one per V element and chunk)."""
        g, r = self.g, self.refs
        v_scale = 1.0 if g.spec.v_scale is None else g.spec.v_scale
        cq, G = g.cq, g.G
        if g.decode:        # acc / l / o_buf rows per (KV head, sequence): a (G, Dp) slab
            for h in range(g.Hkv):
                for b in range(g.nseq):
                    if g.spec.sinks:
                        out = r.acc[h, b] * _lanes(self.sink_scale(r.m[h, b], r.l[h, b], r.sinks[h], v_scale), g.Dp)
                    else:
                        out = r.acc[h, b] * _lanes(v_scale / r.l[h, b], g.Dp)
                    r.o_buf[oslot, b, h] = out.astype(r.o_buf.dtype)
            return
        words_mode = self._words_mode()
        if words_mode:
            words, stride = self._buf_words(r.o_buf, oslot), r.o_buf.shape[2] * G // 2
        for h in range(g.Hkv):
            # (l is lane-replicated: no lane broadcast of its first lane)
            if g.spec.sinks:    # each row's query head's sink, rows as load_q's
                sink = jnp.concatenate([jnp.broadcast_to(r.sinks[h, j:j + 1, :], (cq, LANES))
                                        for _ in range(g.n_qchunks) for j in range(G)], axis=0)
                out = r.acc[h] * _lanes(self.sink_scale(r.m[h], r.l[h], sink, v_scale), g.Dp)
            else:
                out = r.acc[h] * _lanes(v_scale / r.l[h], g.Dp)    # (bq * G, Dp), rows as load_q's
            head = lambda j: jnp.concatenate([out[(y * G + j) * cq:(y * G + j + 1) * cq] for y in range(g.n_qchunks)],
                                             axis=0)         # query head j: (bq, Dp)
            if not words_mode:
                r.o_buf[oslot, :, h] = jnp.stack([head(j) for j in range(G)], axis=1).astype(r.o_buf.dtype)
                continue
            for j in range(G // 2):
                w = _bf16_word(head(2 * j), head(2 * j + 1))
                res = _store_strided_words(words, h * G // 2 + j, stride, w, g.Dp, self.interpret)
                words = res if self.interpret else words
        if words_mode and self.interpret:
            r.o_buf[oslot] = pltpu.bitcast(words, r.o_buf.dtype).reshape(r.o_buf.shape[1:])


def _pipeline(g: _Geometry, meta: _Metadata, dma: _Dmas, attn: _Attention, cnt):
    """Every sequence of the case through one double-buffered pipeline: a loop over the
    sequences (decode: over groups of ``nseq`` sequences, one q block), a loop over each
    one's q blocks, a loop over each q block's KV steps. While step k computes, step k + 1
    (or the next q block's / sequence's first step) and the next q block are being
    fetched; outputs are written back asynchronously, in order. Analysis mode (static
    bounds) loops over each run of like sequences (same q and KV length) instead, each
    run's metadata in closed form (``_Metadata``): the same bodies and cross-sequence
    prefetch, every SMEM address and trip count known to the profiler. Buffer slots and
    the output writes in flight live in SMEM (``_Word``)."""
    seg_lo, seg_hi = meta.seq_range
    nseq = g.nseq

    def seq_body(s, carry):
        # decode: the group of sequences from s (members), each with its info and, past
        # the first, whether it exists (live: 1 / 0); prefill / mixed: s alone
        members = meta.members(s)
        infos = [meta.seq_info(seq) for _, seq, _ in members]
        lives = [None] + [_select_lt(seq, seg_hi, 1, 0) for _, seq, _ in members[1:]]
        info = infos[0]
        q_start, q_len, kv_len, ctx, nq = info
        n_live = 1 if nseq == 1 else _min(nseq, seg_hi - s)
        for (_, seq, valid), inf in zip(members, infos):
            _when(valid, functools.partial(dma.cache_update, seq, inf, False))

        def qblock(i, carry2):
            nxt_s = _select_lt(i + 1, nq, s, s + nseq)    # last_q ? next sequence / group : s
            nxt_i = _select_lt(i + 1, nq, i + 1, 0)       # last_q ? 0 : i + 1
            has_next = nxt_s < seg_hi
            qslot = cnt[_Word.Q_SLOT]

            @pl.when(has_next)
            def _():
                dma.fetch_q(nxt_s, nxt_i, 1 - qslot)

            dma.wait_q(qslot, n_live)
            attn.load_q(qslot)
            attn.reset_max()
            sts = [meta.qblock_steps(inf, i) for inf in infos]
            st = sts[0]
            nsteps = st.nc + st.nn
            for st_b, live in zip(sts[1:], lives[1:]):
                nsteps = _max(nsteps, _select_lt(0, live, st_b.nc, 1))

            def step(k, carry3):
                kvslot = cnt[_Word.KV_SLOT]
                last_step = k + 1 >= nsteps

                @pl.when(jnp.logical_not(last_step))
                def _():
                    if not g.decode:
                        # a merged step reads the new tokens from the cache (_Steps)
                        _when(_all_lt((0, st.merged), (k + 1, st.nc), (st.nc - 2, k + 1)) != 0,
                              lambda: dma.cache_update(s, info, do_wait=True))
                    dma.fetch_kv(s, i, k + 1, 1 - kvslot)

                @pl.when(jnp.logical_and(last_step, has_next))
                def _():
                    dma.fetch_kv(nxt_s, nxt_i, 0, 1 - kvslot)

                dma.wait_kv(kvslot)
                if not g.decode:
                    attn.compute_step(info, i, k, kvslot, st)
                else:
                    for b, (inf, st_b, live) in enumerate(zip(infos, sts, lives)):
                        if not g.spec.update_cache:
                            break               # (the new token is read from the cache)
                        # the sequence's last step, when its block holds the new token
                        last = jnp.logical_and(k + 1 >= nsteps if nseq == 1 else k + 1 == st_b.nc, st_b.merged == 1)
                        if live is not None:
                            last = jnp.logical_and(last, live == 1)
                        pl.when(last)(functools.partial(attn.place_new_token, inf, st_b.c0 + k, kvslot, qslot, b))
                    attn.compute_group(list(zip(infos, sts, lives)), k, kvslot)
                cnt[_Word.KV_SLOT] = 1 - kvslot
                return carry3

            jax.lax.fori_loop(0, nsteps, step, 0)
            if g.decode and g.spec.update_cache:
                for b, (st_b, live) in enumerate(zip(sts, lives)):
                    apart = st_b.merged == 0
                    if live is not None:
                        apart = jnp.logical_and(apart, live == 1)
                    pl.when(apart)(functools.partial(attn.decode_new_token, qslot, b))
            oslot = cnt[_Word.O_SLOT]
            attn.finalize(oslot)
            await_output(1 - oslot)
            if not g.decode:
                dma.o_block(q_start, i, oslot).start()
            else:
                for (b, _, valid), inf in zip(members, infos):
                    _when(valid, lambda b=b, q0=inf[0]: dma.o_row(q0, oslot, b).start())
            cnt[_Word.O_PENDING] = n_live
            cnt[_Word.O_SLOT] = 1 - oslot
            cnt[_Word.Q_SLOT] = 1 - qslot
            return carry2

        _loop(0, nq, qblock, 0, unroll_static=True)     # static: decode's 1
        if g.decode:
            for (_, seq, valid), inf in zip(members, infos):
                _when(valid, functools.partial(dma.cache_update, seq, inf, True))
        else:       # unless a merged step awaited it
            _when(meta.qblock_steps(info, 0).merged == 0, lambda: dma.cache_update(s, info, do_wait=True))
        return carry

    def await_output(oslot):
        """Await the output write in flight from ``oslot`` (decode: its O_PENDING rows)."""
        if not g.decode:
            pl.when(cnt[_Word.O_PENDING] == 1)(lambda: dma.o_block(0, 0, oslot).wait())
            return
        for b in range(nseq):
            pl.when(cnt[_Word.O_PENDING] > b)(functools.partial(lambda b: dma.o_row(0, oslot, b).wait(), b))

    def run():
        attn.init_state()
        dma.fetch_q(seg_lo, 0, 0)
        dma.fetch_kv(seg_lo, 0, 0, 0)
        for w in (_Word.Q_SLOT, _Word.KV_SLOT, _Word.O_SLOT, _Word.O_PENDING):
            cnt[w] = 0
        if not meta.analysis:
            if nseq == 1:
                jax.lax.fori_loop(seg_lo, seg_hi, seq_body, 0)
            else:
                jax.lax.fori_loop(0, _cdiv(seg_hi - seg_lo, nseq), lambda j, c: seq_body(seg_lo + j * nseq, c), 0)
        else:
            for r0, r1 in _like_runs(seg_lo, seg_hi, meta.kv_lens_c, meta.cu_c, nseq):
                meta.run = (r0, r1)
                if r1 - r0 <= nseq:
                    seq_body(r0, 0)
                elif nseq == 1:
                    jax.lax.fori_loop(r0, r1, seq_body, 0)
                else:
                    jax.lax.fori_loop(0, (r1 - r0) // nseq, lambda j, c, r0=r0: seq_body(r0 + j * nseq, c), 0)
        await_output(1 - cnt[_Word.O_SLOT])

    _when(seg_lo < seg_hi, run)


def _make_kernel(spec: KernelSpec, interpret: bool = False):
    g = _Geometry.of(spec)

    def kernel(*refs):
        if spec.sinks:      # the sinks operand follows the four HBM inputs
            refs = list(refs)
            sinks = refs.pop(8)
            refs = _Refs(*refs, sinks=sinks)
        else:
            refs = _Refs(*refs)
        meta = _Metadata(g, refs)
        _pipeline(g, meta, _Dmas(g, refs, meta), _Attention(g, refs, interpret), refs.cnt)

    return kernel


def build_case_call(spec: KernelSpec, *, q_shape, q_dtype, newkv_shape, cache_shape, cache_dtype,
                    vmem_limit_bytes: int | None, interpret):
    """The ``pallas_call`` of one case (inputs: 4 SMEM arrays, q, newkv, cache, o_in)."""
    bq, bkv, cq, ckv = spec.bs
    Hkv, G, Dp = spec.num_kv_heads, spec.group, spec.head_dim_p
    q_heads = q_buffer_heads(Hkv, G, q_dtype)
    # decode: a q block is nseq = bq sequences' tokens, each with its own KV block and
    # its rows of qh / acc / m / l as one (G, .) slab per (KV head, sequence)
    nseq = bq if spec.case == Case.DECODE else 1
    kv_block_shape = (nseq * bkv // spec.page_size, spec.page_size, kv_buffer_rows(spec.kv_rows), spec.kv_pack, Dp)
    rows = (bq, G) if spec.case == Case.DECODE else (bq * G,)
    scratch = [
        pltpu.VMEM((2, bq, q_heads, G, Dp), q_dtype),              # q_buf (_Attention.load_q)
        pltpu.VMEM((2,) + kv_block_shape, cache_dtype),            # kv_buf
        pltpu.VMEM((2, nseq, spec.kv_rows, spec.kv_pack, Dp), cache_dtype),  # nkv_buf (decode)
        pltpu.VMEM((2, bq, q_heads, G, Dp), q_dtype),              # o_buf
        pltpu.VMEM((Hkv, *rows, Dp), jnp.bfloat16),                # qh (head-major q)
        pltpu.VMEM((Hkv, *rows, Dp), jnp.float32),                 # acc
        pltpu.VMEM((Hkv, *rows, LANES), jnp.float32),              # m
        pltpu.VMEM((Hkv, *rows, LANES), jnp.float32),              # l
        pltpu.SMEM((_Word.COUNT,), jnp.int32),                     # slots / counters (_Word)
        pltpu.SMEM((2 * spec.max_num_seqs + 1 if spec.static_meta else 1,), jnp.int32),
        pltpu.SemaphoreType.DMA((_Sem.ROWS, 2)),
    ]
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    # Analysis mode reads its metadata from static SMEM stores, so the four metadata
    # arrays are passed as plain (unread) operands rather than scalar-prefetched: on v5e,
    # XLA places small operands in VMEM and libtpu's static profiler rejects the
    # VMEM -> SMEM prefetch DMA ("Unsupported DMA direction: 10 on VL/VLP"). The kernel's
    # operand order is the same either way.
    n_prefetch = 0 if spec.static_meta is not None else 4
    in_specs = [any_spec] * (8 - n_prefetch)
    if spec.sinks:
        in_specs.append(pl.BlockSpec((Hkv, G, LANES), lambda *_: (0, 0, 0), memory_space=pltpu.VMEM))
    params = dict(dimension_semantics=("arbitrary",))
    if vmem_limit_bytes is not None:
        params["vmem_limit_bytes"] = int(vmem_limit_bytes)
    call = pl.pallas_call(
        _make_kernel(spec, interpret=bool(interpret)),
        out_shape=(jax.ShapeDtypeStruct(q_shape, q_dtype),
                   jax.ShapeDtypeStruct(cache_shape, cache_dtype)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=n_prefetch, grid=(1,),
            in_specs=in_specs, out_specs=[any_spec, any_spec],
            scratch_shapes=scratch),
        # operand indices count the 4 scalar-prefetch arrays: cache is #6, o_in is #7
        input_output_aliases={7: 0, 6: 1},
        compiler_params=pltpu.CompilerParams(**params),
        interpret=interpret,
        name=spec.name,
    )
    if n_prefetch:
        return call
    # (as 2-D operands: Pallas checks rank-1 blocks against the local TPU's sublane count,
    # which a deviceless compile does not have)
    return lambda *args: call(*(a.reshape(1, -1) for a in args[:4]), *args[4:])
