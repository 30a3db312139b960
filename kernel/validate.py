"""Input validation that runs before tracing: every error names the value and the rule.

Static validation (shapes, dtypes, options, block sizes) always runs: it reads no array
data. Dynamic validation of the metadata values (``kv_lens``, ``page_indices``,
``cu_q_lens``, ``distribution``) copies them to the host, so it is opt-in: ``check_values=True``
or ``RPA_CHECK_VALUES=1`` (it never applies under ``jit``, where the values are unknown).
"""
from __future__ import annotations

import os

import numpy as np

from .config import BlockSizes, block_size_errors, cdiv, get_kv_cache_shape

SUPPORTED_Q_DTYPES = ("bfloat16", "float32")
SUPPORTED_KV_DTYPES = ("bfloat16", "float8_e4m3fn")
SUPPORTED_HEAD_DIMS = (64, 128, 256)
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


def validate_inputs(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens,
                    distribution, *, sliding_window=None, soft_cap=None, sm_scale=1.0,
                    q_scale=None, k_scale=None, v_scale=None, block_sizes=None,
                    check_values: bool | None = None) -> dict:
    """Validate shapes, dtypes and options; with ``check_values`` (default:
    ``$RPA_CHECK_VALUES``) also the metadata values when they are concrete.

    Returns the derived problem dimensions. Raises ``ValueError`` naming the bad value.
    """
    def err(msg):
        raise ValueError(msg)

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
    if D not in SUPPORTED_HEAD_DIMS:
        err(f"head_dim={D} is not supported; valid head_dim: {SUPPORTED_HEAD_DIMS}")
    if _dtype_name(queries) not in SUPPORTED_Q_DTYPES:
        err(f"queries dtype {_dtype_name(queries)} not supported; valid: {SUPPORTED_Q_DTYPES}")
    if _dtype_name(keys) != _dtype_name(values):
        err(f"keys dtype {_dtype_name(keys)} != values dtype {_dtype_name(values)}")
    kv_dtype = _dtype_name(kv_cache)
    if kv_dtype not in SUPPORTED_KV_DTYPES:
        err(f"kv_cache dtype {kv_dtype} not supported; valid: {SUPPORTED_KV_DTYPES}")
    if getattr(kv_cache, "ndim", None) != 5:
        err(f"kv_cache must be 5-D {get_kv_cache_shape.__doc__.split('``')[1]}, got shape {getattr(kv_cache, 'shape', None)}")
    num_pages, page_size = kv_cache.shape[:2]
    want = get_kv_cache_shape(num_pages, page_size, Hkv, D, kv_cache.dtype)
    if tuple(kv_cache.shape) != want:
        err(f"kv_cache shape {tuple(kv_cache.shape)} does not match num_kv_heads={Hkv}, head_dim={D}, "
            f"dtype={kv_dtype}: expected {want} (see kernel.get_kv_cache_shape)")
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
    if sliding_window is not None and (not isinstance(sliding_window, (int, np.integer)) or sliding_window <= 0):
        err(f"sliding_window={sliding_window!r} must be a positive int or None")
    if soft_cap is not None and not (isinstance(soft_cap, (int, float)) and soft_cap > 0):
        err(f"soft_cap={soft_cap!r} must be a positive float or None")
    for name, v in (("sm_scale", sm_scale), ("q_scale", q_scale), ("k_scale", k_scale), ("v_scale", v_scale)):
        if v is not None and not (isinstance(v, (int, float, np.floating)) and np.isfinite(v)):
            err(f"{name}={v!r} must be a finite Python float (per-tensor scale) or None")
        if name != "sm_scale" and v is not None and v <= 0:
            err(f"{name}={v!r} must be > 0")
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
