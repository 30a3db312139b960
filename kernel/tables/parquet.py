"""The Parquet mirror of a table: one flat row per entry (key fields, ``bq..ckv``,
``heuristic_bq..``, the metrics, provenance columns), ``schema_version`` and ``info`` in
the schema metadata. pyarrow is imported lazily (serving reads JSON only)."""
from __future__ import annotations

import json

from ..config import BlockSizes
from .schema import (_PROV_INT, KEY_FIELDS, PROVENANCE_FIELDS, SCHEMA_VERSION, Entry, Table, TableError, _entries,
                     _float, read_regular_file)

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
