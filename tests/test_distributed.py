"""Many workers on one sweep (``rpa-tune sweep --storage URL``) with real ``rpa-tune``
processes and the fake evaluator (tests/tune_fakes.py), on SQLite, an Optuna journal file
and a real PostgreSQL server started for these tests (tests/pg_server.py)."""
import collections
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from kernel.config import TuningKey
from kernel.workload import ServingLimits
from pg_server import create_database, find_pg_bin, postgres_server
from rpa_tune.engine import SweepSpec, plan_sweep
from rpa_tune.presets import get_preset
from rpa_tune.space import load_space
from rpa_tune.store import ResultStore
from rpa_tune.workloads import make_workload
from cli_checks import assert_one_error_line

TESTS = str(Path(__file__).resolve().parent)
RPA_TUNE = str(Path(sys.executable).with_name("rpa-tune"))
LIM = ServingLimits(page_size=128, max_num_tokens=2048, max_num_seqs=128, max_model_len=8192)
MODEL = get_preset("llama3-8b").model()
SWEEP = ["sweep", "--tpu", "v6e", "--backend", "compile", "--heartbeat", "1", "--grace", "3"]
HEURISTIC = "bq1_bkv1024_cq1_ckv512"        # the decode key's heuristic: the first config planned


def make_spec(case="decode", **kw) -> SweepSpec:
    w, desc = make_workload(case, LIM)
    key = TuningKey("v6e", case, MODEL.q_dtype, MODEL.kv_dtype, MODEL.num_q_heads, MODEL.num_kv_heads,
                    MODEL.head_dim, LIM.page_size, LIM.max_num_tokens, LIM.max_model_len)
    args = dict(backend="compile", search="grid", budget=1000)
    args.update(kw)
    return SweepSpec(key=key, model=MODEL, limits=LIM, workload=w, workload_desc=desc,
                     case_space=load_space("v6e").for_case(case), **args)


def planned_labels(case="decode") -> set[str]:
    return {bs.label() for bs in plan_sweep(make_spec(case)).candidates}


@pytest.fixture(scope="module")
def pg():
    if find_pg_bin() is None:
        pytest.skip("PostgreSQL binaries (initdb, postgres) not installed: scripts/setup.sh installs postgresql")
    with postgres_server() as url:
        yield url


def storage_url(kind: str, tmp_path: Path, request) -> str:
    if kind == "sqlite":
        return f"sqlite:///{tmp_path / 'study.db'}"
    if kind == "journal":
        return str(tmp_path / "study.journal")
    base = request.getfixturevalue("pg")
    return create_database(base, "t" + uuid.uuid4().hex[:10])


def env_for(tmp_path: Path, name: str, **extra) -> dict:
    e = dict(os.environ)
    e.update({"RPA_TUNE_EVALUATOR_OVERRIDE": "tune_fakes:make_evaluator", "RPA_TUNE_KERNEL_HASH": "dist-test",
              "PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", ""), "COLUMNS": "250",
              "RPA_TUNE_FAKE_LOG": str(tmp_path / f"{name}.log")})
    e.pop("RPA_TUNE_FAKE_BEHAVIOUR", None)
    e.pop("RPA_TUNE_FAKE_DELAY", None)
    e.update(extra)
    return e


def _default_sigint():
    # a test runner started in the background (`cmd &`) ignores SIGINT, and so would the
    # worker: Python installs its KeyboardInterrupt handler only when SIGINT is not ignored
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start(args, env, name, tmp_path):
    out = open(tmp_path / f"{name}.out", "w")
    err = open(tmp_path / f"{name}.err", "w")
    return subprocess.Popen([RPA_TUNE, *args], env=env, stdout=out, stderr=err, preexec_fn=_default_sigint)


def finish(p, name, tmp_path, timeout=180):
    rc = p.wait(timeout=timeout)
    return rc, (tmp_path / f"{name}.out").read_text(), (tmp_path / f"{name}.err").read_text()


def run(args, env, timeout=180):
    return subprocess.run([RPA_TUNE, *args], capture_output=True, text=True, env=env, timeout=timeout)


def logged(tmp_path: Path, name: str) -> list[str]:
    f = tmp_path / f"{name}.log"
    return f.read_text().split() if f.exists() else []


def store_rows(path: Path):
    return ResultStore(path).read() if path.exists() else ResultStore(path).read()


def label(r) -> str:
    return f"bq{r.bq}_bkv{r.bkv}_cq{r.cq}_ckv{r.ckv}"


# sqlite under slow (the suite's time): an RDB storage like postgres, which runs by default
@pytest.mark.parametrize("kind", ["postgres", pytest.param("sqlite", marks=pytest.mark.slow), "journal"])
def test_two_workers_share_one_sweep(kind, tmp_path, request):
    """Two identical commands on one storage: every planned config evaluated exactly once
    (counted in the evaluator, not only in rows); the rows of both workers' results stores
    are the space; the storage holds the same rows; status and export read them."""
    url = storage_url(kind, tmp_path, request)
    args = SWEEP + ["--case", "decode", "--budget", "100", "--search", "grid", "--jobs", "1", "--storage", url]
    ps = [start(args + ["--results", str(tmp_path / f"res{i}")], env_for(tmp_path, f"w{i}", RPA_TUNE_FAKE_DELAY="0.3"),
                f"w{i}", tmp_path) for i in (1, 2)]
    for i, p in enumerate(ps, 1):
        rc, out, err = finish(p, f"w{i}", tmp_path)
        assert rc == 0, err[-3000:]
        assert "29 of 29 configs done by 2 worker(s)" in out, out[-2000:]
    evaluated = logged(tmp_path, "w1") + logged(tmp_path, "w2")
    want = planned_labels()
    assert len(want) == 29
    assert sorted(evaluated) == sorted(want), "every config evaluated exactly once across the workers"
    a, b = store_rows(tmp_path / "res1"), store_rows(tmp_path / "res2")
    assert len(a) and len(b), "both workers took part"
    assert not set(a.config_id) & set(b.config_id)
    assert {label(r) for r in a.itertuples()} | {label(r) for r in b.itertuples()} == want

    from rpa_tune.distributed import rows_from_storage
    from rpa_tune.export import build_tables, read_results
    stored = rows_from_storage(url)
    assert sorted(r["config_id"] for r in stored) == sorted(set(a.config_id) | set(b.config_id))
    mixed = read_results([url, str(tmp_path / "res1"), str(tmp_path / "res2")])
    assert len(mixed) == 29 and mixed.config_id.is_unique, "a row in a store and in the storage is kept once"
    from_dirs = build_tables(read_results([tmp_path / "res1", tmp_path / "res2"]))[0]
    from_url = build_tables(read_results([url]))[0]
    assert from_url["v6e"].entries == from_dirs["v6e"].entries
    assert tuple(from_url["v6e"].entries[0].block_sizes) == (1, 1024, 1, 256)

    env = env_for(tmp_path, "status")
    st = run(["status", "--storage", url, "--json"], env)
    assert st.returncode == 0, st.stderr
    (s,) = json.loads(st.stdout)
    assert (s["done"], s["total"], s["running"], s["left"], s["given_back"]) == (29, 29, 0, 0, 0)
    assert s["best"]["block_sizes"] == [1, 1024, 1, 256] and len(s["workers"]) == 2
    if kind == "postgres":     # the commands themselves
        table = run(["status", "--storage", url], env)
        assert table.returncode == 0 and "29/29" in table.stdout and "(1, 1024, 1, 256)" in table.stdout
        out = tmp_path / "tables"
        ex = run(["export", "--results", url, "--results", str(tmp_path / "res1"), "--out", str(out)], env)
        assert ex.returncode == 0, ex.stderr
        doc = json.loads((out / "v6e.json").read_text())
        assert [e["block_sizes"] for e in doc["entries"]] == [dict(bq=1, bkv=1024, cq=1, ckv=256)]
        # a rerun of the same command evaluates nothing (idempotent)
        again = run(args + ["--results", str(tmp_path / "res1")], env_for(tmp_path, "w3"))
        assert again.returncode == 0, again.stderr
        assert "0 evaluated" in again.stdout and not logged(tmp_path, "w3")


# journal and sqlite under slow (the suite's time): each storage's heartbeats and claims run
# by default in the two-worker and dead-before-heartbeat tests
@pytest.mark.parametrize("kind", ["postgres", pytest.param("journal", marks=pytest.mark.slow),
                                  pytest.param("sqlite", marks=pytest.mark.slow)])
def test_kill_9_worker_its_config_is_redone_once(kind, tmp_path, request):
    """SIGKILL a worker in the middle of an evaluation: after the grace period the other
    worker gets the config back and evaluates it once; nothing the killed worker finished
    is lost or evaluated again."""
    url = storage_url(kind, tmp_path, request)
    args = SWEEP + ["--case", "decode", "--budget", "100", "--search", "grid", "--storage", url]
    a = start(args + ["--jobs", "2", "--results", str(tmp_path / "resA")],
              env_for(tmp_path, "A", RPA_TUNE_FAKE_DELAY="0.3", RPA_TUNE_FAKE_BEHAVIOUR=f"{HEURISTIC}=hang"),
              "A", tmp_path)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(list((tmp_path / "resA").glob("*.parquet"))) < 3:
        time.sleep(0.05)
    assert HEURISTIC in logged(tmp_path, "A"), "A is stuck on the heuristic config"
    b = start(args + ["--jobs", "1", "--results", str(tmp_path / "resB")],
              env_for(tmp_path, "B", RPA_TUNE_FAKE_DELAY="0.3"), "B", tmp_path)
    while time.monotonic() < deadline and not logged(tmp_path, "B"):
        time.sleep(0.05)
    os.kill(a.pid, signal.SIGKILL)
    a.wait(timeout=30)
    rc, out, err = finish(b, "B", tmp_path)
    assert rc == 0, err[-3000:]
    rows_a, rows_b = store_rows(tmp_path / "resA"), store_rows(tmp_path / "resB")
    assert len(rows_a) >= 3
    from rpa_tune.distributed import rows_from_storage
    stored = rows_from_storage(url)
    # what A finished: its rows in its store, and in the study (A writes there first, so a
    # kill between the two writes leaves one only in the study)
    done_a = {label(r) for r in rows_a.itertuples()} | {
        f"bq{r['bq']}_bkv{r['bkv']}_cq{r['cq']}_ckv{r['ckv']}" for r in stored if r["sweep_id"] in set(rows_a.sweep_id)}
    in_flight = set(logged(tmp_path, "A")) - done_a          # A was evaluating these when killed
    assert HEURISTIC in in_flight
    count_b = collections.Counter(logged(tmp_path, "B"))
    assert all(n == 1 for n in count_b.values()), "B evaluated nothing twice"
    assert not done_a & set(count_b), "nothing A finished was evaluated again"
    assert in_flight <= set(count_b), "every config A was evaluating was redone (once) by B"
    assert done_a | {label(r) for r in rows_b.itertuples()} == planned_labels()
    assert not set(rows_a.config_id) & set(rows_b.config_id)
    assert {r["config_id"] for r in stored} >= set(rows_a.config_id), "nothing A finished is lost"
    st = run(["status", "--storage", url, "--json"], env_for(tmp_path, "status"))
    (s,) = json.loads(st.stdout)
    assert (s["done"], s["running"], s["left"]) == (29, 0, 0)
    # A held up to --jobs 2 claims: those it was evaluating, and maybe one claimed but not yet started
    assert len(in_flight) <= s["given_back"] <= 2
    assert len({r["config_id"] for r in stored}) == len(stored) == 29


def test_a_worker_with_another_kernel_hash_or_space_refuses_to_join(tmp_path):
    url = f"sqlite:///{tmp_path / 'study.db'}"
    args = SWEEP + ["--case", "decode", "--budget", "100", "--search", "grid", "--jobs", "2", "--storage", url]
    first = run(args + ["--results", str(tmp_path / "res")], env_for(tmp_path, "first"))
    assert first.returncode == 0, first.stderr
    r = run(args + ["--results", str(tmp_path / "other")], env_for(tmp_path, "x", RPA_TUNE_KERNEL_HASH="edited"))
    lines = [l for l in r.stderr.splitlines() if l.startswith("rpa-tune: ")]
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
    assert "kernel version (kernel hash) 'dist-test' (this worker: 'edited')" in lines[0]
    assert "refusing to join" in lines[0] and "Traceback" not in r.stderr
    space = tmp_path / "small.toml"
    text = (Path(TESTS).parent / "search_spaces" / "v6e.toml").read_text()
    space.write_text(text.replace("bkv = [128, 256, 512, 1024, 2048, 4096, 8192, 16384]", "bkv = [512, 1024]", 1))
    r = run(args + ["--space", str(space), "--results", str(tmp_path / "other")], env_for(tmp_path, "y"))
    assert r.returncode == 2 and "search space (planned candidates)" in r.stderr and "refusing" in r.stderr
    assert not (tmp_path / "other").exists() and not logged(tmp_path, "x") and not logged(tmp_path, "y")


def test_tpe_with_a_budget_two_workers_never_evaluate_a_config_twice(tmp_path):
    """TPE below the space size: the workers ask one shared TPE study; the budget holds for
    the study and no config is evaluated twice."""
    url = str(tmp_path / "tpe.journal")
    args = SWEEP + ["--case", "prefill", "--search", "tpe", "--budget", "8", "--patience", "0", "--jobs", "1",
                    "--storage", url]
    ps = [start(args + ["--results", str(tmp_path / f"r{i}")], env_for(tmp_path, f"t{i}", RPA_TUNE_FAKE_DELAY="0.2"),
                f"t{i}", tmp_path) for i in (1, 2)]
    for i, p in enumerate(ps, 1):
        rc, out, err = finish(p, f"t{i}", tmp_path)
        assert rc == 0, err[-3000:]
    evaluated = logged(tmp_path, "t1") + logged(tmp_path, "t2")
    assert len(evaluated) == len(set(evaluated)) == 8, evaluated
    assert set(evaluated) <= planned_labels("prefill") and len(planned_labels("prefill")) > 8


@pytest.mark.parametrize("args,needles", [
    (["sweep", "--tpu", "v6e", "--storage", "ftp://host/x"], ["'ftp://host/x' is not a supported storage"]),
    (["sweep", "--tpu", "v6e", "--storage", "sqlite:////no/such/dir/s.db"], ["'/no/such/dir' does not exist"]),
    (["sweep", "--tpu", "v6e", "--backend", "compile", "--storage", "postgresql://rpa:secret@127.0.0.1:1/x"],
     ["cannot open --storage 'postgresql://rpa:***@127.0.0.1:1/x'", "Connection refused"]),
    (["status", "--storage", "mysql://h/x"], ["'mysql://h/x' is not a supported storage"]),
    (["export", "--results", "postgresql://rpa@127.0.0.1:1/x", "--out", "T"], ["cannot open", "Connection refused"]),
    (["status", "--storage", "sqlite:///{tmp}/none.db"], ["none.db' (no sweep has used it)"]),
    (["sweep", "--tpu", "v6e", "--backend", "compile", "--storage", "sqlite:///{tmp}/none.db", "--retry", "crash"],
     ["--retry cannot be combined with --storage"]),
    (["export", "--results", "{tmp}/none.journal", "--out", "T"], ["none.journal' (no sweep has used it)"]),
])
def test_bad_storage_exits_2_with_one_line(tmp_path, args, needles):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    r = run([*args, *(["--results", str(tmp_path / "res")] if args[0] == "sweep" else [])], env_for(tmp_path, "bad"))
    assert_one_error_line(r, needles)
    assert "secret" not in r.stderr and not (tmp_path / "res").exists()
    assert not list(tmp_path.glob("none.*")), "reading a storage creates nothing"


def test_status_help():
    r = run(["status", "--help"], dict(os.environ, COLUMNS="200"))
    assert r.returncode == 0 and "--storage" in r.stdout and "--json" in r.stdout
    r = run(["sweep", "--help"], dict(os.environ, COLUMNS="200"))
    for o in ("--storage", "--heartbeat", "--grace"):
        assert o in r.stdout


def test_missing_postgres_driver_is_one_line(tmp_path):
    fake = tmp_path / "nodriver" / "psycopg2"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('no psycopg2 here')\n")
    env = env_for(tmp_path, "nodriver")
    env["PYTHONPATH"] = str(fake.parent) + os.pathsep + env["PYTHONPATH"]
    r = run(["status", "--storage", "postgresql://rpa@127.0.0.1:5432/x"], env)
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "needs the PostgreSQL driver psycopg2: pip install 'rpa-tune[distributed]'" in r.stderr


def test_a_config_enqueued_twice_is_claimed_once(tmp_path, monkeypatch):
    """A joining worker that found the plan unfinished (its creator died before marking it)
    enqueues it again: each config is still handed out once, the copy is skipped."""
    from rpa_tune.distributed import Session, open_storage
    from rpa_tune.engine import sweep_context
    monkeypatch.setenv("RPA_TUNE_KERNEL_HASH", "dist-test")
    spec = make_spec()
    plan, ctx = plan_sweep(spec), sweep_context(spec)
    url = f"sqlite:///{tmp_path / 'study.db'}"
    first = Session(open_storage(url), spec, plan, ctx, where=url)
    first.study.set_user_attr("enqueued", "joiner")
    first._enqueue(first.study, first.planned)                  # every config twice in the queue
    second = Session(open_storage(url), spec, plan, ctx, where=url)
    claimed = []
    workers = [first, second]
    while workers:
        for w in list(workers):
            got = w.claim()
            if got is None:
                workers.remove(w)
                continue
            claimed.append(got[1].label())
            w.finish(got[0], {"status": "ok", "metric": 1e-4, "config_id": got[1].label()})
    assert sorted(claimed) == sorted(planned_labels())
    skipped = [t for t in first.study.get_trials() if t.user_attrs.get("skipped") == "duplicate"]
    assert len(skipped) == len(claimed)


def test_ctrl_c_gives_the_claimed_config_back_at_once(tmp_path):
    """Ctrl-C (SIGINT) of a worker: its claimed configs go back to the study at once (no
    waiting for --grace); the next worker evaluates them."""
    url = f"sqlite:///{tmp_path / 'study.db'}"
    args = ["sweep", "--tpu", "v6e", "--backend", "compile", "--case", "decode", "--budget", "100", "--search", "grid", "--jobs", "1",
            "--grace", "600", "--storage", url]
    a = start(args + ["--results", str(tmp_path / "resA")],
              env_for(tmp_path, "A", RPA_TUNE_FAKE_BEHAVIOUR=f"{HEURISTIC}=hang"), "A", tmp_path)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and HEURISTIC not in logged(tmp_path, "A"):
        time.sleep(0.05)
    a.send_signal(signal.SIGINT)
    try:
        rc, out, err = finish(a, "A", tmp_path, timeout=60)
    finally:
        a.kill()
    assert rc == 130, err[-2000:]
    st = json.loads(run(["status", "--storage", url, "--json"], env_for(tmp_path, "s")).stdout)[0]
    assert (st["done"], st["running"], st["waiting"], st["given_back"]) == (0, 0, 29, 1)
    t0 = time.monotonic()
    b = run(args + ["--results", str(tmp_path / "resB")], env_for(tmp_path, "B"))
    assert b.returncode == 0 and time.monotonic() - t0 < 60, b.stderr[-2000:]
    assert sorted(logged(tmp_path, "B")) == sorted(planned_labels())


def test_a_worker_dead_after_recording_its_row_is_not_redone(tmp_path, monkeypatch):
    """A worker that died between storing a config's row and telling Optuna: the config's
    retried trial is closed with the stored row, never handed out for evaluation."""
    from rpa_tune.distributed import Session, open_storage, retry_callback
    from rpa_tune.engine import sweep_context
    import optuna
    monkeypatch.setenv("RPA_TUNE_KERNEL_HASH", "dist-test")
    spec = make_spec(budget=2)
    plan, ctx = plan_sweep(spec), sweep_context(spec)
    url = str(tmp_path / "study.journal")
    s = Session(open_storage(url), spec, plan, ctx, where=url)
    tid, bs = s.claim()
    s.storage.set_trial_user_attr(tid, "row", json.dumps({"status": "ok", "metric": 2e-4, "config_id": "c1"}))
    s.storage.set_trial_state_values(tid, optuna.trial.TrialState.FAIL)        # as fail_stale would
    retry_callback(3)(s.study, s.storage.get_trial(tid))
    other = s.claim()
    assert other is not None and other[1] != bs, "the retried trial is not handed out again"
    s.finish(other[0], {"status": "ok", "metric": 3e-4, "config_id": "c2"})
    assert s.claim() is None
    done = [t for t in s.study.get_trials() if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(done) == 2
    assert {json.loads(t.user_attrs["row"])["config_id"] for t in done} == {"c1", "c2"}


@pytest.mark.parametrize("kind", ["sqlite", "journal"])
def test_a_worker_dead_before_its_first_heartbeat_gives_its_config_back(kind, tmp_path, monkeypatch):
    """A worker killed between taking a trial and its first heartbeat leaves it RUNNING with
    no heartbeat, which Optuna's stale check (RDB storages) passes over: once --grace has
    passed since the trial started, another worker fails it and gets its config; a trial
    its owner beats for is left alone."""
    from rpa_tune.distributed import Session, _bs_of, open_storage
    from rpa_tune.engine import sweep_context
    import optuna
    monkeypatch.setenv("RPA_TUNE_KERNEL_HASH", "dist-test")
    spec = make_spec()
    plan, ctx = plan_sweep(spec), sweep_context(spec)
    url = f"sqlite:///{tmp_path / 'study.db'}" if kind == "sqlite" else str(tmp_path / "study.journal")
    session = lambda: Session(open_storage(url, heartbeat=1, grace=2), spec, plan, ctx, where=url,
                              heartbeat=1, grace=1)
    dead, owner, live = session(), session(), session()
    orphan = dead._pop_waiting()                 # taken; the worker dies before _own's beat
    owned_tid, owned_bs = owner.claim()          # taken and beaten for once
    RUNNING = optuna.trial.TrialState.RUNNING
    state = lambda tid: live.storage.get_trial(tid).state
    live.fail_stale(force=True)
    assert state(orphan._trial_id) == RUNNING, "not stale before --grace"
    time.sleep(1.3)                               # past --grace
    owner._beat(owned_tid)                        # as its heartbeat thread does
    live.fail_stale(force=True)
    assert state(orphan._trial_id) == optuna.trial.TrialState.FAIL
    assert state(owned_tid) == RUNNING, "a trial with a fresh heartbeat stays with its owner"
    got = []
    while (c := live.claim()) is not None:
        got.append(c[1])
        live.finish(c[0], {"status": "ok", "metric": 1e-4, "config_id": c[1].label()})
    assert _bs_of(orphan) in got and owned_bs not in got
    assert sorted(b.label() for b in got) == sorted(planned_labels() - {owned_bs.label()})


def test_storage_lost_mid_sweep_is_one_line(tmp_path):
    """The PostgreSQL server goes away while a worker evaluates: the worker stops with one
    line (exit 1) naming the storage, and what it finished stays in its --results."""
    if find_pg_bin() is None:
        pytest.skip("PostgreSQL binaries (initdb, postgres) not installed: scripts/setup.sh installs postgresql")
    args = SWEEP + ["--case", "decode", "--budget", "100", "--search", "grid", "--jobs", "1", "--results", str(tmp_path / "res")]
    with postgres_server() as base:
        url = create_database(base, "lost")
        p = start(args + ["--storage", url], env_for(tmp_path, "L", RPA_TUNE_FAKE_DELAY="0.4"), "L", tmp_path)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(logged(tmp_path, "L")) < 3:
            time.sleep(0.05)
        assert len(logged(tmp_path, "L")) >= 3, "the worker started evaluating"
    rc, out, err = finish(p, "L", tmp_path)            # the server is stopped and removed here
    lines = [l for l in err.splitlines() if l.startswith("rpa-tune: ")]
    assert rc == 1 and len(lines) == 1, err[-3000:]
    assert lines[0].startswith("rpa-tune: error: lost --storage 'postgresql") and "rerun the same command" in lines[0]
    assert "Traceback" not in err
    assert len(store_rows(tmp_path / "res")) >= 2, "rows finished before the loss are kept"


def test_tpe_patience_stops_a_shared_study_where_it_stops_a_local_sweep(tmp_path):
    """TPE with --patience 3 on a storage: after the heuristic config (ok) every other config
    fails, so after 3 evaluations without improvement the study stops, as a local sweep
    does, and not at the budget."""
    w, desc = make_workload("prefill", LIM)
    key = TuningKey("v6e", "prefill", MODEL.q_dtype, MODEL.kv_dtype, MODEL.num_q_heads, MODEL.num_kv_heads,
                    MODEL.head_dim, LIM.page_size, LIM.max_num_tokens, LIM.max_model_len)
    plan = plan_sweep(SweepSpec(key=key, model=MODEL, limits=LIM, workload=w, workload_desc=desc,
                                case_space=load_space("v6e").for_case("prefill"), backend="compile", search="tpe",
                                budget=20))
    assert plan.heuristic is not None and len(plan.candidates) > 20
    behaviour = f"{plan.heuristic.label()}=ok;*=oom"
    args = SWEEP + ["--case", "prefill", "--search", "tpe", "--budget", "20", "--patience", "3", "--jobs", "1"]
    local = run(args + ["--results", str(tmp_path / "loc")], env_for(tmp_path, "loc", RPA_TUNE_FAKE_BEHAVIOUR=behaviour))
    shared = run(args + ["--results", str(tmp_path / "sh"), "--storage", str(tmp_path / "p.journal")],
                 env_for(tmp_path, "sh", RPA_TUNE_FAKE_BEHAVIOUR=behaviour))
    assert local.returncode == 0 and shared.returncode == 0, shared.stderr[-3000:]
    assert len(logged(tmp_path, "loc")) == 4, logged(tmp_path, "loc")
    evaluated = logged(tmp_path, "sh")
    assert evaluated[0] == plan.heuristic.label() and len(evaluated) == len(set(evaluated)) == 4, evaluated
    assert "no improvement" in shared.stdout
