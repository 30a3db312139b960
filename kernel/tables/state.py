"""The process-wide tables (read once, lazily, thread-safely) and the memoised lookup."""
from __future__ import annotations

import functools
import logging
import threading

from ..config import Case, TuningKey
from .loading import LoadedTables, load_tables

log = logging.getLogger("kernel.tables")

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
