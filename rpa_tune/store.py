"""The results store: an append-only Parquet dataset directory, one row per evaluated config.

Layout: ``<results>/part-<time>-<config>-<pid>.parquet`` files, each holding the rows of
one finished evaluation (normally one row). A file is written under ``<results>/.tmp/``,
fsynced and then atomically renamed into place, so a sweep killed at any moment (even
``kill -9``) leaves only complete files; readers (``pyarrow.dataset``,
``pandas.read_parquet(dir)``) ignore the dot-directory. Every file has the same schema
(``SCHEMA``); read with ``ResultStore.read()`` (which also tolerates files from older
schema versions by filling missing columns with nulls).

Resume: ``config_id`` hashes key + workload + block sizes + backend + kernel hash +
evaluator version; a config whose id is already stored with any status is not evaluated
again (``--retry STATUS`` re-evaluates the chosen statuses).
"""
from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

SCHEMA_VERSION = 1

KEY_COLUMNS = ("generation", "case", "q_dtype", "kv_dtype", "num_q_heads", "num_kv_heads", "head_dim",
               "page_size", "max_num_tokens", "max_model_len", "sliding_window")

SCHEMA = pa.schema([
    ("generation", pa.string()), ("case", pa.string()), ("q_dtype", pa.string()), ("kv_dtype", pa.string()),
    ("num_q_heads", pa.int64()), ("num_kv_heads", pa.int64()), ("head_dim", pa.int64()),
    ("page_size", pa.int64()), ("max_num_tokens", pa.int64()), ("max_model_len", pa.int64()),
    ("sliding_window", pa.bool_()),
    ("key_id", pa.string()), ("max_num_seqs", pa.int64()),
    ("workload_id", pa.string()), ("workload", pa.string()), ("workload_json", pa.string()),
    ("num_seqs", pa.int64()), ("num_tokens", pa.int64()),
    ("bq", pa.int64()), ("bkv", pa.int64()), ("cq", pa.int64()), ("ckv", pa.int64()),
    ("is_heuristic", pa.bool_()),
    ("status", pa.string()), ("metric", pa.float64()), ("unit", pa.string()), ("method", pa.string()),
    ("cycles", pa.float64()), ("estimate_s", pa.float64()), ("memory_bound_s", pa.float64()),
    ("compute_bound_s", pa.float64()), ("active_bound", pa.string()),
    ("audit", pa.string()), ("clock_hz", pa.float64()), ("clock_source", pa.string()),
    ("samples", pa.int64()), ("spread", pa.float64()), ("compile_s", pa.float64()), ("eval_s", pa.float64()),
    ("vmem_predicted_bytes", pa.int64()), ("vmem_limit_bytes", pa.int64()), ("vmem_reported_bytes", pa.int64()),
    ("message", pa.string()),
    ("backend", pa.string()), ("search", pa.string()), ("seed", pa.int64()), ("evaluator_version", pa.string()),
    ("jax_version", pa.string()), ("jaxlib_version", pa.string()), ("libtpu_version", pa.string()),
    ("rpa_tune_version", pa.string()), ("device_kind", pa.string()),
    ("kernel_hash", pa.string()), ("kernel_source_hash", pa.string()), ("git_sha", pa.string()),
    ("timestamp", pa.timestamp("us", tz="UTC")), ("sweep_id", pa.string()), ("config_id", pa.string()),
    ("schema_version", pa.int64()),
])
COLUMNS = tuple(SCHEMA.names)


def config_id(key_id: str, workload_id: str, bs, backend: str, kernel_hash: str, evaluator_version: str) -> str:
    doc = json.dumps([key_id, workload_id, [int(x) for x in bs], backend, kernel_hash, evaluator_version])
    return hashlib.sha256(doc.encode()).hexdigest()[:20]


class ResultStore:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    # -- writing -------------------------------------------------------------------
    def append(self, rows: list[dict]) -> Path:
        """Durably add rows (one new file). Returns the file's path."""
        if not rows:
            raise ValueError("no rows to append")
        rows = [dict(r, schema_version=SCHEMA_VERSION) for r in rows]
        unknown = set().union(*rows) - set(COLUMNS)
        if unknown:
            raise ValueError(f"unknown result columns {sorted(unknown)}")
        table = pa.Table.from_pylist([{c: r.get(c) for c in COLUMNS} for r in rows], schema=SCHEMA)
        tmpdir = self.root / ".tmp"
        tmpdir.mkdir(parents=True, exist_ok=True)
        cid = str(rows[0].get("config_id") or "x")[:12]
        name = f"part-{time.time_ns()}-{cid}-{os.getpid()}-{uuid.uuid4().hex[:6]}.parquet"
        tmp = tmpdir / (name + ".tmp")
        with open(tmp, "wb") as f:
            pq.write_table(table, f)
            f.flush()
            os.fsync(f.fileno())
        final = self.root / name
        os.replace(tmp, final)
        _fsync_dir(self.root)
        return final

    # -- reading -------------------------------------------------------------------
    def files(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.glob("*.parquet") if p.is_file())

    def read_table(self) -> pa.Table:
        tables = []
        for p in self.files():
            try:
                t = pq.read_table(p)
            except Exception:  # noqa: BLE001 - a foreign / damaged file never stops a reader
                continue
            cols = []
            for field in SCHEMA:
                if field.name in t.column_names:
                    try:
                        cols.append(t.column(field.name).cast(field.type))
                    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                        cols.append(pa.nulls(t.num_rows, field.type))
                else:
                    cols.append(pa.nulls(t.num_rows, field.type))
            tables.append(pa.Table.from_arrays(cols, schema=SCHEMA))
        if not tables:
            return SCHEMA.empty_table()
        return pa.concat_tables(tables)

    def read(self):
        """All rows as a pandas DataFrame (empty, with every column, when there are none)."""
        return self.read_table().to_pandas()

    def recorded(self) -> dict[str, dict]:
        """config_id -> its most recent row (as a dict)."""
        t = self.read_table()
        out: dict[str, dict] = {}
        if t.num_rows == 0:
            return out
        for r in t.sort_by("timestamp").to_pylist():
            out[r["config_id"]] = r
        return out


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
