"""The shipped tables: they load, mirror their Parquet, match their results, and compile."""
import logging
from pathlib import Path

import pytest

from kernel import bringup
from kernel import tables as kt

TABLES = Path(__file__).resolve().parent.parent / "tables"
FILES = sorted(TABLES.glob("*.json")) if TABLES.is_dir() else []
SAMPLE_PER_FILE = 2          # default suite; `-m slow` compiles every entry


def test_tables_are_shipped():
    """Not skipped when tables are missing: the checkout must ship them (and the kernel
    must find them in the checkout; tests/test_wheel.py checks an installed wheel)."""
    assert {p.stem for p in FILES} >= {"v5e", "v6e", "tpu7x"}, f"tables missing in {TABLES}"
    assert kt.shipped_table_dir() == TABLES


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_table_file_loads_and_mirrors(path):
    t = kt.Table.read(path)
    assert len(t) > 0
    assert t.to_json_text() == path.read_text(), "not in canonical form: re-export it"
    assert {e.key.generation for e in t.entries} == {path.stem}
    assert kt.Table.read(path.with_suffix(".parquet")) == t
    for e in t.entries:
        assert e.method in kt.METHODS and e.unit == "s"
        assert e.method != "modelled" or not e.promoted      # a modelled gain never promotes
        assert e.provenance["kernel_hash"] and e.provenance["libtpu_version"] and e.provenance["date"]
        if e.promoted:
            assert e.heuristic_metric is not None or "failed" in e.decision
            assert e.gain is None or e.gain > e.margin


def test_shipped_tables_cover_three_generations_cases_and_presets():
    """What the tables promise (docs/tables.md, "What is shipped"): v5e, v6e and TPU7x, each case,
    for the Llama-3-8B shard and two more presets (Llama-3-70B at TP8, Qwen3-32B at TP4),
    at the 2048-token bucket; an entry is written even where the heuristic was kept."""
    keys = {(e.key.generation, e.key.case, e.key.num_q_heads, e.key.num_kv_heads, e.key.max_num_tokens)
            for p in FILES for e in kt.Table.read(p).entries}
    missing = [(gen, case, q, kv) for gen in ("v5e", "v6e", "tpu7x") for case in ("decode", "prefill", "mixed")
               for q, kv in ((32, 8), (8, 1), (16, 2)) if (gen, case, q, kv, 2048) not in keys]
    assert not missing, missing


def test_shipped_tables_hold_every_key_the_coverage_claims():
    """rpa_tune.coverage.COMPLETE: every key of each (generation, shape, case) it lists, all
    page sizes and token buckets, has an entry in the shipped tables (promoted or not), not
    on a retired sweep workload. (An entry of an earlier kernel version is stale: `rpa-tune
    doctor` and the report say so; a version bump does not fail this test.)"""
    from rpa_tune import coverage
    names = {s.name for s in coverage.SHAPES}
    assert all(g in coverage.ESTIMABLE and n in names and c in coverage.CASES for g, n, c in coverage.COMPLETE)
    entries = {e.key: e for p in FILES for e in kt.Table.read(p).entries}
    claimed = [sw for sw in coverage.plan() if (sw.generation, sw.shape.name, sw.case) in coverage.COMPLETE]
    want = coverage.expected_keys(claimed)
    assert not claimed or {k.max_num_tokens for k in want} == set(coverage.BUCKETS)
    missing = [k.id() for k in want if k not in entries]
    assert not missing, missing
    retired = [k.id() for k in want if coverage.on_retired_workload(entries[k])]
    assert not retired, retired


def test_shipped_tables_load_without_problems(monkeypatch, caplog):
    for var in ("RPA_TABLE", "RPA_SHIPPED_TABLES", "RPA_TABLE_STRICT"):
        monkeypatch.delenv(var, raising=False)
    caplog.set_level(logging.WARNING, logger="kernel.tables")
    state = kt.load_tables()
    assert len(state.index) == sum(len(kt.Table.read(p)) for p in FILES)
    # only staleness warnings are acceptable (the kernel may have changed since tuning)
    for msg in state.warnings:
        assert "tuned for kernel version" in msg or "tuned with libtpu" in msg, msg


def test_committed_results_reproduce_the_tables():
    """CI's `rpa-tune export --results tables/results --out tables --check`."""
    from rpa_tune.export import build_tables, check_tables, read_results
    results = TABLES / "results"
    assert results.is_dir(), "the results behind the shipped tables are not committed"
    tables, _ = build_tables(read_results([results]))
    assert sorted(tables) == sorted(p.stem for p in FILES)
    problems = check_tables(tables, TABLES)
    assert not problems, "\n".join(f"{p.file}: {p.problem}\n{p.diff}" for p in problems)


def _sample(n):
    out = []
    for p in FILES:
        entries = list(kt.Table.read(p).entries)
        promoted = [e for e in entries if e.promoted] or entries
        from rpa_tune.cli_tables import sample_entries
        out.extend(sample_entries(promoted, n))
    return out


def _verify(entries):
    assert entries, "nothing to verify"
    results = bringup.verify_entries(entries, progress=False)
    bad = [(e.key.id(), tuple(e.block_sizes), v.error) for e, v in results if v.status != "compiled"]
    assert not bad, bad
    for e, v in results:
        assert v.block_sizes[0][1] == e.block_sizes


def test_sample_of_shipped_entries_compiles_deviceless():
    _verify(_sample(SAMPLE_PER_FILE))


@pytest.mark.slow
def test_every_shipped_entry_compiles_deviceless():
    _verify(_sample(None))


def test_tables_resolve_the_block_sizes_of_the_snapshot(monkeypatch):
    """For every key of the shipped tables, the kernel's table lookup resolves the block
    sizes it resolved from the tables of ``tests/snapshots/resolved_block_sizes.json``'s
    revision (None: not promoted, the heuristic applies), and no key was added or lost: a
    refactor leaves them alone; a deliberate re-ranking records a new snapshot
    (``tests/snapshots/make_resolved.py <revision>``)."""
    import json
    snap = json.loads((Path(__file__).parent / "snapshots" / "resolved_block_sizes.json").read_text())["entries"]
    for var in ("RPA_TABLE", "RPA_SHIPPED_TABLES", "RPA_TABLE_STRICT", *kt.ENV_BLOCK_SIZES.values()):
        monkeypatch.delenv(var, raising=False)
    kt.reset()
    got = {}
    for p in FILES:
        for e in kt.Table.read(p).entries:
            k = e.key
            dims = dict(max_num_tokens=k.max_num_tokens, num_q_heads=k.num_q_heads, num_kv_heads=k.num_kv_heads,
                        head_dim=k.head_dim, page_size=k.page_size, pages_per_seq=k.max_model_len // k.page_size,
                        q_dtype=k.q_dtype, kv_dtype=k.kv_dtype)
            found = kt.lookup_block_sizes(k.case, generation=k.generation, dims=dims, sliding_window=k.sliding_window)
            got[k.id()] = None if found is None else list(found[0])
    kt.reset()
    assert got == snap
