"""rpa-tune export / diff: determinism, merging, promotion margin, --check."""
import json
import random

import pytest
import typer
from typer.testing import CliRunner

from kernel.tables import Table
from rpa_tune import export as ex
from rpa_tune.cli_tables import register, sample_entries
from tables_synth import key, row, write_results

runner = CliRunner()


def _app():
    app = typer.Typer()
    register(app)

    @app.callback()
    def _main():  # a callback keeps Typer in multi-command mode
        pass

    return app


def H(k):
    return tuple(ex.heuristic_for(k))


def _other_bs(k, i=0):
    """Legal configurations different from the heuristic's."""
    h = H(k)
    if k.case == "decode":
        cands = [(1, 2048, 1, 512), (1, 512, 1, 512), (1, 4096, 1, 1024), (1, 256, 1, 256)]
    else:
        cands = [(128, 1024, 64, 512), (64, 512, 64, 256), (32, 256, 32, 128), (256, 2048, 128, 512)]
    return [c for c in cands if c != h][i]


def _sweep_rows(keys, *, gains, method="estimate", **kw):
    rows = []
    for k, g in zip(keys, gains):
        base = 1e-4 * (1 + k.max_num_tokens / 1000)
        rows.append(row(k, H(k), base, method=method, **kw))
        rows.append(row(k, _other_bs(k, 0), base / (1 + g), method=method, **kw))
        rows.append(row(k, _other_bs(k, 1), base * 1.3, method=method, **kw))
    return rows


KEYS = [key(g, c, t=t) for g in ("v5e", "v6e") for c in ("decode", "prefill") for t in (64, 512)]


def _export(results, out):
    r = runner.invoke(_app(), ["export", "--results", str(results), "--out", str(out)])
    assert r.exit_code == 0, r.output
    return r


def test_export_is_byte_identical_and_order_independent(tmp_path):
    rows = _sweep_rows(KEYS, gains=[0.1, 0.01, 0.3, 0.05] * 2)
    write_results(tmp_path / "r1", rows)
    shuffled = rows[:]
    random.Random(0).shuffle(shuffled)
    write_results(tmp_path / "r2", shuffled[:7])
    write_results(tmp_path / "r2", shuffled[7:])
    _export(tmp_path / "r1", tmp_path / "a")
    _export(tmp_path / "r1", tmp_path / "b")
    _export(tmp_path / "r2", tmp_path / "c")
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == ["v5e.json", "v5e.parquet", "v6e.json", "v6e.parquet"]
    for n in names:
        a = (tmp_path / "a" / n).read_bytes()
        assert a == (tmp_path / "b" / n).read_bytes() == (tmp_path / "c" / n).read_bytes(), n
    # JSON and Parquet hold the same rows
    for g in ("v5e", "v6e"):
        assert Table.read(tmp_path / "a" / f"{g}.json") == Table.read(tmp_path / "a" / f"{g}.parquet")


def test_merge_several_sweeps_and_duplicates(tmp_path):
    rows = _sweep_rows(KEYS, gains=[0.1] * len(KEYS))
    write_results(tmp_path / "m1", rows[:12])           # machine 1: half the keys
    write_results(tmp_path / "m2", rows[12:])           # machine 2: the other half
    write_results(tmp_path / "m2", rows[:3])            # an overlapping copy
    r = runner.invoke(_app(), ["export", "-r", str(tmp_path / "m1"), "-r", str(tmp_path / "m2"),
                               "--out", str(tmp_path / "out")])
    assert r.exit_code == 0, r.output
    write_results(tmp_path / "all", rows)
    _export(tmp_path / "all", tmp_path / "ref")
    for n in ("v5e.json", "v6e.json"):
        assert (tmp_path / "out" / n).read_bytes() == (tmp_path / "ref" / n).read_bytes()
    t = Table.read(tmp_path / "out" / "v6e.json")
    assert len(t) == 4 and all(e.samples == 1 for e in t.entries)   # the duplicate was dropped


def _one(rows):
    import pandas as pd
    tables, reports = ex.build_tables(ex.normalize_results(pd.DataFrame(rows)))
    return [r for r in reports if r.key is not None]


@pytest.mark.parametrize("gain, promoted", [(0.0199, False), (0.02, False), (0.0201, True), (0.5, True)])
def test_estimate_margin(gain, promoted):
    k = key()
    (rep,) = _one(_sweep_rows([k], gains=[gain]))
    e = rep.entry
    assert e.promoted is promoted, e.decision
    assert e.margin == ex.ESTIMATE_MIN_GAIN
    assert e.gain == pytest.approx(gain, abs=1e-6)
    assert tuple(e.block_sizes) == _other_bs(k, 0) and tuple(e.heuristic_block_sizes) == H(k)


@pytest.mark.parametrize("case, bs, gain, promoted", [
    ("prefill", (32, 256, 32, 128), 0.9, False),     # composed up to 48 % low: it must beat 92.3 %
    ("prefill", (32, 256, 32, 128), 1.0, True),
    ("prefill", (64, 512, 64, 256), 0.2, False),     # up to 18 % low: it must beat 22.0 %
    ("prefill", (64, 512, 64, 256), 0.25, True),
    ("prefill", (128, 1024, 64, 512), 0.05, True),   # bq 128 composed within 0.4 %: the plain margin
    ("mixed", (32, 256, 32, 128), 0.05, True),       # mixed keeps the plain margin
])
def test_a_small_q_prefill_estimate_must_beat_the_heuristic_by_its_composition_error(case, bs, gain, promoted):
    k = key("v6e", case, t=512)
    assert H(k)[0] >= 128
    (rep,) = _one([row(k, H(k), 1e-4), row(k, bs, 1e-4 / (1 + gain))])
    e = rep.entry
    assert tuple(e.block_sizes) == bs and e.promoted is promoted, e.decision
    if not promoted:
        assert "below whole compiles" in e.decision


@pytest.mark.parametrize("gain, rel_spread, promoted", [
    (0.05, 0.03, False),    # margin 2 x 3% = 6% > 5%
    (0.07, 0.03, True),
    (0.009, 0.0, False),    # floor 1%
    (0.011, 0.0, True),
])
def test_measured_margin_uses_spread(gain, rel_spread, promoted):
    k = key()
    base = 1e-4
    rows = [row(k, H(k), base, method="measured", spread=rel_spread, samples=20),     # spreads are relative
            row(k, _other_bs(k), base / (1 + gain), method="measured", spread=rel_spread, samples=20)]
    (rep,) = _one(rows)
    assert rep.entry.method == "measured"
    assert rep.entry.promoted is promoted, rep.entry.decision
    assert rep.entry.margin == pytest.approx(max(0.01, 2 * rel_spread), abs=1e-6)


def test_measured_rows_win_over_estimates():
    k = key()
    rows = _sweep_rows([k], gains=[0.5])                          # estimate says other_bs(0) is better
    rows += [row(k, H(k), 2e-4, method="measured", samples=10), row(k, _other_bs(k, 1), 1.5e-4, method="measured")]
    (rep,) = _one(rows)
    assert rep.entry.method == "measured" and tuple(rep.entry.block_sizes) == _other_bs(k, 1)


def test_no_heuristic_baseline_is_not_promoted():
    k = key()
    rows = [r for r in _sweep_rows([k], gains=[0.5]) if (r["bq"], r["bkv"], r["cq"], r["ckv"]) != H(k)]
    (rep,) = _one(rows)
    assert rep.entry.promoted is False and rep.entry.heuristic_metric is None and rep.entry.gain is None
    assert "no heuristic baseline" in rep.entry.decision


def test_failing_heuristic_promotes_best_and_disqualification():
    k = key()
    rows = [row(k, H(k), None, status="vmem_oom"), row(k, _other_bs(k, 0), 1e-4),
            row(k, _other_bs(k, 1), 0.5e-4), row(k, _other_bs(k, 1), None, status="wrong_result", method="correctness"),
            row(k, _other_bs(k, 2), 0.9e-4), row(k, _other_bs(k, 2), None, status="timeout")]
    (rep,) = _one(rows)
    e = rep.entry
    assert e.promoted and "failed" in e.decision and e.heuristic_metric is None
    assert tuple(e.block_sizes) == _other_bs(k, 2)      # other_bs(1) was wrong; a timeout disqualifies nothing


def test_a_failure_under_an_earlier_kernel_source_disqualifies_nothing():
    # the current source's heuristic fits (ok), the earlier source's ran out of VMEM: the
    # entry compares against the heuristic's estimate, not "the heuristic failed"
    k = key()
    rows = [row(k, H(k), None, status="vmem_oom", kernel_hash="old", timestamp="2025-01-01T00:00:00Z"),
            row(k, _other_bs(k, 0), None, status="vmem_oom", kernel_hash="old", timestamp="2025-01-01T00:00:00Z"),
            row(k, H(k), 1e-4), row(k, _other_bs(k, 0), 0.5e-4)]
    (rep,) = _one(rows)
    e = rep.entry
    assert e.heuristic_metric == pytest.approx(1e-4) and e.gain == pytest.approx(1.0)
    assert tuple(e.block_sizes) == _other_bs(k, 0) and e.promoted and "failed" not in e.decision
    # the same failure under the current source still disqualifies
    (rep,) = _one(rows + [row(k, _other_bs(k, 0), None, status="vmem_oom")])
    assert tuple(rep.entry.block_sizes) == H(k)


def test_heuristic_best_is_kept():
    k = key()
    rows = [row(k, H(k), 1e-4), row(k, _other_bs(k), 1.1e-4)]
    (rep,) = _one(rows)
    assert not rep.entry.promoted and tuple(rep.entry.block_sizes) == H(k) and rep.entry.gain == 0


def test_repeated_rows_are_aggregated_and_newest_kernel_wins():
    k = key()
    rows = [row(k, H(k), 1e-4, method="measured", spread=0.001, samples=5, timestamp=f"2025-11-2{i}T00:00:00Z")
            for i in range(3)]
    rows += [row(k, _other_bs(k), m, method="measured", spread=0.001, samples=5) for m in (0.8e-4, 0.9e-4, 0.85e-4)]
    rows += [row(k, _other_bs(k, 1), 0.1e-4, kernel_hash="old", timestamp="2025-01-01T00:00:00Z", method="measured")]
    (rep,) = _one(rows)
    e = rep.entry
    assert tuple(e.block_sizes) == _other_bs(k) and e.metric == pytest.approx(0.85e-4)
    # spread: relative, the larger of the rows' (0.1 %) and the rows' range over their median
    assert e.samples == 15 and e.spread == pytest.approx((0.9e-4 - 0.8e-4) / 0.85e-4)
    assert e.provenance["kernel_hash"] == "k0" and e.provenance["budget"] == 2


def test_a_newer_evaluator_version_supersedes_the_older_prices():
    """Rows of an evaluator version the key was re-priced under replace the older version's
    (never a median of both); a key not yet re-priced keeps its older rows."""
    k, k2 = key(), key(t=4096)
    old = dict(evaluator_version="compile-4", timestamp="2026-11-25T10:00:00Z")
    new = dict(evaluator_version="compile-5", timestamp="2026-11-26T10:00:00Z")
    rows = [row(k, H(k), 2e-4, **old), row(k, _other_bs(k, 0), 1e-4, **old), row(k, _other_bs(k, 1), 1.5e-4, **old),
            row(k, H(k), 2e-4, **new), row(k, _other_bs(k, 0), 1.9e-4, **new), row(k, _other_bs(k, 1), 1.5e-4, **new),
            row(k2, H(k2), 2e-4, **old), row(k2, _other_bs(k2, 0), 1e-4, **old)]
    reports = {r.key: r.entry for r in _one(rows)}
    assert tuple(reports[k].block_sizes) == _other_bs(k, 1) and reports[k].metric == pytest.approx(1.5e-4)
    assert tuple(reports[k2].block_sizes) == _other_bs(k2, 0) and reports[k2].metric == pytest.approx(1e-4)


def test_check_detects_stale_and_missing(tmp_path):
    rows = _sweep_rows(KEYS, gains=[0.1] * len(KEYS))
    write_results(tmp_path / "res", rows)
    out = tmp_path / "tables"
    _export(tmp_path / "res", out)
    app = _app()
    ok = runner.invoke(app, ["export", "-r", str(tmp_path / "res"), "--out", str(out), "--check"])
    assert ok.exit_code == 0, ok.output
    assert "up to date" in ok.output
    # a new sweep changes one key's winner: the committed table is stale
    k = KEYS[0]
    write_results(tmp_path / "res", [row(k, (1, 4096, 1, 1024) if k.case == "decode" else (256, 2048, 128, 512),
                                         1e-6, timestamp="2025-11-22T10:00:00Z")])
    stale = runner.invoke(app, ["export", "-r", str(tmp_path / "res"), "--out", str(out), "--check"])
    assert stale.exit_code == 1
    assert "stale" in stale.output and "-        \"bkv\"" in stale.output.replace("\r", "")
    assert f"{k.generation}.json" in stale.output
    before = (out / f"{k.generation}.json").read_bytes()
    assert before == (out / f"{k.generation}.json").read_bytes()       # --check writes nothing
    (out / "v6e.parquet").unlink()
    missing = runner.invoke(app, ["export", "-r", str(tmp_path / "res"), "--out", str(out), "--check"])
    assert missing.exit_code == 1 and "missing" in missing.output


def test_a_table_names_the_digest_of_its_results_and_check_fails_when_they_change(tmp_path):
    """``info["results_digest"]`` covers the generation's rows as export reads them, not the
    files holding them: the same rows split across files in another order give the same
    table; a new row that changes no entry (a slower config) changes the digest, so
    ``--check`` calls the table stale; another generation's rows leave it alone."""
    import hashlib
    rows = _sweep_rows(KEYS, gains=[0.1] * len(KEYS))
    write_results(tmp_path / "one", rows)
    for r in reversed(rows):
        write_results(tmp_path / "many", [r])
    _export(tmp_path / "one", tmp_path / "a")
    _export(tmp_path / "many", tmp_path / "b")
    for n in ("v5e.json", "v6e.json"):
        assert (tmp_path / "a" / n).read_bytes() == (tmp_path / "b" / n).read_bytes()
    v6e = [r for r in rows if r["generation"] == "v6e"]
    # an independent digest: the v6e rows' digest columns, each as JSON, sorted, hashed
    df = ex.read_results([tmp_path / "one"])
    recs = [r for r in df.to_dict("records") if r["generation"] == "v6e"]
    assert len(recs) == len(v6e)
    lines = sorted(json.dumps([r[c] for c in ex.digest_columns()]) for r in recs)
    want = "sha256:" + hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]
    assert Table.read(tmp_path / "a" / "v6e.json").info["results_digest"] == want
    v5e_before = (tmp_path / "a" / "v5e.json").read_bytes()
    k = next(k for k in KEYS if k.generation == "v6e")
    # an older price of another workload: the key's entry stays the one of its newest workload
    other = row(k, _other_bs(k, 2), 1e-9, timestamp="2025-11-22T09:00:00Z", workload_id="w-older")
    write_results(tmp_path / "one", [other])
    stale = runner.invoke(_app(), ["export", "-r", str(tmp_path / "one"), "--out", str(tmp_path / "a"), "--check"])
    assert stale.exit_code == 1 and "v6e.json" in stale.output and "v5e.json" not in stale.output
    assert "results_digest" in stale.output
    t, _ = ex.build_tables(ex.read_results([tmp_path / "one"]))
    assert t["v6e"].entries == Table.read(tmp_path / "a" / "v6e.json").entries
    _export(tmp_path / "one", tmp_path / "a")
    assert (tmp_path / "a" / "v5e.json").read_bytes() == v5e_before


def test_diff_command(tmp_path):
    write_results(tmp_path / "r1", _sweep_rows(KEYS[:3], gains=[0.1, 0.1, 0.1]))
    _export(tmp_path / "r1", tmp_path / "old")
    write_results(tmp_path / "r2", _sweep_rows(KEYS[1:4], gains=[0.1, 0.5, 0.1]))
    _export(tmp_path / "r2", tmp_path / "new")
    r = runner.invoke(_app(), ["diff", str(tmp_path / "old"), str(tmp_path / "new"), "--fields"])
    assert r.exit_code == 1, r.output                      # entries differ: exit 1 (for scripts / CI)
    assert "1 added, 1 removed, 1 changed" in r.output.replace("\n", " ")
    same = runner.invoke(_app(), ["diff", str(tmp_path / "old"), str(tmp_path / "old")])
    assert same.exit_code == 0 and "0 added, 0 removed, 0 changed" in same.output
    js = runner.invoke(_app(), ["diff", str(tmp_path / "old"), str(tmp_path / "new"), "--json"])
    assert js.exit_code == 1
    doc = json.loads(js.stdout)
    assert doc["counts"] == {"added": 1, "removed": 1, "changed": 1}
    assert [(x["change"], x["key"]) for x in doc["rows"]] == [("removed", KEYS[0].id()), ("changed", KEYS[2].id()),
                                                              ("added", KEYS[3].id())]
    assert "metric" in doc["rows"][1]["changed_fields"]
    old, new = ex.load_table_path(tmp_path / "old"), ex.load_table_path(tmp_path / "new")
    rows = ex.diff_tables(old, new)
    assert [x.change for x in rows] == ["removed", "changed", "added"]
    ch = rows[1]
    assert ch.metric_change == pytest.approx(1.1 / 1.5 - 1)
    assert "metric" in ex.changed_fields(ch.old, ch.new)


def test_sample_entries_deterministic():
    xs = list(range(10))
    assert sample_entries(xs, 3) == [0, 3, 6]
    assert sample_entries(xs, None) == xs and sample_entries(xs, 20) == xs


def test_vmem_limit_recorded_only_when_not_the_kernel_default():
    from kernel.api import default_case_vmem_limit
    k = key()
    bs = _other_bs(k)
    default = default_case_vmem_limit(bs, generation=k.generation, num_q_heads=k.num_q_heads,
                                      num_kv_heads=k.num_kv_heads, head_dim=k.head_dim, page_size=k.page_size,
                                      q_dtype=k.q_dtype, kv_dtype=k.kv_dtype)
    for evaluated, want in ((None, None), (default, None), (default + (8 << 20), default + (8 << 20))):
        rows = [row(k, H(k), 1e-4), row(k, bs, 0.5e-4, vmem_limit_bytes=evaluated)]
        (rep,) = _one(rows)
        assert rep.entry.vmem_limit_bytes == want


def test_store_layout_hidden_dirs_and_source_hash(tmp_path):
    k = key()
    rows = [row(k, H(k), 1e-4, kernel_source_hash="feedbeef"), row(k, _other_bs(k), 0.5e-4, kernel_source_hash="feedbeef")]
    write_results(tmp_path / "res", rows)
    write_results(tmp_path / "res" / ".tmp", [row(k, _other_bs(k, 1), 1e-9)])     # unfinished: ignored
    t, _ = ex.build_tables(ex.read_results([tmp_path / "res"]))
    (e,) = t["v6e"].entries
    assert tuple(e.block_sizes) == _other_bs(k) and e.provenance["kernel_hash"] == "feedbeef"


def test_compact_results_keeps_rows_and_never_rewrites_a_compacted_part(tmp_path):
    """Compaction merges the one-row parts of a sweep into new compacted parts, one per
    generation, and removes only those; a later compaction leaves the earlier parts byte for
    byte and adds one part for the new rows. The export reads the same tables throughout."""
    from rpa_tune.store import is_compact
    rows = _sweep_rows(KEYS, gains=[0.1] * len(KEYS))
    for r in rows:
        write_results(tmp_path / "res", [r])
    _export(tmp_path / "res", tmp_path / "before")
    first = ex.compact_results(tmp_path / "res")
    assert sorted(p.name for p in (tmp_path / "res").iterdir()) == sorted(p.name for p in first)
    _export(tmp_path / "res", tmp_path / "compacted")
    for n in ("v5e.json", "v6e.json"):       # the same rows, in other files: the same tables
        assert (tmp_path / "before" / n).read_bytes() == (tmp_path / "compacted" / n).read_bytes()
    assert len(first) == 2 and all(is_compact(p) for p in first)        # v5e and v6e
    assert sorted(p.name.split("-")[2] for p in first) == ["v5e", "v6e"]
    kept = {p: p.read_bytes() for p in first}
    assert ex.compact_results(tmp_path / "res") == []                     # nothing new: nothing written
    later = dict(rows[0], timestamp="2030-01-01T00:00:00Z", config_id="later")
    write_results(tmp_path / "res", [later])                             # a later sweep appends a part
    (second,) = ex.compact_results(tmp_path / "res")
    assert second not in kept and {p: p.read_bytes() for p in first} == kept
    assert sorted((tmp_path / "res").iterdir()) == sorted(first + [second])
    _export(tmp_path / "res", tmp_path / "after")
    for n in ("v5e.json", "v6e.json"):       # one more row: the same entries (the digest names it)
        assert Table.read(tmp_path / "before" / n).entries == Table.read(tmp_path / "after" / n).entries


def test_a_compacted_part_holds_the_rows_without_diagnostics_and_stays_under_its_size(tmp_path):
    """Every row survives compaction with its other columns as recorded; the diagnostic
    columns are left out; a generation larger than the size limit is split into parts under
    it (a single row is the smallest part)."""
    import pandas as pd
    from rpa_tune.store import COLUMNS, DIAGNOSTIC_COLUMNS, ResultStore, compact
    rows = [dict(r, eval_s=1.5, compile_s=2.5, message="m" * 200) for r in _sweep_rows(KEYS, gains=[0.1] * len(KEYS))]
    for r in rows:
        write_results(tmp_path / "res", [r])
    store = ResultStore(tmp_path / "res")
    before = store.read()
    parts = compact(tmp_path / "res", max_bytes=9_000)
    after = store.read()
    assert len(parts) > 2                                                  # split below one part per generation
    for p in parts:
        assert p.stat().st_size <= 9_000 or len(pd.read_parquet(p)) == 1
        assert not set(DIAGNOSTIC_COLUMNS) & set(pd.read_parquet(p).columns)
        assert len(set(pd.read_parquet(p)["generation"])) == 1
    assert after["eval_s"].isna().all() and after["compile_s"].isna().all()
    same = [c for c in COLUMNS if c not in DIAGNOSTIC_COLUMNS]
    order = ["config_id", "timestamp", "bq", "bkv", "cq", "ckv", "key_id"]
    pd.testing.assert_frame_equal(before[same].sort_values(order).reset_index(drop=True),
                                  after[same].sort_values(order).reset_index(drop=True))


def test_export_merges_into_existing_tables_and_says_what_changed(tmp_path):
    """Exporting one new key into a directory that holds a table keeps its other entries;
    only --replace drops them, and says so."""
    out = tmp_path / "tables"
    v6e = [k for k in KEYS if k.generation == "v6e"]
    write_results(tmp_path / "all", _sweep_rows(v6e, gains=[0.1] * 4))
    _export(tmp_path / "all", out)
    before = Table.read(out / "v6e.json")
    assert len(before) == 4
    # a later sweep of one key finds a better config
    k = v6e[0]
    write_results(tmp_path / "one", _sweep_rows([k], gains=[0.5]))
    r = runner.invoke(_app(), ["export", "-r", str(tmp_path / "one"), "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "v6e: 0 added, 1 changed, 0 unchanged, 3 kept from the existing table" in r.output
    after = Table.read(out / "v6e.json")
    assert set(after.by_key()) == set(before.by_key())
    assert after.by_key()[k].gain == pytest.approx(0.5) and before.by_key()[k].gain == pytest.approx(0.1)
    for other in v6e[1:]:
        assert after.by_key()[other] == before.by_key()[other]
    assert Table.read(out / "v6e.parquet") == after
    # entries of an earlier export kept beside the new ones: no one set of results made the table
    assert "results_digest" in before.info and "results_digest" not in after.info
    # --check compares with the merged table, which is now what is on disk
    ok = runner.invoke(_app(), ["export", "-r", str(tmp_path / "one"), "--out", str(out), "--check"])
    assert ok.exit_code == 0, ok.output
    # --replace drops the other keys, and says so
    js = runner.invoke(_app(), ["export", "-r", str(tmp_path / "one"), "--out", str(out), "--replace", "--json"])
    assert js.exit_code == 0, js.output
    doc = json.loads(js.stdout)
    assert doc["tables"]["v6e"]["dropped"] == [x.id() for x in v6e[1:]]
    assert doc["tables"]["v6e"]["unchanged"] == [k.id()] and doc["tables"]["v6e"]["entries"] == 1
    assert [x["key"] for x in doc["keys"]] == [k.id()]
    assert len(Table.read(out / "v6e.json")) == 1


def test_export_refuses_to_overwrite_an_unreadable_table(tmp_path):
    out = tmp_path / "tables"
    out.mkdir()
    (out / "v6e.json").write_text("{ not json")
    write_results(tmp_path / "res", _sweep_rows([KEYS[4]], gains=[0.1]))
    r = runner.invoke(_app(), ["export", "-r", str(tmp_path / "res"), "--out", str(out)])
    assert r.exit_code == 2 and "invalid JSON" in r.output and "--replace" in r.output
    assert (out / "v6e.json").read_text() == "{ not json" and not (out / "v6e.parquet").exists()


def test_export_names_workload_ambiguity_and_lets_the_user_choose(tmp_path):
    k = KEYS[4]
    assert (k.generation, k.case) == ("v6e", "decode")
    old = [dict(r, workload_id="wA", workload="old workload", timestamp="2025-11-20T10:00:00Z")
           for r in _sweep_rows([k], gains=[0.3])]
    new = [dict(r, workload_id="wB", workload="new workload", timestamp="2025-11-22T10:00:00Z")
           for r in _sweep_rows([k], gains=[0.05])]
    write_results(tmp_path / "res", old + new)
    r = runner.invoke(_app(), ["export", "-r", str(tmp_path / "res"), "--out", str(tmp_path / "a")])
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert f"{k.id()}: results for 2 workloads; used the newest, wB (new workload); others: wA (old workload)" in text
    assert "--workload-id" in text
    e = Table.read(tmp_path / "a" / "v6e.json").by_key()[k]
    assert e.provenance["workload_id"] == "wB" and e.gain == pytest.approx(0.05)
    r = runner.invoke(_app(), ["export", "-r", str(tmp_path / "res"), "--out", str(tmp_path / "b"),
                               "--workload-id", "wA"])
    assert r.exit_code == 0 and "workloads" not in r.output
    e = Table.read(tmp_path / "b" / "v6e.json").by_key()[k]
    assert e.provenance["workload_id"] == "wA" and e.gain == pytest.approx(0.3)


def test_estimates_of_a_case_that_needs_a_device_are_not_promoted():
    """TPU7x prefill / mixed estimates are refused (rpa_tune.coverage.NEEDS_A_DEVICE_CASES):
    a winning estimate there is written, not promoted, and says why; a device measurement is."""
    k = key("tpu7x", "prefill", t=512)
    (rep,) = _one(_sweep_rows([k], gains=[0.5]))
    assert rep.entry.promoted is False and "tpu7x prefill estimates are refused" in rep.entry.decision
    assert "--backend tpu" in rep.entry.decision
    (rep,) = _one(_sweep_rows([k], gains=[0.5], method="measured"))
    assert rep.entry.promoted is True, rep.entry.decision
    (rep,) = _one(_sweep_rows([key("tpu7x", "decode")], gains=[0.5]))
    assert rep.entry.promoted is True, rep.entry.decision


def test_a_heuristic_evaluated_without_an_audited_estimate_is_named_as_such():
    """An evaluated heuristic whose estimate failed the audit (metric NaN) is no baseline; the
    decision says so instead of asking for it to be evaluated."""
    k = key()
    rows = _sweep_rows([k], gains=[0.5])
    for r in rows:
        if (r["bq"], r["bkv"], r["cq"], r["ckv"]) == H(k):
            r["metric"] = float("nan")
    (rep,) = _one(rows)
    assert rep.entry.promoted is False and rep.entry.heuristic_metric is None
    assert "was evaluated, but its estimate failed the audit" in rep.entry.decision, rep.entry.decision
