"""``rpa-tune report``: a static HTML page of sweep results (``index.html`` + PNG heatmaps).

Three steps, kept apart:

* **gather** (``gather``): the groups ``show`` ranks (``report.winners``: one per key,
  workload and backend, of the latest kernel version, with the heuristic's row that
  ``show``'s gain is computed against), each turned into a ``Heatmap`` (metric over
  bq x bkv, one panel per (cq, ckv)); and the ``Coverage`` matrix (generation x model shape x
  case x token bucket) from the results and a tables directory.
* **draw** (``heatmap_figure``): one matplotlib figure per heatmap (Agg canvas, no pyplot
  state).
* **render** (``render_html``): the page; every string from results or tables goes
  through ``html.escape``. No JavaScript.

``write_report`` writes them to a directory and leaves a marker file there
(``MARKER``), so a later run may replace its own output but never a directory it did not
make (``check_out``; ``--force`` overrides).
"""
from __future__ import annotations

import dataclasses
import datetime
import html
import json
import math
import os
import re
from collections import Counter
from pathlib import Path

from kernel.config import CASES as KERNEL_CASES, GENERATIONS, TuningKey

from .kernels import DEFAULT
from .report import Group, winners, wrong_configs

MARKER = ".rpa-tune-report"
COVERAGE_STATES = ("tuned", "not promoted", "stale", "missing", "needs a device")
CASES = tuple(c.value for c in KERNEL_CASES)   # the coverage matrix: no verify stage
FAILED_COLOR = "#b0b0b0"
WINNER_COLOR = "#e8112d"
HEURISTIC_COLOR = "#00b7ff"
DPI = 80


class ReportError(ValueError):
    """Bad input for the report (a one-line message naming the value and what is valid)."""


# ================================================================================ gather
@dataclasses.dataclass
class Heatmap:
    """The metric of one group over (bq, bkv), one panel per (cq, ckv) pair."""

    title: str
    bq_values: list                 # rows of every panel, ascending
    bkv_values: list                # columns of every panel, ascending
    panels: list                    # (cq, ckv) pairs, ascending
    cells: dict                     # (bq, bkv, cq, ckv) -> (status, metric or None)
    winner: tuple | None            # (bq, bkv, cq, ckv)
    heuristic: tuple | None
    unit: str = "s"

    @property
    def failed(self) -> dict:
        return {bs: st for bs, (st, _) in self.cells.items() if st != "ok"}


@dataclasses.dataclass
class KeySection:
    """One group of ``show`` (key, workload, backend, kernel) with its heatmap."""

    group: Group
    heatmap: Heatmap
    anchor: str
    image: str                      # the PNG's file name in the output directory
    table_state: str                # the tables' entry for the key: promoted / not promoted / none
    table_block_sizes: tuple | None
    table_workload_id: str | None = None    # the entry's workload when another group's (its winner is not this one's)

    @property
    def audit_counts(self) -> dict:
        """Audit verdicts of the group's ok rows (compile backend; device rows have none);
        rows of configs found wrong are left out, as ``show`` leaves them out."""
        c = Counter((r.get("audit") or "not recorded") for r in self.group.configs
                    if self.heatmap.cells.get(_bs(r), ("",))[0] == "ok")
        return dict(sorted(c.items()))


@dataclasses.dataclass
class CoverageCell:
    state: str                      # one of COVERAGE_STATES
    keys: list                      # key ids behind the cell (results and tables)
    anchor: str | None = None       # the first key section of the page for the cell


@dataclasses.dataclass
class Coverage:
    generations: list
    shapes: list                    # (shape tuple, label)
    cases: list
    buckets: list
    cells: dict                     # (generation, shape, case, bucket) -> CoverageCell
    matrix_rows: int = 0            # the first shapes are the shipped matrix's (rpa_tune.coverage.SHAPES)


@dataclasses.dataclass
class ReportData:
    results: str
    tables: str
    sections: list
    coverage: Coverage
    total_groups: int               # groups before --key / --limit
    rows: int
    generated: str


def _bs(r) -> tuple:
    return tuple(int(r[k]) for k in ("bq", "bkv", "cq", "ckv"))


def heatmap_data(group: Group, wrong: set = frozenset()) -> Heatmap:
    """The heatmap of a group filled with ``winners(..., all_configs=True)``. An ok row of a
    config found wrong (``report.wrong_configs``) is drawn as ``wrong_result``."""
    cells = {}
    for r in group.configs:
        bs = _bs(r)
        st = str(r.get("status") or "?")
        metric = r.get("metric") if st == "ok" else None
        if st == "ok" and (r.get("key_id"), *bs, r.get("kernel_hash")) in wrong:
            st, metric = "wrong_result", None
        if st == "ok" and metric is None:
            st = "no metric"
        cells[bs] = (st, metric)
    heur = _bs(group.heuristic) if group.heuristic else None
    if heur is None:        # the baseline failed: mark the config the sweep flagged as the heuristic
        flagged = [r for r in group.configs if r.get("is_heuristic")]
        heur = _bs(flagged[-1]) if flagged else None
    key = TuningKey(**group.key)
    from .ui import shape_label
    return Heatmap(
        title=f"{key.generation} {key.case} {shape_label(group.key)} t{key.max_num_tokens} ({group.backend})",
        bq_values=sorted({b[0] for b in cells}), bkv_values=sorted({b[1] for b in cells}),
        panels=sorted({(b[2], b[3]) for b in cells}), cells=cells,
        winner=_bs(group.best) if group.best else None, heuristic=heur,
        unit=str((group.best or {}).get("unit") or "s"))


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:90]


def model_shape(key: dict) -> tuple:
    return (int(key["num_q_heads"]), int(key["num_kv_heads"]), int(key["head_dim"]), str(key["q_dtype"]),
            str(key["kv_dtype"]))


def shape_name(shape: tuple) -> str:
    """The presets with this attention shape and the shape itself (``ui.shape_label``)."""
    from .presets import PRESETS
    from .ui import shape_label
    names = [p.name for p in PRESETS.values() if (p.num_q_heads, p.num_kv_heads, p.head_dim, p.q_dtype,
                                                    p.kv_dtype) == shape]
    label = shape_label(dict(zip(("num_q_heads", "num_kv_heads", "head_dim", "q_dtype", "kv_dtype"), shape)))
    return f"{', '.join(names) or 'custom'}: {label}"


def coverage(df, entries, sections=()) -> Coverage:
    """Generation x model shape x case x token bucket of our kernel: ``tuned`` when the
    tables hold a promoted entry for it tuned for the current kernel source (not on a
    retired sweep workload), ``not
    promoted`` when a current non-promoted entry, or results and no entry, exist but no
    promoted one, ``stale`` when its only entries are another kernel source's or were tuned
    on an earlier sweep workload (``coverage.on_retired_workload``), or its only results
    another kernel source's, else
    ``missing``; ``needs a device`` instead of any but ``tuned`` where no estimate of its
    generation and case is trusted (``coverage.NEEDS_A_DEVICE_CASES``). Rows: the shapes of
    the shipped
    matrix (``rpa_tune.coverage``; a shape and its sliding-window keys are two rows), then
    the other presets, then any other shape in the results or tables. Buckets: the
    matrix's and the keys' ``max_num_tokens``. Page size and model length are folded into
    the cell (its keys list them)."""
    from kernel.provenance import kernel_id
    from . import coverage as matrix
    from .kernels import row_kernel
    source = kernel_id()
    from .presets import PRESETS, get_preset
    results_keys: set = set()         # keys with results of the current kernel source
    old_results: set = set()          # keys with results of earlier kernels only
    if len(df):
        d = df[[row_kernel(k) == DEFAULT for k in df["kernel"]]] if "kernel" in df else df
        cols = [f.name for f in dataclasses.fields(TuningKey)]
        # rows without the column (written before it existed) count as current
        import numpy as np
        col = d["kernel_source_hash"] if "kernel_source_hash" in d else None
        fresh = np.asarray((col == source) | col.isna() if col is not None else [True] * len(d), dtype=bool)
        for part, into in ((d[fresh], results_keys), (d[~fresh], old_results)):
            for vals in part[cols].drop_duplicates().itertuples(index=False):
                try:
                    into.add(TuningKey(*vals))
                except (TypeError, ValueError):
                    continue
        old_results -= results_keys
    table_keys = {e.key: e for e in entries}

    def preset_shape(p, kv_dtype=None):
        return (p.num_q_heads, p.num_kv_heads, p.head_dim, p.q_dtype, kv_dtype or p.kv_dtype)

    rows: dict = {}
    for sh in matrix.SHAPES:
        rows.setdefault((preset_shape(get_preset(sh.preset), sh.kv_dtype), sh.sliding_window is not None), sh.name)
    matrix_rows = len(rows)
    for p in PRESETS.values():
        rows.setdefault((preset_shape(p), False), None)
    for k in sorted(results_keys | old_results | set(table_keys)):
        rows.setdefault((model_shape(k.as_dict()), k.sliding_window), None)
    from .ui import shape_label
    shapes = []
    for (shape, sw), name in rows.items():
        label = (f"{name}: " + shape_label(dict(zip(("num_q_heads", "num_kv_heads", "head_dim", "q_dtype",
                                                     "kv_dtype"), shape)))) if name else shape_name(shape)
        shapes.append(((shape, sw), label + (", sliding window" if sw else "")))
    buckets = sorted(set(matrix.BUCKETS) | {k.max_num_tokens for k in results_keys | old_results | set(table_keys)})
    anchors = {}        # a key's cell links its table entry's group first, then its first group
    for sec in sorted(sections, key=lambda sec: sec.table_workload_id is not None):
        if sec.group.kernel == DEFAULT:         # the matrix is of the default kernel's tables
            anchors.setdefault(sec.group.key_id, sec.anchor)
    by_cell: dict = {}
    for k in results_keys | old_results | set(table_keys):
        by_cell.setdefault((k.generation, (model_shape(k.as_dict()), k.sliding_window), k.case,
                            k.max_num_tokens), []).append(k)
    cells = {}
    for g in GENERATIONS:
        for s, _ in shapes:
            for c in CASES:
                for t in buckets:
                    ks = by_cell.get((g, s, c, t), [])
                    rk = sorted(k for k in ks if k in results_keys)
                    tk = sorted(k for k in ks if k in table_keys)
                    current = [k for k in tk if not matrix.is_stale(table_keys[k], source)]
                    if any(table_keys[k].promoted for k in current):
                        state = "tuned"
                    elif current:
                        state = "not promoted"
                    elif tk:                  # the kernel uses such an entry: it is not missing
                        state = "stale"
                    elif rk:
                        state = "not promoted"
                    elif any(k in old_results for k in ks):
                        state = "stale"
                    else:
                        state = "missing"
                    if state != "tuned" and matrix.NEEDS_A_DEVICE_CASES.get((g, c)):
                        state = "needs a device"     # no estimate of it is trusted (rpa_tune.coverage)
                    keys = sorted({k.id() for k in ks})
                    anchor = next((anchors[k] for k in keys if k in anchors), None)
                    cells[(g, s, c, t)] = CoverageCell(state, keys, anchor)
    return Coverage(list(GENERATIONS), shapes, list(CASES), buckets, cells, matrix_rows)


def coverage_counts(cov: Coverage) -> str:
    """The cells per state, the shipped matrix's rows apart from the other presets' and
    shapes' (which the tables do not promise)."""
    inside = {s for s, _ in cov.shapes[:cov.matrix_rows]}
    parts = []
    for name, mine in (("The shipped matrix's rows", True), ("the other rows", False)):
        counts = Counter(c.state for (_, s, _, _), c in cov.cells.items() if (s in inside) == mine)
        if mine or counts:
            parts.append(f"{name}: " + ", ".join(f"{counts.get(st, 0)} {_e(st)}" for st in COVERAGE_STATES)
                         + " cells")
    return "; ".join(parts) + "."


def other_workload(entry, group: Group) -> str | None:
    """The workload id a table entry was tuned on when it is not ``group``'s, else None (also
    when the entry records none). A key's results can hold groups of two workloads (a mixed
    key priced again on the plan's new batch keeps its retired batch's rows,
    ``coverage.RETIRED_SWEEP_WORKLOADS``); the entry's winner and gain are one group's."""
    wid = entry.provenance.get("workload_id")
    return None if not wid or str(wid) == str(group.workload_id) else str(wid)


def gather(df, entries, *, results: str = "", tables: str = "", tpu=None, case=None, backend=None,
           key: str | None = None, limit: int | None = None) -> ReportData:
    """Everything the page shows. ``df``: the results (``ResultStore.read()``); ``entries``:
    the table entries (``export.load_table_path(...).entries``). ``key``: only groups whose
    key id contains it; ``limit``: at most that many groups (in ``show``'s order)."""
    groups = winners(df, tpu=tpu, case=case, backend=backend, top=1, all_configs=True)
    total = len(groups)
    if key:
        groups = [g for g in groups if key in g.key_id]
    if limit is not None:
        groups = groups[:limit]
    wrong = wrong_configs(df) if len(df) else set()
    by_key = {e.key: e for e in entries}
    sections, used = [], set()
    for i, g in enumerate(groups):
        base = _slug(f"{g.kernel}-{g.key_id}-{g.backend}-{g.workload_id}") or f"key-{i}"
        anchor = base if base not in used else f"{base}-{i}"
        used.add(anchor)
        e = by_key.get(TuningKey(**g.key)) if g.kernel == DEFAULT else None     # entries: its tables
        state = "none" if e is None else ("promoted" if e.promoted else "not promoted")
        other = None if e is None else other_workload(e, g)
        k = g.key
        image = _slug(f"{i + 1:03d}-{k['generation']}-{k['case']}-h{k['num_q_heads']}x{k['num_kv_heads']}-"
                      f"d{k['head_dim']}-{k['kv_dtype']}-p{k['page_size']}-t{k['max_num_tokens']}-{g.backend}") + ".png"
        sections.append(KeySection(g, heatmap_data(g, wrong), anchor, image, state,
                                   tuple(e.block_sizes) if e is not None else None, other))
    return ReportData(results=results, tables=tables, sections=sections, coverage=coverage(df, entries, sections),
                      total_groups=total, rows=len(df),
                      generated=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))


# ================================================================================== draw
MAX_WIDTH_IN = 15.5          # about the page's width at DPI: images are not scaled down


def panel_grid(hm: Heatmap) -> tuple[int, int]:
    """(rows, columns) of the panels of a heatmap's figure: as many columns as fit the width."""
    n = max(len(hm.panels), 1)
    fit = int((MAX_WIDTH_IN - 1.3) // (0.56 * len(hm.bkv_values) + 0.9))
    cols = max(1, min(n, fit))
    return -(-n // cols), cols


def figure_size(hm: Heatmap) -> tuple[float, float]:
    """Inches (width, height) of a heatmap's figure (PNG pixels: these times ``DPI``)."""
    rows, cols = panel_grid(hm)
    w = cols * (0.56 * len(hm.bkv_values) + 0.9) + 1.3
    h = rows * (0.38 * len(hm.bq_values) + 1.0) + 1.1
    return math.ceil(max(w, 5.0) * 4) / 4, math.ceil(h * 4) / 4     # quarter inches: whole pixels at DPI


def _short_time(v: float) -> str:
    if v >= 1:
        return f"{v:.3g}s"
    if v >= 1e-3:
        return f"{v * 1e3:.3g}ms"
    return f"{v * 1e6:.3g}µs"


def _ticks(lo: float, hi: float, log: bool, n: int = 5) -> list:
    """Colour-bar ticks: both ends, and ``n - 2`` evenly spaced ones between (on the scale
    used) rounded to 2 significant digits, none too close to an end."""
    pos = (lambda v: math.log(v / lo) / math.log(hi / lo)) if log else (lambda v: (v - lo) / (hi - lo))
    inner = [lo * (hi / lo) ** (i / (n - 1)) if log else lo + (hi - lo) * i / (n - 1) for i in range(1, n - 1)]
    inner = sorted({float(f"{v:.2g}") for v in inner})
    return [lo] + [v for v in inner if 0.12 < pos(v) < 0.88] + [hi]


def heatmap_figure(hm: Heatmap):
    """``(figure, panel axes)``: one panel per (cq, ckv) pair; ok cells coloured by the metric
    (one colour scale for all panels, lower is better), failed configs grey and hatched
    with their status, configs not evaluated blank; the winner boxed in red (★), the
    heuristic's config in blue dashes (H)."""
    from matplotlib import colormaps, colors
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch, Rectangle
    from .ui import SHORT

    fig = Figure(figsize=figure_size(hm), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    rows, cols = panel_grid(hm)
    grid = fig.add_gridspec(rows, cols)
    metrics = [m for st, m in hm.cells.values() if st == "ok" and m is not None and m > 0]
    if metrics:
        lo, hi = min(metrics), max(metrics)
        if hi <= lo:
            lo, hi = lo * 0.99, hi * 1.01
        norm = colors.LogNorm(lo, hi) if hi / lo > 3 else colors.Normalize(lo, hi)
    else:
        norm = colors.Normalize(0, 1)
    cmap = colormaps["viridis"]
    nq, nk = len(hm.bq_values), len(hm.bkv_values)
    annotate = nk <= 10
    axes = []
    for i, (cq, ckv) in enumerate(hm.panels):
        ax = fig.add_subplot(grid[i // cols, i % cols])
        axes.append(ax)
        for y, bq in enumerate(hm.bq_values):
            for x, bkv in enumerate(hm.bkv_values):
                bs = (bq, bkv, cq, ckv)
                if bs not in hm.cells:
                    ax.add_patch(Rectangle((x - .5, y - .5), 1, 1, facecolor="white", edgecolor="#e4e4e4", lw=.5))
                    continue
                st, m = hm.cells[bs]
                mark = ("★" if bs == hm.winner else "") + ("H" if bs == hm.heuristic else "")
                if st == "ok":
                    rgba = cmap(norm(m))
                    ax.add_patch(Rectangle((x - .5, y - .5), 1, 1, facecolor=rgba, edgecolor="white", lw=.5))
                    text = _short_time(m) if hm.unit == "s" else f"{m:.3g}"
                    dark = 0.299 * rgba[0] + 0.587 * rgba[1] + 0.114 * rgba[2] < 0.5
                    color = "white" if dark else "black"
                else:
                    ax.add_patch(Rectangle((x - .5, y - .5), 1, 1, facecolor=FAILED_COLOR, edgecolor="#707070",
                                           hatch="///", lw=.5))
                    text, color = SHORT.get(st, st), "black"
                if annotate or mark:
                    label = (mark + " " if mark else "") + (text if annotate else "")
                    ax.text(x, y, label.strip(), ha="center", va="center", fontsize=7, color=color,
                            fontweight="bold" if mark else "normal",
                            bbox=None if st == "ok" else dict(facecolor="white", edgecolor="none", pad=0.5, alpha=0.8))
                if bs == hm.winner:
                    ax.add_patch(Rectangle((x - .45, y - .45), .9, .9, fill=False, edgecolor=WINNER_COLOR, lw=2.6))
                if bs == hm.heuristic:
                    ax.add_patch(Rectangle((x - .33, y - .33), .66, .66, fill=False, edgecolor=HEURISTIC_COLOR,
                                           lw=1.8, linestyle=(0, (3, 2))))
        ax.set_xlim(-.5, nk - .5)
        ax.set_ylim(nq - .5, -.5)
        ax.set_xticks(range(nk), [str(v) for v in hm.bkv_values], fontsize=8, rotation=45 if nk > 7 else 0)
        ax.set_yticks(range(nq), [str(v) for v in hm.bq_values], fontsize=8)
        ax.set_xlabel("bkv", fontsize=8)
        ax.set_ylabel("bq", fontsize=8)
        ax.set_title(f"cq={cq}, ckv={ckv}", fontsize=9)
        ax.set_aspect("auto")
        ax.tick_params(length=2)
    if metrics:
        from matplotlib.cm import ScalarMappable
        cb = fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=axes, shrink=0.9, pad=0.02)
        cb.set_label(f"{'time' if hm.unit == 's' else hm.unit} (lower is better)", fontsize=8)
        cb.ax.tick_params(labelsize=7)
        cb.ax.minorticks_off()
        ticks = _ticks(norm.vmin, norm.vmax, log=isinstance(norm, colors.LogNorm))
        cb.set_ticks(ticks, labels=[_short_time(v) if hm.unit == "s" else f"{v:.3g}" for v in ticks])
    handles = [Patch(facecolor=FAILED_COLOR, edgecolor="#707070", hatch="///", label="failed (status shown)"),
               Patch(facecolor="white", edgecolor="#bbbbbb", label="not evaluated"),
               Line2D([], [], marker="s", markersize=9, markerfacecolor="none", markeredgecolor=WINNER_COLOR,
                      markeredgewidth=2, linestyle="none", label="★ winner (lowest time)"),
               Line2D([], [], marker="s", markersize=7, markerfacecolor="none", markeredgecolor=HEURISTIC_COLOR,
                      markeredgewidth=1.5, linestyle="none", label="H heuristic (the baseline)")]
    fig.legend(handles=handles, loc="outside lower center", ncols=4, fontsize=8, frameon=False)
    fig.suptitle(hm.title, fontsize=10)
    return fig, axes


def save_png(fig, path: Path) -> None:
    """The figure as a 256-colour PNG (heatmaps have few colours: a third of the bytes)."""
    import numpy as np
    from PIL import Image
    fig.canvas.draw()
    rgb = Image.fromarray(np.asarray(fig.canvas.buffer_rgba())).convert("RGB")
    rgb.quantize(256, method=Image.Quantize.MEDIANCUT).save(path, format="png", optimize=True)


# ================================================================================ render
def _e(v) -> str:
    return html.escape("" if v is None else str(v), quote=True)


def method_label(backend: str, method: str, audited: bool = True) -> str:
    """What a group's numbers are: the compile backend's are estimates (or modelled where no
    estimate is possible), not device times."""
    if method == "modelled":
        return "modelled by the device-cost model from the walk's features, no static estimate; not a device time"
    if method == "estimate" or backend == "compile":
        if not audited:
            return ("static compiler estimate, not a device time; no audit verdict recorded (rows of an "
                    "evaluator older than the audit)")
        return ("static compiler estimate (audited) through the calibrated device-cost model, one call on one "
                "TensorCore; not a device time")
    if method == "measured" or backend == "tpu":
        return "measured on the device"
    return method or "-"


def _fmt_bs(bs) -> str:
    return "-" if bs is None else "(" + ", ".join(str(int(v)) for v in bs) + ")"


def _gain_text(g: Group) -> str:
    if g.gain is None:
        return "- (no ok heuristic row)" if g.best else "-"
    return f"×{g.gain:.2f} ({g.gain - 1:+.1%})"


CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;max-width:1500px;
     padding:0 16px;color:#1d1d1f;line-height:1.4}
h1{font-size:1.6em;margin-bottom:.2em} h2{margin-top:1.6em;border-bottom:1px solid #ddd;padding-bottom:.2em}
h3{font-size:1.05em;margin:0 0 .4em;word-break:break-all}
.note{background:#fff7e0;border:1px solid #f0d48a;padding:8px 12px;border-radius:4px}
table{border-collapse:collapse;font-size:13px}
th,td{border:1px solid #d6d6d6;padding:3px 7px;text-align:left;vertical-align:top}
th{background:#f3f3f3}
table.cov{font-size:12px} table.cov td.c{text-align:center;min-width:44px;padding:3px 4px}
.wide{overflow-x:auto}
td.tuned{background:#c8ecc9} td.not-promoted{background:#fde3a7} td.stale{background:#f6c6c6} td.missing{background:#f1f1f1;color:#999} td.needs-a-device{background:#dde4f0;color:#556}
td.c a{color:inherit}
.key{border:1px solid #ddd;border-radius:6px;padding:12px;margin:18px 0;background:#fcfcfc}
.key img{max-width:100%;height:auto;display:block;margin-top:8px}
table.kv{width:100%} table.kv th{width:190px;font-weight:600}
.bad{color:#b00020;font-weight:600}
.toc{columns:2;font-size:13px} .toc li{word-break:break-all}
code{font-size:12px}
"""


def render_html(data: ReportData) -> str:
    """The page (a string). Every value from results or tables is escaped."""
    p = []
    add = p.append
    add("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">")
    add("<title>rpa-tune report</title>")
    add(f"<style>{CSS}</style></head><body>")
    add("<h1>rpa-tune report</h1>")
    shown = len(data.sections)
    add(f"<p>Results <code>{_e(data.results)}</code> ({data.rows} rows, {data.total_groups} key groups"
        + (f", {shown} shown" if shown != data.total_groups else "") + f"); tables <code>{_e(data.tables)}</code>; "
        f"generated {_e(data.generated)} by <code>rpa-tune report</code>.</p>")
    backends = sorted({s.group.backend for s in data.sections})
    if "compile" in backends or any(s.group.method == "estimate" for s in data.sections):
        add("<p class=\"note\"><b>Estimates, not device times.</b> Rows of the <code>compile</code> backend were "
            "compiled deviceless for the target TPU; their times are libtpu's static cost estimate, composed and "
            "audited by rpa-tune's estimator (a key's audit row says whether the traces held all the work; "
            "rows recorded before the audit existed say so), not measurements on a TPU. Rows of the <code>tpu</code> backend are device times.</p>")
    _render_coverage(add, data.coverage)
    add("<h2 id=\"keys\">Keys</h2>")
    if not data.sections:
        add("<p>No key matched.</p>")
    else:
        add("<p>Per key (grouped as <code>rpa-tune show</code> groups them: key, workload, backend), the winner "
            "and the heuristic's config, and the metric over bq × bkv with one panel per (cq, ckv). Lower is "
            "better. Gain = heuristic time / winner time (as <code>show</code>'s \"vs heuristic\").</p>")
        add("<ul class=\"toc\">")
        for s in data.sections:
            add(f"<li><a href=\"#{_e(s.anchor)}\">{_e(s.group.kernel)} {_e(s.group.key_id)} "
                f"({_e(s.group.backend)})</a></li>")
        add("</ul>")
    for s in data.sections:
        _render_section(add, s)
    add("</body></html>\n")
    return "\n".join(p)


def _render_coverage(add, cov: Coverage) -> None:
    from . import coverage as matrix
    add("<h2 id=\"coverage\">Coverage</h2>")
    add("<p>Our kernel's keys per generation × model shape × case × token bucket (<code>max_num_tokens</code> "
        "of the key, as the tables key them). <b>tuned</b>: the tables hold a promoted entry; <b>not "
        "promoted</b>: results (or a non-promoted entry) exist, but no promoted entry (the winner did not beat "
        "the heuristic by the margin, or it was not exported); <b>stale</b>: only entries of an earlier kernel "
        "source or tuned on an earlier sweep workload (the kernel uses such entries; of an earlier kernel, "
        "with a warning), or only results of an earlier kernel source; <b>missing</b>: none of these; <b>needs a device</b>: a generation and "
        "case whose estimates are refused (below), unless tuned. The first rows are the "
        "shapes the shipped tables promise (<code>rpa_tune/coverage.py</code>). Page size and model length "
        "are folded into a cell (hover it for its keys; a link goes to the key below).</p>")
    add("<p>" + coverage_counts(cov) + "</p>")
    if not cov.buckets:
        add("<p>No keys in the results or tables.</p>")
        return
    add("<div class=\"wide\"><table class=\"cov\"><thead><tr>"
        "<th rowspan=\"2\">generation</th><th rowspan=\"2\">model shape</th>")
    for c in cov.cases:
        add(f"<th colspan=\"{len(cov.buckets)}\">{_e(c)}</th>")
    add("</tr><tr>")
    for _ in cov.cases:
        for t in cov.buckets:
            add(f"<th>t{t}</th>")
    add("</tr></thead><tbody>")
    ncols = len(cov.cases) * len(cov.buckets)
    for g in cov.generations:
        if all(cov.cells[(g, s, c, t)].state == "missing" for s, _ in cov.shapes for c in cov.cases
               for t in cov.buckets):
            why = matrix.NEEDS_A_DEVICE.get(g)
            why = f"; needs a device: {why}" if why else ""
            add(f"<tr><th>{_e(g)}</th><td>every shape</td><td class=\"c missing\" colspan=\"{ncols}\">missing "
                f"(no results, no table entry{_e(why)})</td></tr>")
            continue
        for j, (shape, label) in enumerate(cov.shapes):
            add("<tr>")
            if j == 0:
                add(f"<th rowspan=\"{len(cov.shapes)}\">{_e(g)}</th>")
            add(f"<td>{_e(label)}</td>")
            for c in cov.cases:
                for t in cov.buckets:
                    cell = cov.cells[(g, shape, c, t)]
                    cls = cell.state.replace(" ", "-")
                    text = _e(cell.state)
                    if cell.anchor:
                        text = f"<a href=\"#{_e(cell.anchor)}\">{text}</a>"
                    title = f" title=\"{_e(chr(10).join(cell.keys))}\"" if cell.keys else ""
                    add(f"<td class=\"c {cls}\"{title}>{text}</td>")
            add("</tr>")
    add("</tbody></table></div>")
    device = {}
    for (g, c), why in matrix.NEEDS_A_DEVICE_CASES.items():
        if g in cov.generations and c in cov.cases:
            device.setdefault(why, []).append(f"{g} {c}")
    for why, pairs in device.items():
        add(f"<p><b>Needs a device</b>: {_e(', '.join(pairs))}: {_e(why)}. Their estimates are not "
            "promoted (<code>rpa-tune export</code>); tune them with <code>--backend tpu</code>.</p>")


def _render_section(add, s: KeySection) -> None:
    from .ui import fmt_time, shape_label
    g, b, h = s.group, s.group.best, s.group.heuristic
    add(f"<div class=\"key\" id=\"{_e(s.anchor)}\">")
    add(f"<h3>{_e(g.kernel)} · {_e(g.key_id)}</h3>")
    audit = ", ".join(f"{_e(v)}: {n}" for v, n in s.audit_counts.items()) or "-"
    if any(v == "incomplete" for v in s.audit_counts):
        audit = f"<span class=\"bad\">{audit}</span>"
    statuses = ", ".join(f"{_e(k)}: {v}" for k, v in sorted(g.counts.items()))
    evaluators = ", ".join(sorted({str(r.get("evaluator_version")) for r in g.configs
                                   if r.get("evaluator_version")})) or "-"
    if g.excluded_wrong:
        statuses += f" <span class=\"bad\">({g.excluded_wrong} wrong excluded)</span>"
    rows = [
        ("shape", _e(shape_label(g.key)) + f" · page {_e(g.key['page_size'])} · tokens {_e(g.key['max_num_tokens'])}"
         f" · model len {_e(g.key['max_model_len'])}" + (" · sliding window" if g.key.get("sliding_window") else "")),
        ("workload", f"{_e(g.workload)} <small>({_e(g.workload_id)})</small>"),
        ("backend / method", f"{_e(g.backend)} / {_e(g.method)} · evaluator {_e(evaluators)} · kernel "
         f"{_e(g.kernel_hash)}" + (" <span class=\"bad\">(stale: an older kernel version than this "
                                   "checkout's)</span>" if g.stale else "")),
        ("numbers are", _e(method_label(g.backend, g.method, audited=set(s.audit_counts) != {"not recorded"}))),
        ("winner", f"{_e(_fmt_bs(_bs(b)))} · {_e(fmt_time(b['metric']))}" if b else "<span class=\"bad\">no ok "
         "config</span>"),
        ("heuristic", f"{_e(_fmt_bs(_bs(h)))} · {_e(fmt_time(h['metric']))}" if h else
         (f"{_e(_fmt_bs(s.heatmap.heuristic))} · not ok" if s.heatmap.heuristic else "not evaluated")),
        ("gain over the heuristic", _e(_gain_text(g))),
        ("audit (ok rows)", audit),
        ("statuses", statuses or "-"),
        ("table entry", _e(s.table_state) + (f" {_e(_fmt_bs(s.table_block_sizes))}" if s.table_block_sizes else "")
         + (f" <span class=\"bad\">(tuned on workload {_e(s.table_workload_id)}, another group's: not this "
            "heatmap's winner)</span>" if s.table_workload_id else "")),
    ]
    add("<table class=\"kv\">" + "".join(f"<tr><th>{_e(k)}</th><td>{v}</td></tr>" for k, v in rows) + "</table>")
    add(f"<img src=\"{_e(s.image)}\" alt=\"heatmap of {_e(g.key_id)}\" loading=\"lazy\">")
    add("</div>")


# ================================================================================= write
def check_out(out: Path, force: bool = False) -> None:
    """``ReportError`` unless ``out`` may receive the report: a new or empty directory, or
    one holding an earlier report (``MARKER``), or any directory with ``force``."""
    if out.exists() and not out.is_dir():
        raise ReportError(f"--out {str(out)!r} exists and is not a directory; give a directory for index.html "
                          "and its images")
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).is_file() and not force:
        raise ReportError(f"--out {str(out)!r} is not empty and holds no earlier report (no {MARKER}); give a new "
                          "or empty directory, or pass --force to write into it")
    probe = out
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise ReportError(f"--out {str(out)!r}: {str(probe)!r} is not a directory; give a writable directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ReportError(f"--out {str(out)!r}: {str(probe)!r} is not writable; give a writable directory")


def write_report(data: ReportData, out: Path, force: bool = False) -> list[Path]:
    """Write ``index.html``, one PNG per key section and the marker into ``out``; files an
    earlier report there wrote and this one does not are removed. Returns the files."""
    check_out(out, force)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ReportError(f"--out {str(out)!r}: cannot create it ({e.strerror or e}); give a writable "
                          "directory") from None
    marker = out / MARKER
    old = []
    if marker.is_file():
        try:
            old = json.loads(marker.read_text()).get("files", [])
        except (ValueError, AttributeError, OSError):
            old = []
    written = []
    try:
        for s in data.sections:
            fig, _ = heatmap_figure(s.heatmap)
            p = out / s.image
            save_png(fig, p)
            written.append(p)
        page = out / "index.html"
        tmp = out / ".index.html.tmp"
        tmp.write_text(render_html(data), encoding="utf-8")
        os.replace(tmp, page)
        written.append(page)
        names = sorted(p.name for p in written)
        for name in old:
            if isinstance(name, str) and "/" not in name and name not in names and (out / name).is_file():
                (out / name).unlink()
        marker.write_text(json.dumps({"generated_by": "rpa-tune report", "files": names}, indent=1) + "\n")
    except OSError as e:
        raise ReportError(f"--out {str(out)!r}: cannot write ({e.strerror or e}); give a writable directory") from None
    return written + [marker]
