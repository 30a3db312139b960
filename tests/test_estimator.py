"""The estimator (rpa_tune.estimator): the audit catches missing work, the kernel's step
plan matches the DMAs in libtpu's simulated trace, composed estimates match full compiles."""
import dataclasses

import pytest

from kernel.config import BlockSizes, Case
from kernel.steps import features
from kernel.workload import ModelShape, ServingLimits, Workload
from rpa_tune.estimator import audit, compose, profiler
from rpa_tune.estimator.trace import TraceStats, parse_bundles

LLAMA = ModelShape(32, 8, 128)
LIM = ServingLimits(page_size=128, max_num_tokens=512, max_num_seqs=16, max_model_len=8192)


@dataclasses.dataclass
class FakeCal:
    dma_granule_bytes: int = 32
    flops_per_vmatmul: int = 1 << 20


def _trace(read_bytes, write_bytes, matmuls):
    return TraceStats(100, {"hbm_to_vmem": 1, "vmem_to_hbm": 1},
                      {"hbm_to_vmem": read_bytes // 32, "vmem_to_hbm": write_bytes // 32},
                      {"vmatmul.mubr.bf16": matmuls})


def test_audit_flags_a_trace_missing_work():
    w = Workload.of_case("decode", [1] * 4, [2049] * 4)
    need = audit.needed(w, LLAMA, "decode")
    assert need.kv_read_bytes == 4 * 2048 * audit.token_bytes(LLAMA)
    matmuls = -(-need.flops // FakeCal.flops_per_vmatmul)
    ok = audit.audit_trace(_trace(need.kv_read_bytes, need.kv_write_bytes, matmuls), need, FakeCal())
    assert ok.verdict == audit.COMPLETE and not ok.reasons
    # the profiler dropped half the page DMAs: incomplete, and the reason names the bytes
    half = audit.audit_trace(_trace(need.kv_read_bytes // 2, need.kv_write_bytes, matmuls), need, FakeCal())
    assert half.verdict == audit.INCOMPLETE and "KV read" in half.reasons[0] and "50%" in half.reasons[0]
    # ... or the P@V matmuls (predicated moves left undefined): too little MXU work
    mxu = audit.audit_trace(_trace(need.kv_read_bytes, need.kv_write_bytes, matmuls // 3), need, FakeCal())
    assert mxu.verdict == audit.INCOMPLETE and "MXU" in mxu.reasons[0]


def test_trace_counts_static_dma_bytes_and_names_run_time_sized_ones(tmp_path):
    """Bundle lines as libtpu prints them: a DMA of static size counts its granules; one whose
    size is a register is counted apart, and the read check says it cannot see those bytes."""
    f = tmp_path / "k_bundles.txt"
    f.write_text(
        "  bundle slots:\n"
        "  %91 = dma.hbm_to_vmem [thread:$0]  /*hbm=*/%s5_s9, /*size_in_granules=*/32768, /*vmem=*/%s88\n"
        "  %92 = dma.hbm_to_vmem [thread:$0]  /*hbm=*/%s5_s9, /*size_in_granules=*/%s77_s3, /*vmem=*/%s88\n"
        "  %93 = dma.vmem_to_hbm [thread:$0]  /*vmem=*/%s5_s9, /*size_in_granules=*/64, /*hbm=*/%s88\n"
        "  bundle slots:\n"
        "  %94 = dma.done [thread:$0] %s1\n"
        "  %95 = vmatmul.mubr.bf16.gmr.mxu0 %v1\n")
    t = parse_bundles(str(f))
    assert t.bundles == 2 and t.dma_issues == {"hbm_to_vmem": 2, "vmem_to_hbm": 1}
    assert t.dma_granules == {"hbm_to_vmem": 32768, "vmem_to_hbm": 64}
    assert t.dma_dynamic == {"hbm_to_vmem": 1} and t.mxu_matmuls == 1
    w = Workload.of_case("decode", [1] * 2, [2049] * 2)
    a = audit.audit_trace(t, audit.needed(w, LLAMA, "decode"), FakeCal())
    assert a.verdict == audit.INCOMPLETE and any("run-time size" in r for r in a.reasons)


def test_time_model_rejects_an_impossible_rate():
    """Cycles that would move the workload's bytes faster than HBM allows fail the rate check."""
    w = Workload.of_case("decode", [1] * 64, [4097] * 64)
    t = audit.time_model(1000.0, w, LLAMA, "v6e", "decode")
    assert not t["rate_ok"] and "HBM" in t["rate_note"] and t["active_bound"] == "memory"
    assert t["time_s"] == t["memory_bound_s"] and t["mbu"] == pytest.approx(1.0)
    slow = audit.time_model(1e9, w, LLAMA, "v6e", "decode")
    assert slow["rate_ok"] and slow["active_bound"] == "estimate" and slow["mbu"] < 0.01


def _profile(case, w, bs, gen="v6e"):
    req = dict(workload=dict(q_lens=list(w.q_lens), kv_lens=list(w.kv_lens), distribution=list(w.distribution)),
               block_sizes=list(bs), tpu=gen, model=dataclasses.asdict(LLAMA), limits=dataclasses.asdict(LIM),
               case=case)
    r = profiler.profile("rpa_tune.estimator.ours:lower", req, timeout=600)
    assert r["status"] == "ok", r.get("message")
    return r


@pytest.mark.parametrize("case,q,kv,bs", [
    ("decode", [1, 1, 1], [300, 1025, 77], BlockSizes(1, 512, 1, 256)),
    ("prefill", [128], [128 + 640], BlockSizes(128, 512, 128, 256)),
])
def test_step_plan_matches_the_page_dmas_in_the_trace(case, q, kv, bs):
    """kernel.steps mirrors the kernel's walk: the cache pages it plans are the page DMAs
    (HBM -> VMEM) libtpu's simulated trace holds, and the trace passes its audit."""
    w = Workload.of_case(case, q, kv)
    r = _profile(case, w, bs)
    tr = TraceStats.from_json(r["trace"])
    f = features(case, bs, LIM.page_size, q, kv)
    assert tr.dma_issues.get("hbm_to_vmem", 0) == f["page_cached"] > 0
    from rpa_tune.estimator.calibration import calibration
    a = audit.audit_trace(tr, audit.needed(w, LLAMA, case), calibration("v6e"))
    assert a.verdict == audit.COMPLETE, a.reasons


def test_composed_matches_a_full_compile_and_ignores_sequence_order(tmp_path, monkeypatch):
    """The probes of a config price a ragged decode batch within 5 % of compiling it whole,
    and the full compile does not depend on the order of the sequences (it did while the
    kernel read a page count from a dynamic SMEM address)."""
    monkeypatch.setenv("RPA_TUNE_PROBE_CACHE", str(tmp_path))
    bs = BlockSizes(1, 512, 1, 512)
    pr = compose.probe_config(builder="rpa_tune.estimator.ours:lower", case="decode", bs=bs, tpu="v6e",
                              model=dataclasses.asdict(LLAMA), limits=dataclasses.asdict(LIM))
    assert pr["status"] == "ok" and pr["audit"] == audit.COMPLETE, pr.get("reasons")
    m = compose.model_from_json(pr["model"])
    kvs = [1800, 300, 1100, 700]
    full = _profile("decode", Workload.of_case("decode", [1] * 4, kvs), bs)["cycles"]
    rev = _profile("decode", Workload.of_case("decode", [1] * 4, kvs[::-1]), bs)["cycles"]
    assert rev == pytest.approx(full, rel=0.01)
    assert m.cycles(Workload.of_case("decode", [1] * 4, kvs)) == pytest.approx(full, rel=0.05)



_SHORT_DECODE_GAP = pytest.mark.xfail(
    strict=True, reason="decode, many short sequences: probes of at most 3 sequences price 12-16 "
    "sequences 5-10 % low on TPU7x and v5e (benchmarks/README.md, Composition); needs a probe with "
    "more sequences")


@pytest.mark.parametrize("gen,case", [
    ("v6e", "decode"), ("v6e", "prefill"), ("v6e", "mixed"), ("tpu7x", "prefill"), ("tpu7x", "mixed"),
    pytest.param("tpu7x", "decode", marks=_SHORT_DECODE_GAP), pytest.param("v5e", "decode", marks=_SHORT_DECODE_GAP)])
def test_recorded_probes_price_recorded_full_compiles(gen, case):
    """The composition rule against the compiler, from recorded measurements: the probe
    cycles and whole-workload cycles that benchmarks/compose_check.py measured (its jsonl)
    are refitted with today's ``compose.fit`` and ``kernel.steps`` plan, and every composed
    workload must land within 5 % of its whole compile. Changing the step plan, the priced
    items or the fit without re-measuring fails here."""
    import collections
    import json
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import compose_check as cc
    with open(cc.CACHE) as f:
        recs = {d["key"]: d for d in map(json.loads, f)}
    # the kernel version with the most records (the recorded data need not be of today's
    # kernel: this checks the composition rule, test_step_plan_... checks today's kernel)
    hashes = collections.Counter(json.loads(k)[-1] for k in recs)
    kh = hashes.most_common(1)[0][0]
    checked = 0
    for key, r in recs.items():
        g, what, *rest = json.loads(key)
        if what != "probes" or rest[-1] != kh or g != gen or rest[0] != case:
            continue
        bs = BlockSizes(*rest[1])
        plist = [compose.Probe(tuple(p["q_lens"]), tuple(p["kv_lens"])) for p in r["probes"]]
        model = compose.fit(case, bs, cc.PAGE_SIZE, plist, [p["cycles"] for p in r["probes"]])
        for name, w in cc.workloads():
            full = recs.get(json.dumps([gen, name, list(bs), kh]))
            if cc.case_of(w) != Case.parse(case) or cc.CONFIGS[Case.parse(case)] != bs or not full or full["status"] != "ok":
                continue
            assert model.cycles(w) == pytest.approx(full["cycles"], rel=0.05), (gen, name)
            checked += 1
    assert checked >= 4
