"""The sweep engine: enumerate -> legality -> VMEM pre-filter -> evaluate -> record.

One loop (``run_sweep``) for every sweep: the search (``rpa_tune.search``) asks configs,
a scheduler (``rpa_tune.schedulers``) says which of them this process evaluates, and the
local worker pool (``rpa_tune.pool``) evaluates them, ``jobs`` at a time. The scheduler is
this process alone (``LocalScheduler``, the default) or a study in a shared Optuna
storage (``distributed.StudyScheduler``, ``sweep --storage``), where a config another
worker claimed or finished is waited for and its outcome told to this worker's search.

Every finished evaluation is written to the store at once (one atomic Parquet file), so
an interrupted sweep (Ctrl-C, ``kill -9``) loses nothing that finished; rerunning the
same command skips every config already recorded (same ``config_id``).
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import time
import uuid

from kernel.config import BlockSizes, Case, TuningKey
from kernel.workload import ModelShape, ServingLimits, Workload

from . import prefilter, provenance
from .evaluators import base, evaluator_version
from .evaluators.base import EvalResult, Task
from .pool import WorkerPool
from .schedulers import OVER, PENDING, RUN, LocalScheduler, Scheduler
from .search import SEEDED, make_search
from .space import CaseSpace, context, enumerate_space
from .store import ResultStore, config_id, row_block_sizes
from .workloads import workload_id


# ============================================================================= sweeps
def problem_key(tpu: str, case: Case | str, model: ModelShape, limits: ServingLimits, *,
                sliding_window: bool = False) -> TuningKey:
    """The ``TuningKey`` a sweep of ``model`` under ``limits`` records its rows under: the
    key a kernel call of that shape looks up (``kernel.tables.key_for``, the one builder)."""
    from kernel.tables import key_for
    dims = dict(q_dtype=model.q_dtype, kv_dtype=model.kv_dtype, num_q_heads=model.num_q_heads,
                num_kv_heads=model.num_kv_heads, head_dim=model.head_dim, page_size=limits.page_size,
                max_num_tokens=limits.max_num_tokens, pages_per_seq=limits.pages_per_seq)
    return key_for(case, generation=tpu, dims=dims, sliding_window=sliding_window)


@dataclasses.dataclass
class SweepSpec:
    """Everything one sweep (one key, one workload) needs; validated by the caller."""

    key: TuningKey
    model: ModelShape
    limits: ServingLimits
    workload: Workload
    workload_desc: str
    case_space: CaseSpace
    backend: str = "compile"
    search: str = "tpe"
    budget: int = 20
    seed: int = 0
    jobs: int = 1
    timeout: float = 900.0
    patience: int = 10
    refine: int = 0              # climb asks after the budget (rpa_tune.search), outside it
    seeds: int = 0               # seeds from each other bucket, its best first (0: all; sibling_configs)
    retry: tuple = ()            # statuses to evaluate again on resume
    model_label: str = ""
    sliding_window: int | None = None   # the window the kernel runs with (key.sliding_window)
    kernel: str = "rpa-tune"            # the tuned kernel (rpa_tune.kernels)
    soft_cap: float | None = None       # logit soft cap the kernel runs with (not in the key)

    def __post_init__(self):
        if bool(self.key.sliding_window) != (self.sliding_window is not None):
            raise ValueError(f"key {self.key.id()} and sliding_window={self.sliding_window} disagree")

    @property
    def generation(self) -> str:
        return self.key.generation

    @property
    def tuned_kernel(self):
        from .kernels import get_kernel
        return get_kernel(self.kernel)

    @property
    def key_id(self) -> str:
        from .kernels import key_id
        return key_id(self.key, self.kernel)

    @property
    def case(self) -> Case:
        return Case.parse(self.key.case)


@dataclasses.dataclass
class Plan:
    """What a sweep will evaluate, before any evaluation."""

    candidates: list              # legal, capped, VMEM pre-filter passed
    predicted: dict               # BlockSizes -> predicted scratch bytes
    total: int
    illegal: int
    capped: int
    prefiltered: int
    heuristic: BlockSizes | None
    reasons: dict


def heuristic_config(spec: SweepSpec) -> BlockSizes | None:
    """The key's baseline: what the tuned kernel runs for it without a table entry (ours:
    ``kernel.heuristics.heuristic_for_key``; the public kernel: its own default; export
    compares against the same)."""
    try:
        return spec.tuned_kernel.heuristic(spec.key, max_num_seqs=spec.limits.max_num_seqs)
    except Exception:  # noqa: BLE001 - a baseline is optional
        return None


def plan_sweep(spec: SweepSpec) -> Plan:
    """Legal candidates of the space (the tuned kernel's rules), the baseline first, and
    (ours only) the VMEM pre-filter: it predicts our kernel's scratch; for the public
    kernel the compiler alone judges VMEM."""
    kern = spec.tuned_kernel
    ctx = context(spec.model, spec.limits, spec.generation)
    en = enumerate_space(spec.case_space, ctx, kern.block_size_errors)
    cands = list(en.candidates)
    heur = heuristic_config(spec)
    if heur is not None and heur not in cands and not kern.block_size_errors(spec.case, heur, spec.limits.page_size):
        cands.insert(0, heur)    # the baseline is evaluated even when outside the space
    keep, predicted = [], {}
    prefiltered = 0
    for bs in cands:
        p = kern.predicted_vmem_bytes(spec.model, spec.limits, bs, spec.case)
        if p is not None and prefilter.rejects(p, spec.generation):
            prefiltered += 1
            continue
        keep.append(bs)
        predicted[bs] = p
    if heur not in predicted:
        heur = None
    return Plan(keep, predicted, en.total, en.illegal, en.capped, prefiltered, heur, en.reasons)


@dataclasses.dataclass
class Outcome:
    spec: SweepSpec
    plan: Plan
    counts: dict
    evaluated: int = 0            # new evaluations this run
    resumed: int = 0              # configs recorded already (in the store, or by another worker)
    best: dict | None = None      # best ok row
    heuristic_row: dict | None = None
    interrupted: bool = False
    stop_reason: str = ""
    elapsed_s: float = 0.0
    search_note: str = ""
    study: str = ""                  # --storage: the Optuna study this worker joined
    storage_s: float | None = None   # --storage: wall time in storage calls (claims, tells, checks)
    storage_calls: int = 0
    storage_join_s: float | None = None   # --storage: creating / joining the study


class Events:
    """Callbacks for progress displays (all optional)."""

    def start(self, spec: SweepSpec, plan: Plan, total: int) -> None: ...
    def resumed(self, row: dict) -> None: ...
    def dispatched(self, bs: BlockSizes) -> None: ...
    def finished(self, row: dict, outcome: Outcome) -> None: ...


@dataclasses.dataclass
class SweepContext:
    """What every row of a sweep records: the tuned kernel, provenance, the versions in its
    config ids and the workload id (one definition for local and distributed sweeps)."""

    spec: SweepSpec
    kernel: object
    prov: dict
    kversion: str | None
    ev_version: str
    wid: str

    def config_id(self, bs) -> str:
        return config_id(self.spec.key_id, self.wid, bs, self.spec.backend, self.kversion, self.ev_version)

    def row(self, plan: Plan, bs: BlockSizes, res: EvalResult, eval_s: float, sweep_id: str,
            seeded: bool = False) -> dict:
        """The store row of one evaluation of ``bs`` in this sweep (``make_row``); a config
        asked as a seed (``sibling_configs``) records ``SEEDED`` as its search."""
        s = self.spec
        return make_row(s.key, s.limits, s.workload, s.workload_desc, bs, res, backend=s.backend,
                        search=SEEDED if seeded else s.search,
                        seed=s.seed, eval_s=eval_s, prov=self.prov, config=self.config_id(bs), wid=self.wid,
                        ev_version=self.ev_version, sweep_id=sweep_id, heuristic=bs == plan.heuristic,
                        predicted=plan.predicted.get(bs))


def sweep_context(spec: SweepSpec) -> SweepContext:
    kern = spec.tuned_kernel
    prov = provenance.provenance()
    kversion = kern.config_version()
    prov = kern.row_provenance(prov)    # (a kernel not ours records its own version)
    prov["kernel"], prov["kernel_version"] = kern.name, kern.version()
    ev_version = evaluator_version(spec.backend, spec.case, spec.generation)
    wid = workload_id(spec.workload)
    if spec.sliding_window is not None:   # another window is another problem (full attention keeps its ids)
        wid = f"{wid}-sw{spec.sliding_window}"
    if spec.soft_cap is not None:         # so is a soft cap
        wid = f"{wid}-cap{spec.soft_cap:g}"
    return SweepContext(spec, kern, prov, kversion, ev_version, wid)


def note_row(outcome: Outcome, row: dict) -> None:
    """Count a finished row in ``outcome`` (statuses, best, the heuristic's row)."""
    outcome.counts[row["status"]] = outcome.counts.get(row["status"], 0) + 1
    if row["status"] == base.OK and row.get("metric") is not None:
        if outcome.best is None or row["metric"] < outcome.best["metric"]:
            outcome.best = row
    if row.get("is_heuristic"):
        outcome.heuristic_row = row


def _priced_alike(r: dict, spec: SweepSpec, ctx: SweepContext) -> bool:
    """``r`` prices this sweep's kernel source with its backend for a key that differs from
    the sweep's at most in its token bucket, under any evaluator version (a new version
    re-prices a config; the compile backend's from its cached probes)."""
    return (r.get("backend") == spec.backend and r.get("kernel") == ctx.kernel.name
            and r.get("kernel_hash") == ctx.prov.get("kernel_hash")
            and all(r.get(k) == v for k, v in spec.key.as_dict().items() if k != "max_num_tokens"))


def sibling_configs(spec: SweepSpec, ctx: SweepContext, recorded: dict) -> list[BlockSizes]:
    """The configs evaluated ``ok`` for the same key at other token buckets (same kernel,
    kernel hash and backend; any workload and evaluator version), best first: a sweep over
    several buckets (``--buckets``) seeds each bucket's search with them
    (``rpa_tune.search``), since the compile backend prices them from cached probes. Other
    backends pay for every evaluation (a device run, an interpretation): none for them.
    ``spec.seeds`` > 0: only the configs among the ``spec.seeds`` best of some other bucket
    (a probe cache that did not survive, e.g. on a fresh machine, makes every seed a full
    evaluation, and most of a long sweep's are far from any bucket's best), ranked per
    batch priced there and per evaluator version: the metrics of two batches at one bucket
    (the plan's sweep step before and after a change), or of two versions of one evaluator,
    do not compare, and ranked together the smaller batch's (or the cheaper version's)
    configs took every place."""
    if spec.backend != "compile":
        return []
    rows = [r for r in recorded.values()
            if r.get("status") == base.OK and r.get("metric") is not None
            and r.get("max_num_tokens") != spec.key.max_num_tokens and _priced_alike(r, spec, ctx)]
    rows.sort(key=lambda r: r["metric"])
    if spec.seeds:
        per_batch: dict = {}
        for r in rows:
            batch = (r["max_num_tokens"], r.get("workload_id"), r.get("evaluator_version"))
            per_batch.setdefault(batch, []).append(row_block_sizes(r))
        keep = {bs for configs in per_batch.values() for bs in list(dict.fromkeys(configs))[:spec.seeds]}
        rows = [r for r in rows if row_block_sizes(r) in keep]
    return list(dict.fromkeys(map(row_block_sizes, rows)))


def own_picks(spec: SweepSpec, ctx: SweepContext, recorded: dict) -> list[BlockSizes]:
    """The configs this sweep's search picked in earlier runs (recorded for this very key
    and workload with the sweep's search, not as the heuristic or a seed; under any
    evaluator version): replayed inside the budget (``rpa_tune.search``), so rerunning a
    finished ``--buckets`` sweep evaluates nothing new although its seeds have grown since,
    and after a new evaluator version it re-prices what it picked before."""
    return list(dict.fromkeys(
        row_block_sizes(r) for r in recorded.values()        # (in the order they were recorded)
        if r.get("search") == spec.search and not r.get("is_heuristic")
        and r.get("max_num_tokens") == spec.key.max_num_tokens and r.get("workload_id") == ctx.wid
        and _priced_alike(r, spec, ctx)))


def make_task(spec: SweepSpec, plan: Plan, bs: BlockSizes) -> Task:
    return Task(backend=spec.backend, generation=spec.generation, case=spec.case.value,
                model=spec.model, limits=spec.limits, workload=spec.workload, bs=bs,
                timeout=float(spec.timeout), seed=spec.seed,
                vmem_predicted_bytes=plan.predicted.get(bs), sliding_window=spec.sliding_window,
                kernel=spec.tuned_kernel.name, soft_cap=spec.soft_cap, heuristic=bs == plan.heuristic)


def run_sweep(spec: SweepSpec, store: ResultStore, *, scheduler: Scheduler | None = None,
              events: Events | None = None, pool_env: dict | None = None) -> Outcome:
    """Sweep ``spec``: the search asks, ``scheduler`` (default: this process alone) grants,
    the worker pool evaluates, every row goes to ``store`` at once. The scheduler may refuse
    the sweep (raise) before anything is evaluated."""
    events = events or Events()
    sched = scheduler or LocalScheduler()
    t_start = time.monotonic()
    plan = plan_sweep(spec)
    outcome = Outcome(spec, plan, counts={s: 0 for s in base.STATUSES})
    ctx = sweep_context(spec)
    pool = None
    try:
        recorded = sched.open(spec, plan, ctx, store)
        seeds = sibling_configs(spec, ctx, recorded)
        # What the search proposes depends on its seeds, which grow between runs, and with parallel
        # jobs (or workers) on the order outcomes arrive in: a rerun then replays its own earlier
        # picks (one job, no seeds, no other worker: it proposes them again, in the same order)
        parallel = spec.jobs > 1 or sched.shared
        replay = own_picks(spec, ctx, recorded) if seeds or parallel else []
        search = make_search(spec.search, plan.candidates, budget=spec.budget, seed=spec.seed,
                             first=plan.heuristic, patience=spec.patience, jobs=2 if parallel else 1,
                             seeds=seeds, replay=replay, refine=spec.refine)
        outcome.search_note = search.fallback
        if search.seeds:
            outcome.search_note = "; ".join(x for x in (outcome.search_note, (
                f"{len(search.seeds)} configs evaluated at other token buckets of the key first (outside the "
                "budget)")) if x)
        # the head is always asked (replayed picks may outnumber the budget: rows recorded before
        # seeds were marked as such count as picks), then the budget, the seeds and the climb
        limit = max(spec.budget, len(search.head) - len(search.seeds)) + len(search.seeds) + spec.refine
        seeded = set(search.seeds)
        total = min(limit, len(plan.candidates))
        sched.planned(total)
        sweep_id = uuid.uuid4().hex[:12]
        events.start(spec, plan, total)
        pool = WorkerPool(spec.backend, 1 if spec.backend == "tpu" else spec.jobs, env=pool_env)
        pending: dict = {}          # config -> acquire arguments: another worker evaluates it
        asked, exhausted, polled = 0, False, -1.0

        def grant(bs: BlockSizes, args: tuple) -> None:
            g = sched.acquire(bs, *args)
            if g.kind == RUN:
                pool.submit(make_task(spec, plan, bs), (bs, g.token))
                events.dispatched(bs)
            elif g.kind == PENDING:
                pending[bs] = args
            elif g.kind == OVER:
                search.spend(bs)
            elif g.row is None:       # given up: every worker that took it died
                search.tell(bs, base.CRASH, None)
            else:
                row = dict(g.row, is_heuristic=bs == plan.heuristic)
                outcome.resumed += 1
                note_row(outcome, row)
                search.tell(bs, row["status"], row.get("metric"))
                events.resumed(row)

        while True:
            sched.tick()
            if pending and time.monotonic() - polled >= sched.poll_s:
                polled = time.monotonic()
                for bs in list(pending):      # done elsewhere meanwhile, or given back to the study
                    if pool.free_slots() > 0:
                        grant(bs, pending.pop(bs))
            # hand out work while there is budget and a free worker
            while not exhausted and asked < limit and pool.free_slots() > 0 and not search.should_stop():
                bs = search.ask()
                if bs is None:
                    # a climb waits for the outcomes in flight before it knows where to go next
                    exhausted = not (search.waiting and (pool.busy or pending))
                    break
                asked += 1
                cid = ctx.config_id(bs)
                prev = recorded.get(cid)
                # --retry STATUS evaluates such rows again, and so is the heuristic's crash: every
                # key needs its baseline, and the probe cache answers a repeat at once
                redo = prev is not None and (prev["status"] in spec.retry or (
                    bs == plan.heuristic and prev["status"] == base.CRASH))
                grant(bs, (cid, prev, redo, search.phase(bs)))
            if pool.busy == 0:
                if not pending:
                    break
                time.sleep(sched.poll_s)
                continue
            for (bs, token), task, res, eval_s in pool.wait(timeout=sched.poll_s if sched.shared else None):
                row = ctx.row(plan, bs, res, eval_s, sweep_id, seeded=bs in seeded)
                # the shared record first: a worker killed between the two writes leaves the row
                # there (not redone, and exported from there) rather than only in its own store
                try:
                    sched.record(token, row)
                finally:
                    store.append([row])
                recorded[row["config_id"]] = row
                outcome.evaluated += 1
                note_row(outcome, row)
                search.tell(bs, row["status"], row.get("metric"))
                events.finished(row, outcome)
        if not plan.candidates:
            outcome.stop_reason = "no candidate passed the legality rules, size caps and VMEM pre-filter"
        elif search.stop_reason:
            outcome.stop_reason = search.stop_reason
        elif asked >= limit and len(plan.candidates) > limit:
            outcome.stop_reason = f"budget of {spec.budget} evaluations reached" + (
                f" (and {spec.refine} climb asks)" if spec.refine else "")
        elif asked >= len(plan.candidates):
            outcome.stop_reason = "every candidate evaluated"
        else:
            outcome.stop_reason = (f"the search proposed nothing more ({asked} of {len(plan.candidates)} "
                                   "candidates asked)")
        sched.finish(outcome)
    except KeyboardInterrupt:
        sched.give_back()
        outcome.interrupted = True
        outcome.stop_reason = "interrupted: rerun the same command to resume" + (
            " (this worker's claimed configs were given back to the study)" if sched.shared else "")
        sched.finish(outcome)
    finally:
        if pool is not None:
            pool.close()
        sched.close()
        outcome.elapsed_s = time.monotonic() - t_start
    return outcome


def make_row(key: TuningKey, limits: ServingLimits, workload: Workload, workload_desc: str, bs: BlockSizes,
             res: EvalResult, *, backend: str, search: str, seed: int, eval_s: float, prov: dict, config: str,
             wid: str, ev_version: str, sweep_id: str, heuristic: bool, predicted: int | None) -> dict:
    """One store row (``store.SCHEMA``) for one evaluation."""
    from .kernels import key_id
    w = workload
    r = dict(key.as_dict())
    r.update(
        key_id=key_id(key, prov.get("kernel")), max_num_seqs=limits.max_num_seqs,
        workload_id=wid, workload=workload_desc,
        workload_json=json.dumps({"q_lens": w.q_lens, "kv_lens": w.kv_lens, "distribution": w.distribution}),
        num_seqs=w.num_seqs, num_tokens=w.num_tokens,
        bq=bs.bq, bkv=bs.bkv, cq=bs.cq, ckv=bs.ckv, is_heuristic=bool(heuristic),
        status=res.status, metric=res.metric, unit=res.unit, method=res.method or _method(backend),
        cycles=res.cycles, estimate_s=res.estimate_s, memory_bound_s=res.memory_bound_s,
        compute_bound_s=res.compute_bound_s, active_bound=res.active_bound, audit=res.audit,
        clock_hz=res.clock_hz, clock_source=res.clock_source, samples=res.samples,
        spread=res.spread, compile_s=res.compile_s, eval_s=eval_s, vmem_predicted_bytes=predicted,
        vmem_limit_bytes=res.vmem_limit_bytes, vmem_reported_bytes=res.vmem_reported_bytes,
        message=res.message, backend=backend, search=search, seed=seed,
        evaluator_version=ev_version, device_kind=res.device_kind,
        timestamp=_dt.datetime.now(_dt.timezone.utc), sweep_id=sweep_id, config_id=config,
        static_s=res.static_s, calibration=res.calibration)
    walk = res.walk or {}
    for k in ("qblocks", "steps", "pages", "hbm_bytes", "mxu_flops"):
        r[f"walk_{k}"] = walk.get(k)
    for k in ("jax_version", "jaxlib_version", "libtpu_version", "rpa_tune_version", "kernel_hash",
              "kernel_source_hash", "git_sha", "kernel", "kernel_version"):
        r[k] = prov.get(k)
    if r["status"] != base.OK or r["audit"] == "incomplete":
        # only ok rows carry a metric: nothing else can win. An estimate whose audit is
        # incomplete (work missing from the profiler's trace, or a rate above peak) keeps
        # its cycles and bounds in the row, and its message says why, but never wins.
        r["metric"] = None
    return r


def _method(backend: str) -> str:
    return {"compile": "estimate", "tpu": "measured", "interpret": "correctness"}.get(backend, "")
