"""Synthetic results datasets (the results-store contract) and tables for table tests."""
from __future__ import annotations

import itertools
from pathlib import Path

import pandas as pd

from kernel.config import BlockSizes, TuningKey
from kernel.tables import Entry, Table

_counter = itertools.count()


def key(generation="v6e", case="decode", *, q_dtype="bfloat16", kv_dtype="bfloat16", hq=32, hkv=8, d=128,
        page=128, t=64, l=8192, sw=False) -> TuningKey:
    return TuningKey(generation, case, q_dtype, kv_dtype, hq, hkv, d, page, t, l, sw)


def row(k: TuningKey, bs, metric, *, status="ok", method="estimate", spread=0.0, samples=1,
        timestamp="2025-11-22T10:00:00Z", kernel_hash="k0", workload_id="w0", **extra) -> dict:
    bs = BlockSizes(*bs)
    r = dict(k.as_dict(), key_id=k.id(), workload_id=workload_id, bq=bs.bq, bkv=bs.bkv, cq=bs.cq, ckv=bs.ckv,
             status=status, metric=None if metric is None else float(metric), unit="s", method=method,
             cycles=None if metric is None else int(metric * 1e9), samples=samples, spread=spread, compile_s=1.5,
             backend="compile" if method == "estimate" else "device", search="grid", seed=0,
             jax_version="0.12.0.1", jaxlib_version="0.12.0.1", libtpu_version="0.0.50.1",
             device_kind=None, kernel_hash=kernel_hash, git_sha="abc1234", timestamp=timestamp,
             config_id=f"{k.id()}/{bs.label()}")
    r.update(extra)
    return r


def write_results(directory: Path, rows: list[dict], name: str | None = None) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    p = directory / (name or f"part-{next(_counter):05d}.parquet")
    pd.DataFrame(rows).to_parquet(p, index=False)
    return p


def entry(k: TuningKey, bs, *, promoted=True, metric=1e-4, kernel_hash=None, libtpu=None, **kw) -> Entry:
    prov = {"kernel_hash": kernel_hash, "libtpu_version": libtpu}
    return Entry(key=k, block_sizes=BlockSizes(*bs), promoted=promoted,
                 decision="promoted" if promoted else "not promoted", metric=metric, unit="s",
                 method=kw.pop("method", "estimate"), provenance=prov, **kw)


def table(*entries: Entry) -> Table:
    return Table(tuple(entries), info={"generated_by": "tests"})


def dims_for(k: TuningKey) -> dict:
    """A validate_inputs-style dims dict for a key (pages_per_seq from max_model_len)."""
    return dict(max_num_tokens=k.max_num_tokens, num_q_heads=k.num_q_heads, num_kv_heads=k.num_kv_heads,
                head_dim=k.head_dim, num_pages=1000, page_size=k.page_size, max_num_seqs=16,
                pages_per_seq=-(-k.max_model_len // k.page_size), kv_dtype=k.kv_dtype, q_dtype=k.q_dtype)


import pytest  # noqa: E402


@pytest.fixture
def isolated_tables(monkeypatch):
    """No shipped tables, no RPA_* overrides, a fresh table state; returns a setter that
    points RPA_TABLE at the given paths and resets the loaded state."""
    from kernel import tables as kt
    for var in ("RPA_TABLE", "RPA_TABLE_STRICT", "RPA_D_BLOCK_SIZES", "RPA_P_BLOCK_SIZES", "RPA_M_BLOCK_SIZES"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RPA_SHIPPED_TABLES", "0")
    kt.reset()

    def use(*paths):
        import os
        monkeypatch.setenv("RPA_TABLE", os.pathsep.join(str(p) for p in paths))
        kt.reset()

    yield use
    kt.reset()
