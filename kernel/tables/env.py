"""Environment variables of the tables: block-size overrides and where tables come from."""
from __future__ import annotations

import functools
import os

from ..config import BlockSizes, Case

# Environment variables (documented in docs/tables.md).
ENV_BLOCK_SIZES = {Case.DECODE: "RPA_D_BLOCK_SIZES", Case.PREFILL: "RPA_P_BLOCK_SIZES",
                   Case.MIXED: "RPA_M_BLOCK_SIZES"}
ENV_TABLE = "RPA_TABLE"                  # PATH[:PATH...] user tables, before the shipped ones; "none": no tables
ENV_SHIPPED = "RPA_SHIPPED_TABLES"       # "0": do not load the shipped tables
ENV_STRICT = "RPA_TABLE_STRICT"          # "1": refuse entries tuned for another kernel hash / libtpu
# tpu-inference's RPA v3 (kernel.tables.block_sizes_for): its own override variables (the
# ones vLLM-TPU reads) and where its tables come from
ENV_PUBLIC_BLOCK_SIZES = {Case.DECODE: "RPA_V3_DECODE_BLOCK_SIZES", Case.PREFILL: "RPA_V3_PREFILL_BLOCK_SIZES",
                          Case.MIXED: "RPA_V3_MIXED_BLOCK_SIZES"}
ENV_PUBLIC_TABLE = "RPA_TPU_INFERENCE_TABLE"   # like RPA_TABLE, for tpu-inference's tables


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


def env_block_sizes(case, variables: dict = ENV_BLOCK_SIZES) -> tuple[BlockSizes, str] | None:
    """``(BlockSizes, variable name)`` from ``RPA_{D,P,M}_BLOCK_SIZES`` (or ``variables``:
    ``ENV_PUBLIC_BLOCK_SIZES``), or None when unset or empty. A malformed value raises
    ``ValueError`` naming the variable (a user mistake: silently ignoring an override would
    run a configuration the user did not ask for)."""
    var = variables[Case.parse(case)]
    raw = os.environ.get(var)
    if raw is None or not raw.strip():
        return None
    return _parse_env_block_sizes(var, raw), var


def env_flag(var: str, default: str = "") -> bool:
    """A yes/no environment variable: 1, true, yes, on (any case) are yes."""
    return os.environ.get(var, default).strip().lower() in ("1", "true", "yes", "on")
