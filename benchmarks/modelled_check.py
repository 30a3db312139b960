"""Modelled prices against estimates, on programs the profiler can price.

Where libtpu's static profiler cannot price a program (v4, TPU7x prefill / mixed), the
compile backend prices a config ``modelled``: the device-cost model
(``rpa_tune.estimator.device_model``) of the config's walk features alone, without the
static estimate (``rpa_tune.evaluators.compile``, step 6). This checks that price against
the ``estimate`` price of the same configs, where both exist: every audited estimate row of
our kernel's current version in the shipped results (``tables/results``: v5e, v5p, v6e
decode / prefill / mixed and TPU7x decode, each key's newest evaluator version; not TPU7x
prefill / mixed, whose estimates hide their cached-KV work), priced
twice through the same calibration (the generation's, ``device_model.calibration_for``):

* estimate: ``device_time(static, features)``, the row's static estimate (``estimate_s``:
  its cycles at the calibrated clock) under the model, as sweeps rank estimates;
* modelled: ``device_time(None, features)``, what the compile backend records where no
  estimate is possible.

The features are counted from the row's recorded workload by our kernel's own walk
(``device_model.features``), as a sweep counts them. No compile runs.

Reported per generation and case: the error of the modelled price, modelled / estimate - 1
(never above 0: the modelled price drops the static term of a max), its median and 10th
percentile, the share of rows within 10 %; and per key (one key, workload and evaluator
version: the configs one ranking compares), how the modelled ranking picks: the share of
keys where it picks the estimate's best, the estimate price of its pick over the estimate's
best (the regret: what a table of modelled entries loses, as the estimate judges it), and
Spearman's rank correlation of the two prices over the key's configs.

    python benchmarks/modelled_check.py [--results tables/results] [--limit-keys N]

writes ``benchmarks/results/modelled_check.md`` and ``benchmarks/results/modelled_check.json``.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "results", "modelled_check")
CASES = ("decode", "prefill", "mixed")


def read_rows(results: str) -> list[dict]:
    """Audited estimate rows of our kernel's current version, each key's newest evaluator, of
    the generations and cases whose estimates are trusted (``coverage.compile_method``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from kernel.provenance import kernel_id
    from rpa_tune import store
    from rpa_tune.kernels import DEFAULT, row_kernel
    files = sorted(glob.glob(os.path.join(results, "*.parquet")))
    files = [f for f in files if not os.path.basename(f).startswith("walk-")]
    cols = ["generation", "case", "q_dtype", "kv_dtype", "num_q_heads", "num_kv_heads", "head_dim", "page_size",
            "max_num_tokens", "max_model_len", "sliding_window", "key_id", "workload_id", "workload_json", "bq", "bkv",
            "cq", "ckv", "status", "metric", "method", "estimate_s", "backend", "evaluator_version", "kernel",
            "kernel_hash", "kernel_source_hash", "kernel_version", "timestamp", "config_id", "is_heuristic"]
    parts = []
    for f in files:
        t = pq.read_table(f)
        parts.append(t.select([c for c in cols if c in t.column_names]))
    table = store.canonical_rows(pa.concat_tables(parts, promote_options="default"))
    from rpa_tune.coverage import ESTIMATE, compile_method
    rows = [r for r in table.to_pylist()
            if r["status"] == "ok" and r["method"] == "estimate" and r["backend"] == "compile"
            and compile_method(r["generation"], r["case"]) == ESTIMATE       # (not TPU7x prefill / mixed's)
            and r["metric"] is not None and r["estimate_s"] and row_kernel(r.get("kernel")) == DEFAULT
            and r["kernel_hash"] == kernel_id()]
    for r in rows:
        r["timestamp"] = str(r["timestamp"])
    return store.newest_evaluator(rows)


def window(r: dict) -> int | None:
    if not r["sliding_window"]:
        return None
    m = re.search(r"-sw(\d+)", r["workload_id"] or "")
    if not m:
        raise ValueError(f"{r['key_id']}: a sliding-window key whose workload_id {r['workload_id']!r} names no window")
    return int(m.group(1))


def price_rows(rows: list[dict], progress=None) -> list[dict]:
    """Each row with ``estimate_price`` and ``modelled_price`` (seconds) and its features."""
    from kernel.config import BlockSizes
    from kernel.workload import ModelShape, Workload
    from rpa_tune.estimator import device_model
    from rpa_tune.kernels import get_kernel
    kern = get_kernel("rpa-tune")
    cals, workloads, out = {}, {}, []
    for i, r in enumerate(rows):
        g = r["generation"]
        if g not in cals:
            cals[g] = device_model.calibration_for(g)
        cal, version = cals[g]
        if r["workload_json"] not in workloads:
            wj = json.loads(r["workload_json"])
            workloads[r["workload_json"]] = Workload(tuple(wj["q_lens"]), tuple(wj["kv_lens"]),
                                                     tuple(wj["distribution"]))
        model = ModelShape(int(r["num_q_heads"]), int(r["num_kv_heads"]), int(r["head_dim"]), r["q_dtype"],
                           r["kv_dtype"])
        bs = BlockSizes(int(r["bq"]), int(r["bkv"]), int(r["cq"]), int(r["ckv"]))
        f = device_model.features(kern, workloads[r["workload_json"]], model, r["case"], bs, int(r["page_size"]), g,
                                  window(r))
        est = device_model.device_time(r["estimate_s"], f, g, cal.constants)
        mod = device_model.device_time(None, f, g, cal.constants)
        out.append(dict(key_id=r["key_id"], workload_id=r["workload_id"], evaluator_version=r["evaluator_version"],
                        generation=g, case=r["case"], bs=list(bs), is_heuristic=bool(r.get("is_heuristic")),
                        calibration=version, estimate_s=r["estimate_s"], estimate_price=est["time_s"],
                        estimate_bound=est["device_bound"], modelled_price=mod["time_s"],
                        modelled_bound=mod["device_bound"], features=f.to_json(),
                        heads=int(r["num_q_heads"]), head_dim=int(r["head_dim"])))
        if progress and i % 2000 == 0:
            progress(i, len(rows))
    return out


def spearman(a, b) -> float | None:
    if len(a) < 3:
        return None
    ra = np.argsort(np.argsort(a, kind="stable"), kind="stable").astype(float)
    rb = np.argsort(np.argsort(b, kind="stable"), kind="stable").astype(float)
    if ra.std() == 0 or rb.std() == 0:
        return None
    return float(np.corrcoef(ra, rb)[0, 1])


def per_key(priced: list[dict]) -> list[dict]:
    """One summary per ranking (key, workload, evaluator version)."""
    groups: dict = {}
    for p in priced:
        groups.setdefault((p["key_id"], p["workload_id"], p["evaluator_version"]), []).append(p)
    out = []
    for (k, w, v), ps in sorted(groups.items()):
        if len(ps) < 2:
            continue
        est = [p["estimate_price"] for p in ps]
        mod = [p["modelled_price"] for p in ps]
        order = lambda xs: min(range(len(ps)), key=lambda i: (xs[i], ps[i]["bs"]))    # ties: smaller sizes
        be, bm = order(est), order(mod)
        heur = next((p for p in ps if p["is_heuristic"]), None)
        out.append(dict(key_id=k, workload_id=w, evaluator_version=v, generation=ps[0]["generation"],
                        case=ps[0]["case"], configs=len(ps), same_pick=be == bm,
                        regret=est[bm] / est[be] - 1.0, spearman=spearman(est, mod),
                        estimate_best=ps[be]["bs"], modelled_best=ps[bm]["bs"],
                        # the modelled pick against the heuristic, both as the estimate prices them
                        pick_vs_heuristic=(est[bm] / heur["estimate_price"] - 1.0) if heur else None))
    return out


# ----------------------------------------------------------- what the modelled price lacks
def extra_terms(p: dict) -> tuple[float, float]:
    """(KV steps, compute tiles) of a priced row: the counts whose latency the static estimate
    charges and the modelled price does not. A tile is one ``cq`` x ``ckv`` matmul of one q
    block and KV chunk (prefill / mixed: the issued FLOPs over one tile's; decode: a step's
    ``bkv / ckv`` chunks)."""
    f = p["features"]
    bq, bkv, cq, ckv = p["bs"]
    if p["case"] == "decode":
        return float(f["steps"]), float(f["steps"] * max(1, bkv // ckv))
    return float(f["steps"]), f["mxu_flops"] / (4.0 * cq * ckv * p["head_dim"] * p["heads"])


def fit_extra(priced: list[dict]) -> tuple[float, float]:
    """Latencies per KV step and per tile (seconds) that, added to the modelled price, best
    match the estimate price (least squares on relative error)."""
    from scipy.optimize import least_squares
    x = np.array([extra_terms(p) for p in priced])
    m = np.array([p["modelled_price"] for p in priced])
    e = np.array([p["estimate_price"] for p in priced])
    r = least_squares(lambda c: (m + x @ (c * 1e-7)) / e - 1.0, [1.0, 1.0], bounds=([0.0, 0.0], [1e4, 1e4]))
    return float(r.x[0] * 1e-7), float(r.x[1] * 1e-7)


def held_out(priced: list[dict]) -> list[dict]:
    """Per generation and case: the two latencies fitted on the case's rows of the other
    generations, and the held-out generation's regret with them added to its modelled prices."""
    out = []
    for c in CASES:
        for g in sorted({p["generation"] for p in priced if p["case"] == c}):
            train = [p for p in priced if p["case"] == c and p["generation"] != g]
            test = [p for p in priced if p["case"] == c and p["generation"] == g]
            if not train:
                continue
            t_step, t_tile = fit_extra(train)
            fixed = [dict(p, modelled_price=p["modelled_price"] + t_step * a + t_tile * b)
                     for p, (a, b) in ((p, extra_terms(p)) for p in test)]
            ks = per_key(fixed)
            reg = np.array([k["regret"] for k in ks]) if ks else np.array([0.0])
            err = np.array([abs(p["modelled_price"] / p["estimate_price"] - 1.0) for p in fixed])
            out.append(dict(generation=g, case=c, t_step_us=t_step * 1e6, t_tile_ns=t_tile * 1e9, keys=len(ks),
                            regret_median=float(np.median(reg)), regret_p90=float(np.percentile(reg, 90)),
                            same_pick=float(np.mean([k["same_pick"] for k in ks])) if ks else None,
                            abs_error_median=float(np.median(err))))
    return out


def summarize(priced: list[dict], keys: list[dict]) -> list[dict]:
    out = []
    for g in sorted({p["generation"] for p in priced}):
        for c in CASES:
            ps = [p for p in priced if p["generation"] == g and p["case"] == c]
            if not ps:
                continue
            err = np.array([p["modelled_price"] / p["estimate_price"] - 1.0 for p in ps])
            ks = [k for k in keys if k["generation"] == g and k["case"] == c]
            reg = np.array([k["regret"] for k in ks]) if ks else np.array([0.0])
            rho = [k["spearman"] for k in ks if k["spearman"] is not None]
            vs = np.array([k["pick_vs_heuristic"] for k in ks if k["pick_vs_heuristic"] is not None])
            out.append(dict(
                generation=g, case=c, rows=len(ps), calibration=ps[0]["calibration"],
                error_median=float(np.median(err)), error_p10=float(np.percentile(err, 10)),
                error_min=float(err.min()), within_10pct=float(np.mean(err >= -0.10)),
                modelled_bound={b: sum(p["modelled_bound"] == b for p in ps) for b in ("hbm", "mxu")},
                estimate_static=float(np.mean([p["estimate_bound"] == "static" for p in ps])),
                keys=len(ks), same_pick=float(np.mean([k["same_pick"] for k in ks])) if ks else None,
                regret_median=float(np.median(reg)), regret_p90=float(np.percentile(reg, 90)),
                regret_max=float(reg.max()), regret_over_5pct=float(np.mean(reg > 0.05)) if ks else None,
                spearman_median=float(np.median(rho)) if rho else None, with_heuristic=len(vs),
                pick_slower_than_heuristic=float(np.mean(vs > 0.02)) if len(vs) else None,
                pick_vs_heuristic_median=float(np.median(vs)) if len(vs) else None))
    return out


def pct(x) -> str:
    return "-" if x is None else f"{x:+.1%}"


def render(summary: list[dict], keys: list[dict], meta: dict, lacks: list[dict] = ()) -> str:
    lines = ["# Modelled prices against estimates", "",
             f"`benchmarks/modelled_check.py` over `{meta['results']}`: {meta['rows']} audited estimate rows of our "
             f"kernel ({meta['kernel']}, each key's newest evaluator version), {meta['keys']} rankings (key, "
             "workload, evaluator version). Each row priced twice through its generation's calibration: "
             "**estimate** = the device-cost model over the row's static estimate, **modelled** = the model "
             "of the walk's features alone (what the compile backend records where no estimate is "
             "possible). Error = modelled / estimate - 1 (never above 0). Regret = the estimate price of "
             "the modelled ranking's pick over the estimate's best. Times per call, one TensorCore.", "",
             "| gen | case | calibration | rows | error median | error p10 | within 10 % | static-bound (est.) "
             "| keys | same pick | regret median | regret p90 | regret max | keys regret > 5 % | Spearman median "
             "| pick slower than heuristic | pick / heuristic median |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in summary:
        lines.append(
            f"| {s['generation']} | {s['case']} | {s['calibration']} | {s['rows']} | {pct(s['error_median'])} | "
            f"{pct(s['error_p10'])} | {s['within_10pct']:.0%} | {s['estimate_static']:.0%} | {s['keys']} | "
            f"{s['same_pick']:.0%} | {pct(s['regret_median'])} | {pct(s['regret_p90'])} | {pct(s['regret_max'])} | "
            f"{s['regret_over_5pct']:.0%} | "
            f"{'-' if s['spearman_median'] is None else format(s['spearman_median'], '.2f')} | "
            f"{'-' if s['pick_slower_than_heuristic'] is None else format(s['pick_slower_than_heuristic'], '.0%')} "
            f"of {s['with_heuristic']} | {pct(s['pick_vs_heuristic_median'])} |")
    lines += ["", "static-bound (est.): share of rows whose estimate price is set by the static estimate (the "
              "term the modelled price lacks). Pick slower than heuristic: keys (with a heuristic row) where the "
              "modelled ranking's pick costs more than 2 % over the heuristic as the estimate prices both; pick / "
              "heuristic: its median ratio, minus 1.", "", "## Largest regrets", "",
              "| key | workload | configs | estimate's best | modelled pick | regret |", "|---|---|---:|---|---|---:|"]
    for k in sorted(keys, key=lambda k: -k["regret"])[:12]:
        lines.append(f"| {k['key_id']} | {k['workload_id']} | {k['configs']} | {tuple(k['estimate_best'])} | "
                     f"{tuple(k['modelled_best'])} | {pct(k['regret'])} |")
    if lacks:
        before = {(s["generation"], s["case"]): s for s in summary}
        lines += ["", "## What the modelled price lacks", "",
                  "Two latencies the static estimate charges and the model does not carry, per KV step and "
                  "per compute tile (one `cq` x `ckv` matmul), fitted on the case's rows of the *other* "
                  "generations (least squares on relative error against the estimate price) and added to the "
                  "held-out generation's modelled prices. A proposal for the model, not what the compile "
                  "backend records.", "",
                  "| gen | case | t_step (µs) | t_tile (ns) | keys | regret median (before → with) | regret p90 "
                  "(before → with) | same pick (with) | abs. error median (with) |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for h in lacks:
            b = before[(h["generation"], h["case"])]
            lines.append(f"| {h['generation']} | {h['case']} | {h['t_step_us']:.3f} | {h['t_tile_ns']:.0f} | "
                         f"{h['keys']} | {pct(b['regret_median'])} → {pct(h['regret_median'])} | "
                         f"{pct(b['regret_p90'])} → {pct(h['regret_p90'])} | {h['same_pick']:.0%} | "
                         f"{h['abs_error_median']:.1%} |")
    lines += ["", f"Wall time {meta['seconds']:.0f} s; no compile."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default=os.path.join(os.path.dirname(HERE), "tables", "results"))
    ap.add_argument("--limit-keys", type=int, default=0, help="only the first N rankings (a quick look)")
    ap.add_argument("--out", default=OUT, help="output path without extension (.md and .json are written)")
    a = ap.parse_args(argv)
    from kernel.provenance import kernel_id
    t0 = time.time()
    rows = read_rows(a.results)
    if a.limit_keys:
        keep = sorted({(r["key_id"], r["workload_id"]) for r in rows})[:a.limit_keys]
        rows = [r for r in rows if (r["key_id"], r["workload_id"]) in set(keep)]
    priced = price_rows(rows, progress=lambda i, n: print(f"  {i}/{n} rows", file=sys.stderr))
    keys = per_key(priced)
    summary = summarize(priced, keys)
    lacks = held_out(priced)
    meta = dict(results=os.path.relpath(a.results, os.path.dirname(HERE)), rows=len(priced), keys=len(keys),
                kernel=kernel_id(), seconds=time.time() - t0)
    with open(a.out + ".json", "w") as f:
        json.dump(dict(meta=meta, summary=summary, lacks=lacks,
                       worst=sorted(keys, key=lambda k: -k["regret"])[:40]), f, indent=1, sort_keys=True)
        f.write("\n")
    text = render(summary, keys, meta, lacks)
    with open(a.out + ".md", "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
