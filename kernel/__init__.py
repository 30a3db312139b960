"""rpa-tune's Ragged Paged Attention kernel for TPU (JAX Pallas / Mosaic).

Public API::

    out, new_kv_cache = kernel.ragged_paged_attention(queries, keys, values, kv_cache,
        kv_lens, page_indices, cu_q_lens, distribution, *, sm_scale=1.0, ...)
    report = kernel.precompile(model_shape, serving_limits, tpu=None)  # before serving

Block sizes resolve per case: explicit argument -> RPA_{D,P,M}_BLOCK_SIZES -> tuned tables
(``kernel.tables``) -> heuristic (``kernel.heuristics``).
"""
from .config import (BlockSizes, CASES, Case, GENERATIONS, TpuGeneration, TuningKey, block_size_errors,
                     get_generation, get_kv_cache_shape, kv_packing)
from .api import ragged_paged_attention
from .validate import validate_inputs
from .bringup import precompile
from . import reference

__all__ = [
    "BlockSizes", "CASES", "Case", "GENERATIONS", "TpuGeneration", "TuningKey", "block_size_errors",
    "get_generation", "get_kv_cache_shape", "kv_packing", "ragged_paged_attention",
    "validate_inputs", "reference", "precompile",
]
