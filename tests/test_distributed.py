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


def run_two_workers(args, tmp_path: Path, prefix: str, res: str, delay: str) -> tuple[list[str], list[str]]:
    """Start two workers of ``args`` together (results ``{res}1``/``{res}2``, logs
    ``{prefix}1``/``{prefix}2``), wait for both to succeed: (their stdouts, the configs they evaluated)."""
    ps = [start(args + ["--results", str(tmp_path / f"{res}{i}")],
                env_for(tmp_path, f"{prefix}{i}", RPA_TUNE_FAKE_DELAY=delay), f"{prefix}{i}", tmp_path) for i in (1, 2)]
    outs = []
    for i, p in enumerate(ps, 1):
        rc, out, err = finish(p, f"{prefix}{i}", tmp_path)
        assert rc == 0, err[-3000:]
        outs.append(out)
    return outs, logged(tmp_path, f"{prefix}1") + logged(tmp_path, f"{prefix}2")


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
    outs, evaluated = run_two_workers(args, tmp_path, "w", "res", "0.3")
    for out in outs:
        assert "29 of 29 configs done by 2 worker(s)" in out, out[-2000:]
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
    _, evaluated = run_two_workers(args, tmp_path, "t", "r", "0.2")
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


def scheduler(url: str, spec, tmp_path: Path, **kw):
    """A joined ``StudyScheduler`` for ``spec`` (its heartbeat thread stopped at teardown)."""
    from rpa_tune.distributed import StudyScheduler, open_storage
    from rpa_tune.engine import sweep_context
    hb = {k: kw[k] for k in ("heartbeat", "grace") if k in kw}
    s = StudyScheduler(open_storage(url, **hb), url, **kw)
    plan = plan_sweep(spec)
    s.open(spec, plan, sweep_context(spec), ResultStore(tmp_path / f"res-{uuid.uuid4().hex[:6]}"))
    s.planned(len(plan.candidates))
    return s


def ok_row(bs, metric=1e-4) -> dict:
    return {"status": "ok", "metric": metric, "config_id": bs.label()}


@pytest.mark.parametrize("kind", ["sqlite", "journal"])
def test_two_workers_racing_over_every_config_evaluate_each_once(kind, tmp_path, monkeypatch):
    """Two schedulers (threads, each with its own storage connection) acquire every config in
    the same order at the same time, each config's trial created twice: each config is
    granted to exactly one of them; the other is told to wait, or gets its row."""
    import threading
    from rpa_tune.schedulers import DONE, PENDING, RUN
    monkeypatch.setenv("RPA_TUNE_KERNEL_HASH", "dist-test")
    spec = make_spec()
    url = f"sqlite:///{tmp_path / 'study.db'}" if kind == "sqlite" else str(tmp_path / "study.journal")
    ws = [scheduler(url, spec, tmp_path), scheduler(url, spec, tmp_path)]
    cands = plan_sweep(spec).candidates
    for bs in cands:                                  # as two workers creating its trial at once
        ws[0]._create(bs, "budget")
        ws[1]._create(bs, "budget")
    granted = collections.defaultdict(list)
    barrier = threading.Barrier(2)

    def work(i):
        for bs in cands:
            barrier.wait()
            g = ws[i].acquire(bs, bs.label(), None, False, "budget")
            granted[bs.label()].append(g.kind)
            if g.kind == RUN:
                ws[i].record(g.token, ok_row(bs))
    threads = [threading.Thread(target=work, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for w in ws:
        w.close()
    assert set(granted) == {bs.label() for bs in cands}
    for kinds in granted.values():
        assert sorted(kinds).count(RUN) == 1 and set(kinds) <= {RUN, PENDING, DONE}, kinds
    rows = [t for t in ws[0].study.get_trials() if "row" in t.user_attrs]
    assert len(rows) == len(cands), "one row per config"


def test_a_trial_made_from_an_old_view_of_the_study_never_runs_a_config_twice(tmp_path, monkeypatch):
    """Worker Y, looking at a view of the study read a moment before worker X made a trial
    of a config (not yet taken), makes and takes its own: X's lower-numbered trial would win
    once X took it, so Y takes and closes it first; X then finds the config held by Y. One
    of the two evaluates it."""
    from rpa_tune.schedulers import PENDING, RUN
    monkeypatch.setenv("RPA_TUNE_KERNEL_HASH", "dist-test")
    spec = make_spec()
    url = f"sqlite:///{tmp_path / 'study.db'}"
    x, y = scheduler(url, spec, tmp_path), scheduler(url, spec, tmp_path)
    bs = plan_sweep(spec).candidates[0]
    x._trials(fresh=True)                       # both views read before either trial exists
    y._trials(fresh=True)
    made = x._create(bs, "budget")              # X made its trial and is about to take it ...
    got_y = y.acquire(bs, bs.label(), None, False, "budget")     # ... when Y makes and takes its own
    monkeypatch.setattr(x, "_create", lambda *a: made)          # X goes on: its trial is the one made
    got_x = x.acquire(bs, bs.label(), None, False, "budget")
    assert sorted((got_y.kind, got_x.kind)) == sorted((RUN, PENDING))
    x.close()
    y.close()


def test_a_worker_dead_after_recording_its_row_is_not_redone(tmp_path, monkeypatch):
    """A worker that died between storing a config's row and telling Optuna: the config's
    retried trial is answered with the stored row (and closed), never evaluated again."""
    from rpa_tune.distributed import retry_callback
    from rpa_tune.schedulers import DONE, RUN
    import optuna
    monkeypatch.setenv("RPA_TUNE_KERNEL_HASH", "dist-test")
    spec = make_spec(budget=2)
    url = str(tmp_path / "study.journal")
    s = scheduler(url, spec, tmp_path)
    bs, other = plan_sweep(spec).candidates[:2]
    g = s.acquire(bs, bs.label(), None, False, "head")
    assert g.kind == RUN
    s.storage.set_trial_user_attr(g.token, "row", json.dumps(ok_row(bs, 2e-4)))
    s.storage.set_trial_state_values(g.token, optuna.trial.TrialState.FAIL)        # as fail_stale would
    retry_callback(3)(s.study, s.storage.get_trial(g.token))
    again = scheduler(url, spec, tmp_path)
    d = again.acquire(bs, bs.label(), None, False, "head")
    assert d.kind == DONE and d.row["metric"] == 2e-4, "the retried trial is not handed out again"
    assert again.acquire(other, other.label(), None, False, "budget").kind == RUN
    states = collections.Counter(t.state for t in s.study.get_trials())
    assert states[optuna.trial.TrialState.WAITING] == 0, "the copy of the finished trial was closed"
    s.close()
    again.close()


@pytest.mark.parametrize("kind", ["sqlite", "journal"])
def test_a_worker_dead_before_its_first_heartbeat_gives_its_config_back(kind, tmp_path, monkeypatch):
    """A worker killed between taking a trial and its first heartbeat leaves it RUNNING with
    no heartbeat, which Optuna's stale check (RDB storages) passes over: once --grace has
    passed since the trial started, another worker fails it and gets its config; a trial
    its owner beats for is left alone."""
    from rpa_tune.schedulers import PENDING, RUN
    import optuna
    monkeypatch.setenv("RPA_TUNE_KERNEL_HASH", "dist-test")
    spec = make_spec()
    url = f"sqlite:///{tmp_path / 'study.db'}" if kind == "sqlite" else str(tmp_path / "study.journal")
    dead, owner, live = (scheduler(url, spec, tmp_path, heartbeat=1, grace=1) for _ in range(3))
    cands = plan_sweep(spec).candidates
    orphan_bs, owned_bs = cands[0], cands[1]
    dead._create(orphan_bs, "head")                # taken; the worker dies before _own's beat
    (orphan,) = [t for t in dead.study.get_trials() if t.state == optuna.trial.TrialState.WAITING]
    assert dead._take(orphan._trial_id)
    owned = owner.acquire(owned_bs, owned_bs.label(), None, False, "budget")     # taken and beaten for
    assert owned.kind == RUN
    RUNNING = optuna.trial.TrialState.RUNNING
    state = lambda tid: live.storage.get_trial(tid).state
    live.fail_stale(force=True)
    assert state(orphan._trial_id) == RUNNING, "not stale before --grace"
    assert live.acquire(orphan_bs, orphan_bs.label(), None, False, "head").kind == PENDING
    time.sleep(1.3)                               # past --grace
    owner._beat(owned.token)                      # as its heartbeat thread does
    live.fail_stale(force=True)
    assert state(orphan._trial_id) == optuna.trial.TrialState.FAIL
    assert state(owned.token) == RUNNING, "a trial with a fresh heartbeat stays with its owner"
    got = {}
    for bs in cands:
        got[bs] = live.acquire(bs, bs.label(), None, False, "budget")
        if got[bs].kind == RUN:
            live.record(got[bs].token, ok_row(bs))
    assert got[orphan_bs].kind == RUN and got[owned_bs].kind == PENDING
    assert all(g.kind == RUN for bs, g in got.items() if bs != owned_bs)
    for w in (dead, owner, live):
        w.close()


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
    assert (st["done"], st["running"], st["waiting"], st["given_back"]) == (0, 0, 1, 1)
    t0 = time.monotonic()
    b = run(args + ["--results", str(tmp_path / "resB")], env_for(tmp_path, "B"))
    assert b.returncode == 0 and time.monotonic() - t0 < 60, b.stderr[-2000:]
    assert sorted(logged(tmp_path, "B")) == sorted(planned_labels())


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


def _cfg(r) -> tuple:
    return (int(r["bq"]), int(r["bkv"]), int(r["cq"]), int(r["ckv"]))


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_retry_with_a_storage_evaluates_each_such_config_again_once(kind, tmp_path, request):
    """`--retry vmem_oom` with `--storage`, two workers started together: each config the
    study recorded as vmem_oom is evaluated again exactly once (by one of them), nothing else
    is; the study then holds its new row; a third run finds nothing to retry."""
    url = storage_url(kind, tmp_path, request)
    oom = ["bq1_bkv512_cq1_ckv128", "bq1_bkv2048_cq1_ckv256"]
    args = SWEEP + ["--case", "decode", "--budget", "100", "--search", "grid", "--jobs", "1", "--storage", url]
    first = run(args + ["--results", str(tmp_path / "r0")],
                env_for(tmp_path, "first", RPA_TUNE_FAKE_BEHAVIOUR=";".join(f"{c}=oom" for c in oom)))
    assert first.returncode == 0, first.stderr[-3000:]
    assert sorted(logged(tmp_path, "first")) == sorted(planned_labels())
    retry = args + ["--retry", "vmem_oom"]
    _, evaluated = run_two_workers(retry, tmp_path, "w", "r", "0.3")
    assert sorted(evaluated) == sorted(oom), "each oom config once"
    st = json.loads(run(["status", "--storage", url, "--json"], env_for(tmp_path, "s")).stdout)[0]
    assert (st["done"], st["counts"]) == (29, {"ok": 29})
    third = run(retry + ["--results", str(tmp_path / "r3")], env_for(tmp_path, "w3"))
    assert third.returncode == 0 and not logged(tmp_path, "w3") and "0 evaluated" in third.stdout


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_seeds_and_refine_with_a_storage_as_without_one(kind, tmp_path, request):
    """`--seeds` and `--refine` with `--storage`: one worker prices the 512 bucket, another one
    (its own empty --results) the 1024 bucket with --seeds 2: its seeds are the two best
    configs the study of the 512 bucket holds; it then climbs (--refine). The configs it
    evaluates, in order, are those of the same sweep without a storage."""
    from rpa_tune.distributed import rows_from_storage
    from tune_fakes import fake_metric
    from kernel.config import BlockSizes
    url = storage_url(kind, tmp_path, request)
    base = SWEEP + ["--case", "prefill", "--model", "llama3-70b-tp8", "--search", "tpe", "--budget", "6",
                    "--patience", "0", "--jobs", "1"]
    small = run(base + ["--max-num-tokens", "512", "--storage", url, "--results", str(tmp_path / "x")],
                env_for(tmp_path, "x"))
    assert small.returncode == 0, small.stderr[-3000:]
    rows512 = [r for r in rows_from_storage(url) if r["max_num_tokens"] == 512 and r["status"] == "ok"]
    assert len(rows512) == 6
    best2 = {_cfg(r) for r in sorted(rows512, key=lambda r: fake_metric(BlockSizes(*_cfg(r))))[:2]}
    big = base + ["--max-num-tokens", "1024", "--seeds", "2", "--refine", "30", "--json"]
    shared = run(big + ["--storage", url, "--results", str(tmp_path / "y")], env_for(tmp_path, "y"))
    assert shared.returncode == 0, shared.stderr[-3000:]
    rows = ResultStore(tmp_path / "y").read()
    seeded = {_cfg(r) for r in rows.to_dict("records") if r["search"] == "seed"}
    heur = {_cfg(r) for r in rows.to_dict("records") if r["is_heuristic"]}
    assert seeded and seeded == best2 - heur, "the seeds are the other bucket's two best, from the storage"
    assert len(rows) > 6 + len(seeded), "it climbed past its budget"
    assert {r["config_id"] for r in rows_from_storage(url) if r["max_num_tokens"] == 1024} == set(rows.config_id)
    # the same two sweeps without a storage, in one results directory
    for args, name in ((base + ["--max-num-tokens", "512"], "lx"), (big, "ly")):
        r = run(args + ["--results", str(tmp_path / "local")], env_for(tmp_path, name))
        assert r.returncode == 0, r.stderr[-3000:]
    assert logged(tmp_path, "ly") == logged(tmp_path, "y"), "one engine: the same configs in the same order"
    assert json.loads(shared.stdout)[0]["stop_reason"].endswith(
        json.loads(r.stdout)[0]["stop_reason"]), (shared.stdout[-500:], r.stdout[-500:])


def test_refine_with_two_workers_climbs_from_the_best_of_both(tmp_path):
    """`--refine` with two workers on one study: the climb starts from the best row of every
    worker and ends at a local optimum of the fake landscape (every neighbour of the study's
    best evaluated, none better); the study's --budget holds and no config is evaluated twice."""
    from rpa_tune.distributed import rows_from_storage
    from rpa_tune.search import neighbours
    from kernel.config import BlockSizes
    url = f"sqlite:///{tmp_path / 'study.db'}"
    args = SWEEP + ["--case", "decode", "--search", "random", "--budget", "5", "--refine", "40", "--jobs", "1",
                    "--storage", url]
    _, evaluated = run_two_workers(args, tmp_path, "w", "r", "0.2")
    assert len(evaluated) == len(set(evaluated)), evaluated
    rows = rows_from_storage(url)
    done = {_cfg(r): r["metric"] for r in rows}
    assert len(done) == len(evaluated)
    best = min(done, key=done.get)
    nbs = neighbours(BlockSizes(*best), plan_sweep(make_spec()).candidates)
    assert nbs and all(tuple(nb) in done and done[tuple(nb)] >= done[best] for nb in nbs)
    from rpa_tune.distributed import open_storage, rpa_studies
    st = open_storage(url)
    (s,) = rpa_studies(st)
    trials = st.get_all_trials(s._study_id)
    assert not [t for t in trials if t.state.name in ("WAITING", "RUNNING")], "no trial left open"
    phase = collections.defaultdict(set)
    for t in trials:
        if "row" in t.user_attrs:
            phase[t.user_attrs["phase"]].add(tuple(t.params.values()))
    assert len(phase["head"] | phase["budget"]) == 5 and phase["climb"], phase
    assert sum(map(len, phase.values())) == len(evaluated) and trials[0].user_attrs["phase"] == "head"
