"""Public entry point: ``ragged_paged_attention`` (call-compatible with RPA v3)."""
from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

from . import rpa, tables  # tables reads files only on the first lookup
from .config import BlockSizes, CASES, Case, block_size_errors, cdiv, round_up, get_generation
from .config import kv_bytes_per_token as config_kv_bytes_per_token
from .hardware import current_generation, tpu_info
from .heuristics import heuristic_block_sizes
from .validate import validate_inputs
from .vmem import default_vmem_limit, scratch_bytes

log = logging.getLogger("kernel")

FP8_MAX = 448.0  # float8_e4m3fn
E5M2_MAX = 57344.0  # float8_e5m2


def quantize(x, dtype, scale=None):
    """``x / scale`` (no scale: ``x``) cast to ``dtype``, saturating at an fp8 format's
    largest finite value: Q when ``q_scale`` is set (as v3 does), and new K/V given in a
    wider dtype than the cache's (unscaled: K/V arrive quantized, the scales only
    dequantize)."""
    x = x.astype(jnp.float32)
    if scale is not None:
        x = x / scale
    if np.dtype(dtype) == np.dtype(jnp.float8_e4m3fn):
        x = jnp.clip(x, -FP8_MAX, FP8_MAX)
    elif np.dtype(dtype) == np.dtype(jnp.float8_e5m2):
        x = jnp.clip(x, -E5M2_MAX, E5M2_MAX)
    return x.astype(dtype)


def resolve_block_sizes(case: Case, explicit, *, generation: str, dims: dict,
                        chunk_prefill_size=None, sliding_window: bool = False) -> tuple[BlockSizes, str]:
    """Block sizes for one case and where they came from.

    Order: the explicit argument ("explicit") -> ``RPA_{D,P,M}_BLOCK_SIZES``
    ("env:<variable>") -> the tables, exact key then bucketing rule ("table:<file>#<key>")
    -> the heuristic ("heuristic"). See ``kernel.tables``. Everything after the explicit
    argument is memoised per (shape, env value, table state): a call pays a dict lookup.
    """
    return _resolve(case, explicit, generation=generation, dims=dims, chunk_prefill_size=chunk_prefill_size,
                    sliding_window=sliding_window)[:2]


def _resolve(case: Case, explicit, *, generation: str, dims: dict, chunk_prefill_size=None,
             sliding_window: bool = False, heuristic_only: bool = False) -> tuple[BlockSizes, str, int | None]:
    """``resolve_block_sizes`` plus the scoped VMEM limit a table entry asks for (None: the
    kernel's default for the block sizes). ``heuristic_only``: without explicit sizes, the
    heuristic's, never an override's or a table's."""
    if explicit is not None:
        return BlockSizes.coerce(explicit, name=f"{case.value} block sizes"), "explicit", None
    if heuristic_only:
        return _heuristic_cached(
            case, generation, dims["num_q_heads"], dims["num_kv_heads"], dims["head_dim"], dims["page_size"],
            kv_bytes_per_token(dims), dims["max_num_tokens"], dims["pages_per_seq"] * dims["page_size"],
            chunk_prefill_size, dims["q_dtype"], dims["kv_dtype"]), "heuristic", None
    return _resolve_cached(
        case, generation, os.environ.get(tables.ENV_BLOCK_SIZES[case]), tables.epoch(),
        dims["max_num_tokens"], dims["num_q_heads"], dims["num_kv_heads"], dims["head_dim"],
        dims["page_size"], dims["pages_per_seq"], dims["q_dtype"], dims["kv_dtype"],
        chunk_prefill_size, bool(sliding_window))


@functools.lru_cache(maxsize=4096)
def _resolve_cached(case, generation, env_raw, epoch, max_num_tokens, num_q_heads, num_kv_heads, head_dim,
                    page_size, pages_per_seq, q_dtype, kv_dtype, chunk_prefill_size, sliding_window):
    dims = dict(max_num_tokens=max_num_tokens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                head_dim=head_dim, page_size=page_size, pages_per_seq=pages_per_seq, q_dtype=q_dtype,
                kv_dtype=kv_dtype)
    env = tables.env_block_sizes(case)
    if env is not None:
        bs, var = env
        errs = block_size_errors(case, bs, page_size)
        if errs:
            raise ValueError(f"environment variable {var}={','.join(map(str, bs))} gives illegal "
                             f"{case.value} block sizes: " + "; ".join(errs))
        return bs, f"env:{var}", None
    found = tables.lookup_entry(case, generation=generation, dims=dims, sliding_window=sliding_window)
    if found is not None:
        return found
    return _heuristic_cached(
        case, generation, num_q_heads, num_kv_heads, head_dim, page_size, kv_bytes_per_token(dims),
        max_num_tokens, pages_per_seq * page_size, chunk_prefill_size, q_dtype, kv_dtype), "heuristic", None


@functools.lru_cache(maxsize=4096)
def _heuristic_cached(case, generation, num_q_heads, num_kv_heads, head_dim, page_size, kv_bpt,
                      max_num_tokens, max_model_len, chunk_prefill_size, q_dtype, kv_dtype) -> BlockSizes:
    """The heuristic is a pure function of these: computed once per shape, not per call."""
    return heuristic_block_sizes(
        case, generation=generation, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, page_size=page_size, kv_bytes_per_token=kv_bpt,
        max_num_tokens=max_num_tokens, max_model_len=max_model_len,
        chunk_prefill_size=chunk_prefill_size, q_dtype=q_dtype, kv_dtype=kv_dtype)


def heuristic_block_sizes_for(case: Case, *, generation: str, dims: dict, sliding_window: bool = False,
                              chunk_prefill_size=None) -> BlockSizes:
    """The heuristic's block sizes for ``case`` of a call with ``dims``: what a case without
    explicit sizes gets in a program built ``heuristic_only`` (never an override or a table)."""
    return _resolve(Case.parse(case), None, generation=generation, dims=dims, chunk_prefill_size=chunk_prefill_size,
                    sliding_window=sliding_window, heuristic_only=True)[0]


def kv_bytes_per_token(dims: dict) -> int:
    """``kernel.config.kv_bytes_per_token`` of a call's dims."""
    return config_kv_bytes_per_token(dims["num_kv_heads"], dims["head_dim"], dims["kv_dtype"])


def ragged_paged_attention(
    queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, *,
    use_causal_mask: bool = True, update_kv_cache: bool = True, skip_kv_mask: bool = False,
    sm_scale: float = 1.0, sliding_window: int | None = None, soft_cap: float | None = None,
    out_dtype=None, mask_value: float | None = None,
    q_scale: float | None = None, k_scale: float | None = None, v_scale: float | None = None,
    chunk_prefill_size: int | None = None, d_block_sizes=None, p_block_sizes=None,
    m_block_sizes=None, vmem_limit_bytes: int | None = None, debug_mode: bool = False,
    disable_bounds_checks: bool = True, disable_semaphore_checks: bool = True,
    attention_sink=None, interpret=False,
):
    """Ragged paged attention over a mixed batch, fused with the KV-cache update.

    Called as tpu-inference's RPA v3 (same positional arguments, same keyword names and
    semantics; the argument-by-argument table is in docs/kernel.md).

    Args:
      queries: ``[max_num_tokens, num_q_heads, head_dim]`` (any head_dim: padded to 128 lanes).
      keys, values: ``[max_num_tokens, num_kv_heads, head_dim]``, K/V of the new tokens, in
        the cache's dtype (already quantized) or a wider float dtype (cast, saturating).
      kv_cache: ``get_kv_cache_shape(num_pages, page_size, num_kv_heads, head_dim, dtype)``
        (bfloat16, float32, float8_e4m3fn or float8_e5m2).
      kv_lens: ``int32[max_num_seqs]``, KV length of each sequence (new tokens included).
      page_indices: ``int32[max_num_seqs * pages_per_seq]``, flattened page table.
      cu_q_lens: ``int32[max_num_seqs + 1]``.
      distribution: ``int32[3]`` ``(i, j, k)``: ``[0,i)`` decode, ``[i,j)`` prefill, ``[j,k)`` mixed.
      use_causal_mask: False: every query token sees all ``kv_len`` keys of its sequence.
      update_kv_cache: False: K/V of every position are read from the cache, which is left
        unchanged (``keys`` / ``values`` are not read).
      q_scale / k_scale / v_scale: per-tensor scales. K and V are stored as given; the
        scales dequantize them (scores times ``k_scale``, output times ``v_scale``).
        ``q_scale``: Q is quantized to the cache dtype as ``q / q_scale`` (saturating), its
        scores multiplied back.
      attention_sink: ``float32[num_q_heads]`` or None: a logit per query head added to the
        softmax denominator (a key with no value).
      d/p/m_block_sizes: ``BlockSizes`` (or 4-tuples) per case; ``None`` resolves through
        ``RPA_{D,P,M}_BLOCK_SIZES``, then the tuned tables (``kernel.tables``: exact key,
        then the bucketing rule), then the heuristic (``kernel.heuristics``).
      skip_kv_mask, out_dtype, mask_value, disable_*_checks: v3's; accepted and checked as v3
        does, with no effect on the result (see docs/kernel.md). ``debug_mode=True`` is refused.
      interpret: run in the Pallas TPU interpreter (``True`` or a ``pltpu.InterpretParams``).

    Returns:
      ``(out [max_num_tokens, num_q_heads, head_dim], updated kv_cache)``. Rows of padding
      tokens (beyond ``cu_q_lens[k]``) are unspecified.
    """
    return _call(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution,
                 layout="merged", use_causal_mask=use_causal_mask, update_kv_cache=update_kv_cache,
                 skip_kv_mask=skip_kv_mask, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                 out_dtype=out_dtype, mask_value=mask_value, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale,
                 chunk_prefill_size=chunk_prefill_size, explicit={Case.DECODE: d_block_sizes,
                                                                  Case.PREFILL: p_block_sizes,
                                                                  Case.MIXED: m_block_sizes},
                 vmem_limit_bytes=vmem_limit_bytes, debug_mode=debug_mode, attention_sink=attention_sink,
                 interpret=interpret)


def ragged_paged_attention_hd64(
    queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, attention_sink=None, *,
    sm_scale: float = 1.0, sliding_window: int | None = None, soft_cap: float | None = None,
    mask_value: float | None = None, q_scale: float | None = None, k_scale: float | None = None,
    v_scale: float | None = None, chunk_prefill_size: int | None = None,
    num_kv_pages_per_block: int | None = None, num_queries_per_block: int | None = None,
    vmem_limit_bytes: int | None = None, debug_mode: bool = False, interpret=False,
):
    """Ragged paged attention for head_dim 64 on tpu-inference's head_dim-64 cache layout,
    called as its ``ragged_paged_attention_hd64``.

    The cache is ``get_kv_cache_shape_hd64(num_pages, page_size, num_kv_heads, dtype)``:
    ``[num_pages, page_size, ceil(num_kv_heads / kv_packing), kv_packing, 128]``, head h at
    entry h with K in lanes 0-63 and V in lanes 64-127 (half the bytes per token of the
    merged layout at head_dim 64). Same semantics as ``ragged_paged_attention`` (always
    causal, the cache always updated); ``num_queries_per_block`` and
    ``num_kv_pages_per_block`` set prefill's and mixed's ``bq`` and ``bkv`` (in pages;
    their compute chunks divide them), decode keeps the heuristic's.
    """
    explicit = {Case.DECODE: None, Case.PREFILL: None, Case.MIXED: None}
    for name, v in (("num_kv_pages_per_block", num_kv_pages_per_block),
                    ("num_queries_per_block", num_queries_per_block)):
        if v is not None and (not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v <= 0):
            raise ValueError(f"{name}={v!r} must be positive (a positive int, or None for the heuristic's)")
    return _call(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution,
                 layout="hd64", use_causal_mask=True, update_kv_cache=True, skip_kv_mask=False, sm_scale=sm_scale,
                 sliding_window=sliding_window, soft_cap=soft_cap, out_dtype=None, mask_value=mask_value,
                 q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, chunk_prefill_size=chunk_prefill_size,
                 explicit=explicit, vmem_limit_bytes=vmem_limit_bytes, debug_mode=debug_mode,
                 attention_sink=attention_sink, interpret=interpret,
                 hd64_blocks=(num_queries_per_block, num_kv_pages_per_block))


def _hd64_block_sizes(heuristic: BlockSizes, page_size: int, bq, kv_pages) -> BlockSizes:
    """The heuristic's prefill / mixed block sizes with ``bq`` and ``bkv`` set from the
    head_dim-64 call's arguments (None: the heuristic's); the compute chunks are the largest
    that divide both the new block and the heuristic's chunk."""
    import math
    new_bq = heuristic.bq if bq is None else int(bq)
    new_bkv = heuristic.bkv if kv_pages is None else int(kv_pages) * page_size
    return BlockSizes(new_bq, new_bkv, math.gcd(new_bq, heuristic.cq), math.gcd(new_bkv, heuristic.ckv))


def _call(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, *, layout,
          use_causal_mask, update_kv_cache, skip_kv_mask, sm_scale, sliding_window, soft_cap, out_dtype,
          mask_value, q_scale, k_scale, v_scale, chunk_prefill_size, explicit, vmem_limit_bytes, debug_mode,
          attention_sink, interpret, hd64_blocks=None):
    dims = validate_inputs(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens,
                           distribution, sliding_window=sliding_window, soft_cap=soft_cap,
                           sm_scale=sm_scale, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale,
                           block_sizes=explicit, layout=layout, use_causal_mask=use_causal_mask,
                           update_kv_cache=update_kv_cache, skip_kv_mask=skip_kv_mask,
                           attention_sink=attention_sink, chunk_prefill_size=chunk_prefill_size,
                           vmem_limit_bytes=vmem_limit_bytes, debug_mode=debug_mode, out_dtype=out_dtype,
                           mask_value=mask_value)
    if interpret is True:
        interpret = pltpu.InterpretParams()
    elif interpret is False:
        interpret = None
    generation = current_generation().name
    if hd64_blocks is not None and any(v is not None for v in hd64_blocks):
        for case in (Case.PREFILL, Case.MIXED):
            h = heuristic_block_sizes_for(case, generation=generation, dims=dims,
                                          sliding_window=sliding_window is not None,
                                          chunk_prefill_size=chunk_prefill_size)
            explicit[case] = _hd64_block_sizes(h, dims["page_size"], *hd64_blocks)
    options = build_options(dims, generation, explicit, sm_scale=sm_scale,
                            sliding_window=sliding_window, soft_cap=soft_cap, q_scale=q_scale,
                            k_scale=k_scale, v_scale=v_scale, chunk_prefill_size=chunk_prefill_size,
                            vmem_limit_bytes=vmem_limit_bytes, causal=use_causal_mask,
                            update_cache=update_kv_cache, layout=layout, sinks=attention_sink is not None)
    sinks = None
    if attention_sink is not None:
        # base 2, as the kernel's scores: (Hkv, G, 128) lane-replicated
        Hkv = dims["num_kv_heads"]
        sinks = jnp.asarray(attention_sink, jnp.float32).reshape(Hkv, -1, 1) * np.float32(np.log2(np.e))
        sinks = jnp.broadcast_to(sinks, (*sinks.shape[:2], 128))
    return _rpa_jit(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens,
                    distribution, sinks, options=options, interpret=interpret)


@dataclass(frozen=True)
class Options:
    sm_scale: float
    sliding_window: int | None
    soft_cap: float | None
    q_scale: float | None
    k_scale: float | None
    v_scale: float | None
    block_sizes: tuple  # (decode, prefill, mixed)
    vmem_limit_bytes: int | tuple | None   # one limit, or per case (decode, prefill, mixed)
    generation: str
    static_meta: tuple | None = None      # analysis mode, per case
    cases: tuple = ("decode", "prefill", "mixed")
    new_kv_in_vmem: bool = False          # analysis: the new K/V operand constrained to VMEM
    causal: bool = True                   # use_causal_mask
    update_cache: bool = True             # update_kv_cache
    layout: str = "merged"                # the cache layout: "merged" or "hd64" (rpa.KernelSpec.kv_layout)
    sinks: bool = False                   # an attention_sink operand


def build_options(dims: dict, generation: str, explicit: dict, *, sm_scale=1.0, sliding_window=None,
                  soft_cap=None, q_scale=None, k_scale=None, v_scale=None, chunk_prefill_size=None,
                  vmem_limit_bytes=None, static_meta=None, cases=("decode", "prefill", "mixed"),
                  heuristic_only: bool = False, new_kv_in_vmem: bool = False, causal: bool = True,
                  update_cache: bool = True, layout: str = "merged", sinks: bool = False) -> "Options":
    """Resolve block sizes per case and freeze every static option of one call.

    For a program built for analysis (``kernel.analysis``): ``heuristic_only`` resolves the
    cases without explicit sizes to the heuristic (no override, no table), so the program
    does not depend on the tables of the process building it; ``new_kv_in_vmem`` places
    the case kernels' new K/V operand in VMEM.

    A non-causal call and a call on the head_dim-64 layout resolve without tables (the
    heuristic's sizes where none are given): the tables' keys are causal, merged-layout
    programs."""
    if not causal or layout != "merged":
        heuristic_only = True
    resolved, table_limits = {}, []
    for case in CASES:
        bs, _source, limit = _resolve(case, explicit.get(case), generation=generation, dims=dims,
                                      chunk_prefill_size=chunk_prefill_size,
                                      sliding_window=sliding_window is not None, heuristic_only=heuristic_only)
        errs = block_size_errors(case, bs, dims["page_size"])
        if errs:
            raise ValueError(f"{case.value} block sizes {tuple(bs)} are illegal: " + "; ".join(errs))
        resolved[case] = bs
        table_limits.append(limit)
    if vmem_limit_bytes is None and any(v is not None for v in table_limits):
        vmem_limit_bytes = tuple(table_limits)   # the limits the table's entries were tuned with
    f = lambda v: None if v is None else float(v)
    return Options(
        sm_scale=float(sm_scale), sliding_window=None if sliding_window is None else int(sliding_window),
        soft_cap=f(soft_cap), q_scale=f(q_scale), k_scale=f(k_scale), v_scale=f(v_scale),
        block_sizes=tuple(resolved[c] for c in CASES), vmem_limit_bytes=vmem_limit_bytes,
        generation=generation, static_meta=static_meta, cases=tuple(cases), new_kv_in_vmem=bool(new_kv_in_vmem),
        causal=bool(causal), update_cache=bool(update_cache), layout=str(layout), sinks=bool(sinks))


def prepare_inputs(queries, keys, values, kv_cache, options: Options):
    """Pre-arrange Q and the new K/V into the kernel layouts (XLA ops around the kernel)."""
    T, Hq, D = queries.shape
    Hkv = keys.shape[1]
    G = Hq // Hkv
    Dp = round_up(D, 128)
    kv_rows, pk = kv_cache.shape[2], kv_cache.shape[3]
    bss = options.block_sizes
    # Rows past the last token, so that a block's DMA stays in bounds: q and o are read and
    # written a q block (bq rows) at a time; the new K/V rows are also read a page at a
    # time across a prefill / mixed KV block (bkv rows). (Padding q and o by bkv as well
    # doubled the XLA ops' work at a 2K budget with bkv 2048.)
    q_pad = max([bs.bq for bs in bss] + [1])
    kv_pad = max([q_pad] + [bs.bkv for bs in bss[1:]])
    q = queries
    if options.q_scale is not None:
        q = (quantize(q, kv_cache.dtype, options.q_scale)).astype(queries.dtype)
    q = q.reshape(T, Hkv, G, D)
    q = jnp.pad(q, ((0, q_pad), (0, 0), (0, 0), (0, Dp - D)))
    k = quantize(keys, kv_cache.dtype)     # K/V arrive quantized: the scales only dequantize
    v = quantize(values, kv_cache.dtype)
    if options.layout == "hd64":            # head h: [K | V] in 128 lanes, entry h
        kv = jnp.concatenate([k, v], axis=2)
        kv = jnp.pad(kv, ((0, kv_pad), (0, kv_rows * pk - Hkv), (0, 0)))
    else:
        kv = jnp.stack([k, v], axis=2).reshape(T, 2 * Hkv, D)
        kv = jnp.pad(kv, ((0, kv_pad), (0, kv_rows * pk - 2 * Hkv), (0, Dp - D)))
    kv = kv.reshape(T + kv_pad, kv_rows, pk, Dp)
    o = jnp.zeros_like(q)
    return q, kv, o


def case_spec(case: Case, options: Options, *, num_kv_heads, group, head_dim, page_size,
              pages_per_seq, kv_rows, kv_pack, max_num_seqs, static_meta=None) -> rpa.KernelSpec:
    idx = CASES.index(case)
    gen = get_generation(options.generation)
    return rpa.KernelSpec(
        case=case, bs=options.block_sizes[idx], num_kv_heads=num_kv_heads, group=group,
        head_dim_p=round_up(head_dim, 128), page_size=page_size, pages_per_seq=pages_per_seq,
        kv_rows=kv_rows, kv_pack=kv_pack, max_num_seqs=max_num_seqs, sm_scale=options.sm_scale,
        sliding_window=options.sliding_window, soft_cap=options.soft_cap,
        k_scale=options.k_scale, v_scale=options.v_scale, q_scale=options.q_scale,
        static_meta=static_meta, skip_dead_chunks=gen.skip_dead_chunks,
        score_tile_vregs=gen.score_tile_vregs, bf16_exp=gen.bf16_exp and case != Case.DECODE,
        causal=options.causal or case == Case.DECODE, update_cache=options.update_cache,
        kv_layout=options.layout, sinks=options.sinks)


def default_case_vmem_limit(bs: BlockSizes, *, generation: str, num_q_heads: int, num_kv_heads: int,
                            head_dim: int, page_size: int, q_dtype, kv_dtype, case=None) -> int:
    """The scoped VMEM limit a call uses for ``bs`` when neither the caller nor a table
    gives one (what ``vmem_limit_for`` computes inside the jitted call)."""
    pk = 32 // (np.dtype(kv_dtype).itemsize * 8)
    sb = scratch_bytes(BlockSizes.coerce(bs), num_kv_heads=num_kv_heads, group=num_q_heads // num_kv_heads,
                       head_dim=round_up(head_dim, 128), page_size=page_size,
                       kv_rows=cdiv(2 * num_kv_heads, pk), kv_pack=pk, q_dtype=np.dtype(q_dtype),
                       kv_dtype=np.dtype(kv_dtype), decode=case is not None and Case.parse(case) == Case.DECODE)
    return default_vmem_limit(sb, tpu_info(generation).vmem_capacity_bytes)


def vmem_limit_for(spec: rpa.KernelSpec, q_dtype, kv_dtype, generation: str, explicit=None) -> int:
    if explicit is not None:
        return int(explicit)
    sb = scratch_bytes(spec.bs, num_kv_heads=spec.num_kv_heads, group=spec.group,
                       head_dim=spec.head_dim_p, page_size=spec.page_size, kv_rows=spec.kv_rows,
                       kv_pack=spec.kv_pack, q_dtype=q_dtype, kv_dtype=kv_dtype, decode=spec.case == Case.DECODE)
    return default_vmem_limit(sb, tpu_info(generation).vmem_capacity_bytes)


@functools.partial(jax.jit, static_argnames=("options", "interpret"), donate_argnames=("kv_cache",))
def _rpa_jit(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, sinks=None, *,
             options: Options, interpret):
    T, Hq, D = queries.shape
    q, newkv, o = prepare_inputs(queries, keys, values, kv_cache, options)
    o, kv_cache = run_cases(q, newkv, o, kv_cache, kv_lens, page_indices, cu_q_lens, distribution,
                            num_kv_heads=keys.shape[1], group=Hq // keys.shape[1], head_dim=D,
                            options=options, interpret=interpret, sinks=sinks)
    if options.layout == "hd64":            # the PV products' V lanes (rpa._Attention.kv_of_head)
        return o[:T].reshape(T, Hq, -1)[:, :, D:2 * D], kv_cache
    out = o[:T].reshape(T, Hq, -1)[:, :, :D]
    return out, kv_cache


def run_cases(q, newkv, o, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, *, num_kv_heads,
              group, head_dim, options: Options, interpret, sinks=None):
    """The case kernels on prepared operands (``prepare_inputs``); returns ``(o, kv_cache)``."""
    Hkv, D = num_kv_heads, head_dim
    S = kv_lens.shape[0]
    if options.new_kv_in_vmem:
        newkv = pltpu.with_memory_space_constraint(newkv, pltpu.VMEM)
    common = dict(num_kv_heads=Hkv, group=group, head_dim=D, page_size=kv_cache.shape[1],
                  pages_per_seq=page_indices.shape[0] // S, kv_rows=kv_cache.shape[2],
                  kv_pack=kv_cache.shape[3], max_num_seqs=S)
    for name in options.cases:
        case = Case(name)
        meta = None if options.static_meta is None else options.static_meta[CASES.index(case)]
        spec = case_spec(case, options, static_meta=meta, **common)
        call = rpa.build_case_call(
            spec, q_shape=q.shape, q_dtype=q.dtype, newkv_shape=newkv.shape,
            cache_shape=kv_cache.shape, cache_dtype=kv_cache.dtype,
            vmem_limit_bytes=None if interpret is not None else vmem_limit_for(
                spec, q.dtype, kv_cache.dtype, options.generation,
                options.vmem_limit_bytes[CASES.index(case)] if isinstance(options.vmem_limit_bytes, tuple)
                else options.vmem_limit_bytes),
            interpret=interpret if interpret is not None else False)
        extra = () if sinks is None else (sinks,)
        o, kv_cache = call(kv_lens, page_indices, cu_q_lens, distribution, q, newkv, kv_cache, o, *extra)
    return o, kv_cache
