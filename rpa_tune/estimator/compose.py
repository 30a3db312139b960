"""A config's cost for any workload, from a few small probe compiles.

libtpu's static profiler simulates what it compiles, so its time and memory grow with the
workload (a full 128 x 2K decode on v6e: 56 s and 3.9 GB; prefill chunks more). The kernel's
cost is, up to pipeline fill at the ends, a sum over what it walks: a fixed cost per call,
per sequence, per q block, per KV step (from the cache or from the new tokens), per page
DMA and per ``ckv`` chunk computed (``kernel.steps.features``). So per config we compile a
handful of small *probe* workloads, each a real program of the kernel (the same code path
as serving: one pipeline across all sequences), fit those per-item costs by least squares
(the probes are chosen so that their differences isolate each item: pipeline fill cancels
in the differences), and price any workload by counting its items. The same probes price
every workload and token bucket of a key. ``benchmarks/README.md`` has the check against
full compiles.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from kernel.config import BlockSizes, Case
from kernel.steps import FEATURES, features
from kernel.workload import Workload


@dataclasses.dataclass(frozen=True)
class Probe:
    q_lens: tuple
    kv_lens: tuple

    def workload(self, case: Case) -> Workload:
        return Workload.of_case(case, list(self.q_lens), list(self.kv_lens))


def probes(case: Case | str, bs: BlockSizes, page_size: int) -> list[Probe]:
    """The probe workloads of one config (small: at most three sequences, two q blocks)."""
    case = Case.parse(case)
    bq, bkv, _, ckv = bs
    P = page_size
    if case == Case.DECODE:
        part = ckv if ckv < bkv else max(P, (bkv // 2) // P * P)
        shapes = [(1, bkv), (2, bkv), (2, 2 * bkv), (2, bkv + P), (2, bkv + part), (3, 2 * bkv)]
        return [Probe((1,) * n, (ctx + 1,) * n) for n, ctx in shapes]
    one = [(bq, bq)]
    return [Probe(*zip(*s)) for s in (
        one, [(bq, bq + bkv)], [(bq, bq + 2 * bkv)], [(2 * bq, 2 * bq)], one * 2, [(bq, bq + P)],
        [(bq, bq + bkv + P)])]


def case_features(case: Case | str) -> tuple[str, ...]:
    """The items priced for a case. Decode: all of ``kernel.steps.FEATURES`` (it computes
    only the chunks holding visible keys, so chunks vary apart from steps). Prefill / mixed
    compute every chunk of a step, so chunks are steps x ``bkv / ckv``; and a step of new
    tokens costs what a cached step costs (the same compute; its KV comes from the new-KV
    array instead of pages). Pricing new steps and their pages apart was wrong: in every
    small probe each q block has exactly one new step, so those items were collinear with
    q blocks, and a 1K causal sequence (q blocks with two new steps) came out 10 % high on
    v6e; with one step item it is within 2 % (benchmarks/README.md, "Estimator")."""
    if Case.parse(case) == Case.DECODE:
        return FEATURES
    return ("call", "seq", "qblock", "step", "page_cached")


def design(case: Case | str, bs: BlockSizes, page_size: int, workloads, sliding_window=None) -> np.ndarray:
    case = Case.parse(case)
    names = case_features(case)
    rows = []
    for w in workloads:
        lo, hi = w.case_range(case)
        f = features(case, bs, page_size, w.q_lens[lo:hi], w.kv_lens[lo:hi], sliding_window)
        rows.append([f[k] for k in names])
    return np.asarray(rows, dtype=np.float64)


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Cycles = sum of per-item costs x item counts (``case_features``)."""

    case: str
    block_sizes: tuple
    page_size: int
    coef: tuple                 # cycles per item, ``case_features(case)`` order
    probe_cycles: tuple
    probe_fit_error: float      # largest relative residual of a probe
    sliding_window: int | None = None

    def cycles(self, workload: Workload) -> float:
        x = design(self.case, BlockSizes(*self.block_sizes), self.page_size, [workload], self.sliding_window)[0]
        return float(x @ np.asarray(self.coef))

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def fit(case: Case | str, bs: BlockSizes, page_size: int, probe_list: list[Probe], cycles: list[float],
        sliding_window=None) -> CostModel:
    """Least-squares per-item costs from the probes' cycles. Items that never vary across
    the probes (always collinear with another, e.g. decode's q blocks with its sequences)
    get the minimum-norm share, which prices workloads of the same structure exactly."""
    case = Case.parse(case)
    X = design(case, bs, page_size, [p.workload(case) for p in probe_list], sliding_window)
    y = np.asarray(cycles, dtype=np.float64)
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    resid = np.abs(X @ coef - y) / y
    return CostModel(case.value, tuple(bs), page_size, tuple(float(c) for c in coef),
                     tuple(float(c) for c in y), float(resid.max()), sliding_window)


# ------------------------------------------------------------------ probing a config
def _cache_dir() -> str:
    import os
    return os.environ.get("RPA_TUNE_PROBE_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "rpa-tune", "probes")


def _cache_key(doc: dict) -> str:
    import hashlib
    import json
    from ..provenance import kernel_hash, versions
    full = dict(doc, kernel=kernel_hash(), versions=versions(), composer=PROBE_VERSION)
    return hashlib.sha256(json.dumps(full, sort_keys=True).encode()).hexdigest()[:24]


PROBE_VERSION = "1"     # the probe workloads (``probes``); the fit is redone from cached cycles


def probe_config(*, builder: str, case: Case | str, bs: BlockSizes, tpu: str, model: dict, limits: dict,
                 options: dict | None = None, timeout: float | None = 600, use_cache: bool = True) -> dict:
    """Compile and audit every probe of one config; fit its ``CostModel``.

    Returns ``{"status", "model" (CostModel JSON), "probes": [{q_lens, kv_lens, cycles,
    audit, max_rss_bytes, compile_s}], "audit": complete | incomplete, "reasons",
    "compile_s", "max_rss_bytes"}``, or the first probe's failure (``vmem_oom``,
    ``compile_error``, ``timeout``, ``crash``) with its fields. Results are cached on disk
    per config, kernel source, library versions and generation (``RPA_TUNE_PROBE_CACHE``).
    """
    import json
    import os
    import time
    from kernel.workload import ModelShape
    from . import audit as audit_mod, profiler
    from .calibration import calibration
    case = Case.parse(case)
    bs = BlockSizes.coerce(bs)
    doc = dict(builder=builder, case=case.value, bs=list(bs), tpu=tpu, model=model, limits=limits,
               options=options or {})
    path = os.path.join(_cache_dir(), _cache_key(doc) + ".json")
    plist = probes(case, bs, limits["page_size"])
    window = (options or {}).get("sliding_window")
    if use_cache and os.path.exists(path):
        try:
            with open(path) as f:
                out = json.load(f)
            if out.get("status") == "ok":   # the probes' cycles are cached; the fit is redone
                out["model"] = fit(case, bs, limits["page_size"], plist,
                                   [p["cycles"] for p in out["probes"]], window).to_json()
            return out
        except (OSError, ValueError, KeyError, TypeError):
            pass
    cal = calibration(tpu)
    shape = ModelShape(**model)
    deadline = None if timeout is None else time.monotonic() + timeout
    out = {"status": "ok", "probes": [], "audit": audit_mod.COMPLETE, "reasons": [], "compile_s": 0.0,
           "max_rss_bytes": 0}
    for p in plist:
        w = p.workload(case)
        left = None if deadline is None else max(1.0, deadline - time.monotonic())
        req = dict(doc, workload=dict(q_lens=list(w.q_lens), kv_lens=list(w.kv_lens),
                                      distribution=list(w.distribution)), block_sizes=list(bs))
        for k in ("builder", "bs"):
            req.pop(k)
        r = profiler.profile(builder, req, timeout=left)
        out["max_rss_bytes"] = max(out["max_rss_bytes"], r.get("max_rss_bytes") or 0)
        out["compile_s"] += (r.get("lower_s") or 0.0) + (r.get("compile_s") or 0.0)
        if r["status"] != "ok":
            return dict(r, probe=dict(q_lens=p.q_lens, kv_lens=p.kv_lens), compile_s=out["compile_s"],
                        max_rss_bytes=out["max_rss_bytes"])
        from .trace import TraceStats
        a = audit_mod.audit_trace(TraceStats.from_json(r["trace"]), audit_mod.needed(w, shape, case), cal)
        if a.verdict != audit_mod.COMPLETE:
            out["audit"] = audit_mod.INCOMPLETE
            out["reasons"] += [f"probe {list(p.q_lens)}/{list(p.kv_lens)}: {x}" for x in a.reasons]
        out["probes"].append(dict(q_lens=list(p.q_lens), kv_lens=list(p.kv_lens), cycles=r["cycles"],
                                  audit=a.to_json(), max_rss_bytes=r.get("max_rss_bytes"),
                                  compile_s=r.get("compile_s")))
    m = fit(case, bs, limits["page_size"], plist, [p["cycles"] for p in out["probes"]], window)
    out["model"] = m.to_json()
    if use_cache:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = path + f".{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(out, f)
        os.replace(tmp, path)
    return out


def model_from_json(d: dict) -> CostModel:
    return CostModel(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items()})
