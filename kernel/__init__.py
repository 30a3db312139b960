"""rpa-tune's Ragged Paged Attention kernel for TPU (JAX Pallas / Mosaic).

Public API::

    out, new_kv_cache = kernel.ragged_paged_attention(queries, keys, values, kv_cache,
        kv_lens, page_indices, cu_q_lens, distribution, *, sm_scale=1.0, ...)   # as RPA v3
    out, new_kv_cache = kernel.ragged_paged_attention_hd64(...)   # as tpu-inference's head_dim-64 kernel
    report = kernel.precompile(model_shape, serving_limits, tpu=None)  # before serving

Block sizes resolve per case: explicit argument -> RPA_{D,P,M}_BLOCK_SIZES -> tuned tables
(``kernel.tables``) -> heuristic (``kernel.heuristics``).

Importing the package (or ``kernel.config``, ``kernel.tables``) is light: JAX and Pallas
are imported on first use of an attribute that needs them (PEP 562 ``__getattr__``), so
the CLI can use the kernel's own constants without initialising a backend.
"""
from __future__ import annotations

import importlib

from .config import (BlockSizes, CASES, Case, GENERATIONS, TpuGeneration, TuningKey, block_size_errors,
                     get_generation, get_kv_cache_shape, get_kv_cache_shape_hd64, kv_packing)

# attribute -> module that defines it (imported on first access)
_LAZY = {
    "ragged_paged_attention": ".api",
    "ragged_paged_attention_hd64": ".api",
    "validate_inputs": ".validate",
    "precompile": ".bringup",
    "reference": None,          # the submodule itself
}

__all__ = [
    "BlockSizes", "CASES", "Case", "GENERATIONS", "TpuGeneration", "TuningKey", "block_size_errors",
    "get_generation", "get_kv_cache_shape", "get_kv_cache_shape_hd64", "kv_packing", "ragged_paged_attention",
    "ragged_paged_attention_hd64",
    "validate_inputs", "reference", "precompile",
]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'kernel' has no attribute {name!r}")
    module = _LAZY[name]
    if module is None:
        value = importlib.import_module(f".{name}", __name__)
    else:
        value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
