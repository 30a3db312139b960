"""Shared helpers for kernel tests: run kernel vs reference on a seeded workload."""
from __future__ import annotations

import numpy as np
import jax.numpy as jnp

import kernel
from kernel.workload import ModelShape, ServingLimits, Workload, make_inputs


def new_token_slots(inp, workload: Workload, limits: ServingLimits):
    """(page, row) of every cache slot the call must write."""
    slots = set()
    pps = limits.pages_per_seq
    for s, (q, kv) in enumerate(zip(workload.q_lens, workload.kv_lens)):
        for pos in range(kv - q, kv):
            slots.add((int(inp["page_indices"][s * pps + pos // limits.page_size]), pos % limits.page_size))
    return slots


def run_and_check(model: ModelShape, limits: ServingLimits, workload: Workload, *, seed=0,
                  atol=2e-2, rtol=2e-2, **kwargs):
    inp = make_inputs(model, limits, workload, seed=seed)
    attn = {k: kwargs[k] for k in ("sm_scale", "sliding_window", "soft_cap", "q_scale", "k_scale", "v_scale")
            if k in kwargs}
    ref_out, ref_cache = kernel.reference.ragged_paged_attention(**inp, **attn)
    before = inp["kv_cache"].copy()
    out, cache = kernel.ragged_paged_attention(**{k: jnp.asarray(v) for k, v in inp.items()},
                                               interpret=True, **kwargs)
    out = np.asarray(out)
    cache = np.asarray(cache)
    n = workload.num_tokens
    assert out.shape == inp["queries"].shape and out.dtype == inp["queries"].dtype
    got, want = out[:n].astype(np.float32), ref_out[:n].astype(np.float32)
    assert np.all(np.isfinite(got)), "non-finite outputs on valid tokens"
    np.testing.assert_allclose(got, want, atol=atol, rtol=rtol)
    # the cache equals the reference update bit for bit ...
    u8 = lambda a: a.view(np.uint8)
    assert np.array_equal(u8(cache), u8(ref_cache)), "KV cache differs from the reference update"
    # ... and exactly the new tokens' slots changed (everything else bit-identical)
    changed = np.any(u8(cache) != u8(before), axis=tuple(range(2, cache.ndim)))
    changed_slots = {(int(p), int(r)) for p, r in zip(*np.nonzero(changed))}
    expected = new_token_slots(inp, workload, limits)
    assert changed_slots <= expected, f"slots written that should not be: {sorted(changed_slots - expected)[:5]}"
    return out, cache
