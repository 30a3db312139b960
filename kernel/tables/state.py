"""The process-wide tables (read once, lazily, thread-safely) and the memoised lookup."""
from __future__ import annotations

import functools
import logging
import threading

from ..config import BlockSizes, CASES, Case, TuningKey
from .loading import LoadedTables, load_tables
from .schema import DEFAULT_KERNEL, KERNEL_NAMES, PUBLIC_KERNEL

log = logging.getLogger("kernel.tables")

_lock = threading.Lock()
_loaded: LoadedTables | None = None
_loaded_other: dict[str, LoadedTables] = {}    # other kernels' tables (block_sizes_for)
_logged_keys: set = set()
_epoch = 0




def epoch() -> int:
    """Incremented by ``reset``/``reload``: callers memoising lookups key on it."""
    return _epoch


def loaded(kernel: str = DEFAULT_KERNEL) -> LoadedTables:
    """The process-wide tables of ``kernel``, read on first use (thread-safe)."""
    global _loaded
    if kernel != DEFAULT_KERNEL:
        if kernel not in KERNEL_NAMES:
            raise ValueError(f"unknown kernel {kernel!r}; valid: {', '.join(KERNEL_NAMES)}")
        with _lock:
            if kernel not in _loaded_other:
                _loaded_other[kernel] = load_tables(kernel=kernel)
            return _loaded_other[kernel]
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
        _loaded_other.clear()
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


# ------------------------------------------------------- bring-up of tpu-inference's RPA v3
def _dtype_name(d) -> str:
    """A dtype's name ("bfloat16") from a name, a NumPy / JAX dtype or scalar type."""
    if isinstance(d, str):
        return d
    import numpy as np
    return np.dtype(d).name
def block_sizes_for(*, kernel: str = PUBLIC_KERNEL, generation: str, q_dtype: str, kv_dtype: str,
                    num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                    max_num_tokens: int, pages_per_seq: int, sliding_window=None) -> dict:
    """Block sizes for a server that calls tpu-inference's RPA v3 (``kernel`` is its name,
    the only one this serves: our kernel resolves its own, ``kernel.api``), as the keyword
    arguments of its ``ragged_paged_attention``: ``{"d_block_sizes": (bq, bkv, cq, ckv),
    "p_block_sizes": ..., "m_block_sizes": ...}``, with a case present only when something
    chose it. Per case, in order: the ``RPA_V3_{DECODE,PREFILL,MIXED}_BLOCK_SIZES``
    variable (the ones vLLM-TPU reads), then its tables (``$RPA_TPU_INFERENCE_TABLE``, then
    the shipped ``tables/tpu-inference/``; exact key, then the bucketing rule), and
    otherwise nothing: the kernel's own default applies (``get_default_block_sizes``).
    A malformed variable raises ``ValueError`` naming it; a bad table is skipped with a
    warning. ``q_dtype`` / ``kv_dtype``: dtypes or their names ("bfloat16", "float8_e4m3fn")."""
    from .env import ENV_PUBLIC_BLOCK_SIZES, env_block_sizes
    if kernel != PUBLIC_KERNEL:
        raise ValueError(f"block_sizes_for serves kernel {PUBLIC_KERNEL!r}, got {kernel!r} (this project's "
                         "kernel looks its block sizes up itself)")
    out = {}
    for case in CASES:
        arg = f"{case.value[0]}_block_sizes"
        env = env_block_sizes(case, ENV_PUBLIC_BLOCK_SIZES)
        if env is not None:
            out[arg] = tuple(env[0])
            continue
        key = TuningKey(generation=generation, case=case.value, q_dtype=_dtype_name(q_dtype),
                        kv_dtype=_dtype_name(kv_dtype),
                        num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                        page_size=page_size, max_num_tokens=max_num_tokens,
                        max_model_len=pages_per_seq * page_size, sliding_window=sliding_window is not None)
        m = loaded(kernel).index.find(key)
        if m is None or not m.entry.promoted:
            _log_once((kernel, key), f"{kernel} table: no promoted entry for {key.id()}; the kernel's own "
                                     "default applies")
            continue
        out[arg] = tuple(BlockSizes.coerce(m.entry.block_sizes))
    return out
