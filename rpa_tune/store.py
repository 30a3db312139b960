"""The results store: an append-only Parquet dataset directory, one row per evaluated config.

Layout: ``<results>/part-<time>-<config>-<pid>.parquet`` files, each holding the rows of
one finished evaluation (normally one row). A file is written under ``<results>/.tmp/``,
fsynced and then atomically renamed into place, so a sweep killed at any moment (even
``kill -9``) leaves only complete files; readers (``pyarrow.dataset``,
``pandas.read_parquet(dir)``) ignore the dot-directory. Every file has the same schema
(``SCHEMA``); read with ``ResultStore.read()`` (which also tolerates files from older
schema versions by filling missing columns with nulls).

Resume: ``config_id`` hashes key (with the tuned kernel) + workload + block sizes + backend
+ kernel version (``rpa_tune.kernels.TunedKernel.config_version``) + evaluator version; a config whose id is already stored with any status is not evaluated
again (``--retry STATUS`` re-evaluates the chosen statuses).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
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
    # the tuned kernel (rpa_tune.kernels): "rpa-tune" (ours; null in files written before
    # there were two) or "tpu-inference", and its version (our kernel source hash, or
    # "tpu-inference==<package version>")
    ("kernel", pa.string()), ("kernel_version", pa.string()),
])
COLUMNS = tuple(SCHEMA.names)
log = logging.getLogger("rpa_tune.store")


def config_id(key_id: str, workload_id: str, bs, backend: str, kernel_hash: str, evaluator_version: str) -> str:
    doc = json.dumps([key_id, workload_id, [int(x) for x in bs], backend, kernel_hash, evaluator_version])
    return hashlib.sha256(doc.encode()).hexdigest()[:20]


def row_block_sizes(r) -> "BlockSizes":
    """The block sizes a results row evaluated."""
    from kernel.config import BlockSizes
    return BlockSizes(*(int(r[c]) for c in ("bq", "bkv", "cq", "ckv")))


# Rows that price the same thing: one key and workload, by one backend, for one kernel source.
EVALUATION_GROUP = ("key_id", "workload_id", "backend", "kernel", "kernel_hash")


def newest_evaluator(rows: list[dict]) -> list[dict]:
    """``rows`` without those an evaluator version has superseded: in each
    ``EVALUATION_GROUP``, only the rows of the evaluator version of its most recent row. A
    new version re-prices configs (the compile backend's from cached probes); until a key
    is re-priced its older rows stand."""
    def get(r, k):       # a missing value (None, or NaN from a DataFrame) is None
        v = r.get(k)
        return None if v is None or (isinstance(v, float) and v != v) else v

    group = lambda r: tuple(get(r, k) for k in EVALUATION_GROUP)
    newest: dict[tuple, tuple] = {}
    for r in rows:
        g, t = group(r), str(get(r, "timestamp") or "")
        if g not in newest or t > newest[g][0]:
            newest[g] = (t, get(r, "evaluator_version"))
    return [r for r in rows if get(r, "evaluator_version") == newest[group(r)][1]]


def newest_evaluator_frame(df):
    """``newest_evaluator`` for a DataFrame of store rows."""
    if not len(df):
        return df
    recs = df.to_dict("records")
    keep = {id(r) for r in newest_evaluator(recs)}
    return df[[id(r) in keep for r in recs]]


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
        return result_files([self.root]) if self.root.is_dir() else []

    def read_table(self) -> pa.Table:
        return read_results_table([self.root] if self.root.is_dir() else []).table

    def read(self):
        """All rows as a pandas DataFrame (empty, with every column, when there are none)."""
        return self.read_table().to_pandas()

    def read_current(self):
        """``read`` without the rows a newer evaluator version has superseded
        (``newest_evaluator``): what reports and comparisons show."""
        return newest_evaluator_frame(self.read())

    def recorded(self) -> dict[str, dict]:
        """config_id -> its most recent row (as a dict)."""
        t = self.read_table()
        out: dict[str, dict] = {}
        if t.num_rows == 0:
            return out
        for r in t.sort_by("timestamp").to_pylist():
            out[r["config_id"]] = r
        return out


# ------------------------------------------------------------------- the one reader
@dataclasses.dataclass
class ResultsRead:
    table: pa.Table                 # every readable row, conformed to SCHEMA
    files: list                     # the files read
    damaged: list                   # (file, reason) of files skipped


def result_files(paths) -> list[Path]:
    """The Parquet files of results paths (a directory: every ``*.parquet`` below it except
    under dot-directories such as a store's ``.tmp/``; a file: itself). A missing path
    raises ``FileNotFoundError``."""
    files = []
    for p in map(Path, paths):
        if p.is_dir():
            files.extend(sorted(f for f in p.rglob("*.parquet") if f.is_file()
                                and not any(part.startswith(".") for part in f.relative_to(p).parts)))
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"results path {p} does not exist")
    return files


def read_results_table(paths) -> ResultsRead:
    """All result rows under ``paths`` through ``pyarrow.dataset`` with the one ``SCHEMA``
    (older files: missing columns are null; unknown columns are ignored). The one policy
    for a damaged file (not Parquet, truncated, a column of an incompatible type): it is
    skipped, named in ``damaged`` and logged as a warning; the other files are read."""
    import pyarrow.dataset as ds
    files = result_files(paths)
    tables, damaged = [], []
    for f in files:
        try:
            tables.append(ds.dataset(f, schema=SCHEMA, format="parquet").to_table())
        except Exception as e:  # noqa: BLE001 - any reader failure is a damaged file
            reason = " ".join(str(e).split())[:300]
            damaged.append((str(f), reason))
            log.warning("rpa-tune results: skipping damaged file %s: %s", f, reason)
    table = pa.concat_tables(tables) if tables else SCHEMA.empty_table()
    return ResultsRead(table, files, damaged)


def replace_results(directory, table: pa.Table, merged, name: str = "results.parquet") -> Path:
    """Write ``table`` (rows sorted by key, config and time) as ``directory/name`` through a
    temporary file and an atomic rename, then remove the ``merged`` files it replaces. The
    one rewrite of a results directory (``export.compact_results``, ``estimator.rejudge``):
    a crash leaves either the old files or the new one, never half a file; a file not
    named in ``merged`` is never removed."""
    import pyarrow.parquet as pq
    d = Path(directory)
    order = [(c, "ascending") for c in ("key_id", "config_id", "timestamp") if c in table.column_names]
    if order:
        table = table.sort_by(order)
    out, tmp = d / name, d / f".{name}.tmp"
    pq.write_table(table, tmp, compression="zstd")
    tmp.replace(out)
    _fsync_dir(d)
    for p in map(Path, merged):
        if p != out:
            p.unlink()
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
