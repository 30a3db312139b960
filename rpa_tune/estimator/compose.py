"""A config's cost for any workload, from a few small probe compiles.

libtpu's static profiler simulates what it compiles, so its time and memory grow with the
workload. So per config we compile a handful of small *probe* workloads, each a real
program of the kernel (the same code path as serving: one pipeline across all sequences),
fit a cost model to their cycles and price any workload from the kernel's own walk over it
(``kernel.steps``):

* prefill / mixed: a sum of per-item costs (per call, sequence, q block, KV step, cached
  page; ``case_features``), fitted by least squares; the probes' differences isolate each
  item, so pipeline fill cancels. Our mixed probes start with two warm-up sequences
  (``mixed_warm_up``): a mixed batch holds many sequences, and a batch's first two cost
  less than the rest. Our prefill probes end with a long KV walk (``long_walk_probe``),
  which prices what a KV step waiting on its page DMAs costs beyond its items, per
  pipelined page;
* decode: a two-stage pipeline (``pipeline_cycles``: each KV step's page DMAs overlap the
  previous step's compute), seven costs fitted to eight probes of 4-8 sequences. Where HBM
  is the bound (v5e, TPU7x) a step costs its DMA or its compute, whichever is larger, which
  no sum of item costs can express.

The same probes price every workload and every token bucket of a config: they are
compiled at one token bucket per config (``probe_tokens``), whatever the key's. A bucket
only sizes the q / output arrays, which stay in HBM (``pl.ANY``) and of which a probe
touches only its own rows, so the probes' cycles do not depend on it (checked:
``tests/test_estimator.py``). ``benchmarks/README.md`` ("Composition") has the check against
full compiles.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import re
import threading

import numpy as np

from kernel.config import BlockSizes, Case, cdiv, round_up
from kernel.steps import decode_steps, features
from kernel.workload import Workload


@dataclasses.dataclass(frozen=True)
class Probe:
    q_lens: tuple
    kv_lens: tuple

    def workload(self, case: Case) -> Workload:
        return Workload.of_case(case, list(self.q_lens), list(self.kv_lens))


def probes(case: Case | str, bs: BlockSizes, page_size: int, skip_dead_chunks: bool = True,
           warm_up: bool = True, long_walk: bool = True) -> list[Probe]:
    """The probe workloads of one config. Decode: eight batches of 4-8 sequences, or of
    4-8 groups of ``bq`` sequences (one page, a part step, three pages, one full step, two
    full steps), enough steps for the pipeline
    to reach its steady state, where a step costs the larger of its compute and its page
    DMAs (``pipeline_cycles``); their KV lengths end on step boundaries, the new token
    included (both kernels attend to it in their last step, ``pipeline_steps``). Prefill /
    mixed: at most three sequences, two q blocks. Mixed with ``warm_up`` (our kernel):
    each probe after the two ``mixed_warm_up`` sequences, no two like sequences in a row.
    Prefill with ``long_walk`` (our kernel): last, ``long_walk_probe``."""
    case = Case.parse(case)
    bq, bkv, _, ckv = bs
    P = page_size
    if case == Case.DECODE:
        part = ckv + P if ckv + P < bkv else max(P, (bkv // 2) // P * P + P)
        mid = min(bkv, 3 * P)
        shapes = [(4, P), (8, P), (4, min(part, bkv)), (4, mid), (4, bkv), (8, bkv), (4, 2 * bkv), (5, 2 * bkv)]
        if partial_chunk_probe(bs, P):
            # every length above is a whole number of chunks when ckv == P: without this probe
            # no step ends in a partial chunk and its cost (``pipeline_cycles``: "partial"),
            # which nearly every served sequence pays, is left to the fit's whim
            shapes.append((4, ckv + max(1, P // 2)))
        seen, out = set(), []
        for n, ctx in shapes:
            n *= bq         # groups of bq sequences (kernel.steps.decode_steps)
            if (n, ctx) not in seen:
                seen.add((n, ctx))
                out.append(Probe((1,) * n, (ctx,) * n))
        return out
    one = [(bq, bq)]
    # Where dead chunks are skipped, chunks and cached pages vary apart only if a probe's
    # cached context is not a whole number of chunks' pages: with (bq, bq + 2 bkv) instead,
    # chunk and page costs are confounded (only chunk + 3 page is determined), which
    # misprices a causal prefill, whose diagonal steps have chunks but no pages.
    third = [(bq, bq + ckv + P)] if skip_dead_chunks else [(bq, bq + 2 * bkv)]
    shapes = (one, [(bq, bq + bkv)], third, [(2 * bq, 2 * bq)], one * 2, [(bq, bq + P)], [(bq, bq + bkv + P)])
    if case == Case.MIXED and warm_up:
        # like sequences in a row are one loop in the analysis program (kernel.analysis),
        # which serving does not have: the second of two costs far less there than after
        # another sequence
        shapes = [unlike_in_a_row(mixed_warm_up(P) + s) for s in shapes]
        shapes = [s for i, s in enumerate(shapes) if s not in shapes[:i]]   # ckv == bkv: 3rd is 7th
    out = [Probe(*zip(*s)) for s in shapes]
    if case == Case.PREFILL and long_walk:
        out.append(long_walk_probe(bs))
    return out


def long_walk_probe(bs: BlockSizes) -> Probe:
    """One q block after four KV steps of cached context (two or three for a ``bkv`` over
    1024): a walk long enough that each KV step waits on its page DMAs where they take
    longer than its compute, as in serving. The other probes walk one to three steps, where
    that wait never shows, so without it small-q prefill is priced low against whole
    compiles (benchmarks/README.md, "Small q blocks"); ``fit`` prices the wait per pipelined page."""
    n = max(2, min(4, 4096 // bs.bkv))
    return Probe((bs.bq,), (bs.bq + n * bs.bkv,))


def pipelined_pages(case: Case | str, bs: BlockSizes, page_size: int, workload: Workload,
                    sliding_window=None) -> int:
    """Cached pages fetched while an earlier KV step computes: every cached page of the
    call's walk (``audit.cached_step_pages``) but its first cached step's."""
    from .audit import cached_step_pages
    return sum(cached_step_pages(workload, case, bs, page_size, sliding_window)[1:])


def unlike_in_a_row(seqs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``seqs`` with each sequence like the one before it given one more KV token."""
    out = []
    for q, kv in seqs:
        while out and out[-1] == (q, kv):
            kv += 1
        out.append((q, kv))
    return out


def mixed_warm_up(page_size: int) -> list[tuple[int, int]]:
    """The two short decode-like sequences (q_len, kv_len) every mixed probe of our kernel
    starts with, so that each probed sequence is priced as a batch's third or later.

    A mixed batch holds 7-34 sequences (``rpa_tune.workloads.mixed_workload``), and in one
    the first sequence waits for its first KV fetch, which later ones get during earlier
    compute, and the second costs a constant less than the rest. Probes of one or two
    sequences would price every sequence like a batch's first two: low for batches of many
    short sequences, and by a different amount per config, which would skew the ranking of
    configs. With the warm-up, ``call``
    absorbs the first two sequences' discount, and the probes' differences price the rest.
    benchmarks/README.md ("Composition for many sequences") has the check against whole
    compiles."""
    P = page_size
    return [(1, 2 * P + 1), (2, P + 2)]


def partial_chunk_probe(bs: BlockSizes, page_size: int) -> bool:
    """Whether a decode config needs the probe whose last chunk is partial (``probes``)."""
    return bs.ckv == page_size


def smallest_probe(case: Case | str, bs: BlockSizes, page_size: int, skip_dead_chunks: bool = True) -> Probe:
    """The config's probe with the fewest tokens (KV, then queries): the cheapest whole
    program of the config, which a plain compile needs for the VMEM verdict only (the
    kernel's VMEM depends on the block sizes and the model, not on the workload)."""
    return min(probes(case, bs, page_size, skip_dead_chunks), key=lambda p: (sum(p.kv_lens), sum(p.q_lens)))


# Prefill compositions without ``long_walk_probe`` (compile evaluator versions before 7)
# price a small bq low against whole compiles of the same workloads (benchmarks/README.md,
# "Small q blocks"): a small q block's KV steps wait on their page DMAs in a long walk, which
# those probes' one to three steps never show, so they price such a step at its compute.
# The most a config was found low, by bq (whole compiles and configs re-priced with the
# long-walk probe; figures in notebook.md):
PREFILL_UNDERPRICED = ((32, 0.48), (64, 0.18))     # bq at most, fraction low (bq >= 128: none)


PREFILL_LONG_WALK_VERSION = 7     # the first compile evaluator prefill version with ``long_walk_probe``


def composition_error(case: Case | str, bs: BlockSizes, evaluator_version: str | None = None) -> float:
    """The most a config's composed estimate (recorded by ``evaluator_version``, e.g.
    "compile-5") has been measured below whole compiles, as a fraction
    (``PREFILL_UNDERPRICED``; 0 where none was, and for prefill priced with the long-walk
    probe). Its true estimate is then up to ``1 / (1 - error)`` times the composed one:
    ``rpa-tune export`` promotes such a config only if it beats the heuristic (bq 128 or
    more, composed about right: benchmarks/README.md, "Small q blocks") even so."""
    if Case.parse(case) != Case.PREFILL:
        return 0.0
    m = re.match(r"compile-(\d+)(\+|$)", str(evaluator_version or ""))   # "compile-7", "compile-7+v5p1"
    if m and int(m.group(1)) >= PREFILL_LONG_WALK_VERSION:
        return 0.0
    return next((e for bq, e in PREFILL_UNDERPRICED if bs.bq <= bq), 0.0)


PROBE_MIN_TOKENS = 2048   # the token bucket probes are compiled at, unless one needs more


def probe_tokens(plist: list[Probe]) -> int:
    """The token bucket a config's probes are compiled at: ``PROBE_MIN_TOKENS``, or the
    next power of two holding the largest probe's tokens. It depends on the config only,
    so every key bucket shares the probes (module doc)."""
    need = max(sum(p.q_lens) for p in plist)
    return max(PROBE_MIN_TOKENS, 1 << (need - 1).bit_length())


# ------------------------------------------------------------------ decode: a two-stage pipeline
PIPELINE_PARAMS = ("call", "seq", "step", "chunk", "partial", "dma_step", "dma_page")


def pipeline_steps(bs: BlockSizes, page_size: int, kv_lens, sliding_window=None,
                   walk_new: bool = False) -> list[tuple[int, int, bool, bool]]:
    """Decode's KV steps in kernel order: (pages fetched, chunks computed, first of its
    sequence or group, ends in a partial chunk). The kernel runs the chunks wholly below the
    context end unmasked and a partial last chunk masked, in a loop of its own.

    Ours: ``kernel.steps.decode_steps`` (the ``kv_len - 1`` cached tokens' pages; the new
    token computed with the last step's keys unless it starts a block of its own, then on
    the VPU, apart; sequences in groups of ``bq``). ``walk_new``: tpu-inference's RPA v3,
    one sequence at a time, whose KV steps read all ``kv_len`` tokens (a block filled from
    the cache, then from the new-KV array; lowered with write-back off, all from the
    cache), so a new token that starts a block is a step of its own."""
    if not walk_new:
        return [(st.pages, st.chunks, st.first, st.partial)
                for st in decode_steps(bs, page_size, kv_lens, sliding_window)]
    out = []
    bkv, ckv = bs.bkv, bs.ckv
    for kv in kv_lens:
        lo = max(0, kv - sliding_window + 1) if sliding_window else 0
        c0 = lo // bkv
        for i in range(max(1, cdiv(kv, bkv) - c0)):
            base = (c0 + i) * bkv
            valid = max(0, min(bkv, kv - base))
            x_hi = min(bkv // ckv, cdiv(valid, ckv))
            x_lo = min(x_hi, max(0, lo - base) // ckv) if sliding_window else 0
            out.append((cdiv(valid, page_size), x_hi - x_lo, i == 0, valid % ckv != 0))
    return out


def pipeline_cycles(theta, steps, page_floor: float = 0.0) -> float:
    """Cycles of decode's double-buffered walk: the pages of step k+1 are fetched while step k
    computes (the DMA of a step is issued when the previous step starts computing, and DMAs
    run one after another); a step computes once its pages have landed and the previous step
    is done. Compute of a step: ``step + chunk * chunks`` (+ ``partial`` when its last chunk
    is partial, + ``seq`` at a sequence's first step); its DMA: ``dma_step + dma_page *
    pages``, and never less than ``page_floor * pages`` (a page's bytes at the HBM peak:
    ``dma_page_floor``); ``call`` before the first step.

    A sum of per-item costs cannot price decode where HBM is the bound (v5e, TPU7x): a
    step costs its compute when its pages are few and its DMA when they are many, so a
    linear fit prices batches of short sequences low there (benchmarks/README.md,
    "Composition")."""
    call, seq, c0, c1, c2, d0, d1 = theta
    dma_done = issue = 0.0
    comp_end = call
    for pages, chunks, first, partial in steps:
        dma_done = max(issue, dma_done) + max(d0 + d1 * pages, page_floor * pages)
        start = max(comp_end + (seq if first else 0.0), dma_done)
        issue = start
        comp_end = start + c0 + c1 * chunks + (c2 if partial else 0.0)
    return comp_end


def dma_page_floor(tpu: str, model: dict, page_size: int) -> float:
    """The fewest cycles one page of merged K/V can take to fetch: its bytes at the HBM
    peak (``kernel.hardware``) and the calibrated clock. The profiler lets a step's page
    DMAs run concurrently above that peak (``calibration.json``:
    ``hbm_bw_double_buffered_bytes_per_second``; benchmarks/README.md, "Calibration"), so a
    decode pipeline fitted to its probes can fetch a page faster than HBM allows and price
    HBM-bound decode too fast: the audit would then refuse the configs the profiler
    flatters most. Pricing (not the fit) keeps each step's page
    DMAs at or above this floor."""
    from kernel.hardware import tpu_info
    from kernel.workload import ModelShape
    from . import audit as audit_mod
    from .calibration import calibration
    cal = calibration(tpu)
    return audit_mod.token_bytes(ModelShape(**model)) * page_size * cal.clock_hz / tpu_info(tpu).mem_bw_bytes_per_second


def _fit_pipeline(step_lists, cycles) -> tuple[np.ndarray, np.ndarray]:
    from scipy.optimize import least_squares
    y = np.asarray(cycles, dtype=np.float64)

    def resid(th):
        return np.array([pipeline_cycles(th, st) for st in step_lists]) / y - 1.0

    scale = float(np.median(y)) / 10
    best = None
    for x0 in ([1.0, 0.4, 0.4, 0.2, 0.1, 0.2, 0.16], [2.0, 0.1, 0.6, 0.1, 0.0, 0.1, 0.18],
               [0.4, 0.6, 0.2, 0.4, 0.2, 0.4, 0.1]):
        r = least_squares(resid, x0=np.asarray(x0) * scale, bounds=(0, np.inf), x_scale=scale)
        if best is None or r.cost < best.cost:
            best = r
    return best.x, np.abs(best.fun)


def case_features(case: Case | str) -> tuple[str, ...]:
    """The items priced for a case. Decode: the costs of its pipeline model
    (``PIPELINE_PARAMS``). Prefill / mixed: call, sequence, q block, KV step, cached page and
    computed chunk (the chunks holding a visible key where the generation skips dead chunks;
    on TPU7x every chunk, so chunks are steps x ``bkv / ckv`` and share the step's cost). A
    step of new tokens costs what a cached step costs (the same compute; its KV comes from
    the new-KV array instead of pages). New steps and their pages cannot be priced apart:
    in every small probe each q block has exactly one new step, so those items are
    collinear with q blocks (benchmarks/README.md, "Composition")."""
    if Case.parse(case) == Case.DECODE:
        return PIPELINE_PARAMS
    return ("call", "seq", "qblock", "step", "page_cached", "chunk")


def design(case: Case | str, bs: BlockSizes, page_size: int, workloads, sliding_window=None,
           skip_dead_chunks: bool = True) -> np.ndarray:
    case = Case.parse(case)
    names = case_features(case)
    rows = []
    for w in workloads:
        lo, hi = w.case_range(case)
        f = features(case, bs, page_size, w.q_lens[lo:hi], w.kv_lens[lo:hi], sliding_window, skip_dead_chunks)
        rows.append([f[k] for k in names])
    return np.asarray(rows, dtype=np.float64)


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Prefill / mixed (``kind`` "linear"): cycles = sum of per-item costs x item counts
    (``case_features``). Decode (``kind`` "pipeline"): ``coef`` are ``PIPELINE_PARAMS`` and the
    cycles come from ``pipeline_cycles`` over the workload's steps."""

    case: str
    block_sizes: tuple
    page_size: int
    coef: tuple                 # cycles per item / pipeline cost, ``case_features(case)`` order
    probe_cycles: tuple
    probe_fit_error: float      # largest relative residual of a probe
    sliding_window: int | None = None
    kind: str = "linear"
    skip_dead_chunks: bool = True   # the generation's kernel skips dead prefill / mixed chunks
    walk_new: bool = False          # decode: the KV walk covers the new token (pipeline_steps)
    page_floor: float = 0.0         # decode: cycles a page's DMA takes at least (dma_page_floor)
    page_pipelined: float = 0.0     # prefill: cycles a pipelined cached page waits (pipelined_pages)

    def cycles(self, workload: Workload) -> float:
        if self.kind == "pipeline":
            lo, hi = workload.case_range(Case.DECODE)
            steps = pipeline_steps(BlockSizes(*self.block_sizes), self.page_size, workload.kv_lens[lo:hi],
                                   self.sliding_window, self.walk_new)
            return pipeline_cycles(self.coef, steps, self.page_floor)
        bs = BlockSizes(*self.block_sizes)
        x = design(self.case, bs, self.page_size, [workload], self.sliding_window, self.skip_dead_chunks)[0]
        wait = (self.page_pipelined * pipelined_pages(self.case, bs, self.page_size, workload, self.sliding_window)
                if self.page_pipelined else 0.0)
        return float(x @ np.asarray(self.coef)) + wait

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def fit(case: Case | str, bs: BlockSizes, page_size: int, probe_list: list[Probe], cycles: list[float],
        sliding_window=None, skip_dead_chunks: bool = True, walk_new: bool = False,
        page_floor: float = 0.0) -> CostModel:
    """Decode: the pipeline's seven costs by least squares on relative error (non-negative),
    fitted to the probes' cycles as the profiler gave them; ``page_floor`` applies when the
    model prices a workload (``pipeline_cycles``).
    Prefill / mixed: least-squares per-item costs from the probes' cycles. Items that never vary across
    the probes (always collinear with another, e.g. decode's q blocks with its sequences)
    get the minimum-norm share, which prices workloads of the same structure exactly."""
    case = Case.parse(case)
    if case == Case.DECODE:
        coef, resid = _fit_pipeline([pipeline_steps(bs, page_size, p.kv_lens, sliding_window, walk_new)
                                     for p in probe_list], cycles)
        return CostModel(case.value, tuple(bs), page_size, tuple(float(c) for c in coef),
                         tuple(float(c) for c in cycles), float(resid.max()), sliding_window, "pipeline",
                         walk_new=walk_new, page_floor=float(page_floor))
    if case == Case.PREFILL and len(probe_list) > 1 and probe_list[-1] == long_walk_probe(bs):
        # the short probes' items first; then what the long walk costs beyond them, per
        # pipelined page (never less than nothing: a compute-bound walk waits on no DMA)
        base = fit(case, bs, page_size, probe_list[:-1], cycles[:-1], sliding_window, skip_dead_chunks)
        lw, y = probe_list[-1].workload(case), float(cycles[-1])
        n, items = pipelined_pages(case, bs, page_size, lw, sliding_window), base.cycles(lw)
        wait = max(0.0, (y - items) / n) if n else 0.0
        err = abs(items + wait * n - y) / y
        return dataclasses.replace(base, probe_cycles=tuple(float(c) for c in cycles),
                                   probe_fit_error=max(base.probe_fit_error, err), page_pipelined=wait)
    X = design(case, bs, page_size, [p.workload(case) for p in probe_list], sliding_window, skip_dead_chunks)
    y = np.asarray(cycles, dtype=np.float64)
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    resid = np.abs(X @ coef - y) / y
    return CostModel(case.value, tuple(bs), page_size, tuple(float(c) for c in coef),
                     tuple(float(c) for c in y), float(resid.max()), sliding_window,
                     skip_dead_chunks=skip_dead_chunks)


def inconsistent_probes(case: Case | str, bs: BlockSizes, page_size: int, probe_list: list[Probe], cycles,
                        sliding_window=None, skip_dead_chunks: bool = True) -> list[str]:
    """Why a prefill / mixed config's probe cycles cannot be composed: a probe that holds
    another's queries and more cached KV steps (and no less of any priced item) but costs no
    more cycles. Its extra steps' work is in the trace (the audit counts it) and yet not in
    the cycles: a latency the profiler charges whatever the work hides it, and a fit to such
    probes prices cached KV at nothing (or less). Seen on TPU7x (benchmarks/README.md,
    "Probes whose cycles ignore their cached KV").
    Decode is not checked: its pipeline model prices hidden page DMAs by design."""
    case = Case.parse(case)
    if case == Case.DECODE:
        return []
    names = case_features(case)
    X = design(case, bs, page_size, [p.workload(case) for p in probe_list], sliding_window, skip_dead_chunks)
    step = names.index("step")
    out = []
    for i, pi in enumerate(probe_list):
        for j, pj in enumerate(probe_list):
            if (pi.q_lens == pj.q_lens and X[i][step] > X[j][step] and (X[i] >= X[j]).all()
                    and cycles[i] <= cycles[j]):
                out.append(f"probe {list(pi.q_lens)}/{list(pi.kv_lens)} costs {cycles[i]:,.0f} cycles, no more "
                           f"than {list(pj.q_lens)}/{list(pj.kv_lens)} ({cycles[j]:,.0f}) with {X[i][step]:.0f} "
                           f"KV steps to its {X[j][step]:.0f}: the profiler's cycles miss work its trace holds, "
                           "so they cannot be composed")
    return out


# ------------------------------------------------------------------ probing a config
CACHE_ENV = "RPA_TUNE_PROBE_CACHE"


def _cache_dir() -> str:
    from rpa_tune import user_cache_dir
    return os.environ.get(CACHE_ENV) or user_cache_dir("probes")


def program_cache_dir() -> str:
    """Where the profiler keeps its verdicts per lowered program (``profiler.ProgramCache``):
    beside the per-config probe cache. When a config's entry is missing (a new kernel
    version, a new composer), its probes whose programs did not change are answered from it."""
    return os.path.join(_cache_dir(), "programs")


def _cache_key(doc: dict) -> str:
    import hashlib
    import json
    from ..provenance import kernel_hash, versions
    full = dict(doc, kernel=kernel_hash(), versions=versions(), composer=PROBE_VERSION)
    return hashlib.sha256(json.dumps(full, sort_keys=True).encode()).hexdigest()[:24]


def padded_twin(doc: dict) -> dict | None:
    """The cache request of the same config for the shape whose head_dim is ``doc``'s
    padded to 128 lanes, or None when it is already a multiple of 128. The kernel pads
    head_dim to 128 lanes in its cache layout and its q / new K/V operands (``kernel.api``),
    so both shapes compile the same kernel program but for ``sm_scale``'s value (and XLA's
    pad outside it): Llama-3.2-1B's recorded decode estimates equal Llama-3-8B's to the
    cycle, 728 of 728 (benchmarks/README.md, "Padded head_dim"). The twin's probe audit
    asked for at least the work of the padded shape, which the narrower shape's need never
    exceeds (``audit.needed``): a complete twin verdict holds for it, not the reverse, so
    only the narrower shape reads the twin's record (``probe_config``)."""
    d = doc["model"]["head_dim"]
    if d % 128 == 0:
        return None
    return dict(doc, model=dict(doc["model"], head_dim=round_up(d, 128)))


def _judge(out: dict, consistency: list[str]) -> None:
    """A probed config's audit verdict and reasons: every probe's trace audit, and whether
    the probes' cycles can be composed at all (``inconsistent_probes``)."""
    from . import audit as audit_mod
    reasons = [f"probe {p['q_lens']}/{p['kv_lens']}: {x}" for p in out["probes"]
               for x in (p.get("audit") or {}).get("reasons", [])]
    out["consistency"] = consistency
    out["reasons"] = reasons + consistency[:1] + (
        [f"and {len(consistency) - 1} more such probe pairs"] if len(consistency) > 1 else [])
    whole = all((p.get("audit") or {}).get("verdict") == audit_mod.COMPLETE for p in out["probes"])
    out["audit"] = audit_mod.COMPLETE if whole and not consistency else audit_mod.INCOMPLETE


OURS_BUILDER = "rpa_tune.estimator.ours:lower"     # our kernel's builder (``rpa_tune.kernels.ours``)
PROBE_VERSION = "3"     # the probe workloads (``probes``); the fit is redone from cached cycles
# How many probes of one config compile at once (default 1); the sweep sets it per worker.
PROBE_WORKERS_ENV = "RPA_TUNE_PROBE_WORKERS"


def probe_config(*, builder: str, case: Case | str, bs: BlockSizes, tpu: str, model: dict, limits: dict,
                 options: dict | None = None, timeout: float | None = 600, use_cache: bool = True,
                 workers: int | None = None, writes_kv_cache: bool | None = None, extra_libtpu_args: str = "",
                 rss_cap: int | None = None) -> dict:
    """Compile and audit every probe of one config; fit its ``CostModel``.

    Returns ``{"status", "model" (CostModel JSON), "probes": [{q_lens, kv_lens, cycles,
    audit, max_rss_bytes, compile_s}], "audit": complete | incomplete, "reasons",
    "compile_s", "max_rss_bytes" (largest child), "concurrent_rss_bytes" (bound on the
    children alive at once), "probe_workers"}``, or the first probe's failure (``vmem_oom``,
    ``compile_error``, ``timeout``, ``crash``) with its fields. Results are cached on disk
    per config, kernel source, library versions and generation (``RPA_TUNE_PROBE_CACHE``).
    ``workers``: probes compiled at once (default ``$RPA_TUNE_PROBE_WORKERS`` or 1); after
    a probe fails no further one starts and those still compiling are killed.
    ``builder`` names the tuned kernel (``rpa_tune.kernels``: the one whose ``builder`` it
    is); its ``probe_plan`` says how its configs are probed and audited.
    ``writes_kv_cache``: False for a program lowered without its KV-cache write-back (the
    public kernel, ``rpa_tune.estimator.public``): its audit does not ask for those bytes
    (default: the kernel's ``writes_kv_cache``).
    ``extra_libtpu_args``: more libtpu flags for the profiled compiles (the VMEM size
    override, ``rpa_tune.evaluators.compile``); part of the cache key, and so is the VMEM
    size override a kernel that runs with all of VMEM gets at the scoped limit of
    ``options`` (``profiler.deviceless_vmem_args``).
    ``rss_cap``: each profiler child's memory cap (default ``profiler.rss_cap_bytes()``); a
    recorded crash at a lower cap is profiled again.
    The probes' cycles are also checked against each other (``inconsistent_probes``, on
    every call, cached or not): a config failing it is profiled again without
    fast-forward, and if it still fails its ``audit`` is incomplete (``consistency`` says why).
    """
    import json
    import time
    from kernel.workload import ModelShape
    from . import audit as audit_mod, profiler
    from .calibration import calibration
    from rpa_tune.provenance import kernel_hash
    from ..kernels import KernelError, kernel_for_builder
    case = Case.parse(case)
    bs = BlockSizes.coerce(bs)
    kern = kernel_for_builder(builder)
    if kern is None:
        raise KernelError(f"no tuned kernel has the estimator builder {builder!r} (rpa_tune.kernels)")
    if writes_kv_cache is None:
        writes_kv_cache = kern.writes_kv_cache
    shape = ModelShape(**model)
    plan = kern.probe_plan(case, bs, tpu, shape, limits["page_size"])
    skip = plan.skip_dead_chunks
    plist = probes(case, bs, limits["page_size"], skip, plan.mixed_warm_up, long_walk=plan.long_walk)
    # one program per config for every token bucket (module doc)
    limits = dict(limits, max_num_tokens=probe_tokens(plist))
    doc = dict(builder=builder, case=case.value, bs=list(bs), tpu=tpu, model=model, limits=limits,
               options=options or {})
    fast = plan.fast_forward
    if fast:
        doc["profiler"] = "fast_forward"
    if case == Case.DECODE and partial_chunk_probe(bs, limits["page_size"]):
        doc["partial_probe"] = True             # (the others' probes, and cache keys, are unchanged)
    if extra_libtpu_args:
        doc["libtpu_args"] = extra_libtpu_args
    # the VMEM size override the kernel's profiled compiles get at this limit (a kernel
    # that runs with all of VMEM: ``profiler.deviceless_vmem_args``): another size, or
    # another rule, is another verdict
    profiled_args = profiler.deviceless_vmem_args(builder, dict(tpu=tpu, options=options or {}), extra_libtpu_args)
    if profiled_args != extra_libtpu_args:
        doc["profiled_libtpu_args"] = profiled_args
    doc.update(plan.cache_tags)
    walk_new = plan.walk_new
    source = kernel_hash()       # what the cache key holds; every probe must have compiled it
    path = os.path.join(_cache_dir(), _cache_key(doc) + ".json")
    window = (options or {}).get("sliding_window")
    floor = dma_page_floor(tpu, model, limits["page_size"]) if case == Case.DECODE else 0.0
    failed, forward_failed = threading.Event(), threading.Event()
    cap = profiler.rss_cap_bytes() if rss_cap is None else int(rss_cap)

    def recorded(at: str, twin: bool = False) -> dict | None:
        """The verdict recorded at ``at`` (None if none can be used), its fit and check redone."""
        try:
            with open(at) as f:
                out = json.load(f)
            if out.get("status") != "ok":
                # a crash the program causes (_write_cache): the same probes crash again,
                # unless the memory cap has been raised since
                if out.get("cause") == profiler.MEMORY_CAP and cap > out.get("cap_bytes", 0):
                    raise ValueError("the memory cap was raised")
                whose = "the padded twin's probes (padded_twin)" if twin else "this config's probes"
                return dict(out, compile_s=0.0, cached=True, message=f"recorded for {whose} before "
                            f"(not profiled again): {out.get('message', '')}")
            if twin and out.get("audit") != audit_mod.COMPLETE:
                raise ValueError("the twin's audit is incomplete: this shape's own need may pass")
            # ok: the probes' cycles are cached; the fit and the check are redone
            if [(tuple(p["q_lens"]), tuple(p["kv_lens"])) for p in out["probes"]] != [
                    (p.q_lens, p.kv_lens) for p in plist]:
                raise ValueError("recorded for other probes")
            cycles = [p["cycles"] for p in out["probes"]]
            out["model"] = fit(case, bs, limits["page_size"], plist, cycles, window, skip, walk_new,
                               floor).to_json()
            _judge(out, inconsistent_probes(case, bs, limits["page_size"], plist, cycles, window, skip))
            if out["consistency"] and any(p.get("fast_forward") for p in out["probes"]):
                # recorded before the check: profile again without fast-forward (below)
                forward_failed.set()
                raise ValueError("inconsistent fast-forwarded probes")
            return out
        except (OSError, ValueError, KeyError, TypeError):
            return None

    if use_cache:
        out = recorded(path)
        twin = padded_twin(doc) if out is None and plan.padded_twin else None
        if twin is not None:
            out = recorded(os.path.join(_cache_dir(), _cache_key(twin) + ".json"), twin=True)
            if out is not None:
                out["cycles_of"] = f"head_dim {twin['model']['head_dim']} (padded_twin)"
                if out["status"] == "ok":
                    _write_cache(path, out)
        if out is not None:
            return out
    cal = calibration(tpu)
    # Where XLA leaves our kernel's new K/V operand in HBM, the kernel gets no estimate
    # (``ours.places_on_no_estimate``): the config's probes are profiled again with it in VMEM.
    # ``lost``: the probe that first got no estimate, set when the probes are placed (``run`` reads it).
    may_place = plan.place_new_kv_on_no_estimate
    lost = None
    deadline = None if timeout is None else time.monotonic() + timeout
    out = {"status": "ok", "probes": [], "audit": audit_mod.COMPLETE, "reasons": [], "compile_s": 0.0,
           "max_rss_bytes": 0}
    from .trace import TraceStats

    def run(p: Probe) -> dict | None:
        """One probe, profiled (twice at most); None if another probe failed first."""
        if failed.is_set():
            return None
        w = p.workload(case)
        req = dict(doc, workload=dict(q_lens=list(w.q_lens), kv_lens=list(w.kv_lens),
                                      distribution=list(w.distribution)), block_sizes=list(bs))
        for k in ("builder", "bs", "profiler", "libtpu_args", "profiled_libtpu_args", "partial_probe",
                  *dict(plan.cache_tags)):
            req.pop(k, None)
        if lost is not None:
            req["place_new_kv"] = True
        # A decode probe of two full steps is longer than a key's max_model_len when bkv is
        # half of it (bkv 4096 at 8K): the probe's limits admit it. max_model_len only sizes
        # the page table, which no step of the kernel costs by.
        req["limits"] = dict(limits, max_model_len=max(limits["max_model_len"],
                                                       round_up(max(w.kv_lens), limits["page_size"])))
        need = audit_mod.needed(w, shape, case, sliding_window=window)
        if not writes_kv_cache:
            need = dataclasses.replace(need, kv_write_bytes=0)
        # the public kernel fetches the cache one page per run-time-sized DMA (audit doc)
        page_bytes = audit_mod.page_bytes(limits["page_size"], shape) if plan.page_bound_audit else None
        spent = {"compile_s": 0.0, "max_rss_bytes": 0}

        def attempt(forward: bool):
            left = None if deadline is None else max(1.0, deadline - time.monotonic())
            r = profiler.profile(builder, req, timeout=left, expect_kernel_hash=source, fast_forward=forward,
                                 cancel=failed, extra_libtpu_args=extra_libtpu_args, rss_cap=cap,
                                 program_cache=program_cache_dir() if use_cache else None)
            spent["max_rss_bytes"] = max(spent["max_rss_bytes"], r.get("max_rss_bytes") or 0)
            spent["compile_s"] += (r.get("lower_s") or 0.0) + (r.get("compile_s") or 0.0)
            a = (audit_mod.audit_trace(TraceStats.from_json(r["trace"]), need, cal, page_bytes)
                 if r["status"] == "ok" else None)
            return r, a

        forwarded = fast and not forward_failed.is_set()
        r, a = attempt(forwarded)
        # A fast-forwarded loop leaves the trace (and the cycles) without its skipped
        # iterations, which the audit sees as missing work: such a probe is profiled again
        # without fast-forward (so is one whose profiler crashed), and so are the config's
        # probes not started yet, whose programs have the same loops.
        # (Not one without an estimate that is profiled again with the new K/V placed.)
        if (forwarded and r["status"] in ("ok", "crash") and (a is None or a.verdict != audit_mod.COMPLETE)
                and not (may_place and lost is None and r.get("cause") == profiler.NO_ESTIMATE)):
            forward_failed.set()
            forwarded = False
            r, a = attempt(forwarded)
        if r["status"] == profiler.CANCELLED:    # another probe failed while this one ran
            return None
        if r["status"] != "ok":
            failed.set()
        return dict(probe=p, result=r, audit=a, fast_forward=forwarded, **spent)

    # The probes are independent programs: ``workers`` of them compile at once (the sweep
    # gives each of its jobs an equal share of the cores; ``PROBE_WORKERS_ENV``).
    # Longest first (most q blocks, then most KV): the children pack better, and the
    # largest program, the likeliest to run out of VMEM, fails before the others are paid for.
    workers = max(1, min(len(plist), workers or int(os.environ.get(PROBE_WORKERS_ENV) or 1)))
    order = sorted(range(len(plist)), key=lambda i: (-sum(cdiv(q, bs.bq) for q in plist[i].q_lens),
                                                      -sum(plist[i].kv_lens), i))
    spent_before = {"compile_s": 0.0, "max_rss_bytes": 0}
    while True:
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            ran = dict(zip(order, pool.map(run, [plist[i] for i in order])))
        done = [ran[i] for i in range(len(plist)) if ran[i] is not None]
        ok = len(done) == len(plist) and all(d["result"]["status"] == "ok" for d in done)
        why = inconsistent_probes(case, bs, limits["page_size"], plist, [d["result"]["cycles"] for d in done],
                                  window, skip) if ok else []
        no_estimate = [d for d in done if d["result"].get("cause") == profiler.NO_ESTIMATE]
        if no_estimate and may_place and lost is None:
            lost = no_estimate[0]
            failed.clear()
        elif why and any(d["fast_forward"] for d in done):
            # Probes whose cycles miss work their traces hold: when fast-forwarded, the
            # whole config is profiled again without it.
            forward_failed.set()
        else:
            break
        spent_before["compile_s"] += sum(d["compile_s"] for d in done)
        spent_before["max_rss_bytes"] = max([spent_before["max_rss_bytes"]] + [d["max_rss_bytes"] for d in done])
    out["max_rss_bytes"] = max([spent_before["max_rss_bytes"]] + [d["max_rss_bytes"] for d in done])
    out["compile_s"] = spent_before["compile_s"] + sum(d["compile_s"] for d in done)
    out["probe_workers"] = workers
    # at most ``workers`` children live at once: the sum of the largest peaks bounds the
    # config's memory
    out["concurrent_rss_bytes"] = sum(sorted((d["max_rss_bytes"] for d in done), reverse=True)[:workers])

    def failure(d: dict, **fields) -> dict:
        p = d["probe"]
        return dict(d["result"], probe=dict(q_lens=list(p.q_lens), kv_lens=list(p.kv_lens)),
                    compile_s=out["compile_s"], max_rss_bytes=out["max_rss_bytes"], **fields)

    for d in done:
        p, r, a = d["probe"], d["result"], d["audit"]
        if r["status"] != "ok":
            failed_out = failure(d)
            if lost is not None and r["status"] == "vmem_oom":
                # the compile evaluator retries a VMEM OOM at another limit, then with the
                # VMEM size override where a plain compile fits (``evaluators.compile``)
                failed_out["message"] = ("with the new K/V operand placed in VMEM (where XLA put it, no "
                                         f"estimate): {r.get('message', '')}")
            elif lost is not None:
                # placed in VMEM it failed otherwise: the verdict stays the first (a compile
                # error from an operand serving keeps in HBM is no verdict on the config)
                failed_out = failure(lost, message=f"{lost['result'].get('message', '')}; profiled again with "
                                                   f"the new K/V operand in VMEM: {r['status']}: "
                                                   f"{r.get('message', '')[-300:]}")
                if r.get("cause") in (profiler.MEMORY_CAP, profiler.LIBTPU_ABORT):
                    failed_out.update(cause=r["cause"], cap_bytes=r.get("cap_bytes"))   # (what the cache keeps)
            if use_cache and (r["status"] == "vmem_oom"
                              or r.get("cause") in (profiler.MEMORY_CAP, profiler.LIBTPU_ABORT)):
                _write_cache(path, failed_out)
            return failed_out
        if a.notes:
            out.setdefault("notes", []).append(f"probe {list(p.q_lens)}/{list(p.kv_lens)}: {a.notes[0]}")
        out["probes"].append(dict(q_lens=list(p.q_lens), kv_lens=list(p.kv_lens), cycles=r["cycles"],
                                  audit=a.to_json(), max_rss_bytes=r.get("max_rss_bytes"),
                                  compile_s=r.get("compile_s"), fast_forward=d["fast_forward"]))
    m = fit(case, bs, limits["page_size"], plist, [p["cycles"] for p in out["probes"]], window, skip, walk_new,
            floor)
    _judge(out, why)
    out["skip_dead_chunks"] = skip
    if lost is not None:
        out["new_kv_placed"] = True
    out["model"] = m.to_json()
    if use_cache:
        _write_cache(path, out)
    return out


def _write_cache(path: str, out: dict) -> None:
    """A config's probe verdict, written whole or not at all. Besides ``ok`` ones, the
    crashes its program causes (``profiler.MEMORY_CAP``, ``profiler.LIBTPU_ABORT``) and the
    compiler's VMEM OOM at the scoped limit the cache key holds: they are what the same
    probes give again at every token bucket of the key, and each can cost minutes of
    compiling (docs/estimator.md, "Probe cache")."""
    import json
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + f".{os.getpid()}.{threading.get_ident()}.tmp"
    with open(tmp, "w") as f:
        json.dump(out, f)
    os.replace(tmp, path)


def model_from_json(d: dict) -> CostModel:
    return CostModel(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items()})
