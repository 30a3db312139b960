"""Evaluators: backend selection, timing statistics (fake timer, synthetic profile), the VMEM
limit policy and pre-filter against real deviceless compiles, interpret correctness."""

import numpy as np
import pytest

from kernel.config import GENERATIONS, BlockSizes, Case
from kernel.workload import ModelShape, ServingLimits, Workload
from rpa_tune import cli, prefilter
from rpa_tune.evaluators import base, tpu
from rpa_tune.evaluators.base import Task
from rpa_tune.evaluators.compile import CompileEvaluator
from rpa_tune.evaluators.interpret import CORRUPT_ENV, InterpretEvaluator

LLAMA = ModelShape(32, 8, 128)
MiB = 1 << 20


# ----------------------------------------------------------------- backend selection
@pytest.mark.parametrize("probe,gen,want", [
    ({"platform": "cpu", "device_kind": "cpu", "count": 0}, "v6e", "compile"),
    ({"platform": "tpu", "device_kind": "TPU v6 lite", "count": 4}, "v6e", "tpu"),
    ({"platform": "tpu", "device_kind": "TPU v5 lite", "count": 4}, "v6e", "compile"),
    ({"platform": "tpu", "device_kind": "TPU7x", "count": 4}, "tpu7x", "tpu"),
    ({"platform": "unknown", "device_kind": None, "count": 0}, "v5p", "compile"),
])
def test_auto_picks_tpu_only_for_the_requested_generation(monkeypatch, probe, gen, want):
    monkeypatch.setattr(tpu, "probe_devices", lambda timeout=180: probe)
    got, why = cli._resolve_backend("auto", gen)
    assert got == want and why.startswith("auto")


def test_tpu_backend_requires_that_tpu(monkeypatch):
    monkeypatch.setattr(tpu, "probe_devices", lambda timeout=180: {"platform": "tpu", "device_kind": "TPU v5 lite"})
    with pytest.raises(cli.UsageError, match="needs a TPU v6e here, found TPU v5e"):
        cli._resolve_backend("tpu", "v6e")
    assert cli._resolve_backend("tpu", "v5e")[0] == "tpu"
    assert cli._resolve_backend("compile", "v5e") == ("compile", "requested")


def test_no_tpu_on_this_machine_without_device_nodes():
    if tpu._accelerator_nodes():
        pytest.skip("this machine has accelerator device nodes")
    p = tpu.probe_devices()
    assert p["platform"] == "cpu" and not p["probed"] and tpu.tpu_generation_present(p) is None


# ------------------------------------------------------------------ timing statistics
def test_time_calls_with_a_fake_timer():
    clock = [0.0]
    durations = [9.0, 9.0] + [0.02] + [0.01 * (1 + i % 5) for i in range(200)]   # 2 warm-ups first
    calls = []

    def step():
        d = durations.pop(0)
        calls.append(d)
        clock[0] += d

    times = tpu.time_calls(step, warmup=2, timer=lambda: clock[0])
    assert calls[:2] == [9.0, 9.0], "warm-up calls run but are not timed"
    assert 9.0 not in times
    assert len(times) == tpu.iterations_for(0.02) == 50     # 1 s target / 20 ms first call
    assert times == pytest.approx(calls[2:])
    st = tpu.summarize_times(times)
    assert st.samples == 50 and st.median == pytest.approx(0.03)
    assert st.q25 == pytest.approx(0.02) and st.q75 == pytest.approx(0.04)
    assert st.spread == pytest.approx((0.04 - 0.02) / 0.03)


def test_iteration_bounds_and_bad_samples():
    assert tpu.iterations_for(10.0) == tpu.MIN_ITERS
    assert tpu.iterations_for(1e-7) == tpu.MAX_ITERS
    with pytest.raises(ValueError):
        tpu.summarize_times([])
    with pytest.raises(ValueError):
        tpu.summarize_times([1.0, float("nan")])


def test_device_times_from_a_profile_trace():
    from jax.profiler import ProfileData
    ev = lambda mid, off, dur: f"events {{ metadata_id: {mid} offset_ps: {off} duration_ps: {dur} }}"
    text = f"""
    planes {{ id: 1 name: "/device:TPU:1" lines {{ id: 1 name: "XLA Ops" {ev(1, 0, 99000000)} }}
              event_metadata {{ key: 1 value {{ id: 1 name: "rpa_decode_bq1_bkv512_cq1_ckv256" }} }} }}
    planes {{ id: 2 name: "/device:TPU:0"
      lines {{ id: 1 name: "XLA Modules" {ev(3, 0, 50000000)} }}
      lines {{ id: 2 name: "XLA Ops" {ev(1, 0, 5000000)} {ev(2, 6000000, 1000000)} {ev(1, 9000000, 7000000)} }}
      event_metadata {{ key: 1 value {{ id: 1 name: "rpa_decode_bq1_bkv512_cq1_ckv256.3" }} }}
      event_metadata {{ key: 2 value {{ id: 2 name: "copy.3" }} }}
      event_metadata {{ key: 3 value {{ id: 3 name: "jit_fn" }} }} }}
    planes {{ id: 3 name: "/host:CPU" }}
    """
    prof = ProfileData.from_text_proto(text)
    assert tpu.device_times_from_profile(prof, "rpa_decode_bq1_bkv512_cq1_ckv256") == pytest.approx([5e-6, 7e-6])
    assert tpu.device_times_from_profile(prof, "rpa_prefill") == []


def test_tpu_evaluator_refuses_to_time_without_a_tpu():
    t = Task("tpu", "v6e", "decode", ModelShape(4, 1, 128), ServingLimits(page_size=16, max_num_tokens=16,
             max_num_seqs=4, max_model_len=256), Workload.of_case("decode", [1], [10]), BlockSizes(1, 32, 1, 16))
    r = tpu.TpuEvaluator().evaluate(t)
    assert r.status == "compile_error" and "no TPU here" in r.message


# ------------------------------------------------------------------ VMEM policy
def test_vmem_limit_policy():
    assert base.initial_vmem_limit(4 * MiB, 128 * MiB) == 16 * MiB
    assert base.initial_vmem_limit(60 * MiB, 128 * MiB) == 64 * MiB       # the kernel's default: <= capacity / 2
    new = base.raised_vmem_limit(int(72.14 * MiB), 64 * MiB, 128 * MiB)
    assert new % MiB == 0 and 72.14 * MiB * 1.05 < new <= 78 * MiB
    assert base.raised_vmem_limit(130 * MiB, 64 * MiB, 128 * MiB) is None   # over the capacity: hopeless
    assert base.raised_vmem_limit(127 * MiB, 100 * MiB, 128 * MiB) == 128 * MiB
    assert base.raised_vmem_limit(10 * MiB, 16 * MiB, 128 * MiB) is None    # already enough


def test_vmem_retry_raises_after_a_scoped_oom_and_lowers_after_a_whole_program_one():
    scoped = dict(kind="scoped_limit", used_bytes=int(72.14 * MiB), limit_bytes=64 * MiB)
    assert base.next_vmem_limit(scoped, None, 128 * MiB, set()) == base.raised_vmem_limit(
        int(72.14 * MiB), 64 * MiB, 128 * MiB)
    whole = dict(kind="capacity", used_bytes=int(68.41 * MiB), limit_bytes=int(63.94 * MiB),
                 scoped_bytes=int(26.34 * MiB))
    assert base.next_vmem_limit(whole, 32 * MiB, int(63.94 * MiB), set()) == 27 * MiB
    assert base.next_vmem_limit(whole, 32 * MiB, int(63.94 * MiB), {27 * MiB}) is None    # tried: stop
    assert base.next_vmem_limit(whole, 27 * MiB, int(63.94 * MiB), set()) is None         # failed at it
    assert base.next_vmem_limit(dict(whole, scoped_bytes=0), None, 64 * MiB, set()) is None
    assert base.next_vmem_limit(dict(whole, scoped_bytes=None), None, 64 * MiB, set()) is None  # a plain compile


def test_scoped_allocations_are_summed_from_a_whole_program_oom_message():
    from rpa_tune.estimator.profiler import scoped_allocation_bytes
    block = ("\n  {n}. Size: {size}\n     Shape: bf16[2,8,128,9,2,256]\n     Tag: scratch operand\n"
             "     Allocation type: {kind}\n     ==========================\n")
    msg = ("Ran out of memory in memory space vmem. Used 68.41M of 63.94M vmem.\n\nProgram vmem requirement "
           "68.41M:\n  Largest program allocations in vmem:\n"
           + block.format(n=1, size="18.00M", kind="scoped") + block.format(n=2, size="8.25M", kind="scoped")
           + block.format(n=3, size="4.00M", kind="global") + block.format(n=4, size="16.0K", kind="scoped"))
    assert scoped_allocation_bytes(msg) == int(18 * MiB) + int(8.25 * MiB) + 16 * 1024
    assert scoped_allocation_bytes("Used 10M of 8M vmem") == 0


def test_a_whole_program_vmem_oom_under_the_profiler_fits_at_the_lowered_limit():
    """TPU7x, head_dim 256 decode at (1, 1024, 1, 1024): the kernel's default limit fits a
    plain compile, but under the static profiler the program passes the chip's VMEM; at
    the least limit its scoped allocations fit in, it profiles."""
    import dataclasses
    from rpa_tune.estimator import profiler, compose
    model = ModelShape(16, 8, 256)
    lim = ServingLimits(page_size=128, max_num_tokens=64, max_num_seqs=8, max_model_len=4096)
    w = Workload.of_case("decode", [1] * 4, [2048] * 4)
    req = dict(workload=dict(q_lens=list(w.q_lens), kv_lens=list(w.kv_lens), distribution=list(w.distribution)),
               block_sizes=[1, 1024, 1, 1024], tpu="tpu7x", model=dataclasses.asdict(model),
               limits=dataclasses.asdict(lim), case="decode")
    r = profiler.profile(compose.OURS_BUILDER, req, timeout=900, bundles=False, rss_cap=8 << 30)
    assert r["status"] == "vmem_oom" and r["vmem"]["kind"] == "capacity", r.get("message")
    cap = int(r["vmem"]["limit_bytes"])
    new = base.next_vmem_limit(r["vmem"], None, cap, set())
    assert new is not None and r["vmem"]["scoped_bytes"] <= new < cap // 2
    r2 = profiler.profile(compose.OURS_BUILDER, dict(req, options={"vmem_limit_bytes": new}), timeout=900, bundles=False,
                          rss_cap=8 << 30)
    assert r2["status"] == "ok" and r2["cycles"] > 0, r2.get("message")


def test_compile_evaluator_raises_the_limit_when_the_compiler_asks():
    """(1, 8192, 1, 2048) on v6e needs ~72 MiB of scoped VMEM: over the kernel's default
    limit (64 MiB), under the capacity. The compile backend retries with a raised limit."""
    lim = ServingLimits(page_size=128, max_num_tokens=512, max_num_seqs=16, max_model_len=8192)
    w = Workload.of_case("decode", [1] * 4, [3000] * 4)
    bs = BlockSizes(1, 8192, 1, 2048)
    t = Task("compile", "v6e", "decode", LLAMA, lim, w, bs, timeout=600,
             vmem_predicted_bytes=prefilter.predicted_bytes(LLAMA, lim, bs))
    r = CompileEvaluator(profile=False).evaluate(t)
    assert r.status == "ok", r.message
    assert 64 * MiB < r.vmem_limit_bytes <= 128 * MiB and "retried with" in r.message


def _borderline_reject(gen, case, model, limits):
    """The config of a wide space whose prediction is the smallest one still rejected."""
    if case == Case.DECODE:
        cands = [BlockSizes(1, 128 * k, 1, c) for k in range(1, 400) for c in (512, 1024, 2048) if (128 * k) % c == 0]
    else:
        cands = [BlockSizes(bq, bkv, bq // 2, ckv) for bq in (128, 256, 512) for bkv in (1024, 2048, 4096, 8192)
                 for ckv in (512, 1024) if bkv % ckv == 0]
    rejected = [(prefilter.predicted_bytes(model, limits, bs), bs) for bs in cands
                if prefilter.rejects(prefilter.predicted_bytes(model, limits, bs), gen)]
    return min(rejected)


@pytest.mark.parametrize("gen", sorted(GENERATIONS))
def test_prefilter_never_rejects_a_config_the_compiler_accepts(gen):
    """The pre-filter's borderline rejection (the smallest predicted size it rejects)
    does not compile even at the most permissive limit (the chip's VMEM capacity);
    a control config it accepts does compile."""
    lim = ServingLimits(page_size=128, max_num_tokens=512, max_num_seqs=8, max_model_len=8192)
    pred, bs = _borderline_reject(gen, Case.DECODE, LLAMA, lim)
    v = prefilter.compiler_verdict(LLAMA, lim, gen, "decode", bs)
    assert v["status"] == "vmem_oom", (bs, pred, v)
    control = prefilter.compiler_verdict(LLAMA, lim, gen, "decode", BlockSizes(1, 256, 1, 128))
    assert control["status"] == "ok", control


@pytest.mark.slow
@pytest.mark.parametrize("gen", sorted(GENERATIONS))
def test_prefilter_borderline_prefill_and_mixed(gen):
    lim = ServingLimits(page_size=128, max_num_tokens=1024, max_num_seqs=8, max_model_len=8192)
    model = ModelShape(16, 8, 256)
    for case in (Case.PREFILL, Case.MIXED):
        pred, bs = _borderline_reject(gen, case, model, lim)
        v = prefilter.compiler_verdict(model, lim, gen, case, bs)
        assert v["status"] == "vmem_oom", (case, bs, pred, v)


# ------------------------------------------------------------------ interpret
def _small_task(case="decode", bs=(1, 64, 1, 32)):
    return Task("interpret", "v6e", case, ModelShape(4, 1, 128), ServingLimits(page_size=16),
                Workload.of_case(case, [1], [1]), BlockSizes(*bs))


def test_interpret_evaluator_ok_and_wrong_result(monkeypatch):
    ev = InterpretEvaluator()
    ok = ev.evaluate(_small_task("prefill", (16, 64, 8, 32)))
    assert ok.status == "ok" and "matches the reference" in ok.message
    monkeypatch.setenv(CORRUPT_ENV, BlockSizes(1, 64, 1, 32).label())
    bad = ev.evaluate(_small_task())
    assert bad.status == "wrong_result" and "outputs off" in bad.message and bad.metric is None
    other = ev.evaluate(_small_task("decode", (1, 32, 1, 32)))
    assert other.status == "ok", "only the chosen config is corrupted"


def test_interpret_evaluator_runs_the_task_window_on_kernel_and_reference(monkeypatch):
    """A sliding-window task is checked with the window on both sides; the kernel run with
    the window against the full-attention reference differs (the window hides keys in this
    problem), so a window dropped on either side is a wrong_result."""
    import dataclasses
    import kernel
    ev = InterpretEvaluator()
    t = dataclasses.replace(_small_task("decode", (1, 64, 1, 32)), sliding_window=20)
    ok = ev.evaluate(t)
    assert ok.status == "ok" and "sliding window 20" in ok.message, ok.message
    full_reference = kernel.reference.ragged_paged_attention
    monkeypatch.setattr(kernel.reference, "ragged_paged_attention",
                        lambda *a, sliding_window=None, **k: full_reference(*a, **k))
    assert ev.evaluate(t).status == "wrong_result"


# ------------------------------------------------------------------ static estimate
def _estimate(case, workload, lim, bs):
    """The compile backend's verdict for one config on v6e (Llama-3-8B shape); must be ok."""
    t = Task("compile", "v6e", case, LLAMA, lim, workload, bs, timeout=1800,
             vmem_predicted_bytes=prefilter.predicted_bytes(LLAMA, lim, bs))
    r = CompileEvaluator().evaluate(t)
    assert r.status == "ok", r.message
    return r


def test_estimate_grows_with_context_and_sequences(tmp_path, monkeypatch):
    """The compile backend's metric follows the workload: 4x the context or 4x the
    sequences gives a clearly larger time. All three are priced from the same probe
    compiles of the config (composition, no sampling), and every row says whether its
    audit is complete and which clock converted its cycles."""
    monkeypatch.setenv("RPA_TUNE_PROBE_CACHE", str(tmp_path))
    lim = ServingLimits(page_size=128, max_num_tokens=512, max_num_seqs=64, max_model_len=8192)
    bs = BlockSizes(1, 1024, 1, 256)

    def metric(n, kv):
        return _estimate("decode", Workload.of_case("decode", [1] * n, [kv] * n), lim, bs)

    base_r, long_r, many_r = metric(6, 1024), metric(6, 4096), metric(24, 1024)
    assert long_r.cycles > 2 * base_r.cycles and many_r.cycles > 2 * base_r.cycles
    assert long_r.metric > 2 * base_r.metric and many_r.metric > 2 * base_r.metric
    for r in (base_r, long_r, many_r):
        assert r.active_bound in ("estimate", "memory", "compute")
        assert r.audit in ("complete", "incomplete") and r.clock_hz and r.clock_source
        assert "composed from" in r.message
    assert len(list(tmp_path.glob("*.json"))) == 1          # one probe set priced all three


@pytest.mark.slow
def test_causal_prefill_estimate_grows_faster_than_linearly(tmp_path, monkeypatch):
    """Twice the chunk length, about four times the causal work: the composed estimate
    grows clearly faster than 2x. (Slow: seven prefill probe compiles, about 5 min.)"""
    monkeypatch.setenv("RPA_TUNE_PROBE_CACHE", str(tmp_path))
    lim = ServingLimits(page_size=128, max_num_tokens=2048, max_num_seqs=8, max_model_len=8192)

    def cycles(n):
        return _estimate("prefill", Workload.of_case("prefill", [n], [n]), lim, BlockSizes(128, 512, 128, 256)).cycles

    assert cycles(2048) > 2.8 * cycles(1024)


def test_reference_mismatches_names_each_problem():
    """The check both the interpret and the tpu backends apply to a kernel call."""
    from rpa_tune.evaluators.interpret import reference_mismatches
    rng = np.random.default_rng(0)
    ref_out = rng.standard_normal((6, 4, 128)).astype(np.float32)
    ref_cache = rng.standard_normal((3, 16, 2, 2, 128)).astype(np.float32)
    assert reference_mismatches(ref_out.copy(), ref_cache.copy(), ref_out, ref_cache, 5, "bfloat16") == []
    off = ref_out.copy()
    off[5] += 1.0                      # past num_tokens: padding rows are not compared
    assert reference_mismatches(off, ref_cache, ref_out, ref_cache, 5, "bfloat16") == []
    off[2, 1, 3] += 1.0
    assert reference_mismatches(off, ref_cache, ref_out, ref_cache, 5, "bfloat16") == [
        "1 of 2560 outputs off (max abs err 1)"]
    nan = ref_out.copy()
    nan[0, 0, 0] = np.nan
    assert reference_mismatches(nan, ref_cache, ref_out, ref_cache, 5, "bfloat16") == ["non-finite outputs"]
    flipped = ref_cache.copy()
    flipped.view(np.uint32)[1, 2, 0, 1, 7] ^= 1     # one bit of one slot
    assert reference_mismatches(ref_out, flipped, ref_out, ref_cache, 5, "bfloat16") == [
        "KV cache differs from the reference update"]
    # fp8 caches get the looser tolerance
    near = ref_out + 0.025 * (1 + np.abs(ref_out))
    assert reference_mismatches(near, ref_cache, ref_out, ref_cache, 5, "float8_e4m3fn") == []
    assert reference_mismatches(near, ref_cache, ref_out, ref_cache, 5, "bfloat16") != []


def test_registry_knows_every_backend_and_base_knows_none():
    """The registry lives where the subclasses are known (rpa_tune.evaluators); base.py
    defines the interface only."""
    import inspect
    import rpa_tune.evaluators as ev
    from rpa_tune.evaluators import base
    for b in ev.BACKENDS:
        cls = ev.evaluator_class(b)
        assert issubclass(cls, ev.Evaluator) and cls.name == b
        assert ev.evaluator_version(b) == f"{b}-{cls.version}"
        for case in ("decode", "prefill", "mixed"):     # a case's own version, else the evaluator's
            assert ev.evaluator_version(b, case) == f"{b}-{cls.case_versions.get(case, cls.version)}"
            for gen in ("v5e", "v5p", "v6e", "tpu7x"):      # then the generation's own, if any
                own = cls.generation_versions.get(gen)
                tag = getattr(cls, "version_tag", None)
                extra = tag(case, gen) if tag else ""
                assert ev.evaluator_version(b, case, gen) == ev.evaluator_version(b, case) + (
                    f"+{gen}{own}" if own else "") + extra
    with pytest.raises(ValueError, match="unknown backend 'gpu'; valid: compile, interpret, tpu"):
        ev.evaluator_class("gpu")
    src = inspect.getsource(base)
    assert "CompileEvaluator" not in src and "InterpretEvaluator" not in src and "TpuEvaluator" not in src


def test_compile_evaluator_estimates_with_the_task_window():
    """The estimate of a sliding-window task lowers the kernel with the window (and the
    composition prices the window's steps): the options carry it; a full-attention task's
    options do not."""
    import dataclasses
    from rpa_tune.evaluators.compile import _options
    t = _small_task()
    assert _options(t, 16 << 20) == {"vmem_limit_bytes": 16 << 20}
    assert _options(dataclasses.replace(t, sliding_window=64), 16 << 20) == {
        "vmem_limit_bytes": 16 << 20, "sliding_window": 64}


def test_after_a_profiler_crash_the_plain_compile_takes_the_vmem_retries(monkeypatch):
    """The profiler died: the plain compile decides, retried at the limit a scoped-limit OOM
    asks for, and the row says the config fits without the profiler (no compile here: the
    plain compile is faked)."""
    lim = ServingLimits(page_size=128, max_num_tokens=512, max_num_seqs=16, max_model_len=8192)
    t = Task("compile", "v6e", "decode", LLAMA, lim, Workload.of_case("decode", [1], [100]), BlockSizes(1, 512, 1, 256),
             timeout=60)
    ev = CompileEvaluator()
    limits = []

    def plain(task, limit, remaining):
        limits.append(limit)
        if len(limits) == 1:
            return {"status": base.VMEM_OOM, "vmem": {"kind": "scoped_limit", "used_bytes": 40 * MiB,
                                                    "limit_bytes": 32 * MiB}}
        return {"status": "ok", "lower_s": 0.1, "compile_s": 0.2}

    monkeypatch.setattr(ev, "_plain_compile", plain)
    import time as _time
    r = ev._after_profiler_crash(t, 32 * MiB, _time.monotonic() + 60, {"returncode": -6, "message": "abort"}, [],
                                 {"device_kind": "deviceless TPU v6 lite"})
    assert limits == [32 * MiB, base.raised_vmem_limit(40 * MiB, 32 * MiB, 128 * MiB)]
    assert r.status == "crash" and r.vmem_limit_bytes == limits[-1]
    assert "retried with" in r.message and "compiles without the profiler" in r.message


def test_after_a_profiler_crash_the_plain_compile_takes_the_smallest_probe_not_the_bucket(monkeypatch):
    """The VMEM verdict after a profiler crash compiles the config's smallest probe (one q
    block of bq tokens, no cached context) instead of the token bucket's 8 x 1024-token
    prefill, under limits that admit it; a decode batch smaller than any decode probe is
    compiled as it is. (The plain compile is faked: it records what it was given.)"""
    lim = ServingLimits(page_size=128, max_num_tokens=8192, max_num_seqs=128, max_model_len=8192)
    bucket = Workload.of_case("prefill", [1024] * 8, [1024 + 512 * i for i in range(8)])
    t = Task("compile", "v5e", "prefill", LLAMA, lim, bucket, BlockSizes(256, 1024, 32, 256), timeout=60)
    ev = CompileEvaluator()
    seen = []

    def plain(task, limit, remaining):
        seen.append(task)
        return {"status": "ok", "lower_s": 0.1, "compile_s": 0.2}

    monkeypatch.setattr(ev, "_plain_compile", plain)
    import time as _time
    r = ev._after_profiler_crash(t, 32 * MiB, _time.monotonic() + 60, {"returncode": -9, "message": "cap"}, [],
                                 {"device_kind": "deviceless TPU v5 lite"})
    (small,) = seen
    assert (small.workload.q_lens, small.workload.kv_lens) == ((256,), (256,))
    assert small.workload.case_range("prefill") == (0, 1)
    assert small.bs == t.bs and small.model == t.model and small.limits.page_size == 128
    assert r.status == "crash" and "smallest probe, 1 sequence, 256 queries, 256 KV tokens" in r.message
    # decode: a 1-sequence batch is smaller than the decode probes (4 x bq sequences)
    seen.clear()
    d = Task("compile", "v6e", "decode", LLAMA, lim, Workload.of_case("decode", [1], [100]), BlockSizes(1, 512, 1, 256),
             timeout=60)
    ev._after_profiler_crash(d, 32 * MiB, _time.monotonic() + 60, {"returncode": -6, "message": "abort"}, [],
                             {"device_kind": "deviceless TPU v6 lite"})
    assert seen == [d]


def test_a_sliding_window_estimate_is_audited_against_the_window_s_bytes(monkeypatch):
    """A window task's rate check bounds it by the keys its queries see: 8 decode sequences
    of 2,000 tokens with a 64-token window read 64 keys each, not 2,000, fetched as the one
    128-token page that holds them (``audit.walk_bytes``: the kernel fetches whole pages). An
    estimate 1.05x that bound passes the audit (it is 15x faster than reading the whole
    contexts, which the bound once asked for, so the audit refused every window config
    that beat the full-context bound; Gemma-2's window keys on v5p)."""
    import dataclasses
    from kernel.hardware import tpu_info
    from rpa_tune.estimator import compose
    from rpa_tune.estimator.calibration import calibration
    lim = ServingLimits(page_size=128, max_num_tokens=512, max_num_seqs=16, max_model_len=8192)
    w = Workload.of_case("decode", [1] * 8, [2000] * 8)
    t = dataclasses.replace(Task("compile", "v6e", "decode", LLAMA, lim, w, BlockSizes(1, 128, 1, 128),
                                 timeout=60), sliding_window=64)
    token = 2 * LLAMA.num_kv_heads * LLAMA.head_dim * 2                   # merged K/V of a token, bf16
    qo = 2 * LLAMA.num_q_heads * LLAMA.head_dim * 2                        # its query read, output written
    # per sequence: the window's 64 keys read (63 cached, the new one from its input), the new
    # one written to the cache, its query read and output written
    window_bytes = 8 * ((64 + 1) * token + qo)
    # the 63 cached keys (positions 1936-1998) lie in one page, 1920-2047, fetched whole
    bound_s = (window_bytes + 8 * (128 - 63) * token) / tpu_info("v6e").mem_bw_bytes_per_second
    cycles = 1.05 * bound_s * calibration("v6e").clock_hz
    monkeypatch.setattr(compose, "probe_config", lambda **kw: {
        "status": "ok", "model": None, "probes": [{}], "audit": "complete", "reasons": [], "max_rss_bytes": 1 << 30})
    monkeypatch.setattr(compose, "model_from_json", lambda m: type("M", (), {"cycles": lambda self, w: cycles})())
    r = CompileEvaluator().evaluate(t)
    assert r.status == "ok" and r.audit == "complete", r.message
    assert r.memory_bound_s == pytest.approx(bound_s, rel=1e-9)
    assert r.estimate_s == pytest.approx(1.05 * bound_s, rel=1e-6)


@pytest.mark.parametrize("plain_fits", [True, False])
def test_a_profiler_only_vmem_oom_is_profiled_again_with_the_vmem_size_override(monkeypatch, plain_fits):
    """The profiled probes run out of the chip's VMEM (the profiler's HLO temp) at every
    limit tried: the plain compile decides. It fits: the probes are profiled again with
    libtpu's VMEM size override at the first limit, and the row is an estimate saying so.
    It does not: the row is the VMEM OOM (no compile here: both compiles are faked)."""
    from rpa_tune.estimator import compose
    lim = ServingLimits(page_size=128, max_num_tokens=512, max_num_seqs=16, max_model_len=8192)
    t = Task("compile", "v6e", "decode", LLAMA, lim, Workload.of_case("decode", [1], [100]), BlockSizes(1, 512, 1, 256),
             timeout=60)
    calls = []

    def fake_probe_config(**kw):
        calls.append((kw["options"]["vmem_limit_bytes"], kw.get("extra_libtpu_args", "")))
        if "override_vmem_size_kib" in kw.get("extra_libtpu_args", ""):
            return {"status": "ok", "model": None, "probes": [{}], "audit": "complete", "reasons": [],
                    "max_rss_bytes": 1 << 30}
        return {"status": base.VMEM_OOM, "vmem": {"kind": "capacity", "used_bytes": 150 * MiB,
                                                 "limit_bytes": 128 * MiB}}

    monkeypatch.setattr(compose, "probe_config", fake_probe_config)
    monkeypatch.setattr(compose, "model_from_json", lambda m: type("M", (), {"cycles": lambda self, w: 1.0e6})())
    ev = CompileEvaluator()
    monkeypatch.setattr(ev, "_plain_compile", lambda task, limit, remaining: {
        "status": "ok" if plain_fits else base.VMEM_OOM, "vmem": {"kind": "scoped_limit"}})
    r = ev.evaluate(t)
    first = calls[0][0]
    if plain_fits:
        assert r.status == "ok" and r.vmem_limit_bytes == first and r.metric > 0
        assert calls[-1] == (first, f"--xla_tpu_override_vmem_size_kib={2 * 128 * 1024}")
        assert "VMEM size override" in r.message
        assert not any(a for _, a in calls[:-1])
    else:
        assert r.status == "vmem_oom" and r.vmem_reported_bytes == 150 * MiB
        assert not any(a for _, a in calls)


@pytest.mark.slow
def test_hbm_bound_decode_estimate_passes_the_rate_audit(tmp_path, monkeypatch):
    """Llama-3-8B decode on v5e at (1, 512, 1, 512), 64 sequences of ~2.6K context: the
    probes' fit fetched its pages at 1.8x the HBM peak and the composed estimate came out
    at 1.11x the peak, which the audit refused. Pricing each step's page DMAs at no less
    than the peak (``compose.dma_page_floor``) makes it an audited estimate at or above the
    memory bound, and leaves a compute-bound config's price where the probes put it."""
    monkeypatch.setenv("RPA_TUNE_PROBE_CACHE", str(tmp_path))
    from rpa_tune.workloads import make_workload
    lim = ServingLimits(page_size=128, max_num_tokens=8192, max_num_seqs=128, max_model_len=8192)
    w, _ = make_workload(Case.DECODE, lim, seed=0, path=None, num_seqs=64, context="lognormal:2048:0.8",
                         chunk=None, num_chunks=None)
    ev = CompileEvaluator()
    r = ev.evaluate(Task("compile", "v5e", "decode", LLAMA, lim, w, BlockSizes(1, 512, 1, 512), timeout=1800))
    assert r.status == "ok" and r.audit == "complete", r.message
    assert r.memory_bound_s <= r.estimate_s <= 1.15 * r.memory_bound_s
