"""RPA v3's arguments and semantics in our kernel (Pallas TPU interpreter) against the
project's NumPy reference (``kernel/reference.py``): K/V arriving quantized with the
scales only dequantizing, float8_e5m2 and float32 caches, ``use_causal_mask=False``,
``update_kv_cache=False`` (cache bit-identical, input K/V ignored), any head_dim,
attention sinks, and tpu-inference's head_dim-64 cache layout
(``ragged_paged_attention_hd64``). Each case compares the output and the whole cache bit
for bit, and checks that only the new tokens' slots changed."""
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import kernel
from kernel import reference
from kernel.config import get_kv_cache_shape_hd64
from kernel.workload import ModelShape, ServingLimits, Workload, make_inputs
from kernel_cases import new_token_slots

SMALL = ServingLimits(page_size=16, max_num_tokens=96, max_num_seqs=6, max_model_len=320)
E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"
BS = dict(d_block_sizes=(2, 32, 2, 16), p_block_sizes=(16, 32, 8, 16), m_block_sizes=(8, 48, 8, 16))


def batch():
    """Decode (one new token opening a block, one inside a step), a prefill chunk with
    context, mixed sequences (one of several q blocks)."""
    return Workload.concat(Workload.of_case("decode", [1, 1, 1], [33, 70, 5]),
                           Workload.of_case("prefill", [20], [57]),
                           Workload.of_case("mixed", [3, 25], [40, 25]))


def run(model, workload, *, layout="merged", kv_in_cache_dtype=False, seed=0, atol=2e-2, rtol=2e-2,
        expect_writes=True, **kwargs):
    inp = make_inputs(model, SMALL, workload, seed=seed)
    rng = np.random.default_rng(seed + 7)
    kvd = np.dtype(model.kv_dtype)
    if layout == "hd64":
        shape = get_kv_cache_shape_hd64(inp["kv_cache"].shape[0], SMALL.page_size, model.num_kv_heads, kvd)
        inp["kv_cache"] = rng.standard_normal(shape, np.float32).astype(kvd)
    if kv_in_cache_dtype:       # K/V arrive quantized, as v3 takes them
        for k in ("keys", "values"):
            inp[k] = reference._to_dtype(inp[k].astype(np.float32), kvd)
    attn = {k: kwargs[k] for k in kwargs if not k.endswith("block_sizes")}
    ref_out, ref_cache = reference.ragged_paged_attention(**inp, layout=layout, **attn)
    before = inp["kv_cache"].copy()
    args = {k: jnp.asarray(v) for k, v in inp.items()}
    if layout == "hd64":
        kw = {k: v for k, v in kwargs.items() if not k.endswith("block_sizes")}
        sink = kw.pop("attention_sink", None)
        out, cache = kernel.ragged_paged_attention_hd64(
            *(args[k] for k in ("queries", "keys", "values", "kv_cache", "kv_lens", "page_indices", "cu_q_lens",
                                "distribution")), None if sink is None else jnp.asarray(sink),
            interpret=True, **kw)
    else:
        out, cache = kernel.ragged_paged_attention(**args, interpret=True, **kwargs)
    out, cache = np.asarray(out), np.asarray(cache)
    n = workload.num_tokens
    got, want = out[:n].astype(np.float32), ref_out[:n].astype(np.float32)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, atol=atol, rtol=rtol)
    u8 = lambda a: a.view(np.uint8)
    assert np.array_equal(u8(cache), u8(ref_cache)), "KV cache differs from the reference update"
    changed = np.any(u8(cache) != u8(before), axis=tuple(range(2, cache.ndim)))
    changed_slots = {(int(p), int(r)) for p, r in zip(*np.nonzero(changed))}
    if expect_writes:
        assert changed_slots <= new_token_slots(inp, workload, SMALL)
    else:
        assert not changed_slots, "update_kv_cache=False wrote the cache"
    return inp, out, cache


def test_fp8_kv_arrives_quantized_scales_only_dequantize():
    model = ModelShape(8, 2, 128, kv_dtype=E4M3)
    w = batch()
    inp, _, cache = run(model, w, kv_in_cache_dtype=True, sm_scale=0.1, k_scale=0.5, v_scale=0.5, **BS)
    # the cache holds the given fp8 bytes: not divided by the scales (a double-scaled K/V
    # would differ)
    pps = SMALL.pages_per_seq
    s, t = 3, 0                             # the prefill sequence's first new token
    pos = w.kv_lens[s] - w.q_lens[s] + t
    page = int(inp["page_indices"][s * pps + pos // SMALL.page_size])
    q0 = int(inp["cu_q_lens"][s])
    slot = cache[page, pos % SMALL.page_size]          # (rows, 4, 128): K of head 0 is entry 0
    assert np.array_equal(slot[0, 0].view(np.uint8), inp["keys"][q0 + t, 0].view(np.uint8))


@pytest.mark.parametrize("kw", [
    dict(sm_scale=0.1),
    dict(sm_scale=0.1, k_scale=0.5, v_scale=0.25, q_scale=0.5),
])
def test_e5m2_cache(kw):
    run(ModelShape(8, 2, 128, kv_dtype=E5M2), batch(), kv_in_cache_dtype=True, **kw, **BS)


def test_e5m2_cache_given_wider_kv_saturates():
    # bf16 K/V beyond e5m2's range are cast saturating (57344), never to inf
    run(ModelShape(4, 1, 128, kv_dtype=E5M2), Workload.of_case("mixed", [5, 9], [20, 30]), sm_scale=0.01,
        m_block_sizes=(8, 32, 8, 16))


def test_float32_cache():
    run(ModelShape(8, 2, 128, q_dtype="float32", kv_dtype="float32"), batch(), sm_scale=0.1, **BS)


def test_non_causal():
    run(ModelShape(8, 2, 128), batch(), use_causal_mask=False, sm_scale=0.1, **BS)


def test_update_kv_cache_false_reads_the_cache_and_ignores_new_kv():
    model = ModelShape(8, 2, 128)
    w = batch()
    inp, out, cache = run(model, w, update_kv_cache=False, sm_scale=0.1, expect_writes=False, **BS)
    # other keys / values: the same output
    args = {k: jnp.asarray(v) for k, v in inp.items()}
    args["keys"], args["values"] = args["keys"] * 3 + 1, -args["values"]
    out2, _ = kernel.ragged_paged_attention(**args, update_kv_cache=False, sm_scale=0.1, interpret=True, **BS)
    n = w.num_tokens
    assert np.array_equal(np.asarray(out2)[:n], out[:n])


@pytest.mark.parametrize("head_dim", [80, pytest.param(240, marks=pytest.mark.slow)])
def test_any_head_dim(head_dim):
    run(ModelShape(6, 2, head_dim), batch(), sm_scale=head_dim ** -0.5, **BS)


def test_attention_sinks_merged_layout():
    model = ModelShape(8, 2, 128)
    sinks = np.linspace(-2.0, 3.0, model.num_q_heads).astype(np.float32)
    run(model, batch(), attention_sink=sinks, sm_scale=0.1, **BS)


@pytest.mark.parametrize("kv_dtype,kw", [
    ("bfloat16", dict(sm_scale=0.125)),
    (E4M3, dict(sm_scale=0.125, k_scale=0.5, v_scale=0.5, q_scale=0.5)),
    pytest.param("float32", dict(sm_scale=0.125, sliding_window=20), marks=pytest.mark.slow),
    pytest.param(E5M2, dict(sm_scale=0.125, soft_cap=20.0), marks=pytest.mark.slow),
])
def test_hd64_layout(kv_dtype, kw):
    q_dtype = "float32" if kv_dtype == "float32" else "bfloat16"
    run(ModelShape(8, 2, 64, q_dtype=q_dtype, kv_dtype=kv_dtype), batch(), layout="hd64",
        kv_in_cache_dtype=kv_dtype.startswith("float8"), **kw)


def test_hd64_layout_with_sinks_and_window_block_arguments():
    model = ModelShape(8, 4, 64)
    sinks = np.linspace(0.0, 5.0, model.num_q_heads).astype(np.float32)
    run(model, batch(), layout="hd64", attention_sink=sinks, sm_scale=0.125, sliding_window=12,
        num_queries_per_block=16, num_kv_pages_per_block=2)


def test_hd64_cache_is_half_the_merged_bytes():
    m = kernel.get_kv_cache_shape(10, 16, 8, 64, jnp.bfloat16)
    h = kernel.get_kv_cache_shape_hd64(10, 16, 8, jnp.bfloat16)
    assert np.prod(h) * 2 == np.prod(m)


def test_fp8_e5m2_byte_conversion_is_exact():
    from kernel import rpa
    b = np.arange(256, dtype=np.uint32)
    bits = np.asarray(rpa._e5m2_bf16_bits(jnp.asarray(b))) & 0xFFFF
    got = bits.astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)
    want = b.astype(np.uint8).view(ml_dtypes.float8_e5m2).astype(np.float32)
    finite = np.isfinite(want)
    assert np.array_equal(got[finite], want[finite])
    assert np.all(np.isfinite(got))          # inf / NaN bytes map to finite values
