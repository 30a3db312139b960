"""Workload generators (seeded, fit the limits, few distinct lengths) and workload files."""
import dataclasses
import json

import numpy as np
import pytest

from kernel.config import Case
from kernel.workload import ServingLimits
from rpa_tune.workloads import (MIXED_CHUNK, WorkloadError, decode_workload, make_workload, mixed_workload,
                                prefill_workload, quantise, read_workload_file, workload_id)

LIM = ServingLimits(page_size=128, max_num_tokens=2048, max_num_seqs=128, max_model_len=8192)


@pytest.mark.parametrize("case", ["decode", "prefill", "mixed"])
def test_generators_are_seeded_and_fit(case):
    a, _ = make_workload(case, LIM, seed=3)
    b, _ = make_workload(case, LIM, seed=3)
    c, _ = make_workload(case, LIM, seed=4)
    assert a == b and workload_id(a) == workload_id(b)
    assert workload_id(a) != workload_id(c)
    a.check_fits(LIM)
    lo, hi = a.case_range(Case.parse(case))
    assert (lo, hi) == (0, a.num_seqs), "all sequences belong to the requested case"
    assert len(set(zip(a.q_lens, a.kv_lens))) <= 8, "few distinct (q, kv) pairs keep estimates fast"


def test_decode_defaults_and_distribution():
    w, desc = decode_workload(LIM)
    assert w.num_seqs == 64 and set(w.q_lens) == {1}
    assert len(set(w.kv_lens)) == 4
    assert "lognormal:2048:0.8" in desc
    # quantisation keeps the total context of the raw draw (within rounding)
    rng = np.random.default_rng([0, 1])
    raw = np.clip(np.rint(rng.lognormal(np.log(2048), 0.8, 64)) + 1, 1, 8192)
    assert abs(sum(w.kv_lens) - raw.sum()) <= 64
    # the median context is near the requested one
    assert 1200 < np.median(w.kv_lens) < 3500
    fixed, _ = decode_workload(LIM, num_seqs=10, context="fixed:1000")
    assert fixed.kv_lens == (1001,) * 10
    uni, _ = decode_workload(LIM, num_seqs=200, context="uniform:100:200")
    assert uni.num_seqs == 128, "capped by max_num_seqs"
    assert 100 <= min(uni.kv_lens) and max(uni.kv_lens) <= 201


def test_decode_grows_with_more_context():
    short, _ = decode_workload(LIM, context="fixed:1024")
    long, _ = decode_workload(LIM, context="fixed:4096")
    assert sum(long.kv_lens) > 3.9 * sum(short.kv_lens)


def test_prefill_chunks_and_mixed_mix():
    w, _ = prefill_workload(LIM, num_chunks=3, chunk=512, seed=1)
    assert w.q_lens == (512, 512, 512)
    assert all((kv - 512) % 512 == 0 and kv <= 512 + 4096 for kv in w.kv_lens)
    small = ServingLimits(page_size=16, max_num_tokens=64, max_num_seqs=4, max_model_len=256)
    w, _ = prefill_workload(small)
    assert w.q_lens == (64,) and w.kv_lens[0] <= 256
    m, _ = mixed_workload(LIM)
    assert max(m.q_lens) == MIXED_CHUNK and min(m.q_lens) == 1 and 4 in m.q_lens
    assert m.num_tokens <= LIM.max_num_tokens
    for t in (128, 256, 512, 1024, 2048, 4096, 8192):
        # a step a server pads to bucket t holds more than t / 2 tokens (here: all t)
        lim = dataclasses.replace(LIM, max_num_tokens=t)
        m, _ = mixed_workload(lim)
        m.check_fits(lim)
        ext = {q for q in m.q_lens if 16 <= q <= 64 and m.q_lens.count(q) == 2}     # the two extends
        chunks = [(q, kv) for q, kv in zip(m.q_lens, m.kv_lens) if q not in ext | {1, 4}]
        assert t // 2 < m.num_tokens <= t and m.q_lens.count(1) == (16 if t > 128 else 0)
        assert sum(q for q, _ in chunks) >= t // 4 and all(q <= MIXED_CHUNK for q, _ in chunks)
        assert len(chunks) == -(-sum(q for q, _ in chunks) // MIXED_CHUNK) and len(ext) == 1
    m2, _ = mixed_workload(small)
    m2.check_fits(small)


def test_quantise_preserves_order_and_levels():
    vals = [10, 1000, 20, 990, 15, 1010]
    q = quantise(vals, 2)
    assert q == [15, 1000, 15, 1000, 15, 1000]
    assert quantise([1, 2], 4) == [1, 2]


def test_workload_files(tmp_path):
    j = tmp_path / "w.json"
    j.write_text(json.dumps([{"q_len": 1, "kv_len": 100}, {"q_len": 1, "kv_len": 300},
                             {"q_len": 64, "kv_len": 500}]))
    d, desc = make_workload("decode", LIM, path=j)
    assert d.q_lens == (1, 1) and d.kv_lens == (100, 300) and "w.json" in desc
    p, _ = make_workload("prefill", LIM, path=j)
    assert p.q_lens == (64,)
    m, _ = make_workload("mixed", LIM, path=j)
    assert m.num_seqs == 3
    c = tmp_path / "w.csv"
    c.write_text("q_len,kv_len,case\n1,50,decode\n8,40,mixed\n" + "".join(f"1,{100 + i},decode\n" for i in range(30)))
    d, desc = make_workload("decode", LIM, path=c)
    assert d.num_seqs == 31 and len(set(d.kv_lens)) <= 8 and "quantised" in desc
    m, _ = make_workload("mixed", LIM, path=c)
    assert m.q_lens == (8,)


@pytest.mark.parametrize("text,match", [
    ("[{\"q_len\": 2, \"kv_len\": 1}]", "need 1 <= q_len <= kv_len"),
    ("[{\"q_len\": 1}]", "must be an object with q_len and kv_len"),
    ("{not json", "not valid JSON"),
    ("a,b\n1,2\n", "needs a header with q_len,kv_len"),
    ("q_len,kv_len,case\n1,5,sideways\n", "unknown case"),
    ("q_len,kv_len\n", "has no sequences"),
])
def test_bad_workload_files(tmp_path, text, match):
    f = tmp_path / "w.txt"
    f.write_text(text)
    with pytest.raises(WorkloadError, match=match):
        read_workload_file(f)


def test_workload_must_fit_limits(tmp_path):
    f = tmp_path / "w.json"
    f.write_text(json.dumps([{"q_len": 1, "kv_len": 100000}]))
    with pytest.raises(WorkloadError, match="does not fit the serving limits.*max_model_len"):
        make_workload("decode", LIM, path=f)
    with pytest.raises(WorkloadError, match="no prefill sequences"):
        make_workload("prefill", LIM, path=f)
    with pytest.raises(WorkloadError, match="unknown context distribution"):
        make_workload("decode", LIM, context="pareto:1")
