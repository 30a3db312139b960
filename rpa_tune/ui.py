"""Rich rendering: sweep header, live progress, summary tables, show / verify / doctor."""
from __future__ import annotations

import json
import math
import os
import threading
import time

from rich.console import Console
from rich.markup import escape
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)
from rich.table import Table

from .engine import Events, Outcome, Plan, SweepSpec, plan_sweep
from .kernels import DEFAULT, REFERENCE

def _console(**kw) -> Console:
    c = Console(highlight=False, **kw)
    if not c.is_terminal and "COLUMNS" not in os.environ:
        # logs / pipes: never wrap (tables only take the width their cells need)
        c = Console(highlight=False, width=100_000, **kw)
    return c


out = _console()
err = _console(stderr=True)

STATUS_STYLE = {"ok": "green", "vmem_oom": "yellow", "compile_error": "red", "timeout": "magenta",
                "wrong_result": "bold red", "crash": "red"}
SHORT = {"ok": "ok", "vmem_oom": "oom", "compile_error": "err", "timeout": "timeout",
         "wrong_result": "wrong", "crash": "crash"}


def styled(text: str, style: str | None) -> str:
    text = escape(str(text))
    return f"[{style}]{text}[/]" if style else text


def fmt_time(s) -> str:
    if s is None or (isinstance(s, float) and math.isnan(s)):
        return "-"
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} µs"


def fmt_bytes(b) -> str:
    if b is None or (isinstance(b, float) and math.isnan(b)):
        return "-"
    return f"{b / 2**20:.1f} MiB"


def fmt_bs(r) -> str:
    return f"({int(r['bq'])}, {int(r['bkv'])}, {int(r['cq'])}, {int(r['ckv'])})"


def fmt_counts(counts: dict) -> str:
    parts = [styled(f"{SHORT.get(k, k)} {v}", STATUS_STYLE.get(k)) for k, v in counts.items() if v]
    return " · ".join(parts) or "-"


def shape_label(key: dict) -> str:
    return (f"q{key['num_q_heads']}/kv{key['num_kv_heads']} d{key['head_dim']} "
            f"{_dt(key['q_dtype'])}/{_dt(key['kv_dtype'])}")


def _dt(name: str) -> str:
    return {"bfloat16": "bf16", "float32": "f32", "float8_e4m3fn": "fp8"}.get(name, name)


# ============================================================================ sweep
def _plan_line(plan: Plan) -> str:
    return (f"{len(plan.candidates)} candidates of {plan.total} in the space "
            f"({plan.illegal} illegal, {plan.capped} over a size cap, {plan.prefiltered} rejected by the VMEM "
            f"pre-filter)")


def print_header(spec: SweepSpec, backend_note: str, results, storage: str | None = None) -> None:
    plan = plan_sweep(spec)
    k = spec.key
    err.print(f"[bold]rpa-tune sweep[/] {k.generation} {k.case}: {spec.model_label or shape_label(k.as_dict())}")
    err.print(f"  kernel    {spec.tuned_kernel.name} ({spec.tuned_kernel.version()})")
    err.print(f"  key       {k.id()}")
    err.print(f"  workload  {escape(spec.workload_desc)}")
    err.print(f"  space     {spec.case_space and _plan_line(plan)}; heuristic {tuple(plan.heuristic) if plan.heuristic else '-'}")
    err.print(f"  backend   {spec.backend} ({backend_note}); search {spec.search}, budget {spec.budget}, "
              f"seed {spec.seed}, jobs {1 if spec.backend == 'tpu' else spec.jobs}, timeout {spec.timeout:g} s")
    err.print(f"  results   {os.fspath(results)}")
    if storage:
        err.print(f"  storage   {escape(storage)} (shared with every worker of the same sweep)")


def print_json(doc) -> None:
    """A JSON document on stdout (``--json``): nothing else is printed there."""
    import sys
    sys.stdout.write(json.dumps(doc, indent=2, default=_json_default) + "\n")
    sys.stdout.flush()


def _json_default(v):
    if hasattr(v, "item"):
        return v.item()
    if hasattr(v, "isoformat"):
        return v.isoformat()
    return str(v)


def _bs_list(r) -> list | None:
    return None if not r else [int(r[k]) for k in ("bq", "bkv", "cq", "ckv")]


def outcome_dict(o: Outcome) -> dict:
    """One sweep's outcome for ``sweep --json``."""
    b, h = o.best, o.heuristic_row
    extra = {} if o.storage_s is None else dict(study=o.study, storage_s=round(o.storage_s, 4),
                                                storage_calls=o.storage_calls,
                                                storage_join_s=round(o.storage_join_s or 0.0, 4))
    return extra | dict(key=o.spec.key.as_dict(), key_id=o.spec.key_id, kernel=o.spec.kernel, workload=o.spec.workload_desc,
                backend=o.spec.backend, evaluated=o.evaluated, resumed=o.resumed,
                counts={k: v for k, v in o.counts.items() if v}, stop_reason=o.stop_reason,
                search_note=o.search_note, interrupted=o.interrupted, elapsed_s=round(o.elapsed_s, 3),
                best=None if not b else dict(block_sizes=_bs_list(b), metric=b.get("metric")),
                heuristic=None if not h else dict(block_sizes=_bs_list(h), metric=h.get("metric"),
                                                   status=h.get("status")),
                speedup=(h["metric"] / b["metric"]) if b and h and h.get("metric") else None)


def group_dict(g) -> dict:
    """One key's winners for ``show --json``."""
    return dict(key=g.key, key_id=g.key_id, kernel=g.kernel, workload_id=g.workload_id, workload=g.workload,
                backend=g.backend,
                method=g.method, kernel_hash=g.kernel_hash, stale=g.stale, counts=g.counts,
                excluded_wrong=g.excluded_wrong, speedup=g.gain,
                heuristic=None if not g.heuristic else dict(block_sizes=_bs_list(g.heuristic),
                                                            metric=g.heuristic.get("metric")),
                configs=[dict(block_sizes=_bs_list(r), metric=r.get("metric"), bound=r.get("active_bound"),
                              cycles=r.get("cycles"), vmem_limit_bytes=r.get("vmem_limit_bytes"),
                              heuristic=bool(r.get("is_heuristic"))) for r in g.rows])


def print_plan(spec: SweepSpec, backend_note: str, results, json_out: bool = False) -> None:
    if json_out:
        plan = plan_sweep(spec)
        print_json(dict(key=spec.key.as_dict(), key_id=spec.key_id, kernel=spec.kernel, workload=spec.workload_desc,
                        backend=spec.backend, total=plan.total, illegal=plan.illegal, capped=plan.capped,
                        prefiltered=plan.prefiltered,
                        heuristic=list(plan.heuristic) if plan.heuristic else None,
                        candidates=[dict(block_sizes=list(bs), predicted_vmem_bytes=plan.predicted[bs])
                                    for bs in plan.candidates]))
        return
    print_header(spec, backend_note, results)
    plan = plan_sweep(spec)
    t = Table(title=f"{spec.key.generation} {spec.key.case}: candidates (dry run, nothing evaluated)")
    for c in ("#", "(bq, bkv, cq, ckv)", "predicted VMEM", "note"):
        t.add_column(c)
    for i, bs in enumerate(plan.candidates):
        t.add_row(str(i + 1), str(tuple(bs)), fmt_bytes(plan.predicted[bs]),
                  "heuristic" if bs == plan.heuristic else "")
    out.print(t)
    if plan.reasons:
        out.print("dropped: " + "; ".join(f"{n} x {r}" for r, n in sorted(plan.reasons.items(), key=lambda x: -x[1])))


def sweep_progress(interval: float = 30.0) -> Events:
    """A live Rich bar on a terminal; plain progress lines when stderr is not one (logs, CI)."""
    return SweepProgress() if err.is_terminal else PlainProgress(interval=interval)


class PlainProgress(Events):
    """Progress for logs: one line per finished config (n/N, status, time, best so far) and,
    while evaluations run, a line every ``interval`` seconds."""

    def __init__(self, interval: float = 30.0, stream=None):
        import sys
        self.stream = stream or sys.stderr
        self.interval = interval
        self.done = self.total = self.in_flight = 0
        self.counts: dict = {}
        self.best = None
        self.label = ""
        self.t0 = time.monotonic()
        self.last = self.t0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = None

    def __enter__(self):
        self._thread = threading.Thread(target=self._beat, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _line(self, text: str) -> None:
        with self._lock:
            self.last = time.monotonic()
            self.stream.write(f"[{self.label} {self.last - self.t0:6.0f} s] {text}\n")
            self.stream.flush()

    def _beat(self):
        while not self._stop.wait(min(self.interval, 1.0)):
            if time.monotonic() - self.last >= self.interval and self.in_flight:
                self._line(f"config {self.done}/{self.total} done, {self.in_flight} running; {self._best()}")

    def _best(self) -> str:
        counts = ", ".join(f"{k} {v}" for k, v in self.counts.items() if v)
        best = f"best {fmt_bs(self.best)} {fmt_time(self.best['metric'])}" if self.best else "no ok config yet"
        return f"{best} ({counts or 'nothing finished'})"

    def _note(self, row, how: str):
        self.done += 1
        self.counts[row["status"]] = self.counts.get(row["status"], 0) + 1
        if row["status"] == "ok" and row.get("metric") is not None:
            if self.best is None or row["metric"] < self.best["metric"]:
                self.best = row
        t = fmt_time(row.get("metric")) if row["status"] == "ok" else str(row.get("message") or "")[:80]
        self._line(f"config {self.done}/{self.total} {fmt_bs(row)} {row['status']} {t}{how}; {self._best()}")

    def start(self, spec, plan, total):
        self.label = f"{spec.key.generation} {spec.key.case}"
        self.total = total
        self.t0 = time.monotonic()
        self._line(f"start: {total} configs to evaluate or resume")

    def resumed(self, row):
        self._note(row, " (recorded before)")

    def dispatched(self, bs):
        self.in_flight += 1

    def finished(self, row, outcome):
        self.in_flight = max(0, self.in_flight - 1)
        self._note(row, "")


class SweepProgress(Events):
    """Live progress: bar, ETA, counts per status, best so far."""

    def __init__(self):
        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                 MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("eta"),
                                 TimeRemainingColumn(), TextColumn("{task.fields[status]}"),
                                 console=err, transient=False)
        self.task = None
        self.counts: dict = {}
        self.best = None
        self.in_flight = 0

    def __enter__(self):
        self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        self.progress.__exit__(*exc)

    def _status(self) -> str:
        best = (f" | best {fmt_time(self.best['metric'])} {fmt_bs(self.best)}" if self.best else "")
        running = f" | running {self.in_flight}" if self.in_flight else ""
        return fmt_counts(self.counts) + best + running

    def _note(self, row):
        self.counts[row["status"]] = self.counts.get(row["status"], 0) + 1
        if row["status"] == "ok" and row.get("metric") is not None:
            if self.best is None or row["metric"] < self.best["metric"]:
                self.best = row

    def start(self, spec, plan, total):
        self.task = self.progress.add_task(f"{spec.key.generation} {spec.key.case}", total=max(total, 1),
                                           status="")

    def resumed(self, row):
        self._note(row)
        self.progress.update(self.task, advance=1, status=self._status())

    def dispatched(self, bs):
        self.in_flight += 1
        self.progress.update(self.task, status=self._status())

    def finished(self, row, outcome):
        self.in_flight = max(0, self.in_flight - 1)
        self._note(row)
        self.progress.update(self.task, advance=1, status=self._status())


def print_summary(o: Outcome, store, top: int = 10) -> None:
    spec = o.spec
    df = store.read()
    if not df.empty:
        from .workloads import workload_id
        d = df[(df["key_id"] == spec.key_id) & (df["workload_id"] == workload_id(spec.workload))
               & (df["backend"] == spec.backend)]
        d = d[d["kernel_hash"] == spec.tuned_kernel.config_version()]
        d = d.sort_values("timestamp").drop_duplicates("config_id", keep="last")
    else:
        d = df
    who = f"{spec.kernel}: "
    if spec.backend == "compile":
        from .coverage import compile_method
        how = compile_method(spec.key.generation, spec.key.case)     # estimate, or modelled
    else:
        how = "measured" if spec.backend == "tpu" else "correctness"
    cals = sorted({str(c) for c in d["calibration"].dropna()}) if len(d) and "calibration" in d else []
    cal = f"; calibration {', '.join(cals)}" if how != "correctness" and cals else ""
    t = Table(title=f"{who}{spec.key.generation} {spec.key.case} — {spec.backend} ({how})",
              caption=f"times: one call on one TensorCore{cal}")
    for c in ("rank", "(bq, bkv, cq, ckv)", "status", "time", "bound", "cycles", "VMEM limit", "compile", "note"):
        t.add_column(c, justify="right" if c in ("time", "cycles", "compile", "rank") else "left")
    ok = d[d["status"] == "ok"].sort_values("metric", na_position="last") if len(d) else d
    shown = 0
    for _, r in ok.iterrows():
        if shown >= top:
            break
        shown += 1
        t.add_row(str(shown), fmt_bs(r), "[green]ok[/]", fmt_time(r["metric"]), str(r["active_bound"] or "-"),
                  "-" if r["cycles"] is None or math.isnan(r["cycles"]) else f"{r['cycles']:,.0f}",
                  fmt_bytes(r["vmem_limit_bytes"]), fmt_time(r["compile_s"]),
                  "heuristic" if r["is_heuristic"] else "")
    bad = d[d["status"] != "ok"] if len(d) else d
    for _, r in bad.head(5).iterrows():
        t.add_row("-", fmt_bs(r), styled(r["status"], STATUS_STYLE.get(r["status"])), "-", "-", "-",
                  fmt_bytes(r["vmem_limit_bytes"]), fmt_time(r["compile_s"]), escape(str(r["message"] or "")[:60]))
    out.print(t)
    counts = {k: v for k, v in o.counts.items() if v}
    line = (f"{o.evaluated} evaluated, {o.resumed} already recorded; {fmt_counts(counts)}; "
            f"{o.elapsed_s:.0f} s; {o.stop_reason}")
    if o.search_note:
        line += f" ({o.search_note})"
    out.print(line)
    if o.best:
        msg = f"best {fmt_bs(o.best)} {fmt_time(o.best['metric'])}"
        h = o.heuristic_row
        if h and h.get("status") == "ok" and h.get("metric"):
            msg += f"; heuristic {fmt_bs(h)} {fmt_time(h['metric'])} -> x{h['metric'] / o.best['metric']:.2f}"
        out.print(msg)


def print_overall(outcomes) -> None:
    t = Table(title="all cases")
    for c in ("case", "best (bq, bkv, cq, ckv)", "time", "vs heuristic", "statuses"):
        t.add_column(c)
    for o in outcomes:
        b, h = o.best, o.heuristic_row
        gain = f"x{h['metric'] / b['metric']:.2f}" if b and h and h.get("metric") else "-"
        t.add_row(o.spec.key.case, fmt_bs(b) if b else "-", fmt_time(b["metric"]) if b else "-", gain,
                  fmt_counts({k: v for k, v in o.counts.items() if v}))
    out.print(t)


# ============================================================================= show
def fmt_audit(r) -> str:
    """A compile-backend row's audit verdict (device timings have none)."""
    a = (r or {}).get("audit")
    if not a:
        return "-"
    return a if a == "complete" else f"[bold red]{a}[/]"


def fmt_clock(r) -> str:
    """The clock that turned an estimate's cycles into time, and where it came from."""
    hz = (r or {}).get("clock_hz")
    if not hz or (isinstance(hz, float) and hz != hz):
        return "-"
    src = (r or {}).get("clock_source") or ""
    return f"{hz / 1e9:.3f} GHz" + (f" ({escape(src)})" if src else "")


def print_winners(groups, top: int = 1) -> None:
    cals = sorted({str(g.best.get("calibration")) for g in groups
                   if g.best and g.best.get("calibration") not in (None, "none")})
    t = Table(title="rpa-tune: best block sizes per key",
              caption="times: one call on one TensorCore" + (f"; calibration {', '.join(cals)}" if cals else ""))
    for c in ("kernel", "tpu", "case", "shape", "page", "tokens", "len", "workload", "backend", "best (bq, bkv, cq, ckv)",
              "time", "bound", "audit", "clock", "vs heuristic", "statuses"):
        t.add_column(c, overflow="fold")
    for g in groups:
        b = g.best
        gain = f"x{g.gain:.2f}" if g.gain else "-"
        be = g.backend + (f" ({b['method']})" if b and b.get("method") == "modelled" else "") + (
            " (stale kernel)" if g.stale else "")
        t.add_row(g.kernel, g.key["generation"], g.key["case"], shape_label(g.key), str(g.key["page_size"]),
                  str(g.key["max_num_tokens"]), str(g.key["max_model_len"]), escape(g.workload[:48]), be,
                  fmt_bs(b) if b else "[red]none ok[/]", fmt_time(b["metric"]) if b else "-",
                  (b.get("active_bound") or "-") if b else "-", fmt_audit(b), fmt_clock(b), gain,
                  fmt_counts(g.counts) + (f" · [bold red]{g.excluded_wrong} wrong excluded[/]" if g.excluded_wrong else ""))
    out.print(t)
    if top > 1:
        for g in groups:
            tt = Table(title=f"{g.key['generation']} {g.key['case']} {shape_label(g.key)} — top {top} ({g.backend})")
            for c in ("rank", "(bq, bkv, cq, ckv)", "time", "bound", "audit", "cycles", "VMEM limit", "note"):
                tt.add_column(c)
            for i, r in enumerate(g.rows):
                tt.add_row(str(i + 1), fmt_bs(r), fmt_time(r["metric"]), str(r.get("active_bound") or "-"), fmt_audit(r),
                           f"{r['cycles']:,.0f}" if r.get("cycles") else "-", fmt_bytes(r.get("vmem_limit_bytes")),
                           "heuristic" if r.get("is_heuristic") else "")
            out.print(tt)


def comparison_dict(c) -> dict:
    return dict(key=c.key, workload_id=c.workload_id, workload=c.workload, backend=c.backend, method=c.method,
                ratio=c.ratio, best={k: _brief(r) for k, r in c.best.items()},
                heuristic={k: _brief(r) for k, r in c.heuristic.items()})


def _brief(r) -> dict | None:
    if not r:
        return None
    return dict(block_sizes=[int(r[x]) for x in ("bq", "bkv", "cq", "ckv")], metric=r.get("metric"),
                active_bound=r.get("active_bound"), cycles=r.get("cycles"))


def print_comparison(rows) -> None:
    t = Table(title="rpa-tune compare: each kernel at its best, same workload and method "
                    "(compile: audited estimates; tpu: device times)")
    for c in ("tpu", "case", "shape", "page", "tokens", "len", "workload", "backend", f"{DEFAULT} best", "time",
              f"{REFERENCE} best", "time", "its default", f"{DEFAULT} / {REFERENCE}"):
        t.add_column(c, overflow="fold")
    for c in rows:
        a, b, h = c.best.get(DEFAULT), c.best.get(REFERENCE), c.heuristic.get(REFERENCE)
        t.add_row(c.key["generation"], c.key["case"], shape_label(c.key), str(c.key["page_size"]),
                  str(c.key["max_num_tokens"]), str(c.key["max_model_len"]), escape(c.workload[:40]), c.backend,
                  fmt_bs(a) if a else "[red]none ok[/]", fmt_time(a["metric"]) if a else "-",
                  fmt_bs(b) if b else "[red]none ok[/]", fmt_time(b["metric"]) if b else "-",
                  (f"{fmt_bs(h)} {fmt_time(h['metric'])}" if h and h.get("metric") else "-"),
                  f"{c.ratio:.2f}" if c.ratio else "-")
    out.print(t)


# =========================================================================== verify
class VerifyProgress:
    def __init__(self):
        self.progress = None
        self.task = None

    def start(self, total):
        self.progress = Progress(SpinnerColumn(), TextColumn("verify (interpret)"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=err)
        self.progress.start()
        self.task = self.progress.add_task("verify", total=max(total, 1))

    def advance(self, row):
        self.progress.update(self.task, advance=1)

    def stop(self):
        if self.progress is not None:
            self.progress.stop()


def print_verify(rows) -> None:
    t = Table(title="rpa-tune verify: chosen configs vs the reference (Pallas interpreter)")
    for c in ("tpu", "case", "shape", "(bq, bkv, cq, ckv)", "status", "detail"):
        t.add_column(c, overflow="fold")
    for r in rows:
        t.add_row(r["generation"], r["case"], shape_label(r), fmt_bs(r),
                  styled(r["status"], STATUS_STYLE.get(r["status"])), escape(str(r.get("message") or "")[:120]))
    out.print(t)


# =========================================================================== doctor
def print_doctor(rep: dict) -> None:
    t = Table(title="rpa-tune doctor", show_header=False)
    t.add_column("item")
    t.add_column("value", overflow="fold")
    for k, v in rep["versions"].items():
        t.add_row(k, escape(str(v or "not installed")))
    for k, v in rep["kernel"].items():
        t.add_row(k, str(v))
    for k, v in rep.get("kernels", {}).items():
        t.add_row(f"kernel {k}", escape(v))
    if not rep.get("tables"):
        t.add_row("tables", "none found ($RPA_TABLE unset and no shipped tables): the heuristic applies")
    for f in rep.get("tables", []):
        match = ("" if not f["loaded"] else "; all match this kernel" if f["matches_kernel"]
                 else " [yellow](used with a warning; RPA_TABLE_STRICT=1 refuses them)[/]")
        t.add_row("table", escape(f["path"]) + ": " + (escape(f["status"]) if f["loaded"]
                                                      else styled(f["status"], "red")) + match)
    d = rep["devices"]
    t.add_row("devices", f"{d.get('platform')} {d.get('device_kind') or ''} x{d.get('count')}"
              + ("" if d.get("probed") else " (no accelerator device nodes; not probed)"))
    for name, (state, detail) in rep["backends"].items():
        style = {"works": "green", "partly": "yellow", "unavailable": "dim", "fails": "red"}.get(state, "")
        t.add_row(f"backend {name}", styled(state, style) + ": " + escape(str(detail)))
    t.add_row("backend auto", rep["auto"])
    for k, v in rep["compilation_cache"].items():
        t.add_row(f"cache: {k}", escape(str(v)))
    out.print(t)


def print_presets(presets) -> None:
    t = Table(title="model presets (per-shard attention shapes)")
    for c in ("name", "q heads", "kv heads", "head_dim", "dtypes", "description"):
        t.add_column(c)
    for p in presets.values():
        t.add_row(p.name, str(p.num_q_heads), str(p.num_kv_heads), str(p.head_dim), f"{p.q_dtype}/{p.kv_dtype}",
                  p.description)
    out.print(t)


# ============================================================================ status
def status_dict(s) -> dict:
    """One study of ``rpa-tune status --json``."""
    b = s.best
    return dict(study=s.name, key_id=s.meta.get("key_id"), workload_id=s.meta.get("workload_id"),
                backend=s.meta.get("backend"), kernel=s.identity.get("kernel"),
                kernel_version=s.identity.get("kernel_version"), search=s.identity.get("search"),
                total=s.total, done=s.done, running=s.running, waiting=s.waiting, left=s.left,
                given_back=s.failed, counts=s.counts, workers=s.workers,
                best=None if not b else dict(block_sizes=_bs_list(b), metric=b.get("metric")))


def print_status(studies, where: str) -> None:
    """``rpa-tune status``: one row per study of a storage."""
    t = Table(title=f"rpa-tune studies in {escape(where)}")
    for c in ("study", "key / workload / backend", "done", "running", "left", "given back", "best so far",
              "workers"):
        t.add_column(c, justify="right" if c in ("done", "running", "left", "given back") else "left")
    for s in studies:
        m = s.meta
        b = s.best
        t.add_row(s.name, escape(f"{m.get('key_id')} / {m.get('workload_id')} / {m.get('backend')}"),
                  f"{s.done}/{s.total}", str(s.running), str(s.left), str(s.failed),
                  f"{fmt_bs(b)} {fmt_time(b['metric'])}" if b else "-",
                  f"{len(s.workers)}: " + ", ".join(s.workers))
    out.print(t)
