"""Reading results back: winners per key (``show``), interpret checks of winners
(``verify``) and the environment report (``doctor``). No printing here (see ``ui``)."""
from __future__ import annotations

import dataclasses
import math
import platform
import time
import uuid

from kernel.config import BlockSizes, TuningKey
from kernel.workload import ModelShape, ServingLimits, Workload

from . import provenance
from .evaluators import base
from .kernels import DEFAULT, REFERENCE, get_kernel
from .store import KEY_COLUMNS, ResultStore, config_id, newest_evaluator_frame

RANKED_BACKENDS = ("tpu", "compile")


@dataclasses.dataclass
class Group:
    """Results of one (key, workload, backend) evaluated by one kernel version."""

    key: dict
    key_id: str
    workload_id: str
    workload: str
    backend: str
    method: str
    kernel_hash: str
    stale: bool                 # kernel_hash differs from the current kernel sources
    counts: dict
    rows: list                  # ok rows, best first (wrong configs excluded)
    heuristic: dict | None
    excluded_wrong: int = 0
    kernel: str = DEFAULT        # the tuned kernel (rpa_tune.kernels)
    # every row of the group (each config's latest, any status; wrong configs included),
    # for views of the whole space (``rpa-tune report``'s heatmaps)
    configs: list = dataclasses.field(default_factory=list, repr=False)

    @property
    def best(self) -> dict | None:
        return self.rows[0] if self.rows else None

    @property
    def gain(self) -> float | None:
        """heuristic metric / best metric (> 1: the tuned config is faster)."""
        if not self.best or not self.heuristic or not self.heuristic.get("metric"):
            return None
        return self.heuristic["metric"] / self.best["metric"]


def wrong_configs(df) -> set:
    """(key_id, bq, bkv, cq, ckv, kernel_hash) of every config seen producing a wrong result."""
    bad = df[df["status"] == base.WRONG_RESULT]
    return {(r.key_id, int(r.bq), int(r.bkv), int(r.cq), int(r.ckv), r.kernel_hash) for r in bad.itertuples()}


def winners(df, *, tpu=None, case=None, backend=None, top: int = 1, all_configs: bool = False) -> list[Group]:
    """One ``Group`` per (key, workload, backend) of the latest kernel version: its best
    ``top`` ok configs, status counts and the heuristic's row (the baseline of ``gain``);
    ``all_configs`` also fills ``Group.configs`` with every row of the group."""
    if df.empty:
        return []
    from .kernels import KernelError, get_kernel, row_kernel
    wrong = wrong_configs(df)
    d = df
    if tpu is not None:
        d = d[d["generation"] == tpu]
    if case is not None:
        d = d[d["case"] == case]
    d = d[d["backend"] == backend] if backend is not None else d[d["backend"].isin(RANKED_BACKENDS)]
    if d.empty:
        return []
    d = d.sort_values("timestamp").drop_duplicates("config_id", keep="last")
    groups = []
    for (key_id, wid, be), g in d.groupby(["key_id", "workload_id", "backend"], sort=True):
        latest = g.sort_values("timestamp")["kernel_hash"].iloc[-1]
        g = g[g["kernel_hash"] == latest]
        # rows an evaluator version re-priced do not rank beside their new price (as in export:
        # a modelled key's earlier estimates are not set against its modelled prices)
        g = newest_evaluator_frame(g)
        counts = g["status"].value_counts().to_dict()
        ok = g[(g["status"] == base.OK) & g["metric"].notna()]
        is_wrong = ok.apply(lambda r: (r.key_id, int(r.bq), int(r.bkv), int(r.cq), int(r.ckv), r.kernel_hash)
                            in wrong, axis=1) if len(ok) else ok["metric"].astype(bool)
        excluded = int(is_wrong.sum()) if len(ok) else 0
        ok = ok[~is_wrong] if len(ok) else ok
        ok = ok.sort_values(["metric", "bq", "bkv", "cq", "ckv"])
        heur = g[g["is_heuristic"].fillna(False).astype(bool) & (g["status"] == base.OK)]
        first = g.iloc[-1]
        kern = row_kernel(first.get("kernel"))
        try:
            current = get_kernel(kern).config_version()
        except KernelError:     # a kernel this version does not know: nothing to compare with
            current = None
        groups.append(Group(
            key={k: _py(first[k]) for k in KEY_COLUMNS}, key_id=key_id, workload_id=wid,
            workload=str(first["workload"]), backend=be, method=str(first["method"]), kernel_hash=str(latest),
            stale=current is not None and latest != current, counts={k: int(v) for k, v in counts.items()},
            rows=[_row(r) for _, r in ok.head(top).iterrows()],
            heuristic=_row(heur.iloc[-1]) if len(heur) else None, excluded_wrong=excluded, kernel=kern,
            configs=[_row(r) for _, r in g.iterrows()] if all_configs else []))
    order = {"v4": 0, "v5e": 1, "v5p": 2, "v6e": 3, "tpu7x": 4}
    cases = {"decode": 0, "prefill": 1, "mixed": 2}
    groups.sort(key=lambda g: (order.get(g.key["generation"], 9), cases.get(g.key["case"], 9), g.key_id,
                               g.backend, g.workload_id))
    return groups


def _py(v):
    if hasattr(v, "item"):
        return v.item()
    return v


def _row(r) -> dict:
    out = {}
    for k, v in r.items():
        v = _py(v)
        if isinstance(v, float) and math.isnan(v):
            v = None
        out[k] = v
    return out


# ============================================================================ verify
def verify_winners(store: ResultStore, *, tpu=None, case=None, top: int = 1, jobs: int = 2,
                   timeout: float = 900.0, progress=None) -> list[dict]:
    """Interpret-mode checks of the best ``top`` configs per key; rows are appended to the
    store (backend ``interpret``) and returned. Configs already checked with the current
    kernel are not run again."""
    from .engine import WorkerPool, make_row
    from .evaluators import Task, evaluator_version
    from .evaluators.interpret import interpret_problem
    from .workloads import workload_id

    df = store.read_current()
    groups = winners(df, tpu=tpu, case=case, top=top)
    prov = provenance.provenance()
    ev = evaluator_version("interpret")
    recorded = store.recorded()
    todo, out, seen = [], [], set()
    for g in groups:
        if not get_kernel(g.kernel).interpretable:      # it does not run in the interpreter
            continue
        for r in g.rows:
            key = TuningKey(**g.key)
            bs = BlockSizes(int(r["bq"]), int(r["bkv"]), int(r["cq"]), int(r["ckv"]))
            if (key, bs) in seen:
                continue
            seen.add((key, bs))
            model = ModelShape(key.num_q_heads, key.num_kv_heads, key.head_dim, key.q_dtype, key.kv_dtype)
            limits = ServingLimits(page_size=key.page_size, max_num_tokens=key.max_num_tokens,
                                   max_num_seqs=int(r.get("max_num_seqs") or 128), max_model_len=key.max_model_len)
            task = Task(backend="interpret", generation=key.generation, case=key.case, model=model, limits=limits,
                        workload=Workload.of_case(key.case, [1], [1]), bs=bs, timeout=timeout, seed=0)
            small_limits, small_w = interpret_problem(task)
            task = dataclasses.replace(task, limits=small_limits, workload=small_w)
            wid = workload_id(small_w)
            cid = config_id(key.id(), wid, bs, "interpret", prov["kernel_hash"], ev)
            if cid in recorded:
                out.append(dict(recorded[cid], verified_for=r.get("config_id")))
                continue
            todo.append((task, key, cid, wid, r))
    if progress is not None:
        progress.start(len(todo) + len(out))
        for row in out:
            progress.advance(row)
    if todo:
        sweep_id = uuid.uuid4().hex[:12]
        pending = list(todo)
        with WorkerPool("interpret", jobs) as pool:
            while pending or pool.busy:
                while pending and pool.free_slots() > 0:
                    item = pending.pop(0)
                    pool.submit(item[0], item)
                for item, task, res, eval_s in pool.wait():
                    _, key, cid, wid, r = item
                    row = make_row(key, task.limits, task.workload, "interpret check of " + str(r.get("workload")),
                                   task.bs, res, backend="interpret", search="verify", seed=0, eval_s=eval_s,
                                   prov=prov, config=cid, wid=wid, ev_version=ev, sweep_id=sweep_id,
                                   heuristic=bool(r.get("is_heuristic")), predicted=None)
                    store.append([row])
                    row = dict(row, verified_for=r.get("config_id"))
                    out.append(row)
                    if progress is not None:
                        progress.advance(row)
    if progress is not None:
        progress.stop()
    return out


# ============================================================================ doctor
def table_files() -> list[dict]:
    """The table files the kernel loads here (``$RPA_TABLE``, then the shipped ones): path,
    status with the entry count, and whether their entries were tuned for this kernel."""
    import logging
    from kernel import tables
    logging.getLogger("kernel.tables").disabled = True       # doctor reports, it does not warn
    try:
        state = tables.load_tables()
    finally:
        logging.getLogger("kernel.tables").disabled = False
    out = []
    for path, status in state.files:
        out.append(dict(path=path, status=status, loaded=status.startswith("ok"),
                        matches_kernel=status.startswith("ok") and "another kernel" not in status))
    return out


def doctor_report(*, tpu: str = "v6e", quick: bool = False) -> dict:
    from importlib import metadata
    from .evaluators.base import compilation_cache_dir
    from .evaluators.tpu import probe_devices, tpu_generation_present

    def ver(d):
        try:
            return metadata.version(d)
        except metadata.PackageNotFoundError:
            return None

    rep = {"versions": {"python": platform.python_version(), "jax": ver("jax"), "jaxlib": ver("jaxlib"),
                        "libtpu": ver("libtpu") or ver("libtpu-nightly"), "rpa-tune": ver("rpa-tune"),
                        "optuna": ver("optuna"), "pyarrow": ver("pyarrow")},
           "kernel": {"kernel_id (tables and results)": provenance.kernel_source_hash(),
                      "program_fingerprint": provenance.fingerprint_status(),
                      "git_sha": provenance.git_sha(), "kernel_dir": str(provenance.KERNEL_DIR)},
           "tables": table_files(), "kernels": kernels_report()}
    probe = probe_devices()
    here = tpu_generation_present(probe)
    rep["devices"] = probe
    backends = {"tpu": ("works", f"TPU {here} ({probe.get('device_kind')}) x{probe.get('count')}") if here
                else ("unavailable", "no TPU found" + ("" if probe.get("probed") else
                                                       " (no /dev/accel* or /dev/vfio device nodes)"))}
    cache_dir = None
    try:
        import jax
        cache_dir = jax.config.jax_compilation_cache_dir
    except Exception:  # noqa: BLE001
        pass
    rep["compilation_cache"] = {"jax_compilation_cache_dir (this process)": cache_dir or "(not set)",
                                "tpu backend workers": compilation_cache_dir(),
                                "compile / interpret workers": "disabled (the estimate needs real compiles)"}
    if quick:
        backends["compile"] = ("not checked", "--quick")
        backends["interpret"] = ("not checked", "--quick")
    else:
        backends.update(_trial_runs(tpu))
    rep["backends"] = backends
    rep["auto"] = ("tpu" if here == tpu else "compile") + f" (for --tpu {tpu})"
    return rep


def kernels_report() -> dict:
    """The tunable kernels and whether each can be used here (``rpa_tune.kernels``)."""
    from .kernels import KernelError, get_kernel, kernel_names
    out = {}
    for name in kernel_names():
        k = get_kernel(name)
        try:
            k.check_available()
            out[name] = f"ok: {k.version()} ({k.doc})"
        except KernelError as e:
            out[name] = f"unavailable: {e}"
    return out


def _trial_runs(tpu: str) -> dict:
    from .engine import WorkerPool
    from .evaluators.base import Task
    model = ModelShape(8, 2, 128)
    out = {}
    trials = {
        "compile": Task(backend="compile", generation=tpu, case="decode", model=model,
                        limits=ServingLimits(page_size=128, max_num_tokens=64, max_num_seqs=8, max_model_len=2048),
                        workload=Workload.of_case("decode", [1] * 4, [1000] * 2 + [300] * 2),
                        bs=BlockSizes(1, 256, 1, 128), timeout=300),
        "interpret": Task(backend="interpret", generation=tpu, case="decode", model=ModelShape(4, 1, 128),
                          limits=ServingLimits(page_size=16, max_num_tokens=16, max_num_seqs=4, max_model_len=256),
                          workload=Workload.of_case("decode", [1], [1]), bs=BlockSizes(1, 32, 1, 16), timeout=300),
    }
    for name, task in trials.items():
        t0 = time.monotonic()
        with WorkerPool(name, 1) as pool:
            pool.submit(task)
            res = []
            while not res:
                res = pool.wait()
        r = res[0][2]
        secs = time.monotonic() - t0
        if r.status == base.OK:
            what = (f"deviceless {tpu} compile + static profiler estimate ({r.cycles:.0f} cycles)"
                    if name == "compile" else "Pallas interpreter matches the reference")
            out[name] = ("works", f"{what}, {secs:.0f} s")
        elif name == "compile" and r.status == base.CRASH and "compiles without the profiler" in r.message:
            out[name] = ("partly", f"deviceless compile works, but libtpu's static profiler crashed: the "
                                   f"compile backend records such configs as crash ({secs:.0f} s)")
        else:
            out[name] = ("fails", f"{r.status}: {r.message[:300]}")
    return out


# =========================================================================== compare
@dataclasses.dataclass
class KernelComparison:
    """One (key, workload, backend) tuned for both kernels: each one's best, same method."""

    key: dict
    workload_id: str
    workload: str
    backend: str
    method: str
    best: dict                  # kernel name -> its best ok row (None if it has none)
    heuristic: dict             # kernel name -> its baseline's ok row (None if absent)

    @property
    def ratio(self) -> float | None:
        """ours / public of the best metrics (< 1: ours is faster)."""
        a, b = self.best.get(DEFAULT), self.best.get(REFERENCE)
        return a["metric"] / b["metric"] if a and b and b.get("metric") else None


def compare_kernels(df, *, tpu=None, case=None, backend=None) -> list[KernelComparison]:
    """Per key, workload and backend tuned for both kernels: the best of each (metrics of
    the same backend, so the same method: both estimates through the same audited time
    model, or both device times) and their ratio. Keys tuned for one kernel only are left
    out. Stale rows (another kernel version) are not compared (``winners`` keeps the latest)."""
    groups = [g for g in winners(df, tpu=tpu, case=case, backend=backend) if not g.stale]
    by: dict[tuple, dict] = {}
    for g in groups:
        by.setdefault((TuningKey(**g.key), g.workload_id, g.backend), {})[g.kernel] = g
    out = []
    for (key, wid, be), per in sorted(by.items(), key=lambda x: (x[0][0], x[0][1], x[0][2])):
        if len(per) < 2:
            continue
        any_g = next(iter(per.values()))
        out.append(KernelComparison(key=dataclasses.asdict(key), workload_id=wid, workload=any_g.workload,
                                    backend=be, method=any_g.method,
                                    best={k: g.best for k, g in per.items()},
                                    heuristic={k: g.heuristic for k, g in per.items()}))
    return out
