"""Typed configuration: block sizes, cases, TPU generations and the KV-cache layout.

Everything here is plain Python (no tracing), so it can be used by the tuner, the
validator and the tables without importing Pallas.
"""
from __future__ import annotations

import dataclasses
import enum
import math
from typing import NamedTuple

import ml_dtypes  # noqa: F401  (registers bfloat16 / float8 dtype names with NumPy, without JAX)
import numpy as np


class Case(str, enum.Enum):
    """The three specialised kernels. ``distribution = (i, j, k)`` splits sequences
    into ``[0, i)`` decode, ``[i, j)`` prefill chunks and ``[j, k)`` mixed."""

    DECODE = "decode"
    PREFILL = "prefill"
    MIXED = "mixed"
    # A server's stage, not a kernel of ours: SGLang-JAX's target-verify (a few draft tokens
    # per sequence), run by its mixed kernel under its own table stage. Not in CASES.
    VERIFY = "verify"

    @classmethod
    def parse(cls, value: "Case | str") -> "Case":
        if isinstance(value, Case):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            raise ValueError(
                f"unknown case {value!r}; valid cases are {[c.value for c in cls]}"
            ) from None


CASES: tuple[Case, ...] = (Case.DECODE, Case.PREFILL, Case.MIXED)


class BlockSizes(NamedTuple):
    """The four tuning knobs of one case.

    bq / bkv: query / KV tokens fetched into VMEM per pipeline step (DMA granularity).
    cq / ckv: query / KV tokens per compute step (VREG pressure).
    """

    bq: int
    bkv: int
    cq: int
    ckv: int

    @classmethod
    def coerce(cls, value, *, name: str = "block_sizes") -> "BlockSizes":
        if isinstance(value, BlockSizes):
            return value
        try:
            items = tuple(value)
        except TypeError:
            raise ValueError(
                f"{name}={value!r} is not a 4-tuple (bq, bkv, cq, ckv) of positive ints"
            ) from None
        if len(items) != 4 or not all(
            isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in items
        ):
            raise ValueError(
                f"{name}={value!r} is not a 4-tuple (bq, bkv, cq, ckv) of positive ints"
            )
        return cls(*(int(v) for v in items))

    @property
    def q_chunk_loop(self) -> bool:
        """Prefill / mixed run a block's q chunks (``bq / cq``) as a loop, not unrolled
        (more than ``MAX_UNROLLED_Q_CHUNKS``)."""
        return self.bq // self.cq > MAX_UNROLLED_Q_CHUNKS

    def label(self) -> str:
        return f"bq{self.bq}_bkv{self.bkv}_cq{self.cq}_ckv{self.ckv}"


DECODE_GROUPS = (1, 2, 4, 8)     # decode: sequences per KV step (bq = cq)


def block_size_errors(case: Case, bs: BlockSizes, page_size: int) -> list[str]:
    """Legality rules of a block-size tuple; an empty list means legal."""
    errs = []
    for name, v in zip(bs._fields, bs):
        if v <= 0:
            errs.append(f"{name}={v} must be a positive int")
    if errs:
        return errs
    if bs.bq % bs.cq:
        errs.append(f"bq={bs.bq} must be a multiple of cq={bs.cq} (rule bq % cq == 0)")
    if bs.bkv % bs.ckv:
        errs.append(f"bkv={bs.bkv} must be a multiple of ckv={bs.ckv} (rule bkv % ckv == 0)")
    if bs.bkv % page_size:
        errs.append(f"bkv={bs.bkv} must be a multiple of page_size={page_size}")
    if bs.ckv % page_size:
        errs.append(f"ckv={bs.ckv} must be a multiple of page_size={page_size}")
    if case == Case.DECODE and (bs.cq != bs.bq or bs.bq not in DECODE_GROUPS):
        errs.append(f"decode block sizes need bq == cq in {DECODE_GROUPS} (sequences per step, one token each), "
                    f"got bq={bs.bq}, cq={bs.cq}")
    return errs


# --------------------------------------------------------------------------- dtypes
def dtype_bits(dtype) -> int:
    return np.dtype(dtype).itemsize * 8


def kv_packing(kv_dtype) -> int:
    """Rows of a 32-bit word: 1 for f32, 2 for bf16, 4 for fp8."""
    bits = dtype_bits(kv_dtype)
    if 32 % bits:
        raise ValueError(f"kv dtype {np.dtype(kv_dtype).name} has {bits} bits; need 8, 16 or 32")
    return 32 // bits


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def get_kv_cache_shape(num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, kv_dtype):
    """Merged, packed KV-cache layout (K and V of head h at combined index 2h and 2h+1):
    ``[num_pages, page_size, ceil(2*num_kv_heads / kv_packing), kv_packing, round_up(head_dim, 128)]``."""
    for name, v in (("num_pages", num_pages), ("page_size", page_size),
                    ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        if not isinstance(v, (int, np.integer)) or v <= 0:
            raise ValueError(f"{name}={v!r} must be a positive int")
    pk = kv_packing(kv_dtype)
    return (int(num_pages), int(page_size), cdiv(2 * num_kv_heads, pk), pk, round_up(head_dim, 128))


def get_kv_cache_shape_hd64(num_pages: int, page_size: int, num_kv_heads: int, kv_dtype, head_dim: int = 64):
    """The head_dim-64 layout tpu-inference's ``ragged_paged_attention_hd64`` uses (head h at
    entry h, K in lanes 0-63 and V in lanes 64-127): ``[num_pages, page_size,
    ceil(num_kv_heads / kv_packing), kv_packing, 128]``. ``head_dim`` must be 64."""
    if head_dim != 64:
        raise ValueError(f"head_dim={head_dim!r} is not valid for the head_dim-64 cache layout; valid: 64")
    for name, v in (("num_pages", num_pages), ("page_size", page_size), ("num_kv_heads", num_kv_heads)):
        if not isinstance(v, (int, np.integer)) or v <= 0:
            raise ValueError(f"{name}={v!r} must be a positive int")
    pk = kv_packing(kv_dtype)
    return (int(num_pages), int(page_size), cdiv(num_kv_heads, pk), pk, 128)


def kv_bytes_per_token(num_kv_heads: int, head_dim: int, kv_dtype) -> int:
    """Bytes of one token's K and V, all KV heads, in the cache layout (``get_kv_cache_shape``:
    combined heads padded to the packing, head_dim to 128 lanes). The one definition used by
    the heuristic, the search spaces and the tuner."""
    _, _, rows, pk, dp = get_kv_cache_shape(1, 1, num_kv_heads, head_dim, kv_dtype)
    return rows * pk * dp * np.dtype(kv_dtype).itemsize


# ----------------------------------------------------------------------- generations
# Prefill / mixed compute steps unroll up to this many q chunks (bq / cq) per block and
# loop over more (kernel/rpa.py), in serving and in analysis alike.
MAX_UNROLLED_Q_CHUNKS = 8


@dataclasses.dataclass(frozen=True)
class TpuGeneration:
    name: str            # CLI / table name
    topology: str        # deviceless topology name accepted by libtpu
    device_kind: str     # jax device.device_kind
    chip_version: str    # name in jax's tpu_info.ChipVersion
    # Prefill / mixed skip the ckv chunks of a KV step that hold no visible key (past the
    # causal diagonal, past the valid tokens, before the window). Off on TPU7x only because
    # libtpu's static profiler aborts on the branch there, so no config could be ranked
    # without a device (kernel/rpa.py, compute_step).
    skip_dead_chunks: bool = True
    # f32 score-tile budget (vregs) of one online-softmax update (kernel/rpa.py, _row_tile).
    # The 256-wide MXUs (v6e, TPU7x) want tall tiles: every tile pushes the chunk's K as
    # MXU weights again. The 128-wide ones want short tiles (their spills cost more).
    score_tile_vregs: int = 256
    # Prefill / mixed: the softmax's exp of (score - max) in bf16, the dtype p takes for
    # its PV product anyway; row sums stay f32. The 256-wide generations, whose VPU and EUP
    # have bf16: TPU7x and v6e (estimates in notebook.md).
    bf16_exp: bool = False


GENERATIONS: dict[str, TpuGeneration] = {
    g.name: g
    for g in (
        TpuGeneration("v4", "v4:2x2x1", "TPU v4", "TPU_V4", score_tile_vregs=64),
        TpuGeneration("v5e", "v5e:1x1", "TPU v5 lite", "TPU_V5E", score_tile_vregs=64),
        TpuGeneration("v5p", "v5p:2x2x1", "TPU v5", "TPU_V5P", score_tile_vregs=64),
        TpuGeneration("v6e", "v6e:1x1", "TPU v6 lite", "TPU_V6E", bf16_exp=True),
        TpuGeneration("tpu7x", "tpu7x:2x2x1", "TPU7x", "TPU_7X", skip_dead_chunks=False, bf16_exp=True),
    )
}


def get_generation(name: str) -> TpuGeneration:
    key = str(name).lower().replace("tpu_", "").replace("tpu-", "")
    aliases = {"v7x": "tpu7x", "7x": "tpu7x", "v5litepod": "v5e", "v5lite": "v5e", "v6": "v6e"}
    key = aliases.get(key, key)
    if key in GENERATIONS:
        return GENERATIONS[key]
    for g in GENERATIONS.values():  # device kinds, e.g. "TPU v6 lite"
        if str(name).lower() == g.device_kind.lower():
            return g
    raise ValueError(f"unknown TPU generation {name!r}; valid: {sorted(GENERATIONS)}")


# ------------------------------------------------------------------------- table key
@dataclasses.dataclass(frozen=True, order=True)
class TuningKey:
    """What a tuned block-size entry is keyed by (one case, one shard's attention shape)."""

    generation: str          # GENERATIONS name: v4, v5e, v5p, v6e, tpu7x
    case: str                # decode / prefill / mixed
    q_dtype: str
    kv_dtype: str
    num_q_heads: int         # per shard
    num_kv_heads: int        # per shard
    head_dim: int
    page_size: int
    max_num_tokens: int      # token bucket
    max_model_len: int       # model-length bucket
    sliding_window: bool = False

    def __post_init__(self):
        object.__setattr__(self, "generation", get_generation(self.generation).name)
        object.__setattr__(self, "case", Case.parse(self.case).value)
        for f in ("num_q_heads", "num_kv_heads", "head_dim", "page_size", "max_num_tokens", "max_model_len"):
            v = getattr(self, f)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"TuningKey.{f}={v!r} must be a positive int")
            object.__setattr__(self, f, int(v))
        object.__setattr__(self, "sliding_window", bool(self.sliding_window))

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def id(self) -> str:
        return (f"{self.generation}/{self.case}/q{self.q_dtype}-kv{self.kv_dtype}/h{self.num_q_heads}x{self.num_kv_heads}"
                f"/d{self.head_dim}/p{self.page_size}/t{self.max_num_tokens}/l{self.max_model_len}"
                f"/sw{int(self.sliding_window)}")
