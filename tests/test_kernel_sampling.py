"""The sampled workloads behind large compiler estimates (kernel.analysis.sample_for_estimate)."""
import pytest

from kernel import analysis
from kernel.config import Case
from kernel.metrics import visible_pairs
from kernel.workload import ModelShape, Workload

LLAMA = ModelShape(32, 8, 128)


def test_items_cover_every_query_row_and_keep_the_causal_work():
    w = Workload.concat(Workload.of_case("decode", [1, 1], [5, 900]),
                        Workload.of_case("prefill", [300, 64], [300, 1000]),
                        Workload.of_case("mixed", [1, 130], [7, 260]))
    for case, bq in ((Case.DECODE, 1), (Case.PREFILL, 128), (Case.MIXED, 64)):
        lo, hi = w.case_range(case)
        items = analysis._items(w, case, bq)
        assert sum(r for r, _ in items) == sum(w.q_lens[lo:hi])
        assert all(1 <= r <= bq and r <= e for r, e in items)
        # each q block, as a sequence of its own, sees exactly the keys it saw in place
        whole = sum(visible_pairs(q, kv) for q, kv in zip(w.q_lens[lo:hi], w.kv_lens[lo:hi]))
        assert sum(visible_pairs(r, e) for r, e in items) == whole


def test_small_workloads_are_compiled_as_they_are():
    n = analysis.MAX_SAMPLED_ITEMS[Case.DECODE]
    w = Workload.of_case("decode", [1] * n, [2048] * n)
    sample, scale, note = analysis.sample_for_estimate(w, "decode", 1, LLAMA)
    assert sample is w and scale == 1.0 and note == ""


def test_large_workloads_are_sampled_deterministically_and_scaled():
    w = Workload.of_case("decode", [1] * 128, [2048] * 64 + [4096] * 64)
    a = analysis.sample_for_estimate(w, "decode", 1, LLAMA, max_items=4)
    b = analysis.sample_for_estimate(w, "decode", 1, LLAMA, max_items=4)
    assert a == b
    sample, scale, note = a
    # drawn in proportion to the work: the 4096 half carries 65 % of the proxy and gets 3
    # of the 4 draws (a repeated item is compiled again, not dropped)
    assert sample.kv_lens == (2048, 4096, 4096, 4096)
    whole = sum(analysis._proxy((1, e), LLAMA) for e in w.kv_lens)
    part = sum(analysis._proxy((1, e), LLAMA) for e in sample.kv_lens)
    assert scale == pytest.approx(whole / part)
    assert "sampled" in note


def test_mixed_sample_holds_the_heavy_q_blocks():
    """A serving step of many decodes and one long chunk: the chunk's q blocks carry most
    of the work, so they must be in the sample whatever bq is."""
    w = Workload.of_case("mixed", [512] + [1] * 24, [3584] + [900] * 12 + [2900] * 12)
    for bq in (32, 64, 128):
        sample, scale, _ = analysis.sample_for_estimate(w, "mixed", bq, LLAMA)
        assert max(sample.q_lens) == bq
        assert 1.0 < scale < 3 * len(analysis._items(w, Case.MIXED, bq))


def test_scale_tracks_the_work_of_uniform_decode_batches():
    # the scaled sample carries exactly the whole batch's proxy work; twice the bytes per
    # sequence is less than twice the work (the per-sequence overhead does not double),
    # the same bytes in fewer sequences a little less work
    def work(n, kv):
        s, scale, _ = analysis.sample_for_estimate(Workload.of_case("decode", [1] * n, [kv] * n),
                                                   "decode", 1, LLAMA)
        assert s.num_seqs == analysis.MAX_SAMPLED_ITEMS[Case.DECODE] < n
        return scale * sum(analysis._proxy((1, e), LLAMA) for e in s.kv_lens)
    for n, kv in ((64, 4096), (128, 2048), (128, 4096)):
        assert work(n, kv) == pytest.approx(n * analysis._proxy((1, kv), LLAMA), rel=1e-9)
    assert 1.5 < work(128, 4096) / work(128, 2048) < 2.0
    assert 0.75 < work(64, 4096) / work(128, 2048) < 1.0


def test_prefill_sample_depends_on_bq_only():
    w = Workload.of_case("prefill", [1024, 1024], [1024, 3072])
    s128 = analysis.sample_for_estimate(w, "prefill", 128, LLAMA)
    assert s128[0].num_seqs == analysis.MAX_SAMPLED_ITEMS[Case.PREFILL]
    assert all(q <= 128 for q in s128[0].q_lens)
    # a longer-context chunk is more work: the scale factor stays finite and >= 1
    assert s128[1] >= 1.0
    s256 = analysis.sample_for_estimate(w, "prefill", 256, LLAMA)
    assert all(q <= 256 for q in s256[0].q_lens)
