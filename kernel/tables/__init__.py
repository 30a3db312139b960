"""Tuned block-size tables: the schema, reading, and the lookup used when a server runs.

A table maps a ``TuningKey`` (TPU generation, case, q / KV dtype, q and KV heads per
shard, head_dim, page_size, max_num_tokens bucket, max_model_len bucket, sliding window
yes/no) to the block sizes ``(bq, bkv, cq, ckv)`` found by ``rpa-tune sweep`` and baked
by ``rpa-tune export``, with the metric, the heuristic's metric for the same key, the
gain over it and the provenance. JSON is the canonical form (``Table.to_json_text``:
``indent=2, sort_keys=True``, entries sorted by key, trailing newline); Parquet mirrors
it (``Table.to_parquet``). Schema: ``SCHEMA_VERSION``; docs/tables.md documents it.

Lookup order in ``kernel.ragged_paged_attention`` (``kernel.api.resolve_block_sizes``):
explicit argument -> ``RPA_{D,P,M}_BLOCK_SIZES`` -> tables (exact key, then the bucketing
rule of ``TableIndex.find``) -> heuristic.

Tables are read once per process, lazily and thread-safely, from ``$RPA_TABLE`` (files or
directories, ``os.pathsep``-separated; ``none`` disables tables) and then the shipped
tables (package data ``kernel/_tables`` of a wheel, else ``tables/`` at the root of the
source checkout; ``RPA_SHIPPED_TABLES=0`` skips them). A missing, unreadable, corrupt or
newer-schema file never raises: it is skipped with one warning naming the file; a bad entry
drops only itself, with one warning naming it. Entries tuned for another
kernel source hash or libtpu are used with one warning per file (``RPA_TABLE_STRICT=1``
refuses them). An entry may carry the scoped VMEM limit it was tuned with
(``vmem_limit_bytes``); the kernel applies it with the entry's block sizes.

Tables of tpu-inference's RPA v3 (``info.kernel = "tpu-inference"``; shipped in
``tables/tpu-inference/``, ``$RPA_TPU_INFERENCE_TABLE``) serve a server that calls that
kernel: ``block_sizes_for`` returns its ``d/p/m_block_sizes`` arguments (override ->
table -> bucket -> the kernel's own default). Our kernel never reads them.

One module per concept: ``schema`` (Entry, Table, JSON, field validation, reading regular
files, the Parquet mirror), ``env`` (environment variables), ``index`` (bucketing),
``loading`` (which files, per-file and per-entry rejection), ``state`` (the process-wide
tables and the memoised lookup); the kernel's version id is in ``kernel.provenance``. This
package never imports ``rpa_tune``; Parquet support imports pyarrow lazily.
"""
from __future__ import annotations

from ..provenance import kernel_id, libtpu_version
from .env import (ENV_BLOCK_SIZES, ENV_PUBLIC_BLOCK_SIZES, ENV_PUBLIC_TABLE, ENV_SHIPPED, ENV_STRICT, ENV_TABLE,
                  env_block_sizes)
from .index import Match, TableIndex
from .loading import LoadedTables, load_tables, shipped_table_dir, tuned_for_another_kernel
from .schema import (DEFAULT_KERNEL, KERNEL_NAMES, KEY_FIELDS, METHODS, PROVENANCE_FIELDS, PUBLIC_KERNEL,
                     SCHEMA_VERSION, Entry, Table, TableError, read_regular_file, table_kernel)
from .state import (_lookup_cached, block_sizes_for, epoch, key_for,
                    loaded, lookup_block_sizes, lookup_entry, reload, reset)

__all__ = [
    "SCHEMA_VERSION", "Entry", "Table", "TableError", "TableIndex", "ENV_BLOCK_SIZES", "ENV_TABLE",
    "ENV_SHIPPED", "ENV_STRICT", "env_block_sizes", "key_for", "kernel_id", "libtpu_version",
    "load_tables", "loaded", "lookup_block_sizes", "lookup_entry", "reload", "reset", "shipped_table_dir",
    "epoch", "KEY_FIELDS", "METHODS", "PROVENANCE_FIELDS", "LoadedTables", "Match",
    "read_regular_file", "DEFAULT_KERNEL", "PUBLIC_KERNEL", "KERNEL_NAMES", "table_kernel", "block_sizes_for",
    "ENV_PUBLIC_BLOCK_SIZES", "ENV_PUBLIC_TABLE", "tuned_for_another_kernel",
]
