"""``rpa-tune export``, ``rpa-tune diff`` and ``rpa-tune precompile``.

Registered on the main Typer app by ``register(app)`` (one line in ``rpa_tune/cli.py``).
"""
from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.table import Table as RichTable

console = Console()
err_console = Console(stderr=True)

DEFAULT_TABLES = Path(__file__).resolve().parent.parent / "tables"


def _fmt_bs(bs) -> str:
    return "-" if bs is None else f"({bs.bq}, {bs.bkv}, {bs.cq}, {bs.ckv})"


def _fmt_s(v) -> str:
    if v is None:
        return "-"
    if v >= 1e-3:
        return f"{v * 1e3:.3f} ms"
    return f"{v * 1e6:.2f} us"


def _fmt_pct(v) -> str:
    return "-" if v is None else f"{v:+.1%}"


# ------------------------------------------------------------------------------ export
def export_cmd(
    results: List[Path] = typer.Option(..., "--results", "-r", help="Results dataset dir or .parquet file; "
                                       "repeat to merge several sweeps / machines."),
    out: Path = typer.Option(DEFAULT_TABLES, "--out", "-o", help="Tables directory (<generation>.json + .parquet)."),
    check: bool = typer.Option(False, "--check", help="Do not write; exit 1 with a diff if the tables in --out "
                               "are stale or missing (for CI)."),
    generation: List[str] = typer.Option([], "--tpu", help="Only these generations (repeatable)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="One line per key with the decision."),
):
    """Bake the best `ok` row per key into versioned tables (promoted only if it beats the heuristic)."""
    from kernel.config import get_generation
    from rpa_tune.export import build_tables, check_tables, read_results, write_tables
    try:
        df = read_results(results)
    except (FileNotFoundError, ValueError) as e:
        err_console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2)
    if len(df) == 0:
        err_console.print(f"[red]error:[/red] no result rows in {', '.join(map(str, results))}")
        raise typer.Exit(2)
    if generation:
        gens = {get_generation(g).name for g in generation}
        df = df[[get_generation(g).name in gens if g else False for g in df["generation"]]]
    tables, reports = build_tables(df)
    promoted = sum(1 for r in reports if r.entry is not None and r.entry.promoted)
    kept = sum(1 for r in reports if r.entry is not None and not r.entry.promoted)
    skipped = [r for r in reports if r.entry is None]
    if verbose or check is False:
        t = RichTable(title="export")
        for c in ("key", "best (bq, bkv, cq, ckv)", "metric", "heuristic", "gain", "decision"):
            t.add_column(c, overflow="fold")
        for r in reports:
            if r.entry is None:
                if verbose:
                    t.add_row(r.key.id() if r.key else "-", "-", "-", "-", "-", r.note)
                continue
            e = r.entry
            if verbose or e.promoted or e.heuristic_metric is None:
                t.add_row(e.key.id(), _fmt_bs(e.block_sizes), _fmt_s(e.metric), _fmt_s(e.heuristic_metric),
                          _fmt_pct(e.gain), e.decision)
        if t.row_count:
            console.print(t)
    console.print(f"export: {len(df)} result rows -> {len(tables)} table(s): {promoted} promoted, "
                  f"{kept} kept the heuristic, {len(skipped)} keys without a usable result", soft_wrap=True)
    if check:
        problems = check_tables(tables, out)
        others = sorted(p.name for p in Path(out).glob("*.json") if p.stem not in tables) if Path(out).is_dir() else []
        if others:
            console.print(f"note: {', '.join(others)} in {out} have no rows in these results (not checked)")
        if problems:
            for p in problems:
                err_console.print(f"[red]{p.file}: {p.problem}[/red]")
                if p.diff:
                    console.print(p.diff, markup=False, highlight=False, soft_wrap=True)
            err_console.print(f"[red]{len(problems)} table file(s) stale or missing:[/red] run "
                              f"`rpa-tune export --results ... --out {out}` and commit the result")
            raise typer.Exit(1)
        console.print(f"[green]tables in {out} are up to date[/green] ({', '.join(f'{g}.json' for g in tables)})")
        return
    written = write_tables(tables, out)
    for p in written:
        console.print(f"wrote {p}")


# -------------------------------------------------------------------------------- diff
def diff_cmd(
    old: Path = typer.Argument(..., help="Old table file or directory."),
    new: Path = typer.Argument(..., help="New table file or directory."),
    fields: bool = typer.Option(False, "--fields", help="List the changed fields of changed entries."),
):
    """Entries added, removed and changed between two tables, with the metric change."""
    from kernel.tables import TableError
    from rpa_tune.export import changed_fields, diff_tables, load_table_path
    try:
        a, b = load_table_path(old), load_table_path(new)
    except (TableError, OSError) as e:
        err_console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2)
    rows = diff_tables(a, b)
    counts = {k: sum(1 for r in rows if r.change == k) for k in ("added", "removed", "changed")}
    summary = (f"{counts['added']} added, {counts['removed']} removed, {counts['changed']} changed "
               f"({len(a)} -> {len(b)} entries)")
    t = RichTable(title=f"{old} -> {new}")
    for c in ("change", "key", "block sizes", "promoted", "metric old", "metric new", "metric change"):
        t.add_column(c, overflow="fold")
    if fields:
        t.add_column("changed fields", overflow="fold")
    style = {"added": "green", "removed": "red", "changed": "yellow"}
    for r in rows:
        o, n = r.old, r.new
        bs = (_fmt_bs(n.block_sizes) if o is None else _fmt_bs(o.block_sizes) if n is None
              else _fmt_bs(o.block_sizes) if o.block_sizes == n.block_sizes
              else f"{_fmt_bs(o.block_sizes)} -> {_fmt_bs(n.block_sizes)}")
        pr = (str(n.promoted) if o is None else str(o.promoted) if n is None
              else str(o.promoted) if o.promoted == n.promoted else f"{o.promoted} -> {n.promoted}")
        cells = [f"[{style[r.change]}]{r.change}[/]", r.key.id(), bs, pr,
                 _fmt_s(o.metric if o else None), _fmt_s(n.metric if n else None), _fmt_pct(r.metric_change)]
        if fields:
            cells.append(", ".join(changed_fields(o, n)) if (o and n) else "")
        t.add_row(*cells)
    if rows:
        console.print(t)
    console.print(summary, soft_wrap=True)


# -------------------------------------------------------------------------- precompile
def _model_shape(model: str | None, num_q_heads, num_kv_heads, head_dim, q_dtype, kv_dtype):
    """A per-shard ``ModelShape`` from a preset (``rpa_tune.presets``) or explicit heads."""
    from kernel.workload import ModelShape
    if model is None:
        if None in (num_q_heads, num_kv_heads, head_dim):
            raise typer.BadParameter("give --model PRESET or all of --q-heads/--kv-heads/--head-dim")
        return ModelShape(num_q_heads, num_kv_heads, head_dim, q_dtype or "bfloat16", kv_dtype or "bfloat16")
    from rpa_tune.presets import get_preset
    try:
        return get_preset(model).model(q_dtype=q_dtype, kv_dtype=kv_dtype)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


def _int_list(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not a comma-separated list of ints") from None


def precompile_cmd(
    tpu: Optional[str] = typer.Option(None, "--tpu", help="TPU generation to compile for deviceless "
                                      "(v4, v5e, v5p, v6e, tpu7x); default: the local TPU."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Model preset (per-shard attention "
                                        "shape, rpa_tune.presets), e.g. llama3-8b, llama3-70b-tp8."),
    num_q_heads: Optional[int] = typer.Option(None, "--q-heads", help="Query heads per shard (instead of --model)."),
    num_kv_heads: Optional[int] = typer.Option(None, "--kv-heads", help="KV heads per shard."),
    head_dim: Optional[int] = typer.Option(None, "--head-dim", help="Head dimension: 64, 128 or 256."),
    q_dtype: Optional[str] = typer.Option(None, "--dtype", help="Query dtype (default: the preset's)."),
    kv_dtype: Optional[str] = typer.Option(None, "--kv-dtype", help="KV-cache dtype, e.g. float8_e4m3fn."),
    max_num_tokens: int = typer.Option(2048, "--max-num-tokens", help="Largest token bucket."),
    buckets: Optional[str] = typer.Option(None, "--buckets", help="Comma-separated token buckets "
                                          "(default: powers of two from 16 to --max-num-tokens)."),
    max_num_seqs: int = typer.Option(128, "--max-num-seqs"),
    max_model_len: int = typer.Option(8192, "--max-model-len"),
    page_size: int = typer.Option(128, "--page-size"),
    num_pages: Optional[int] = typer.Option(None, "--num-pages", help="KV-cache pages (default: "
                                            "max_num_seqs * ceil(max_model_len / page_size))."),
    cases: str = typer.Option("decode,prefill,mixed", "--cases"),
    per_case: bool = typer.Option(False, "--per-case", help="One executable per case x bucket."),
    sliding_window: Optional[int] = typer.Option(None, "--sliding-window"),
    sm_scale: Optional[float] = typer.Option(None, "--sm-scale", help="Default 1/sqrt(head_dim)."),
    cache_dir: Optional[Path] = typer.Option(None, "--cache-dir", help="JAX persistent compilation cache "
                                             "(default: $JAX_COMPILATION_CACHE_DIR if set)."),
    table: Optional[str] = typer.Option(None, "--table", help="Table file/dir to use (sets RPA_TABLE)."),
    verify_tables: Optional[Path] = typer.Option(None, "--verify-tables", help="Instead: compile the "
                                                 "entries of these tables (file or dir) deviceless."),
    sample: Optional[int] = typer.Option(None, "--sample", help="With --verify-tables: at most N entries "
                                         "(evenly spaced, deterministic)."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the report as JSON."),
    progress: Optional[bool] = typer.Option(None, "--progress/--no-progress"),
):
    """Compile every case x token-bucket variant a server needs (or every table entry) before serving."""
    from kernel.analysis import quiet_libtpu
    quiet_libtpu()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    if table is not None:
        os.environ["RPA_TABLE"] = table
    import kernel
    from kernel import bringup, tables as ktables
    ktables.reset()
    if verify_tables is not None:
        t = _load_for_verify(verify_tables)
        entries = [e for e in t.entries if tpu is None or e.key.generation == kernel.get_generation(tpu).name]
        entries = sample_entries(entries, sample)
        results = bringup.verify_entries(entries, progress=progress, cache_dir=cache_dir)
        rt = RichTable(title=f"verify {verify_tables}: {len(results)} entries compiled deviceless")
        for c in ("key", "block sizes", "status", "seconds"):
            rt.add_column(c, overflow="fold")
        for e, v in results:
            rt.add_row(e.key.id(), _fmt_bs(e.block_sizes), v.status + (f": {v.error[:300]}" if v.error else ""),
                       f"{v.seconds:.2f}")
        console.print(rt)
        if json_out:
            json_out.write_text(json.dumps([{"key": e.key.id(), "status": v.status, "seconds": v.seconds,
                                             "error": v.error} for e, v in results], indent=2) + "\n")
        if any(v.status == "error" for _, v in results):
            raise typer.Exit(1)
        return
    from kernel.workload import ServingLimits
    shape = _model_shape(model, num_q_heads, num_kv_heads, head_dim, q_dtype, kv_dtype)
    limits = ServingLimits(page_size=page_size, max_num_tokens=max_num_tokens, max_num_seqs=max_num_seqs,
                           max_model_len=max_model_len)
    attn = {"sm_scale": sm_scale if sm_scale is not None else shape.head_dim ** -0.5}
    if sliding_window is not None:
        attn["sliding_window"] = sliding_window
    console.print(f"model {shape}  limits {limits}  tpu {tpu or 'local'}")
    report = kernel.precompile(shape, limits, token_buckets=_int_list(buckets), num_pages=num_pages, tpu=tpu,
                               cases=[c for c in cases.split(",") if c], per_case=per_case,
                               cache_dir=cache_dir, progress=progress, **attn)
    rt = RichTable(title=report.summary())
    for c in ("bucket", "cases", "block sizes [source]", "status", "lower s", "compile s"):
        rt.add_column(c, overflow="fold")
    for v in report.variants:
        rt.add_row(str(v.bucket), "+".join(v.cases),
                   "\n".join(f"{c}: {_fmt_bs(bs)} [{src}]" for c, bs, src in v.block_sizes),
                   v.status + (f": {v.error[:300]}" if v.error else ""), f"{v.lower_s:.2f}", f"{v.compile_s:.2f}")
    console.print(rt)
    if json_out:
        json_out.write_text(json.dumps(report.as_dict(), indent=2) + "\n")
    if not report.ok:
        raise typer.Exit(1)


def _load_for_verify(path: Path):
    from kernel.tables import TableError
    from rpa_tune.export import load_table_path
    try:
        return load_table_path(path)
    except (TableError, OSError) as e:
        err_console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2)


def sample_entries(entries: list, n: int | None) -> list:
    """At most ``n`` entries, evenly spaced over the (sorted) list; deterministic."""
    if n is None or n >= len(entries):
        return list(entries)
    if n <= 0:
        return []
    step = len(entries) / n
    return [entries[int(i * step)] for i in range(n)]


def register(app: typer.Typer) -> None:
    """Add ``export``, ``diff`` and ``precompile`` to the main app."""
    app.command("export")(export_cmd)
    app.command("diff")(diff_cmd)
    app.command("precompile")(precompile_cmd)
