"""The estimator (rpa_tune.estimator): the audit catches missing work, the kernel's step
plan matches the DMAs in libtpu's simulated trace, composed estimates match full compiles."""
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from kernel.config import BlockSizes, Case, cdiv
from kernel.steps import decode_steps, features
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
    need = audit.needed(w, LLAMA, "decode", sliding_window=None)
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
    a = audit.audit_trace(t, audit.needed(w, LLAMA, "decode", sliding_window=None), FakeCal())
    assert a.verdict == audit.INCOMPLETE and any("run-time size" in r for r in a.reasons)


def test_run_time_sized_page_dmas_count_at_one_page_only_when_enough_are_issued():
    """A kernel whose cache fetches are one run-time-sized DMA per page (the public kernel):
    the read check counts each at one page, so it passes when enough DMAs are issued to carry
    the bytes the trace does not show, and fails when too few are (e.g. a dropped loop)."""
    w = Workload.of_case("decode", [1] * 2, [2049] * 2)
    need = audit.needed(w, LLAMA, "decode", sliding_window=None)
    page_bytes = audit.page_bytes(128, LLAMA)
    assert page_bytes == 128 * 8 * 2 * 128 * 2                 # tokens x KV heads x (K, V) x dims x bf16
    pages = -(-need.kv_read_bytes // page_bytes)               # 32 pages of context

    def trace(dyn):
        return TraceStats(bundles=1, dma_issues={"hbm_to_vmem": dyn}, dma_granules={"vmem_to_hbm": 10 ** 6},
                          opcodes={"vmatmul.mubr.bf16": 10 ** 6}, dma_dynamic={"hbm_to_vmem": dyn})

    ok = audit.audit_trace(trace(pages), need, FakeCal(), page_bytes)
    assert ok.verdict == audit.COMPLETE and ok.notes and "one page" in ok.notes[0]
    few = audit.audit_trace(trace(pages // 2), need, FakeCal(), page_bytes)
    assert few.verdict == audit.INCOMPLETE and not few.notes
    # without the caller's bound (our kernel: every DMA has a static size) nothing is assumed
    assert audit.audit_trace(trace(pages), need, FakeCal()).verdict == audit.INCOMPLETE


def test_time_model_rejects_an_impossible_rate():
    """Cycles that would move the workload's bytes faster than HBM allows fail the rate check."""
    w = Workload.of_case("decode", [1] * 64, [4097] * 64)
    t = audit.time_model(1000.0, w, LLAMA, "v6e", "decode", sliding_window=None)
    assert not t["rate_ok"] and "HBM" in t["rate_note"] and t["active_bound"] == "memory"
    assert t["time_s"] == t["memory_bound_s"] and t["mbu"] == pytest.approx(1.0)
    slow = audit.time_model(1e9, w, LLAMA, "v6e", "decode", sliding_window=None)
    assert slow["rate_ok"] and slow["active_bound"] == "estimate" and slow["mbu"] < 0.01


@pytest.mark.parametrize("bq", [32, 64, 128])
def test_walk_bytes_count_each_q_block_fetching_its_context_again(bq):
    """128 queries after 2048 cached tokens, page 128: each of the 128 / bq q blocks fetches
    the 16 cached pages (its diagonal step's keys come from the new-KV array, not the
    cache); ``needed`` counts them once. (A v5p trace of (32, 256, 16, 256) moved 33.5 MB of
    the cache, as counted here; benchmarks/README.md, "Small q blocks".)"""
    w = Workload.of_case("prefill", [128], [2176])
    tb = 2 * LLAMA.num_kv_heads * LLAMA.head_dim * 2          # merged K+V of every KV head, bf16
    walk = audit.walk_bytes(w, LLAMA, "prefill", BlockSizes(bq, 256, bq, 256), 128, sliding_window=None)
    assert walk == (128 // bq) * 2048 * tb
    assert audit.needed(w, LLAMA, "prefill", sliding_window=None).kv_read_bytes == 2048 * tb


def test_the_memory_bound_counts_what_the_configs_walk_fetches():
    """An estimate that clears the workload's bytes but not the bytes its own walk fetches
    (four times the context: 45 µs on v5e, the compute bound 22 µs) at the HBM peak is impossible: refused, with the walk
    named; a slower one stands, its memory bound the walk's."""
    from kernel.hardware import tpu_info
    from rpa_tune.estimator.calibration import calibration
    w = Workload.of_case("prefill", [128], [2176])
    walk = audit.walk_bytes(w, LLAMA, "prefill", BlockSizes(32, 256, 32, 256), 128, sliding_window=None)
    once = audit.time_model(1.0, w, LLAMA, "v5e", "prefill", sliding_window=None)
    cycles = 1.5 * max(once["memory_bound_s"], once["compute_bound_s"]) * calibration("v5e").clock_hz
    plain = audit.time_model(cycles, w, LLAMA, "v5e", "prefill", sliding_window=None)
    assert plain["rate_ok"] and plain["active_bound"] == "estimate"
    t = audit.time_model(cycles, w, LLAMA, "v5e", "prefill", sliding_window=None, walk=walk)
    extra = walk - audit.needed(w, LLAMA, "prefill", sliding_window=None).kv_read_bytes
    assert t["memory_bound_s"] == pytest.approx(plain["memory_bound_s"] + extra / tpu_info("v5e").mem_bw_bytes_per_second)
    assert not t["rate_ok"] and "walk fetches" in t["rate_note"] and t["time_s"] == t["memory_bound_s"]
    assert t["mbu"] < 1.0            # MBU stays against the workload's bytes
    slow = audit.time_model(cycles * 10, w, LLAMA, "v5e", "prefill", sliding_window=None, walk=walk)
    assert slow["rate_ok"] and slow["active_bound"] == "estimate"


def test_the_walk_bound_counts_the_padded_cache_a_narrow_head_dim_reads():
    """Llama-3.2-1B's head_dim 64 is padded to 128 lanes in the cache: its walk moves the
    padded bytes, so its memory bound is never below them at the HBM peak, and equals its
    128-wide twin's but for the Q / O and new-token bytes, which the paper counts unpadded."""
    from kernel.hardware import tpu_info
    narrow, wide = ModelShape(32, 8, 64), LLAMA
    w = Workload.of_case("prefill", [128], [2176])
    bs = BlockSizes(32, 256, 32, 256)
    bw = tpu_info("v5p").mem_bw_bytes_per_second
    walk = audit.walk_bytes(w, narrow, "prefill", bs, 128, sliding_window=None)
    assert walk == audit.walk_bytes(w, wide, "prefill", bs, 128, sliding_window=None) == 4 * 2048 * 2 * 8 * 128 * 2
    t = {m.head_dim: audit.time_model(1.0, w, m, "v5p", "prefill", sliding_window=None, walk=walk)
         for m in (narrow, wide)}
    assert t[64]["memory_bound_s"] * bw >= walk
    unpadded = 2 * 128 * 2 * 8 * 64 * 2 + 128 * 2 * 32 * 64 * 2   # new K/V read and written, Q read, O written
    assert t[64]["memory_bound_s"] * bw == pytest.approx(walk + unpadded)
    assert t[128]["memory_bound_s"] * bw == pytest.approx(walk + 2 * unpadded)


def _recorded_rows():
    """Three recorded compile rows of one prefill config, their estimates 0.5x, 0.97x and 2x
    the memory bound of the cache its walk fetches; and that bound."""

    from rpa_tune.estimator.calibration import calibration
    w = Workload.of_case("prefill", [128], [2176])
    bs = BlockSizes(32, 256, 32, 256)
    walk = audit.walk_bytes(w, LLAMA, "prefill", bs, 128, sliding_window=None)
    bound = audit.time_model(1.0, w, LLAMA, "v5e", "prefill", sliding_window=None, walk=walk)["memory_bound_s"]
    old = audit.time_model(1.0, w, LLAMA, "v5e", "prefill", sliding_window=None)
    clock = calibration("v5e").clock_hz
    rows = []
    for i, est in enumerate((0.5 * bound, 0.97 * bound, 2.0 * bound)):
        rows.append(dict(backend="compile", kernel="rpa-tune", status="ok", method="estimate", generation="v5e",
                         case="prefill", num_q_heads=32, num_kv_heads=8, head_dim=128, q_dtype="bfloat16",
                         kv_dtype="bfloat16", page_size=128, bq=bs.bq, bkv=bs.bkv, cq=bs.cq, ckv=bs.ckv,
                         sliding_window=False, workload="prefill: 1 seqs", workload_id="w", key_id="k",
                         config_id=f"c{i}", workload_json=json.dumps(dict(q_lens=list(w.q_lens), kv_lens=list(w.kv_lens),
                                                       distribution=list(w.distribution))),
                         cycles=est * clock, estimate_s=est, metric=max(est, old["memory_bound_s"]),
                         memory_bound_s=old["memory_bound_s"], active_bound="estimate", audit="complete",
                         message="composed"))
    return rows, bound


def test_recorded_rows_are_judged_again_by_the_walks_memory_bound():
    """``rejudge`` applies today's time model to a recorded row's own cycles: a row whose
    estimate beats its walk's bytes at the HBM peak by more than 5 % is refused (no metric),
    one within 5 % takes the bound as its time, one above it is left as it was; every row
    gets today's memory bound."""
    import pandas as pd

    from rpa_tune.estimator.rejudge import rejudge
    rows, bound = _recorded_rows()
    new, changed = rejudge(pd.DataFrame(rows))
    assert list(changed) == [True, True, False]
    assert new.audit.tolist() == ["incomplete", "complete", "complete"]
    assert pd.isna(new.metric[0]) and "walk fetches" in new.message[0]
    assert new.metric[1] == pytest.approx(bound) and new.active_bound[1] == "memory"
    assert new.metric[2] == rows[2]["metric"] and new.message[2] == "composed"
    assert new.memory_bound_s.tolist() == pytest.approx([bound] * 3)


def test_rejudge_reports_first_and_rewrites_a_results_directory_only_when_asked(tmp_path, capsys):
    """``python -m rpa_tune.estimator.rejudge DIR`` only reports; with ``--write`` the
    parts holding a judged row are replaced by a compacted part holding their rows, the judged
    ones changed, and the other parts stay as they were; a missing directory is one line and
    exit 2."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rpa_tune.estimator.rejudge import main
    from rpa_tune.store import SCHEMA, read_results_table
    rows, bound = _recorded_rows()
    d = tmp_path / "res"
    d.mkdir()
    for name, part in (("a.parquet", rows[:2]), ("b.parquet", rows[2:])):
        cols = {f.name: pa.array([r.get(f.name) for r in part], type=f.type) for f in SCHEMA}
        pq.write_table(pa.table(cols, schema=SCHEMA), d / name)
    assert main([str(d)]) == 0
    assert "2 of 3 rows judged again (1 refused, 1 at the walk's memory bound)" in capsys.readouterr().out
    assert sorted(p.name for p in d.iterdir()) == ["a.parquet", "b.parquet"]
    b = (d / "b.parquet").read_bytes()
    assert main([str(d), "--write"]) == 0
    (part,) = [p.name for p in d.iterdir() if p.name != "b.parquet"]
    assert part.startswith("compact-") and (d / "b.parquet").read_bytes() == b
    got = read_results_table([d]).table.to_pandas().set_index("config_id")
    assert got.audit.to_dict() == {"c0": "incomplete", "c1": "complete", "c2": "complete"}
    assert got.metric["c1"] == pytest.approx(bound) and got.metric["c2"] == rows[2]["metric"]
    assert main([str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err


def _double_buffered(w, bs, page, dma):
    """Cycles of a prefill walk where each KV step's page DMAs (``dma`` cycles a page) are
    issued when the step before it starts and run one after another, and a step computes
    once its pages have landed and the step before is done: an independent reference for
    the composition (3,000 a call, 1,500 a q block, 300 a step and a chunk)."""
    from kernel.steps import plan
    comp_end, dma_done, prev_start, first = 3000.0, 3000.0, 3000.0, True
    for q, kv in zip(w.q_lens, w.kv_lens):
        for steps in plan("prefill", bs, page, q, kv):
            for j, st in enumerate(steps):
                pages = st.pages if st.cached else 0
                dma_done = max(prev_start, dma_done) + dma * pages
                start = max(comp_end + (1500.0 if j == 0 else 0.0), dma_done if pages or first else 0.0)
                first, prev_start = False, start
                comp_end = start + 300.0 + 300.0 * st.chunks
    return comp_end


@pytest.mark.parametrize("dma, long_walk, within", [(600.0, True, 0.06), (600.0, False, None), (50.0, True, 1e-6)])
def test_the_long_walk_probe_prices_kv_steps_that_wait_on_their_pages(dma, long_walk, within):
    """A bq-32 prefill whose KV steps wait on their page DMAs (600 cycles a page against 600
    of compute a step): composed from its probes' cycles under a double-buffered reference
    walk, 128 queries after 2048 cached tokens, 256 after 1024 and 512 after 4096 land
    within 6 % of the reference with the long-walk probe (the 256, eight q blocks of four
    steps, 5.5 % high), and more than 15 % low without it (as the profiler's whole compiles
    showed for bq 32: benchmarks/README.md, "Small q blocks"). With 50 cycles a page the
    walk is compute-bound, the probe adds no wait, and the composition is exact."""
    bs, page = BlockSizes(32, 256, 16, 256), 128
    plist = compose.probes("prefill", bs, page, long_walk=long_walk)
    m = compose.fit("prefill", bs, page, plist, [_double_buffered(p.workload("prefill"), bs, page, dma)
                                                   for p in plist])
    assert (m.page_pipelined > 1.0) is (long_walk and dma > 100)
    for q, kv in (([128], [2176]), ([256], [1280]), ([512], [4608])):
        w = Workload.of_case("prefill", q, kv)
        err = m.cycles(w) / _double_buffered(w, bs, page, dma) - 1
        if within:
            assert abs(err) < within, (q, kv, err)
        else:
            assert err < -0.15, (q, kv, err)


def test_mfu_is_against_the_peak_a_head_dim_can_fill_as_the_paper_defines_it():
    """The RPA paper's MFU (section 4.2.1): FLOPs / time over the bf16 peak times the MXU share
    a head_dim-deep contraction fills: 50 % for head_dim 128 on 256-wide MXUs (v6e), all of
    it on 128-wide ones (v5e) or for head_dim 256. At the compute bound it is the profiler's
    K=128 rate over that share, never above 100 %."""
    from kernel import metrics
    from kernel.hardware import tpu_info
    from rpa_tune.estimator.calibration import calibration
    w = Workload.of_case("prefill", [4096], [4096])
    for gen, model, share in (("v6e", LLAMA, 0.5), ("v5e", LLAMA, 1.0), ("v6e", ModelShape(16, 8, 256), 1.0)):
        t = audit.time_model(1e6, w, model, gen, "prefill", sliding_window=None)
        raw = metrics.flops(w, model, "prefill") / t["time_s"] / tpu_info(gen).bf16_ops_per_second
        assert t["mfu_of_peak"] == pytest.approx(raw) and t["mfu"] == pytest.approx(raw / share)
    fast = audit.time_model(1.0, w, LLAMA, "v6e", "prefill", sliding_window=None)        # at the compute bound
    assert fast["active_bound"] == "compute"
    assert fast["mfu"] == pytest.approx(calibration("v6e").k128_fraction_of_peak / 0.5) and fast["mfu"] <= 1.0


def _request(case, w, bs, gen="v6e", model=LLAMA) -> dict:
    return dict(workload=dict(q_lens=list(w.q_lens), kv_lens=list(w.kv_lens), distribution=list(w.distribution)),
                block_sizes=list(bs), tpu=gen, model=dataclasses.asdict(model), limits=dataclasses.asdict(LIM),
                case=case)


def _profile(case, w, bs, gen="v6e", model=LLAMA):
    r = profiler.profile(compose.OURS_BUILDER, _request(case, w, bs, gen, model), timeout=600)
    assert r["status"] == "ok", r.get("message")
    return r


@pytest.mark.parametrize("case,q,kv,bs,gen", [
    ("decode", [1, 1, 1], [300, 1025, 77], BlockSizes(1, 512, 1, 256), "v6e"),
    # v5e's compiler rejected a select on bf16 V in the partial-chunk path (an LLO type
    # check in the analysis-mode compile): every decode probe of a config failed there
    ("decode", [1, 1, 1], [300, 1025, 77], BlockSizes(1, 512, 1, 256), "v5e"),
    # groups of two sequences per step (kernel.steps.decode_steps), a short last group
    ("decode", [1] * 5, [300, 1025, 77, 129, 513], BlockSizes(2, 512, 2, 512), "v6e"),
    ("prefill", [128], [128 + 640], BlockSizes(128, 512, 128, 256), "v6e"),
    # spec-decode rows whose new tokens are read with the last cached step's pages (1154:
    # they add a page to it)
    ("mixed", [4, 4], [2048, 1154], BlockSizes(64, 512, 64, 256), "tpu7x"),
])
def test_step_plan_matches_the_page_dmas_in_the_trace(case, q, kv, bs, gen):
    """kernel.steps mirrors the kernel's walk: the cache pages it plans are the page DMAs
    (HBM -> VMEM) libtpu's simulated trace holds, and the trace passes its audit."""
    w = Workload.of_case(case, q, kv)
    r = _profile(case, w, bs, gen)
    tr = TraceStats.from_json(r["trace"])
    f = features(case, bs, LIM.page_size, q, kv)
    assert tr.dma_issues.get("hbm_to_vmem", 0) == f["page_cached"] > 0
    if case == "decode":
        assert sum(st.pages for st in decode_steps(bs, LIM.page_size, kv)) == f["page_cached"]
    from rpa_tune.estimator.calibration import calibration
    a = audit.audit_trace(tr, audit.needed(w, LLAMA, case, sliding_window=None), calibration(gen))
    assert a.verdict == audit.COMPLETE, a.reasons


@pytest.mark.parametrize("case,q,kv,bs", [
    ("prefill", [128, 64], [128 + 640, 64], BlockSizes(128, 512, 128, 256)),
    pytest.param("mixed", [1, 1, 64], [900, 300, 600], BlockSizes(64, 512, 64, 256), marks=pytest.mark.slow),
])
def test_fast_forward_changes_no_cycle_of_a_prefill_or_mixed_program(case, q, kv, bs):
    """The composition's prefill / mixed probes run the profiler with loop fast-forward
    (profiler.FAST_FORWARD_FLAG), which is not exact for long loops: it must leave these
    programs' cycles and trace totals as they are. (What it saves is measured in
    benchmarks/README.md, "Loop fast-forward".)"""
    req = _request(case, Workload.of_case(case, q, kv), bs)
    plain = profiler.profile(compose.OURS_BUILDER, req, timeout=600, rss_cap=8 << 30)
    fast = profiler.profile(compose.OURS_BUILDER, req, timeout=600, fast_forward=True)
    assert plain["status"] == fast["status"] == "ok", (plain.get("message"), fast.get("message"))
    assert fast["cycles"] == plain["cycles"] and fast["trace"] == plain["trace"]


def test_a_probe_whose_fast_forwarded_trace_misses_work_is_profiled_again_without(monkeypatch, tmp_path):
    """Fast-forward can drop a loop's work from both the trace and the cycles; the audit
    sees it, and the probe is compiled again without fast-forward (whose cycles are used)."""
    from rpa_tune.estimator import trace as trace_mod

    calls = []

    def fake_profile(builder, req, *, timeout=None, expect_kernel_hash=None, fast_forward=False, **kw):
        calls.append(fast_forward)
        kv = sum(req["workload"]["kv_lens"])
        return {"status": "ok", "cycles": 10 if fast_forward else 1000 + 3 * kv, "trace": {"ff": fast_forward},
                "max_rss_bytes": 1, "compile_s": 0.1, "lower_s": 0.1}

    class Verdict:
        def __init__(self, ok):
            self.verdict = audit.COMPLETE if ok else audit.INCOMPLETE
            self.reasons = [] if ok else ["trace holds 0% of the needed MXU FLOPs"]
            self.notes = []

        def to_json(self):
            return {"verdict": self.verdict}

    monkeypatch.setattr(profiler, "profile", fake_profile)
    monkeypatch.setattr(trace_mod.TraceStats, "from_json", staticmethod(lambda d: d))
    monkeypatch.setattr(audit, "audit_trace", lambda tr, need, cal, page_bytes=None: Verdict(not tr["ff"]))
    monkeypatch.setenv("RPA_TUNE_PROBE_CACHE", str(tmp_path))
    bs = BlockSizes(128, 512, 128, 256)
    pr = compose.probe_config(builder=compose.OURS_BUILDER, case="prefill", bs=bs, tpu="v6e",
                              model=dataclasses.asdict(LLAMA), limits=dataclasses.asdict(LIM), use_cache=False)
    n = len(compose.probes("prefill", bs, LIM.page_size))
    # after the first probe's fast-forward misses work, the others skip straight to the plain compile
    assert calls == [True, False] + [False] * (n - 1)
    assert pr["status"] == "ok" and pr["audit"] == audit.COMPLETE
    assert all(not p["fast_forward"] and p["cycles"] == 1000 + 3 * sum(p["kv_lens"]) for p in pr["probes"])
    calls.clear()
    compose.probe_config(builder=compose.OURS_BUILDER, case="decode", bs=BlockSizes(1, 512, 1, 256), tpu="v6e",
                         model=dataclasses.asdict(LLAMA), limits=dataclasses.asdict(LIM), use_cache=False)
    assert calls and not any(calls)          # decode never fast-forwards


def test_probes_whose_cycles_ignore_their_cached_kv_are_not_composed(monkeypatch, tmp_path):
    """TPU7x's profiler charged 256 queries the same 18,497 cycles after 0 to 1,024 cached
    tokens although their traces held the extra steps' matmuls: a fit to such probes priced
    cached KV at nothing. Such probes are profiled again without fast-forward, and if their
    cycles still ignore the work the config's audit is incomplete (also when read from the
    probe cache); probes whose cycles grow with the work pass."""
    bs = BlockSizes(256, 512, 32, 256)
    plist = compose.probes("prefill", bs, 256, skip_dead_chunks=False)
    flat = [18497 if len(p.q_lens) == 1 and p.q_lens[0] == 256 else 23176 for p in plist]
    grows = [1000 + 3 * sum(p.kv_lens) + 500 * len(p.q_lens) for p in plist]
    why = compose.inconsistent_probes("prefill", bs, 256, plist, flat, skip_dead_chunks=False)
    assert why and all("no more than" in w for w in why)
    assert not compose.inconsistent_probes("prefill", bs, 256, plist, grows, skip_dead_chunks=False)
    # decode's pipeline model prices hidden page DMAs by design: not checked
    dec = compose.probes("decode", BlockSizes(1, 512, 1, 256), 128)
    assert not compose.inconsistent_probes("decode", BlockSizes(1, 512, 1, 256), 128, dec, [5] * len(dec))

    calls = []
    plain_grows = [True]

    def fake_profile(builder, req, *, timeout=None, expect_kernel_hash=None, fast_forward=False, **kw):
        calls.append(fast_forward)
        kv = sum(req["workload"]["kv_lens"])
        cyc = 18497 if fast_forward or not plain_grows[0] else 1000 + 3 * kv
        return {"status": "ok", "cycles": cyc, "trace": {}, "max_rss_bytes": 1, "compile_s": 0.1, "lower_s": 0.1}

    _probe_with(monkeypatch, tmp_path, fake_profile)
    model, lim = dataclasses.asdict(LLAMA), dataclasses.asdict(LIM)
    cfg = BlockSizes(128, 512, 128, 256)            # fast-forwarded at page 128 on v6e
    n = len(compose.probes("prefill", cfg, LIM.page_size))
    pr = compose.probe_config(builder=compose.OURS_BUILDER, case="prefill", bs=cfg, tpu="v6e", model=model, limits=lim)
    assert calls == [True] * n + [False] * n        # the whole config again, without fast-forward
    assert pr["audit"] == audit.COMPLETE and not pr["consistency"]
    assert not any(p["fast_forward"] for p in pr["probes"])

    calls.clear()
    plain_grows[0] = False                          # the profiler's cycles ignore the work either way
    n = len(compose.probes("mixed", cfg, LIM.page_size))     # (no long walk: prefill's eighth probe)
    pr = compose.probe_config(builder=compose.OURS_BUILDER, case="mixed", bs=cfg, tpu="v6e", model=model, limits=lim)
    assert calls == [True] * n + [False] * n
    assert pr["status"] == "ok" and pr["audit"] == audit.INCOMPLETE
    assert any("cannot be composed" in r for r in pr["reasons"])
    calls.clear()
    again = compose.probe_config(builder=compose.OURS_BUILDER, case="mixed", bs=cfg, tpu="v6e", model=model, limits=lim)
    assert calls == [] and again["audit"] == audit.INCOMPLETE and again["reasons"] == pr["reasons"]

    # a fast-forwarded record from before the check is not trusted: profiled again without it
    plain_grows[0] = True
    monkeypatch.setattr(compose, "inconsistent_probes", lambda *a, **k: [])
    compose.probe_config(builder=compose.OURS_BUILDER, case="prefill", bs=BlockSizes(128, 256, 128, 256), tpu="v6e",
                         model=model, limits=lim)
    monkeypatch.undo()
    _probe_with(monkeypatch, tmp_path, fake_profile)
    calls.clear()
    pr = compose.probe_config(builder=compose.OURS_BUILDER, case="prefill", bs=BlockSizes(128, 256, 128, 256), tpu="v6e",
                              model=model, limits=lim)
    m = len(compose.probes("prefill", BlockSizes(128, 256, 128, 256), LIM.page_size))
    assert calls == [False] * m and pr["audit"] == audit.COMPLETE


def _probe_with(monkeypatch, tmp_path, fake_profile) -> None:
    """``compose.probe_config`` with ``fake_profile`` in place of the profiler child, every
    trace passing its audit, and the probe cache in ``tmp_path``."""
    class Complete:
        verdict, reasons, notes = audit.COMPLETE, [], []

        def to_json(self):
            return {"verdict": audit.COMPLETE, "reasons": []}

    monkeypatch.setattr(profiler, "profile", fake_profile)
    monkeypatch.setattr(audit, "audit_trace", lambda tr, need, cal, page_bytes=None: Complete())
    monkeypatch.setenv("RPA_TUNE_PROBE_CACHE", str(tmp_path))


def test_a_vmem_oom_is_kept_for_the_configs_other_buckets(monkeypatch, tmp_path):
    """The compiler's VMEM OOM at a scoped limit is the program's, the same at every token
    bucket of the key: the compile backend's first estimate of a config that runs out at
    the initial limit compiles at it, then at the limit the OOM asks for; pricing the
    config for another bucket compiles nothing, recorded verdicts taking it through the same
    retry to the same estimate. A timeout is not kept."""
    from kernel.workload import ServingLimits as Lim
    from rpa_tune.evaluators import compile as compile_ev
    from rpa_tune.evaluators.base import Task
    from rpa_tune.workloads import make_workload
    need = 40 << 20
    calls = []

    def fake_profile(builder, req, *, timeout=None, expect_kernel_hash=None, fast_forward=False, **kw):
        limit = req["options"]["vmem_limit_bytes"]
        calls.append(limit)
        if limit < need:
            return {"status": "vmem_oom", "vmem": {"kind": "scoped_limit", "used_bytes": need, "limit_bytes": limit},
                    "message": f"Scoped allocation with size {need} exceeds the limit {limit}", "max_rss_bytes": 1}
        w = req["workload"]
        return {"status": "ok", "cycles": 1000 + 10 * sum(w["q_lens"]) + sum(w["kv_lens"]), "trace": {},
                "max_rss_bytes": 1, "compile_s": 0.1, "lower_s": 0.1}

    _probe_with(monkeypatch, tmp_path, fake_profile)
    bs = BlockSizes(64, 512, 64, 256)

    def task(bucket):
        lim = Lim(page_size=128, max_num_tokens=bucket, max_num_seqs=16, max_model_len=2048)
        return Task(backend="compile", generation="v6e", case="prefill", model=LLAMA, limits=lim,
                    workload=make_workload("prefill", lim)[0], bs=bs, vmem_predicted_bytes=8 << 20)

    first = compile_ev.CompileEvaluator().evaluate(task(512))
    assert first.status == "ok" and first.vmem_limit_bytes >= need and min(calls) < need
    assert "OOM at limit" in first.message
    n = len(calls)
    again = compile_ev.CompileEvaluator().evaluate(task(1024))
    assert len(calls) == n and again.status == "ok" and again.vmem_limit_bytes == first.vmem_limit_bytes
    assert again.message.split(";")[0] == first.message.split(";")[0]       # (the same retry note)
    # the recorded OOM says so
    oom = compose.probe_config(builder=compose.OURS_BUILDER, case="prefill", bs=bs, tpu="v6e",
                               model=dataclasses.asdict(LLAMA), limits=dataclasses.asdict(task(512).limits),
                               options={"vmem_limit_bytes": min(calls)})
    assert oom["status"] == "vmem_oom" and oom["cached"] and oom["vmem"]["used_bytes"] == need
    assert len(calls) == n
    # a timeout is not the program's: compiled again
    monkeypatch.setattr(profiler, "profile", lambda *a, **k: calls.append(0) or {"status": "timeout", "message": "t"})
    args = dict(builder=compose.OURS_BUILDER, case="prefill", bs=BlockSizes(128, 512, 128, 256), tpu="v6e",
                model=dataclasses.asdict(LLAMA), limits=dataclasses.asdict(task(512).limits))
    compose.probe_config(**args)
    n = len(calls)
    assert compose.probe_config(**args)["status"] == "timeout" and len(calls) > n


def test_mixed_probes_start_with_two_warm_up_sequences_and_no_like_ones_in_a_row():
    """Our kernel's mixed probes: each after ``mixed_warm_up``, no two like sequences in a
    row (the analysis program loops over such runs; serving does not), no probe twice.
    Decode and prefill probes, and the public kernel's (``warm_up=False``), are unchanged."""
    for bs, page in ((BlockSizes(64, 512, 64, 256), 128), (BlockSizes(16, 1024, 8, 1024), 256)):
        plain = compose.probes("mixed", bs, page, warm_up=False)
        warm = compose.probes("mixed", bs, page)
        w = compose.mixed_warm_up(page)
        assert len(w) == 2 and w[0] != w[1]
        for p in warm:
            seqs = list(zip(p.q_lens, p.kv_lens))
            assert seqs[:2] == w and all(a != b for a, b in zip(seqs, seqs[1:]))
        assert len(set(warm)) == len(warm) == len(set(plain))
        # the probed sequences are the plain probes', a like one given one more KV token
        for p, q in zip(warm, dict.fromkeys(plain)):
            assert p.q_lens[2:] == q.q_lens
            assert [a - b for a, b in zip(p.kv_lens[2:], q.kv_lens)] == [
                int(i > 0 and q.kv_lens[i] == q.kv_lens[i - 1] and q.q_lens[i] == q.q_lens[i - 1])
                for i in range(len(q.q_lens))]
        for case in ("decode", "prefill"):
            assert compose.probes(case, bs, page) == compose.probes(case, bs, page, warm_up=False)
    # the helper itself (benchmarks/small_q_check.py uses it too): only a like neighbour moves
    assert compose.unlike_in_a_row([(1, 5)] * 3 + [(2, 5), (2, 6)]) == [(1, 5), (1, 6), (1, 5), (2, 5), (2, 6)]


def test_mixed_probes_price_a_batch_past_its_first_two_sequences(monkeypatch, tmp_path):
    """In a batch the first two sequences cost less than each later one (the first KV
    fetch waits, later ones overlap earlier compute; measured 1,150-1,250 cycles on v5e) and
    the analysis program charges a run of like sequences a loop serving does not run. Against
    a profiler stand-in with both effects on top of per-item costs, the warm-up probes price
    a 12-sequence batch exactly (call absorbs the first two's discount); the probes without
    the warm-up are off by more than 5 %."""
    bs, page = BlockSizes(64, 512, 64, 256), 128
    names = compose.case_features("mixed")
    cost = dict(call=3000, seq=900, qblock=400, step=700, page_cached=60, chunk=300)

    def truth(q_lens, kv_lens):
        f = features("mixed", bs, page, q_lens, kv_lens)
        runs = sum(1 for i in range(1, len(q_lens)) if (q_lens[i], kv_lens[i]) == (q_lens[i - 1], kv_lens[i - 1]))
        return (sum(cost[k] * f[k] for k in names) - 1500 * min(1, len(q_lens)) - 1200 * (len(q_lens) >= 2)
                - 2500 * runs)

    def fake_profile(builder, req, *, timeout=None, expect_kernel_hash=None, fast_forward=False, **kw):
        w = req["workload"]
        return {"status": "ok", "cycles": truth(w["q_lens"], w["kv_lens"]), "trace": {}, "max_rss_bytes": 1,
                "compile_s": 0.1, "lower_s": 0.1}

    _probe_with(monkeypatch, tmp_path, fake_profile)
    pr = compose.probe_config(builder=compose.OURS_BUILDER, case="mixed", bs=bs, tpu="v6e",
                              model=dataclasses.asdict(LLAMA), limits=dataclasses.asdict(LIM))
    assert pr["status"] == "ok" and [(tuple(p["q_lens"]), tuple(p["kv_lens"])) for p in pr["probes"]] == [
        (p.q_lens, p.kv_lens) for p in compose.probes("mixed", bs, page)]
    q = [128, 40, 40] + [4] * 4 + [1] * 5
    kv = [1152, 900, 931] + [2048 + i for i in range(4)] + [700 + 50 * i for i in range(5)]
    w = Workload.of_case("mixed", q, kv)
    assert compose.model_from_json(pr["model"]).cycles(w) == pytest.approx(truth(q, kv), rel=1e-9)
    plain = compose.probes("mixed", bs, page, warm_up=False)
    old = compose.fit("mixed", bs, page, plain, [truth(p.q_lens, p.kv_lens) for p in plain])
    assert abs(old.cycles(w) / truth(q, kv) - 1) > 0.05
    # a cached probe set of other probes (an older probe version) is not refitted: profiled again
    monkeypatch.setattr(compose, "probes", lambda *a, **k: plain)
    again = compose.probe_config(builder=compose.OURS_BUILDER, case="mixed", bs=bs, tpu="v6e",
                                 model=dataclasses.asdict(LLAMA), limits=dataclasses.asdict(LIM))
    assert [p["q_lens"] for p in again["probes"]] == [list(p.q_lens) for p in plain]


def test_the_heuristic_is_profiled_under_a_higher_memory_cap(monkeypatch, tmp_path):
    """A key is promoted only over its heuristic's estimate: the heuristic's probes get
    ``RPA_ESTIMATE_HEURISTIC_MAX_RSS_GB`` (never below the others' cap), the sweep marks the
    heuristic's task, the compile evaluator passes the cap on, and a crash recorded at the
    lower cap is profiled again at the higher one (and kept, not retried, at the same cap)."""
    from kernel.config import TuningKey
    from kernel.workload import ServingLimits as Lim
    from rpa_tune.engine import SweepSpec, make_task, plan_sweep
    from rpa_tune.evaluators import compile as compile_ev
    from rpa_tune.evaluators.base import Task
    from rpa_tune.space import load_space
    from rpa_tune.workloads import make_workload
    monkeypatch.delenv("RPA_ESTIMATE_MAX_RSS_GB", raising=False)
    monkeypatch.setenv("RPA_ESTIMATE_HEURISTIC_MAX_RSS_GB", "6")
    assert profiler.rss_cap_bytes() == 3 << 30 and profiler.rss_cap_bytes(heuristic=True) == 6 << 30
    monkeypatch.setenv("RPA_ESTIMATE_MAX_RSS_GB", "7")
    assert profiler.rss_cap_bytes(heuristic=True) == 7 << 30
    monkeypatch.delenv("RPA_ESTIMATE_MAX_RSS_GB")

    lim = Lim(page_size=128, max_num_tokens=512, max_num_seqs=16, max_model_len=2048)
    w, desc = make_workload("prefill", lim)
    key = TuningKey("v6e", "prefill", "bfloat16", "bfloat16", 32, 8, 128, 128, 512, 2048)
    spec = SweepSpec(key=key, model=LLAMA, limits=lim, workload=w, workload_desc=desc,
                     case_space=load_space("v6e").for_case("prefill"), budget=3)
    plan = plan_sweep(spec)
    other = next(bs for bs in plan.candidates if bs != plan.heuristic)
    assert make_task(spec, plan, plan.heuristic).heuristic and not make_task(spec, plan, other).heuristic
    task = make_task(spec, plan, plan.heuristic)
    assert Task.from_json(task.to_json()).heuristic

    seen = []
    monkeypatch.setattr(compose, "probe_config", lambda **kw: seen.append(kw["rss_cap"]) or {"status": "timeout"})
    for t in (task, make_task(spec, plan, other)):
        compile_ev.CompileEvaluator()._estimate(t, 16 << 20, 60.0)
    assert seen == [6 << 30, 3 << 30]
    monkeypatch.undo()

    caps = []

    def fake_profile(builder, req, *, timeout=None, expect_kernel_hash=None, fast_forward=False, rss_cap=None,
                     **kw):
        caps.append(rss_cap)
        if rss_cap < 5 << 30:
            return {"status": "crash", "returncode": -9, "cause": profiler.MEMORY_CAP, "cap_bytes": rss_cap,
                    "message": "passed the memory cap", "max_rss_bytes": rss_cap}
        return {"status": "ok", "cycles": 1000 + sum(req["workload"]["kv_lens"]), "trace": {}, "max_rss_bytes": 1,
                "compile_s": 0.1, "lower_s": 0.1}

    _probe_with(monkeypatch, tmp_path, fake_profile)
    args = dict(builder=compose.OURS_BUILDER, case="prefill", bs=BlockSizes(128, 512, 128, 256), tpu="v6e",
                model=dataclasses.asdict(LLAMA), limits=dataclasses.asdict(LIM))
    assert compose.probe_config(**args, rss_cap=3 << 30)["status"] == "crash" and set(caps) == {3 << 30}
    n = len(caps)
    assert compose.probe_config(**args, rss_cap=3 << 30)["cached"] and len(caps) == n   # kept
    caps.clear()
    assert compose.probe_config(**args, rss_cap=6 << 30)["status"] == "ok"
    assert caps and set(caps) == {6 << 30}


def test_a_crash_names_its_cause_only_when_the_program_causes_it():
    """The profiler's verdicts that the probe cache keeps (``cause``): passing the memory cap
    (with the cap), a libtpu abort (SIGABRT); not a kill by anything else, not a full disk."""
    import time as time_mod
    capped = profiler._kill_reason(time_mod.monotonic(), 600, 5 << 30, 3 << 30, None)
    assert capped["cause"] == profiler.MEMORY_CAP and capped["cap_bytes"] == 3 << 30
    assert profiler._kill_reason(time_mod.monotonic(), 600, 2 << 30, 3 << 30, None) is None
    assert "cause" not in profiler._kill_reason(time_mod.monotonic() - 700, 600, 1, 3 << 30, None)   # timeout
    abort = "F1123 llo_module.cc:75] Check failed: TakeStatus() is OK ... Raising signal 6"
    assert profiler._died(-6, abort, 1)["cause"] == profiler.LIBTPU_ABORT
    assert "cause" not in profiler._died(-9, "", 1)
    full = profiler._died(-6, "write failed: No space left on device", 1)
    assert "cause" not in full and full["environment"] == "disk_full"


@pytest.mark.parametrize("crash,cached", [
    ({"returncode": -9, "cause": "memory_cap", "cap_bytes": 3 << 30,
      "message": "the static profiler passed the memory cap of 3.0 GB"}, True),
    ({"returncode": -6, "cause": "libtpu_abort", "message": "Check failed: TakeStatus() is OK"}, True),
    ({"returncode": -9, "message": "killed by the machine"}, False),      # no cause: not the program's
])
def test_a_crash_the_program_causes_is_kept_for_the_configs_other_buckets(monkeypatch, tmp_path, crash, cached):
    """A probe that passes the profiler's memory cap or makes libtpu abort does so at every
    token bucket of the key (they share the probes): the verdict is cached and returned
    without compiling, saying so, until the memory cap is raised. Other crashes are not
    kept."""
    calls = []

    def fake_profile(builder, req, *, timeout=None, expect_kernel_hash=None, fast_forward=False, **kw):
        calls.append(req["workload"]["kv_lens"])
        return dict(crash, status="crash", max_rss_bytes=5)

    _probe_with(monkeypatch, tmp_path, fake_profile)
    monkeypatch.setenv("RPA_ESTIMATE_MAX_RSS_GB", "3")
    args = dict(builder=compose.OURS_BUILDER, case="prefill", bs=BlockSizes(128, 512, 128, 256), tpu="v5e",
                model=dataclasses.asdict(LLAMA), limits=dataclasses.asdict(LIM))
    first = compose.probe_config(**args)
    n = len(calls)          # (a fast-forwarded probe that crashed is compiled again without: 2)
    assert first["status"] == "crash" and n in (1, 2) and not first.get("cached")
    again = compose.probe_config(**args)
    if not cached:
        assert len(calls) == 2 * n and not again.get("cached")
        return
    assert len(calls) == n and again["status"] == "crash" and again["cached"] and again["compile_s"] == 0
    assert again["message"].startswith("recorded for this config's probes before") and crash["message"] in again["message"]
    # another config is compiled as usual
    compose.probe_config(**dict(args, bs=BlockSizes(128, 256, 128, 256)))
    assert len(calls) > n
    n = len(calls)
    monkeypatch.setenv("RPA_ESTIMATE_MAX_RSS_GB", "6")          # a higher cap: the cap crash is tried again
    compose.probe_config(**args)
    assert (len(calls) > n) == (crash.get("cause") == "memory_cap")


def test_a_padded_head_dim_reads_its_128_lane_twins_complete_record_and_not_the_reverse(monkeypatch, tmp_path):
    """Head_dim 64 compiles the kernel program of head_dim 128 (padded to 128 lanes): a
    config's probes recorded for the 128-wide shape, complete, serve the 64-wide one without
    compiling, whose need is no larger; a 64-wide record never serves the 128-wide shape,
    nor an incomplete twin the 64-wide one."""
    import glob
    calls = []

    def fake_profile(builder, req, *, timeout=None, expect_kernel_hash=None, fast_forward=False, **kw):
        calls.append(req["model"]["head_dim"])
        return {"status": "ok", "cycles": 1000 + 3 * sum(req["workload"]["kv_lens"]), "trace": {},
                "max_rss_bytes": 1, "compile_s": 0.1, "lower_s": 0.1}

    _probe_with(monkeypatch, tmp_path, fake_profile)
    wide, narrow = dataclasses.asdict(LLAMA), dataclasses.asdict(ModelShape(32, 8, 64))
    args = dict(builder=compose.OURS_BUILDER, case="prefill", bs=BlockSizes(128, 512, 128, 256), tpu="v6e",
                limits=dataclasses.asdict(LIM))
    assert compose.padded_twin({"model": wide}) is None
    assert compose.padded_twin({"model": narrow, "tpu": "v6e"}) == {"model": wide, "tpu": "v6e"}
    w = compose.probe_config(**args, model=wide)
    n = len(calls)
    assert n and set(calls) == {128} and "cycles_of" not in w
    nr = compose.probe_config(**args, model=narrow)
    assert len(calls) == n and nr["cycles_of"].startswith("head_dim 128")
    assert nr["model"] == w["model"] and [p["cycles"] for p in nr["probes"]] == [p["cycles"] for p in w["probes"]]
    assert compose.probe_config(**args, model=narrow)["cycles_of"] and len(calls) == n   # its own record now
    # the reverse: a 64-wide record does not serve the 128-wide shape
    other = dict(args, bs=BlockSizes(128, 256, 128, 256))
    compose.probe_config(**other, model=narrow)
    m = len(calls)
    assert set(calls[n:]) == {64}
    compose.probe_config(**other, model=wide)
    assert len(calls) == 2 * m - n and set(calls[m:]) == {128}
    # an incomplete twin is not read
    for f in glob.glob(str(tmp_path / "*.json")):
        os.remove(f)
    calls.clear()
    compose.probe_config(**args, model=wide)
    for f in glob.glob(str(tmp_path / "*.json")):
        with open(f) as fh:
            d = json.load(fh)
        with open(f, "w") as fh:
            json.dump(dict(d, audit=audit.INCOMPLETE), fh)
    k = len(calls)
    pr = compose.probe_config(**args, model=narrow)
    assert len(calls) == 2 * k and set(calls[k:]) == {64} and "cycles_of" not in pr


def test_probes_of_a_config_compile_in_parallel_in_order_and_stop_after_a_failure(monkeypatch, tmp_path):
    """``workers`` probes compile at once, the largest programs (most q blocks) first; the
    fit sees them in probe order whatever order they ran and finished in; once one fails,
    no further probe starts, the ones still compiling are cancelled, and its failure is
    the result."""
    import threading
    import time as time_mod
    live, peak, calls, cancelled, lock = [0], [0], [], [], threading.Lock()

    def fake_profile(builder, req, *, timeout=None, expect_kernel_hash=None, fast_forward=False, cancel=None,
                     extra_libtpu_args="", rss_cap=None, program_cache=None):
        kv = sum(req["workload"]["kv_lens"])
        with lock:
            calls.append(req["workload"]["kv_lens"])
            live[0] += 1
            peak[0] = max(peak[0], live[0])
        if fail_at is not None and len(calls) == fail_at:
            with lock:
                live[0] -= 1
            return {"status": "vmem_oom", "message": "out of VMEM", "max_rss_bytes": 1}
        if fail_at is not None:                    # a long compile, until it is cancelled
            t0 = time_mod.monotonic()
            while not cancel.is_set() and time_mod.monotonic() - t0 < 30:
                time_mod.sleep(0.01)
            if cancel.is_set():
                with lock:
                    live[0] -= 1
                    cancelled.append(req["workload"]["kv_lens"])
                return {"status": profiler.CANCELLED, "max_rss_bytes": 1}
        time_mod.sleep(0.05 * (1 + kv % 3))        # finish out of order
        with lock:
            live[0] -= 1
        return {"status": "ok", "cycles": 1000 + 7 * kv, "trace": {}, "max_rss_bytes": kv,
                "compile_s": 0.1, "lower_s": 0.1}

    _probe_with(monkeypatch, tmp_path, fake_profile)
    bs = BlockSizes(128, 512, 128, 256)
    args = dict(builder=compose.OURS_BUILDER, case="prefill", bs=bs, tpu="v6e", model=dataclasses.asdict(LLAMA),
                limits=dataclasses.asdict(LIM), use_cache=False)
    plist = compose.probes("prefill", bs, LIM.page_size)
    fail_at = None
    one = compose.probe_config(**args, workers=1)
    assert peak[0] == 1
    # the two probes with two q blocks ran first, then the rest by KV length, longest first
    first = sorted(calls[:2])
    assert first == sorted([list(p.kv_lens) for p in plist if sum(cdiv(q, bs.bq) for q in p.q_lens) == 2])
    rest = [sum(kv) for kv in calls[2:]]
    assert rest == sorted(rest, reverse=True)
    calls.clear()
    two = compose.probe_config(**args, workers=2)
    assert peak[0] == 2 and two["probe_workers"] == 2
    assert [p["kv_lens"] for p in two["probes"]] == [list(p.kv_lens) for p in plist]
    assert two["model"] == one["model"] and [p["cycles"] for p in two["probes"]] == [p["cycles"] for p in one["probes"]]
    rss = sorted((p["max_rss_bytes"] for p in two["probes"]), reverse=True)
    assert two["concurrent_rss_bytes"] == rss[0] + rss[1]
    calls.clear()
    fail_at = 2                          # the second probe fails at once; the first is still running
    t0 = time_mod.monotonic()
    bad = compose.probe_config(**args, workers=2)
    assert bad["status"] == "vmem_oom" and list(bad["probe"]["kv_lens"]) == calls[1]
    assert len(calls) == 2 and cancelled == [calls[0]] and time_mod.monotonic() - t0 < 10


@pytest.mark.parametrize("tpu,placed", [("v5p", "ok"), ("v5p", "compile_error"), ("v5p", "vmem_oom"),
                                         ("tpu7x", "ok")])
def test_a_config_without_an_estimate_is_profiled_again_with_the_new_kv_in_vmem(monkeypatch, tmp_path, tpu, placed):
    """Where XLA leaves the new K/V in HBM the kernel gets no estimate: on the generations
    whose profiler prices that copy at 0 (v5p here, Llama-3-8B prefill, which
    ``places_new_kv`` leaves to XLA), every probe of the config is profiled again with it
    placed, and with fast-forward (no retry without it first). A VMEM OOM of the placed
    config is its verdict (the compile evaluator retries it at another limit); another failure
    leaves the first crash the verdict. TPU7x prices the copy: no second try."""
    from rpa_tune.estimator import ours
    calls = []

    def fake_profile(builder, req, *, fast_forward=False, **kw):
        in_vmem = bool(req.get("place_new_kv"))
        calls.append((in_vmem, fast_forward))
        kv = sum(req["workload"]["kv_lens"])
        if not in_vmem and kv % 256:       # XLA's placement leaves some probes' operand in HBM
            return {"status": "crash", "cause": profiler.NO_ESTIMATE, "cycles": 0, "trace": {},
                    "message": "the static profiler gave no estimate", "max_rss_bytes": 1}
        if in_vmem and placed == "compile_error":
            return {"status": "compile_error", "message": "Too many buffers are colored", "max_rss_bytes": 1}
        if in_vmem and placed == "vmem_oom":
            return {"status": "vmem_oom", "message": "Used 68.31M of 63.94M vmem", "max_rss_bytes": 1,
                    "vmem": {"kind": "capacity", "used_bytes": 68, "limit_bytes": 64}}
        return {"status": "ok", "cycles": 1000 + 3 * kv, "trace": {}, "max_rss_bytes": 1, "compile_s": 0.1,
                "lower_s": 0.1}

    _probe_with(monkeypatch, tmp_path, fake_profile)
    bs = BlockSizes(128, 512, 128, 256)
    plist = compose.probes("prefill", bs, LIM.page_size)
    assert any(sum(p.kv_lens) % 256 for p in plist) and not ours.places_new_kv(tpu, "prefill", LLAMA)
    r = compose.probe_config(builder=compose.OURS_BUILDER, case="prefill", bs=bs, tpu=tpu, model=dataclasses.asdict(LLAMA),
                             limits=dataclasses.asdict(LIM), use_cache=False)
    if tpu == "tpu7x":
        assert r["status"] == "crash" and not any(p for p, _ in calls)
        return
    assert all(ff for p, ff in calls if not p)             # not retried without fast-forward first
    if placed == "ok":
        assert r["status"] == "ok" and r["new_kv_placed"] and sum(p for p, _ in calls) == len(plist)
        assert [p["cycles"] for p in r["probes"]] == [1000 + 3 * sum(p.kv_lens) for p in plist]
    elif placed == "vmem_oom":
        assert r["status"] == "vmem_oom" and r["vmem"]["kind"] == "capacity"
        assert r["message"].startswith("with the new K/V operand placed in VMEM")
    else:
        assert r["status"] == "crash" and r["cause"] == profiler.NO_ESTIMATE and sum(r["probe"]["kv_lens"]) % 256
        assert "with the new K/V operand in VMEM: compile_error: Too many buffers" in r["message"]


@pytest.mark.slow
def test_v5p_prefill_of_eight_kv_heads_is_estimated_with_the_new_kv_placed_where_xla_left_it(tmp_path,
                                                                                           monkeypatch):
    """(64, 1024, 32, 256) of Llama-3-8B's v5p prefill: left to XLA, the new K/V of some of
    its probes is in HBM and the kernel gets no estimate; the config is composed from its
    probes profiled again with the operand placed, every one audited complete."""
    monkeypatch.setenv("RPA_TUNE_PROBE_CACHE", str(tmp_path))
    limits = ServingLimits(page_size=128, max_num_tokens=128, max_num_seqs=128, max_model_len=8192)
    r = compose.probe_config(builder=compose.OURS_BUILDER, case="prefill", bs=BlockSizes(64, 1024, 32, 256), tpu="v5p",
                             model=dataclasses.asdict(LLAMA), limits=dataclasses.asdict(limits),
                             options=dict(vmem_limit_bytes=32 << 20), timeout=3000, use_cache=False, workers=2)
    assert r["status"] == "ok", r.get("message")
    assert r["new_kv_placed"] and r["audit"] == audit.COMPLETE, r["reasons"]
    assert all(p["cycles"] > 0 for p in r["probes"])


def test_every_probe_fits_the_limits_it_is_compiled_with(monkeypatch, tmp_path):
    """Decode (1, 4096, 1, 512) at max_model_len 6144: its two-step probes hold 8192 tokens;
    each probe is compiled with limits that admit it (the profiler child refused them)."""
    seen = []

    def fake_profile(builder, req, **kw):
        w = Workload(tuple(req["workload"]["q_lens"]), tuple(req["workload"]["kv_lens"]),
                     tuple(req["workload"]["distribution"]))
        w.check_fits(ServingLimits(**req["limits"]))        # raises as the child did
        seen.append(max(w.kv_lens))
        return {"status": "ok", "cycles": 1000 + sum(w.kv_lens), "trace": {}, "max_rss_bytes": 1}

    _probe_with(monkeypatch, tmp_path, fake_profile)
    lim = ServingLimits(page_size=128, max_num_tokens=2048, max_num_seqs=128, max_model_len=6144)
    r = compose.probe_config(builder=compose.OURS_BUILDER, case="decode", bs=BlockSizes(1, 4096, 1, 512), tpu="v6e",
                             model=dataclasses.asdict(LLAMA), limits=dataclasses.asdict(lim), use_cache=False)
    assert r["status"] == "ok" and max(seen) > lim.max_model_len


def test_each_sweep_worker_compiles_probes_on_its_share_of_the_cores(monkeypatch):
    from rpa_tune.evaluators import base
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    env = {k: v for k, v in os.environ.items() if k != compose.PROBE_WORKERS_ENV}
    assert base.worker_env("compile", env, jobs=1)[compose.PROBE_WORKERS_ENV] == "8"
    assert base.worker_env("compile", env, jobs=3)[compose.PROBE_WORKERS_ENV] == "2"
    assert base.worker_env("compile", env, jobs=16)[compose.PROBE_WORKERS_ENV] == "1"
    assert base.worker_env("compile", dict(env, **{compose.PROBE_WORKERS_ENV: "3"}), jobs=1)[
        compose.PROBE_WORKERS_ENV] == "3"
    assert compose.PROBE_WORKERS_ENV not in base.worker_env("interpret", env, jobs=1)


GEMMA_256 = ModelShape(16, 8, 256)
LLAMA_FP8 = ModelShape(32, 8, 128, kv_dtype="float8_e4m3fn")


# by default (the suite's time) one generation per way it failed: head_dim 256 on v5e (the
# same check failed on all three), fp8 on TPU7x (the type check) and on v6e (0 cycles)
DEFAULT_ESTIMABLE = {("head_dim256", "v5e"), ("fp8", "tpu7x"), ("fp8", "v6e")}


@pytest.mark.parametrize("gen,model", [
    pytest.param(g, m, id=f"{mid}-{g}", marks=[] if (mid, g) in DEFAULT_ESTIMABLE else [pytest.mark.slow])
    for mid, m in (("head_dim256", GEMMA_256), ("fp8", LLAMA_FP8)) for g in ("v5e", "v6e", "tpu7x")])
def test_head_dim_256_and_fp8_kv_are_estimable(gen, model):
    """Both failed on every generation: an LLO type check on the converted K (head_dim 256
    on all, fp8 on TPU7x) or 0 cycles (fp8 on v5e / v6e, with the output donated), and
    head_dim 256 passed the 3 GB cap on the XLA ops around the kernel. The probe workload's
    page DMAs are in the trace and it passes its audit."""
    bs = BlockSizes(1, 256, 1, 128)
    q, kv = [1] * 3, [300, 129, 77]
    w = Workload.of_case("decode", q, kv)
    r = _profile("decode", w, bs, gen, model)
    assert r["cycles"] > 0 and r["max_rss_bytes"] < 1.5 * 2**30
    tr = TraceStats.from_json(r["trace"])
    assert tr.dma_issues.get("hbm_to_vmem", 0) == features("decode", bs, LIM.page_size, q, kv)["page_cached"] > 0
    from rpa_tune.estimator.calibration import calibration
    a = audit.audit_trace(tr, audit.needed(w, model, "decode", sliding_window=None), calibration(gen))
    assert a.verdict == audit.COMPLETE, a.reasons


def test_composed_matches_a_full_compile_and_ignores_sequence_order(tmp_path, monkeypatch):
    """The probes of a config price a ragged decode batch within 5 % of compiling it whole,
    and the full compile does not depend on the order of the sequences (it did while the
    kernel read a page count from a dynamic SMEM address)."""
    monkeypatch.setenv("RPA_TUNE_PROBE_CACHE", str(tmp_path))
    bs = BlockSizes(1, 512, 1, 512)
    pr = compose.probe_config(builder=compose.OURS_BUILDER, case="decode", bs=bs, tpu="v6e",
                              model=dataclasses.asdict(LLAMA), limits=dataclasses.asdict(LIM))
    assert pr["status"] == "ok" and pr["audit"] == audit.COMPLETE, pr.get("reasons")
    m = compose.model_from_json(pr["model"])
    kvs = [1800, 300, 1100, 700]
    full = _profile("decode", Workload.of_case("decode", [1] * 4, kvs), bs)["cycles"]
    rev = _profile("decode", Workload.of_case("decode", [1] * 4, kvs[::-1]), bs)["cycles"]
    # (the order does change how each sequence's compute overlaps the next one's page DMAs:
    # 23,941 against 23,696 cycles, 1.0 %, at kernel e65ef0b3)
    assert rev == pytest.approx(full, rel=0.02)
    assert m.cycles(Workload.of_case("decode", [1] * 4, kvs)) == pytest.approx(full, rel=0.05)



# Composed workloads known to land just outside 5 % (benchmarks/README.md, "Composition"):
# checked at their recorded error bound instead; one that comes back within 5 % fails, so
# this list and the README stay true.
KNOWN_COMPOSITION_GAPS = {("v6e", "decode 12 x 700"): 0.07, ("v5e", "decode 48 lognormal ~1K"): 0.06}


@pytest.mark.parametrize("gen,case", [(g, c) for g in ("v6e", "tpu7x", "v5e") for c in ("decode", "prefill", "mixed")])
def test_recorded_probes_price_recorded_full_compiles(gen, case):
    """The composition rule against the compiler, from recorded measurements: the probe
    cycles and whole-workload cycles that benchmarks/compose_check.py measured (its jsonl)
    are refitted with today's ``compose.fit`` and ``kernel.steps`` plan, and every composed
    workload must land within 5 % of its whole compile. Changing the step plan, the priced
    items, the probes or the fit without re-measuring fails here."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import compose_check as cc
    with open(cc.CACHE) as f:
        recs = {d["key"]: d for d in map(json.loads, f)}
    # the newest kernel version recorded with today's probes (the recorded data need not be
    # of today's kernel: this checks the composition rule, test_step_plan_... checks today's kernel)
    found = cc.recorded(recs, gen, Case.parse(case))
    if found is None:
        pytest.skip(f"no recorded {gen} {case} probes of today's probe shapes (run benchmarks/compose_check.py)")
    kh, r = found
    bs = cc.CONFIGS[Case.parse(case)]
    plist = [compose.Probe(tuple(p["q_lens"]), tuple(p["kv_lens"])) for p in r["probes"]]
    model = compose.fit(case, bs, cc.PAGE_SIZE, plist, [p["cycles"] for p in r["probes"]],
                        skip_dead_chunks=cc.recorded_skip(r))
    checked = 0
    for name, w in cc.workloads():
        full = recs.get(json.dumps([gen, name, list(bs), kh]))
        if cc.case_of(w) != Case.parse(case) or not full or full["status"] != "ok":
            continue
        err = model.cycles(w) / full["cycles"] - 1
        gap = KNOWN_COMPOSITION_GAPS.get((gen, name))
        if gap is None:
            assert abs(err) <= 0.05, (gen, name, err)
        else:
            assert 0.05 < abs(err) <= gap, (f"{gen} {name}: {err:+.1%}; update KNOWN_COMPOSITION_GAPS and "
                                            "benchmarks/README.md")
        checked += 1
    # TPU7x prefill: four of the six whole prefill workloads do not fit TPU7x's VMEM under
    # the profiler at compose_check's default limit (the probes fit), so two are compared
    assert checked >= (2 if (gen, case) == ("tpu7x", "prefill") else 4)


def test_decode_pipeline_model_bounds_and_fit():
    """Decode's two-stage pipeline: many full steps cost their DMA when DMA is the larger
    stage and their compute otherwise; the fit recovers the costs that generated the
    probes' cycles (a synthetic kernel: no compiler involved)."""
    bs = BlockSizes(1, 1024, 1, 512)
    full = compose.pipeline_steps(bs, 128, [1025] * 40)          # 40 sequences, one 8-page step each
    dma_bound = (100.0, 50.0, 500.0, 200.0, 300.0, 100.0, 800.0)     # DMA 6500 > compute 50 + 500 + 400
    cpu_bound = (100.0, 50.0, 5000.0, 2000.0, 300.0, 100.0, 100.0)   # compute 9050 > DMA 900
    per_seq = lambda th: (compose.pipeline_cycles(th, full) - compose.pipeline_cycles(th, full[:20])) / 20
    assert per_seq(dma_bound) == pytest.approx(100 + 8 * 800)
    assert per_seq(cpu_bound) == pytest.approx(50 + 5000 + 2 * 2000)
    truth = (3000.0, 400.0, 300.0, 1500.0, 700.0, 200.0, 900.0)
    plist = compose.probes("decode", bs, 128)
    cycles = [compose.pipeline_cycles(truth, compose.pipeline_steps(bs, 128, p.kv_lens)) for p in plist]
    m = compose.fit("decode", bs, 128, plist, cycles)
    assert m.kind == "pipeline" and m.probe_fit_error < 1e-3
    for kvs in ([700] * 12, [513, 3001, 77, 8193], [2049] * 16):
        w = Workload.of_case("decode", [1] * len(kvs), kvs)
        want = compose.pipeline_cycles(truth, compose.pipeline_steps(bs, 128, kvs))
        assert m.cycles(w) == pytest.approx(want, rel=0.01)


def test_decode_pricing_keeps_page_dmas_at_or_above_the_hbm_peak():
    """The profiler fetches a step's pages concurrently faster than HBM can deliver them:
    pricing charges a step's DMA at least its pages' bytes at the peak (``page_floor``),
    which changes a DMA-bound walk and leaves a compute-bound one alone; the fit itself is
    to the probes' cycles as the profiler gave them."""
    floor = compose.dma_page_floor("v5e", dataclasses.asdict(LLAMA), 128)
    from kernel.hardware import tpu_info
    from rpa_tune.estimator.calibration import calibration
    # a page of Llama-3-8B's merged K/V: 128 tokens x 8 KV heads x 128 x (K, V) x 2 bytes
    assert floor * tpu_info("v5e").mem_bw_bytes_per_second / calibration("v5e").clock_hz == pytest.approx(524288)
    bs = BlockSizes(1, 512, 1, 512)
    steps = compose.pipeline_steps(bs, 128, [2049] * 30)            # 30 sequences of four 4-page steps
    dma_fast = (100.0, 50.0, 300.0, 200.0, 300.0, 100.0, 0.5 * floor)  # the profiler's DMA: half the floor
    assert len(steps) == 120 and {s[0] for s in steps} == {4}
    per_step = lambda th, fl: (compose.pipeline_cycles(th, steps, fl) - compose.pipeline_cycles(th, steps[:60], fl)) / 60
    assert per_step(dma_fast, 0.0) == pytest.approx(100 + 2 * floor)           # > compute 300 + 200 (+ 50 / 4)
    assert per_step(dma_fast, floor) == pytest.approx(4 * floor, rel=0.02)     # 4 pages a step at the peak
    compute_bound = (100.0, 50.0, 9000.0, 3000.0, 300.0, 100.0, 2 * floor)
    assert per_step(compute_bound, floor) == pytest.approx(per_step(compute_bound, 0.0))
    plist = compose.probes("decode", bs, 128)
    cycles = [compose.pipeline_cycles(dma_fast, compose.pipeline_steps(bs, 128, p.kv_lens)) for p in plist]
    m = compose.fit("decode", bs, 128, plist, cycles, page_floor=floor)
    assert m.probe_fit_error < 1e-3 and m.page_floor == floor
    w = Workload.of_case("decode", [1] * 30, [2049] * 30)
    assert m.cycles(w) >= 120 * 4 * floor
    assert compose.model_from_json(m.to_json()) == m


def test_profiler_child_logs_stay_in_its_temporary_folder_and_a_full_disk_is_named(monkeypatch):
    """libtpu's logs (over 100 MB per bundle-dump compile) go to the child's temporary
    folder, removed with it; a child killed by a full disk is the machine's failure,
    marked so that no benchmark records it as the config's crash."""
    monkeypatch.setenv(profiler.WARM_ENV, "0")       # a child per compile (the warm ones: below)
    here = os.path.dirname(os.path.abspath(__file__))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    r = profiler.profile("tune_fakes:env_report_builder", {}, timeout=120)
    assert r["status"] == "ok" and "rpa_profile_" in r["tpu_log_dir"]
    assert not os.path.exists(r["tpu_log_dir"])
    r = profiler.profile("tune_fakes:disk_full_builder", {}, timeout=120)
    assert r["status"] == "crash" and r["environment"] == "disk_full"
    assert r["message"].startswith("the disk is full")


def test_a_cancelled_profiler_child_is_killed_at_once(monkeypatch):
    """A config's probe that is no longer needed (another one failed) is killed when its
    caller sets the cancel event, not left to finish its compile."""
    import threading
    import time as time_mod
    monkeypatch.setenv(profiler.WARM_ENV, "0")       # a child per compile (the warm ones: below)
    here = os.path.dirname(os.path.abspath(__file__))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    cancel = threading.Event()
    threading.Timer(1.0, cancel.set).start()
    t0 = time_mod.monotonic()
    r = profiler.profile("tune_fakes:sleeping_builder", {}, timeout=120, cancel=cancel)
    assert r["status"] == profiler.CANCELLED and time_mod.monotonic() - t0 < 20


def test_a_kernel_edited_during_a_run_is_not_recorded_under_the_old_hash(monkeypatch):
    """The profiler child imports the kernel afresh: when the source it saw is not the one
    the caller records under, the result is the environment's failure, not the config's."""
    from rpa_tune.provenance import KERNEL_HASH_ENV
    monkeypatch.setenv(profiler.WARM_ENV, "0")       # a child per compile (the warm ones: below)
    here = os.path.dirname(os.path.abspath(__file__))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv(KERNEL_HASH_ENV, "source-the-child-sees")
    r = profiler.profile("tune_fakes:no_kernel_builder", {}, timeout=120, expect_kernel_hash="source-at-start")
    assert r["status"] == "crash" and r["environment"] == "source_changed"
    assert "source-at-start" in r["message"] and "source-the-child-sees" in r["message"]
    r = profiler.profile("tune_fakes:no_kernel_builder", {}, timeout=120,
                         expect_kernel_hash="source-the-child-sees")
    assert r["kernel_hash"] == "source-the-child-sees" and "environment" not in r
    assert r["status"] == "crash" and "no estimate" in r["message"]     # no kernel, no profile


def test_step_plan_counts_the_chunks_the_kernel_computes():
    """Prefill skips the chunks with no visible key (v6e): the chunks kernel.steps plans are
    what the simulated trace computes, the same MXU instructions per planned chunk for a
    q block after 128 cached tokens (2 chunks: one of each step) and after 640 (3: the
    first cached step's two, then the last cached step's first, which also holds the new
    tokens: kernel.rpa._Steps)."""
    bs = BlockSizes(128, 512, 128, 256)
    per_chunk = set()
    for q, kv, chunks in ([128], [256], 2), ([128], [768], 3):
        tr = TraceStats.from_json(_profile("prefill", Workload.of_case("prefill", q, kv), bs)["trace"])
        assert features("prefill", bs, LIM.page_size, q, kv)["chunk"] == chunks
        every = features("prefill", bs, LIM.page_size, q, kv, skip_dead_chunks=False)   # TPU7x's kernel
        assert every["chunk"] == every["step"] * (bs.bkv // bs.ckv)
        per_chunk.add(tr.mxu_matmuls / chunks)
    assert len(per_chunk) == 1 and per_chunk.pop() > 0


def test_analysis_mode_loops_over_runs_of_like_sequences():
    """Analysis mode loops over each run of sequences with the same q and KV length (their
    metadata in closed form) and unrolls only where neighbours differ; the runs are taken
    from the metadata the kernel stores, over the case's sequence range only."""
    from kernel.analysis import static_meta_for
    from kernel.rpa import _like_runs
    w = Workload.of_case("mixed", [1, 1, 1, 4, 4, 128, 128], [700, 700, 900, 900, 900, 128, 256])
    meta = static_meta_for(w, ServingLimits(128, 512, 16, 4096))
    (lo, hi), kv, cu = meta[[c.value for c in Case].index("mixed")]
    assert (lo, hi) == w.case_range(Case.MIXED)
    runs = _like_runs(lo, hi, kv, cu)
    assert [(a, b) for a, b in runs] == [(0, 2), (2, 3), (3, 5), (5, 6), (6, 7)]
    # every run is one (q_len, kv_len) and neighbouring runs differ
    for a, b in runs:
        assert len({(w.q_lens[s], w.kv_lens[s]) for s in range(a, b)}) == 1
    for (a, _), (c, _) in zip(runs, runs[1:]):
        assert (w.q_lens[a], w.kv_lens[a]) != (w.q_lens[c], w.kv_lens[c])


def test_every_token_bucket_of_a_config_shares_its_probes(monkeypatch, tmp_path):
    """The probes are compiled at one bucket per config, whatever the key's: a second
    bucket of the same config reads the first one's probes from the cache."""
    seen = []

    def fake_profile(builder, req, **kw):
        seen.append(req["limits"]["max_num_tokens"])
        return {"status": "ok", "cycles": 1000 + sum(req["workload"]["kv_lens"]), "trace": {}, "max_rss_bytes": 1}

    _probe_with(monkeypatch, tmp_path, fake_profile)
    bs = BlockSizes(512, 1024, 128, 256)
    runs = []
    for t in (128, 8192):
        lim = ServingLimits(page_size=128, max_num_tokens=t, max_num_seqs=128, max_model_len=8192)
        runs.append(compose.probe_config(builder=compose.OURS_BUILDER, case="prefill", bs=bs, tpu="v6e",
                                         model=dataclasses.asdict(LLAMA), limits=dataclasses.asdict(lim)))
        if t == 128:
            first = list(seen)
    plist = compose.probes("prefill", bs, 128)
    assert len(first) == len(plist) == len(seen)        # the second bucket compiled nothing
    assert set(first) == {compose.probe_tokens(plist)} == {2048}
    assert runs[0]["model"] == runs[1]["model"]
    # a config whose largest probe holds more tokens than the default bucket gets a bigger one
    assert compose.probe_tokens([compose.Probe((1500, 1500), (1500, 1500))]) == 4096


@pytest.mark.parametrize("gen,case,bs,q,kv", [
    ("v5e", "decode", BlockSizes(1, 256, 1, 128), [1] * 4, [300] * 4),
    ("v6e", "prefill", BlockSizes(64, 256, 64, 128), [128], [384]),
])
def test_a_probe_costs_the_same_cycles_at_any_token_bucket(gen, case, bs, q, kv):
    """Why one probe bucket can price every key bucket: the bucket only sizes arrays the
    program leaves in HBM. The smallest bucket (128) and the largest (8192) compile to the
    same cycles."""
    model = ModelShape(8, 1, 128)
    w = Workload.of_case(Case.parse(case), q, kv)
    cycles = []
    for t in (128, 8192):
        lim = ServingLimits(page_size=128, max_num_tokens=t, max_num_seqs=128, max_model_len=8192)
        req = dict(_request(case, w, bs, gen, model), limits=dataclasses.asdict(lim))
        r = profiler.profile(compose.OURS_BUILDER, req, timeout=600)
        assert r["status"] == "ok", r.get("message")
        cycles.append(r["cycles"])
    assert cycles[0] == cycles[1] > 0


def test_a_soft_capped_program_computes_the_cap():
    """The compile backend's soft cap (Gemma-2's keys) reaches the profiled program: the
    tanh of every logit costs cycles a plain program does not spend. (It crashed the
    profiler on v6e until the kernel folded log2(e) into the cap: kernel/rpa.py.)"""
    from rpa_tune.evaluators.compile import _options
    from rpa_tune.evaluators.base import Task
    model = ModelShape(8, 1, 128)
    w = Workload.of_case(Case.PREFILL, [128], [384])
    bs = BlockSizes(64, 256, 64, 128)
    task = Task(backend="compile", generation="v6e", case="prefill", model=model, limits=LIM, workload=w, bs=bs,
                soft_cap=50.0)
    assert Task.from_json(task.to_json()).soft_cap == 50.0
    cycles = []
    for opts in ({}, {"soft_cap": _options(task, 64 << 20)["soft_cap"]}):
        r = profiler.profile(compose.OURS_BUILDER, dict(_request("prefill", w, bs, "v6e", model), options=opts), timeout=600)
        assert r["status"] == "ok", r.get("message")
        cycles.append(r["cycles"])
    assert cycles[1] > cycles[0]


def test_warm_profiler_children_give_a_new_childs_results_and_are_reused(monkeypatch):
    """A warm child (profiler._Warm) serves compile after compile: the same cycles and
    trace as a new child per compile, libtpu's logs and profiles gone after each request;
    another environment gets another child, and a child that crashed is not reused."""
    model = ModelShape(8, 1, 128)
    reqs = [_request("decode", Workload.of_case(Case.DECODE, [1] * n, [300] * n), BlockSizes(1, 256, 1, 128),
                     "v5e", model) for n in (4, 5)]
    monkeypatch.setenv(profiler.WARM_ENV, "0")
    cold = [profiler.profile(compose.OURS_BUILDER, r, timeout=600) for r in reqs]
    monkeypatch.setenv(profiler.WARM_ENV, "1")
    profiler._Warm.close_all()
    warm = [profiler.profile(compose.OURS_BUILDER, r, timeout=600) for r in reqs]
    for c, w in zip(cold, warm):
        assert w["status"] == c["status"] == "ok"
        assert (w["cycles"], w["trace"], w["kernels"]) == (c["cycles"], c["trace"], c["kernels"])
    children = [w for idle in profiler._Warm._idle.values() for w in idle]
    assert len(children) == 1 and children[0].served == 2          # one child served both
    child = children[0]
    assert os.listdir(child.profile_dir) == [] and "tpu_logs" not in os.listdir(child.dir)
    here = os.path.dirname(os.path.abspath(__file__))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    r = profiler.profile("tune_fakes:disk_full_builder", {}, timeout=120)    # a new environment
    assert r["status"] == "crash" and r["environment"] == "disk_full"
    children = [w for idle in profiler._Warm._idle.values() for w in idle]
    assert children == [child]                   # the crashed child is gone, the first one kept
    profiler._Warm.close_all()
    assert child.proc.poll() is not None and not os.path.exists(child.dir)


def _process_gone(pid: int) -> bool:
    """No such process, or only its zombie (an init that does not reap it keeps that)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _caller(code: str, **env) -> subprocess.Popen:
    """A process that calls the profiler (``code``) with the test fakes importable."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict({k: v for k, v in os.environ.items() if k != "TPU_LOG_DIR"},
               PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]), **env)
    return subprocess.Popen([sys.executable, "-c", "from rpa_tune.estimator import profiler; " + code],
                            env=env, cwd=os.path.dirname(here), stdout=subprocess.PIPE, text=True)


def _kill_and_expect_gone(caller: subprocess.Popen, child: int, folder: str) -> None:
    """SIGKILL the caller: within 20 s its child is gone and the child's folder removed."""
    assert os.path.isdir(folder) and not _process_gone(child)
    os.kill(caller.pid, signal.SIGKILL)
    caller.wait()
    deadline = time.monotonic() + 20
    while (os.path.exists(folder) or not _process_gone(child)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _process_gone(child), "the orphaned child is still running"
    assert not os.path.exists(folder)


@pytest.mark.parametrize("warm", ["1", "0"])
def test_a_profiler_child_whose_parent_is_killed_stops_and_removes_its_folder(tmp_path, warm):
    """A profiler child runs in its own session, out of reach of a group kill of its caller.
    When the caller dies by SIGKILL mid-compile, the child (warm or not) stops within
    seconds instead of compiling on, and its folder (profiles, libtpu logs) is removed."""
    pid_file = tmp_path / "child.json"
    caller = _caller("profiler.profile('tune_fakes:reporting_sleeper_builder', {}, timeout=600)",
                     RPA_TEST_PID_FILE=str(pid_file), **{profiler.WARM_ENV: warm})
    try:
        deadline = time.monotonic() + 120
        while not pid_file.exists():
            assert caller.poll() is None and time.monotonic() < deadline, "the child never started"
            time.sleep(0.2)
        child = json.loads(pid_file.read_text())
        _kill_and_expect_gone(caller, child["pid"], os.path.dirname(child["tpu_log_dir"]))
    finally:
        if caller.poll() is None:
            caller.kill()
        if pid_file.exists() and not _process_gone(pid := json.loads(pid_file.read_text())["pid"]):
            os.kill(pid, signal.SIGKILL)


def test_an_idle_warm_profiler_child_whose_parent_is_killed_removes_its_folder():
    """A warm child kept idle between compiles, whose caller dies by SIGKILL, exits and
    removes its folder (the caller's exit handler, which would, never runs)."""
    caller = _caller(
        "import json, time; profiler.profile('tune_fakes:compile_error_builder', {}, timeout=120); "
        "print(json.dumps([[w.proc.pid, w.dir] for ws in profiler._Warm._idle.values() for w in ws]), "
        "flush=True); time.sleep(120)", **{profiler.WARM_ENV: "1"})
    try:
        [[pid, folder]] = json.loads(caller.stdout.readline())
        _kill_and_expect_gone(caller, pid, folder)
    finally:
        if caller.poll() is None:
            caller.kill()


@pytest.mark.parametrize("page", [128, 256])
def test_every_decode_config_has_a_probe_ending_in_a_partial_chunk(page):
    """Nearly every served sequence ends in a partial chunk; a config whose probes never do
    leaves that cost to the fit (it priced v5e (1, 4096, 1, 256) at page 256 at 16x the
    other configs). Every decode candidate of the shipped spaces has such a probe, and one
    without."""
    from rpa_tune.space import load_space
    seen = 0
    for gen in ("v5e", "v6e", "tpu7x"):
        for bs in load_space(gen).for_case("decode").product():
            bs = BlockSizes(*bs)
            if bs.bkv % page or bs.ckv % page or bs.bkv % bs.ckv:
                continue
            flags = {st[3] for p in compose.probes("decode", bs, page)
                     for st in compose.pipeline_steps(bs, page, p.kv_lens)}
            assert flags == {True, False}, (gen, bs, page)
            seen += 1
    assert seen > 50


def test_at_most_a_few_warm_profiler_children_stay_idle(monkeypatch):
    """Every environment gets its own warm child; the least recently used idle ones are
    closed, so a long test session or sweep keeps at most WARM_MAX_IDLE of them."""
    here = os.path.dirname(os.path.abspath(__file__))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv(profiler.WARM_ENV, "1")
    profiler._Warm.close_all()
    made = []
    for i in range(profiler.WARM_MAX_IDLE + 2):
        monkeypatch.setenv("RPA_TEST_ENV_MARK", str(i))         # another environment each time
        r = profiler.profile("tune_fakes:compile_error_builder", {}, timeout=120)
        assert r["status"] == "compile_error", r
        made.extend(w for idle in profiler._Warm._idle.values() for w in idle if w not in made)
    idle = [w for xs in profiler._Warm._idle.values() for w in xs]
    assert len(made) == profiler.WARM_MAX_IDLE + 2 and len(idle) == profiler.WARM_MAX_IDLE
    assert idle == made[-profiler.WARM_MAX_IDLE:]
    assert all(w.proc.poll() is not None for w in made[:2])
    profiler._Warm.close_all()


@pytest.fixture
def fakes_importable(monkeypatch):
    """Profiler children that can import ``tune_fakes`` (its builders)."""
    here = os.path.dirname(os.path.abspath(__file__))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))


@pytest.mark.parametrize("gen", ["v5e", "v5p", "v6e", "tpu7x"])
def test_only_tpu7x_prices_an_hbm_to_hbm_dma(gen, fakes_importable):
    """``ours.NO_HBM_TO_HBM_PRICE`` is what libtpu does: a kernel that is one HBM -> HBM
    copy gets 0 estimated cycles there (the profiler reports no estimate) and a positive
    count on TPU7x."""
    from rpa_tune.estimator import ours
    r = profiler.profile("tune_fakes:hbm_to_hbm_copy_builder", {"tpu": gen}, timeout=600)
    if gen in ours.NO_HBM_TO_HBM_PRICE:
        assert r["status"] == "crash" and r["cycles"] == 0, r
    else:
        assert r["status"] == "ok" and r["cycles"] > 0, r


QWEN_TP4 = ModelShape(16, 2, 128)


def test_v5p_decode_of_two_kv_heads_is_estimable_with_the_new_kv_in_vmem():
    """Left to XLA, the new K/V operand of this program is in HBM on v5p, and the kernel
    gets no estimate (its cache update is an HBM -> HBM copy); placed in VMEM it is
    estimated and its page DMAs pass the audit."""
    bs, q, kv = BlockSizes(1, 2048, 1, 512), [1] * 4, [512, 513, 700, 900]
    w = Workload.of_case("decode", q, kv)
    req = _request("decode", w, bs, "v5p", QWEN_TP4)
    left = profiler.profile(compose.OURS_BUILDER, dict(req, place_new_kv=False), timeout=600)
    assert left["status"] == "crash" and left["cycles"] == 0
    r = _profile("decode", w, bs, "v5p", QWEN_TP4)
    tr = TraceStats.from_json(r["trace"])
    pages = features("decode", bs, LIM.page_size, q, kv)["page_cached"]
    # the page DMAs, and one per sequence for its q row when XLA leaves q in HBM
    assert pages > 0 and tr.dma_issues.get("hbm_to_vmem", 0) - pages in (0, len(q))
    from rpa_tune.estimator.calibration import calibration
    a = audit.audit_trace(tr, audit.needed(w, QWEN_TP4, "decode", sliding_window=None), calibration("v5p"))
    assert a.verdict == audit.COMPLETE, a.reasons


@pytest.mark.parametrize("case,model,bs,q,kv", [
    ("decode", ModelShape(8, 1, 128), BlockSizes(1, 2048, 1, 512), [1] * 4, [512, 513, 700, 900]),
    pytest.param("mixed", ModelShape(48, 1, 128), BlockSizes(32, 512, 4, 256), [1, 1, 64], [900, 300, 600],
                 marks=pytest.mark.slow),
    pytest.param("prefill", ModelShape(8, 1, 128), BlockSizes(128, 512, 128, 256), [256, 64], [300, 64],
                 marks=pytest.mark.slow),
])
def test_the_new_kv_placement_changes_no_v5p_program_of_one_kv_head(case, model, bs, q, kv):
    """XLA put the operand in VMEM in the v5p programs of one KV head, every v5p estimate
    recorded before the placement: the same cycles with it placed explicitly."""
    from rpa_tune.estimator import ours
    assert ours.PLACE_NEW_KV <= ours.NO_HBM_TO_HBM_PRICE and ours.places_new_kv("v5p", case, model)
    req = _request(case, Workload.of_case(case, q, kv), bs, "v5p", model)
    left = profiler.profile(compose.OURS_BUILDER, dict(req, place_new_kv=False), timeout=600)
    placed = profiler.profile(compose.OURS_BUILDER, req, timeout=600)
    assert left["status"] == placed["status"] == "ok"
    assert placed["cycles"] == left["cycles"] > 0


def test_which_estimates_place_the_new_kv_in_vmem():
    """Decode on v5p always; prefill / mixed on v5p for shapes of at most 2 KiB of K/V per
    token (every config of a key alike); never elsewhere."""
    from rpa_tune.estimator.ours import places_new_kv
    for case in ("decode", "prefill", "mixed"):
        assert not any(places_new_kv(g, case, QWEN_TP4) for g in ("v5e", "v6e", "tpu7x"))
        assert places_new_kv("v5p", case, QWEN_TP4) and places_new_kv("v5p", case, ModelShape(8, 1, 128))
        assert places_new_kv("v5p", case, LLAMA) == (case == "decode")
        assert places_new_kv("v5p", case, GEMMA_256) == (case == "decode")


def test_an_estimate_lowers_the_same_program_whatever_the_tables_and_overrides(monkeypatch):
    """The other two cases' block sizes pad the operands of the lowered case's program
    (kernel.api.prepare_inputs): from the tables or RPA_{D,P,M}_BLOCK_SIZES they would make
    a config's estimate depend on the process's tables (v5p: 3.9 % for one config,
    rpa_tune.estimator.ours). The estimate's builder takes the heuristic's."""
    from kernel import tables as kt
    from rpa_tune.estimator import ours
    bs = BlockSizes(64, 512, 64, 512)
    w = Workload.of_case("mixed", [1, 2, 128], [257, 130, 128])
    req = dict(_request("mixed", w, bs, "v5p"), options={"vmem_limit_bytes": 32 << 20})
    for var in ("RPA_D_BLOCK_SIZES", "RPA_P_BLOCK_SIZES", "RPA_M_BLOCK_SIZES"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RPA_TABLE", "none")
    kt.reset()
    try:
        plain = ours.lower(**req)[0].as_text()
        direct = lambda: ours.lower_for_estimate(w, bs, "v5p", LLAMA, LIM, "mixed",
                                                 vmem_limit_bytes=32 << 20).as_text()
        assert direct() == plain
        monkeypatch.setenv("RPA_P_BLOCK_SIZES", "512,2048,64,512")
        monkeypatch.setenv("RPA_D_BLOCK_SIZES", "8,2048,8,512")
        assert direct() != plain               # the padding follows the overrides ...
        assert ours.lower(**req)[0].as_text() == plain      # ... but not in an estimate
    finally:
        kt.reset()


@pytest.mark.parametrize("tpu", ["v5p", "tpu7x", "v6e"])
def test_every_probe_request_is_one_the_builder_takes(tpu, monkeypatch, tmp_path):
    """The cache key's extra fields (``other_cases`` on the generations whose programs the
    padding moved, ...) never reach the builder: each request binds to its signature."""
    import inspect
    from rpa_tune.estimator import ours
    monkeypatch.setenv(compose.CACHE_ENV, str(tmp_path))
    seen = []

    def fake(builder, request, **kw):
        seen.append(request)
        inspect.signature(ours.lower).bind(**request)          # raises on an unknown field
        return {"status": "compile_error", "message": "fake", "cycles": 0}
    monkeypatch.setattr(profiler, "profile", fake)
    for case, bs in (("decode", BlockSizes(1, 1024, 1, 512)), ("mixed", BlockSizes(64, 512, 64, 512))):
        r = compose.probe_config(builder=compose.OURS_BUILDER, case=case, bs=bs, tpu=tpu,
                                 model=dataclasses.asdict(LLAMA), limits=dataclasses.asdict(LIM),
                                 options={"vmem_limit_bytes": 32 << 20})
        assert r["status"] == "compile_error"
    assert len(seen) >= 2
