"""The table schema: ``Entry`` and ``Table``, their canonical JSON form, field validation,
and reading files (regular files only), and the Parquet mirror of a table: one flat row per entry
(key fields, ``bq..ckv``, ``heuristic_bq..``, the metrics, provenance columns), ``schema_version``
and ``info`` in the schema metadata; pyarrow is imported lazily (serving reads JSON only)."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import stat
from pathlib import Path
from typing import Any

from ..config import BlockSizes, Case, TuningKey, block_size_errors

SCHEMA_VERSION = 1
METHODS = ("estimate", "measured", "modelled")
# The kernels a table can be for: this project's, and tpu-inference's RPA v3 (the one
# vLLM-TPU and SGLang-JAX run). A table holds one kernel's entries; its ``info["kernel"]``
# names it (absent: ours, as in every table written before there were two).
DEFAULT_KERNEL, PUBLIC_KERNEL = "rpa-tune", "tpu-inference"
KERNEL_NAMES = (DEFAULT_KERNEL, PUBLIC_KERNEL)
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
    spread: float | None = None                    # relative: a fraction of metric (IQR / median)
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
        if self.spread is not None and not (self.spread >= 0 and math.isfinite(self.spread)):
            raise TableError(f"{where}: spread {self.spread!r} must be a finite fraction of the metric (>= 0)")

    # -- flat form (the Parquet mirror's row) --------------------------------------------
    def to_row(self) -> dict:
        return entry_to_row(self)

    @classmethod
    def from_row(cls, row: dict) -> "Entry":
        return entry_from_row(row)


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

    @property
    def kernel(self) -> str:
        """The kernel whose block sizes these are (``info["kernel"]``, default ours)."""
        return table_kernel(self.info)

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
        table_kernel(info)
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

    # -- Parquet (the mirror, below) ------------------------------------------------------
    def to_arrow(self):
        return table_to_arrow(self)

    def to_parquet_bytes(self) -> bytes:
        return table_to_parquet_bytes(self)

    def write_parquet(self, path) -> None:
        _atomic_write_bytes(Path(path), self.to_parquet_bytes())

    @classmethod
    def read_parquet(cls, path, *, on_bad_entry=None) -> "Table":
        return read_parquet(path, on_bad_entry=on_bad_entry)

    @classmethod
    def read(cls, path, *, on_bad_entry=None) -> "Table":
        path = Path(path)
        if path.suffix == ".parquet":
            return cls.read_parquet(path, on_bad_entry=on_bad_entry)
        return cls.read_json(path, on_bad_entry=on_bad_entry)


def table_kernel(info: dict) -> str:
    """The kernel named by a table's ``info`` (``DEFAULT_KERNEL`` when absent); ``TableError``
    for a value that is no kernel name (lower-case letters, digits, ``.``, ``_``, ``-``). A
    table of a kernel other than the one a loader reads is skipped by that loader."""
    k = (info or {}).get("kernel", DEFAULT_KERNEL)
    if not isinstance(k, str) or not _KERNEL_NAME.fullmatch(k):
        raise TableError(f"info.kernel={k!r} is not a kernel name (e.g. {', '.join(KERNEL_NAMES)})")
    return k


_KERNEL_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")


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


# ---------------------------------------------------------------- the Parquet mirror
_ENTRY_FIELDS = ("promoted", "decision", "metric", "unit", "method", "heuristic_metric", "gain", "margin",
                 "samples", "spread", "vmem_limit_bytes")


def arrow_schema():
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


def entry_to_row(e: Entry) -> dict:
    row = {f: getattr(e.key, f) for f in KEY_FIELDS}
    row.update(zip(BlockSizes._fields, (int(v) for v in e.block_sizes)))
    hb = e.heuristic_block_sizes
    row.update({f"heuristic_{n}": (None if hb is None else int(v))
                for n, v in zip(BlockSizes._fields, hb or (None,) * 4)})
    row.update(promoted=bool(e.promoted), decision=e.decision, metric=_float(e.metric),
               unit=e.unit, method=e.method, heuristic_metric=_float(e.heuristic_metric),
               gain=_float(e.gain), margin=_float(e.margin), samples=e.samples,
               spread=_float(e.spread), vmem_limit_bytes=e.vmem_limit_bytes)
    row.update({k: e.provenance.get(k) for k in PROVENANCE_FIELDS})
    return row


def entry_from_row(row: dict) -> Entry:
    hb = [row.get(f"heuristic_{n}") for n in BlockSizes._fields]
    d = {
        "key": {f: row[f] for f in KEY_FIELDS},
        "block_sizes": {n: row[n] for n in BlockSizes._fields},
        "heuristic_block_sizes": None if any(v is None for v in hb) else dict(zip(BlockSizes._fields, hb)),
        "provenance": {k: row.get(k) for k in PROVENANCE_FIELDS},
    }
    for f in _ENTRY_FIELDS:
        d[f] = row.get(f)
    return Entry.from_dict(d)


def table_to_arrow(t: Table):
    import pyarrow as pa
    meta = json.dumps({"schema_version": t.schema_version, "info": t.info}, sort_keys=True)
    schema = arrow_schema().with_metadata({b"rpa_table": meta.encode()})
    return pa.Table.from_pylist([entry_to_row(e) for e in t.entries], schema=schema)


def table_to_parquet_bytes(t: Table) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq
    sink = pa.BufferOutputStream()
    pq.write_table(table_to_arrow(t), sink, compression="zstd", use_dictionary=False, write_statistics=False)
    return sink.getvalue().to_pybytes()


def read_parquet(path, *, on_bad_entry=None) -> Table:
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
    doc = {"schema_version": meta.get("schema_version"), "info": meta.get("info") or {}, "entries": []}
    Table.from_dict(doc)  # version checks before touching rows
    missing = [c for c in arrow_schema().names if c not in t.column_names and c not in PROVENANCE_FIELDS]
    if missing:
        raise TableError(f"Parquet table misses columns {missing}")
    return Table(_entries(t.to_pylist(), entry_from_row, on_bad_entry), doc["info"], SCHEMA_VERSION)
