"""The `rpa-tune` console script: input errors (exit 2, one line, nothing written), help,
shell completion, dry runs, and show / verify on a (fake-evaluated) results store."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_checks import assert_one_error_line

TESTS = str(Path(__file__).resolve().parent)
RPA_TUNE = str(Path(sys.executable).with_name("rpa-tune"))


def run(args, env=None, timeout=300):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([RPA_TUNE, *args], capture_output=True, text=True, env=e, timeout=timeout)


@pytest.fixture(scope="module")
def bad_workload(tmp_path_factory):
    f = tmp_path_factory.mktemp("w") / "too_long.json"
    f.write_text(json.dumps([{"q_len": 1, "kv_len": 50000}]))
    return f


@pytest.mark.parametrize("args,needles", [
    (["--tpu", "v9"], ["unknown TPU 'v9'", "v4, v5e, v5p, v6e, tpu7x"]),
    (["--tpu", "v6e", "--model", "llama4-fake"], ["unknown model preset 'llama4-fake'", "llama3-8b", "gemma2-9b"]),
    (["--tpu", "v6e", "--case", "training"], ["'training' is not one of 'decode', 'prefill', 'mixed', 'verify', 'all'"]),
    (["--tpu", "v6e", "--backend", "gpu"], ["'gpu' is not one of 'auto', 'tpu', 'compile', 'interpret'"]),
    (["--tpu", "v6e", "--q-heads", "30", "--kv-heads", "8", "--head-dim", "128"],
     ["--q-heads 30 is not a multiple of --kv-heads 8"]),
    (["--tpu", "v6e", "--q-heads", "8", "--kv-heads", "8", "--head-dim", "96"],
     ["--head-dim 96 is not supported", "64, 128, 256"]),
    (["--tpu", "v6e", "--q-heads", "8"], ["needs --q-heads, --kv-heads and --head-dim together"]),
    (["--tpu", "v6e", "--kv-dtype", "int4"], ["'int4' is not one of", "'float8_e5m2'"]),
    (["--tpu", "v6e", "--page-size", "96"], ["--page-size 96 must be a power of two"]),
    (["--tpu", "v6e", "--max-model-len", "64"], ["--max-model-len 64 is smaller than --page-size 128"]),
    (["--tpu", "v6e", "--search", "bayes"], ["'bayes' is not one of 'grid', 'random', 'tpe'"]),
    (["--tpu", "v6e", "--context", "zipf:2"], ["unknown context distribution 'zipf:2'"]),
    (["--tpu", "v6e", "--backend", "tpu"], ["--backend tpu needs a TPU v6e here, found no TPU"]),
    (["--tpu", "v6e", "--sliding-window", "0"], ["--sliding-window", "0"]),
    (["--tpu", "v6e", "--sliding-window", "8192"],
     ["--sliding-window 8192 is not below --max-model-len 8192"]),
])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path, args, needles):
    res = tmp_path / "results"
    r = run(["sweep", *args, "--results", str(res)])
    assert_one_error_line(r, needles)
    assert not res.exists(), "nothing may be written on bad input"


def test_impossible_workload_file(tmp_path, bad_workload):
    res = tmp_path / "results"
    r = run(["sweep", "--tpu", "v6e", "--workload", str(bad_workload), "--results", str(res)])
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "kv_len 50000 > max_model_len=8192" in r.stderr
    assert not res.exists()


@pytest.mark.parametrize("command,options", [
    ("sweep", ["--tpu", "--case", "--model", "--q-heads", "--kv-heads", "--head-dim", "--dtype", "--kv-dtype",
               "--page-size", "--max-num-tokens", "--max-num-seqs", "--max-model-len", "--workload", "--backend",
               "--search", "--budget", "--jobs", "--timeout", "--results", "--space", "--seed", "--patience"]),
    ("show", ["--results", "--tpu", "--case", "--backend", "--top"]),
    ("verify", ["--results", "--tpu", "--case", "--top", "--jobs", "--timeout"]),
    ("doctor", ["--quick", "--tpu"]),
    ("report", ["--results", "--out", "--tables", "--tpu", "--case", "--backend", "--key", "--limit", "--force"]),
])
def test_help_explains_every_option(command, options):
    r = run([command, "--help"], env={"COLUMNS": "250"})
    assert r.returncode == 0
    for o in options:
        assert o in r.stdout, o
    if command == "sweep":
        for default in ("[default: decode]", "[default: llama3-8b]", "[default: 128]", "[default: 2048]",
                        "[default: 8192]", "[default: auto]", "[default: tpe]", "[default: 20]", "[default: 2]",
                        "[default: 900.0]", "[default: results]", "Default: from --model"):
            assert default in r.stdout, default


def test_shell_completion():
    env = {"_RPA_TUNE_COMPLETE": "complete_bash", "COMP_WORDS": "rpa-tune sweep --tpu v", "COMP_CWORD": "3"}
    r = run([], env=env)
    assert r.stdout.split() == ["v4", "v5e", "v5p", "v6e"]
    env.update(COMP_WORDS="rpa-tune sweep --model llama3", COMP_CWORD="3")
    assert run([], env=env).stdout.split() == ["llama3-8b", "llama3-70b-tp8", "llama3.2-1b"]


def test_dry_run_plans_without_writing(tmp_path):
    res = tmp_path / "results"
    r = run(["sweep", "--tpu", "v6e", "--case", "decode", "--dry-run", "--results", str(res)], env={"COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    assert "29 candidates of 768" in r.stderr and "(1, 4096, 1, 1024)" in r.stdout
    assert not res.exists()


@pytest.fixture(scope="module")
def fake_results(tmp_path_factory):
    """A results dir filled by a real CLI sweep whose workers use the fake evaluator."""
    res = tmp_path_factory.mktemp("cli") / "results"
    env = {"RPA_TUNE_EVALUATOR_OVERRIDE": "tune_fakes:make_evaluator", "RPA_TUNE_KERNEL_HASH": "cli-test",
           "PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", ""), "COLUMNS": "250"}
    # a small shard (8 q / 1 KV heads) keeps the interpret runs of `verify` cheap
    r = run(["sweep", "--tpu", "v6e", "--case", "decode", "--model", "llama3-70b-tp8", "--backend", "compile",
             "--search", "grid", "--budget", "100", "--results", str(res)], env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "39 evaluated" in r.stdout and "best (1, 1024, 1, 256)" in r.stdout
    return res, env


def test_show_prints_winners(fake_results):
    res, env = fake_results
    r = run(["show", "--results", str(res)], env=env)
    assert r.returncode == 0, r.stderr
    assert "(1, 1024, 1, 256)" in r.stdout and "ok 39" in r.stdout and "x3.50" in r.stdout
    # an estimate says its audit verdict and the clock that made it a time
    assert "complete" in r.stdout and "1.500 GHz (fake clock)" in r.stdout
    r = run(["show", "--results", str(res), "--top", "3"], env=env)
    assert "(1, 1024, 1, 512)" in r.stdout and "(1, 1024, 1, 128)" in r.stdout
    r = run(["show", "--results", str(res), "--tpu", "v5e"], env=env)
    assert r.returncode == 1 and "no matching results" in r.stderr
    r = run(["show", "--results", str(res), "--tpu", "v9"], env=env)
    assert r.returncode == 2 and "unknown TPU 'v9'" in r.stderr


def test_verify_marks_wrong_results_and_they_never_win(fake_results):
    """A deliberately corrupted output path (test hook) makes the winner wrong_result;
    `show` then picks the next config."""
    res, env = fake_results
    r = run(["verify", "--results", str(res), "--jobs", "1"],
            env=dict(env, RPA_TUNE_TEST_CORRUPT="bq1_bkv1024_cq1_ckv256", RPA_TUNE_EVALUATOR_OVERRIDE=""))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "wrong_result" in r.stdout and "outputs off" in r.stdout
    shown = run(["show", "--results", str(res)], env=env)
    assert "(1, 1024, 1, 256)" not in shown.stdout
    assert "1 wrong excluded" in shown.stdout
    assert "(1, 1024, 1, 512)" in shown.stdout or "(1, 1024, 1, 128)" in shown.stdout
    # the next winner is verified clean
    r = run(["verify", "--results", str(res), "--jobs", "1"], env=dict(env, RPA_TUNE_EVALUATOR_OVERRIDE=""))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "matches the reference" in r.stdout


def test_doctor_quick_reports_versions_backends_and_cache():
    r = run(["doctor", "--quick"], env={"COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    import jax
    for needle in ("jax", jax.__version__, "libtpu", "backend tpu", "backend compile", "backend auto",
                   "cache: tpu backend workers"):
        assert needle in r.stdout, needle
    if not Path("/dev/accel0").exists() and not list(Path("/dev").glob("vfio/[0-9]*")):
        assert "unavailable" in r.stdout and "compile (for --tpu v6e)" in r.stdout


def test_doctor_runs_a_trial_of_each_cpu_backend():
    """Without --quick, doctor compiles one small config deviceless (with the estimate) and
    runs one in the interpreter, and says both work on this machine."""
    r = run(["doctor", "--tpu", "v6e"], env={"COLUMNS": "250"}, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "static profiler estimate (" in r.stdout and "cycles)" in r.stdout, r.stdout
    assert "Pallas interpreter matches the reference" in r.stdout, r.stdout


def test_multi_bucket_sweep_json_plain_progress_and_show_json(tmp_path):
    """`--buckets` sweeps one key per token bucket; with stderr not a terminal, progress is
    plain lines (config n/N, status, best so far); `--json` puts one document on stdout."""
    res = tmp_path / "results"
    env = {"RPA_TUNE_EVALUATOR_OVERRIDE": "tune_fakes:make_evaluator", "RPA_TUNE_KERNEL_HASH": "cli-json",
           "PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = run(["sweep", "--tpu", "v6e", "--case", "decode", "--model", "llama3-70b-tp8", "--backend", "compile",
             "--search", "grid", "--budget", "100", "--buckets", "128,64", "--results", str(res), "--json"], env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert [d["key"]["max_num_tokens"] for d in doc] == [64, 128]
    for d in doc:
        assert d["evaluated"] == 39 and d["counts"] == {"ok": 39}
        assert d["best"]["block_sizes"] == [1, 1024, 1, 256]          # tune_fakes' minimum
    lines = [l for l in r.stderr.splitlines() if "] config " in l]
    assert sum("config 39/39" in l for l in lines) == 2, r.stderr[-2000:]
    assert all(" ok " in l and "best (" in l for l in lines)
    assert "\x1b[" not in r.stderr                                  # no live display codes in a log
    shown = run(["show", "--results", str(res), "--json"], env=env)
    assert shown.returncode == 0, shown.stderr
    groups = json.loads(shown.stdout)
    assert sorted(g["key"]["max_num_tokens"] for g in groups) == [64, 128]
    assert all(g["configs"][0]["block_sizes"] == [1, 1024, 1, 256] and g["counts"] == {"ok": 39} for g in groups)
    none = run(["show", "--results", str(res), "--json", "--tpu", "v5e"], env=env)
    assert none.returncode == 1 and json.loads(none.stdout) == []


def test_doctor_lists_table_files_with_counts_and_kernel_match(tmp_path):
    from kernel import tables as kt
    from tables_synth import entry, key, table
    good = table(entry(key(t=64), (1, 256, 1, 256), kernel_hash=kt.kernel_id()))
    doc = good.to_dict()
    doc["entries"].append(dict(doc["entries"][0], key=dict(doc["entries"][0]["key"], sliding_window="no")))
    (tmp_path / "mine.json").write_text(json.dumps(doc))
    # wide enough for the paths in one cell line (a test worker's tmp_path is long)
    r = run(["doctor", "--quick"], env={"RPA_TABLE": str(tmp_path / "mine.json"), "RPA_SHIPPED_TABLES": "1",
                                        "COLUMNS": "1000"})
    assert r.returncode == 0, r.stderr
    out = " ".join(r.stdout.split())
    assert f"{tmp_path / 'mine.json'}: ok: 1 entries, 1 rejected; all match this kernel" in out
    for p in sorted((Path(__file__).resolve().parent.parent / "tables").glob("*.json")):
        assert f"{p}: ok: {len(kt.Table.read(p))} entries" in out


def test_no_wrapping_in_pipes(tmp_path):
    """Piped output keeps every key on one line (no 80-column folding)."""
    from tables_synth import entry, key, table
    keys = [key(t=t, l=131072, hq=64, hkv=8) for t in (64, 128)]
    table(entry(keys[0], (1, 256, 1, 256))).write_json(tmp_path / "old.json")
    table(*(entry(k, (1, 512, 1, 512)) for k in keys)).write_json(tmp_path / "new.json")
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    r = subprocess.run([RPA_TUNE, "diff", str(tmp_path / "old.json"), str(tmp_path / "new.json"), "--fields"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1, r.stderr
    for k in keys:
        assert any(k.id() in line for line in r.stdout.splitlines()), r.stdout
    assert "1 added, 0 removed, 1 changed (1 -> 2 entries)" in r.stdout.splitlines()[-1]


def test_sliding_window_sweep_tunes_the_window_key_and_export_ships_it(tmp_path):
    """`--sliding-window N` runs the kernel with the window (the evaluator's task carries it),
    records the rows under the key's sliding_window=true entry, keeps them apart from a
    full-attention sweep of the same shape, and export writes an entry that the kernel's
    lookup finds for sliding-window layers only."""
    import pandas as pd
    res, out = tmp_path / "results", tmp_path / "tables"
    env = {"RPA_TUNE_EVALUATOR_OVERRIDE": "tune_fakes:make_evaluator", "RPA_TUNE_KERNEL_HASH": "cli-window",
           "PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", "")}
    base = ["sweep", "--tpu", "v6e", "--case", "decode", "--model", "llama3-70b-tp8", "--backend", "compile",
            "--search", "grid", "--budget", "100", "--results", str(res), "--json"]
    r = run(base + ["--sliding-window", "512"], env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout)[0]["key"]["sliding_window"] is True
    r = run(base, env=env)                   # the same shape, full attention: its own rows
    assert r.returncode == 0, r.stderr[-3000:]
    df = pd.read_parquet(res)
    sw = df[df["sliding_window"]]
    assert len(sw) == 39 and len(df) == 78 and set(sw["status"]) == {"ok"}
    assert set(sw["message"]) == {"fake estimate (sliding_window=512)"}
    assert set(df[~df["sliding_window"]]["message"]) == {"fake estimate (sliding_window=None)"}
    assert all("sliding window 512" in w for w in sw["workload"])
    assert not set(sw["config_id"]) & set(df[~df["sliding_window"]]["config_id"])
    r = run(["export", "--results", str(res), "--out", str(out)], env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads((out / "v6e.json").read_text())
    assert sorted(e["key"]["sliding_window"] for e in doc["entries"]) == [False, True]


def test_soft_cap_sweep_runs_the_kernel_capped_and_keeps_its_rows_apart(tmp_path):
    """`--soft-cap 50` (Gemma-2's layers) reaches the evaluator's task; its rows are another
    workload of the same key than an uncapped sweep's, so export never compares the two."""
    import pandas as pd
    res = tmp_path / "results"
    env = {"RPA_TUNE_EVALUATOR_OVERRIDE": "tune_fakes:make_evaluator", "RPA_TUNE_KERNEL_HASH": "cli-cap",
           "PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", "")}
    base = ["sweep", "--tpu", "v6e", "--case", "decode", "--model", "llama3-70b-tp8", "--backend", "compile",
            "--search", "grid", "--budget", "5", "--results", str(res), "--json"]
    assert run(base + ["--soft-cap", "50"], env=env).returncode == 0
    assert run(base, env=env).returncode == 0
    df = pd.read_parquet(res)
    capped = df[df["message"].str.endswith("soft_cap=50")]
    assert len(capped) == 5 and len(df) == 10
    assert all("soft cap 50" in w for w in capped["workload"])
    assert len(set(df["workload_id"])) == 2
    r = run(base + ["--soft-cap", "0"], env=env)
    assert r.returncode == 2 and "--soft-cap" in r.stderr


def test_each_bucket_starts_from_the_configs_the_earlier_buckets_evaluated(tmp_path):
    """`--buckets`: the compile backend prices a config at every bucket from the same cached
    probes, so each bucket's search first evaluates what the earlier buckets of the key
    evaluated (outside the budget), then its own budget of new proposals."""
    import pandas as pd
    res = tmp_path / "results"
    cmd, env = _fake_bucket_sweep(res, "cli-seeds")
    r = run(cmd + ["--json"], env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    df = pd.read_parquet(res)
    cfg = _configs
    small, big = cfg(df[df["max_num_tokens"] == 512]), cfg(df[df["max_num_tokens"] == 1024])
    # every config of the first bucket, then the second one's budget (its heuristic included)
    assert len(small) == 6 and small < big and len(big - small) in (5, 6)
    doc = json.loads(r.stdout)
    assert "configs evaluated at other token buckets" in doc[1]["search_note"] and not doc[0]["search_note"]


def test_seeds_limits_a_bucket_to_the_best_configs_of_each_other_bucket(tmp_path):
    """`--seeds N`: a bucket's search first evaluates only the N best configs (by their ok
    metric) of each other bucket, not all of them; the rest of its budget is its own."""
    import pandas as pd
    res = tmp_path / "results"
    cmd, env = _fake_bucket_sweep(res, "cli-seeds-cap")
    r = run(cmd + ["--seeds", "2"], env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    df = pd.read_parquet(res)
    small = df[(df["max_num_tokens"] == 512) & (df["status"] == "ok")].sort_values("metric")
    assert len(_configs(small)) == 6
    best2 = set(map(tuple, small[["bq", "bkv", "cq", "ckv"]].to_numpy().tolist()[:2]))
    big = df[df["max_num_tokens"] == 1024]
    seeded = _configs(big[big["search"] == "seed"])
    assert seeded == best2 - _configs(big[big["is_heuristic"]]) and seeded
    assert len(big) <= 6 + len(seeded)


def _fake_bucket_sweep(res, tag: str):
    """A two-bucket TPE sweep of the fake compile evaluator (budget 6, one job): its command
    and environment."""
    env = {"RPA_TUNE_EVALUATOR_OVERRIDE": "tune_fakes:make_evaluator", "RPA_TUNE_KERNEL_HASH": tag,
           "PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = ["sweep", "--tpu", "v6e", "--case", "prefill", "--model", "llama3-70b-tp8", "--backend", "compile",
           "--search", "tpe", "--budget", "6", "--patience", "0", "--jobs", "1", "--buckets", "512,1024",
           "--results", str(res)]
    return cmd, env


def _configs(df) -> set:
    return set(map(tuple, df[["bq", "bkv", "cq", "ckv"]].to_numpy().tolist()))


def test_rerunning_a_bucket_sweep_only_closes_the_buckets_and_then_asks_nothing(tmp_path):
    """A finished `--buckets` sweep run again: the first bucket now also evaluates what the
    later buckets found (its seeds grew), but no bucket's search proposes anything new (its
    earlier picks are replayed inside the budget); a third run evaluates nothing."""
    import pandas as pd
    res = tmp_path / "results"
    cmd, env = _fake_bucket_sweep(res, "cli-rerun")
    cfg = _configs
    assert run(cmd, env=env).returncode == 0
    first = pd.read_parquet(res)
    small, big = (cfg(first[first["max_num_tokens"] == t]) for t in (512, 1024))
    # the second bucket's seeds (the first bucket's configs) are recorded as seeds
    seeded = first[(first["max_num_tokens"] == 1024) & (first["search"] == "seed")]
    assert cfg(seeded) == small - cfg(first[first["is_heuristic"]])
    assert run(cmd, env=env).returncode == 0
    second = pd.read_parquet(res)
    assert cfg(second[second["max_num_tokens"] == 512]) == big, "the first bucket priced the second's finds"
    assert cfg(second[second["max_num_tokens"] == 1024]) == big, "and the second bucket proposed nothing new"
    assert len(second) == len(first) + len(big - small)
    assert run(cmd, env=env).returncode == 0
    assert len(pd.read_parquet(res)) == len(second)
    # a smaller budget still replays every earlier pick of a bucket (none is dropped)
    small = run(cmd[:cmd.index("--budget") + 1] + ["1"] + cmd[cmd.index("--budget") + 2:] + ["--json"], env=env)
    assert small.returncode == 0, small.stderr[-2000:]
    for doc, t in zip(json.loads(small.stdout), (512, 1024)):
        assert doc["resumed"] == len(second[second["max_num_tokens"] == t]) and doc["evaluated"] == 0


def test_a_new_evaluator_version_re_prices_what_was_evaluated_and_nothing_else(tmp_path):
    """After an evaluator version change, rerunning a `--buckets` sweep re-prices every
    config the earlier version evaluated (the compile backend's from cached probes) and
    proposes nothing new; export then takes the new version's prices only."""
    import pandas as pd
    res = tmp_path / "results"
    cmd, env = _fake_bucket_sweep(res, "cli-version")
    cfg = _configs
    assert run(cmd, env=env).returncode == 0
    old = pd.read_parquet(res)
    v2 = dict(env, RPA_TUNE_EVALUATOR_OVERRIDE="tune_fakes:make_evaluator_v2")
    assert run(cmd, env=v2).returncode == 0
    df = pd.read_parquet(res)
    new = df[df["evaluator_version"] == "override:tune_fakes:make_evaluator_v2"]
    for t in (512, 1024):
        # the second bucket's finds reach the first one too (as on any rerun), nothing else
        assert cfg(new[new["max_num_tokens"] == t]) == cfg(old), t
    out = tmp_path / "tables"
    assert run(["export", "--results", str(res), "--out", str(out)], env=v2).returncode == 0
    doc = json.loads((out / "v6e.json").read_text())
    assert doc["entries"] and all(e["provenance"]["config_id"] in set(new["config_id"]) for e in doc["entries"])


def test_refine_climbs_with_parallel_jobs_to_a_local_optimum_and_a_rerun_adds_nothing(tmp_path):
    """`--refine`: after its budget the sweep climbs from its best with two jobs in flight
    (waiting for outcomes before it decides where to go when every neighbour it could ask is
    running), ends at a local optimum of the fake landscape, and a rerun evaluates nothing."""
    import pandas as pd
    from kernel.config import BlockSizes
    from rpa_tune.search import neighbours
    from tune_fakes import fake_metric
    res = tmp_path / "results"
    env = {"RPA_TUNE_EVALUATOR_OVERRIDE": "tune_fakes:make_evaluator", "RPA_TUNE_KERNEL_HASH": "cli-refine",
           "RPA_TUNE_FAKE_DELAY": "0.05", "PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = ["sweep", "--tpu", "v6e", "--case", "prefill", "--model", "llama3-70b-tp8", "--backend", "compile",
           "--search", "tpe", "--budget", "4", "--refine", "60", "--jobs", "2", "--results", str(res), "--json"]
    r = run(cmd, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert "local optimum" in doc[0]["stop_reason"], doc[0]["stop_reason"]
    df = pd.read_parquet(res)
    got = {BlockSizes(*map(int, x)) for x in df[["bq", "bkv", "cq", "ckv"]].to_numpy().tolist()}
    best = min(got, key=fake_metric)
    assert 4 < len(df) <= 4 + 60 and len(got) == len(df)
    again = run(cmd, env=env)
    assert again.returncode == 0 and len(pd.read_parquet(res)) == len(df)
    # every neighbour of the best was evaluated and none beats it
    from rpa_tune.cli import resolve_limits, resolve_model
    from rpa_tune.space import context, enumerate_space, load_space
    m, _ = resolve_model("llama3-70b-tp8", None, None, None, None, None)
    cands = enumerate_space(load_space("v6e").for_case("prefill"),
                            context(m, resolve_limits(128, 2048, 128, 8192), "v6e")).candidates
    assert set(neighbours(best, set(cands))) <= got
