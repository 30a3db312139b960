"""``rpa-tune export`` / ``diff``: bake sweep results into versioned tables (``kernel.tables``).

Selection, per ``TuningKey`` (all rules deterministic: the same results give byte-identical
files, whatever the order of rows or files):

1. Rows are read from every ``*.parquet`` under each ``--results`` path (several sweeps or
   machines merge by concatenation; exact duplicate rows are dropped).
2. A configuration (bq, bkv, cq, ckv) is *disqualified* for the key if any row for it says
   ``wrong_result``, ``vmem_oom`` or ``compile_error`` under the kernel source (``kernel_hash``)
   of the comparison group used (3.), whatever its workload or backend; a failure under an
   earlier source says nothing of this one. ``timeout`` / ``crash`` rows are
   infrastructure failures and disqualify nothing.
3. ``ok`` rows with a positive metric form *comparison groups* (method, kernel_hash,
   workload_id): numbers are only compared within one group. The group used is the
   ``measured`` one if any (a device measurement beats a compiler estimate), then one of
   the method the compile backend prices the key with today (``coverage.compile_method``:
   ``modelled`` where no estimate is possible, else ``estimate``), then the one with the
   most recent row, then the one with more configurations. A key's entry is thus ranked
   by one method, and an entry's ``method`` is its group's: a ``modelled`` price is never
   compared with an estimate, nor written as one.
4. Within the group, repeated rows of one configuration are merged: metric = median,
   samples = sum, spread = max(row spreads, (max - min of the row metrics) / median). A
   spread is relative everywhere (a fraction of the metric: the TPU evaluator's IQR /
   median; 0 or null for estimates, which are deterministic). The best
   configuration has the lowest metric (ties: smaller block sizes).
5. The heuristic's configuration for the key (``kernel.heuristics``, as a call without
   ``chunk_prefill_size`` resolves it) is looked up in the same group (if absent, the one
   configuration the sweep flagged ``is_heuristic``); ``gain = heuristic_metric /
   best_metric - 1``. The entry is *promoted*
   (used by the kernel) only if ``gain > margin``:

   * ``estimate``: margin ``ESTIMATE_MIN_GAIN`` = 2 %. The compiler estimate is
     deterministic (re-compiling gives the same cycles, spread 0), so the margin is not
     noise but model fidelity: the static profiler costs per-step fixed overheads (DMA
     issue, semaphore waits, loop prologues) by its own model, and differences of a few
     percent are of that order; below 2 % we keep the heuristic, which also avoids
     churning the tables on near-ties.
   * ``measured``: margin = max(``MEASURED_MIN_GAIN`` = 1 %, 2 x the larger (relative)
     spread of the best and the heuristic configuration): a gain that
     does not clear twice the run-to-run spread is not distinguishable from noise.
   * ``modelled``: a gain over the heuristic never promotes. The device-cost model without
     the static estimate ranks block sizes poorly where both can be priced: its pick costs
     a median 17-86 % more than the estimate's best, as the estimate prices it
     (benchmarks/README.md, "Modelled prices against estimates"). The compiler's verdicts
     still promote (below): a modelled entry is used where the heuristic does not compile.

   No heuristic row in the group: not promoted (``heuristic_metric = null``, the decision
   says so). Heuristic configuration disqualified (e.g. ``vmem_oom``): the best is
   promoted whatever the gain (the heuristic would not work for this key). Our kernel's
   estimates of a generation and case whose estimates are refused
   (``rpa_tune.coverage.NEEDS_A_DEVICE_CASES``: TPU7x prefill and mixed) are not promoted.
   Non-promoted keys are still written (``promoted: false``): they stop the lookup's
   bucketing rule from borrowing a neighbouring bucket's sizes for a key where the
   heuristic was found as good.

A table's ``info["results_digest"]`` names the rows it was exported from (``results_digest``:
its generation's rows of its kernel, the columns selection reads, whatever files hold them),
so ``export --check`` fails when the results change even where the entries would not. A table
merged with entries of an earlier export (``merge_tables``) names no digest: no one set of
results made it.
"""
from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
from pathlib import Path
from typing import Iterable

from kernel.config import BlockSizes, TuningKey, get_generation
from kernel.tables import Entry, Table, TableError, PROVENANCE_FIELDS, SCHEMA_VERSION

from .kernels import DEFAULT, get_kernel

ESTIMATE_MIN_GAIN = 0.02
MEASURED_MIN_GAIN = 0.01
MEASURED_SPREAD_FACTOR = 2.0
DISQUALIFYING = ("wrong_result", "vmem_oom", "compile_error")
PRICED_METHODS = ("estimate", "measured", "modelled")     # rows whose metric a table ranks
KEY_COLUMNS = tuple(f.name for f in dataclasses.fields(TuningKey))
REQUIRED_COLUMNS = KEY_COLUMNS + ("bq", "bkv", "cq", "ckv", "status", "metric", "method")
OPTIONAL_COLUMNS = ("unit", "samples", "spread", "cycles", "compile_s", "backend", "search", "seed",
                    "jax_version", "jaxlib_version", "libtpu_version", "device_kind", "kernel_hash",
                    "git_sha", "timestamp", "config_id", "workload_id", "key_id", "kernel_source_hash",
                    "vmem_limit_bytes", "is_heuristic", "workload", "kernel", "kernel_version",
                    "evaluator_version")


# ----------------------------------------------------------------------------- reading
def read_results(paths: Iterable):
    """All result rows as a pandas DataFrame, read by the store's one reader
    (``rpa_tune.store.read_results_table``); ``df.attrs["damaged"]`` lists the skipped
    damaged files as ``(file, reason)``.

    A source that is a storage URL (``postgresql://...``, ``sqlite:///...``, a ``.journal``
    file: ``rpa-tune sweep --storage``) adds the rows its studies hold; a row found both
    in a results directory and in a storage (same ``config_id`` and ``sweep_id``: one
    evaluation) is kept once. A storage that cannot be read raises ``ValueError``."""
    import pyarrow as pa
    from .distributed import StorageError, is_storage_url, rows_from_storage
    from .store import COLUMNS, SCHEMA, read_results_table
    paths = list(paths)
    urls = [str(p) for p in paths if is_storage_url(str(p)) and not Path(str(p)).is_dir()]
    got = read_results_table([p for p in paths if str(p) not in urls])
    table = got.table
    if urls:
        rows = []
        for u in urls:
            try:
                rows += rows_from_storage(u)
            except StorageError as e:
                raise ValueError(str(e)) from None
        if rows:
            extra = pa.Table.from_pylist([{c: r.get(c) for c in COLUMNS} for r in rows], schema=SCHEMA)
            table = pa.concat_tables([table, extra])
    df = table.to_pandas()
    if urls and len(df):
        df = df.drop_duplicates(["config_id", "sweep_id"], ignore_index=True)
    df = normalize_results(df)
    df.attrs["damaged"] = list(got.damaged)
    return df


def normalize_results(df):
    """Check required columns, add missing optional ones, None for missing values,
    ISO-8601 timestamps, exact duplicate rows dropped."""
    missing = [c for c in REQUIRED_COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(f"results lack required columns {missing}")
    for c in OPTIONAL_COLUMNS:
        if c not in df.columns:
            df[c] = None
    df = df.astype(object).where(df.notna(), None)
    df["timestamp"] = [_iso(v) for v in df["timestamp"]]
    df = df.drop_duplicates(ignore_index=True)
    return df


def _iso(v) -> str | None:
    """Timestamps as ISO-8601 UTC strings (accepts strings, datetimes, epoch seconds)."""
    import pandas as pd
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return None
    try:
        if isinstance(v, (int, float)):
            ts = pd.Timestamp(float(v), unit="s", tz="UTC")
        else:
            ts = pd.Timestamp(v)
            ts = ts.tz_localize("UTC") if ts.tzinfo is None else ts.tz_convert("UTC")
        return ts.strftime("%Y-%m-%dT%H:%M:%SZ")
    except Exception:  # noqa: BLE001 - keep whatever the sweep wrote
        return str(v)


def _clean(v):
    if v is None:
        return None
    if isinstance(v, float) and math.isnan(v):
        return None
    if hasattr(v, "item"):
        v = v.item()
    return v


def _str(v):
    v = _clean(v)
    return None if v is None else str(v)


def _int(v):
    v = _clean(v)
    if v is None:
        return None
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


# --------------------------------------------------------------------------- selection
@dataclasses.dataclass
class ConfigStats:
    bs: BlockSizes
    metric: float
    samples: int
    spread: float
    rows: list


@dataclasses.dataclass
class KeyReport:
    key: TuningKey
    entry: Entry | None
    note: str
    # results of this key for other workloads than the one used (workload_id -> description)
    other_workloads: dict = dataclasses.field(default_factory=dict)
    workload: str = ""           # description of the workload used


def heuristic_for(key: TuningKey, kernel: str = DEFAULT) -> BlockSizes | None:
    """The key's baseline, as the sweep evaluated it (ours: ``kernel.heuristics.heuristic_for_key``;
    the public kernel: its own default, ``rpa_tune.kernels``)."""
    return get_kernel(kernel).heuristic(key)


def _row_key(r) -> TuningKey:
    return TuningKey(**{c: _clean(r[c]) for c in KEY_COLUMNS})


def _row_bs(r) -> BlockSizes:
    from .store import row_block_sizes
    return row_block_sizes(r)


def _aggregate(rows: list[dict]) -> dict[BlockSizes, ConfigStats]:
    by: dict[BlockSizes, list] = {}
    for r in rows:
        by.setdefault(_row_bs(r), []).append(r)
    out = {}
    for bs, rs in by.items():
        ms = sorted(float(r["metric"]) for r in rs)
        n = len(ms)
        med = ms[n // 2] if n % 2 else 0.5 * (ms[n // 2 - 1] + ms[n // 2])
        # relative spreads (a fraction of the metric), as the evaluators record them
        spreads = [float(_clean(r.get("spread")) or 0.0) for r in rs]
        spread = max(max(spreads), (ms[-1] - ms[0]) / med if med > 0 else 0.0)
        samples = sum(_int(r.get("samples")) or 1 for r in rs)
        out[bs] = ConfigStats(bs, med, samples, spread, _recent_first(rs))
    return out


def _recent_first(rows: list[dict]) -> list[dict]:
    """Most recent timestamp first (missing last); ties in a total order on all fields."""
    rows = sorted(rows, key=lambda r: repr(sorted((k, repr(v)) for k, v in r.items())))
    return sorted(rows, key=lambda r: r.get("timestamp") or "", reverse=True)


def _margin(method: str, best: ConfigStats, heur: ConfigStats | None) -> float:
    if method == "estimate":
        return ESTIMATE_MIN_GAIN
    if method == "modelled":
        return ESTIMATE_MIN_GAIN     # as deterministic; its gain never promotes (select_key)
    rel = [s.spread for s in (best, heur) if s is not None]     # already relative
    return max(MEASURED_MIN_GAIN, MEASURED_SPREAD_FACTOR * max(rel + [0.0]))


def select_key(key: TuningKey, rows: list[dict], kernel: str = DEFAULT) -> KeyReport:
    """The table entry for one key from its result rows (see the module docstring)."""
    kern = get_kernel(kernel)
    ok = [r for r in rows if _str(r.get("status")) == "ok" and _str(r.get("method")) in PRICED_METHODS
          and _clean(r.get("metric")) is not None and math.isfinite(float(r["metric"]))
          and float(r["metric"]) > 0]
    from .store import newest_evaluator
    ok = newest_evaluator(ok)      # rows an evaluator version re-priced do not stand beside their new price
    if not ok:
        return KeyReport(key, None, "no ok rows with a metric")
    groups: dict[tuple, list] = {}
    for r in ok:
        groups.setdefault((_str(r["method"]), _str(r.get("kernel_hash")) or "",
                           _str(r.get("workload_id")) or ""), []).append(r)

    from .coverage import compile_method
    today = compile_method(key.generation, key.case)     # the compile backend's method for the key

    def group_rank(item):
        (method, khash, wid), rs = item
        latest = max((r.get("timestamp") or "") for r in rs)
        nconf = len({_row_bs(r) for r in rs})
        return (method == "measured", method == today, latest, nconf, khash, wid)

    (method, khash, wid), grows = max(groups.items(), key=group_rank)
    others = {w: _str(rs[0].get("workload")) or "" for (m, kh, w), rs in sorted(groups.items())
              if m == method and kh == khash and w != wid}
    # A failure disqualifies a config only for the kernel source it failed with: VMEM and
    # correctness verdicts do not depend on the workload, but an earlier source's say nothing.
    disq: dict[BlockSizes, str] = {}
    for r in rows:
        st = _str(r.get("status"))
        if st in DISQUALIFYING and (_str(r.get("kernel_hash")) or "") == khash:
            disq.setdefault(_row_bs(r), st)
    stats = _aggregate(grows)
    cands = {bs: s for bs, s in stats.items() if bs not in disq}
    if not cands:
        return KeyReport(key, None, "every ok configuration is disqualified by another row "
                                    f"({', '.join(sorted(set(disq.values())))})")
    best = min(cands.values(), key=lambda s: (s.metric, tuple(s.bs)))
    try:
        hbs = heuristic_for(key, kernel)
    except Exception:  # noqa: BLE001 - a key the heuristic cannot handle has no baseline
        hbs = None
    heur = stats.get(hbs) if hbs is not None else None
    if heur is None:
        # the sweep's own baseline (e.g. the heuristic for the workload's prefill chunk)
        flagged = sorted({_row_bs(r) for r in grows if r.get("is_heuristic") is True} - set(disq))
        if len(flagged) == 1 and flagged[0] in stats:
            hbs, heur = flagged[0], stats[flagged[0]]
    all_key_configs = {_row_bs(r) for r in rows
                       if (_str(r.get("kernel_hash")) or "") == khash and (_str(r.get("workload_id")) or "") == wid}
    margin = _margin(method, best, heur if hbs not in disq else None)
    gain = None
    if hbs is not None and hbs in disq:
        promoted = True
        decision = (f"promoted: the heuristic {tuple(hbs)} failed for this key ({disq[hbs]})")
        heur_metric = None
    elif heur is None and hbs is None and kern.baseline_may_be_missing:
        promoted = True       # tpu-inference's get_default_block_sizes raises there (v4): no default runs
        heur_metric = None
        decision = f"promoted: {kernel} has no default block sizes for this key"
    elif heur is None:
        promoted = False
        heur_metric = None
        if hbs is not None and any(_row_bs(r) == hbs and _str(r.get("status")) == "ok" for r in rows):
            # evaluated, but its estimate is unaudited (metric NaN: the audit found work
            # missing or an impossible rate), so there is nothing to compare against
            decision = (f"not promoted: the heuristic {tuple(hbs)} was evaluated, but its estimate failed "
                        f"the audit (no time), so there is no baseline to beat")
        else:
            decision = (f"not promoted: no heuristic baseline {tuple(hbs) if hbs else '(none)'} in the "
                        f"results (method {method}); evaluate it to allow promotion")
    else:
        heur_metric = heur.metric
        gain = round(heur.metric / best.metric - 1.0, 6)
        if best.bs == hbs:
            promoted = False
            decision = "not promoted: the heuristic is the best configuration found"
        elif gain > margin:
            promoted = True
            decision = f"promoted: gain {gain:.2%} > margin {margin:.2%} ({method})"
        else:
            promoted = False
            decision = f"not promoted: gain {gain:.2%} <= margin {margin:.2%} ({method})"
    if promoted and method == "modelled" and gain is not None:
        promoted = False
        decision = (f"not promoted: gain {gain:.2%} of a modelled price, which ranks block sizes poorly "
                    f"(benchmarks/README.md, \"Modelled prices against estimates\"); tune it on a device "
                    f"(rpa-tune sweep --backend tpu)")
    device = kern.refused_estimate(key) if method == "estimate" else None
    if device and promoted:
        promoted = False
        decision = (f"not promoted: {key.generation} {key.case} estimates are refused ({device}); "
                    f"tune it on a device (rpa-tune sweep --backend tpu)")
    if promoted and method == "estimate" and gain is not None:
        err = kern.composition_error(key.case, best.bs, _str(best.rows[0].get("evaluator_version")))
        need = 1.0 / (1.0 - err) - 1.0
        if err and gain <= need:
            promoted = False
            decision = (f"not promoted: gain {gain:.2%}, but {key.case} estimates of bq {best.bs.bq} composed up to "
                        f"{err:.0%} below whole compiles, so it must exceed {need:.2%} (benchmarks/README.md, "
                        f"\"Small q blocks\")")
    rep = best.rows[0]
    prov = {k: None for k in PROVENANCE_FIELDS}
    for k in ("jax_version", "jaxlib_version", "libtpu_version", "git_sha", "search",
              "backend", "device_kind", "config_id", "workload_id"):
        prov[k] = _str(rep.get(k))
    # the hash the kernel checks tables against (kernel.tables.kernel_source_hash); older
    # stores only have the sweep's own kernel_hash
    prov["kernel_hash"] = _str(rep.get("kernel_source_hash")) or _str(rep.get("kernel_hash"))
    prov["date"] = _str(rep.get("timestamp"))
    prov["seed"] = _int(rep.get("seed"))
    prov["budget"] = len(all_key_configs)
    spread = float(best.spread)
    # the public kernel's limit is its own default at serving time (the estimate used half
    # of VMEM deviceless, rpa_tune.estimator.public): none is recorded
    vmem_limit = (_entry_vmem_limit(key, best.bs, _int(rep.get("vmem_limit_bytes"))) if kern.records_vmem_limit
                  else None)
    entry = Entry(key=key, block_sizes=best.bs, promoted=promoted, decision=decision,
                  metric=float(best.metric), unit=_str(rep.get("unit")) or "s", method=method,
                  heuristic_block_sizes=hbs, heuristic_metric=heur_metric, gain=gain,
                  margin=round(margin, 6), samples=int(best.samples), spread=spread,
                  vmem_limit_bytes=vmem_limit, provenance=prov)
    entry.check()
    return KeyReport(key, entry, decision, others, _str(rep.get("workload")) or "")


def _entry_vmem_limit(key: TuningKey, bs: BlockSizes, evaluated: int | None) -> int | None:
    """The scoped VMEM limit to record: the one the winning row was evaluated with, when
    it differs from the kernel's default for these block sizes (e.g. the sweep raised it
    after a scoped-limit OOM); None when the default is what was evaluated."""
    if evaluated is None:
        return None
    from kernel.api import default_case_vmem_limit
    default = default_case_vmem_limit(bs, generation=key.generation, num_q_heads=key.num_q_heads,
                                      num_kv_heads=key.num_kv_heads, head_dim=key.head_dim,
                                      page_size=key.page_size, q_dtype=key.q_dtype, kv_dtype=key.kv_dtype,
                                      case=key.case)
    return None if evaluated == default else int(evaluated)


def build_tables(df, *, workload_ids=(), kernel: str = DEFAULT) -> tuple[dict[str, Table], list[KeyReport]]:
    """Tables per generation of ``kernel`` from a results DataFrame, and a report per key.

    ``workload_ids``: only rows whose ``workload_id`` starts with one of them (a key tuned on
    several workloads otherwise uses the newest, and its report lists the others)."""
    by_key: dict[TuningKey, list] = {}
    bad = 0
    from .kernels import row_kernel
    records = [r for r in df.to_dict("records") if row_kernel(r.get("kernel")) == kernel]
    if workload_ids:
        records = [r for r in records if any(str(r.get("workload_id") or "").startswith(w) for w in workload_ids)]
    for r in records:
        try:
            k = _row_key(r)
            _row_bs(r)
        except (TypeError, ValueError):
            bad += 1
            continue
        by_key.setdefault(k, []).append(r)
    reports = []
    for k, rows in sorted(by_key.items()):
        try:
            reports.append(select_key(k, rows, kernel))
        except TableError as e:     # e.g. a public decode winner with bq > 1 (a custom space): the
            reports.append(KeyReport(k, None, f"no entry: {e}"))   # table schema takes our rules
    per_gen: dict[str, list[Entry]] = {}
    for rep in reports:
        if rep.entry is not None:
            per_gen.setdefault(rep.key.generation, []).append(rep.entry)
    def version(es):      # the versions the entries were tuned with (provenance.kernel_hash)
        return ", ".join(sorted({e.provenance.get("kernel_hash") or "" for e in es} - {""})) or None
    rows_of = lambda g: [r for k, rs in by_key.items() if k.generation == g for r in rs]
    def fingerprints(es):   # the recorded programs of the versions and JAX the entries were tuned with
        got = {get_kernel(kernel).fingerprint(e.provenance.get("kernel_hash"), e.provenance.get("jax_version"))
               for e in es}
        return ", ".join(sorted(got - {None})) or None
    tables = {g: Table(tuple(es), info=table_info(g, kernel, version(es), results_digest(rows_of(g)),
                                                  fingerprints(es)))
              for g, es in sorted(per_gen.items())}
    if bad:
        reports.append(KeyReport(None, None, f"{bad} result rows with an invalid key or block sizes skipped"))
    return tables, reports


def digest_columns() -> tuple:
    """The columns ``results_digest`` covers: those export reads, less the diagnostic ones
    compaction leaves out (``rpa_tune.store.DIAGNOSTIC_COLUMNS``)."""
    from .store import DIAGNOSTIC_COLUMNS
    return tuple(c for c in REQUIRED_COLUMNS + OPTIONAL_COLUMNS if c not in DIAGNOSTIC_COLUMNS)


def results_digest(rows: list[dict]) -> str:
    """A digest of result rows as export reads them (``normalize_results``): each row's
    ``digest_columns`` as canonical JSON, sorted, hashed. Independent of the files and the
    order that hold the rows."""
    cols = digest_columns()
    lines = sorted(json.dumps([_clean(r.get(c)) for c in cols], default=str) for r in rows)
    return "sha256:" + hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def table_info(generation: str, kernel: str = DEFAULT, kernel_version: str | None = None,
               digest: str | None = None, fingerprint: str | None = None) -> dict:
    """A table's ``info``. Our kernel's tables name no kernel (as before there were two);
    the public kernel's say which, and its version. ``digest``: ``results_digest`` of the
    rows it was exported from; ``fingerprint``: the recorded program fingerprint of the
    kernel version its entries were tuned for (``rpa_tune.fingerprint``)."""
    who = {} if kernel == DEFAULT else {"kernel": kernel, "kernel_version": kernel_version}
    return {
        **who,
        "generated_by": "rpa-tune export",
        "generation": generation,
        "device_kind": get_generation(generation).device_kind,
        "promotion": {
            "estimate_min_gain": ESTIMATE_MIN_GAIN,
            "measured_min_gain": MEASURED_MIN_GAIN,
            "measured_spread_factor": MEASURED_SPREAD_FACTOR,
            "rule": "promote iff heuristic_metric / metric - 1 > margin; no heuristic baseline: not promoted",
        },
        **({"results_digest": digest} if digest else {}),
        **({"kernel_fingerprint": fingerprint} if fingerprint else {}),
        "schema_version": SCHEMA_VERSION,
    }


# ---------------------------------------------------------------------------- merging
@dataclasses.dataclass
class MergeReport:
    """What writing one generation's table does to the file already in ``--out``."""

    generation: str
    added: list = dataclasses.field(default_factory=list)       # keys new to the file
    changed: list = dataclasses.field(default_factory=list)     # keys whose entry the results replace
    unchanged: list = dataclasses.field(default_factory=list)   # keys the results reproduce
    kept: list = dataclasses.field(default_factory=list)        # keys in the file, not in the results
    dropped: list = dataclasses.field(default_factory=list)     # kept keys removed by --replace

    def summary(self) -> str:
        s = (f"{self.generation}: {len(self.added)} added, {len(self.changed)} changed, "
             f"{len(self.unchanged)} unchanged, {len(self.kept)} kept from the existing table")
        return s + (f", {len(self.dropped)} dropped (--replace)" if self.dropped else "")


def merge_tables(tables: dict[str, Table], out_dir, *, replace: bool = False
                 ) -> tuple[dict[str, Table], dict[str, MergeReport]]:
    """The tables to write to ``out_dir``: each existing ``<generation>.json`` merged with
    the new entries (the new entry wins per key; entries of keys without results are kept),
    or, with ``replace``, the new entries only (the dropped keys are reported). An existing
    table that cannot be read raises ``TableError`` (it is never overwritten silently)."""
    out_dir = Path(out_dir)
    merged, reports = {}, {}
    for g, new in tables.items():
        path = out_dir / f"{g}.json"
        old = Table.read(path) if path.exists() else Table(info=new.info)
        if old.kernel != new.kernel:
            sub = get_kernel(new.kernel).table_subdir
            raise TableError(f"{path} is a table of kernel {old.kernel}, not {new.kernel} (its tables go "
                             f"to {sub + '/' if sub else 'the top of the tables directory'})")
        o, n = old.by_key(), new.by_key()
        rep = MergeReport(g)
        for k in sorted(set(o) | set(n)):
            if k not in n:
                (rep.dropped if replace else rep.kept).append(k)
            elif k not in o:
                rep.added.append(k)
            elif o[k] == n[k]:
                rep.unchanged.append(k)
            else:
                rep.changed.append(k)
        entries = dict(n) if replace else {**o, **n}
        info = new.info if replace or not rep.kept else {k: v for k, v in new.info.items() if k != "results_digest"}
        merged[g] = Table(tuple(entries.values()), info=info)
        reports[g] = rep
    return merged, reports


# ------------------------------------------------------------------------ write / check
def planned_files(tables: dict[str, Table]) -> dict[str, bytes]:
    """File name -> bytes for every table (``<generation>.json`` and ``.parquet``)."""
    out = {}
    for g, t in tables.items():
        out[f"{g}.json"] = t.to_json_text().encode()
        out[f"{g}.parquet"] = t.to_parquet_bytes()
    return out


def write_tables(tables: dict[str, Table], out_dir) -> list[Path]:
    out_dir = Path(out_dir)
    written = []
    for name, data in planned_files(tables).items():
        p = out_dir / name
        if p.exists() and p.read_bytes() == data:
            written.append(p)
            continue
        tmp = p.with_name(f".{p.name}.tmp")
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(data)
        tmp.replace(p)
        written.append(p)
    return written


@dataclasses.dataclass
class CheckProblem:
    file: str
    problem: str
    diff: str = ""


def check_tables(tables: dict[str, Table], out_dir, *, max_diff_lines: int = 200) -> list[CheckProblem]:
    """Stale / missing committed tables compared with what ``tables`` would write.

    JSON must match byte for byte (it is canonical); the Parquet mirror must hold the same
    table (compared by content, since Parquet bytes depend on the pyarrow version)."""
    out_dir = Path(out_dir)
    problems = []
    for g, t in tables.items():
        jp, pp = out_dir / f"{g}.json", out_dir / f"{g}.parquet"
        want = t.to_json_text()
        if not jp.exists():
            problems.append(CheckProblem(str(jp), "missing"))
        else:
            have = jp.read_text()
            if have != want:
                diff = "".join(difflib.unified_diff(have.splitlines(True), want.splitlines(True),
                                                    f"{jp} (committed)", f"{jp} (from results)", n=2))
                lines = diff.splitlines(True)
                if len(lines) > max_diff_lines:
                    diff = "".join(lines[:max_diff_lines]) + f"... ({len(lines) - max_diff_lines} more lines)\n"
                problems.append(CheckProblem(str(jp), "stale", diff))
        if not pp.exists():
            problems.append(CheckProblem(str(pp), "missing"))
        else:
            try:
                if Table.read_parquet(pp) != t:
                    problems.append(CheckProblem(str(pp), "stale (Parquet mirror differs from the table)"))
            except TableError as e:
                problems.append(CheckProblem(str(pp), f"unreadable: {e}"))
    return problems


# ---------------------------------------------------------------------------------- diff
@dataclasses.dataclass
class DiffRow:
    change: str                # added / removed / changed
    key: TuningKey
    old: Entry | None
    new: Entry | None

    @property
    def metric_change(self) -> float | None:
        if self.old is None or self.new is None or not self.old.metric:
            return None
        return self.new.metric / self.old.metric - 1.0


def load_table_path(path) -> Table:
    """One table from a file, or all ``*.json`` tables in a directory merged."""
    p = Path(path)
    files = sorted(p.glob("*.json")) if p.is_dir() else [p]
    entries = []
    for f in files:
        try:
            entries.extend(Table.read(f).entries)
        except TableError as e:
            raise TableError(f"{f}: {e}") from None
    try:
        return Table(tuple(entries))
    except TableError as e:
        raise TableError(f"{p}: {e}") from None


def diff_tables(old: Table, new: Table) -> list[DiffRow]:
    o, n = old.by_key(), new.by_key()
    rows = []
    for k in sorted(set(o) | set(n)):
        a, b = o.get(k), n.get(k)
        if a is None:
            rows.append(DiffRow("added", k, None, b))
        elif b is None:
            rows.append(DiffRow("removed", k, a, None))
        elif a != b:
            rows.append(DiffRow("changed", k, a, b))
    return rows


def changed_fields(a: Entry, b: Entry) -> list[str]:
    da, db = a.to_dict(), b.to_dict()
    out = []
    for f in da:
        if f == "provenance":
            out.extend(f"provenance.{k}" for k in da[f] if da[f].get(k) != db[f].get(k))
        elif da[f] != db[f]:
            out.append(f)
    return out


# ------------------------------------------------------------------------------ compact
def compact_results(directory) -> list[Path]:
    """Merge the small parts of a results directory (one file per evaluation, as
    ``rpa-tune sweep`` writes them) into new compacted parts and remove them
    (``rpa_tune.store.compact``: existing compacted parts are never rewritten). Rows are
    unchanged except for the diagnostic columns no table reads, so exports and sweep
    resumption see the same data."""
    from .store import compact
    return compact(directory)
