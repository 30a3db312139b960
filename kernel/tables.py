"""Tuned block-size tables: the schema, reading, and the lookup used when a server runs.

A table maps a ``TuningKey`` (TPU generation, case, q / KV dtype, q and KV heads per
shard, head_dim, page_size, max_num_tokens bucket, max_model_len bucket, sliding window
yes/no) to the block sizes ``(bq, bkv, cq, ckv)`` found by ``rpa-tune sweep`` and baked
by ``rpa-tune export``, with the metric, the heuristic's metric for the same key, the
gain over it and the provenance. JSON is the canonical form (``Table.to_json_text``:
``indent=2, sort_keys=True``, entries sorted by key, trailing newline); Parquet mirrors
it (``Table.to_parquet``). Schema: ``SCHEMA_VERSION``; README "Tables" documents it.

Lookup order in ``kernel.ragged_paged_attention`` (``kernel.api.resolve_block_sizes``):
explicit argument -> ``RPA_{D,P,M}_BLOCK_SIZES`` -> tables (exact key, then the bucketing
rule of ``TableIndex.find``) -> heuristic.

Tables are read once per process, lazily and thread-safely, from ``$RPA_TABLE`` (files or
directories, ``os.pathsep``-separated; ``none`` disables tables) and then the shipped
tables (``tables/`` next to the ``kernel`` package, else ``kernel/_tables``;
``RPA_SHIPPED_TABLES=0`` skips them). A missing, unreadable, corrupt or newer-schema file
never raises: it is skipped with one warning naming the file. Entries tuned for another
kernel source hash or libtpu are used with one warning per file (``RPA_TABLE_STRICT=1``
refuses them). An entry may carry the scoped VMEM limit it was tuned with
(``vmem_limit_bytes``); the kernel applies it with the entry's block sizes.

This module never imports ``rpa_tune``; Parquet support imports pyarrow lazily.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.resources
import json
import logging
import math
import os
import stat
import threading
from pathlib import Path
from typing import Any, Iterable

from .config import BlockSizes, Case, TuningKey, block_size_errors
from .provenance import KERNEL_SOURCE_FILES, kernel_source_hash, libtpu_version  # noqa: F401 (re-exported)

log = logging.getLogger("kernel.tables")

SCHEMA_VERSION = 1

# Environment variables (documented in the README "Tables" section).
ENV_BLOCK_SIZES = {Case.DECODE: "RPA_D_BLOCK_SIZES", Case.PREFILL: "RPA_P_BLOCK_SIZES",
                   Case.MIXED: "RPA_M_BLOCK_SIZES"}
ENV_TABLE = "RPA_TABLE"                  # PATH[:PATH...] user tables, before the shipped ones; "none": no tables
ENV_SHIPPED = "RPA_SHIPPED_TABLES"       # "0": do not load the shipped tables
ENV_STRICT = "RPA_TABLE_STRICT"          # "1": refuse entries tuned for another kernel hash / libtpu

METHODS = ("estimate", "measured")
KEY_FIELDS = tuple(f.name for f in dataclasses.fields(TuningKey))
PROVENANCE_FIELDS = ("jax_version", "jaxlib_version", "libtpu_version", "kernel_hash", "git_sha",
                     "date", "search", "budget", "backend", "device_kind", "seed", "config_id",
                     "workload_id")
_PROV_INT = ("budget", "seed")


class TableError(ValueError):
    """A table file or document that cannot be used (the message says why)."""


# ------------------------------------------------------------------------------ schema
@dataclasses.dataclass(frozen=True)
class Entry:
    """One tuned key.

    ``block_sizes`` is the best configuration the sweep found for ``key``; the kernel uses
    it only when ``promoted`` (it beat the heuristic by more than ``margin``). A
    non-promoted entry still stops the bucketing rule at its key: the heuristic applies.
    ``gain = heuristic_metric / metric - 1`` (0.10: 10% faster than the heuristic).
    """

    key: TuningKey
    block_sizes: BlockSizes
    promoted: bool
    decision: str
    metric: float                                  # lower is better
    unit: str                                      # "s"
    method: str                                    # "estimate" (compiler) | "measured" (device)
    heuristic_block_sizes: BlockSizes | None = None
    heuristic_metric: float | None = None
    gain: float | None = None
    margin: float | None = None                    # minimum gain required to promote
    samples: int | None = None
    spread: float | None = None                    # same unit as metric
    vmem_limit_bytes: int | None = None            # scoped VMEM limit tuned with; None: kernel default
    provenance: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "block_sizes", BlockSizes.coerce(self.block_sizes))
        if self.heuristic_block_sizes is not None:
            object.__setattr__(self, "heuristic_block_sizes", BlockSizes.coerce(self.heuristic_block_sizes))
        unknown = set(self.provenance) - set(PROVENANCE_FIELDS)
        if unknown:
            raise TableError(f"unknown provenance fields {sorted(unknown)}")
        object.__setattr__(self, "provenance", {k: self.provenance.get(k) for k in PROVENANCE_FIELDS})

    # -- dict form (JSON) ---------------------------------------------------------------
    def to_dict(self) -> dict:
        bs = lambda b: None if b is None else dict(zip(BlockSizes._fields, (int(v) for v in b)))
        return {
            "key": self.key.as_dict(),
            "block_sizes": bs(self.block_sizes),
            "promoted": bool(self.promoted),
            "decision": self.decision,
            "metric": _float(self.metric),
            "unit": self.unit,
            "method": self.method,
            "heuristic_block_sizes": bs(self.heuristic_block_sizes),
            "heuristic_metric": _float(self.heuristic_metric),
            "gain": _float(self.gain),
            "margin": _float(self.margin),
            "samples": None if self.samples is None else int(self.samples),
            "spread": _float(self.spread),
            "vmem_limit_bytes": None if self.vmem_limit_bytes is None else int(self.vmem_limit_bytes),
            "provenance": {k: self.provenance.get(k) for k in PROVENANCE_FIELDS},
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Entry":
        if not isinstance(d, dict):
            raise TableError(f"entry is a {type(d).__name__}, expected an object")
        try:
            kd = d["key"]
            if not isinstance(kd, dict):
                raise TableError("key is not an object")
            missing = [f for f in KEY_FIELDS if f not in kd]
            if missing:
                raise TableError(f"key misses {missing}")
            key = TuningKey(**{f: _key_field(f, kd[f]) for f in KEY_FIELDS})
            entry = cls(
                key=key,
                block_sizes=_block_sizes(d["block_sizes"], "block_sizes"),
                promoted=_bool(d["promoted"], "promoted"),
                decision=str(d.get("decision", "")),
                metric=_req_float(d["metric"], "metric"),
                unit=str(d["unit"]),
                method=str(d["method"]),
                heuristic_block_sizes=(None if d.get("heuristic_block_sizes") is None else
                                       _block_sizes(d["heuristic_block_sizes"], "heuristic_block_sizes")),
                heuristic_metric=_opt_float(d.get("heuristic_metric"), "heuristic_metric"),
                gain=_opt_float(d.get("gain"), "gain"),
                margin=_opt_float(d.get("margin"), "margin"),
                samples=_opt_int(d.get("samples"), "samples"),
                spread=_opt_float(d.get("spread"), "spread"),
                vmem_limit_bytes=_opt_int(d.get("vmem_limit_bytes"), "vmem_limit_bytes"),
                provenance=_provenance(d.get("provenance") or {}),
            )
        except KeyError as e:
            raise TableError(f"entry misses field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            if isinstance(e, TableError):
                raise
            raise TableError(str(e)) from None
        entry.check()
        return entry

    def check(self) -> None:
        """Semantic validity (legal block sizes for the key, known method)."""
        where = self.key.id()
        if self.method not in METHODS:
            raise TableError(f"{where}: method {self.method!r} is not one of {METHODS}")
        errs = block_size_errors(Case.parse(self.key.case), self.block_sizes, self.key.page_size)
        if errs:
            raise TableError(f"{where}: block_sizes {tuple(self.block_sizes)} illegal: " + "; ".join(errs))
        if self.vmem_limit_bytes is not None and self.vmem_limit_bytes <= 0:
            raise TableError(f"{where}: vmem_limit_bytes {self.vmem_limit_bytes} must be positive")
        if not (self.metric > 0 and math.isfinite(self.metric)):
            raise TableError(f"{where}: metric {self.metric!r} must be a positive finite number")

    # -- flat form (Parquet) ------------------------------------------------------------
    def to_row(self) -> dict:
        row = {f: getattr(self.key, f) for f in KEY_FIELDS}
        row.update(zip(BlockSizes._fields, (int(v) for v in self.block_sizes)))
        hb = self.heuristic_block_sizes
        row.update({f"heuristic_{n}": (None if hb is None else int(v))
                    for n, v in zip(BlockSizes._fields, hb or (None,) * 4)})
        row.update(promoted=bool(self.promoted), decision=self.decision, metric=_float(self.metric),
                   unit=self.unit, method=self.method, heuristic_metric=_float(self.heuristic_metric),
                   gain=_float(self.gain), margin=_float(self.margin), samples=self.samples,
                   spread=_float(self.spread), vmem_limit_bytes=self.vmem_limit_bytes)
        row.update({k: self.provenance.get(k) for k in PROVENANCE_FIELDS})
        return row

    @classmethod
    def from_row(cls, row: dict) -> "Entry":
        hb = [row.get(f"heuristic_{n}") for n in BlockSizes._fields]
        d = {
            "key": {f: row[f] for f in KEY_FIELDS},
            "block_sizes": {n: row[n] for n in BlockSizes._fields},
            "heuristic_block_sizes": None if any(v is None for v in hb) else dict(zip(BlockSizes._fields, hb)),
            "provenance": {k: row.get(k) for k in PROVENANCE_FIELDS},
        }
        for f in ("promoted", "decision", "metric", "unit", "method", "heuristic_metric", "gain",
                  "margin", "samples", "spread", "vmem_limit_bytes"):
            d[f] = row.get(f)
        return cls.from_dict(d)


@dataclasses.dataclass(frozen=True)
class Table:
    """A set of entries (unique keys) plus free-form ``info`` (how it was exported)."""

    entries: tuple[Entry, ...] = ()
    info: dict = dataclasses.field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self):
        entries = tuple(sorted(self.entries, key=lambda e: e.key))
        seen = set()
        for e in entries:
            if e.key in seen:
                raise TableError(f"duplicate key {e.key.id()}")
            seen.add(e.key)
        object.__setattr__(self, "entries", entries)

    def __len__(self) -> int:
        return len(self.entries)

    def by_key(self) -> dict[TuningKey, Entry]:
        return {e.key: e for e in self.entries}

    def generations(self) -> list[str]:
        return sorted({e.key.generation for e in self.entries})

    # -- JSON (canonical) ---------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"schema_version": int(self.schema_version), "info": self.info,
                "entries": [e.to_dict() for e in self.entries]}

    def to_json_text(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True, allow_nan=False) + "\n"

    def write_json(self, path) -> None:
        _atomic_write_bytes(Path(path), self.to_json_text().encode())

    @classmethod
    def from_dict(cls, doc: Any, *, on_bad_entry=None) -> "Table":
        """The table of a JSON document. A bad entry (or a repeated key) raises
        ``TableError``, unless ``on_bad_entry(message)`` is given: then that entry alone
        is dropped and reported (serving keeps every good entry of a file)."""
        if not isinstance(doc, dict):
            raise TableError(f"top level is a {type(doc).__name__}, expected an object")
        version = doc.get("schema_version")
        if not isinstance(version, int) or isinstance(version, bool):
            raise TableError(f"schema_version is {version!r}, expected an int")
        if version > SCHEMA_VERSION:
            raise TableError(f"schema_version {version} is newer than this kernel supports "
                             f"({SCHEMA_VERSION}); upgrade the kernel package or re-export the table")
        if version < 1:
            raise TableError(f"schema_version {version} is not a valid version")
        entries = doc.get("entries")
        if not isinstance(entries, list):
            raise TableError("'entries' is missing or not a list")
        info = doc.get("info") or {}
        if not isinstance(info, dict):
            raise TableError("'info' is not an object")
        return cls(_entries(entries, Entry.from_dict, on_bad_entry), info, SCHEMA_VERSION)

    @classmethod
    def from_json_text(cls, text: str, *, on_bad_entry=None) -> "Table":
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise TableError(f"invalid JSON: {e}") from None
        return cls.from_dict(doc, on_bad_entry=on_bad_entry)

    @classmethod
    def read_json(cls, path, *, on_bad_entry=None) -> "Table":
        try:
            text = read_regular_file(path).decode()
        except UnicodeDecodeError as e:
            raise TableError(f"cannot read: {e}") from None
        return cls.from_json_text(text, on_bad_entry=on_bad_entry)

    # -- Parquet (mirror) ---------------------------------------------------------------
    def to_arrow(self):
        import pyarrow as pa
        rows = [e.to_row() for e in self.entries]
        meta = json.dumps({"schema_version": self.schema_version, "info": self.info}, sort_keys=True)
        schema = _arrow_schema().with_metadata({b"rpa_table": meta.encode()})
        return pa.Table.from_pylist(rows, schema=schema)

    def to_parquet_bytes(self) -> bytes:
        import pyarrow as pa
        import pyarrow.parquet as pq
        sink = pa.BufferOutputStream()
        pq.write_table(self.to_arrow(), sink, compression="zstd", use_dictionary=False,
                       write_statistics=False)
        return sink.getvalue().to_pybytes()

    def write_parquet(self, path) -> None:
        _atomic_write_bytes(Path(path), self.to_parquet_bytes())

    @classmethod
    def read_parquet(cls, path, *, on_bad_entry=None) -> "Table":
        data = read_regular_file(path)
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
            t = pq.read_table(pa.BufferReader(data))
        except ImportError as e:
            raise TableError(f"pyarrow is needed to read Parquet tables: {e}") from None
        except Exception as e:  # noqa: BLE001 - any reader failure is a table problem
            raise TableError(f"cannot read Parquet: {e}") from None
        raw = (t.schema.metadata or {}).get(b"rpa_table")
        if raw is None:
            raise TableError("Parquet file has no 'rpa_table' schema metadata (not an rpa-tune table)")
        try:
            meta = json.loads(raw)
        except json.JSONDecodeError as e:
            raise TableError(f"bad 'rpa_table' metadata: {e}") from None
        doc = {"schema_version": meta.get("schema_version"), "info": meta.get("info") or {},
               "entries": []}
        Table.from_dict(doc)  # version checks before touching rows
        missing = [c for c in _arrow_schema().names if c not in t.column_names and c not in PROVENANCE_FIELDS]
        if missing:
            raise TableError(f"Parquet table misses columns {missing}")
        return cls(_entries(t.to_pylist(), Entry.from_row, on_bad_entry), doc["info"], SCHEMA_VERSION)

    @classmethod
    def read(cls, path, *, on_bad_entry=None) -> "Table":
        path = Path(path)
        if path.suffix == ".parquet":
            return cls.read_parquet(path, on_bad_entry=on_bad_entry)
        return cls.read_json(path, on_bad_entry=on_bad_entry)


def _entries(items, parse, on_bad_entry) -> tuple:
    """Parse every entry; a bad one (or a repeated key) raises ``TableError`` naming it, or
    is dropped and reported through ``on_bad_entry`` when given."""
    out, seen = [], set()
    for i, item in enumerate(items):
        try:
            e = parse(item)
            if e.key in seen:
                raise TableError(f"{e.key.id()}: duplicate key (the first entry is kept)")
        except TableError as err:
            msg = f"entry {i}: {err}"
            if on_bad_entry is None:
                raise TableError(msg) from None
            on_bad_entry(msg)
            continue
        seen.add(e.key)
        out.append(e)
    return tuple(out)


def read_regular_file(path) -> bytes:
    """The bytes of ``path`` if it is a regular file (a FIFO, device or directory is
    refused without blocking: ``O_NONBLOCK`` open, then ``fstat``)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise TableError(f"cannot read: {e.strerror or e}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise TableError("not a regular file (tables are read from regular files only)")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    except OSError as e:
        raise TableError(f"cannot read: {e.strerror or e}") from None
    finally:
        os.close(fd)


def _arrow_schema():
    import pyarrow as pa
    i64, f64, s, b = pa.int64(), pa.float64(), pa.string(), pa.bool_()
    fields = [("generation", s), ("case", s), ("q_dtype", s), ("kv_dtype", s),
              ("num_q_heads", i64), ("num_kv_heads", i64), ("head_dim", i64), ("page_size", i64),
              ("max_num_tokens", i64), ("max_model_len", i64), ("sliding_window", b),
              ("bq", i64), ("bkv", i64), ("cq", i64), ("ckv", i64),
              ("heuristic_bq", i64), ("heuristic_bkv", i64), ("heuristic_cq", i64), ("heuristic_ckv", i64),
              ("promoted", b), ("decision", s), ("metric", f64), ("unit", s), ("method", s),
              ("heuristic_metric", f64), ("gain", f64), ("margin", f64), ("samples", i64),
              ("spread", f64), ("vmem_limit_bytes", i64)]
    fields += [(k, i64 if k in _PROV_INT else s) for k in PROVENANCE_FIELDS]
    return pa.schema(fields)


# ---------------------------------------------------------------------------- helpers
def _float(v):
    if v is None:
        return None
    v = float(v)
    return None if math.isnan(v) else v


def _req_float(v, name):
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TableError(f"{name}={v!r} is not a number")
    return float(v)


_KEY_TYPES = {f.name: f.type for f in dataclasses.fields(TuningKey)}


def _key_field(name: str, v):
    """A key field of the declared type (``TuningKey`` coerces; a document must not rely on
    it: ``"sliding_window": "false"`` would be True)."""
    want = _KEY_TYPES[name]
    if want == "bool":
        return _bool(v, f"key.{name}")
    if want == "int":
        if isinstance(v, bool) or not isinstance(v, int):
            raise TableError(f"key.{name}={v!r} is not an int")
        return v
    if not isinstance(v, str):
        raise TableError(f"key.{name}={v!r} is not a string")
    return v


def _opt_float(v, name):
    return None if v is None else _req_float(v, name)


def _opt_int(v, name):
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise TableError(f"{name}={v!r} is not an int")
    return int(v)


def _bool(v, name):
    if not isinstance(v, bool):
        raise TableError(f"{name}={v!r} is not a bool")
    return v


def _block_sizes(v, name) -> BlockSizes:
    if isinstance(v, dict):
        try:
            v = [v[n] for n in BlockSizes._fields]
        except KeyError as e:
            raise TableError(f"{name} misses {e.args[0]!r}") from None
    try:
        return BlockSizes.coerce(v, name=name)
    except ValueError as e:
        raise TableError(str(e)) from None


def _provenance(p: dict) -> dict:
    if not isinstance(p, dict):
        raise TableError("provenance is not an object")
    out = {}
    for k in PROVENANCE_FIELDS:
        v = p.get(k)
        if v is not None:
            if k in _PROV_INT:
                v = _opt_int(v, f"provenance.{k}")
            elif not isinstance(v, str):
                raise TableError(f"provenance.{k}={v!r} is not a string")
        out[k] = v
    return out


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


# ----------------------------------------------------------------- env block sizes
@functools.lru_cache(maxsize=64)
def _parse_env_block_sizes(var: str, raw: str) -> BlockSizes:
    parts = [p.strip() for p in raw.replace(";", ",").split(",")]
    try:
        vals = [int(p) for p in parts]
    except ValueError:
        vals = None
    if vals is None or len(vals) != 4 or any(v <= 0 for v in vals):
        raise ValueError(f"environment variable {var}={raw!r} is malformed: expected 'bq,bkv,cq,ckv' "
                         f"(four positive ints, e.g. '1,2048,1,512'); unset it to use the tables")
    return BlockSizes(*vals)


def env_block_sizes(case) -> tuple[BlockSizes, str] | None:
    """``(BlockSizes, variable name)`` from ``RPA_{D,P,M}_BLOCK_SIZES``, or None when unset
    or empty. A malformed value raises ``ValueError`` naming the variable (a user mistake:
    silently ignoring an override would run a configuration the user did not ask for)."""
    var = ENV_BLOCK_SIZES[Case.parse(case)]
    raw = os.environ.get(var)
    if raw is None or not raw.strip():
        return None
    return _parse_env_block_sizes(var, raw), var


# ------------------------------------------------------------------------------ index
def _family(key: TuningKey) -> tuple:
    """Everything the bucketing rule never crosses."""
    return (key.generation, key.case, key.q_dtype, key.kv_dtype, key.num_q_heads,
            key.num_kv_heads, key.head_dim, key.page_size, key.sliding_window)


@dataclasses.dataclass
class Match:
    entry: Entry
    source: str          # file the entry came from
    exact: bool


class TableIndex:
    """Entries from several tables, earlier tables winning on identical keys.

    ``find(key)``: the exact key; else, within the key's family (same generation, case,
    dtypes, head counts, head_dim, page_size and sliding-window flag), the entry with the
    smallest tabled ``max_num_tokens >= key.max_num_tokens`` and, among those, the smallest
    tabled ``max_model_len >= key.max_model_len`` (a token bucket whose model lengths are all
    too small moves on to the next token bucket). Nothing is ever rounded down.
    """

    def __init__(self):
        self._exact: dict[TuningKey, tuple[Entry, str]] = {}
        self._families: dict[tuple, list[tuple[int, int, TuningKey]]] = {}

    def add(self, table: Table, source: str) -> int:
        added = 0
        for e in table.entries:
            if e.key in self._exact:
                continue
            self._exact[e.key] = (e, source)
            self._families.setdefault(_family(e.key), []).append(
                (e.key.max_num_tokens, e.key.max_model_len, e.key))
            added += 1
        for lst in self._families.values():
            lst.sort()
        return added

    def __len__(self) -> int:
        return len(self._exact)

    def find(self, key: TuningKey) -> Match | None:
        hit = self._exact.get(key)
        if hit is not None:
            return Match(hit[0], hit[1], True)
        for t, l, k in self._families.get(_family(key), ()):
            if t >= key.max_num_tokens and l >= key.max_model_len:
                e, src = self._exact[k]
                return Match(e, src, False)
        return None


# ------------------------------------------------------------------------------ loading
@dataclasses.dataclass
class LoadedTables:
    index: TableIndex
    files: list[tuple[str, str]]        # (path, "ok: N entries" | problem)
    warnings: list[str]


def shipped_table_dir() -> Path | None:
    """The shipped tables: package data ``kernel/_tables`` of an installed wheel (read with
    ``importlib.resources``), else ``tables/`` at the root of the source checkout holding
    the ``kernel`` package (what people edit; the wheel is built from it, see
    pyproject.toml)."""
    data = importlib.resources.files(__package__).joinpath("_tables")
    if data.is_dir():
        return Path(str(data))
    repo = Path(__file__).resolve().parent.parent
    if (repo / "tables").is_dir() and (repo / "pyproject.toml").is_file():
        return repo / "tables"
    return None


def _table_files(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted(p for p in path.iterdir() if p.suffix == ".json" and p.is_file())
    return [path]   # Table.read refuses anything but a regular file


def _strict() -> bool:
    return os.environ.get(ENV_STRICT, "").strip().lower() in ("1", "true", "yes", "on")


def _compat_filter(table: Table, path: str, strict: bool, warn) -> Table:
    cur_hash, cur_libtpu = kernel_source_hash(), libtpu_version()
    bad_hash = sorted({e.provenance.get("kernel_hash") for e in table.entries
                       if e.provenance.get("kernel_hash") not in (None, cur_hash)})
    bad_lib = sorted({e.provenance.get("libtpu_version") for e in table.entries
                      if cur_libtpu is not None
                      and e.provenance.get("libtpu_version") not in (None, cur_libtpu)})
    if not bad_hash and not bad_lib:
        return table
    problems = []
    if bad_hash:
        problems.append(f"tuned for kernel source hash {', '.join(bad_hash)} (current {cur_hash})")
    if bad_lib:
        problems.append(f"tuned with libtpu {', '.join(bad_lib)} (installed {cur_libtpu})")
    n_bad = sum(1 for e in table.entries
                if e.provenance.get("kernel_hash") in bad_hash or e.provenance.get("libtpu_version") in bad_lib)
    if strict:
        warn(f"rpa table {path}: {n_bad} of {len(table)} entries {' and '.join(problems)}; "
             f"refusing them ({ENV_STRICT}=1)")
        keep = tuple(e for e in table.entries if e.provenance.get("kernel_hash") not in bad_hash
                     and e.provenance.get("libtpu_version") not in bad_lib)
        return Table(keep, table.info, table.schema_version)
    warn(f"rpa table {path}: {n_bad} of {len(table)} entries {' and '.join(problems)}; using them "
         f"anyway (set {ENV_STRICT}=1 to refuse)")
    return table


def load_tables(paths: Iterable | None = None, *, shipped: bool | None = None,
                strict: bool | None = None) -> LoadedTables:
    """Read tables (never raises for a bad file: one warning per file, then skipped).

    Defaults come from the environment: ``paths`` from ``$RPA_TABLE`` (``none`` disables
    every table), ``shipped`` from ``$RPA_SHIPPED_TABLES`` (default on), ``strict`` from
    ``$RPA_TABLE_STRICT``.
    """
    warnings_: list[str] = []

    def warn(msg):
        warnings_.append(msg)
        log.warning(msg)

    if paths is None:
        raw = os.environ.get(ENV_TABLE, "")
        if raw.strip().lower() == "none":
            return LoadedTables(TableIndex(), [], [])
        paths = [p for p in raw.split(os.pathsep) if p.strip()]
    if shipped is None:
        shipped = os.environ.get(ENV_SHIPPED, "1").strip().lower() not in ("0", "false", "no", "off")
    if strict is None:
        strict = _strict()
    index = TableIndex()
    files = []
    sources = [(Path(p).expanduser(), True) for p in paths]
    if shipped:
        d = shipped_table_dir()
        if d is not None:
            sources.append((d, False))
        else:
            log.info("no shipped rpa tables found (looked for tables/ next to the kernel package)")
    for src, user in sources:
        if not src.exists():
            msg = f"rpa table {src}: does not exist; falling back to the heuristic for its keys"
            (warn if user else log.info)(msg)
            files.append((str(src), "missing"))
            continue
        for f in _table_files(src):
            rejected = []
            try:
                table = Table.read(f, on_bad_entry=rejected.append)
            except TableError as e:
                warn(f"rpa table {f}: {e}; ignoring this file (the heuristic applies)")
                files.append((str(f), f"ignored: {e}"))
                continue
            except Exception as e:  # noqa: BLE001 - serving must not break on a table
                warn(f"rpa table {f}: unexpected error {type(e).__name__}: {e}; ignoring this file")
                files.append((str(f), f"ignored: {e}"))
                continue
            for msg in rejected:
                warn(f"rpa table {f}: {msg}; ignoring this entry (the heuristic applies for its key)")
            other = sum(1 for e in table.entries if e.provenance.get("kernel_hash") not in (None, kernel_source_hash()))
            table = _compat_filter(table, str(f), strict, warn)
            n = index.add(table, str(f))
            files.append((str(f), f"ok: {n} entries" + (f", {len(rejected)} rejected" if rejected else "")
                          + (f", {other} tuned for another kernel source hash" if other else "")))
    return LoadedTables(index, files, warnings_)


_lock = threading.Lock()
_loaded: LoadedTables | None = None
_logged_keys: set = set()
_epoch = 0


def epoch() -> int:
    """Incremented by ``reset``/``reload``: callers memoising lookups key on it."""
    return _epoch


def loaded() -> LoadedTables:
    """The process-wide tables, read on first use (thread-safe)."""
    global _loaded
    state = _loaded
    if state is None:
        with _lock:
            if _loaded is None:
                _loaded = load_tables()
            state = _loaded
    return state


def reset() -> None:
    """Forget the loaded tables and lookup cache; nothing is read until the next lookup."""
    global _loaded, _epoch
    with _lock:
        _loaded = None
        _epoch += 1
        _logged_keys.clear()
        _lookup_cached.cache_clear()


def reload() -> LoadedTables:
    """Like ``reset``, then re-read the tables from the environment now."""
    reset()
    return loaded()


def _log_once(key: TuningKey, msg: str) -> None:
    with _lock:
        if key in _logged_keys:
            return
        _logged_keys.add(key)
    log.info(msg)


# ------------------------------------------------------------------------------ lookup
def key_for(case, *, generation: str, dims: dict, sliding_window: bool = False) -> TuningKey:
    """The ``TuningKey`` of a call (``dims`` from ``kernel.validate_inputs``);
    ``max_model_len = pages_per_seq * page_size``."""
    return TuningKey(generation=generation, case=Case.parse(case).value, q_dtype=dims["q_dtype"],
                     kv_dtype=dims["kv_dtype"], num_q_heads=dims["num_q_heads"],
                     num_kv_heads=dims["num_kv_heads"], head_dim=dims["head_dim"],
                     page_size=dims["page_size"], max_num_tokens=dims["max_num_tokens"],
                     max_model_len=dims["pages_per_seq"] * dims["page_size"],
                     sliding_window=bool(sliding_window))


def lookup_block_sizes(case, *, generation: str, dims: dict, sliding_window: bool = False):
    """Return ``(BlockSizes, source)`` from the tables, or None (the heuristic applies).

    None when no entry matches (exact key, then the bucketing rule), or the matching entry
    was not promoted. The first miss per key is logged once at INFO. Cached per key.
    """
    found = lookup_entry(case, generation=generation, dims=dims, sliding_window=sliding_window)
    return None if found is None else found[:2]


def lookup_entry(case, *, generation: str, dims: dict, sliding_window: bool = False):
    """``(BlockSizes, source, vmem_limit_bytes)`` (the limit the entry was tuned with, None
    for the kernel's default), or None; see ``lookup_block_sizes``."""
    return _lookup_cached(Case.parse(case).value, generation, dims["q_dtype"], dims["kv_dtype"],
                          dims["num_q_heads"], dims["num_kv_heads"], dims["head_dim"],
                          dims["page_size"], dims["max_num_tokens"],
                          dims["pages_per_seq"] * dims["page_size"], bool(sliding_window))


@functools.lru_cache(maxsize=4096)
def _lookup_cached(case, generation, q_dtype, kv_dtype, hq, hkv, d, page_size, t, model_len, sw):
    key = TuningKey(generation=generation, case=case, q_dtype=q_dtype, kv_dtype=kv_dtype,
                    num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=page_size,
                    max_num_tokens=t, max_model_len=model_len, sliding_window=sw)
    m = loaded().index.find(key)
    if m is None:
        _log_once(key, f"rpa table miss for {key.id()}: no entry (exact or bucketed); using the heuristic")
        return None
    where = f"{m.source}#{m.entry.key.id()}"
    if not m.entry.promoted:
        _log_once(key, f"rpa table entry {where} for {key.id()} keeps the heuristic "
                       f"({m.entry.decision})")
        return None
    if not m.exact:
        _log_once(key, f"rpa table: no exact entry for {key.id()}; using bucket {m.entry.key.id()} "
                       f"from {m.source}")
    return (m.entry.block_sizes, f"table:{where}" + ("" if m.exact else " (bucket)"),
            m.entry.vmem_limit_bytes)


__all__ = [
    "SCHEMA_VERSION", "Entry", "Table", "TableError", "TableIndex", "ENV_BLOCK_SIZES", "ENV_TABLE",
    "ENV_SHIPPED", "ENV_STRICT", "env_block_sizes", "key_for", "kernel_source_hash", "libtpu_version",
    "load_tables", "loaded", "lookup_block_sizes", "lookup_entry", "reload", "reset", "shipped_table_dir",
    "epoch",
]
