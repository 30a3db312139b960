"""Hardware facts per TPU generation, read from JAX's own table (``jax._src.tpu_info``)."""
from __future__ import annotations

import functools
import os

from .config import TpuGeneration, get_generation

GENERATION_ENV = "RPA_TPU_GENERATION"
DEFAULT_GENERATION = "v6e"


@functools.lru_cache(maxsize=None)
def tpu_info(generation: str):
    """``jax._src.tpu_info.TpuInfo`` for one TensorCore of the generation."""
    from jax._src import tpu_info as ti
    gen = get_generation(generation)
    return ti.get_tpu_info_for_chip(ti.ChipVersion[gen.chip_version], 1)


def current_generation() -> TpuGeneration:
    """The local TPU's generation; else ``$RPA_TPU_GENERATION``; else v6e (documented default)."""
    import jax
    try:
        dev = jax.devices()[0]
        if dev.platform == "tpu":
            return get_generation(dev.device_kind)
    except Exception:
        pass
    return get_generation(os.environ.get(GENERATION_ENV, DEFAULT_GENERATION))
