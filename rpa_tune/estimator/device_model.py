"""The device-cost model: the time a kernel call takes on the chip, from the static estimate and
what the kernel's own walk counts.

libtpu's static profiler prices the bundles it simulates. Held against the RPA paper's TPU7x
measurements of the public kernel (benchmarks/README.md, "Fidelity") it misses costs that do
not depend on the bytes or FLOPs: per call and per q block (pipeline fill and drain, the
metadata and semaphore work around each block). They dominate short contexts. The model
adds them back, and caps the static estimate by the rates the device reaches:

    time = max(static, hbm_bytes / (hbm_efficiency x HBM BW), mxu_flops / (mxu_efficiency x MXU peak))
           + t_call + t_qblock x qblocks

* ``static``: the profiler's cycles at the calibrated clock (``audit.time_model``'s
  ``estimate_s``): the price is then an ``estimate``. Where the profiler cannot price the
  program (it refuses it, or hides cached-KV work) there is no ``static`` and the price is
  ``modelled``: the rates and latencies alone.
* The MXU rate is the peak a contraction of ``head_dim`` can fill (the RPA paper's MFU
  definition, ``audit.max_mxu_utilization``: head_dim 128 fills half of a 256-wide MXU), so
  ``mxu_efficiency`` carries over between generations of 128- and 256-wide MXUs.
* ``hbm_bytes``: the bytes the config's walk moves (the paper's count plus any re-read of
  the cache, ``TunedKernel.walk``); ``mxu_flops``: the FLOPs the walk issues (every computed
  ``ckv`` chunk of every q block, masked parts included; decode: the visible pairs).
* ``qblocks``: q blocks of the walk (the public kernel's decode: one per sequence; ours: one
  per group of ``bq`` sequences).
* Bandwidth and peak are one TensorCore's (``kernel.hardware.tpu_info``). Every time is one
  kernel call on one TensorCore: on a chip with two (TPU7x, v5p, v4) a server that shards
  heads over the cores runs one call per core at once, so the chip's time for the whole
  model is the core's time for its half of the heads.

A KV-step latency (``t_step``) was tried: fitted on the paper's rows it is zero, so the model
does not carry it (benchmarks/README.md, "Fidelity"). The constants are fitted by
``fit`` (least squares on relative error) to measured rows and checked by ``leave_one_out``;
a fitted set is a ``DeviceCalibration`` with a version, stored as package data
(``rpa_tune/data/device_calibration.json``) and written by ``rpa-tune calibrate``.
"""
from __future__ import annotations

import dataclasses
import importlib.resources
import json
import os

import numpy as np

from kernel.config import BlockSizes, Case, round_up

CONSTANTS = ("hbm_efficiency", "mxu_efficiency", "t_call_s", "t_qblock_s")
MEANING = {
    "hbm_efficiency": "share of one core's HBM bandwidth a long KV walk reaches",
    "mxu_efficiency": "share of one core's bf16 MXU peak, at the share a head_dim-deep contraction fills, "
                      "that a long causal walk's issued FLOPs reach",
    "t_call_s": "per kernel call: launch, prologue (first fetches), epilogue (last write-back)",
    "t_qblock_s": "per q block: pipeline fill and drain, metadata and semaphore work around it",
}
BOUNDS = {"hbm_efficiency": (0.3, 1.0), "mxu_efficiency": (0.05, 1.0), "t_call_s": (0.0, 1e-3),
          "t_qblock_s": (0.0, 1e-4)}
DATA_FILE = "device_calibration.json"
ENV = "RPA_TUNE_DEVICE_CALIBRATION"      # a calibration file used in place of the package's
ESTIMATE, MODELLED, MEASURED = "estimate", "modelled", "measured"


# ----------------------------------------------------------------------------- features
@dataclasses.dataclass(frozen=True)
class Features:
    """What one call's walk does, counted from the kernel's own step enumeration."""
    qblocks: int
    steps: int
    pages: int
    hbm_bytes: float
    mxu_flops: float
    head_dim: int = 128         # the contraction depth the MXU rate is taken at

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def features(kernel, workload, model, case, bs: BlockSizes, page_size: int, generation: str,
             sliding_window: int | None = None) -> Features:
    """``Features`` of ``kernel`` (a ``TunedKernel``) running ``workload``'s ``case`` at ``bs``.
    The walk is the one the estimator composes with (``compose.pipeline_steps`` for decode,
    ``kernel.steps.plan`` otherwise), as the kernel's probe plan configures it."""
    from kernel.steps import features as step_features
    from . import audit
    from .compose import pipeline_steps
    case = Case.parse(case)
    bs = BlockSizes(*bs)
    plan = kernel.probe_plan(case, bs, generation, model, page_size)
    lo, hi = workload.case_range(case)
    need = audit.needed(workload, model, case, sliding_window=sliding_window)
    walk = kernel.walk(workload, model, case, bs, page_size, sliding_window=sliding_window)
    paper_read = need.kv_read_bytes * model.head_dim // round_up(model.head_dim, 128)
    hbm = need.hbm_bytes + max(0, (walk or 0) - paper_read)
    if case == Case.DECODE:
        steps = pipeline_steps(bs, page_size, workload.kv_lens[lo:hi], sliding_window, plan.walk_new)
        return Features(sum(1 for s in steps if s[2]), len(steps), sum(s[0] for s in steps), float(hbm),
                        float(need.flops), model.head_dim)
    f = step_features(case, bs, page_size, workload.q_lens[lo:hi], workload.kv_lens[lo:hi], sliding_window,
                      plan.skip_dead_chunks)
    flops = 4.0 * f["chunk"] * bs.bq * bs.ckv * model.head_dim * model.num_q_heads
    return Features(f["qblock"], f["step"], f["page_cached"] + f["page_new"], float(hbm), max(flops, need.flops),
                    model.head_dim)


# --------------------------------------------------------------------------- calibration
@dataclasses.dataclass(frozen=True)
class DeviceCalibration:
    version: str                   # named by every row priced with it
    generation: str                # the generation it was fitted on
    constants: dict                # CONSTANTS -> value
    source: str = ""               # what it was fitted to
    fitted_rows: int = 0
    leave_one_out: dict = dataclasses.field(default_factory=dict)   # row name -> relative error
    fit_residuals: dict = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "DeviceCalibration":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def _data(path: str | None = None) -> dict:
    path = path or os.environ.get(ENV)
    if path:
        with open(path) as f:
            return json.load(f)
    return json.loads(importlib.resources.files("rpa_tune.data").joinpath(DATA_FILE).read_text())


def calibrations() -> dict[str, DeviceCalibration]:
    """Generation -> its calibration (the package's, or ``$RPA_TUNE_DEVICE_CALIBRATION``'s)."""
    d = _data()
    return {g: DeviceCalibration.from_json(c) for g, c in d.get("generations", {}).items()}


def calibration_for(generation: str) -> tuple[DeviceCalibration | None, str]:
    """(calibration, the version a row names) for ``generation``: its own, else the one of
    ``transfer_from`` (the generations without device measurements use TPU7x's constants:
    latencies in seconds and efficiencies as fractions of the generation's own rates), the
    version then says so (``tpu7x-paper-1@v6e``). A user's calibration of the generation
    (``rpa-tune calibrate``: ``calibrations/<generation>.json`` in ``rpa_tune.user_cache_dir``)
    comes before the package's; ``$RPA_TUNE_DEVICE_CALIBRATION`` before both."""
    if not os.environ.get(ENV):
        from rpa_tune import user_cache_dir
        user = os.path.join(user_cache_dir("calibrations"), f"{generation}.json")
        if os.path.exists(user):
            try:
                cal = DeviceCalibration.from_json(_data(user)["generations"][generation])
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{user}: not a calibration of {generation} ({type(e).__name__}: {e}); "
                                 "run rpa-tune calibrate again or remove it") from None
            return cal, cal.version
    cals = calibrations()
    if generation in cals:
        return cals[generation], cals[generation].version
    src = _data().get("transfer_from")
    if src in cals:
        return cals[src], f"{cals[src].version}@{generation}"
    return None, "none"


def write(cal: DeviceCalibration, path: str | None = None) -> str:
    """Add or replace ``cal`` for its generation in the calibration file (the package's by
    default); returns the path."""
    if path is None:
        path = str(importlib.resources.files("rpa_tune.data").joinpath(DATA_FILE))
    try:
        with open(path) as f:
            d = json.load(f)
    except FileNotFoundError:
        d = {"about": "device-cost model constants; rpa_tune/estimator/device_model.py", "transfer_from": cal.generation,
             "generations": {}}
    d.setdefault("generations", {})[cal.generation] = cal.to_json()
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(d, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
    return path


# --------------------------------------------------------------------------------- price
def rates(generation: str, head_dim: int = 128) -> tuple[float, float]:
    """(HBM bytes/s, bf16 FLOP/s a head_dim-deep contraction can reach) of one TensorCore."""
    from kernel.hardware import tpu_info
    info = tpu_info(generation)
    fill = min(1.0, head_dim / int(info.mxu_column_size))
    return float(info.mem_bw_bytes_per_second), float(info.bf16_ops_per_second) * fill


def device_time(static_s: float | None, feats: Features, generation: str, constants: dict) -> dict:
    """The modelled device time of one call on one core (module doc), with its terms."""
    bw, peak = rates(generation, feats.head_dim)
    c = constants
    hbm_s = feats.hbm_bytes / (c["hbm_efficiency"] * bw)
    mxu_s = feats.mxu_flops / (c["mxu_efficiency"] * peak)
    core = max(static_s or 0.0, hbm_s, mxu_s)
    bound = ("static" if static_s and core == static_s else "hbm" if core == hbm_s else "mxu")
    fixed = c["t_call_s"] + c["t_qblock_s"] * feats.qblocks
    return dict(time_s=core + fixed, core_s=core, fixed_s=fixed, device_bound=bound,
                label=MODELLED if static_s is None else ESTIMATE)


def price(static_s: float | None, feats: Features, generation: str) -> dict:
    """``device_time`` under the generation's shipped calibration, with its version; without
    one, the static estimate unchanged (``calibration`` "none")."""
    cal, version = calibration_for(generation)
    if cal is None:
        if static_s is None:
            return dict(time_s=None, label=MODELLED, calibration="none", core_s=None, fixed_s=0.0,
                        device_bound=None)
        return dict(time_s=static_s, core_s=static_s, fixed_s=0.0, device_bound="static", label=ESTIMATE,
                    calibration="none")
    return dict(device_time(static_s, feats, generation, cal.constants), calibration=version)


def time_model(cycles: float, workload, model, generation: str, case=None, *, sliding_window: int | None,
               walk: int | None = None, features: Features | None = None) -> dict:
    """``audit.time_model`` (the static time, its bounds, MBU / MFU, the rate check) with the
    device-cost model over it when ``features`` are given: ``time_s`` is then ``price``'s,
    ``static_s`` the static time, ``calibration`` the version, and MBU / MFU against the
    device time."""
    from . import audit
    t = audit.time_model(cycles, workload, model, generation, case, sliding_window=sliding_window, walk=walk)
    if features is None:
        return t
    d = price(t["estimate_s"], features, generation)
    if d["time_s"] is None:
        return t
    scale = t["time_s"] / d["time_s"] if d["time_s"] else 0.0
    return dict(t, time_s=d["time_s"], calibration=d["calibration"], device_bound=d["device_bound"],
                fixed_s=d["fixed_s"], mbu=t["mbu"] * scale, mfu=t["mfu"] * scale, mfu_of_peak=t["mfu_of_peak"] * scale)


# ----------------------------------------------------------------------------------- fit
@dataclasses.dataclass(frozen=True)
class Row:
    """One measured call: its name, generation, measured seconds (one call, one core),
    static estimate (None: modelled) and features."""
    name: str
    generation: str
    measured_s: float
    static_s: float | None
    feats: Features


def fit(rows: list[Row]) -> dict:
    """Constants minimising the squared relative error over ``rows`` (within ``BOUNDS``)."""
    from scipy.optimize import least_squares
    lo = np.array([BOUNDS[k][0] for k in CONSTANTS])
    hi = np.array([BOUNDS[k][1] for k in CONSTANTS])
    scale = np.array([1.0, 1.0, 1e-5, 1e-6])

    def resid(x):
        c = dict(zip(CONSTANTS, x * scale))
        return np.array([device_time(r.static_s, r.feats, r.generation, c)["time_s"] / r.measured_s - 1.0
                         for r in rows])
    best = None
    for x0 in ([0.9, 0.3, 0.5, 0.3], [0.95, 0.4, 1.0, 1.0], [0.8, 0.2, 0.1, 0.1]):
        r = least_squares(resid, np.clip(np.array(x0), lo / scale, hi / scale), bounds=(lo / scale, hi / scale))
        if best is None or r.cost < best.cost:
            best = r
    return {k: float(v) for k, v in zip(CONSTANTS, best.x * scale)}


def errors(rows: list[Row], constants: dict) -> dict:
    """Row name -> predicted / measured - 1."""
    return {r.name: device_time(r.static_s, r.feats, r.generation, constants)["time_s"] / r.measured_s - 1.0
            for r in rows}


def leave_one_out(rows: list[Row]) -> dict:
    """Row name -> relative error of the row predicted by constants fitted without it."""
    out = {}
    for i, r in enumerate(rows):
        c = fit(rows[:i] + rows[i + 1:])
        out[r.name] = errors([r], c)[r.name]
    return out


def calibrate(rows: list[Row], version: str, source: str) -> DeviceCalibration:
    """Fit, check by leave-one-out, and return the calibration of ``rows``' generation."""
    gens = {r.generation for r in rows}
    if len(gens) != 1:
        raise ValueError(f"rows of several generations {sorted(gens)}: calibrate one at a time")
    c = fit(rows)
    return DeviceCalibration(version, gens.pop(), c, source, len(rows),
                             {k: round(v, 4) for k, v in leave_one_out(rows).items()},
                             {k: round(v, 4) for k, v in errors(rows, c).items()})


def adjacent_ratio_errors(rows: list[Row], predicted: dict) -> dict:
    """Per pair of consecutive rows of one series (names ``series/x``): the predicted ratio of
    their times over the measured ratio, minus 1. ``predicted``: row name -> seconds."""
    out = {}
    for a, b in zip(rows, rows[1:]):
        if a.name.split("/")[0] != b.name.split("/")[0]:
            continue
        out[f"{a.name}->{b.name.split('/')[-1]}"] = ((predicted[b.name] / predicted[a.name])
                                                    / (b.measured_s / a.measured_s) - 1.0)
    return out
