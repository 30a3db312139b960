"""Analytic VMEM model of the kernel's scratch buffers (tile padding included).

Used as a pre-filter before compiling: it counts the buffers the kernel allocates
(``rpa.build_case_call``) with Mosaic's minimal tiling (second-minor dims are padded to
the dtype's sublane packing only when they exceed it), plus the f32 score tile of one
compute step. The compiler's temporaries and spills come on top, so this is a lower
bound on scoped VMEM: a config it rejects, the compiler rejects too.
"""
from __future__ import annotations

import numpy as np

from .config import BlockSizes, round_up

LANES = 128
SUBLANES = 8
VMEM_BANKS = 32


def _tile_rows(second_minor: int, dtype) -> int:
    pack = 4 // np.dtype(dtype).itemsize
    sub = 8 * pack
    return second_minor if second_minor <= sub else round_up(second_minor, sub)


def _bytes(shape, dtype) -> int:
    *lead, sm, m = shape
    n = int(np.prod(lead, dtype=np.int64)) if lead else 1
    return n * _tile_rows(sm, dtype) * round_up(m, LANES) * np.dtype(dtype).itemsize


def kv_buffer_rows(kv_rows: int) -> int:
    """Rows per token of the kernel's KV block buffer: ``kv_rows``, plus one of padding when
    a sublane-strided load at stride ``kv_rows`` (one head's words over 8 tokens) would hit
    a VMEM bank twice. With 32 banks, 8 rows at stride 8 touch 4 banks: libtpu then splits
    every such load into two half loads plus an OR (seen in the profiler's bundle trace,
    Llama-3-8B shard: 8 rows per token); an odd stride touches 8 banks."""
    banks = {(t * kv_rows) % VMEM_BANKS for t in range(SUBLANES)}
    return kv_rows + 1 if kv_rows > 1 and len(banks) < SUBLANES else kv_rows


def q_buffer_heads(num_kv_heads: int, group: int, q_dtype) -> int:
    """KV heads per token of the kernel's q / o block buffers. A bf16 q with an even group
    is read and written as uint32 words (two query heads per word: ``kernel.rpa``'s
    ``load_q`` / ``finalize``), one sublane-strided access per (KV head, head pair) at a
    stride of ``heads * group / 2`` words; one padding head when that stride would hit a
    VMEM bank twice (as ``kv_buffer_rows``)."""
    if np.dtype(q_dtype).name != "bfloat16" or group % 2:
        return num_kv_heads
    words = num_kv_heads * group // 2
    return num_kv_heads + 1 if kv_buffer_rows(words) != words else num_kv_heads


def scratch_bytes(bs: BlockSizes, *, num_kv_heads: int, group: int, head_dim: int, page_size: int,
                  kv_rows: int, kv_pack: int, q_dtype, kv_dtype, decode: bool = False) -> int:
    """Scratch bytes of one case's kernel (``decode``: bq is its sequences per step, each
    with its own KV block and new-token row)."""
    bq, bkv, cq, ckv = bs
    nseq = bq if decode else 1
    Dp = round_up(head_dim, LANES)
    total = 0
    total += 2 * _bytes((2, bq, q_buffer_heads(num_kv_heads, group, q_dtype), group, Dp), q_dtype)  # q/o_buf
    total += _bytes((2, nseq * bkv // page_size, page_size, kv_buffer_rows(kv_rows), kv_pack, Dp), kv_dtype)
    total += _bytes((2, nseq, kv_rows, kv_pack, Dp), kv_dtype)
    rows = (bq, group) if decode else (bq * group,)
    total += _bytes((num_kv_heads, *rows, Dp), np.float16)  # qh (bf16; same tiling as f16)
    total += _bytes((num_kv_heads, *rows, Dp), np.float32)             # acc
    total += 2 * _bytes((num_kv_heads, *rows, LANES), np.float32)      # m, l
    # one update's live f32 tiles: scores/probabilities (a row tile) and the K/V chunk
    total += 2 * round_up(min(cq * group, max(16, 64 * 8 * LANES // round_up(ckv, LANES))), 8) \
        * round_up(ckv, LANES) * 4
    total += 2 * ckv * kv_pack * Dp * 4 * nseq
    return total


def default_vmem_limit(scratch: int, capacity: int) -> int:
    """The scoped limit requested per config: scratch plus headroom for the compiler's own
    temporaries (50% + 2 MiB), at least 16 MiB, and at most half the chip's VMEM (the
    compiler reserves the whole limit and adds the kernel's scoped buffers on top)."""
    want = int(scratch * 1.5) + (2 << 20)
    return int(min(max(want, 16 << 20), capacity // 2))
