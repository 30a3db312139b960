"""Input validation that runs before tracing: every error names the value and the rule.

Static validation (shapes, dtypes, options, block sizes) always runs: it reads no array
data. Dynamic validation of the metadata values (``kv_lens``, ``page_indices``,
``cu_q_lens``, ``distribution``) copies them to the host, so it is opt-in: ``check_values=True``
or ``RPA_CHECK_VALUES=1`` (it never applies under ``jit``, where the values are unknown).
"""
from __future__ import annotations

import os

import numpy as np

from .config import BlockSizes, block_size_errors, cdiv, get_kv_cache_shape, get_kv_cache_shape_hd64

SUPPORTED_Q_DTYPES = ("bfloat16", "float32")
SUPPORTED_KV_DTYPES = ("bfloat16", "float32", "float8_e4m3fn", "float8_e5m2")
# the head dims the tuner's CLI offers by name (the kernel takes any head_dim)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
# new K/V may be given in the cache dtype or in one of these (cast to it, saturating)
WIDE_KV_INPUT_DTYPES = ("bfloat16", "float32")
ENV_CHECK_VALUES = "RPA_CHECK_VALUES"     # "1": check metadata values on every eager call


def check_values_default() -> bool:
    return os.environ.get(ENV_CHECK_VALUES, "").strip().lower() in ("1", "true", "yes", "on")


def _concrete(x):
    """A NumPy copy of ``x`` if its value is known now (not a tracer), else None."""
    import jax      # here, not at import: the CLI reads this module's constants without JAX
    if isinstance(x, jax.core.Tracer):
        return None
    try:
        return np.asarray(x)
    except Exception:  # abstract values (ShapeDtypeStruct) have no data
        return None


def _dtype_name(x) -> str:
    return np.dtype(x.dtype).name


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


def validate_options(*, sliding_window=None, soft_cap=None, sm_scale=1.0, q_scale=None, k_scale=None,
                     v_scale=None, use_causal_mask=True, update_kv_cache=True, skip_kv_mask=False,
                     chunk_prefill_size=None, vmem_limit_bytes=None, debug_mode=False, mask_value=None,
                     out_dtype=None) -> None:
    """The options' rules (v3's, in its words where it has one: "must be positive", "must
    not be 0.0"); ``ValueError`` naming the value and what is valid."""
    def err(msg):
        raise ValueError(msg)

    for name, v in (("use_causal_mask", use_causal_mask), ("update_kv_cache", update_kv_cache),
                    ("skip_kv_mask", skip_kv_mask), ("debug_mode", debug_mode)):
        if not isinstance(v, (bool, np.bool_)):
            err(f"{name}={v!r} must be a bool (True or False)")
    if use_causal_mask and skip_kv_mask:
        err("skip_kv_mask=True needs use_causal_mask=False (v3: \"Can not skip kv mask when using causal mask.\")")
    if debug_mode:
        err("debug_mode=True is not supported (v3's DMA-free debug printing); valid: False")
    if sliding_window is not None:
        if not _is_int(sliding_window) or sliding_window <= 0:
            err(f"sliding_window={sliding_window!r} must be positive (a positive int, or None for no window)")
        if not use_causal_mask:
            err(f"sliding_window={sliding_window!r} needs use_causal_mask=True (a window bounds causal attention; "
                "valid without the causal mask: None)")
    if soft_cap is not None and not (_is_real(soft_cap) and np.isfinite(soft_cap) and soft_cap != 0):
        err(f"soft_cap={soft_cap!r} must not be 0.0 (valid: a nonzero finite float, or None for no cap)")
    for name, v in (("sm_scale", sm_scale), ("q_scale", q_scale), ("k_scale", k_scale), ("v_scale", v_scale)):
        if v is not None and not (_is_real(v) and np.isfinite(v)):
            err(f"{name}={v!r} must be a finite Python float (per-tensor scale) or None")
        if name != "sm_scale" and v is not None and v <= 0:
            err(f"{name}={v!r} must be > 0")
    for name, v in (("chunk_prefill_size", chunk_prefill_size), ("vmem_limit_bytes", vmem_limit_bytes)):
        if v is not None and (not _is_int(v) or v <= 0):
            err(f"{name}={v!r} must be positive (a positive int, or None for the default)")
    if mask_value is not None and not (_is_real(mask_value) and mask_value < 0):
        err(f"mask_value={mask_value!r} must be a negative float or None (masked keys get weight 0 either way)")
    if out_dtype is not None:
        try:
            ok = np.issubdtype(np.dtype(out_dtype), np.floating)
        except TypeError:
            ok = False
        if not ok:
            err(f"out_dtype={out_dtype!r} must be a float dtype or None")


def validate_inputs(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens,
                    distribution, *, sliding_window=None, soft_cap=None, sm_scale=1.0,
                    q_scale=None, k_scale=None, v_scale=None, block_sizes=None,
                    check_values: bool | None = None, layout: str = "merged", use_causal_mask=True,
                    update_kv_cache=True, skip_kv_mask=False, attention_sink=None, chunk_prefill_size=None,
                    vmem_limit_bytes=None, debug_mode=False, out_dtype=None, mask_value=None) -> dict:
    """Validate shapes, dtypes and options; with ``check_values`` (default:
    ``$RPA_CHECK_VALUES``) also the metadata values when they are concrete. ``layout``:
    the cache layout, ``"merged"`` (``get_kv_cache_shape``) or ``"hd64"``
    (``get_kv_cache_shape_hd64``).

    Returns the derived problem dimensions. Raises ``ValueError`` naming the bad value.
    """
    def err(msg):
        raise ValueError(msg)

    validate_options(sliding_window=sliding_window, soft_cap=soft_cap, sm_scale=sm_scale, q_scale=q_scale,
                     k_scale=k_scale, v_scale=v_scale, use_causal_mask=use_causal_mask,
                     update_kv_cache=update_kv_cache, skip_kv_mask=skip_kv_mask,
                     chunk_prefill_size=chunk_prefill_size, vmem_limit_bytes=vmem_limit_bytes,
                     debug_mode=debug_mode, mask_value=mask_value, out_dtype=out_dtype)

    if getattr(queries, "ndim", None) != 3:
        err(f"queries must be [max_num_tokens, num_q_heads, head_dim], got shape {getattr(queries, 'shape', None)}")
    T, Hq, D = queries.shape
    for name, x in (("keys", keys), ("values", values)):
        if getattr(x, "ndim", None) != 3:
            err(f"{name} must be [max_num_tokens, num_kv_heads, head_dim], got shape {getattr(x, 'shape', None)}")
    if keys.shape != values.shape:
        err(f"keys shape {keys.shape} != values shape {values.shape}; they must match")
    if keys.shape[0] != T or keys.shape[2] != D:
        err(f"keys shape {keys.shape} does not match queries shape {queries.shape}: "
            f"need [max_num_tokens={T}, num_kv_heads, head_dim={D}]")
    Hkv = keys.shape[1]
    if Hkv <= 0 or Hq % Hkv:
        err(f"num_q_heads={Hq} is not divisible by num_kv_heads={Hkv} (rule: num_q_heads % num_kv_heads == 0)")
    if D <= 0:
        err(f"head_dim={D} must be positive (any positive head_dim; padded to a multiple of 128 lanes)")
    if layout == "hd64" and D != 64:
        err(f"head_dim={D} is not valid for the head_dim-64 kernel (ragged_paged_attention_hd64); valid: 64")
    if _dtype_name(queries) not in SUPPORTED_Q_DTYPES:
        err(f"queries dtype {_dtype_name(queries)} not supported; valid: {SUPPORTED_Q_DTYPES}")
    if _dtype_name(keys) != _dtype_name(values):
        err(f"keys dtype {_dtype_name(keys)} != values dtype {_dtype_name(values)}")
    kv_dtype = _dtype_name(kv_cache)
    if kv_dtype not in SUPPORTED_KV_DTYPES:
        err(f"kv_cache dtype {kv_dtype} not supported; valid: {SUPPORTED_KV_DTYPES}")
    if _dtype_name(keys) != kv_dtype and _dtype_name(keys) not in WIDE_KV_INPUT_DTYPES:
        err(f"keys / values dtype {_dtype_name(keys)} is neither the cache's ({kv_dtype}) nor one of "
            f"{WIDE_KV_INPUT_DTYPES} (cast to the cache's)")
    shape_fn = get_kv_cache_shape_hd64 if layout == "hd64" else get_kv_cache_shape
    if getattr(kv_cache, "ndim", None) != 5:
        err(f"kv_cache must be 5-D {shape_fn.__doc__.split('``')[1]}, got shape {getattr(kv_cache, 'shape', None)}")
    num_pages, page_size = kv_cache.shape[:2]
    want = (get_kv_cache_shape_hd64(num_pages, page_size, Hkv, kv_cache.dtype) if layout == "hd64"
            else get_kv_cache_shape(num_pages, page_size, Hkv, D, kv_cache.dtype))
    if tuple(kv_cache.shape) != want:
        err(f"kv_cache shape {tuple(kv_cache.shape)} does not match num_kv_heads={Hkv}, head_dim={D}, "
            f"dtype={kv_dtype}: expected {want} (see kernel.{shape_fn.__name__})")
    if attention_sink is not None:
        shape = tuple(getattr(attention_sink, "shape", ()))
        dt = _dtype_name(attention_sink) if hasattr(attention_sink, "dtype") else type(attention_sink).__name__
        if shape != (Hq,) or dt != "float32":
            err(f"attention_sink of shape {shape} and dtype {dt}: valid: float32[num_q_heads={Hq}] or None")
    for name, x in (("kv_lens", kv_lens), ("page_indices", page_indices), ("cu_q_lens", cu_q_lens),
                    ("distribution", distribution)):
        if getattr(x, "ndim", None) != 1:
            err(f"{name} must be a 1-D int32 array, got shape {getattr(x, 'shape', None)}")
        if _dtype_name(x) != "int32":
            err(f"{name} must have dtype int32, got {_dtype_name(x)}")
    S = kv_lens.shape[0]
    if cu_q_lens.shape[0] != S + 1:
        err(f"cu_q_lens has {cu_q_lens.shape[0]} entries; need max_num_seqs + 1 = {S + 1}")
    if distribution.shape[0] != 3:
        err(f"distribution must have 3 entries (i, j, k), got {distribution.shape[0]}")
    if page_indices.shape[0] % S:
        err(f"page_indices has {page_indices.shape[0]} entries, not a multiple of max_num_seqs={S}")
    pages_per_seq = page_indices.shape[0] // S
    if block_sizes:
        for case, bs in block_sizes.items():
            if bs is None:
                continue
            bs = BlockSizes.coerce(bs, name=f"{case.value} block sizes")
            errs = block_size_errors(case, bs, page_size)
            if errs:
                err(f"{case.value} block sizes {tuple(bs)} are illegal: " + "; ".join(errs))

    dims = dict(max_num_tokens=T, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, num_pages=num_pages,
                page_size=page_size, max_num_seqs=S, pages_per_seq=pages_per_seq,
                kv_dtype=kv_dtype, q_dtype=_dtype_name(queries))
    if check_values if check_values is not None else check_values_default():
        _validate_values(dims, kv_lens, page_indices, cu_q_lens, distribution)
    return dims


def _validate_values(dims, kv_lens, page_indices, cu_q_lens, distribution):
    kl, pi, cu, dist = (_concrete(x) for x in (kv_lens, page_indices, cu_q_lens, distribution))
    S, T = dims["max_num_seqs"], dims["max_num_tokens"]
    if dist is not None:
        i, j, k = (int(v) for v in dist)
        if not 0 <= i <= j <= k <= S:
            raise ValueError(f"distribution={tuple(int(v) for v in dist)} must satisfy 0 <= i <= j <= k <= max_num_seqs={S}")
    if cu is None or kl is None:
        return
    if cu[0] != 0 or np.any(np.diff(cu) < 0):
        raise ValueError(f"cu_q_lens must start at 0 and be non-decreasing, got {cu.tolist()[:16]}...")
    n = int(dist[2]) if dist is not None else S
    q_lens = np.diff(cu)[:n]
    if n and cu[n] > T:
        raise ValueError(f"cu_q_lens[{n}]={int(cu[n])} exceeds max_num_tokens={T}")
    bad = np.nonzero(kl[:n] < q_lens)[0]
    if bad.size:
        s = int(bad[0])
        raise ValueError(f"kv_lens[{s}]={int(kl[s])} < q_len={int(q_lens[s])}: kv_lens must include the new tokens")
    max_len = dims["pages_per_seq"] * dims["page_size"]
    bad = np.nonzero(kl[:n] > max_len)[0]
    if bad.size:
        s = int(bad[0])
        raise ValueError(f"kv_lens[{s}]={int(kl[s])} exceeds pages_per_seq * page_size = {max_len}")
    if dist is not None:
        dec = q_lens[: int(dist[0])]
        bad = np.nonzero(dec != 1)[0]
        if bad.size:
            s = int(bad[0])
            raise ValueError(f"sequence {s} is in the decode range [0, {int(dist[0])}) but has q_len={int(dec[s])}; decode needs q_len == 1")
    if pi is not None:
        pps, ps = dims["pages_per_seq"], dims["page_size"]
        for s in range(n):
            used = cdiv(int(kl[s]), ps)
            rows = pi[s * pps: s * pps + used]
            bad = np.nonzero((rows < 0) | (rows >= dims["num_pages"]))[0]
            if bad.size:
                p = int(bad[0])
                raise ValueError(
                    f"page_indices[{s * pps + p}]={int(rows[p])} (sequence {s}, page {p}) is out of range "
                    f"[0, num_pages={dims['num_pages']})")
