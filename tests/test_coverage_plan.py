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


def test_cases_that_need_a_device_stay_in_the_matrix_but_are_not_swept():
    """TPU7x prefill / mixed: no audited estimate is possible (coverage.NEEDS_A_DEVICE_CASES).
    The generation's plan skips them, with a line on stderr; they stay matrix keys."""
    pairs = {(sw.generation, sw.case) for sw in coverage.plan(estimable_only=True)}
    assert {("tpu7x", "prefill"), ("tpu7x", "mixed")}.isdisjoint(pairs) and ("tpu7x", "decode") in pairs
    assert ("tpu7x", "prefill") in {(sw.generation, sw.case) for sw in coverage.plan()}
    assert any(k.generation == "tpu7x" and k.case == "mixed" for k in coverage.expected_keys())
    r = _plan("--gen", "tpu7x")
    assert r.returncode == 0 and r.stdout, r.stderr
    assert all(" --case decode " in line for line in r.stdout.splitlines())
    assert "skipped tpu7x prefill (needs a device" in r.stderr
    r = _plan("--gen", "tpu7x", "--case", "mixed")
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and "tpu7x mixed: no estimate is possible" in r.stderr


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
