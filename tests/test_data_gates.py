"""Data gates: the repository stays small, and the result stores kept in it stay append-only.

Git is the store that carries results from one machine to the next, so what it holds is
data, not churn: no tracked file over 1 MB, the tracked tree under 10 MB, caches in the
user's cache directory, and result directories made of compacted parts that are written
once (``rpa_tune.store.compact``) and never rewritten.
"""
import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MAX_FILE_BYTES = 1_000_000
MAX_TREE_BYTES = 10_000_000
STORES = (REPO / "tables" / "results", REPO / "benchmarks" / "results" / "exhaustive")


def _tracked_files() -> list[Path]:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    r = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=False)
    if r.returncode != 0:
        pytest.skip("not a git checkout (an sdist or a copy): nothing is tracked")
    return [REPO / p for p in r.stdout.decode().split("\0") if p]


def test_the_tracked_tree_is_small_and_no_tracked_file_is_large():
    sizes = {p: p.stat().st_size for p in _tracked_files() if p.is_file()}    # a file being deleted is not
    large = sorted(f"{p.relative_to(REPO)}: {n:,} bytes" for p, n in sizes.items() if n > MAX_FILE_BYTES)
    assert not large, "tracked files over 1 MB (a cache belongs in the user's cache directory, results " \
                      "in compacted parts): " + ", ".join(large)
    total = sum(sizes.values())
    assert total < MAX_TREE_BYTES, f"the tracked tree holds {total:,} bytes (limit {MAX_TREE_BYTES:,})"
    assert not any("probe-cache" in p.parts for p in sizes), "the probe cache is tracked"


def test_the_result_stores_are_compacted_parts_written_once():
    """Each compacted part of the stores kept in git holds one generation, none of the
    diagnostic columns, and the bytes the digest in its name was taken of (a part rewritten
    in place would not); every grid the exhaustive check marks complete has rows."""
    import pyarrow.parquet as pq

    from rpa_tune.store import COMPACT_PREFIX, DIAGNOSTIC_COLUMNS, is_compact, read_results_table
    for store in STORES:
        parts = sorted(p for p in store.glob("*.parquet") if is_compact(p))
        assert parts, f"{store} holds no compacted part"
        for p in parts:
            data = p.read_bytes()
            assert len(data) <= MAX_FILE_BYTES, p
            stem = p.name[len(COMPACT_PREFIX):-len(".parquet")]
            assert hashlib.sha256(data).hexdigest()[:12] == stem.rsplit("-", 1)[1], f"{p} was rewritten"
            meta = pq.read_metadata(p)
            assert not set(DIAGNOSTIC_COLUMNS) & set(meta.schema.names), p
            gens = set(pq.read_table(p, columns=["generation"]).column(0).to_pylist())
            assert gens == {stem.split("-")[1]}, (p, gens)
    ex = STORES[1]
    keys = set(read_results_table([ex]).table.column("key_id").to_pylist())
    missing = set(json.loads((ex / "complete.json").read_text())) - keys
    assert not missing, f"grids marked complete without rows in {ex}: {sorted(missing)}"
