"""Plain NumPy reference of ragged paged attention: written for clarity, not speed.

It loops over sequences and tokens in Python with the metadata as concrete values, and
shares no code with the Pallas kernel (only the documented layout). It is the judge in
tests. Same signature as ``kernel.ragged_paged_attention``; block-size arguments are
accepted and ignored. ``layout="hd64"`` reads and writes tpu-inference's head_dim-64 cache
layout (head h at entry h, K in lanes 0-63, V in lanes 64-127); ``ragged_paged_attention_hd64``
is that call with its positional ``attention_sink``.

Semantics (RPA v3's): new K/V are stored as given (cast to the cache dtype, saturating at
an fp8 format's largest finite value, never divided by a scale); ``k_scale`` / ``v_scale``
multiply the K / V read from the cache; ``q_scale`` quantizes Q as ``q / q_scale`` to the
cache dtype (saturating) and multiplies it back. ``use_causal_mask=False``: every query
sees all ``kv_len`` keys. ``update_kv_cache=False``: nothing is written, K/V come from the
cache. ``attention_sink`` (per query head, natural-log units): one more logit in each
softmax denominator, with no value.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

FP8_E4M3_MAX = 448.0
FP8_E5M2_MAX = 57344.0


def _to_dtype(x: np.ndarray, dtype, scale=None) -> np.ndarray:
    """f32 values (divided by ``scale`` if given) cast to ``dtype``, saturating at an fp8
    format's largest finite value."""
    x = x.astype(np.float32)
    if scale is not None:
        x = x / np.float32(scale)
    if np.dtype(dtype) == np.dtype(ml_dtypes.float8_e4m3fn):
        x = np.clip(x, -FP8_E4M3_MAX, FP8_E4M3_MAX)
    elif np.dtype(dtype) == np.dtype(ml_dtypes.float8_e5m2):
        x = np.clip(x, -FP8_E5M2_MAX, FP8_E5M2_MAX)
    return x.astype(dtype)


def _kv_slots(layout: str, h: int, pack: int, D: int):
    """Where head h's K and V live in one cache slot (row, packing entry, lanes)."""
    if layout == "hd64":
        row, j = divmod(h, pack)
        return (row, j, slice(0, D)), (row, j, slice(D, 2 * D))
    rk, jk = divmod(2 * h, pack)
    rv, jv = divmod(2 * h + 1, pack)
    return (rk, jk, slice(0, D)), (rv, jv, slice(0, D))


def _softmax_with_sink(logits: np.ndarray, sink) -> np.ndarray:
    """softmax over the last axis; a sink is one more logit in the denominator."""
    m = logits.max(axis=-1, keepdims=True)
    if sink is not None:
        m = np.maximum(m, np.float32(sink))
    w = np.exp(logits - m)
    den = w.sum(axis=-1, keepdims=True)
    if sink is not None:
        den = den + np.exp(np.float32(sink) - m)
    return w / den


def ragged_paged_attention_hd64(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens,
                                distribution, attention_sink=None, **kwargs):
    """``ragged_paged_attention`` on the head_dim-64 layout (tpu-inference's
    ``ragged_paged_attention_hd64`` signature; its block-size arguments ignored)."""
    return ragged_paged_attention(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens,
                                  distribution, attention_sink=attention_sink, layout="hd64", **kwargs)


def ragged_paged_attention(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens,
                           distribution, *, sm_scale=1.0, sliding_window=None, soft_cap=None,
                           q_scale=None, k_scale=None, v_scale=None, use_causal_mask=True,
                           update_kv_cache=True, attention_sink=None, layout="merged", **_ignored):
    q_all = np.asarray(queries)
    k_all = np.asarray(keys)
    v_all = np.asarray(values)
    cache = np.array(kv_cache)  # a copy, updated in place below
    kv_lens = np.asarray(kv_lens)
    page_indices = np.asarray(page_indices)
    cu = np.asarray(cu_q_lens)
    num_seqs = int(np.asarray(distribution)[2])
    T, Hq, D = q_all.shape
    Hkv = k_all.shape[1]
    group = Hq // Hkv
    page_size, pack = cache.shape[1], cache.shape[3]
    pages_per_seq = page_indices.shape[0] // kv_lens.shape[0]
    sinks = None if attention_sink is None else np.asarray(attention_sink, np.float32)

    out = np.zeros((T, Hq, D), np.float32)
    for s in range(num_seqs):
        q0, q1 = int(cu[s]), int(cu[s + 1])
        q_len, kv_len = q1 - q0, int(kv_lens[s])
        ctx = kv_len - q_len
        pages = page_indices[s * pages_per_seq:(s + 1) * pages_per_seq]
        # 1. write the new tokens into the cache: the whole slot is replaced, and its
        #    padding (head_dim lanes beyond D, unused packed heads) is zero
        for t in range(q_len if update_kv_cache else 0):
            pos = ctx + t
            page, row = int(pages[pos // page_size]), pos % page_size
            cache[page, row] = np.zeros(cache.shape[2:], cache.dtype)
            for h in range(Hkv):
                (rk, jk, lk), (rv, jv, lv) = _kv_slots(layout, h, pack, D)
                cache[page, row, rk, jk, lk] = _to_dtype(k_all[q0 + t, h], cache.dtype)
                cache[page, row, rv, jv, lv] = _to_dtype(v_all[q0 + t, h], cache.dtype)
        # 2. gather K, V of all positions [0, kv_len) from the updated cache (dequantized)
        K = np.zeros((kv_len, Hkv, D), np.float32)
        V = np.zeros((kv_len, Hkv, D), np.float32)
        for pos in range(kv_len):
            page, row = int(pages[pos // page_size]), pos % page_size
            for h in range(Hkv):
                (rk, jk, lk), (rv, jv, lv) = _kv_slots(layout, h, pack, D)
                K[pos, h] = cache[page, row, rk, jk, lk].astype(np.float32)
                V[pos, h] = cache[page, row, rv, jv, lv].astype(np.float32)
        if k_scale is not None:
            K *= np.float32(k_scale)
        if v_scale is not None:
            V *= np.float32(v_scale)
        # 3. attention, one query token at a time
        for t in range(q_len):
            pos_q = ctx + t
            visible = np.arange(kv_len) <= (pos_q if use_causal_mask else kv_len - 1)
            if sliding_window is not None:
                visible &= np.arange(kv_len) > pos_q - sliding_window
            for hq in range(Hq):
                h = hq // group
                q = q_all[q0 + t, hq].astype(np.float32)
                if q_scale is not None:
                    q = _to_dtype(q, cache.dtype, q_scale).astype(np.float32) * np.float32(q_scale)
                logits = (K[:, h] @ q) * np.float32(sm_scale)
                if soft_cap is not None:
                    logits = soft_cap * np.tanh(logits / soft_cap)
                logits = np.where(visible, logits, -np.inf)
                w = _softmax_with_sink(logits, None if sinks is None else sinks[hq])
                out[q0 + t, hq] = w @ V[:, h]
    return out.astype(q_all.dtype), cache


def ragged_paged_attention_fast(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens,
                                distribution, *, sm_scale=1.0, sliding_window=None, soft_cap=None,
                                q_scale=None, k_scale=None, v_scale=None, use_causal_mask=True,
                                update_kv_cache=True, attention_sink=None, layout="merged", **_ignored):
    """``ragged_paged_attention`` with the per-token and per-head loops as NumPy array ops
    (one Python iteration per sequence, and per chunk of its query tokens): the same cache
    update bit for bit, the same attention up to float summation order. For the tuner's
    correctness check, where the loop form costs seconds to minutes per workload; the loop
    form stays the judge of both (tests/test_device_path.py)."""
    q_all = np.asarray(queries)
    k_all = np.asarray(keys)
    v_all = np.asarray(values)
    cache = np.array(kv_cache)  # a copy, updated below
    kv_lens = np.asarray(kv_lens)
    page_indices = np.asarray(page_indices)
    cu = np.asarray(cu_q_lens)
    num_seqs = int(np.asarray(distribution)[2])
    T, Hq, D = q_all.shape
    Hkv = k_all.shape[1]
    group = Hq // Hkv
    page_size, pack = cache.shape[1], cache.shape[3]
    pages_per_seq = page_indices.shape[0] // kv_lens.shape[0]
    heads = np.arange(Hkv)
    k_row, k_lane = (2 * heads) // pack, (2 * heads) % pack          # K of head h is combined head 2h
    v_row, v_lane = (2 * heads + 1) // pack, (2 * heads + 1) % pack  # V is 2h + 1
    k_lanes = v_lanes = slice(0, D)
    if layout == "hd64":                                             # head h is entry h: [K | V]
        k_row, k_lane = heads // pack, heads % pack
        v_row, v_lane = k_row, k_lane
        v_lanes = slice(D, 2 * D)
    sinks = None if attention_sink is None else np.asarray(attention_sink, np.float32)

    out = np.zeros((T, Hq, D), np.float32)
    for s in range(num_seqs):
        q0, q1 = int(cu[s]), int(cu[s + 1])
        q_len, kv_len = q1 - q0, int(kv_lens[s])
        ctx = kv_len - q_len
        pages = page_indices[s * pages_per_seq:(s + 1) * pages_per_seq]
        # 1. the new tokens' slots: zeroed whole, then K and V of each head written
        if update_kv_cache:
            pos = np.arange(ctx, kv_len)
            pg, row = pages[pos // page_size].astype(np.int64), pos % page_size
            cache[pg, row] = 0
            cache[pg[:, None], row[:, None], k_row[None], k_lane[None], k_lanes] = _to_dtype(k_all[q0:q1], cache.dtype)
            cache[pg[:, None], row[:, None], v_row[None], v_lane[None], v_lanes] = _to_dtype(v_all[q0:q1], cache.dtype)
        # 2. K, V of positions [0, kv_len) from the updated cache, dequantized: (Hkv, kv_len, D)
        pos = np.arange(kv_len)
        pg, row = pages[pos // page_size].astype(np.int64), pos % page_size
        K = cache[pg[:, None], row[:, None], k_row[None], k_lane[None], k_lanes].astype(np.float32).transpose(1, 0, 2)
        V = cache[pg[:, None], row[:, None], v_row[None], v_lane[None], v_lanes].astype(np.float32).transpose(1, 0, 2)
        if k_scale is not None:
            K *= np.float32(k_scale)
        if v_scale is not None:
            V *= np.float32(v_scale)
        # 3. attention, a chunk of query tokens at a time (bounded memory for long prompts)
        chunk = max(1, (1 << 24) // max(1, Hq * kv_len))
        for t0 in range(0, q_len, chunk):
            t1 = min(q_len, t0 + chunk)
            n = t1 - t0
            q = q_all[q0 + t0:q0 + t1].astype(np.float32)
            if q_scale is not None:
                q = _to_dtype(q, cache.dtype, q_scale).astype(np.float32) * np.float32(q_scale)
            q = q.reshape(n, Hkv, group, D).transpose(1, 0, 2, 3).reshape(Hkv, n * group, D)
            logits = np.matmul(q, K.transpose(0, 2, 1))                             # (Hkv, n*group, kv_len)
            logits *= np.float32(sm_scale)
            if soft_cap is not None:
                np.divide(logits, np.float32(soft_cap), out=logits)
                np.tanh(logits, out=logits)
                logits *= np.float32(soft_cap)
            pos_q = (ctx + np.arange(t0, t1))[:, None]                              # (n, 1)
            hidden = pos > (pos_q if use_causal_mask else kv_len - 1)
            if sliding_window is not None:
                hidden |= pos <= pos_q - sliding_window
            np.copyto(logits.reshape(Hkv, n, group, kv_len), -np.inf, where=hidden[None, :, None, :])
            m = logits.max(axis=-1, keepdims=True)
            if sinks is not None:       # (Hkv, n * group, 1): query head h * group + j
                sk = np.broadcast_to(sinks.reshape(Hkv, 1, group), (Hkv, n, group)).reshape(Hkv, n * group, 1)
                m = np.maximum(m, sk)
            logits -= m
            np.exp(logits, out=logits)
            den = logits.sum(axis=-1, keepdims=True)
            if sinks is not None:
                den = den + np.exp(sk - m)
            logits /= den
            o = np.matmul(logits, V)                                                # (Hkv, n*group, D)
            out[q0 + t0:q0 + t1] = o.reshape(Hkv, n, group, D).transpose(1, 0, 2, 3).reshape(n, Hq, D)
    return out.astype(q_all.dtype), cache
