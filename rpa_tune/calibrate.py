"""``rpa-tune calibrate``: fit the device-cost model (``rpa_tune.estimator.device_model``) of one
TPU generation to device times, and write the calibration the compile backend then prices
that generation with.

On a TPU (``--backend tpu``) a fixed probe set is timed on the device by the ``tpu``
backend (``rpa_tune.evaluators.tpu``: its device call, its check against the reference,
its profiler-trace timing), each probe in the one TPU worker process (``rpa_tune.pool``):

* decode: ``DECODE_SEQS`` sequences of one new token, every one at a context of
  ``DECODE_CONTEXTS`` (512 ... 32K);
* causal prefill: one sequence of ``PREFILL_CONTEXTS`` tokens (512 ... 8K), no cached KV;
* both kernels (the public RPA v3, ``tpu-inference``, and ours, ``rpa-tune``), each at its
  own heuristic block sizes for the probe's key (never a table's), page ``PAGE``;
* Llama-3-8B's attention sharded for one TensorCore (``shard``): 32 q / 8 KV heads on a
  chip with one core, 16 / 4 on a chip with two (TPU7x, v5p, v4), head_dim 128, bf16.

Each probe also gets its static estimate from the compile backend (its audited probe
compiles, ``estimator.compose.probe_config``, and ``audit.time_model``'s ``estimate_s``), in
a compile worker process; where the profiler cannot price it (the compile fails, or the
audit finds work missing) the row has none and is fitted as ``modelled``. Its features are
``device_model.features``. ``device_model.calibrate`` fits the constants and checks them by
leave-one-out.

``--from-fixture FILE`` fits recorded rows instead (no device; what CI runs): the RPA
paper's TPU7x rows (``rpa_tune/data/paper_tpu7x_rpa_v3.json``), or the rows a device run
wrote beside its calibration (``<generation>.rows.json``). The format (``load_fixture``)::

    {"source": str, "generation": str, "kernel": str, "page_size": int,
     "model": {"num_q_heads", "num_kv_heads", "head_dim"},
     "rows": [{"name": "decode/512", "case": "decode", "kernel": (optional, else the file's),
               "seqs": int, "q_lens": [int], "kv_lens": [int] (seqs copies of one pair; or the lists
               of every sequence without seqs), "block_sizes": [bq, bkv, cq, ckv],
               "measured_s": float, "static_s": float | null, "fitted": bool (optional, default
               true: a row marked false is reported as left out, not fitted)}]}

Where it is written: a device run writes ``calibrations/<generation>.json`` in the user cache
(``rpa_tune.user_cache_dir``; ``--out`` elsewhere), which ``device_model.calibration_for``
uses for that generation before the package's; ``--write`` adds it to the package data
(``device_model.write``). Versions are ``<generation>-device-<n>`` (``-fixture-<n>`` for a
fixture), ``n`` one past the highest of that generation's already written.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys

from kernel.config import BlockSizes, Case, TuningKey, get_generation
from kernel.workload import ModelShape, ServingLimits, Workload

from .estimator import device_model
from .kernels import DEFAULT, REFERENCE

PAGE = 256
DECODE_SEQS = 128
DECODE_CONTEXTS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
PREFILL_CONTEXTS = (512, 1024, 2048, 4096, 8192)
KERNELS = (REFERENCE, DEFAULT)                 # the public kernel, ours
LLAMA3_8B = (32, 8, 128)                       # q heads, KV heads, head_dim of the whole model
TWO_CORES = ("v4", "v5p", "tpu7x")             # chips with two TensorCores
MIN_ROWS = len(device_model.CONSTANTS) + 2     # fewer timed rows cannot be checked by leave-one-out
DEVICE_TIMEOUT_S, COMPILE_TIMEOUT_S = 900.0, 3600.0


class CalibrateError(ValueError):
    """Bad input to calibrate (one line for the CLI)."""


# ------------------------------------------------------------------------------ probes
@dataclasses.dataclass(frozen=True)
class Probe:
    """One timed call: a kernel at its heuristic block sizes on one probe workload."""
    name: str                  # "<kernel>:<case>/<context>" (a series per kernel and case)
    kernel: str
    case: str
    generation: str
    model: ModelShape
    limits: ServingLimits
    workload: Workload
    bs: BlockSizes

    def task(self, backend: str, timeout: float):
        from .evaluators.base import Task
        return Task(backend=backend, generation=self.generation, case=self.case, model=self.model,
                    limits=self.limits, workload=self.workload, bs=self.bs, timeout=timeout, kernel=self.kernel,
                    heuristic=True)


def shard(generation: str) -> ModelShape:
    """Llama-3-8B's attention on one TensorCore: the heads split over the chip's cores."""
    q, kv, hd = LLAMA3_8B
    n = 2 if get_generation(generation).name in TWO_CORES else 1
    return ModelShape(q // n, kv // n, hd)


def probe_set(generation: str, kernels=KERNELS, *, seqs: int = DECODE_SEQS, decode=DECODE_CONTEXTS,
              prefill=PREFILL_CONTEXTS, model: ModelShape | None = None,
              page_size: int = PAGE) -> tuple[list[Probe], list[tuple[str, str]]]:
    """The probes of ``generation`` (module doc) and those left out (name, why: the kernel
    has no block sizes for the key)."""
    from .kernels import get_kernel
    gen = get_generation(generation).name
    model = model or shard(gen)
    out, skipped = [], []
    for kn in kernels:
        kern = get_kernel(kn)
        for case, contexts in ((Case.DECODE.value, decode), (Case.PREFILL.value, prefill)):
            for ctx in contexts:
                n, q = (seqs, 1) if case == Case.DECODE.value else (1, ctx)
                tokens = n * q
                key = TuningKey(gen, case, model.q_dtype, model.kv_dtype, model.num_q_heads, model.num_kv_heads,
                                model.head_dim, page_size, tokens, ctx)
                name = f"{kn}:{case}/{ctx}"
                bs = kern.heuristic(key, max_num_seqs=max(n, 1))
                if bs is None:
                    skipped.append((name, "the kernel has no block sizes for this key"))
                    continue
                out.append(Probe(name, kn, case, gen, model,
                                 ServingLimits(page_size, tokens, max(n, 1), ctx),
                                 Workload.of_case(case, [q] * n, [ctx] * n), BlockSizes(*bs)))
    return out, skipped


def probe_features(p: Probe) -> device_model.Features:
    from .kernels import get_kernel
    return device_model.features(get_kernel(p.kernel), p.workload, p.model, p.case, p.bs, p.limits.page_size,
                                 p.generation)


# ------------------------------------------------------------------- device and compiler
def _evaluate(backend: str, probes: list[Probe], timeout: float, progress) -> dict:
    """Probe name -> ``EvalResult`` of ``backend`` (one worker process, one probe at a time)."""
    from .pool import WorkerPool
    out = {}
    with WorkerPool(backend, 1) as pool:
        for i, p in enumerate(probes):
            pool.submit(p.task(backend, timeout), p.name)
            done = []
            while not done and pool.busy:
                done = pool.wait()
            for name, _task, res, secs in done:
                out[name] = res
                progress(f"{backend} {i + 1}/{len(probes)} {name} {p.bs.label()}: {res.status}"
                         + (f" {res.metric * 1e6:,.1f} us" if res.status == "ok" and res.metric else "")
                         + f" ({secs:.0f} s)")
    return out


def device_times(probes: list[Probe], progress=lambda s: None) -> dict:
    """Probe name -> ``(seconds, why)`` timed on the device by the ``tpu`` backend (seconds
    None when it was not timed: ``why`` says so)."""
    res = _evaluate("tpu", probes, DEVICE_TIMEOUT_S, progress)
    return {n: ((r.metric, r.message) if r.status == "ok" and r.metric else
                (None, f"{r.status}: {_one_line(r.message)}")) for n, r in res.items()}


def static_estimates(probes: list[Probe], progress=lambda s: None) -> dict:
    """Probe name -> ``(static seconds, why)`` from the compile backend: the profiler's
    cycles at the calibrated clock (``estimate_s``); None (the row is ``modelled``) where
    the config does not compile deviceless or the profiler misses work (audit incomplete)."""
    res = _evaluate("compile", probes, COMPILE_TIMEOUT_S, progress)
    out = {}
    for n, r in res.items():
        if r.status != "ok" or r.estimate_s is None:
            out[n] = (None, f"no static estimate: {r.status}: {_one_line(r.message)}")
        elif r.audit != "complete":
            out[n] = (None, f"no static estimate: audit {r.audit}: {_one_line(r.message)}")
        else:
            out[n] = (float(r.estimate_s), "")
    return out


def _one_line(msg, n: int = 200) -> str:
    s = " ".join(str(msg or "").split())
    return s if len(s) <= n else s[:n - 3] + "..."


# ----------------------------------------------------------------------------- rows
@dataclasses.dataclass
class Measured:
    """A row to fit, with what the report says of it."""
    row: device_model.Row
    kernel: str
    case: str
    bs: BlockSizes
    workload: dict           # the fixture's fields (``_workload_json``)
    note: str = ""
    fitted: bool = True      # False: reported, priced under the fitted constants, not fitted


def _workload_json(w: Workload) -> dict:
    """The fixture's workload fields: ``seqs`` copies of one ``q_lens`` / ``kv_lens`` pair, or
    the lists."""
    if len(set(w.q_lens)) == 1 and len(set(w.kv_lens)) == 1:
        return dict(seqs=len(w.q_lens), q_lens=[w.q_lens[0]], kv_lens=[w.kv_lens[0]])
    return dict(q_lens=list(w.q_lens), kv_lens=list(w.kv_lens))


def device_rows(probes: list[Probe], timed: dict, static: dict) -> tuple[list[Measured], list[tuple[str, str]]]:
    """The timed probes as rows to fit, and those left out (name, why)."""
    rows, left = [], []
    for p in probes:
        t, why = timed.get(p.name, (None, "not timed"))
        if t is None:
            left.append((p.name, why))
            continue
        s, swhy = static.get(p.name, (None, "no static estimate"))
        rows.append(Measured(device_model.Row(p.name, p.generation, float(t), s, probe_features(p)), p.kernel,
                             p.case, p.bs, _workload_json(p.workload), swhy))
    return rows, left


def measure_on_device(generation: str, kernels=KERNELS, *, probes: list[Probe] | None = None, timer=None,
                      static=None, progress=lambda s: None) -> tuple[list[Measured], list[tuple[str, str]]]:
    """Time the probe set (``probe_set`` unless ``probes``) on the device (``timer``, default
    ``device_times``), get the timed ones' static estimates (``static``, default
    ``static_estimates``): the rows to fit and the probes left out (name, why)."""
    skipped = []
    if probes is None:
        probes, skipped = probe_set(generation, kernels)
    timed = (timer or device_times)(probes, progress)
    ok = [p for p in probes if timed.get(p.name, (None,))[0] is not None]
    est = (static or static_estimates)(ok, progress) if ok else {}
    rows, left = device_rows(probes, timed, est)
    return rows, skipped + left


def fixture_json(rows: list[Measured], generation: str, model: ModelShape, source: str) -> dict:
    """Measured rows in the fixture format (``load_fixture`` reads them back)."""
    return dict(source=source, generation=generation, page_size=PAGE,
                model=dict(num_q_heads=model.num_q_heads, num_kv_heads=model.num_kv_heads, head_dim=model.head_dim),
                kernel=rows[0].kernel if rows else DEFAULT,
                rows=[dict(name=m.row.name, case=m.case, kernel=m.kernel, **m.workload, block_sizes=list(m.bs),
                           measured_s=m.row.measured_s, static_s=m.row.static_s, static_how=m.note,
                           fitted=m.fitted) for m in rows])


def _fixture_workload(r: dict, where: str) -> Workload:
    case = r["case"]
    spec = r.get("workload")
    if spec is None and isinstance(r.get("q_lens"), dict):
        spec = r["q_lens"]
    if spec is not None:
        n = int(spec["seqs"])
        return Workload.of_case(case, [int(spec["q_len"])] * n, [int(spec["kv_len"])] * n)
    if "q_lens" not in r or "kv_lens" not in r:
        raise CalibrateError(f"{where}: no workload (give q_lens and kv_lens, with seqs for copies of one pair)")
    q, kv = [int(x) for x in r["q_lens"]], [int(x) for x in r["kv_lens"]]
    n = int(r.get("seqs") or len(q))
    if len(q) == len(kv) == 1:
        q, kv = q * n, kv * n
    if not len(q) == len(kv) == n:
        raise CalibrateError(f"{where}: {len(q)} q_lens, {len(kv)} kv_lens for {n} sequences")
    return Workload.of_case(case, q, kv)


def load_fixture(path: str) -> tuple[str, str, list[Measured]]:
    """``(generation, source, rows)`` of a fixture file (module doc); ``CalibrateError`` naming
    the file and what is wrong with it."""
    from .kernels import get_kernel, kernel_names
    try:
        with open(path) as f:
            fx = json.load(f)
    except FileNotFoundError:
        raise CalibrateError(f"--from-fixture {path!r}: no such file") from None
    except (OSError, ValueError) as e:
        raise CalibrateError(f"--from-fixture {path!r}: not a JSON file ({_one_line(e, 120)})") from None
    try:
        gen = get_generation(fx["generation"]).name
        model = ModelShape(**{k: fx["model"][k] for k in ("num_q_heads", "num_kv_heads", "head_dim")})
        page = int(fx["page_size"])
        rows = []
        for i, r in enumerate(fx["rows"]):
            where = f"{path}: row {i} ({r.get('name', '?')})"
            kn = r.get("kernel") or fx["kernel"]
            if kn not in kernel_names():
                raise CalibrateError(f"{where}: unknown kernel {kn!r}; valid: {', '.join(kernel_names())}")
            case = Case.parse(r["case"]).value
            w = _fixture_workload(dict(r, case=case), where)
            bs = BlockSizes(*[int(x) for x in r["block_sizes"]])
            measured = float(r["measured_s"])
            if not (math.isfinite(measured) and measured > 0):
                raise CalibrateError(f"{where}: measured_s {r['measured_s']!r} is not a positive time")
            static = r.get("static_s")
            static = None if static is None else float(static)
            feats = device_model.features(get_kernel(kn), w, model, case, bs, page, gen)
            name = r.get("name") or f"{case}/{max(w.kv_lens)}"
            rows.append(Measured(device_model.Row(name, gen, measured, static, feats), kn, case, bs,
                                 _workload_json(w), str(r.get("static_how") or ""),
                                 fitted=bool(r.get("fitted", True))))
    except CalibrateError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise CalibrateError(f"--from-fixture {path!r}: not a calibration fixture ({type(e).__name__}: "
                             f"{_one_line(e, 120)}); format in rpa_tune/calibrate.py") from None
    if len({m.row.name for m in rows}) != len(rows):
        raise CalibrateError(f"--from-fixture {path!r}: row names repeat")
    return gen, f"{fx.get('source') or 'recorded rows'} ({os.path.basename(path)})", rows


# ----------------------------------------------------------------------------- fit
def user_calibration_path(generation: str) -> str:
    """Where a device run writes the generation's calibration (``calibration_for`` reads it)."""
    from . import user_cache_dir
    return os.path.join(user_cache_dir("calibrations"), f"{get_generation(generation).name}.json")


def _package_path() -> str:
    import importlib.resources
    return str(importlib.resources.files("rpa_tune.data").joinpath(device_model.DATA_FILE))


def next_version(generation: str, tag: str, paths=()) -> str:
    """``<generation>-<tag>-<n>``: one past the highest ``n`` of that generation and tag
    among the calibration files ``paths`` (those missing or unreadable count as none)."""
    pat = re.compile(rf"^{re.escape(generation)}-{re.escape(tag)}-(\d+)$")
    seen = [0]
    for p in paths:
        try:
            with open(p) as f:
                gens = json.load(f).get("generations", {})
        except (OSError, ValueError, AttributeError):
            continue
        for c in gens.values() if isinstance(gens, dict) else ():
            m = pat.match(str((c or {}).get("version", "")))
            if m:
                seen.append(int(m.group(1)))
    return f"{generation}-{tag}-{max(seen) + 1}"


def known_paths(generation: str, out: str | None = None) -> list[str]:
    """Every calibration file a version could already be in."""
    paths = [_package_path(), user_calibration_path(generation)]
    if os.environ.get(device_model.ENV):
        paths.append(os.environ[device_model.ENV])
    if out:
        paths.append(out)
    return paths


@dataclasses.dataclass
class Report:
    calibration: device_model.DeviceCalibration
    rows: list[Measured]
    predicted: dict          # row name -> device_time dict under the fitted constants
    ratios: dict             # "a->b" -> predicted ratio / measured ratio - 1
    left_out: list           # (name, why) of probes not fitted

    def to_json(self) -> dict:
        return dict(calibration=self.calibration.to_json(), left_out=[list(x) for x in self.left_out],
                    adjacent_ratio_errors={k: round(v, 4) for k, v in self.ratios.items()},
                    rows=[dict(name=m.row.name, kernel=m.kernel, case=m.case, block_sizes=list(m.bs),
                               measured_s=m.row.measured_s, static_s=m.row.static_s,
                               fitted_s=self.predicted[m.row.name]["time_s"],
                               label=self.predicted[m.row.name]["label"],
                               bound=self.predicted[m.row.name]["device_bound"],
                               fitted=m.fitted,
                               fit_error=self.predicted[m.row.name]["time_s"] / m.row.measured_s - 1.0,
                               leave_one_out_error=self.calibration.leave_one_out.get(m.row.name), note=m.note)
                          for m in self.rows])


def fit_rows(rows: list[Measured], version: str, source: str, left_out=()) -> Report:
    """Fit ``rows`` (those ``fitted``; ``device_model.calibrate``) and price each under the
    fitted constants."""
    fit = [m.row for m in rows if m.fitted]
    if len(fit) < MIN_ROWS:
        raise CalibrateError(f"{len(fit)} measured rows to fit: at least {MIN_ROWS} are needed to fit "
                             f"{len(device_model.CONSTANTS)} constants and check them by leave-one-out")
    cal = device_model.calibrate(fit, version, source)
    pred = {m.row.name: device_model.device_time(m.row.static_s, m.row.feats, m.row.generation, cal.constants)
            for m in rows}
    ratios = device_model.adjacent_ratio_errors([m.row for m in rows], {k: v["time_s"] for k, v in pred.items()})
    return Report(cal, rows, pred, ratios, list(left_out))


def write_files(report: Report, *, out: str | None, package: bool, rows_json: dict | None) -> list[str]:
    """Write the calibration to ``out`` (and the rows it was fitted to beside it,
    ``<out>.rows.json`` without ``.json``) and, with ``package``, to the package data."""
    written = []
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        written.append(device_model.write(report.calibration, out))
        if rows_json is not None:
            rp = rows_path(out)
            tmp = rp + ".tmp"
            with open(tmp, "w") as f:
                json.dump(rows_json, f, indent=1)
                f.write("\n")
            os.replace(tmp, rp)
            written.append(rp)
    if package:
        written.append(device_model.write(report.calibration))
    return written


def rows_path(out: str) -> str:
    return (out[:-5] if out.endswith(".json") else out) + ".rows.json"


# ----------------------------------------------------------------------------- report
def _us(v) -> str:
    return "-" if v is None else f"{v * 1e6:,.1f}"


def _pct(v) -> str:
    return "-" if v is None else f"{v:+.1%}"


def print_report(rep: Report, console) -> None:
    from rich.table import Table
    cal = rep.calibration
    t = Table(title=f"device-cost model {cal.version} ({cal.generation}; fitted to {cal.fitted_rows} rows: "
                    f"{cal.source})")
    for c in ("constant", "value", "meaning"):
        t.add_column(c, justify="right" if c == "value" else "left")
    for k in device_model.CONSTANTS:
        v = cal.constants[k]
        t.add_row(k, f"{v * 1e6:.3f} us" if k.endswith("_s") else f"{v:.3f}", device_model.MEANING[k])
    console.print(t)
    t = Table(title="rows: one call on one TensorCore (estimate: over the static estimate; modelled: "
                    "rates and latencies alone)")
    for c in ("row", "block sizes", "label", "static (us)", "measured (us)", "fitted (us)", "bound",
              "fit error", "leave-one-out", "ratio to row before"):
        t.add_column(c, justify="left" if c in ("row", "block sizes", "label", "bound") else "right")
    ratio_of = {k.rsplit("->", 1)[0]: v for k, v in rep.ratios.items()}
    names = [m.row.name for m in rep.rows]
    for i, m in enumerate(rep.rows):
        p = rep.predicted[m.row.name]
        ratio = ratio_of.get(names[i - 1]) if i else None
        t.add_row(m.row.name, m.bs.label(), p["label"], _us(m.row.static_s), _us(m.row.measured_s),
                  _us(p["time_s"]), p["device_bound"], _pct(p["time_s"] / m.row.measured_s - 1.0),
                  _pct(cal.leave_one_out.get(m.row.name)) if m.fitted else "not fitted", _pct(ratio))
    console.print(t)
    loo = [abs(v) for v in cal.leave_one_out.values()]
    rat = [abs(v) for v in rep.ratios.values()]
    console.print(f"leave-one-out: largest |error| {max(loo):.1%} over {len(loo)} rows; adjacent-row ratios: "
                  f"largest |error| {max(rat) if rat else 0:.1%} over {len(rat)} pairs")
    for m in rep.rows:
        if not m.fitted:
            console.print(f"not fitted (the fixture marks it so): {m.row.name}" + (f": {m.note}" if m.note else ""))
    for name, why in rep.left_out:
        console.print(f"not timed: {name}: {why}")


def log(msg: str) -> None:
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()
