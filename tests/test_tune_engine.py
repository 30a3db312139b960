"""The sweep engine with real worker processes and a fake evaluator (tests/tune_fakes.py):
crashes, hangs and errors are recorded without stopping the sweep; resume after a real
``kill -9`` of a real ``rpa-tune sweep`` process re-evaluates nothing that finished."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kernel.config import BlockSizes, TuningKey
from kernel.workload import ServingLimits
from rpa_tune.engine import SweepSpec, plan_sweep, run_sweep
from rpa_tune.presets import get_preset
from rpa_tune.space import load_space
from rpa_tune.store import ResultStore
from rpa_tune.workloads import make_workload
from tune_fakes import fake_metric

TESTS = str(Path(__file__).resolve().parent)
RPA_TUNE = str(Path(sys.executable).with_name("rpa-tune"))
LIM = ServingLimits(page_size=128, max_num_tokens=2048, max_num_seqs=128, max_model_len=8192)
MODEL = get_preset("llama3-8b").model()


@pytest.fixture
def fake(monkeypatch, tmp_path):
    monkeypatch.setenv("RPA_TUNE_EVALUATOR_OVERRIDE", "tune_fakes:make_evaluator")
    monkeypatch.setenv("PYTHONPATH", TESTS + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("RPA_TUNE_KERNEL_HASH", "pinned-for-tests")   # other people may edit kernel/ meanwhile
    log = tmp_path / "evaluated.log"
    monkeypatch.setenv("RPA_TUNE_FAKE_LOG", str(log))
    monkeypatch.delenv("RPA_TUNE_FAKE_BEHAVIOUR", raising=False)
    monkeypatch.delenv("RPA_TUNE_FAKE_DELAY", raising=False)
    return log


def spec(case="decode", **kw):
    w, desc = make_workload(case, LIM)
    key = TuningKey("v6e", case, MODEL.q_dtype, MODEL.kv_dtype, MODEL.num_q_heads, MODEL.num_kv_heads,
                    MODEL.head_dim, LIM.page_size, LIM.max_num_tokens, LIM.max_model_len)
    args = dict(backend="compile", search="grid", budget=100, jobs=2, timeout=30)
    args.update(kw)
    return SweepSpec(key=key, model=MODEL, limits=LIM, workload=w, workload_desc=desc,
                     case_space=load_space("v6e").for_case(case), **args)


def evaluated(log: Path) -> list[str]:
    return log.read_text().split() if log.exists() else []


def test_crash_hang_error_oom_are_recorded_and_the_sweep_goes_on(fake, monkeypatch, tmp_path):
    monkeypatch.setenv("RPA_TUNE_FAKE_BEHAVIOUR", "bq1_bkv256_cq1_ckv128=crash;bq1_bkv512_cq1_ckv128=hang;"
                       "bq1_bkv2048_cq1_ckv256=raise;bq1_bkv4096_cq1_ckv512=oom;bq1_bkv128_cq1_ckv128=exit")
    store = ResultStore(tmp_path / "res")
    s = spec(timeout=3)
    t0 = time.monotonic()
    o = run_sweep(s, store)
    assert time.monotonic() - t0 < 90
    df = store.read()
    n = len(plan_sweep(s).candidates)
    assert n == 29 and len(df) == n and o.evaluated == n
    by = {(r.bkv, r.ckv): r for r in df.itertuples() if r.bq == 1}      # (the fakes name bq 1 configs)
    assert by[(256, 128)].status == "crash" and "signal 6" in by[(256, 128)].message
    assert by[(128, 128)].status == "crash" and "exit code 3" in by[(128, 128)].message
    assert by[(512, 128)].status == "timeout" and "--timeout 3" in by[(512, 128)].message
    assert by[(2048, 256)].status == "compile_error" and "fake evaluator failure" in by[(2048, 256)].message
    assert by[(4096, 512)].status == "vmem_oom" and by[(4096, 512)].vmem_reported_bytes == 123 << 20
    assert o.counts == {"ok": 24, "vmem_oom": 1, "compile_error": 1, "timeout": 1, "wrong_result": 0, "crash": 2}
    assert (o.best["bkv"], o.best["ckv"]) == (1024, 256)
    assert df[df.status != "ok"].metric.isna().all(), "failed configs carry no metric"
    # provenance on every row
    for col in ("jax_version", "jaxlib_version", "libtpu_version", "git_sha", "timestamp", "device_kind"):
        assert df[col].notna().all() or col == "device_kind", col
    assert (df.kernel_hash == "pinned-for-tests").all()
    # no worker survives the sweep
    time.sleep(0.5)
    assert not _workers_of(os.getpid())


def test_resume_skips_everything_recorded_and_retry_reruns_a_status(fake, monkeypatch, tmp_path):
    monkeypatch.setenv("RPA_TUNE_FAKE_BEHAVIOUR", "bq1_bkv512_cq1_ckv128=oom")
    store = ResultStore(tmp_path / "res")
    first = run_sweep(spec(), store)
    assert first.evaluated == 29 and first.resumed == 0
    again = run_sweep(spec(), store)
    assert again.evaluated == 0 and again.resumed == 29
    assert (again.best["bkv"], again.best["ckv"]) == (first.best["bkv"], first.best["ckv"])
    assert len(evaluated(fake)) == 29
    monkeypatch.delenv("RPA_TUNE_FAKE_BEHAVIOUR")
    retried = run_sweep(spec(retry=("vmem_oom",)), store)
    assert retried.evaluated == 1 and evaluated(fake)[-1] == "bq1_bkv512_cq1_ckv128"
    assert store.recorded()[retried.best["config_id"]]["status"] == "ok"


def test_budget_and_tpe_resume(fake, tmp_path):
    store = ResultStore(tmp_path / "res")
    a = run_sweep(spec("prefill", search="tpe", budget=8, jobs=1, patience=0), store)
    assert a.evaluated == 8
    b = run_sweep(spec("prefill", search="tpe", budget=12, jobs=1, patience=0), store)
    assert b.resumed == 8 and b.evaluated == 4, "a larger budget continues the same TPE sequence"
    c = run_sweep(spec("prefill", search="tpe", budget=12, jobs=1, patience=0), ResultStore(tmp_path / "fresh"))
    assert evaluated(fake)[-12:] == evaluated(fake)[:12], "same seed, same order"
    assert c.best["metric"] == b.best["metric"]


def _workers_of(parent_pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
            env = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"rpa_tune.worker" in cmd and f"RPA_TUNE_PARENT_PID={parent_pid}".encode() in env:
            out.append(int(d.name))
    return out


def _log_folder_of(worker: int) -> Path:
    """The folder of the workers' logs, which the engine removes when it exits."""
    key = b"RPA_TUNE_WORKER_LOG_DIR="
    env = Path(f"/proc/{worker}/environ").read_bytes().split(b"\0")
    return Path(next(e[len(key):] for e in env if e.startswith(key)).decode())


def _workers_still_running(workers: list[int], timeout: float) -> list[int]:
    """Wait up to ``timeout`` s for the worker processes to be gone; those still alive."""
    def alive():
        out = []
        for w in workers:
            try:
                if b"rpa_tune.worker" in Path(f"/proc/{w}/cmdline").read_bytes():
                    out.append(w)
            except OSError:     # gone
                pass
        return out
    deadline = time.monotonic() + timeout
    left = alive()
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = alive()
    return left


def test_kill_9_of_a_real_sweep_then_resume(fake, tmp_path):
    """Start `rpa-tune sweep`, SIGKILL it mid-sweep, rerun: nothing finished is lost or redone."""
    res = tmp_path / "res"
    env = dict(os.environ, RPA_TUNE_FAKE_DELAY="0.7")
    cmd = [RPA_TUNE, "sweep", "--tpu", "v6e", "--case", "decode", "--backend", "compile", "--search", "grid",
           "--jobs", "2", "--budget", "100", "--results", str(res)]
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(list(res.glob("*.parquet"))) < 5:
        time.sleep(0.05)
    assert len(list(res.glob("*.parquet"))) >= 5, "the sweep did not get going"
    workers = _workers_of(p.pid)
    assert workers, "the sweep runs its evaluations in worker processes"
    logs = _log_folder_of(workers[0])
    assert logs.is_dir()
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=30)
    before = ResultStore(res).read()
    done_before = set(before.config_id)
    assert 5 <= len(before) < 29
    assert not _workers_still_running(workers, 30), "workers die with the killed sweep"
    assert not logs.exists(), "the dead sweep's worker logs are left in the temp folder"
    n_eval_before = len(evaluated(fake))
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    after = ResultStore(res).read()
    assert len(after) == 29 and after.config_id.is_unique, "every config exactly once"
    assert done_before <= set(after.config_id), "nothing recorded before the kill was lost"
    redone = evaluated(fake)[n_eval_before:]
    assert len(redone) == 29 - len(done_before), "finished configs were not evaluated again"
    assert f"{len(done_before)} already recorded" in r.stdout
    best = after[after.status == "ok"].sort_values("metric").iloc[0]
    assert (best.bkv, best.ckv) == (1024, 256)
    assert fake_metric(BlockSizes(1, 1024, 1, 256)) == pytest.approx(best.metric)


def test_workers_busy_in_native_code_die_with_a_killed_sweep(fake, tmp_path):
    """A worker stuck in a call that keeps Python's SIGTERM handler from running (a long
    in-process compile) still ends, with its process group, once the sweep is killed."""
    env = dict(os.environ, RPA_TUNE_FAKE_BEHAVIOUR="*=block")
    cmd = [RPA_TUNE, "sweep", "--tpu", "v6e", "--case", "decode", "--backend", "compile", "--search", "grid",
           "--jobs", "2", "--results", str(tmp_path / "res")]
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not fake.exists() or len(evaluated(fake)) < 2):
        time.sleep(0.05)
    assert len(evaluated(fake)) >= 2, "both workers should be evaluating"
    workers = _workers_of(p.pid)
    assert len(workers) == 2
    logs = _log_folder_of(workers[0])
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=30)
    assert not _workers_still_running(workers, 10), "blocked workers outlived the killed sweep"
    assert not logs.exists()


@pytest.mark.parametrize("kv_dtype, bytes_per_value", [("float32", 4), ("bfloat16", 2), ("float8_e4m3fn", 1)])
def test_kv_bytes_per_token_one_definition(kv_dtype, bytes_per_value):
    """K and V of every KV head, head_dim padded to 128 lanes: 2 * heads * 128 values of the
    dtype's size (8 heads: the packing never pads). The kernel's resolution, the search
    spaces and the heuristic all use this one definition."""
    import ml_dtypes  # noqa: F401  (registers float8 with NumPy)
    from kernel.api import kv_bytes_per_token as api_kv_bytes
    from kernel.config import kv_bytes_per_token
    from kernel.workload import ModelShape, ServingLimits
    from rpa_tune.space import context
    want = 2 * 8 * 128 * bytes_per_value
    assert kv_bytes_per_token(8, 96, kv_dtype) == want
    assert api_kv_bytes(dict(num_kv_heads=8, head_dim=96, kv_dtype=kv_dtype)) == want
    ctx = context(ModelShape(16, 8, 96, "bfloat16", kv_dtype), ServingLimits(), "v6e")
    assert ctx["kv_bytes_per_token"] == want


def test_sweep_key_is_the_key_a_kernel_call_looks_up(monkeypatch):
    """One TuningKey builder: a sweep records its rows under the key the kernel looks up
    (max_model_len as whole pages), and its baseline is what export compares against."""
    from kernel import tables
    from kernel.api import resolve_block_sizes
    from kernel.config import Case
    from kernel.workload import ModelShape, ServingLimits
    from rpa_tune.engine import problem_key
    from rpa_tune.export import heuristic_for
    limits = ServingLimits(page_size=128, max_num_tokens=512, max_model_len=8000)
    k = problem_key("V6E", Case.PREFILL, ModelShape(32, 8, 128), limits)
    assert (k.generation, k.case, k.max_model_len, k.max_num_tokens) == ("v6e", "prefill", 63 * 128, 512)
    assert problem_key("v6e", "decode", ModelShape(32, 8, 128), limits, sliding_window=True).sliding_window
    dims = dict(max_num_tokens=512, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=128, pages_per_seq=63,
                q_dtype="bfloat16", kv_dtype="bfloat16")
    monkeypatch.setenv("RPA_TABLE", "none")
    monkeypatch.delenv("RPA_P_BLOCK_SIZES", raising=False)
    tables.reset()
    try:
        assert resolve_block_sizes(Case.PREFILL, None, generation="v6e", dims=dims) == (heuristic_for(k), "heuristic")
    finally:
        tables.reset()


def test_a_sweep_records_its_cases_evaluator_version(monkeypatch):
    """Rows (and config ids) carry the evaluator version of the key's case: a version for
    one case alone (``Evaluator.case_versions``) changes that case's config ids, so only its
    keys are re-priced, and leaves the other cases' ids as they were."""
    from rpa_tune.engine import sweep_context
    from rpa_tune.evaluators import evaluator_class
    monkeypatch.delenv("RPA_TUNE_EVALUATOR_OVERRIDE", raising=False)
    cls = evaluator_class("compile")
    bs = BlockSizes(16, 512, 16, 256)
    cases = ("decode", "prefill", "mixed")
    monkeypatch.setattr(cls, "case_versions", {})
    before = {case: sweep_context(spec(case)) for case in cases}
    monkeypatch.setattr(cls, "case_versions", {"mixed": "test-9"})
    after = {case: sweep_context(spec(case)) for case in cases}
    assert after["mixed"].ev_version == "compile-test-9" and after["decode"].ev_version == f"compile-{cls.version}"
    for case in cases:
        same = after[case].config_id(bs) == before[case].config_id(bs)
        assert same == (case != "mixed"), case
    # a generation's own version: its keys' ids change, every case's; another generation's stay
    monkeypatch.setattr(cls, "generation_versions", {"v6e": "9"})
    gen = {case: sweep_context(spec(case)) for case in cases}
    assert gen["decode"].ev_version == f"compile-{cls.version}+v6e9"
    assert gen["mixed"].ev_version == "compile-test-9+v6e9"
    assert all(gen[c].config_id(bs) != after[c].config_id(bs) for c in cases)
    monkeypatch.setattr(cls, "generation_versions", {"v5p": "9"})
    assert all(sweep_context(spec(c)).config_id(bs) == after[c].config_id(bs) for c in cases)


def test_a_crashed_heuristic_is_evaluated_again_on_resume(fake, monkeypatch, tmp_path):
    """Every key needs its heuristic's estimate (its baseline): a heuristic whose evaluation
    crashed (e.g. the profiler's memory cap, since raised for the heuristic) is evaluated
    again when the sweep resumes; nothing else recorded is."""
    s = spec()
    heur = plan_sweep(s).heuristic
    monkeypatch.setenv("RPA_TUNE_FAKE_BEHAVIOUR", f"{heur.label()}=crash")
    store = ResultStore(tmp_path / "res")
    first = run_sweep(s, store)
    assert first.evaluated == 29
    assert [r["status"] for r in store.recorded().values() if r.get("is_heuristic")] == ["crash"]
    monkeypatch.delenv("RPA_TUNE_FAKE_BEHAVIOUR")
    n = len(evaluated(fake))
    again = run_sweep(spec(), store)
    assert again.evaluated == 1 and again.resumed == 28 and evaluated(fake)[n:] == [heur.label()]
    rows = [r for r in ResultStore(tmp_path / "res").read_current().to_dict("records") if r.get("is_heuristic")]
    assert sorted(r["status"] for r in rows) in (["crash", "ok"], ["ok"])
    third = run_sweep(spec(), store)
    assert third.evaluated == 0 and third.resumed == 29


def test_seeds_rank_each_batch_of_another_bucket_apart():
    """``--seeds N`` takes the N best configs of each other bucket per batch priced there.
    A bucket priced on two batches (the plan's sweep step before and after it changed), or
    by two versions of one evaluator, has metrics that do not compare: ranked together, the
    smaller batch's configs took every place and the best config on the current batch was
    never a seed; so did the cheaper version's."""
    import types
    from rpa_tune.engine import sibling_configs
    s = spec("mixed", seeds=2)
    ctx = types.SimpleNamespace(kernel=types.SimpleNamespace(name="ours"), prov={"kernel_hash": "h"})
    base = dict(s.key.as_dict(), backend="compile", kernel="ours", kernel_hash="h", status="ok")
    old = [BlockSizes(16, 512, 16, 512), BlockSizes(32, 512, 32, 512), BlockSizes(16, 1024, 16, 1024)]
    new = [BlockSizes(64, 1024, 64, 1024), BlockSizes(128, 1024, 64, 512), BlockSizes(32, 512, 32, 512)]
    base["evaluator_version"] = 1
    rows = [dict(base, max_num_tokens=4096, workload_id="old", metric=1e-4 * (1 + i), **b._asdict())
            for i, b in enumerate(old)]
    rows += [dict(base, max_num_tokens=4096, workload_id="new", metric=3e-4 * (1 + i), **b._asdict())
             for i, b in enumerate(new)]
    # the batch's best under a later evaluator version, which prices every config higher
    later = BlockSizes(128, 512, 128, 512)
    rows += [dict(rows[-3], evaluator_version=2, metric=1e-3, **later._asdict()),
             dict(rows[-3], evaluator_version=2, metric=2e-3)]
    rows.append(dict(rows[0], max_num_tokens=s.key.max_num_tokens, metric=1e-6))   # this bucket: no seed
    rows.append(dict(rows[0], kernel_hash="other", bq=8, metric=1e-6))              # another kernel source
    seeds = sibling_configs(s, ctx, {str(i): r for i, r in enumerate(rows)})
    assert set(seeds) == set(old[:2]) | set(new[:2]) | {later}
    assert seeds[:2] == old[:2]                                   # best metric first, as before


def test_the_loop_waits_for_a_config_another_worker_holds_and_stops_at_a_spent_budget(fake, tmp_path):
    """The one loop with a scheduler that is not this process alone (``schedulers``): a config
    granted PENDING is evaluated elsewhere, asked about again until its row comes, and told
    to the search, never evaluated here; a config granted OVER (the shared budget spent)
    ends the proposals; each row evaluated here is recorded with the scheduler before the
    store, and the grant's token comes back with it."""
    from rpa_tune.schedulers import DONE, OVER, PENDING, RUN, Grant, LocalScheduler
    s = spec(budget=8, jobs=1)
    plan = plan_sweep(s)                      # grid: the heuristic, then the candidates in order
    order = [plan.heuristic] + [c for c in plan.candidates if c != plan.heuristic]
    elsewhere, over = order[2], order[5]

    class Shared(LocalScheduler):
        shared, poll_s = True, 0.05

        def __init__(self):
            self.asks, self.recorded = [], []

        def acquire(self, bs, cid, prev, redo, phase):
            self.asks.append(bs)
            if bs == elsewhere:
                done = self.asks.count(bs) >= 3
                return Grant(DONE, row=dict(self.recorded[0], config_id="other", metric=1e-9, bq=bs.bq, bkv=bs.bkv,
                                            cq=bs.cq, ckv=bs.ckv, is_heuristic=False)) if done else Grant(PENDING)
            if bs == over:
                return Grant(OVER)
            return Grant(RUN, token=bs.label())

        def record(self, token, row):
            assert token == BlockSizes(row["bq"], row["bkv"], row["cq"], row["ckv"]).label()
            assert row["config_id"] not in ResultStore(tmp_path / "res").recorded(), "the scheduler first"
            self.recorded.append(row)
    sched = Shared()
    o = run_sweep(s, ResultStore(tmp_path / "res"), scheduler=sched)
    here = [b.label() for b in order[:5] if b != elsewhere]
    assert evaluated(fake) == here, "evaluated here: what was granted RUN, up to the spent budget"
    assert sched.asks.count(elsewhere) == 3 and sched.asks.count(over) == 1 and order[6] not in sched.asks
    assert o.evaluated == 4 and o.resumed == 1 and o.best["config_id"] == "other"
    assert "budget of 8 evaluations reached" in o.stop_reason
    assert [r["config_id"] for r in sched.recorded] == list(ResultStore(tmp_path / "res").read().sort_values(
        "timestamp").config_id)
