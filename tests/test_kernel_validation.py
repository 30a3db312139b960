"""Bad input raises ValueError naming the value and the rule, before any tracing."""
import pytest
import jax.numpy as jnp

import kernel
from kernel.workload import ModelShape, ServingLimits, Workload, make_inputs

MODEL = ModelShape(8, 2, 128)
LIMITS = ServingLimits(page_size=16, max_num_tokens=32, max_num_seqs=4, max_model_len=128)
W = Workload.concat(Workload.of_case("decode", [1], [20]), Workload.of_case("prefill", [8], [30]),
                    Workload.of_case("mixed", [3], [40]))


@pytest.fixture()
def inp():
    return {k: jnp.asarray(v) for k, v in make_inputs(MODEL, LIMITS, W, seed=0).items()}


def call(inp, **kw):
    return kernel.ragged_paged_attention(**{**inp, **{k: v for k, v in kw.items() if k in inp}},
                                         **{k: v for k, v in kw.items() if k not in inp}, interpret=True)


@pytest.mark.parametrize("override,match,values", [
    (lambda i: dict(queries=i["queries"][:, :, :64]), r"keys shape .* does not match queries", False),
    (lambda i: dict(queries=i["queries"][:, :7]), r"num_q_heads=7 is not divisible by num_kv_heads=2", False),
    (lambda i: dict(values=i["values"][:, :1]), r"keys shape .* != values shape", False),
    (lambda i: dict(queries=i["queries"].astype(jnp.float16)), r"queries dtype float16 not supported", False),
    (lambda i: dict(kv_cache=i["kv_cache"].astype(jnp.float16)), r"kv_cache dtype float16 not supported; valid: "
     r"\('bfloat16', 'float32', 'float8_e4m3fn', 'float8_e5m2'\)", False),
    (lambda i: dict(keys=i["keys"].astype(jnp.float8_e4m3fn), values=i["values"].astype(jnp.float8_e4m3fn)),
     r"keys / values dtype float8_e4m3fn is neither the cache's \(bfloat16\)", False),
    (lambda i: dict(kv_cache=i["kv_cache"][:, :, :1]), r"kv_cache shape .* expected", False),
    (lambda i: dict(kv_lens=i["kv_lens"].astype(jnp.float32)), r"kv_lens must have dtype int32", False),
    (lambda i: dict(cu_q_lens=i["cu_q_lens"][:-1]), r"cu_q_lens has 4 entries; need max_num_seqs \+ 1 = 5", False),
    (lambda i: dict(distribution=jnp.array([2, 1, 3], jnp.int32)), r"distribution=\(2, 1, 3\) must satisfy", True),
    (lambda i: dict(distribution=jnp.array([0, 1, 9], jnp.int32)), r"distribution=\(0, 1, 9\)", True),
    (lambda i: dict(page_indices=i["page_indices"].at[0].set(10_000)), r"page_indices\[0\]=10000 .* out of range", True),
    (lambda i: dict(kv_lens=i["kv_lens"].at[1].set(3)), r"kv_lens\[1\]=3 < q_len=8", True),
    (lambda i: dict(distribution=jnp.array([2, 2, 3], jnp.int32)), r"sequence 1 is in the decode range .* q_len=8", True),
    (lambda i: dict(d_block_sizes=(1, 32, 1, 24)), r"bkv=32 must be a multiple of ckv=24", False),
    (lambda i: dict(p_block_sizes=(16, 32, 6, 16)), r"bq=16 must be a multiple of cq=6", False),
    (lambda i: dict(m_block_sizes=(8, 40, 8, 40)), r"bkv=40 must be a multiple of page_size=16", False),
    (lambda i: dict(p_block_sizes=(8, 32, 8, 8)), r"ckv=8 must be a multiple of page_size=16", False),
    (lambda i: dict(d_block_sizes=(2, 32, 1, 32)), r"decode block sizes need bq == cq in \(1, 2, 4, 8\)", False),
    (lambda i: dict(d_block_sizes=(3, 32, 3, 32)), r"decode block sizes need bq == cq in \(1, 2, 4, 8\)", False),
    (lambda i: dict(d_block_sizes=(1, 32, 1)), r"not a 4-tuple", False),
    # v3's words ("must be positive", "must not be 0.0"), with the value and what is valid
    (lambda i: dict(sliding_window=0), r"sliding_window=0 must be positive \(a positive int, or None", False),
    (lambda i: dict(sliding_window=-1), r"sliding_window=-1 must be positive", False),
    (lambda i: dict(soft_cap=0.0), r"soft_cap=0.0 must not be 0.0 \(valid: a nonzero finite float, or None", False),
    (lambda i: dict(k_scale=0.0), r"k_scale=0.0 must be > 0", False),
    (lambda i: dict(use_causal_mask=False, sliding_window=8), r"sliding_window=8 needs use_causal_mask=True", False),
    (lambda i: dict(skip_kv_mask=True), r"skip_kv_mask=True needs use_causal_mask=False", False),
    (lambda i: dict(use_causal_mask="no"), r"use_causal_mask='no' must be a bool", False),
    (lambda i: dict(update_kv_cache=None), r"update_kv_cache=None must be a bool", False),
    (lambda i: dict(debug_mode=True), r"debug_mode=True is not supported .* valid: False", False),
    (lambda i: dict(chunk_prefill_size=0), r"chunk_prefill_size=0 must be positive", False),
    (lambda i: dict(vmem_limit_bytes=-5), r"vmem_limit_bytes=-5 must be positive", False),
    (lambda i: dict(attention_sink=jnp.zeros((3,), jnp.float32)),
     r"attention_sink of shape \(3,\) and dtype float32: valid: float32\[num_q_heads=8\]", False),
    (lambda i: dict(attention_sink=jnp.zeros((8,), jnp.bfloat16)), r"attention_sink .* dtype bfloat16", False),
])
def test_bad_input_raises_value_error(inp, override, match, values, monkeypatch):
    if values:       # metadata values are checked only on request (RPA_CHECK_VALUES=1)
        monkeypatch.setenv("RPA_CHECK_VALUES", "1")
    with pytest.raises(ValueError, match=match):
        call(inp, **override(inp))


def test_metadata_values_are_checked_only_on_request(inp, monkeypatch):
    """Shape checks always run; value checks (a host copy of the metadata) are opt-in."""
    from kernel import validate
    seen = []
    real = validate._validate_values
    monkeypatch.setattr(validate, "_validate_values", lambda *a: seen.append(1) or real(*a))
    monkeypatch.delenv("RPA_CHECK_VALUES", raising=False)
    bad = dict(inp, kv_lens=inp["kv_lens"].at[1].set(3))
    kernel.validate_inputs(**bad)
    assert seen == []
    with pytest.raises(ValueError, match=r"kv_lens\[1\]=3 < q_len=8"):
        kernel.validate_inputs(**bad, check_values=True)
    monkeypatch.setenv("RPA_CHECK_VALUES", "1")
    with pytest.raises(ValueError, match=r"kv_lens\[1\]=3 < q_len=8"):
        kernel.validate_inputs(**bad)
    assert len(seen) == 2


def test_head_dim_rule():
    """Any head_dim is taken (padded to 128 lanes); the head_dim-64 kernel takes 64 only."""
    m = ModelShape(4, 2, 96)
    inp = {k: jnp.asarray(v) for k, v in make_inputs(m, LIMITS, W).items()}
    assert kernel.validate_inputs(**inp)["head_dim"] == 96
    args = [inp[k] for k in ("queries", "keys", "values")]
    cache = jnp.zeros(kernel.get_kv_cache_shape_hd64(4, 16, 2, jnp.bfloat16), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"head_dim=96 is not valid for the head_dim-64 kernel .*; valid: 64"):
        kernel.ragged_paged_attention_hd64(*args, cache, *(inp[k] for k in ("kv_lens", "page_indices", "cu_q_lens",
                                                                           "distribution")), interpret=True)


def test_hd64_block_arguments_must_be_positive(inp):
    with pytest.raises(ValueError, match=r"num_queries_per_block=0 must be positive"):
        kernel.ragged_paged_attention_hd64(*inp.values(), num_queries_per_block=0, interpret=True)


def test_get_kv_cache_shape_layout():
    assert kernel.get_kv_cache_shape(10, 16, 8, 128, jnp.bfloat16) == (10, 16, 8, 2, 128)
    assert kernel.get_kv_cache_shape(10, 16, 1, 128, jnp.bfloat16) == (10, 16, 1, 2, 128)
    assert kernel.get_kv_cache_shape(10, 16, 3, 64, jnp.float8_e4m3fn) == (10, 16, 2, 4, 128)
    assert kernel.get_kv_cache_shape(4, 128, 8, 256, jnp.float8_e4m3fn) == (4, 128, 4, 4, 256)
    with pytest.raises(ValueError, match="page_size=0 must be a positive int"):
        kernel.get_kv_cache_shape(4, 0, 8, 128, jnp.bfloat16)
    # the head_dim-64 layout: head h at entry h, K | V in 128 lanes
    assert kernel.get_kv_cache_shape_hd64(10, 16, 8, jnp.bfloat16) == (10, 16, 4, 2, 128)
    assert kernel.get_kv_cache_shape_hd64(10, 16, 1, jnp.float8_e5m2) == (10, 16, 1, 4, 128)
    assert kernel.get_kv_cache_shape_hd64(10, 16, 3, jnp.float32) == (10, 16, 3, 1, 128)
    assert kernel.get_kv_cache_shape(10, 16, 3, 80, jnp.float32) == (10, 16, 6, 1, 128)


def test_block_sizes_accepts_plain_tuple_and_named():
    assert kernel.BlockSizes.coerce((1, 64, 1, 32)) == kernel.BlockSizes(bq=1, bkv=64, cq=1, ckv=32)
    assert kernel.Case.parse("Prefill") is kernel.Case.PREFILL
    with pytest.raises(ValueError, match="unknown case 'chunked'"):
        kernel.Case.parse("chunked")
