"""benchmarks/vs_public.py: a partial run (``--tpu`` / ``--only``) merged into the table it
replaces keeps every row it did not run."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

HEADER = ["| gen | workload | ours | public | ratio |", "|---|---|---:|---:|---:|"]


def _table(rows, notes):
    return "\n".join(HEADER + rows + [""] + notes) + "\n"


def test_a_partial_run_keeps_the_rows_it_did_not_run():
    import vs_public as vp
    old_rows = ["| v6e | decode 128 x 512, page 128 | 1 | 2 | 0.50 |",
                "| v6e | causal prefill 1 x 1024 | 3 | 4 | 0.75 |",
                "| v5e | decode 128 x 512, page 128 | 5 | 5 | 1.00 |",
                "| tpu7x | decode 128 x 512, page 128 | 6 | 8 | 0.75 |"]
    old_notes = ["- v6e decode 128 x 512, page 128, public (1, 512, 1, 512): read audit complete",
                 "- v5e decode 128 x 512, page 128, public (1, 512, 1, 512): crash: x",
                 "- tpu7x decode 128 x 512, page 128, ours (1, 512, 1, 512): vmem_oom: y"]
    old = _table(old_rows, old_notes)
    # --tpu v6e --only decode, with a workload the table did not have
    new_rows = ["| v6e | short decode 128 x 128, page 128 | 7 | 9 | 0.78 |",
                "| v6e | decode 128 x 512, page 128 | 1 | 3 | 0.33 |"]
    new_notes = ["- v6e short decode 128 x 128, page 128, ours (1, 128, 1, 128): crash: z"]
    rows, notes = vp.merge_tables(old, new_rows, new_notes)
    assert rows == ["| v6e | decode 128 x 512, page 128 | 1 | 3 | 0.33 |",       # replaced in place
                    "| v6e | causal prefill 1 x 1024 | 3 | 4 | 0.75 |",         # not run: kept
                    "| v6e | short decode 128 x 128, page 128 | 7 | 9 | 0.78 |",  # new: after its generation
                    old_rows[2], old_rows[3]]                                    # other generations kept
    # the v6e decode note is gone (that row was rerun and reported none), the others kept, in row order
    assert notes == [new_notes[0], old_notes[1], old_notes[2]]
    # a full rerun reproduces the old table
    assert vp.merge_tables(old, old_rows, old_notes) == (old_rows, old_notes)
    # --tpu v6e over every case: a v6e row the run no longer produces is gone, with its
    # notes; the other generations' rows stay
    rows, notes = vp.merge_tables(old, new_rows, new_notes, rerun_gens=("v6e",))
    assert rows == ["| v6e | decode 128 x 512, page 128 | 1 | 3 | 0.33 |",
                    "| v6e | short decode 128 x 128, page 128 | 7 | 9 | 0.78 |",
                    old_rows[2], old_rows[3]]
    assert notes == [new_notes[0], old_notes[1], old_notes[2]]


def test_the_pieces_cache_lives_in_the_user_cache_directory(tmp_path, monkeypatch):
    import vs_public as vp
    monkeypatch.delenv("RPA_TUNE_VS_PUBLIC_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert vp.cache_path() == str(tmp_path / "home" / ".cache" / "rpa-tune" / "vs_public.jsonl")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert vp.cache_path() == str(tmp_path / "xdg" / "rpa-tune" / "vs_public.jsonl")
    monkeypatch.setenv("RPA_TUNE_VS_PUBLIC_CACHE", str(tmp_path / "c.jsonl"))
    assert vp.cache_path() == str(tmp_path / "c.jsonl")
    assert os.path.dirname(vp.PIECES) != os.path.dirname(vp.cache_path())


def test_the_kept_pieces_are_those_of_the_current_versions_without_traces(tmp_path, monkeypatch):
    """``write_pieces`` keeps what the tables read of each piece (no trace, no wall time),
    merges this run's pieces into those of the current versions it holds and drops the
    pieces of other versions; a cached piece (with its trace) wins over a kept one."""
    import json
    import vs_public as vp
    monkeypatch.setattr(vp, "_version", lambda k: {"ours": "k2", "public": "tpu-inference 9"}[k])
    key = lambda kernel, version, n: json.dumps([kernel, version, "v6e", "decode", [1, 512, 1, 512], 128, [1] * n])
    piece = lambda k, cycles: dict(key=k, status="ok", cycles=cycles, message="", audit={"reasons": []},
                                   vmem_limit_bytes=None, trace={"big": "x" * 100}, wall_s=3.0, max_rss_bytes=1)
    kept = tmp_path / "pieces.jsonl"
    old = [piece(key("ours", "k1", 8), 10), piece(key("ours", "k2", 8), 20), piece(key("public", "tpu-inference 9", 8), 30)]
    kept.write_text("".join(json.dumps(r) + "\n" for r in old))
    used = {r["key"]: r for r in [piece(key("ours", "k2", 16), 40), piece(key("ours", "k2", 8), 21)]}
    assert vp.write_pieces(used, str(kept)) == 3
    got = [json.loads(line) for line in kept.read_text().splitlines()]
    assert [r["key"] for r in got] == sorted([key("ours", "k2", 8), key("ours", "k2", 16), key("public", "tpu-inference 9", 8)])
    assert {r["key"]: r["cycles"] for r in got} == {key("ours", "k2", 8): 21, key("ours", "k2", 16): 40,
                                                     key("public", "tpu-inference 9", 8): 30}
    assert all(set(r) <= set(vp.PIECE_FIELDS) and "trace" not in r for r in got)
    # the cache's copy of a piece (with its trace) is the one read
    cache = tmp_path / "cache.jsonl"
    cache.write_text(json.dumps(piece(key("ours", "k2", 8), 21)) + "\n")
    monkeypatch.setattr(vp, "PIECES", str(kept))
    monkeypatch.setenv("RPA_TUNE_VS_PUBLIC_CACHE", str(cache))
    loaded = vp._load_cache()
    assert len(loaded) == 3 and "trace" in loaded[key("ours", "k2", 8)] and "trace" not in loaded[key("ours", "k2", 16)]
