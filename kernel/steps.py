"""The kernel's walk over a workload, in plain Python: q blocks, KV steps, pages, chunks.

``plan(case, bs, page_size, q_len, kv_len)`` lists, for one sequence, what ``kernel.rpa``
does: its q blocks, and per q block the KV steps (cached context gathered page by page from
the cache, then the new tokens read from the packed new-KV array, unless they fit in the last
cached step's block: see ``kernel.rpa._Steps``), the pages each step
fetches, and the ``ckv`` chunks each step computes: the chunks holding a visible key
(decode always; prefill / mixed where the generation skips dead chunks,
``TpuGeneration.skip_dead_chunks``), else every chunk of the step, masked. It mirrors
``qblock_steps`` / ``fetch_kv`` / ``compute_step`` in ``kernel/rpa.py`` line for line;
``tests/test_estimator.py`` (``test_step_plan_matches_the_page_dmas_in_the_trace``) checks it
against the DMAs in libtpu's simulated trace.
The estimator counts its features to compose a workload's cost from probe compiles.
"""
from __future__ import annotations

import collections
import dataclasses

from .config import BlockSizes, Case, cdiv


@dataclasses.dataclass(frozen=True)
class Step:
    cached: bool     # KV from the cache (pages) or from the new tokens' array
    pages: int       # page-sized DMAs issued
    chunks: int      # ckv chunks computed


def plan(case: Case | str, bs: BlockSizes, page_size: int, q_len: int, kv_len: int,
         sliding_window: int | None = None, skip_dead_chunks: bool = True) -> list[list[Step]]:
    """The KV steps of each q block of one sequence."""
    case = Case.parse(case)
    bq, bkv, _, ckv = bs
    decode = case == Case.DECODE
    ctx = kv_len - q_len
    nq = 1 if decode else max(1, cdiv(q_len, bq))
    n_chunks = bkv // ckv
    out = []
    for i in range(nq):
        q_first = ctx + i * bq
        q_hi = ctx + min((i + 1) * bq, q_len)
        lo = max(0, q_first - sliding_window + 1) if sliding_window else 0
        c0 = lo // bkv
        nc = max(0, cdiv(ctx, bkv) - c0)
        cached_limit = ctx
        if decode:
            n0, nn = 0, 0
            _, c0, nc, cached_limit = _decode_walk(ctx, bkv, sliding_window)
        else:
            n0 = max(0, lo - ctx) // bkv
            nn = max(1, cdiv(q_hi - ctx, bkv) - n0)
            if nq == 1 and nc >= 2 and (q_hi - 1) // bkv == (ctx - 1) // bkv:
                nn, cached_limit = 0, kv_len       # new tokens merged into the last cached step
        steps = []
        for k in range(nc + nn):
            cached = k < nc
            blk = c0 + k if cached else n0 + k - nc
            limit = ctx if decode else cached_limit if cached else q_hi - ctx
            valid = max(0, min(bkv, limit - blk * bkv))
            base = blk * bkv if (cached or decode) else ctx + blk * bkv    # position of row 0
            if decode:
                x_hi = min(n_chunks, cdiv(max(0, min(cached_limit, q_hi) - base), ckv))
                x_lo = min(x_hi, max(0, lo - base) // ckv) if sliding_window else 0
                chunks = x_hi - x_lo
            elif skip_dead_chunks:
                hi = min(cached_limit, q_hi) if cached else q_hi       # first position no query sees
                chunks = sum(1 for x in range(n_chunks)
                             if base + x * ckv < hi and (not sliding_window or base + (x + 1) * ckv > lo))
            else:
                chunks = n_chunks
            steps.append(Step(cached, cdiv(valid, page_size), chunks))
        out.append(steps)
    return out


def _decode_walk(ctx: int, bkv: int, sliding_window: int | None) -> tuple[int, int, int, int]:
    """A decode sequence's (window start, first block, steps, key limit): the limit is
    ctx + 1 when the last step's block holds the new token (merged, kernel.rpa._Steps)."""
    lo = max(0, ctx - sliding_window + 1) if sliding_window else 0
    c0 = lo // bkv
    nc = max(1, cdiv(ctx, bkv) - c0)
    return lo, c0, nc, ctx + int(ctx < (c0 + nc) * bkv)


@dataclasses.dataclass(frozen=True)
class DecodeStep:
    pages: int       # page-sized DMAs issued (every sequence of the group)
    chunks: int      # ckv chunks computed, summed over the group's sequences
    first: bool      # the group's first step
    partial: bool    # its last chunks run masked (some sequence's keys end inside one)


def decode_steps(bs: BlockSizes, page_size: int, kv_lens, sliding_window: int | None = None) -> list[DecodeStep]:
    """Decode's KV steps in kernel order, for sequences in groups of ``bq`` (``kernel.rpa``
    ``fetch_kv_group`` / ``compute_group``): a group takes as many steps as its longest
    sequence; each step fetches every sequence's pages of that step and computes the
    chunk range that holds a visible key of some sequence, for every sequence."""
    nseq, bkv, ckv = bs.bq, bs.bkv, bs.ckv
    n_chunks = bkv // ckv
    out = []
    kv_lens = list(kv_lens)
    for g0 in range(0, len(kv_lens), nseq):
        seqs = []
        for kv in kv_lens[g0:g0 + nseq]:
            seqs.append((kv - 1, *_decode_walk(kv - 1, bkv, sliding_window)))
        for k in range(max(s[3] for s in seqs)):
            pages, lo_x, hi_x, full_x = 0, n_chunks, 0, n_chunks
            for ctx, lo, c0, nc, limit in seqs:
                base = (c0 + k) * bkv
                pages += cdiv(max(0, min(bkv, ctx - base)), page_size)
                lim = limit if k < nc else 0
                x_hi = min(n_chunks, cdiv(max(0, min(lim, ctx + 1) - base), ckv))
                x_lo = min(x_hi, max(0, lo - base) // ckv) if sliding_window else 0
                full_x = min(full_x, min(x_hi, max(x_lo, max(0, lim - base) // ckv)))
                if x_lo < x_hi or len(seqs) == 1:
                    lo_x = min(lo_x, x_lo)
                hi_x = max(hi_x, x_hi)
            lo_x = min(lo_x, hi_x) if sliding_window else 0
            if len(seqs) < nseq:        # a short last group: its empty places run masked
                full_x = 0
            full_x = min(hi_x, max(lo_x, full_x))
            out.append(DecodeStep(pages, nseq * (hi_x - lo_x), k == 0, full_x < hi_x))
    return out


FEATURES = ("call", "seq", "qblock", "step", "page_cached", "page_new", "chunk")


def features(case: Case | str, bs: BlockSizes, page_size: int, q_lens, kv_lens,
             sliding_window: int | None = None, skip_dead_chunks: bool = True) -> dict[str, int]:
    """Counts of what the kernel does for these sequences (one call of ``case``)."""
    c = collections.Counter(call=1)
    for q, kv in zip(q_lens, kv_lens):
        c["seq"] += 1
        for steps in plan(case, bs, page_size, q, kv, sliding_window, skip_dead_chunks):
            c["qblock"] += 1
            for st in steps:
                c["step"] += 1
                c["page_cached" if st.cached else "page_new"] += st.pages
                c["chunk"] += st.chunks
    return {f: c[f] for f in FEATURES}
