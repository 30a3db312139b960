"""Default block sizes when neither the caller nor a table gives them.

The rule, per case (all KV sizes rounded to multiples of ``page_size``):

* decode: ``bq = cq = 1`` (one sequence per step; groups of sequences are the tuner's to
  find). ``bkv`` = tokens whose merged K+V bytes (all KV heads) make
  ``DECODE_BLOCK_BYTES[gen]`` (1 MiB on v4's 16 MiB VMEM, 2 MiB on v5e/v5p, 4 MiB on
  v6e/TPU7x), capped at ``max_model_len`` and at 4096 tokens. Fetch and compute are
  split: ``ckv = min(bkv, 512)`` tokens, so the DMA granularity can grow without
  growing the per-step VREG working set.
* prefill: ``bq = min(256, next_pow2(chunk))`` (``chunk`` = ``chunk_prefill_size`` or
  ``max_num_tokens``), ``cq`` so that ``cq * group`` rows make one 128/256-row MXU
  operand (128 rows where the MXU is 128 wide, v4/v5e/v5p; 256 on v6e/TPU7x),
  ``bkv = 512``, ``ckv = 256`` tokens (v4: ``bkv = 256``).
* mixed: as prefill with ``bq = min(128, ...)``.
* many query heads per KV head (MQA: one KV head serving 48, say): a q block holds
  ``bq x group`` rows, so the token caps above make q blocks of thousands of rows and a
  ``cq`` of two or four tokens (StarCoder's 48 heads on v5e: ``bq / cq = 64`` chunks per q
  block). Where ``bq x group`` exceeds ``Q_BLOCK_ROWS`` (2048 rows for prefill, 1024 for
  mixed, where the MXU is 128 wide; twice that on v6e/TPU7x), ``bq`` is cut to the power of
  two within it, ``cq`` rounded *up* to the power of two whose rows cover one MXU operand,
  and ``ckv = min(bkv, 512)``. Measured with the compile backend on the shipped results
  (StarCoder on v5e, v5p, v6e, page 128, every bucket): within 1 % (prefill) and 4 %
  (mixed) of the tuned best in geometric mean, where the rule without it was 4.4x and
  9.2x slower (benchmarks/README.md, "The MQA baseline"). Shapes whose q blocks fit are
  unchanged.

Then, on every case, the tuple must fit: while the kernel's scratch model
(``kernel.vmem.scratch_bytes``) (x1.25, +1 MiB for compiler temporaries) exceeds half of the chip's
VMEM, ``bq`` is halved (prefill/mixed), then ``bkv`` (and ``ckv`` with it).
"""
from __future__ import annotations

from .config import BlockSizes, Case, TuningKey, cdiv, kv_bytes_per_token, kv_packing, round_up
from .hardware import tpu_info
from .vmem import scratch_bytes

DECODE_BLOCK_BYTES = {"v4": 1 << 20, "v5e": 2 << 20, "v5p": 2 << 20, "v6e": 4 << 20, "tpu7x": 4 << 20}
# rows (bq x group) of a q block beyond which many query heads per KV head cut bq (module doc),
# where the MXU is 128 wide; twice these where it is 256 wide
Q_BLOCK_ROWS = {Case.PREFILL: 2048, Case.MIXED: 1024}


def _pow2_floor(x: int) -> int:
    return 1 << max(0, int(x).bit_length() - 1)


def _pow2_ceil(x: int) -> int:
    return 1 << max(0, int(x - 1).bit_length())


def _page_round(x: int, page_size: int) -> int:
    return max(page_size, round_up(int(x), page_size))


def heuristic_for_key(key: TuningKey, *, chunk_prefill_size: int | None = None) -> BlockSizes:
    """The heuristic's block sizes for a table key: what a kernel call of that shape resolves
    to when no table entry applies (without ``chunk_prefill_size`` unless given). The one
    baseline a sweep evaluates and an export compares against."""
    return heuristic_block_sizes(
        Case.parse(key.case), generation=key.generation, num_q_heads=key.num_q_heads,
        num_kv_heads=key.num_kv_heads, head_dim=key.head_dim, page_size=key.page_size,
        kv_bytes_per_token=kv_bytes_per_token(key.num_kv_heads, key.head_dim, key.kv_dtype),
        max_num_tokens=key.max_num_tokens, max_model_len=key.max_model_len,
        chunk_prefill_size=chunk_prefill_size, q_dtype=key.q_dtype, kv_dtype=key.kv_dtype)


def heuristic_block_sizes(case: Case, *, generation: str, num_q_heads: int, num_kv_heads: int,
                          head_dim: int, page_size: int, kv_bytes_per_token: int,
                          max_num_tokens: int, max_model_len: int,
                          chunk_prefill_size: int | None = None, q_dtype="bfloat16",
                          kv_dtype="bfloat16") -> BlockSizes:
    bs = _initial(Case.parse(case), generation=generation, num_q_heads=num_q_heads,
                  num_kv_heads=num_kv_heads, page_size=page_size,
                  kv_bytes_per_token=kv_bytes_per_token, max_num_tokens=max_num_tokens,
                  max_model_len=max_model_len, chunk_prefill_size=chunk_prefill_size)
    pk = kv_packing(kv_dtype)
    budget = tpu_info(generation).vmem_capacity_bytes // 2

    def fits(b):
        sb = scratch_bytes(b, num_kv_heads=num_kv_heads, group=num_q_heads // num_kv_heads,
                           head_dim=head_dim, page_size=page_size,
                           kv_rows=cdiv(2 * num_kv_heads, pk), kv_pack=pk, q_dtype=q_dtype,
                           kv_dtype=kv_dtype, decode=Case.parse(case) == Case.DECODE)
        return sb * 1.25 + (1 << 20) <= budget

    while not fits(bs):
        bq, bkv, cq, ckv = bs
        if bq > 8 and Case.parse(case) != Case.DECODE:
            bq //= 2
            cq = min(cq, bq)
        elif bkv > page_size:
            bkv = max(page_size, round_up(bkv // 2, page_size))
            ckv = min(ckv, bkv)
            while bkv % ckv:
                ckv -= page_size
        else:
            break
        bs = BlockSizes(bq, bkv, cq, ckv)
    return bs


def _initial(case: Case, *, generation, num_q_heads, num_kv_heads, page_size, kv_bytes_per_token,
             max_num_tokens, max_model_len, chunk_prefill_size) -> BlockSizes:
    group = num_q_heads // num_kv_heads
    max_kv = _page_round(max_model_len, page_size)
    if case == Case.DECODE:
        target = DECODE_BLOCK_BYTES.get(generation, 2 << 20)
        bkv = _pow2_floor(max(1, target // max(1, kv_bytes_per_token)))
        bkv = min(_page_round(bkv, page_size), max_kv, _page_round(4096, page_size))
        ckv = min(bkv, _page_round(512, page_size))
        while bkv % ckv:
            ckv -= page_size
        return BlockSizes(1, bkv, 1, ckv)
    mxu_rows = 256 if tpu_info(generation).mxu_column_size >= 256 else 128
    chunk = chunk_prefill_size or max_num_tokens
    cap = 256 if case == Case.PREFILL else 128
    bq = max(1, min(cap, _pow2_ceil(max(1, min(chunk, max_num_tokens)))))
    cq = max(1, min(bq, _pow2_floor(max(1, mxu_rows // group))))
    bkv = _page_round(256 if generation == "v4" else 512, page_size)
    bkv = min(bkv, max_kv)
    ckv = min(bkv, _page_round(256, page_size))
    rows = Q_BLOCK_ROWS[case] * mxu_rows // 128
    if bq * group > rows:            # many query heads per KV head (module doc)
        cq = _pow2_ceil(-(-mxu_rows // group))
        bq = max(cq, min(bq, _pow2_floor(max(1, rows // group))))
        cq = min(cq, bq)
        ckv = min(bkv, _page_round(512, page_size))
    while bkv % ckv:
        ckv -= page_size
    return BlockSizes(bq, bkv, cq, ckv)
