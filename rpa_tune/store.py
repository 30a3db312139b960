"""The results store: an append-only Parquet dataset directory, one row per evaluated config.

Layout: ``<results>/part-<time>-<config>-<pid>.parquet`` files, each holding the rows of
one finished evaluation (normally one row). A file is written under ``<results>/.tmp/``,
fsynced and then atomically renamed into place, so a sweep killed at any moment (even
``kill -9``) leaves only complete files; readers (``pyarrow.dataset``,
``pandas.read_parquet(dir)``) ignore the dot-directory. Every file has the same schema
(``SCHEMA``); read with ``ResultStore.read()`` (which also tolerates files from older
schema versions by filling missing columns with nulls).

Compaction (``compact``) is append-only too: it merges the small parts a sweep wrote into
new ``compact-*.parquet`` parts (zstd, rows in time order, one generation each, each under
``COMPACT_MAX_BYTES``, without the ``DIAGNOSTIC_COLUMNS``), then removes only the parts it
merged. An existing compacted part is never rewritten, so a results directory kept in git
grows by new small files and no commit rewrites a large one.

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

from kernel.config import BlockSizes
from kernel.provenance import LEGACY_IDS, canonical_kernel_id

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
    # spread: relative to metric (a fraction: IQR / median of the samples; 0 / null for estimates)
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
    # the device-cost model (rpa_tune.estimator.device_model): the static estimate's time, the
    # calibration that priced ``metric``, and the walk's counted features, so a new
    # calibration re-prices the row without a compile (``reprice``)
    ("static_s", pa.float64()), ("calibration", pa.string()),
    ("walk_qblocks", pa.int64()), ("walk_steps", pa.int64()), ("walk_pages", pa.int64()),
    ("walk_hbm_bytes", pa.float64()), ("walk_mxu_flops", pa.float64()),
])
WALK_COLUMNS = ("walk_qblocks", "walk_steps", "walk_pages", "walk_hbm_bytes", "walk_mxu_flops")
# Walk parts (``walk-*.parquet`` beside the results): the walk features of rows recorded
# before the rows carried them, by ``config_id`` (``backfill_walk``); append-only like the
# results, read by ``read_results_table`` into the rows' empty walk columns.
WALK_PREFIX = "walk-"
WALK_SCHEMA = pa.schema([("config_id", pa.string())] + [(c, SCHEMA.field(c).type) for c in WALK_COLUMNS])
COLUMNS = tuple(SCHEMA.names)
log = logging.getLogger("rpa_tune.store")


def config_id(key_id: str, workload_id: str, bs, backend: str, kernel_hash: str, evaluator_version: str) -> str:
    doc = json.dumps([key_id, workload_id, [int(x) for x in bs], backend, kernel_hash, evaluator_version])
    return hashlib.sha256(doc.encode()).hexdigest()[:20]


def row_block_sizes(r) -> BlockSizes:
    """The block sizes a results row evaluated."""
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
            files.extend(sorted(f for f in p.rglob("*.parquet") if f.is_file() and not f.name.startswith(WALK_PREFIX)
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
    files = result_files(paths)
    table, damaged = _read_files(files)
    table = canonical_rows(table)      # legacy source hashes read as their kernel version
    table = _fill_walk(table, walk_files(paths))
    table = reprice(table)             # metrics under today's device calibration
    return ResultsRead(table, files, damaged)


def _read_files(files) -> tuple[pa.Table, list]:
    """The rows of ``files`` as recorded, conformed to ``SCHEMA``, and the damaged files."""
    import pyarrow.dataset as ds
    tables, damaged = [], []
    for f in files:
        try:
            tables.append(ds.dataset(f, schema=SCHEMA, format="parquet").to_table())
        except Exception as e:  # noqa: BLE001 - any reader failure is a damaged file
            reason = " ".join(str(e).split())[:300]
            damaged.append((str(f), reason))
            log.warning("rpa-tune results: skipping damaged file %s: %s", f, reason)
    return (pa.concat_tables(tables) if tables else SCHEMA.empty_table()), damaged


# ------------------------------------------------------------------------ compaction
COMPACT_PREFIX = "compact-"
# Columns a compacted part leaves out: this machine's wall times and the VMEM prefilter's
# bookkeeping. No table, report or benchmark reads them from stored rows (``rpa-tune show``
# prints a missing one as "-"); a fresh sweep's own parts still hold them. Cycles and every
# time of the estimate (``estimate_s``, the bounds) stay: a later time model re-judges them.
DIAGNOSTIC_COLUMNS = ("eval_s", "compile_s", "vmem_predicted_bytes", "vmem_reported_bytes")
COMPACT_COLUMNS = tuple(c for c in COLUMNS if c not in DIAGNOSTIC_COLUMNS)
COMPACT_MAX_BYTES = 900_000      # a part in git stays under 1 MB (tests/test_data_gates.py)


def is_compact(path) -> bool:
    """Whether ``path`` is a compacted part (``compact``): never rewritten."""
    return Path(path).name.startswith(COMPACT_PREFIX)


def _part_bytes(table: pa.Table) -> bytes:
    import io
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd", compression_level=19)
    return buf.getvalue()


def _compact_chunks(table: pa.Table, max_bytes: int):
    """``(generation, bytes)`` of the parts ``table`` is written as: its rows in time
    order (then config), one generation per part, a generation larger than ``max_bytes``
    split into consecutive runs of rows."""
    import pyarrow.compute as pc
    table = table.select(list(COMPACT_COLUMNS))
    order = [(c, "ascending") for c in ("timestamp", "config_id", "key_id")]
    gens = sorted({g for g in table.column("generation").to_pylist()}, key=lambda g: (g is None, g or ""))
    for g in gens:
        sub = table.filter(pc.is_null(table["generation"]) if g is None else pc.equal(table["generation"], g))
        pending = [sub.sort_by(order)]
        while pending:
            t = pending.pop(0)
            data = _part_bytes(t)
            if len(data) <= max_bytes or t.num_rows < 2:
                yield g, t, data
            else:
                half = t.num_rows // 2
                pending[:0] = [t.slice(0, half), t.slice(half)]


def write_parts(directory, table: pa.Table, merged=(), *, max_bytes: int = COMPACT_MAX_BYTES) -> list[Path]:
    """Write ``table`` into ``directory`` as new compacted parts (``_compact_chunks``), then
    remove the ``merged`` files they replace. A part is named by the newest timestamp of its
    rows and a digest of its bytes, written through a temporary file and an atomic rename,
    and never overwrites a file: a part whose name exists already holds these very bytes.
    A crash leaves the merged files, the new parts, or both (export drops exact duplicate
    rows and resume keys rows by ``config_id``); a file not named in ``merged`` is never
    removed."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    out = []
    for g, t, data in _compact_chunks(table, max_bytes):
        ts = [x for x in t.column("timestamp").to_pylist() if x is not None]
        when = max(ts).strftime("%Y%m%dT%H%M%SZ") if ts else "notime"
        digest = hashlib.sha256(data).hexdigest()[:12]
        p = d / f"{COMPACT_PREFIX}{when}-{g or 'nogen'}-{digest}.parquet"
        if not p.exists():
            tmp = d / f".{p.name}.tmp"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, p)
        out.append(p)
    _fsync_dir(d)
    keep = set(out)
    for p in map(Path, merged):
        if p not in keep:
            p.unlink()
    _fsync_dir(d)
    return out


def compact(directory, *, max_bytes: int = COMPACT_MAX_BYTES) -> list[Path]:
    """Merge the small parts at the top of a results directory (every ``*.parquet`` that is
    not a compacted part, e.g. one file per evaluation as ``rpa-tune sweep`` writes them, or
    an older single ``results.parquet``) into new compacted parts (``write_parts``), rows as
    recorded, and remove them. Existing compacted parts stay byte for byte; a damaged file is
    left in place. Returns the new parts (none when there was nothing to merge)."""
    d = Path(directory)
    if not d.is_dir():
        raise FileNotFoundError(f"results directory {d} does not exist")
    files = sorted(p for p in d.glob("*.parquet") if p.is_file() and not is_compact(p) and not p.name.startswith(WALK_PREFIX))
    if not files:
        return []
    table, damaged = _read_files(files)
    bad = {Path(f) for f, _ in damaged}
    good = [p for p in files if p not in bad]
    if not good:
        return []
    return write_parts(d, table, good, max_bytes=max_bytes)


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


def walk_files(paths) -> list[Path]:
    """The walk parts under results ``paths`` (directories only)."""
    out = []
    for p in map(Path, paths):
        if p.is_dir():
            out.extend(sorted(f for f in p.rglob(f"{WALK_PREFIX}*.parquet") if f.is_file()
                              and not any(part.startswith(".") for part in f.relative_to(p).parts)))
    return out


def _fill_walk(table, files):
    """``table`` with empty walk columns filled from the walk parts ``files`` by config_id."""
    if not files or table.num_rows == 0:
        return table
    known = {}
    for f in files:
        try:
            for r in pq.read_table(f, schema=WALK_SCHEMA).to_pylist():
                known[r["config_id"]] = r
        except Exception as e:  # noqa: BLE001 - a damaged walk part is skipped, as a results file is
            log.warning("skipping walk part %s: %s", f, " ".join(str(e).split())[:200])
    ids = table["config_id"].to_pylist()
    steps = table["walk_steps"].to_pylist()
    if not any(s is None and i in known for i, s in zip(ids, steps)):
        return table
    for c in WALK_COLUMNS:
        vals = table[c].to_pylist()
        vals = [known[i][c] if v is None and s is None and i in known else v for i, v, s in zip(ids, vals, steps)]
        table = table.set_column(table.column_names.index(c), c, pa.array(vals, SCHEMA.field(c).type))
    return table


def row_walk(r: dict):
    """``device_model.Features`` of a results row (a dict of ``SCHEMA`` columns), counted from
    its kernel's walk over its recorded workload; None where the row does not say enough (a
    sliding window the row does not name)."""
    import re

    from kernel.workload import ModelShape, Workload

    from .estimator import device_model
    from .kernels import get_kernel, row_kernel
    sw = None
    if r.get("sliding_window"):
        m = re.search(r"sliding window (\d+)", str(r.get("workload") or ""))
        if not m:
            return None
        sw = int(m.group(1))
    wj = json.loads(r["workload_json"])
    w = Workload(wj["q_lens"], wj["kv_lens"], wj.get("distribution"))
    model = ModelShape(int(r["num_q_heads"]), int(r["num_kv_heads"]), int(r["head_dim"]), r["q_dtype"], r["kv_dtype"])
    return device_model.features(get_kernel(row_kernel(r.get("kernel"))), w, model, r["case"], row_block_sizes(r),
                                 int(r["page_size"]), r["generation"], sw)


def backfill_walk(directory, *, progress=None) -> Path | None:
    """Count the walk features of every priced row under ``directory`` that has none (rows
    recorded before they carried them) and write them as one new walk part (never
    overwriting a file); returns it, or None when no row lacks them. Read back by
    ``read_results_table``, they let ``reprice`` price those rows under today's calibration."""
    from .estimator import device_model
    d = Path(directory)
    t = read_results_table([d]).table
    cols = ["config_id", "status", "method", "metric", "walk_steps", "sliding_window", "workload", "workload_json",
            "num_q_heads", "num_kv_heads", "head_dim", "q_dtype", "kv_dtype", "kernel", "case", "bq", "bkv", "cq",
            "ckv", "page_size", "generation"]
    todo, seen = [], set()
    for r in t.select(cols).to_pylist():
        if (r["status"] == "ok" and r["method"] in (device_model.ESTIMATE, device_model.MODELLED)
                and r["walk_steps"] is None and r["config_id"] not in seen):
            seen.add(r["config_id"])
            todo.append(r)
    memo, out = {}, {c: [] for c in WALK_SCHEMA.names}
    for n, r in enumerate(todo):
        k = tuple(r[c] for c in cols[5:])
        if k not in memo:
            memo[k] = row_walk(r)
        f = memo[k]
        if f is None:
            continue
        out["config_id"].append(r["config_id"])
        for c in WALK_COLUMNS:
            out[c].append(getattr(f, c[len("walk_"):]))
        if progress and n % 2000 == 0:
            progress(n, len(todo))
    if not out["config_id"]:
        return None
    table = pa.Table.from_pydict(out, schema=WALK_SCHEMA)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    data = sink.getvalue().to_pybytes()
    path = d / f"{WALK_PREFIX}{hashlib.sha256(data).hexdigest()[:16]}.parquet"
    if not path.exists():
        tmp = d / f".{path.name}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, path)
    return path


def reprice(table):
    """A results ``pyarrow.Table`` whose rows priced by an older device calibration (or by
    none) carry today's: ``metric`` and ``calibration`` recomputed by
    ``device_model.device_time`` from the row's static estimate (``estimate_s``) and walk
    features (``WALK_COLUMNS``), without a compile. Rows without recorded features (written
    before the device-cost model) keep their static metric and read as calibration "none",
    and so do all rows priced for the same key, kernel and workload (``static_s``): the rows
    one ranking compares are priced one way. Measured rows, and rows without a metric, are
    left alone."""
    if table.num_rows == 0 or "walk_steps" not in table.column_names:
        return table
    from .estimator import device_model
    cols = ["generation", "metric", "method", "estimate_s", "static_s", "calibration", "key_id", "kernel",
            "workload_id", "head_dim", *WALK_COLUMNS]
    rows = table.select(cols).to_pylist()
    priced = (device_model.ESTIMATE, device_model.MODELLED)
    group = lambda r: (r["key_id"], r["kernel"], r["workload_id"])
    static_groups = {group(r) for r in rows
                     if r["metric"] is not None and r["method"] in priced and r["walk_steps"] is None}
    current = {}
    metric, calib, static, changed = [], [], [], False
    for r in rows:
        m, c = r["metric"], r["calibration"]
        # the static time: recorded, or (rows from before it was) the metric they were ranked by
        static.append(r["static_s"] if r["static_s"] is not None or c not in (None, "none") else m)
        if m is not None and r["method"] in priced and group(r) in static_groups:
            if r["static_s"] is not None and r["calibration"] not in (None, "none"):
                m, changed = r["static_s"], True
            c = "none"
        elif m is not None and r["method"] in priced and r["walk_steps"] is not None:
            g = r["generation"]
            if g not in current:
                current[g] = device_model.calibration_for(g)
            cal, version = current[g]
            if cal is not None and c != version:
                feats = device_model.Features(r["walk_qblocks"], r["walk_steps"], r["walk_pages"],
                                              r["walk_hbm_bytes"], r["walk_mxu_flops"], r["head_dim"] or 128)
                est = r["estimate_s"] if r["method"] == device_model.ESTIMATE else None
                m, c, changed = device_model.device_time(est, feats, g, cal.constants)["time_s"], version, True
        metric.append(m)
        calib.append(c if c is not None else "none")
    table = table.set_column(table.column_names.index("calibration"), "calibration", pa.array(calib, pa.string()))
    table = table.set_column(table.column_names.index("static_s"), "static_s", pa.array(static, pa.float64()))
    if changed:
        table = table.set_column(table.column_names.index("metric"), "metric", pa.array(metric, pa.float64()))
    return table


def canonical_rows(table):
    """A results ``pyarrow.Table`` with legacy kernel source hashes read as the version ids
    they stand for (``kernel.provenance.LEGACY_IDS``) in ``kernel_hash``,
    ``kernel_source_hash`` and ``kernel_version``, and the resume ids (``config_id``) of
    such rows computed again from the id, so a sweep of the same version resumes them."""
    import pyarrow.compute as pc
    if table.num_rows == 0 or "kernel_hash" not in table.column_names:
        return table
    legacy = pa.array(sorted(LEGACY_IDS))
    cols = [c for c in ("kernel_hash", "kernel_source_hash", "kernel_version") if c in table.column_names]
    if not any(pc.any(pc.is_in(table[c], value_set=legacy)).as_py() for c in cols):
        return table
    hit = pc.is_in(table["kernel_hash"], value_set=legacy)      # (before the ids are replaced)
    for col in cols:
        vals = [canonical_kernel_id(v) for v in table[col].to_pylist()]
        table = table.set_column(table.column_names.index(col), col, pa.array(vals, pa.string()))
    if "config_id" in table.column_names:
        rows = table.select(["key_id", "workload_id", "bq", "bkv", "cq", "ckv", "backend", "kernel_hash",
                             "evaluator_version", "config_id"]).to_pylist()
        mask = hit.to_pylist()
        ids = [config_id(r["key_id"], r["workload_id"], (r["bq"], r["bkv"], r["cq"], r["ckv"]), r["backend"],
                         r["kernel_hash"], r["evaluator_version"]) if m else r["config_id"]
               for r, m in zip(rows, mask)]
        table = table.set_column(table.column_names.index("config_id"), "config_id", pa.array(ids, pa.string()))
    return table
