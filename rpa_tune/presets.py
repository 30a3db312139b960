"""Shipped model presets: the per-shard attention shape of well-known models.

A preset is only an attention shape (``kernel.workload.ModelShape``): query heads and KV
heads *per shard* (after tensor parallelism), head_dim and dtypes. Sliding-window layers
and logit soft-capping are not modelled by presets.
"""
from __future__ import annotations

import dataclasses

from kernel.workload import ModelShape


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    description: str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    q_dtype: str = "bfloat16"
    kv_dtype: str = "bfloat16"

    def model(self, *, q_dtype: str | None = None, kv_dtype: str | None = None) -> ModelShape:
        return ModelShape(self.num_q_heads, self.num_kv_heads, self.head_dim,
                          q_dtype or self.q_dtype, kv_dtype or self.kv_dtype)

    def summary(self) -> str:
        return (f"{self.num_q_heads} q / {self.num_kv_heads} kv heads per shard, head_dim "
                f"{self.head_dim}, {self.q_dtype}/{self.kv_dtype}")


PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("llama3-8b", "Llama-3/3.1-8B, one shard (GQA 32/8)", 32, 8, 128),
    Preset("llama3-70b-tp8", "Llama-3/3.1-70B at tensor parallelism 8 (64/8 heads -> 8/1 per shard)", 8, 1, 128),
    Preset("qwen3-32b", "Qwen3-32B-like GQA, one shard (64/8, group 8)", 64, 8, 128),
    Preset("qwen3-32b-tp4", "Qwen3-32B-like GQA at tensor parallelism 4 (16/2 per shard)", 16, 2, 128),
    Preset("starcoder-15b", "StarCoder-15B-like MQA (48 q heads, 1 KV head)", 48, 1, 128),
    Preset("llama3.2-1b", "Llama-3.2-1B: head_dim 64 (GQA 32/8)", 32, 8, 64),
    Preset("gemma2-9b", "Gemma-2-9B global-attention shape: head_dim 256 (GQA 16/8)", 16, 8, 256),
)}

DEFAULT_PRESET = "llama3-8b"


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; valid: {', '.join(PRESETS)}") from None
