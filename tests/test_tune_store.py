"""The append-only Parquet results store."""
import datetime as dt

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from rpa_tune.store import COLUMNS, SCHEMA, ResultStore, config_id


def row(cid, status="ok", metric=1e-4, **kw):
    r = dict(generation="v6e", case="decode", q_dtype="bfloat16", kv_dtype="bfloat16", num_q_heads=32,
             num_kv_heads=8, head_dim=128, page_size=128, max_num_tokens=2048, max_model_len=8192,
             sliding_window=False, key_id="k", workload_id="w", bq=1, bkv=512, cq=1, ckv=256, status=status,
             metric=metric, unit="s", method="estimate", backend="compile", config_id=cid,
             timestamp=dt.datetime.now(dt.timezone.utc))
    r.update(kw)
    return r


def test_append_read_roundtrip(tmp_path):
    st = ResultStore(tmp_path / "res")
    assert st.read().empty and list(st.read().columns) == list(COLUMNS)
    assert not (tmp_path / "res").exists(), "reading never creates the directory"
    p1 = st.append([row("a")])
    st.append([row("b", status="vmem_oom", metric=None, vmem_reported_bytes=70 << 20)])
    assert p1.parent == tmp_path / "res" and p1.suffix == ".parquet"
    df = st.read()
    assert len(df) == 2 and set(df["config_id"]) == {"a", "b"}
    assert df.loc[df.config_id == "b", "vmem_reported_bytes"].item() == 70 << 20
    assert not list((tmp_path / "res" / ".tmp").iterdir()), "no temp files left behind"
    # pandas / pyarrow read the directory as a dataset (the .tmp dir is ignored)
    (tmp_path / "res" / ".tmp" / "part-x.parquet.tmp").write_bytes(b"PAR1 half written")
    assert len(pd.read_parquet(tmp_path / "res")) == 2


def test_recorded_keeps_the_latest_row(tmp_path):
    st = ResultStore(tmp_path)
    t0 = dt.datetime(2025, 1, 1, tzinfo=dt.timezone.utc)
    st.append([row("a", status="timeout", metric=None, timestamp=t0)])
    st.append([row("a", status="ok", metric=2e-4, timestamp=t0 + dt.timedelta(seconds=5))])
    rec = st.recorded()
    assert rec["a"]["status"] == "ok" and rec["a"]["metric"] == 2e-4


def test_foreign_and_older_files_do_not_break_reading(tmp_path):
    st = ResultStore(tmp_path)
    st.append([row("a")])
    (tmp_path / "garbage.parquet").write_bytes(b"not parquet")
    old = pa.table({"config_id": ["old"], "status": ["ok"], "metric": [3.0], "bq": [1]})
    pq.write_table(old, tmp_path / "part-old.parquet")     # an older schema version
    df = st.read()
    assert set(df["config_id"]) == {"a", "old"}
    assert df.loc[df.config_id == "old", "bkv"].isna().all()


def test_config_id_depends_on_everything_that_changes_a_result():
    base = config_id("k", "w", (1, 512, 1, 256), "compile", "h1", "compile-1")
    assert base == config_id("k", "w", [1, 512, 1, 256], "compile", "h1", "compile-1")
    for other in (config_id("k2", "w", (1, 512, 1, 256), "compile", "h1", "compile-1"),
                  config_id("k", "w2", (1, 512, 1, 256), "compile", "h1", "compile-1"),
                  config_id("k", "w", (1, 512, 1, 128), "compile", "h1", "compile-1"),
                  config_id("k", "w", (1, 512, 1, 256), "tpu", "h1", "compile-1"),
                  config_id("k", "w", (1, 512, 1, 256), "compile", "h2", "compile-1"),
                  config_id("k", "w", (1, 512, 1, 256), "compile", "h1", "compile-2")):
        assert other != base


def test_schema_has_the_documented_columns():
    for c in ("generation", "case", "q_dtype", "kv_dtype", "num_q_heads", "num_kv_heads", "head_dim", "page_size",
              "max_num_tokens", "max_model_len", "sliding_window", "key_id", "workload_id", "workload", "bq", "bkv",
              "cq", "ckv", "status", "metric", "unit", "method", "cycles", "estimate_s", "memory_bound_s",
              "compute_bound_s", "active_bound", "samples", "spread", "compile_s", "vmem_predicted_bytes",
              "vmem_limit_bytes", "vmem_reported_bytes", "message", "backend", "search", "seed", "jax_version",
              "jaxlib_version", "libtpu_version", "device_kind", "kernel_hash", "git_sha", "timestamp", "config_id"):
        assert c in SCHEMA.names, c


def test_legacy_source_hashes_read_as_their_version(tmp_path):
    """Rows written before kernel versions carry a source hash; the store reads the hashes
    of version 1's sources as ``k1`` and recomputes their resume ids, so a sweep of the
    same version skips them, while another hash stays as written."""
    from kernel.provenance import LEGACY_IDS, kernel_id
    from rpa_tune.store import ResultStore, config_id
    legacy = next(h for h, v in LEGACY_IDS.items() if v == kernel_id())
    store = ResultStore(tmp_path)
    for kh in (legacy, "0123456789abcdef"):
        store.append([dict(key_id="k", workload_id="w", bq=8, bkv=512, cq=8, ckv=256, backend="compile",
                           kernel_hash=kh, kernel_source_hash=kh, kernel_version=kh, evaluator_version="e1",
                           config_id=config_id("k", "w", (8, 512, 8, 256), "compile", kh, "e1"), status="ok")])
    df = store.read().sort_values("kernel_hash")
    assert list(df["kernel_hash"]) == ["0123456789abcdef", kernel_id()]
    assert list(df["kernel_version"]) == ["0123456789abcdef", kernel_id()]
    assert list(df["config_id"]) == [config_id("k", "w", (8, 512, 8, 256), "compile", h, "e1")
                                     for h in ("0123456789abcdef", kernel_id())]


def test_one_reader_one_policy_for_a_damaged_file(tmp_path, caplog):
    """The store, export and compaction read results through one reader: a damaged file is
    skipped and named, the other files are read, and compaction never deletes it."""
    import logging
    from rpa_tune import export as ex
    from rpa_tune.store import read_results_table
    from tables_synth import key, row, write_results
    k = key()
    write_results(tmp_path / "res", [row(k, (1, 256, 1, 256), 1e-4)], name="a.parquet")
    write_results(tmp_path / "res", [row(k, (1, 512, 1, 256), 2e-4)], name="b.parquet")
    (tmp_path / "res" / "c.parquet").write_bytes(b"PAR1 not really")
    caplog.set_level(logging.WARNING, logger="rpa_tune.store")
    got = read_results_table([tmp_path / "res"])
    assert got.table.num_rows == 2 and got.table.schema.names == list(COLUMNS)
    assert [f for f, _ in got.damaged] == [str(tmp_path / "res" / "c.parquet")]
    assert any("c.parquet" in r.getMessage() for r in caplog.records)
    assert len(ResultStore(tmp_path / "res").read()) == 2
    df = ex.read_results([tmp_path / "res"])
    assert len(df) == 2 and [f for f, _ in df.attrs["damaged"]] == [str(tmp_path / "res" / "c.parquet")]
    (part,) = ex.compact_results(tmp_path / "res")
    assert sorted(p.name for p in (tmp_path / "res").glob("*.parquet")) == sorted(["c.parquet", part.name])
    assert len(ResultStore(tmp_path / "res").read()) == 2
