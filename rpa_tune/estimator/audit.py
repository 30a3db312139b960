"""The audit of an estimate, and the time model.

An estimate of libtpu's static profiler is only as good as the work its simulated trace
holds: it drops instructions it cannot follow (predicated moves, dynamic SMEM addresses,
run-time trip counts) and then costs less work than the kernel does. ``audit`` checks the
trace (``trace.TraceStats``) against what the workload needs (``needed``):

* KV bytes read: HBM -> VMEM DMA bytes in the trace >= 95 % of the cached context the
  workload reads (its KV tokens before the new ones, merged K+V of every KV head). A DMA
  whose size is a run-time value prints no size in the trace; when the caller says such a
  DMA moves at most one page (``page_bytes``: tpu-inference's RPA v3 fetches the cache one
  page per DMA, ``clip(left, 0, page_size)`` tokens), the check counts each at one page:
  the trace must then issue enough of them to carry the bytes it does not show. That
  proves the fetches are issued (a dropped loop would issue none), not their sizes; the
  audit's ``notes`` say when it was used;
* KV bytes written: DMA bytes into HBM >= 95 % of the new tokens' K/V;
* MXU work: vmatmul instructions x the most FLOPs one instruction carries on that
  generation (``calibration``) >= 95 % of the workload's FLOPs (QK^T and PV over the
  visible pairs);
* rates: the time the cycles imply (at the calibrated clock) is not below bytes / HBM
  bandwidth or FLOPs / MXU peak by more than 5 %: a faster estimate is physically
  impossible, so work is missing or under-charged.

A trace failing any check is ``incomplete`` (the reasons say which); its result row says
so, and ranking / export never let it win silently. ``time_model`` turns cycles into a
time: ``max(cycles / clock, bytes / HBM BW, FLOPs / achievable MXU peak)``, with the
active bound, MBU and MFU from that time (MFU as the RPA paper defines it: against the
peak times the MXU share a head_dim-deep contraction fills, ``max_mxu_utilization``).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from kernel import metrics
from kernel.config import Case, round_up
from kernel.workload import ModelShape, Workload

COMPLETE, INCOMPLETE = "complete", "incomplete"
WORK_FRACTION = 0.95     # the trace must hold at least this share of the needed work
RATE_TOLERANCE = 1.05    # an implied rate above peak x this is impossible


@dataclasses.dataclass(frozen=True)
class Needed:
    kv_read_bytes: int    # cached context read from HBM
    kv_write_bytes: int   # new tokens written to the cache
    flops: int            # MXU work (visible pairs)
    hbm_bytes: int        # the paper's byte count (KV read + write, Q read, O write)


def token_bytes(model: ModelShape) -> int:
    """Bytes of one token's merged K+V of every KV head (padded head_dim) in the cache."""
    return 2 * model.num_kv_heads * round_up(model.head_dim, 128) * np.dtype(model.kv_dtype).itemsize


def walk_bytes(workload: Workload, model: ModelShape, case: Case | str, bs, page_size: int, *,
               sliding_window: int | None) -> int:
    """Cached K/V bytes our kernel's walk fetches from HBM for ``workload``'s ``case``
    sequences: every cached page of every KV step of every q block (``kernel.steps.plan``).
    A q block fetches its context again, so a small ``bq`` reads the cache many times over;
    ``needed`` counts it once."""
    return sum(cached_step_pages(workload, case, bs, page_size, sliding_window)) * page_size * token_bytes(model)


def cached_step_pages(workload: Workload, case: Case | str, bs, page_size: int, sliding_window=None) -> list[int]:
    """The pages of each cached KV step of our kernel's walk over ``workload``'s ``case``
    sequences, in kernel order (``kernel.steps.plan``; sequences in order)."""
    from kernel.config import BlockSizes
    from kernel.steps import plan
    case = Case.parse(case)
    lo, hi = workload.case_range(case)
    return [st.pages for q, kv in zip(workload.q_lens[lo:hi], workload.kv_lens[lo:hi])
            for steps in plan(case, BlockSizes(*bs), page_size, q, kv, sliding_window)
            for st in steps if st.cached]


def page_bytes(page_size: int, model: ModelShape) -> int:
    """The most one run-time-sized page DMA of tpu-inference's RPA v3 moves: one page of
    merged K/V (``audit_trace``'s ``page_bytes`` for that kernel; module doc)."""
    return int(page_size) * token_bytes(model)


def needed(workload: Workload, model: ModelShape, case: Case | str | None = None, *,
           sliding_window: int | None) -> Needed:
    """What ``workload``'s ``case`` sequences (all without one) must move and compute.
    ``sliding_window`` is required (None: full attention): a bound that forgets it counts
    every cached key, and refused Gemma-2's v5p window estimates as faster than HBM."""
    lo, hi = (0, workload.num_seqs) if case is None else workload.case_range(Case.parse(case))
    tb = token_bytes(model)
    read = write = 0
    for q, kv in zip(workload.q_lens[lo:hi], workload.kv_lens[lo:hi]):
        ctx = kv - q
        if sliding_window:        # the cached keys the first query sees: (ctx - window, ctx)
            ctx = min(ctx, sliding_window - 1)
        read += ctx * tb
        write += q * tb
    return Needed(read, write, metrics.flops(workload, model, case, sliding_window),
                  metrics.hbm_bytes(workload, model, case, sliding_window))


@dataclasses.dataclass
class Audit:
    verdict: str
    reasons: list
    kv_read_bytes: int = 0
    kv_read_traced: int = 0
    kv_write_bytes: int = 0
    kv_write_traced: int = 0
    flops: int = 0
    mxu_flops_traced: int = 0
    notes: list = dataclasses.field(default_factory=list)   # checks passed on a bound (module doc)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def audit_trace(trace, need: Needed, cal, page_bytes: int | None = None) -> Audit:
    """The work check of one compiled estimate (``trace``: ``TraceStats``). ``page_bytes``:
    the most one run-time-sized HBM -> VMEM DMA of this kernel moves (module doc), if known."""
    g = cal.dma_granule_bytes or 32
    read = trace.granules("hbm_to_vmem") * g
    write = sum(n for d, n in trace.dma_granules.items() if d.endswith("to_hbm")) * g
    mxu = trace.mxu_matmuls * cal.flops_per_vmatmul
    a = Audit(COMPLETE, [], need.kv_read_bytes, read, need.kv_write_bytes, write, need.flops, int(mxu))
    dyn = (trace.dma_dynamic or {}).get("hbm_to_vmem", 0)
    if (page_bytes and dyn and read < WORK_FRACTION * need.kv_read_bytes
            and read + dyn * page_bytes >= WORK_FRACTION * need.kv_read_bytes):
        a.notes.append(f"{dyn} HBM->VMEM DMAs have a run-time size the trace does not print; at one page "
                       f"({page_bytes} B) at most each they can carry the {need.kv_read_bytes - read:.3g} needed "
                       "read bytes it does not show (counted so)")
        read = need.kv_read_bytes
    for what, have, want in (("KV read DMA bytes", read, need.kv_read_bytes),
                             ("KV write DMA bytes", write, need.kv_write_bytes),
                             ("MXU FLOPs", mxu, need.flops)):
        if want and have < WORK_FRACTION * want:
            a.verdict = INCOMPLETE
            a.reasons.append(f"trace holds {have / want:.0%} of the needed {what} ({have:.3g} of {want:.3g})")
    if dyn and read < WORK_FRACTION * need.kv_read_bytes:
        a.reasons.append(f"{dyn} HBM->VMEM DMAs have a run-time size the trace does not print: "
                         "the read check cannot see their bytes")
    return a


def achievable_mxu_flops(generation: str, head_dim: int, cal) -> float:
    """bf16 FLOP/s the MXU can reach for a contraction of depth head_dim: JAX's peak, times
    the fraction of it a 128-deep contraction reaches on a 256-wide MXU in the profiler's
    own model (``calibration.k128_fraction_of_peak``) when head_dim is 128 or less."""
    from kernel.hardware import tpu_info
    frac = 1.0
    if head_dim <= 128 and cal.mxu_column_size > 128 and cal.k128_fraction_of_peak:
        frac = min(1.0, cal.k128_fraction_of_peak)
    return tpu_info(generation).bf16_ops_per_second * frac


def max_mxu_utilization(head_dim: int, cal) -> float:
    """The RPA paper's cap on MXU utilization for a head_dim (its section 4.2.1): the share of
    the MXU's contraction depth a head_dim-deep contraction fills (head_dim 128 on a 256-wide
    MXU: 50 %). The paper's MFU is against the peak times this cap."""
    return min(1.0, head_dim / cal.mxu_column_size)


def time_model(cycles: float, workload: Workload, model: ModelShape, generation: str, case=None, *,
               sliding_window: int | None, cal=None, walk: int | None = None) -> dict:
    """Time from cycles at the calibrated clock, the roofline bounds, which is active, MBU,
    MFU as the RPA paper defines it (against the bf16 peak times ``max_mxu_utilization``;
    ``mfu_of_peak``: against the plain peak), and the rate check. The FLOPs are the visible
    pairs' (``kernel.metrics.flops``); the paper's causal count also takes the masked part
    of the diagonal's compute blocks, so this MFU is the stricter one.

    ``walk``: the cached K/V bytes the config's own walk fetches (``walk_bytes``; our
    kernel). The memory bound then counts them in place of the cached context read once:
    the paper's bytes are what any kernel must move, the walk's what this config does move,
    and no estimate of it can beat them at the HBM peak. MBU stays against the paper's.

    This is the static time (``static_s`` = ``time_s``, ``calibration`` "none");
    ``device_model.time_model`` puts the device-cost model over it."""
    from kernel.hardware import tpu_info
    from .calibration import calibration
    cal = cal or calibration(generation)
    info = tpu_info(generation)
    need = needed(workload, model, case, sliding_window=sliding_window)
    est_s = cycles / cal.clock_hz
    # The walk replaces the paper's cached read, which counts head_dim unpadded: a narrower
    # head_dim is padded to 128 lanes in our cache layout (``token_bytes``), so its walk
    # moves twice (head_dim 64) the cache bytes the paper counts for it.
    paper_read = need.kv_read_bytes * model.head_dim // round_up(model.head_dim, 128)
    moved = need.hbm_bytes + max(0, (walk or 0) - paper_read)
    mem_s = moved / info.mem_bw_bytes_per_second
    cmp_s = need.flops / achievable_mxu_flops(generation, model.head_dim, cal)
    static_s = max(est_s, mem_s, cmp_s)
    bound = "estimate" if static_s == est_s else ("memory" if static_s == mem_s else "compute")
    time_s = static_s
    mfu_of_peak = need.flops / time_s / info.bf16_ops_per_second if time_s else 0.0
    rate_ok = est_s * RATE_TOLERANCE >= max(mem_s, cmp_s)
    return dict(cycles=float(cycles), estimate_s=est_s, memory_bound_s=mem_s, compute_bound_s=cmp_s,
                time_s=time_s, static_s=static_s, calibration="none", device_bound=None, fixed_s=None,
                active_bound=bound, hbm_bytes=need.hbm_bytes, flops=need.flops,
                mbu=need.hbm_bytes / time_s / info.mem_bw_bytes_per_second if time_s else 0.0,
                mfu=mfu_of_peak / max_mxu_utilization(model.head_dim, cal), mfu_of_peak=mfu_of_peak,
                clock_hz=cal.clock_hz, clock_source=cal.clock_source, rate_ok=rate_ok,
                rate_note="" if rate_ok else (
                    f"cycles imply {max(mem_s, cmp_s) / est_s:.2f}x the "
                    f"{'MXU' if cmp_s > mem_s else 'HBM'} peak"
                    f"{' for the cached K/V its walk fetches' if walk and cmp_s <= mem_s else ''}"
                    ": work missing or under-charged"))
