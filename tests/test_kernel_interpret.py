"""The Pallas kernel in TPU interpret mode (CPU) against the NumPy reference."""
import numpy as np
import pytest

from kernel.workload import ModelShape, ServingLimits, Workload
from kernel_cases import run_and_check

GQA = ModelShape(32, 8, 128)
MQA = ModelShape(8, 1, 128)
MHA = ModelShape(8, 8, 128)


def rng_lens(seed, n, lo, hi):
    return [int(x) for x in np.random.default_rng(seed).integers(lo, hi, n)]


def decode_w(seed, n=3, max_kv=300):
    return Workload.of_case("decode", [1] * n, rng_lens(seed, n, 1, max_kv))


def prefill_w(seed, chunk=24, n=2, max_ctx=80):
    ctx = rng_lens(seed, n, 0, max_ctx)
    return Workload.of_case("prefill", [chunk] * n, [chunk + c for c in ctx])


def mixed_w(seed, n=3, max_q=20, max_ctx=90):
    q = rng_lens(seed, n, 1, max_q)
    ctx = rng_lens(seed + 1, n, 0, max_ctx)
    return Workload.of_case("mixed", q, [a + b for a, b in zip(q, ctx)])


SMALL = ServingLimits(page_size=16, max_num_tokens=96, max_num_seqs=6, max_model_len=320)

CASES = [
    # id, model, limits, workload, kwargs
    ("decode-gqa", GQA, SMALL, decode_w(0), dict(d_block_sizes=(1, 64, 1, 32))),
    ("decode-bkv-not-dividing", MQA, SMALL, Workload.of_case("decode", [1, 1], [1, 200]),
     dict(d_block_sizes=(1, 48, 1, 16))),
    # the new token at a block's first row (attended apart: 65, 33), at a page's first
    # row in the last step's block, a page no DMA fetches (written into the step's
    # buffer: kernel/rpa.py, place_new_token: 17, 1), at a block's last row (64)
    ("decode-new-token-opens-a-block", GQA, SMALL, Workload.of_case("decode", [1] * 5, [65, 33, 64, 17, 1]),
     dict(d_block_sizes=(1, 32, 1, 16))),
    ("decode-mha-fetch-eq-compute", MHA, SMALL, decode_w(1, n=2), dict(d_block_sizes=(1, 32, 1, 32))),
    # several sequences per step (bq = cq = sequences, kernel/rpa.py compute_group):
    # members with different step counts, new tokens attended apart and in a step, a short
    # last group, a group whose members run past max_num_seqs (6)
    ("decode-groups-of-2", GQA, SMALL, Workload.of_case("decode", [1] * 5, [65, 33, 64, 17, 1]),
     dict(d_block_sizes=(2, 32, 2, 16))),
    ("decode-groups-of-4", MQA, SMALL, Workload.of_case("decode", [1] * 5, [200, 33, 1, 97, 40]),
     dict(d_block_sizes=(4, 64, 4, 32))),
    ("decode-groups-then-prefill-mixed", GQA, SMALL,
     Workload.concat(decode_w(13, n=3), prefill_w(14, chunk=16, n=1), mixed_w(15, n=2)),
     dict(d_block_sizes=(2, 32, 2, 32), p_block_sizes=(16, 32, 8, 16), m_block_sizes=(8, 48, 8, 16))),
    ("prefill-gqa", GQA, SMALL, prefill_w(2), dict(p_block_sizes=(16, 32, 8, 16))),
    ("prefill-bq-not-dividing", MQA, SMALL, prefill_w(3, chunk=21), dict(p_block_sizes=(8, 48, 4, 16))),
    ("prefill-no-context", MHA, SMALL, Workload.of_case("prefill", [40, 40], [40, 40]),
     dict(p_block_sizes=(16, 16, 16, 16))),
    ("mixed-gqa", GQA, SMALL, mixed_w(4), dict(m_block_sizes=(8, 32, 8, 16))),
    ("mixed-mqa", MQA, SMALL, mixed_w(5), dict(m_block_sizes=(16, 64, 4, 32))),
    ("all-three", GQA, SMALL,
     Workload.concat(decode_w(6, n=2), prefill_w(7, chunk=16, n=1), mixed_w(8, n=2)),
     dict(d_block_sizes=(1, 32, 1, 16), p_block_sizes=(16, 32, 8, 16), m_block_sizes=(8, 48, 8, 16))),
    ("head-dim-64", ModelShape(8, 2, 64), SMALL,
     Workload.concat(decode_w(9, n=1), None, mixed_w(10, n=2)),
     dict(d_block_sizes=(1, 32, 1, 16), m_block_sizes=(8, 32, 4, 16))),
    ("head-dim-256", ModelShape(4, 2, 256), SMALL,
     Workload.concat(decode_w(11, n=1), prefill_w(12, chunk=12, n=1), None),
     dict(d_block_sizes=(1, 32, 1, 32), p_block_sizes=(8, 32, 8, 16))),
    ("page-128-long-context", ModelShape(8, 2, 128),
     ServingLimits(page_size=128, max_num_tokens=64, max_num_seqs=4, max_model_len=2048),
     Workload.concat(Workload.of_case("decode", [1, 1], [1900, 700]), None,
                     Workload.of_case("mixed", [9, 30], [1500, 30])),
     dict(d_block_sizes=(1, 512, 1, 128), m_block_sizes=(16, 256, 8, 128))),
    ("many-pages-shuffled", ModelShape(4, 1, 128),
     ServingLimits(page_size=16, max_num_tokens=64, max_num_seqs=4, max_model_len=1024),
     Workload.concat(Workload.of_case("decode", [1, 1], [1000, 513]), None,
                     Workload.of_case("mixed", [20], [777])),
     dict(d_block_sizes=(1, 128, 1, 64), m_block_sizes=(16, 128, 16, 32))),
]


# Under ``slow`` (the default suite's time): cases whose behaviour a default one covers.
# decode-gqa: decode-new-token-opens-a-block (GQA, bq 1); mixed-gqa and all-three:
# decode-groups-then-prefill-mixed (GQA, the three cases in one batch) and mixed-mqa;
# prefill-no-context: the dead-chunk test's uncached prefill; prefill-gqa: the prefill of
# decode-groups-then-prefill-mixed (GQA, the same block sizes); decode-groups-of-2: that
# case's groups of two and decode-new-token-opens-a-block's batch (at bq 1).
SLOW_CASES = {"decode-gqa", "mixed-gqa", "all-three", "prefill-no-context", "prefill-gqa",
              "decode-groups-of-2"}


@pytest.mark.parametrize("model,limits,workload,kwargs", [
    pytest.param(*c[1:], id=c[0], marks=[pytest.mark.slow] if c[0] in SLOW_CASES else []) for c in CASES])
def test_matches_reference(model, limits, workload, kwargs):
    run_and_check(model, limits, workload, sm_scale=model.head_dim ** -0.5, **kwargs)


FP8 = ModelShape(8, 2, 128, kv_dtype="float8_e4m3fn")


@pytest.mark.parametrize("kwargs", [
    pytest.param(dict(k_scale=0.5, v_scale=0.25), marks=pytest.mark.slow),
    dict(k_scale=0.5, v_scale=2.0, q_scale=0.1),
], ids=["kv-scales", "q-k-v-scales"])
def test_fp8_kv(kwargs):
    w = Workload.concat(decode_w(20, n=2), prefill_w(21, chunk=16, n=1), mixed_w(22, n=2))
    run_and_check(FP8, SMALL, w, sm_scale=0.088, d_block_sizes=(1, 32, 1, 16),
                  p_block_sizes=(16, 32, 8, 16), m_block_sizes=(8, 32, 8, 16), atol=3e-2, rtol=3e-2,
                  **kwargs)


def test_fp8_mqa_odd_heads():
    """fp8 packs 2 heads per row: one KV head leaves the second half of the row as padding."""
    model = ModelShape(4, 1, 128, kv_dtype="float8_e4m3fn")
    w = Workload.concat(decode_w(23, n=2), None, mixed_w(24, n=1))
    run_and_check(model, SMALL, w, sm_scale=0.1, k_scale=1.5, v_scale=0.5,
                  d_block_sizes=(1, 32, 1, 32), m_block_sizes=(8, 32, 8, 16), atol=3e-2, rtol=3e-2)


# window 40 under slow: the dead-chunk, merged-step and decode-group tests run windows of
# 20 and 40; 1 (a token sees only itself) is the edge no other test reaches
@pytest.mark.parametrize("window", [1, pytest.param(7, marks=pytest.mark.slow),
                                    pytest.param(40, marks=pytest.mark.slow)])
def test_sliding_window(window):
    w = Workload.concat(decode_w(30, n=2), prefill_w(31, chunk=20, n=1), mixed_w(32, n=2))
    run_and_check(GQA, SMALL, w, sm_scale=0.1, sliding_window=window, d_block_sizes=(1, 32, 1, 16),
                  p_block_sizes=(8, 32, 8, 16), m_block_sizes=(8, 32, 4, 16))


@pytest.mark.parametrize("window", [pytest.param(7, marks=pytest.mark.slow), 40])
def test_sliding_window_decode_groups(window):
    """Sequences of one decode step whose windows start in different chunks (one's first
    visible chunk is below another's window)."""
    w = Workload.of_case("decode", [1] * 4, [150, 20, 90, 41])
    run_and_check(GQA, SMALL, w, sm_scale=0.1, sliding_window=window, d_block_sizes=(2, 32, 2, 16))


def test_fp8_decode_groups():
    w = Workload.of_case("decode", [1] * 3, [100, 31, 64])
    run_and_check(FP8, SMALL, w, sm_scale=0.088, k_scale=0.5, v_scale=0.25, d_block_sizes=(2, 32, 2, 16),
                  atol=3e-2, rtol=3e-2)


def test_soft_cap():
    w = Workload.concat(decode_w(40, n=2), prefill_w(41, chunk=16, n=1), mixed_w(42, n=2))
    run_and_check(MQA, SMALL, w, sm_scale=0.5, soft_cap=3.0, d_block_sizes=(1, 32, 1, 16),
                  p_block_sizes=(16, 32, 8, 16), m_block_sizes=(8, 32, 8, 16))


def test_heuristic_block_sizes_run():
    """No block sizes given: the heuristic (default generation) must produce a working call."""
    w = Workload.concat(decode_w(50, n=2), prefill_w(51, chunk=16, n=1), mixed_w(52, n=1))
    run_and_check(ModelShape(8, 2, 128), SMALL, w, sm_scale=0.1)


# (one of the four runs by default, the suite's time: it computes the dead chunks on TPU7x;
# every other prefill / mixed test runs the default generation, v6e, which skips them)
@pytest.mark.parametrize("generation,window", [
    pytest.param("v6e", None, marks=pytest.mark.slow), ("tpu7x", 20),
    pytest.param("v6e", 20, marks=pytest.mark.slow), pytest.param("tpu7x", None, marks=pytest.mark.slow)])
def test_dead_chunks_skipped_or_computed_give_the_same_attention(generation, window, monkeypatch):
    """Prefill / mixed skip the chunks with no visible key (past the causal diagonal, past a
    cached step's valid tokens, before the window) except on TPU7x, where every chunk is
    computed masked; both paths against the reference, with KV steps of several chunks,
    chunks past the diagonal and partly valid cached steps."""
    from kernel.config import get_generation
    from kernel.hardware import GENERATION_ENV
    monkeypatch.setenv(GENERATION_ENV, generation)
    assert get_generation(generation).skip_dead_chunks == (generation != "tpu7x")
    w = Workload.concat(None, Workload.of_case("prefill", [40, 9], [40, 75]),
                        Workload.of_case("mixed", [1, 23], [50, 61]))
    kw = {} if window is None else dict(sliding_window=window)
    run_and_check(GQA, SMALL, w, sm_scale=0.1, p_block_sizes=(16, 64, 8, 16), m_block_sizes=(8, 64, 8, 16), **kw)


def test_row_tiles_of_every_head_and_q_chunk_pipelined(monkeypatch):
    """Prefill / mixed run the online-softmax tiles of every KV head, q chunk and row tile
    in one software pipeline (each tile's PV product issued after the next tile's scores).
    A score-tile budget of one vreg forces 16-row tiles, so a q block of two q chunks of
    eight tokens x 4 q heads per KV head is eight tiles per head: every hand-over of
    m / l / acc between tiles is checked against the reference."""
    import dataclasses
    from kernel import config
    from kernel.hardware import GENERATION_ENV
    from kernel.rpa import _row_tile
    monkeypatch.setitem(config.GENERATIONS, "v6e", dataclasses.replace(config.GENERATIONS["v6e"], score_tile_vregs=1))
    monkeypatch.setenv(GENERATION_ENV, "v6e")
    assert _row_tile(8 * GQA.group, 16, config.get_generation("v6e").score_tile_vregs) == 16
    w = Workload.concat(None, Workload.of_case("prefill", [40, 9], [40, 75]),
                        Workload.of_case("mixed", [1, 23], [50, 61]))
    run_and_check(GQA, SMALL, w, sm_scale=0.1, p_block_sizes=(16, 64, 8, 16), m_block_sizes=(16, 32, 8, 16))


def test_score_tile_budget_per_generation():
    from kernel.config import get_generation
    from kernel.rpa import _row_tile
    # a prefill q chunk of 128 tokens x 4 q heads per KV head against 256 keys
    assert _row_tile(512, 256, get_generation("v6e").score_tile_vregs) == 512
    assert _row_tile(512, 256, get_generation("tpu7x").score_tile_vregs) == 512
    assert _row_tile(512, 256, get_generation("v5e").score_tile_vregs) == 256
    # decode tiles (the q heads of one token) are never split
    assert _row_tile(4, 1024, 1) == 4


@pytest.mark.parametrize("byte", [0, 1, 2, 3])
def test_fp8_to_bf16_bits_is_exact_for_every_byte(byte):
    """The kernel's integer e4m3 -> bf16 conversion (``rpa._e4m3_bf16_bits``, used on the
    compiled and the interpreted path alike) against ml_dtypes for all 256 bytes, the byte at
    each position of a word whose other bytes are random (they must not leak in): every
    finite value (subnormals, both zeros) exact, the two NaN encodings finite (+-480)."""
    import jax.numpy as jnp
    import ml_dtypes

    from kernel import rpa
    b = np.arange(256, dtype=np.uint32)
    other = np.random.default_rng(byte).integers(0, 2**32, 256, dtype=np.uint64).astype(np.uint32)
    w = (other & ~np.uint32(0xFF << (8 * byte))) | (b << (8 * byte))
    bits = np.asarray(rpa._e4m3_bf16_bits(jnp.asarray(w) >> (8 * byte)))
    assert (bits >> 16).max() == 0
    got = (bits & 0xFFFF).astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)
    want = b.astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    finite = ~np.isnan(want)
    assert finite.sum() == 254
    np.testing.assert_array_equal(got[finite], want[finite])
    np.testing.assert_array_equal(np.signbit(got[finite]), np.signbit(want[finite]))
    np.testing.assert_array_equal(np.abs(got[~finite]), [480.0, 480.0])


# (one of the four runs by default, the suite's time)
@pytest.mark.parametrize("generation,window", [
    pytest.param("v6e", None, marks=pytest.mark.slow), ("tpu7x", 40),
    pytest.param("v6e", 40, marks=pytest.mark.slow), pytest.param("tpu7x", None, marks=pytest.mark.slow)])
def test_new_tokens_merged_into_the_last_cached_step(generation, window, monkeypatch):
    """Few new tokens that fit in the last cached step's block are read from the cache once
    its update has landed, in that step (no step of their own); those that straddle a
    block boundary, or follow a single cached step, keep their own step. The plan says
    which is which, and every sequence matches the reference, cache included. (The
    interpreter runs a DMA when it is awaited, so without the wait for the cache update
    before the merged step's fetch, that step reads the old cache and this fails.)"""
    from kernel.config import BlockSizes
    from kernel.hardware import GENERATION_ENV
    from kernel.steps import plan
    monkeypatch.setenv(GENERATION_ENV, generation)
    bs = BlockSizes(8, 32, 8, 16)
    q, kv = [4, 4, 3, 5, 1], [60, 68, 30, 95, 50]
    merged = [all(st.cached for st in plan("mixed", bs, 16, a, b, window)[0]) for a, b in zip(q, kv)]
    assert merged == [True, False, False, True, True]
    w = Workload.of_case("mixed", q, kv)
    kw = {} if window is None else dict(sliding_window=window)
    run_and_check(GQA, SMALL, w, sm_scale=0.1, m_block_sizes=tuple(bs), **kw)
