"""kernel.tables: schema round trips, lookup precedence, bucketing, fallbacks, logging."""
import json
import logging
import os
import threading
import time

import pytest

from kernel import tables as kt
from kernel.api import resolve_block_sizes
from kernel.config import BlockSizes, Case
from tables_synth import dims_for, entry, isolated_tables, key, table  # noqa: F401

DEC = Case.DECODE


def _heuristic(k):
    return resolve_block_sizes(Case(k.case), None, generation=k.generation, dims=dims_for(k),
                               sliding_window=k.sliding_window)


def _resolve(k, explicit=None):
    return resolve_block_sizes(Case(k.case), explicit, generation=k.generation, dims=dims_for(k),
                               sliding_window=k.sliding_window)


def _warnings(caplog):
    return [r for r in caplog.records if r.name == "kernel.tables" and r.levelno == logging.WARNING]


# ------------------------------------------------------------------------------ schema
def test_json_is_canonical_and_sorted(tmp_path):
    a = entry(key(t=512), (1, 2048, 1, 512))
    b = entry(key(t=64), (1, 1024, 1, 256))
    c = entry(key(case="prefill", t=64), (128, 512, 64, 256), promoted=False)
    t1, t2 = table(a, b, c), table(c, a, b)
    assert t1.to_json_text() == t2.to_json_text()
    text = t1.to_json_text()
    assert text.endswith("}\n")
    doc = json.loads(text)
    assert text == json.dumps(doc, indent=2, sort_keys=True) + "\n"
    assert doc["schema_version"] == kt.SCHEMA_VERSION
    ids = [kt.Entry.from_dict(e).key for e in doc["entries"]]
    assert ids == sorted(ids)                       # numeric key order: t64 before t512
    assert [i.max_num_tokens for i in ids if i.case == "decode"] == [64, 512]
    assert kt.Table.from_json_text(text) == t1


def test_json_parquet_round_trip(tmp_path):
    es = [entry(key(t=t, case=c), bs, promoted=(t != 128), heuristic_block_sizes=BlockSizes(*bs),
                heuristic_metric=2e-4, gain=0.5, margin=0.02, samples=3, spread=1e-6)
          for t in (16, 128, 1024) for c, bs in (("decode", (1, 1024, 1, 512)), ("mixed", (64, 512, 32, 256)))]
    es.append(entry(key(t=2048, sw=True, kv_dtype="float8_e4m3fn"), (1, 512, 1, 512)))  # nulls
    t = table(*es)
    t.write_json(tmp_path / "v6e.json")
    t.write_parquet(tmp_path / "v6e.parquet")
    from_json = kt.Table.read(tmp_path / "v6e.json")
    from_pq = kt.Table.read(tmp_path / "v6e.parquet")
    assert from_json == t == from_pq
    assert from_pq.to_json_text() == (tmp_path / "v6e.json").read_text()
    # Parquet bytes are deterministic too
    assert t.to_parquet_bytes() == from_pq.to_parquet_bytes()


@pytest.mark.parametrize("bad, needle", [
    ("{not json", "invalid JSON"),
    ('{"schema_version": 99, "entries": []}', "newer"),
    ('{"schema_version": 1}', "entries"),
    ('{"schema_version": 1, "entries": [{"key": {}}]}', "key misses"),
    ('[1, 2]', "top level"),
])
def test_bad_documents_raise_table_error(bad, needle):
    with pytest.raises(kt.TableError, match=needle):
        kt.Table.from_json_text(bad)


def test_illegal_block_sizes_in_table_rejected():
    d = table(entry(key(), (1, 1024, 1, 512))).to_dict()
    d["entries"][0]["block_sizes"]["ckv"] = 100          # not a multiple of page 128
    with pytest.raises(kt.TableError, match="illegal"):
        kt.Table.from_dict(d)
    d["entries"][0]["block_sizes"]["ckv"] = 512
    d["entries"].append(d["entries"][0])
    with pytest.raises(kt.TableError, match="duplicate"):
        kt.Table.from_dict(d)


# --------------------------------------------------------------------------- precedence
def test_precedence_explicit_env_table_heuristic(tmp_path, monkeypatch, isolated_tables):
    k = key(t=64)
    heur, src = _heuristic(k)
    assert src == "heuristic"
    tabled = (1, 512, 1, 256) if tuple(heur) != (1, 512, 1, 256) else (1, 256, 1, 256)
    table(entry(k, tabled)).write_json(tmp_path / "t.json")
    isolated_tables(tmp_path / "t.json")
    bs, src = _resolve(k)
    assert tuple(bs) == tabled and src.startswith("table:") and "bucket" not in src
    monkeypatch.setenv("RPA_D_BLOCK_SIZES", "1, 2048, 1, 1024")
    assert _resolve(k) == (BlockSizes(1, 2048, 1, 1024), "env:RPA_D_BLOCK_SIZES")
    # the env variable of another case does not apply to decode
    monkeypatch.delenv("RPA_D_BLOCK_SIZES")
    monkeypatch.setenv("RPA_P_BLOCK_SIZES", "128,512,128,256")
    assert tuple(_resolve(k)[0]) == tabled
    monkeypatch.setenv("RPA_D_BLOCK_SIZES", "1,2048,1,1024")
    assert _resolve(k, explicit=(1, 128, 1, 128)) == (BlockSizes(1, 128, 1, 128), "explicit")
    # RPA_TABLE=none: the heuristic
    monkeypatch.delenv("RPA_D_BLOCK_SIZES")
    monkeypatch.setenv("RPA_TABLE", "none")
    kt.reset()
    assert _resolve(k) == (heur, "heuristic")


def test_an_analysis_program_takes_the_heuristic_for_unset_cases_whatever_the_tables(tmp_path, monkeypatch,
                                                                                      isolated_tables):
    """``build_options(heuristic_only=True)`` (what the estimator's lowering asks for): a case
    without explicit sizes resolves to the heuristic even where a table entry or
    ``RPA_{D,P,M}_BLOCK_SIZES`` would give others; explicit sizes stay; nothing process-wide
    changes, so a serving call's resolution is unaffected."""
    from kernel.api import build_options
    k = key(t=64)
    heur, _ = _heuristic(k)
    tabled = (1, 512, 1, 256) if tuple(heur) != (1, 512, 1, 256) else (1, 256, 1, 256)
    table(entry(k, tabled)).write_json(tmp_path / "t.json")
    isolated_tables(tmp_path / "t.json")
    dims = dims_for(k)
    d = lambda **kw: build_options(dims, k.generation, {}, **kw).block_sizes[0]
    assert tuple(d()) == tabled
    assert d(heuristic_only=True) == heur
    monkeypatch.setenv("RPA_D_BLOCK_SIZES", "1,2048,1,1024")
    assert d(heuristic_only=True) == heur
    assert d() == BlockSizes(1, 2048, 1, 1024)
    explicit = build_options(dims, k.generation, {Case.DECODE: (1, 128, 1, 128)}, heuristic_only=True)
    assert explicit.block_sizes[0] == BlockSizes(1, 128, 1, 128)
    monkeypatch.delenv("RPA_D_BLOCK_SIZES")
    assert tuple(_resolve(k)[0]) == tabled


@pytest.mark.parametrize("value", ["1,2,3", "a,b,c,d", "1,1024,1,0", "1;1024;1", "1,1024,1,512,7"])
def test_malformed_env_raises_naming_variable(value, monkeypatch, isolated_tables):
    monkeypatch.setenv("RPA_D_BLOCK_SIZES", value)
    with pytest.raises(ValueError, match="RPA_D_BLOCK_SIZES"):
        _resolve(key())


def test_illegal_env_block_sizes_raise_naming_variable(monkeypatch, isolated_tables):
    monkeypatch.setenv("RPA_M_BLOCK_SIZES", "64,500,32,250")     # not multiples of page 128
    with pytest.raises(ValueError, match="RPA_M_BLOCK_SIZES.*page_size"):
        _resolve(key(case="mixed"))
    monkeypatch.setenv("RPA_M_BLOCK_SIZES", "  ")                 # empty: unset
    assert _resolve(key(case="mixed"))[1] == "heuristic"


def test_sliding_window_reaches_the_lookup(tmp_path, isolated_tables):
    k_sw = key(sw=True)
    table(entry(k_sw, (1, 256, 1, 256))).write_json(tmp_path / "t.json")
    isolated_tables(tmp_path / "t.json")
    assert tuple(_resolve(k_sw)[0]) == (1, 256, 1, 256)
    assert _resolve(key(sw=False))[1] == "heuristic"


# ----------------------------------------------------------------------------- bucketing
def _index(*entries):
    idx = kt.TableIndex()
    idx.add(table(*entries), "mem")
    return idx


def test_bucketing_rounds_up_tokens_then_model_len():
    e64 = entry(key(t=64, l=4096), (1, 512, 1, 512))
    e64l = entry(key(t=64, l=16384), (1, 1024, 1, 512))
    e256 = entry(key(t=256, l=8192), (1, 2048, 1, 512))
    idx = _index(e64, e64l, e256)
    assert idx.find(key(t=64, l=4096)).exact
    assert idx.find(key(t=16, l=1000)).entry is e64             # both dimensions rounded up
    assert idx.find(key(t=64, l=4097)).entry is e64l            # model len rounds up within t64
    assert idx.find(key(t=65, l=4096)).entry is e256            # next token bucket
    assert idx.find(key(t=64, l=16385)) is None                 # larger than every tabled length
    assert idx.find(key(t=100, l=9000)) is None                 # t256 only has l8192: never round down
    assert idx.find(key(t=257, l=100)) is None                  # beyond the largest token bucket
    assert not idx.find(key(t=16, l=1000)).exact


@pytest.mark.parametrize("other", [
    dict(generation="v5e"), dict(generation="tpu7x"), dict(q_dtype="float32"), dict(kv_dtype="float8_e4m3fn"),
    dict(hq=16), dict(hkv=4), dict(d=64), dict(page=256), dict(case="mixed"), dict(sw=True),
])
def test_bucketing_never_crosses_family(other):
    idx = _index(entry(key(t=1024, l=32768), (1, 512, 1, 512)))
    assert idx.find(key(t=16, l=1024)) is not None
    assert idx.find(key(t=16, l=1024, **other)) is None


def test_first_table_wins_on_identical_keys(tmp_path, isolated_tables):
    k = key()
    table(entry(k, (1, 256, 1, 256))).write_json(tmp_path / "user.json")
    table(entry(k, (1, 512, 1, 512)), entry(key(t=128), (1, 512, 1, 512))).write_json(tmp_path / "other.json")
    isolated_tables(tmp_path / "user.json", tmp_path / "other.json")
    assert tuple(_resolve(k)[0]) == (1, 256, 1, 256)
    assert tuple(_resolve(key(t=128))[0]) == (1, 512, 1, 512)


def test_non_promoted_entry_stops_bucketing(tmp_path, isolated_tables):
    table(entry(key(t=64), (1, 256, 1, 256), promoted=False),
          entry(key(t=128), (1, 2048, 1, 512))).write_json(tmp_path / "t.json")
    isolated_tables(tmp_path / "t.json")
    assert _resolve(key(t=32))[1] == "heuristic"     # t64 says "heuristic": not t128's sizes
    bs, src = _resolve(key(t=100))
    assert tuple(bs) == (1, 2048, 1, 512) and src.endswith("(bucket)")


# ---------------------------------------------------------------------- logging, caching
def test_miss_logged_once_per_key_at_info(caplog, isolated_tables):
    caplog.set_level(logging.INFO, logger="kernel.tables")
    for _ in range(5):
        _resolve(key(t=64))
        _resolve(key(t=128))
    misses = [r for r in caplog.records if "miss" in r.getMessage()]
    assert len(misses) == 2 and all(r.levelno == logging.INFO for r in misses)
    assert "t64" in misses[0].getMessage() and "v6e/decode" in misses[0].getMessage()


def test_tables_read_once_thread_safe(tmp_path, monkeypatch, isolated_tables):
    table(entry(key(), (1, 256, 1, 256))).write_json(tmp_path / "t.json")
    isolated_tables(tmp_path / "t.json")
    calls = []
    real = kt.load_tables

    def slow_load(*a, **kw):
        calls.append(1)
        time.sleep(0.05)
        return real(*a, **kw)

    monkeypatch.setattr(kt.state, "load_tables", slow_load)   # what loaded() calls
    out = []
    threads = [threading.Thread(target=lambda t=t: out.append(_resolve(key(t=8 * (t + 1)))))
               for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(calls) == 1 and len(out) == 8
    assert all(tuple(bs) == (1, 256, 1, 256) for bs, _ in out)


def test_repeated_lookup_is_memoised(tmp_path, isolated_tables, monkeypatch):
    """A key seen before is answered from the cache, without searching the index again
    (its wall time is measured in benchmarks/tables_lookup.py, not asserted here)."""
    table(*(entry(key(t=t), (1, 512, 1, 512)) for t in (16, 32, 64, 128, 256))).write_json(tmp_path / "t.json")
    isolated_tables(tmp_path / "t.json")
    searches = []
    real_find = kt.TableIndex.find
    monkeypatch.setattr(kt.TableIndex, "find", lambda self, k: searches.append(k) or real_find(self, k))
    dims = dims_for(key(t=100))
    for _ in range(50):
        assert tuple(kt.lookup_block_sizes(DEC, generation="v6e", dims=dims)[0]) == (1, 512, 1, 512)
    assert len(searches) == 1
    kt.lookup_block_sizes(DEC, generation="v6e", dims=dims_for(key(t=200)))
    assert len(searches) == 2


# ---------------------------------------------------------------------------- fallbacks
BAD_FILES = {
    "corrupt": (b'{"schema_version": 1, "entries": [', "invalid JSON"),
    "newer": (b'{"schema_version": 2, "entries": []}', "newer"),
    "not_utf8": (b"\xff\xfe\x00garbage", "cannot read"),
    "bad_entry": (b'{"schema_version": 1, "entries": [{"key": {"generation": "v6e"}}]}', "key misses"),
}


@pytest.mark.parametrize("kind", sorted(BAD_FILES) + ["missing"])
def test_bad_table_falls_back_with_exactly_one_warning(kind, tmp_path, caplog, isolated_tables):
    p = tmp_path / f"{kind}.json"
    if kind != "missing":
        p.write_bytes(BAD_FILES[kind][0])
    caplog.set_level(logging.INFO, logger="kernel.tables")
    isolated_tables(p)
    k = key()
    heur = _heuristic(k)
    for t in (16, 64, 64, 1024):
        assert _resolve(key(t=t))[1] == "heuristic"
    assert _resolve(k) == heur
    w = _warnings(caplog)
    assert len(w) == 1, [r.getMessage() for r in w]
    msg = w[0].getMessage()
    assert str(p) in msg
    assert (BAD_FILES[kind][1] if kind != "missing" else "does not exist") in msg


def test_bad_file_does_not_hide_good_file(tmp_path, caplog, isolated_tables):
    (tmp_path / "a_bad.json").write_text("{")
    table(entry(key(), (1, 256, 1, 256))).write_json(tmp_path / "b_good.json")
    caplog.set_level(logging.WARNING, logger="kernel.tables")
    isolated_tables(tmp_path)                       # a directory: every *.json in it
    assert tuple(_resolve(key())[0]) == (1, 256, 1, 256)
    assert len(_warnings(caplog)) == 1


def test_other_kernel_hash_used_with_warning_or_refused(tmp_path, caplog, monkeypatch, isolated_tables):
    table(entry(key(), (1, 256, 1, 256), kernel_hash="0123456789abcdef", libtpu="0.0.1"),
          entry(key(case="mixed"), (64, 512, 64, 512), kernel_hash=kt.kernel_id())).write_json(tmp_path / "t.json")
    caplog.set_level(logging.WARNING, logger="kernel.tables")
    isolated_tables(tmp_path / "t.json")
    assert tuple(_resolve(key())[0]) == (1, 256, 1, 256)
    w = _warnings(caplog)
    assert len(w) == 1 and "0123456789abcdef" in w[0].getMessage() and "RPA_TABLE_STRICT" in w[0].getMessage()
    caplog.clear()
    monkeypatch.setenv("RPA_TABLE_STRICT", "1")
    kt.reset()
    assert _resolve(key())[1] == "heuristic"                     # refused
    assert tuple(_resolve(key(case="mixed"))[0]) == (64, 512, 64, 512)    # current hash: kept
    w = _warnings(caplog)
    assert len(w) == 1 and "refusing" in w[0].getMessage()


def test_entry_vmem_limit_reaches_the_options(tmp_path, isolated_tables):
    from kernel.api import build_options
    k = key(t=64)
    table(entry(k, (1, 2048, 1, 512), vmem_limit_bytes=40 << 20)).write_json(tmp_path / "t.json")
    isolated_tables(tmp_path / "t.json")
    opts = build_options(dims_for(k), "v6e", {})
    assert opts.block_sizes[0] == (1, 2048, 1, 512)
    assert opts.vmem_limit_bytes == (40 << 20, None, None)
    assert build_options(dims_for(k), "v6e", {}, vmem_limit_bytes=8 << 20).vmem_limit_bytes == 8 << 20
    # explicit block sizes: the table's limit does not apply
    assert build_options(dims_for(k), "v6e", {Case.DECODE: (1, 512, 1, 512)}).vmem_limit_bytes is None


def test_one_bad_entry_drops_only_itself_with_one_warning(tmp_path, caplog, isolated_tables):
    good = entry(key(t=64), (1, 256, 1, 256))
    doc = table(good, entry(key(t=128), (1, 512, 1, 512))).to_dict()
    doc["entries"][1]["block_sizes"]["bkv"] = 100           # not a multiple of the page size
    p = tmp_path / "t.json"
    p.write_text(json.dumps(doc))
    caplog.set_level(logging.WARNING, logger="kernel.tables")
    isolated_tables(p)
    assert tuple(_resolve(key(t=64))[0]) == (1, 256, 1, 256)          # the good entry is served
    assert _resolve(key(t=128)) == _heuristic(key(t=128))
    w = [r.getMessage() for r in _warnings(caplog)]
    assert len(w) == 1 and str(p) in w[0] and "entry 1" in w[0] and key(t=128).id() in w[0], w
    assert dict(kt.loaded().files)[str(p)] == "ok: 1 entries, 1 rejected"
    with pytest.raises(kt.TableError, match="entry 1"):         # the tools stay strict
        kt.Table.read(p)


@pytest.mark.parametrize("field, value", [("sliding_window", "false"), ("sliding_window", 0),
                                          ("num_q_heads", "32"), ("num_q_heads", True), ("case", 1)])
def test_key_fields_are_type_checked(field, value):
    doc = table(entry(key(), (1, 256, 1, 256))).to_dict()
    doc["entries"][0]["key"][field] = value
    with pytest.raises(kt.TableError, match=f"key.{field}={value!r} is not"):
        kt.Table.from_dict(doc)


def test_rpa_table_fifo_is_refused_without_blocking(tmp_path, caplog, isolated_tables):
    fifo = tmp_path / "t.json"
    os.mkfifo(fifo)
    caplog.set_level(logging.WARNING, logger="kernel.tables")
    isolated_tables(fifo)
    result = []
    th = threading.Thread(target=lambda: result.append(_resolve(key())), daemon=True)
    th.start()
    th.join(20)
    assert not th.is_alive(), "reading a FIFO table blocked the lookup"
    assert result == [_heuristic(key())]
    w = [r.getMessage() for r in _warnings(caplog)]
    assert len(w) == 1 and "not a regular file" in w[0] and str(fifo) in w[0], w
