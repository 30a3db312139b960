"""The TPU evaluator's device path, exercised on CPU (no device): what it records and how
export reads it (issue #102, item 1)."""
import numpy as np
import pytest

from rpa_tune import export as ex
from rpa_tune.evaluators import tpu
from tables_synth import key, row


def _measured_row(k, bs, median_s, rel_iqr, n=200, seed=0):
    """The row the TPU evaluator writes for ``n`` device samples around ``median_s`` whose
    interquartile range is about ``rel_iqr`` of it (its own statistics, its own EvalResult)."""
    rng = np.random.default_rng(seed)
    # a normal's IQR is 1.349 sigma
    times = median_s * (1 + rng.standard_normal(n) * rel_iqr / 1.349)
    res = tpu.timed_result(tpu.summarize_times(times), how="device time (test)")
    assert res.method == "measured" and res.spread == pytest.approx(rel_iqr, rel=0.3)
    return row(k, bs, res.metric, method=res.method, spread=res.spread, samples=res.samples)


def _select(rows, k):
    import pandas as pd
    _, reports = ex.build_tables(ex.normalize_results(pd.DataFrame(rows)))
    (rep,) = [r for r in reports if r.key == k]
    return rep.entry


@pytest.mark.parametrize("gain, rel_spread, promoted", [(0.10, 0.01, True), (0.01, 0.02, False)])
def test_export_promotes_a_device_timed_win_by_its_relative_spread(gain, rel_spread, promoted):
    k = key()
    h = tuple(ex.heuristic_for(k))
    other = next(c for c in [(1, 2048, 1, 512), (1, 512, 1, 512)] if c != h) if k.case == "decode" else \
        next(c for c in [(128, 1024, 64, 512), (64, 512, 64, 256)] if c != h)
    base = 500e-6
    rows = [_measured_row(k, h, base, rel_spread, seed=1),
            _measured_row(k, other, base / (1 + gain), rel_spread, seed=2)]
    e = _select(rows, k)
    assert e.method == "measured" and tuple(e.block_sizes) == other
    assert e.promoted is promoted, e.decision
    # the margin is twice the larger relative spread (floor 1 %), not a ratio of ratios
    assert 0.01 <= e.margin <= 2 * rel_spread * 1.3 + 1e-9
    assert e.spread < 0.1            # a fraction of the metric


def test_estimate_rows_keep_no_spread():
    k = key()
    h = tuple(ex.heuristic_for(k))
    e = _select([row(k, h, 1e-4, spread=None, samples=None)], k)
    assert e.spread == 0.0 and e.samples == 1


# ------------------------------------------------------------------ 2. one timing method per key
def _counting_step():
    calls = []
    return calls, lambda: calls.append(1)


def _fake_timer(seconds):
    """A clock that advances by ``seconds`` at every second reading (one call each)."""
    t = {"now": 0.0, "n": 0}

    def timer():
        t["n"] += 1
        if t["n"] % 2 == 0:
            t["now"] += seconds
        return t["now"]
    return timer


@pytest.mark.parametrize("call_s", [50e-6, 5e-3])     # below and above the old 1 ms switch
def test_trace_timing_is_used_whatever_the_call_time(call_s):
    _, step = _counting_step()
    asked = []

    def trace(step_, n, prefix):
        asked.append((n, prefix))
        return [400e-6, 410e-6, 420e-6, 405e-6]
    stats, how = tpu.measure(step, tpu.TRACE, "rpa_decode_x", trace=trace, timer=_fake_timer(call_s))
    assert asked and asked[0][1] == "rpa_decode_x"
    assert stats.median == pytest.approx(407.5e-6) and stats.samples == 4
    assert how.startswith("timing trace")


@pytest.mark.parametrize("call_s", [50e-6, 5e-3])
def test_wallclock_timing_never_reads_a_trace(call_s):
    _, step = _counting_step()

    def trace(*a):
        raise AssertionError("wall-clock timing read a trace")
    stats, how = tpu.measure(step, tpu.WALLCLOCK, "p", trace=trace, timer=_fake_timer(call_s))
    assert stats.median == pytest.approx(call_s) and "wallclock" in how


def test_a_config_without_trace_events_is_not_timed_by_wall_clock():
    _, step = _counting_step()
    with pytest.raises(tpu.NoDeviceEvents, match="RPA_TUNE_TPU_TIMING=wallclock"):
        tpu.measure(step, tpu.TRACE, "p", trace=lambda *a: [], timer=_fake_timer(50e-6))


def test_timing_method_is_chosen_per_sweep(monkeypatch):
    monkeypatch.delenv(tpu.TIMING_ENV, raising=False)
    assert tpu.timing_method() == tpu.TRACE
    monkeypatch.setenv(tpu.TIMING_ENV, "wallclock")
    assert tpu.timing_method() == tpu.WALLCLOCK
    monkeypatch.setenv(tpu.TIMING_ENV, "sometimes")
    with pytest.raises(ValueError, match="valid values"):
        tpu.timing_method()


def test_the_timing_method_tags_the_evaluator_version(monkeypatch):
    """Rows timed by the two methods carry different evaluator versions, so a key's rows
    never mix them (``store.newest_evaluator`` keeps one version per key)."""
    import importlib
    import sys
    versions = {}
    try:
        for t in (tpu.TRACE, tpu.WALLCLOCK):
            monkeypatch.setenv(tpu.TIMING_ENV, t)
            versions[t] = importlib.reload(sys.modules["rpa_tune.evaluators.tpu"]).TpuEvaluator.version
    finally:
        monkeypatch.delenv(tpu.TIMING_ENV, raising=False)
        importlib.reload(sys.modules["rpa_tune.evaluators.tpu"])
    assert versions[tpu.TRACE] != versions[tpu.WALLCLOCK] and "wallclock" in versions[tpu.WALLCLOCK]


# ------------------------------------------------------------------ 3. padding from the heuristic
from kernel.config import BlockSizes, Case, kv_bytes_per_token  # noqa: E402
from kernel.workload import ModelShape, ServingLimits, Workload  # noqa: E402
from rpa_tune.evaluators.base import Task  # noqa: E402
from rpa_tune.kernels import get_kernel  # noqa: E402

MODEL = ModelShape(8, 2, 128)
LIMITS = ServingLimits(page_size=128, max_num_tokens=256, max_num_seqs=8, max_model_len=2048)
WORKLOADS = {"decode": Workload.of_case("decode", [1] * 4, [300, 700, 129, 1000]),
             "prefill": Workload.of_case("prefill", [64, 64], [64, 200]),
             "mixed": Workload.of_case("mixed", [1, 30, 90], [257, 130, 400])}
OWN = {"decode": BlockSizes(4, 512, 4, 256), "prefill": BlockSizes(64, 512, 32, 256),
       "mixed": BlockSizes(32, 256, 32, 128)}
ARG = {"decode": "d_block_sizes", "prefill": "p_block_sizes", "mixed": "m_block_sizes"}


def _task(case, kernel="rpa-tune", model=MODEL, sw=None, cap=None, gen="v6e"):
    return Task(backend="tpu", generation=gen, case=case, model=model, limits=LIMITS, workload=WORKLOADS[case],
                bs=OWN[case], kernel=kernel, sliding_window=sw, soft_cap=cap)


def _heuristic(case, model=MODEL, gen="v6e"):
    """The heuristic's sizes for the device call's shapes, from kernel.heuristics directly."""
    from kernel.heuristics import heuristic_block_sizes
    return tuple(heuristic_block_sizes(
        Case.parse(case), generation=gen, num_q_heads=model.num_q_heads, num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim, page_size=LIMITS.page_size,
        kv_bytes_per_token=kv_bytes_per_token(model.num_kv_heads, model.head_dim, model.kv_dtype),
        max_num_tokens=LIMITS.max_num_tokens, max_model_len=LIMITS.pages_per_seq * LIMITS.page_size,
        q_dtype=model.q_dtype, kv_dtype=model.kv_dtype))


@pytest.mark.parametrize("case", ["decode", "prefill", "mixed"])
def test_our_device_call_pads_the_other_cases_for_the_heuristic(case, monkeypatch):
    """With overrides set and the shipped tables loaded, the call's other two cases still
    take the heuristic's sizes (the kernel itself would resolve the overrides)."""
    from kernel import tables as kt
    from kernel.api import resolve_block_sizes
    from kernel.analysis import serving_dims
    env = {"decode": "8,1024,8,256", "prefill": "128,1024,64,512", "mixed": "64,512,64,256"}
    for c, v in env.items():
        monkeypatch.setenv(ARG[c][0].upper().join(["RPA_", "_BLOCK_SIZES"]), v)
    monkeypatch.delenv("RPA_TABLE", raising=False)
    monkeypatch.delenv("RPA_SHIPPED_TABLES", raising=False)
    kt.reset()
    try:
        dc, inp = tpu.device_arguments(_task(case), get_kernel("rpa-tune"), 128 << 20)
        for c in ("decode", "prefill", "mixed"):
            # the kernel, called without them, would take the override
            got, src = resolve_block_sizes(Case.parse(c), None, generation="v6e", dims=serving_dims(MODEL, LIMITS))
            assert src.startswith("env:") and tuple(got) == tuple(map(int, env[c].split(",")))
            want = tuple(OWN[c]) if c == case else _heuristic(c)
            assert dc.kwargs[ARG[c]] == want, c
    finally:
        kt.reset()
    assert dc.kwargs["sm_scale"] == pytest.approx(128 ** -0.5)
    assert dc.new_kv_dtype is None and inp["keys"].dtype == np.dtype(MODEL.q_dtype)


# ------------------------------------------------------------------ 4. the reference, fast and once
from kernel import reference as ref  # noqa: E402
from kernel.workload import make_inputs  # noqa: E402

FP8 = "float8_e4m3fn"


@pytest.mark.parametrize("model, opts, seed", [
    (ModelShape(8, 2, 128), {}, 0),
    (ModelShape(8, 2, 128), {"sliding_window": 100}, 1),
    (ModelShape(4, 4, 64), {"soft_cap": 30.0}, 2),
    (ModelShape(8, 2, 128, kv_dtype=FP8), {}, 3),
    (ModelShape(8, 2, 128, kv_dtype=FP8), {"k_scale": 0.5, "v_scale": 0.25, "q_scale": 0.5,
                                          "sliding_window": 64, "soft_cap": 20.0}, 4),
    (ModelShape(16, 2, 256), {"sliding_window": 300}, 5),
], ids=["plain", "window", "softcap-hd64", "fp8", "fp8-scales-window-cap", "hd256-group8"])
def test_the_vectorised_reference_matches_the_loop_reference(model, opts, seed):
    rng = np.random.default_rng(seed)
    n_dec, n_pre, n_mix = 3, 2, 2
    q_lens = [1] * n_dec + [int(x) for x in rng.integers(2, 40, n_pre)] + [int(x) for x in rng.integers(1, 50, n_mix)]
    kv_lens = [q + int(rng.integers(0, 400)) for q in q_lens]
    w = Workload(tuple(q_lens), tuple(kv_lens), (n_dec, n_dec + n_pre, len(q_lens)))
    inp = make_inputs(model, LIMITS, w, seed=seed)
    kw = dict(sm_scale=model.head_dim ** -0.5, **opts)
    out_l, cache_l = ref.ragged_paged_attention(**inp, **kw)
    out_f, cache_f = ref.ragged_paged_attention_fast(**inp, **kw)
    assert cache_f.dtype == cache_l.dtype and np.array_equal(cache_f.view(np.uint8), cache_l.view(np.uint8))
    n = sum(q_lens)
    np.testing.assert_allclose(out_f[:n].astype(np.float32), out_l[:n].astype(np.float32), rtol=1e-2, atol=1e-2)
    # bf16 rounding of f32 values equal up to summation order: almost every element is exact
    assert np.mean(out_f[:n] == out_l[:n]) > 0.98


def test_the_reference_is_computed_once_per_workload(monkeypatch):
    calls = []
    real = ref.ragged_paged_attention_fast

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)
    monkeypatch.setattr(ref, "ragged_paged_attention_fast", counted)
    monkeypatch.setattr(tpu, "_REFERENCE_CACHE", {})
    kern = get_kernel("rpa-tune")
    first = None
    for bs in (BlockSizes(4, 512, 4, 256), BlockSizes(8, 256, 8, 128), BlockSizes(2, 1024, 2, 512)):
        import dataclasses
        task = dataclasses.replace(_task("decode"), bs=bs)
        _, inp = tpu.device_arguments(task, kern, 128 << 20)
        out = tpu.reference_output(task, inp)
        first = first or out
        assert out[0] is first[0]
    assert len(calls) == 1
    other = dataclasses.replace(_task("decode"), seed=7)
    tpu.reference_output(other, tpu.device_arguments(other, kern, 128 << 20)[1])
    assert len(calls) == 2


# ------------------------------------------------------------------ 5. public kernel call parity
class _Captured(Exception):
    pass


def _estimator_call(task, monkeypatch):
    """The keyword arguments and operand dtypes the estimator's lowering of the public kernel
    (``rpa_tune.estimator.public.lower``, with the compile backend's options) calls it with:
    the jit it builds is intercepted before anything is compiled."""
    import dataclasses
    import jax
    from rpa_tune.estimator import public
    from rpa_tune.evaluators.compile import _options
    from rpa_tune.public_kernel import load_kernel_module
    load_kernel_module()           # imported (its own jit decorators run) before jit is intercepted
    seen = {}

    class FakeJit:
        def __init__(self, fn, **kw):
            seen["kwargs"] = dict(fn.keywords)

        def lower(self, *args):
            seen["dtypes"] = [str(a.dtype) for a in args]
            raise _Captured

    monkeypatch.setattr(jax, "jit", FakeJit)
    w = task.workload
    with pytest.raises(_Captured):
        public.lower(workload=dict(q_lens=list(w.q_lens), kv_lens=list(w.kv_lens), distribution=list(w.distribution)),
                     block_sizes=tuple(task.bs), tpu=task.generation, model=dataclasses.asdict(task.model),
                     limits=dataclasses.asdict(task.limits), case=task.case, options=_options(task, 16 << 20))
    return seen


# the estimator's deviceless-only choices (rpa_tune.estimator.public module doc)
ESTIMATOR_ONLY = {"update_kv_cache", "vmem_limit_bytes"}


@pytest.mark.parametrize("case, kv_dtype, sw, cap", [
    ("decode", "bfloat16", None, None), ("prefill", "bfloat16", None, None), ("mixed", "bfloat16", 128, 30.0),
    ("decode", FP8, None, None), ("prefill", FP8, 256, None), ("mixed", FP8, None, None),
])
def test_the_public_device_call_passes_what_the_estimator_lowers(case, kv_dtype, sw, cap, monkeypatch):
    model = ModelShape(8, 2, 128, kv_dtype=kv_dtype)
    task = _task(case, kernel="tpu-inference", model=model, sw=sw, cap=cap)
    if case != "decode":
        task = dataclasses_replace(task, bs=BlockSizes(64, 256, 32, 128))
    est = _estimator_call(task, monkeypatch)
    monkeypatch.undo()
    dc, inp = tpu.device_arguments(task, get_kernel("tpu-inference"), 128 << 20)
    assert {k: v for k, v in est["kwargs"].items() if k not in ESTIMATOR_ONLY} == dc.kwargs
    if case == "prefill":
        assert dc.kwargs["chunk_prefill_size"] == 64          # its prefill kernel runs only with it
    # q, new K, new V, cache: the dtypes the estimator lowers with are the device call's
    got = [str(inp[k].dtype) for k in ("queries", "keys", "values", "kv_cache")]
    assert got == est["dtypes"][:4] == ["bfloat16", kv_dtype, kv_dtype, kv_dtype]


def dataclasses_replace(obj, **kw):
    import dataclasses
    return dataclasses.replace(obj, **kw)


@pytest.mark.parametrize("case", ["decode", "prefill", "mixed"])
def test_our_device_call_passes_the_estimator_build_options(case):
    """Ours: the device call's block sizes are what the estimator's build
    (``kernel.api.build_options(..., heuristic_only=True)``) resolves for the call's shapes,
    and its attention options are the task's."""
    from kernel.analysis import serving_dims
    from kernel.api import build_options
    task = _task(case, sw=128, cap=20.0)
    dc, _ = tpu.device_arguments(task, get_kernel("rpa-tune"), 128 << 20)
    opts = build_options(serving_dims(MODEL, LIMITS), "v6e", {Case.parse(case): task.bs}, heuristic_only=True,
                         sm_scale=MODEL.head_dim ** -0.5, sliding_window=128, soft_cap=20.0)
    assert tuple(dc.kwargs[ARG[c]] for c in ("decode", "prefill", "mixed")) == tuple(map(tuple, opts.block_sizes))
    assert (dc.kwargs["sm_scale"], dc.kwargs["sliding_window"], dc.kwargs["soft_cap"]) == \
        (opts.sm_scale, opts.sliding_window, opts.soft_cap)
