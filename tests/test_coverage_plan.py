"""``python -m rpa_tune.coverage plan``: the sweeps ``tables/generate.sh`` runs, whole or in
parts for several machines (``--shard K/N``)."""
import subprocess
import sys
from pathlib import Path

import pytest

from rpa_tune import coverage

REPO = Path(__file__).resolve().parent.parent


def _key(sw):
    return sw.generation, sw.shape.name, sw.case, sw.page_size


@pytest.mark.parametrize("count", [1, 2, 5, 7])
def test_shards_split_the_plan_by_key(count):
    whole = coverage.plan()
    parts = [coverage.shard(whole, k, count) for k in range(1, count + 1)]
    # disjoint and complete, each keeping the plan's order
    assert sorted((id(sw) for p in parts for sw in p)) == sorted(id(sw) for sw in whole)
    for p in parts:
        assert p == [sw for sw in whole if sw in p]
    # a key's explore and fill sweeps stay on one machine, explore first
    for p in parts:
        for sw in p:
            roles = [s.role for s in p if _key(s) == _key(sw)]
            assert roles == ["explore", "fill"], (_key(sw), roles)
    # a head_dim-64 key runs beside its 128-wide twin (compose.padded_twin reads its probes)
    part_of = {_key(sw): k for k, p in enumerate(parts) for sw in p}
    twins = [k for k in part_of if k[1] == "llama3.2-1b"]
    assert twins and all(part_of[k] == part_of[(k[0], "llama3-8b", k[2], k[3])] for k in twins)
    # balanced to within one key group (a key and its twin's: two keys)
    sizes = [len({_key(sw) for sw in p}) for p in parts]
    assert max(sizes) - min(sizes) <= 2, sizes


def _plan(*args, pipe_to_head=False):
    cmd = [sys.executable, "-m", "rpa_tune.coverage", "plan", *args]
    if pipe_to_head:
        cmd = ["bash", "-c", " ".join(cmd) + " | head -1; exit ${PIPESTATUS[0]}"]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)


def test_plan_cli_shard_and_bad_shard():
    r = _plan("--gen", "v6e", "--shard", "2/3")
    assert r.returncode == 0, r.stderr
    want = coverage.shard(coverage.plan(generations=("v6e",)), 2, 3)
    assert len(r.stdout.splitlines()) == len(want) > 0
    assert all(line.startswith(("explore --tpu v6e ", "fill --tpu v6e ")) for line in r.stdout.splitlines())
    for bad in ("4/3", "x"):
        r = _plan("--shard", bad)
        assert r.returncode == 2 and r.stdout == ""
        assert len(r.stderr.strip().splitlines()) == 1 and repr(bad) in r.stderr, r.stderr


def test_plan_cli_quiet_when_the_reader_stops_early():
    """``plan | head``: no BrokenPipeError traceback, exit 0."""
    r = _plan(pipe_to_head=True)
    assert r.returncode == 0 and r.stdout.count("\n") == 1
    assert "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, r.stderr


def test_cases_without_an_estimate_are_planned_modelled():
    """TPU7x prefill / mixed and v4: no audited estimate is possible (coverage.needs_a_device).
    The compile plan prices them modelled (coverage.compile_method), with a line on stderr;
    the estimable-only plan skips them."""
    pairs = {(sw.generation, sw.case) for sw in coverage.plan(estimable_only=True)}
    assert {("tpu7x", "prefill"), ("tpu7x", "mixed")}.isdisjoint(pairs) and ("tpu7x", "decode") in pairs
    planned = {(sw.generation, sw.case) for sw in coverage.plan()}
    assert {("tpu7x", "prefill"), ("v4", "decode"), ("v4", "mixed")} <= planned
    assert any(k.generation == "tpu7x" and k.case == "mixed" for k in coverage.expected_keys())
    modelled = {(g, c) for g in coverage.GENERATIONS for c in coverage.CASES
                if coverage.compile_method(g, c) == coverage.MODELLED}
    assert modelled == {("v4", c) for c in coverage.CASES} | {("tpu7x", "prefill"), ("tpu7x", "mixed")}
    assert coverage.compile_method("v7x", "decode") == coverage.ESTIMATE
    r = _plan("--gen", "tpu7x")
    assert r.returncode == 0 and r.stdout, r.stderr
    assert {line.split()[4] for line in r.stdout.splitlines()} == set(coverage.CASES)
    assert "modelled tpu7x prefill (no estimate: " in r.stderr and "tpu7x decode" not in r.stderr
    r = _plan("--gen", "v4", "--case", "mixed")
    assert r.returncode == 0 and r.stdout and all(" --tpu v4 --case mixed " in line for line in r.stdout.splitlines())
    assert r.stderr.strip().splitlines() == [f"modelled v4 mixed (no estimate: {coverage.NEEDS_A_DEVICE['v4']})"]


def test_buckets_sharing_a_workload_are_filled_not_explored():
    """An explore bucket whose generated batch a smaller explore bucket already prices is
    filled from that bucket's configs instead of searched again (``coverage.bucket_roles``)."""
    def batch(case, t):
        w = coverage.sweep_workload(case, 128, t)
        return w.q_lens, w.kv_lens

    for case in coverage.CASES:
        explore, fill = coverage.bucket_roles(case, 128)
        assert sorted(explore + fill) == list(coverage.BUCKETS) and explore[0] == 128
        batches = [batch(case, t) for t in explore]
        assert len(set(batches)) == len(batches), case           # no batch searched twice
        for t in set(coverage.EXPLORE_BUCKETS) - set(explore):     # each dropped one is priced
            assert batch(case, t) in batches, (case, t)
    # decode: 64 sequences at every bucket; mixed and prefill: a batch that fills its bucket
    assert coverage.bucket_roles("decode", 128)[0] == (128,)
    assert coverage.bucket_roles("mixed", 256)[0] == coverage.bucket_roles("prefill", 256)[0] == coverage.EXPLORE_BUCKETS
    lines = [sw for sw in coverage.plan(generations=("v5e",)) if sw.case == "mixed"]
    assert lines and all(sw.buckets == ((128, 2048, 8192) if sw.role == "explore" else (256, 512, 1024, 4096))
                         for sw in lines)


def test_an_entry_tuned_on_a_batch_the_plan_no_longer_sweeps_is_stale():
    """``coverage.on_retired_workload``: an entry tuned on the batch the plan's sweep priced
    at its key before (mixed until 2026-11-29) is stale; one on the current batch, on a
    user's own batch, or of a key outside the plan's format is not judged stale, and a
    window or soft cap recorded after the batch's id does not matter."""
    import dataclasses
    from kernel.config import BlockSizes, TuningKey
    from kernel.tables import Entry
    key = TuningKey(generation="v6e", case="mixed", q_dtype="bfloat16", kv_dtype="bfloat16", num_q_heads=8,
                    num_kv_heads=1, head_dim=128, page_size=128, max_num_tokens=512, max_model_len=8192,
                    sliding_window=False)

    def stale(wid, **kw):
        return coverage.on_retired_workload(Entry(
            key=dataclasses.replace(key, **kw), block_sizes=BlockSizes(32, 512, 32, 512), promoted=True,
            decision="", metric=1.0, unit="s", method="estimate", provenance={"workload_id": wid}))

    for (case, t), wids in coverage.RETIRED_SWEEP_WORKLOADS.items():   # retired: never the current batch
        assert coverage.sweep_workload_id(case, 128, t) not in wids and coverage.sweep_workload_id(case, 256, t) not in wids
    retired = coverage.RETIRED_SWEEP_WORKLOADS[("mixed", 512)][0]
    assert stale(retired) and stale(retired + "-sw4096-cap50")
    assert not stale(coverage.sweep_workload_id("mixed", 128, 512)) and not stale("0123456789ab")
    assert not stale(retired, max_model_len=4096) and not stale(retired, case="prefill")
    # the old bucket-512 step (a 128-token chunk, 256 tokens) is the new bucket-256 step
    assert retired == coverage.sweep_workload_id("mixed", 128, 256) and not stale(retired, max_num_tokens=256)
    assert all(coverage.RETIRED_SWEEP_WORKLOADS.get(("mixed", t)) for t in coverage.BUCKETS if t > 128)


# ------------------------------------------------------------------ the device plan (issue #102, item 4)
def _matrix(generations):
    """Every key of the matrix, from its parts (not from the plan): (gen, shape, case, page, bucket)."""
    return {(g, s.name, c, p, t) for g in generations for s in coverage.SHAPES for c in coverage.CASES
            for p in s.page_sizes for t in coverage.BUCKETS}


def _keys(sweeps):
    return {(sw.generation, sw.shape.name, sw.case, sw.page_size, t) for sw in sweeps for t in sw.buckets}


def test_the_tpu_plan_is_every_key_of_the_matrix_each_searched():
    """The tpu backend times any key, so its plan is the whole matrix, v4 and TPU7x prefill /
    mixed included (the compile plan skips them), and each key's every bucket is searched
    (one sweep per key, no fill sweeps: their seeds are the compile backend's)."""
    tpu = coverage.plan(backend="tpu")
    assert _keys(tpu) == _matrix(coverage.GENERATIONS)
    assert all(sw.role == "explore" and sw.buckets == coverage.BUCKETS for sw in tpu)
    assert len(tpu) == len({_key(sw) for sw in tpu})                      # one sweep per key
    device_only = _keys(tpu) - _keys(coverage.plan(estimable_only=True))
    assert {(k[0], k[2]) for k in device_only} == {("v4", c) for c in coverage.CASES} | {
        ("tpu7x", "prefill"), ("tpu7x", "mixed")}
    # the estimable-only compile plan: v4 absent, TPU7x prefill / mixed skipped; the compile
    # plan: every key (modelled where no estimate is possible)
    assert {sw.generation for sw in coverage.plan(estimable_only=True)} == set(coverage.ESTIMABLE)
    assert _keys(coverage.plan()) == _matrix(coverage.GENERATIONS)
    with pytest.raises(ValueError, match="valid are compile, tpu"):
        coverage.plan(backend="gpu")


def test_plan_cli_tpu_lists_device_only_keys_and_here_needs_a_tpu(monkeypatch):
    r = _plan("--backend", "tpu", "--gen", "v4", "--gen", "tpu7x")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == len(coverage.plan(generations=("v4", "tpu7x"), backend="tpu"))
    for gen, case in [("v4", "decode"), ("v4", "prefill"), ("v4", "mixed"), ("tpu7x", "prefill"),
                      ("tpu7x", "mixed")]:
        assert any(f" --tpu {gen} --case {case} " in line for line in lines), (gen, case)
    # --here: the generation of the TPU on this machine, or one line and exit 2
    env = _fake_env(None)
    r = subprocess.run([sys.executable, "-m", "rpa_tune.coverage", "plan", "--backend", "tpu", "--here"], cwd=REPO,
                       capture_output=True, text=True, timeout=120, env=env)
    if not Path("/dev/accel0").exists():
        assert r.returncode == 2 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "no TPU" in r.stderr and "--dry-run" in r.stderr
    r = subprocess.run([sys.executable, "-m", "rpa_tune.coverage", "plan", "--backend", "tpu", "--here"], cwd=REPO,
                       capture_output=True, text=True, timeout=120, env=_fake_env("tpu7x"))
    assert r.returncode == 0, r.stderr
    assert {line.split()[2] for line in r.stdout.splitlines()} == {"tpu7x"}
    assert len(r.stdout.splitlines()) == len(coverage.plan(generations=("tpu7x",), backend="tpu"))
    r = subprocess.run([sys.executable, "-m", "rpa_tune.coverage", "plan", "--backend", "tpu", "--here", "--gen",
                        "v6e"], cwd=REPO, capture_output=True, text=True, timeout=120, env=_fake_env("tpu7x"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "v6e" in r.stderr, r.stderr
    r = _plan("--here")
    assert r.returncode == 2 and "needs --backend tpu" in r.stderr


TESTS = str(Path(__file__).resolve().parent)
GENERATE = str(REPO / "tables" / "generate.sh")


def _fake_env(generation, **extra):
    import os
    e = {k: v for k, v in os.environ.items() if not k.startswith(("TPU_", "RPA_TUNE_FAKE"))
         and k not in ("GENS", "SHAPES", "CASES", "SHARD", "CHIP", "EXPORT", "REPLACE")}
    e.update(PYTHONPATH=TESTS + os.pathsep + e.get("PYTHONPATH", ""), PYTHON=sys.executable)
    e.update(extra)
    if generation:
        e["RPA_TUNE_FAKE_TPU"] = f"fake_tpu:{generation}"
    return e


def _generate(*args, env, timeout=300):
    return subprocess.run(["bash", GENERATE, *args], cwd=REPO, capture_output=True, text=True, env=env,
                          timeout=timeout)


def test_generate_dry_run_tpu_lists_the_device_plan_with_its_options(tmp_path):
    """`tables/generate.sh --backend tpu --dry-run` on CPU: the sweeps of every generation's
    device plan (v4 and TPU7x prefill / mixed included), each a `--backend tpu` sweep with
    the storage passed through and no compile-only option; nothing is run or written."""
    url = f"sqlite:///{tmp_path}/fleet.db"
    r = _generate("--backend", "tpu", "--dry-run", "--storage", url, env=_fake_env(None))
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stdout.splitlines() if line.startswith("[")]
    want = coverage.plan(backend="tpu")
    assert len(lines) == len(want)
    for line, sw in zip(lines, want):
        assert f"rpa-tune sweep {' '.join(sw.args())} --backend tpu " in line, line
        assert line.endswith(f"--results tables/results --storage {url}"), line
        assert "--seeds" not in line and "--jobs" not in line
        budget = 30 if sw.case == "decode" else 12
        assert f" --budget {budget} --refine 32 " in line
    for gen, case in [("v4", "prefill"), ("v4", "mixed"), ("tpu7x", "prefill"), ("tpu7x", "mixed")]:
        assert any(f"--tpu {gen} --case {case} " in line for line in lines), (gen, case)
    assert not (tmp_path / "fleet.db").exists()
    # the compile plan's dry run: every key with its seeds, v4 and TPU7x prefill / mixed modelled
    r = _generate("--dry-run", env=_fake_env(None, GENS="v4 tpu7x", SHAPES="llama3-8b"))
    lines = [line for line in r.stdout.splitlines() if line.startswith("[")]
    want = coverage.plan(generations=("v4", "tpu7x"), shapes=(coverage.SHAPES[3],))
    assert r.returncode == 0 and len(lines) == len(want) and all("--seeds 8" in x for x in lines), r.stderr
    assert "modelled v4 decode" in r.stderr and "modelled tpu7x mixed" in r.stderr


def test_generate_refuses_bad_input_and_a_missing_tpu_in_one_line(tmp_path):
    env = _fake_env(None)
    for args, words in [(["--backend", "gpu"], "'gpu'"), (["--storage", "bogus"], "'bogus'"), (["--frobnicate"],
                                                                                              "'--frobnicate'"),
                        (["--storage"], "needs a URL")]:
        r = _generate(*args, env=env)
        assert r.returncode == 2 and r.stdout == "", (args, r.stdout)
        assert len(r.stderr.strip().splitlines()) == 1 and words in r.stderr, (args, r.stderr)
    if not Path("/dev/accel0").exists():
        r = _generate("--backend", "tpu", env=env)
        assert r.returncode == 2 and "sweep" not in r.stdout
        assert len(r.stderr.strip().splitlines()) == 1 and "no TPU" in r.stderr, r.stderr


def test_generate_on_a_tpu_runs_its_generations_device_plan_and_exports_the_fleets_rows(tmp_path):
    """On a (stand-in) TPU7x chip, with a storage and CHIP=1: the sweeps of TPU7x's prefill
    and mixed keys (no estimate exists for them), each with --backend tpu and the storage, in
    a process pinned to chip 1; then compaction and an export of the local results and the
    storage. The sweeps and export are recorded by a stand-in Python, not run."""
    log = tmp_path / "calls.log"
    shim = tmp_path / "python"
    shim.write_text(f"""#!/bin/bash
if [ "$1" = -m ] && [ "$2" = rpa_tune.coverage ]; then exec {sys.executable} "$@"; fi
if [ "$1" = -c ] && [[ "$2" == *parse_storage* ]]; then exec {sys.executable} "$@"; fi
echo "TPU_VISIBLE_CHIPS=$TPU_VISIBLE_CHIPS TPU_PROCESS_BOUNDS=$TPU_PROCESS_BOUNDS $*" >> {log}
""")
    shim.chmod(0o755)
    url = str(tmp_path / "fleet.journal")
    env = _fake_env("tpu7x", PYTHON=str(shim), SHAPES="llama3-70b-tp8", CASES="prefill mixed", CHIP="1")
    r = _generate("--backend", "tpu", "--storage", url, env=env)
    assert r.returncode == 0, r.stderr
    calls = log.read_text().splitlines()
    sweeps = [c for c in calls if " -m rpa_tune.cli sweep " in c]
    want = coverage.plan(generations=("tpu7x",), shapes=(coverage.SHAPES[0],), cases=("prefill", "mixed"),
                         backend="tpu")
    assert len(sweeps) == len(want) == 4
    for c, sw in zip(sweeps, want):
        assert c.startswith("TPU_VISIBLE_CHIPS=1 TPU_PROCESS_BOUNDS=1,1,1 -m rpa_tune.cli sweep "), c
        assert f"sweep {' '.join(sw.args())} --backend tpu " in c and c.endswith(f"--storage {url}"), c
    assert "compact_results" in calls[-2]
    assert calls[-1].endswith(f"-m rpa_tune.cli export --results tables/results --results {url} --out tables")
