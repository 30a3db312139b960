"""``rpa-tune export``, ``rpa-tune diff`` and ``rpa-tune precompile``.

Registered on the main Typer app by ``register(app)`` (one line in ``rpa_tune/cli.py``).
"""
from __future__ import annotations

import json
import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.table import Table as RichTable

from .cli_common import (GENERATION_NAMES, TPU_METAVAR, ExportFormat, HeadDim, JsonFlag, KernelChoice, KvDtypeOpt, KvHeads, MaxModelLen,
                         MaxNumSeqs, MaxNumTokens, Model, OptionalTpu, PageSize, QDtypeOpt, QHeads, SlidingWindow,
                         UsageError, fail, parse_cases, parse_int_list, parse_tpu, resolve_limits, resolve_model,
                         value)
from .ui import _console

console = _console()
err_console = _console(stderr=True)



@contextlib.contextmanager
def _logger_off(name: str):
    """Silence one logger for a block (not for the rest of the process: a library user or a
    test calling the command keeps its warnings afterwards)."""
    lg = logging.getLogger(name)
    was = lg.disabled
    lg.disabled = True
    try:
        yield
    finally:
        lg.disabled = was

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
    results: List[str] = typer.Option(..., "--results", "-r", help="Results dataset dir or .parquet file, or "
                                      "a sweep's --storage URL (postgresql://..., sqlite:///..., a .journal "
                                      "file); repeat to merge several sweeps / machines (a row found in "
                                      "several is kept once)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="--format tables: the tables directory "
                                       "(<generation>.json + .parquet; tpu-inference's in its tpu-inference/ "
                                       "subdirectory); an existing table there is merged with the results (see "
                                       "--replace). vllm-env / sglang: the file to write (default: stdout).",
                                       show_default=False),
    fmt: ExportFormat = typer.Option(ExportFormat.tables, "--format", case_sensitive=False,
                                     help="tables: versioned JSON + Parquet tables (both kernels). vllm-env: "
                                     "RPA_V3_{DECODE,PREFILL,MIXED}_BLOCK_SIZES lines for vLLM-TPU. sglang: a "
                                     "Python module in SGLang-JAX's TUNED_BLOCK_SIZES_V3 layout. The last two are "
                                     "for tpu-inference's kernel."),
    kernel: Optional[KernelChoice] = typer.Option(None, "--kernel", case_sensitive=False,
                                                  help="Whose results to export: rpa-tune (default for tables) or "
                                                  "tpu-inference (default, and the only one, for vllm-env / "
                                                  "sglang).", show_default=False),
    replace: bool = typer.Option(False, "--replace", help="Write only the entries built from these results, "
                                 "dropping the existing table's other keys (default: keep them; new results "
                                 "win per key). vllm-env / sglang: overwrite an existing --out file."),
    check: bool = typer.Option(False, "--check", help="Do not write; exit 1 with a diff if the tables in --out "
                               "differ from what would be written (for CI)."),
    generation: List[str] = typer.Option([], "--tpu", parser=parse_tpu, metavar=TPU_METAVAR,
                                         help="Only these generations (repeatable)."),
    workload_id: List[str] = typer.Option([], "--workload-id", help="Only results of these workloads (id or "
                                          "prefix, repeatable; see the warning when a key has several)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="One line per key with the decision."),
    replace_measured: bool = typer.Option(False, "--replace-measured", help="sglang: write entries of ours "
                                          "over SGLang-JAX's own device-measured ones (default: keep theirs, "
                                          "with a note, where ours were not measured on a device)."),
    traffic: Optional[Path] = typer.Option(None, "--traffic", metavar="FILE", help="vllm-env: the server's "
                                           "kernel calls by case and step tokens (CSV case,tokens[,count] or "
                                           "JSON; server_formats.read_traffic) to choose each tuple over. "
                                           "Default: one call in every token bucket of the results.",
                                           show_default=False),
    json_out: JsonFlag = False,
):
    """Bake the best `ok` row per key into versioned tables (promoted only if it beats the heuristic).

    An existing table in --out is merged: the new results win per key, its other entries are
    kept (--replace drops them); the summary says what was added, changed and kept."""
    from kernel.tables import TableError
    from rpa_tune.export import build_tables, check_tables, merge_tables, read_results, write_tables
    from rpa_tune.kernels import DEFAULT, get_kernel, kernel_names, table_dir
    fmt, kernel = value(fmt), value(kernel)
    traffic_calls = None
    if traffic is not None:
        from .server_formats import TrafficError, read_traffic
        if fmt != "vllm-env":
            fail(f"--traffic applies to --format vllm-env, not --format {fmt}")
        try:
            traffic_calls = read_traffic(traffic)
        except TrafficError as e:
            fail(str(e))
    if fmt == "tables":
        kernel = kernel or DEFAULT
        if out is None:
            fail("--out is required with --format tables (the tables directory)")
        if out.exists() and not out.is_dir():
            fail(f"--out {str(out)!r} exists and is not a directory")
    else:
        writers = [n for n in kernel_names() if fmt in get_kernel(n).server_formats]
        if kernel is None and len(writers) == 1:
            kernel = writers[0]
        if kernel is not None and kernel not in writers:
            fail(f"--format {fmt} writes block sizes for {' or '.join(writers)}, not --kernel {kernel} "
                 "(this project's kernel reads its tables and RPA_{D,P,M}_BLOCK_SIZES itself)")
        if check:
            fail(f"--check compares tables; it does not apply to --format {fmt}")
        if out is not None and out.is_dir():
            fail(f"--out {str(out)!r} is a directory; --format {fmt} writes one file")
        if out is not None and out.exists() and not replace:
            fail(f"--out {str(out)!r} exists; pass --replace to overwrite it")
    try:
        with _logger_off("rpa_tune.store"):      # damaged files: reported below, once
            df = read_results(results)
    except (FileNotFoundError, ValueError) as e:
        fail(str(e))
    if len(df) == 0:
        fail(f"no result rows in {', '.join(map(str, results))}")
    if generation:
        df = df[df["generation"].isin(set(generation))]
    if kernel is None:       # several kernels write this format: the one whose rows these are
        from rpa_tune.kernels import row_kernel
        present = [w for w in writers if w in {row_kernel(k) for k in df.get("kernel", [])}]
        if len(present) != 1:
            fail(f"--format {fmt}: pass --kernel ({' or '.join(writers)}); these results hold rows of "
                 f"{', '.join(present) or 'neither'}")
        kernel = present[0]
    tables, reports = build_tables(df, workload_ids=tuple(workload_id), kernel=kernel)
    if not tables:
        fail(f"no usable {kernel} result rows for {', '.join(generation) or 'any generation'}"
             + (f" and workload {', '.join(workload_id)}" if workload_id else "")
             + f" in {', '.join(map(str, results))}"
             + (f" (tune it with `rpa-tune sweep --kernel {kernel} ...`)" if kernel != DEFAULT else "")
             + _other_kernels_hint(df, kernel),
             code=1)
    if fmt != "tables":
        from rpa_tune.kernels import row_kernel
        rows = [r for r in df.to_dict("records") if row_kernel(r.get("kernel")) == kernel]
        _export_server_format(fmt, tables, out, replace_measured=replace_measured, rows=rows, traffic=traffic_calls)
        return
    out = table_dir(out, kernel)
    try:
        merged, merges = merge_tables(tables, out, replace=replace)
    except TableError as e:
        fail(f"{e}; fix or move the existing table, or pass --replace to overwrite it")
    ambiguous = [r for r in reports if r.entry is not None and r.other_workloads]
    warnings = [f"skipped damaged results file {f}: {why}" for f, why in df.attrs.get("damaged", [])]
    warnings += [f"{r.key.id()}: results for {1 + len(r.other_workloads)} workloads; used the newest, "
                f"{r.entry.provenance.get('workload_id')} ({r.workload}); others: "
                + ", ".join(f"{w} ({d})" for w, d in r.other_workloads.items())
                + "; choose with --workload-id" for r in ambiguous]
    promoted = sum(1 for r in reports if r.entry is not None and r.entry.promoted)
    kept = sum(1 for r in reports if r.entry is not None and not r.entry.promoted)
    skipped = [r for r in reports if r.entry is None]
    summary = (f"export: {len(df)} result rows -> {len(tables)} table(s): {promoted} promoted, "
               f"{kept} kept the heuristic, {len(skipped)} keys without a usable result")
    problems = check_tables(merged, out) if check else []
    written = [] if check else write_tables(merged, out)
    if json_out:
        from .ui import print_json
        print_json(dict(
            out=str(out), check=check, up_to_date=(not problems) if check else None,
            written=[str(p) for p in written], warnings=warnings,
            problems=[dict(file=p.file, problem=p.problem) for p in problems],
            tables={g: dict(entries=len(merged[g]), added=[k.id() for k in m.added],
                            changed=[k.id() for k in m.changed], unchanged=[k.id() for k in m.unchanged],
                            kept=[k.id() for k in m.kept], dropped=[k.id() for k in m.dropped])
                    for g, m in merges.items()},
            keys=[dict(key=r.key.id(), promoted=r.entry.promoted, decision=r.entry.decision,
                       block_sizes=list(r.entry.block_sizes), metric=r.entry.metric,
                       heuristic_metric=r.entry.heuristic_metric, gain=r.entry.gain,
                       workload_id=r.entry.provenance.get("workload_id"))
                  if r.entry is not None else dict(key=r.key.id() if r.key else None, promoted=False,
                                                   decision=r.note)
                  for r in reports]))
        if problems:
            raise typer.Exit(1)
        return
    if verbose or not check:
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
    for w in warnings:
        err_console.print(f"[yellow]warning:[/yellow] {w}", soft_wrap=True, markup=True, highlight=False)
    console.print(summary, soft_wrap=True)
    for m in merges.values():
        console.print(("would be " if check else "") + m.summary(), soft_wrap=True)
    if check:
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
    for p in written:
        console.print(f"wrote {p}", soft_wrap=True)


def _other_kernels_hint(df, kernel: str) -> str:
    """Where the results hold rows of other kernels than ``kernel``: how to export those."""
    if "kernel" not in df:
        return ""
    from rpa_tune.kernels import row_kernel
    others = sorted({row_kernel(k) for k in df["kernel"]} - {kernel})
    return "".join(f" (these results hold {o} rows: export them with --kernel {o})" for o in others)


def _export_server_format(fmt: str, tables, out: Optional[Path], *, replace_measured: bool = False,
                          rows=(), traffic=None) -> None:
    """Write (or print) the vllm-env lines or the SGLang-JAX module of ``tables`` (the latter
    beside the installed sglang-jax's own table: ``server_formats.sglang_module``)."""
    from . import server_formats
    if fmt == "vllm-env":
        text, notes = server_formats.vllm_env(tables, list(rows), traffic)
    else:
        theirs, source = server_formats.installed_sglang_table()
        text, notes = server_formats.sglang_module(tables, theirs=theirs, theirs_source=source,
                                                   replace_measured=replace_measured)
        if theirs is None:
            notes = [f"not compared with SGLang-JAX's own table: {source}"] + notes
    if out is None:
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_name(f".{out.name}.tmp")
            tmp.write_text(text)
            tmp.replace(out)
        except OSError as e:
            fail(f"--out {str(out)!r}: cannot write: {e.strerror or e}")
        err_console.print(f"wrote {out}", soft_wrap=True)
    for n in notes:
        err_console.print(f"note: {n}", soft_wrap=True, markup=False, highlight=False)


# -------------------------------------------------------------------------------- diff
def diff_cmd(
    old: Path = typer.Argument(..., help="Old table file or directory."),
    new: Path = typer.Argument(..., help="New table file or directory."),
    fields: bool = typer.Option(False, "--fields", help="List the changed fields of changed entries."),
    json_out: JsonFlag = False,
):
    """Entries added, removed and changed between two tables, with the metric change.

    Exit code 0: no difference; 1: entries were added, removed or changed; 2: bad input."""
    from kernel.tables import TableError
    from rpa_tune.export import changed_fields, diff_tables, load_table_path
    try:
        a, b = load_table_path(old), load_table_path(new)
    except (TableError, OSError) as e:
        fail(str(e))
    rows = diff_tables(a, b)
    counts = {k: sum(1 for r in rows if r.change == k) for k in ("added", "removed", "changed")}
    summary = (f"{counts['added']} added, {counts['removed']} removed, {counts['changed']} changed "
               f"({len(a)} -> {len(b)} entries)")
    if json_out:
        from .ui import print_json
        print_json(dict(old=str(old), new=str(new), counts=counts, old_entries=len(a), new_entries=len(b),
                        rows=[dict(change=r.change, key=r.key.id(), metric_change=r.metric_change,
                                   old=r.old.to_dict() if r.old else None, new=r.new.to_dict() if r.new else None,
                                   changed_fields=changed_fields(r.old, r.new) if (r.old and r.new) else [])
                              for r in rows]))
    else:
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
    if rows:
        raise typer.Exit(1)


# -------------------------------------------------------------------------- precompile
def precompile_cmd(
    tpu: OptionalTpu = None,
    model: Model = "llama3-8b",
    num_q_heads: QHeads = None,
    num_kv_heads: KvHeads = None,
    head_dim: HeadDim = None,
    q_dtype: QDtypeOpt = None,
    kv_dtype: KvDtypeOpt = None,
    max_num_tokens: MaxNumTokens = 2048,
    buckets: Optional[str] = typer.Option(None, "--buckets", help="Comma-separated token buckets "
                                          "(default: powers of two from 16 to --max-num-tokens)."),
    max_num_seqs: MaxNumSeqs = 128,
    max_model_len: MaxModelLen = 8192,
    page_size: PageSize = 128,
    num_pages: Optional[int] = typer.Option(None, "--num-pages", min=1, help="KV-cache pages (default: "
                                            "max_num_seqs * ceil(max_model_len / page_size))."),
    cases: str = typer.Option("decode,prefill,mixed", "--cases", help="Comma-separated cases in the "
                              "executable: decode, prefill, mixed."),
    per_case: bool = typer.Option(False, "--per-case", help="One executable per case x bucket."),
    sliding_window: SlidingWindow = None,
    sm_scale: Optional[float] = typer.Option(None, "--sm-scale", help="Default 1/sqrt(head_dim)."),
    cache_dir: Optional[Path] = typer.Option(None, "--cache-dir", help="JAX persistent compilation cache "
                                             "(default: $JAX_COMPILATION_CACHE_DIR if set)."),
    table: Optional[str] = typer.Option(None, "--table", help="Table file/dir to use (sets RPA_TABLE)."),
    verify_tables: Optional[Path] = typer.Option(None, "--verify-tables", help="Instead: compile the "
                                                 "entries of these tables (file or dir) deviceless."),
    sample: Optional[int] = typer.Option(None, "--sample", min=0, help="With --verify-tables: at most N "
                                         "entries (evenly spaced, deterministic)."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the report as JSON to this file."),
    progress: Optional[bool] = typer.Option(None, "--progress/--no-progress"),
):
    """Compile every case x token-bucket variant a server needs (or every table entry) before serving."""
    if json_out is not None and json_out.is_dir():
        fail(f"--json {str(json_out)!r} is a directory; give a file path")
    if verify_tables is None:
        try:
            shape, _ = resolve_model(model, num_q_heads, num_kv_heads, head_dim, q_dtype, kv_dtype)
            limits = resolve_limits(page_size, max_num_tokens, max_num_seqs, max_model_len)
            token_buckets = parse_int_list("--buckets", buckets)
            case_list = parse_cases(cases)
        except UsageError as e:
            fail(str(e))
        if tpu is None:
            import glob
            # TPU VMs expose /dev/accel* (v4, v5p) or /dev/vfio/<n> (v5e and later); without
            # either, initialising libtpu only prints its own start-up errors before ours
            where = "no TPU device file (/dev/accel*, /dev/vfio/<n>)"
            if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
                import jax
                where = f"the default device is {jax.devices()[0].platform}"
            if not where.endswith("tpu"):
                fail(f"no local TPU ({where}); pass --tpu "
                     f"{'|'.join(GENERATION_NAMES)} to compile deviceless")
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
        entries = [e for e in t.entries if tpu is None or e.key.generation == tpu]
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
            _write_text(json_out, json.dumps([{"key": e.key.id(), "status": v.status, "seconds": v.seconds,
                                               "error": v.error} for e, v in results], indent=2) + "\n")
        if any(v.status == "error" for _, v in results):
            raise typer.Exit(1)
        return
    attn = {"sm_scale": sm_scale if sm_scale is not None else shape.head_dim ** -0.5}
    if sliding_window is not None:
        attn["sliding_window"] = sliding_window
    console.print(f"model {shape}  limits {limits}  tpu {tpu or 'local'}", soft_wrap=True)
    try:
        report = kernel.precompile(shape, limits, token_buckets=token_buckets, num_pages=num_pages, tpu=tpu,
                                   cases=case_list, per_case=per_case, cache_dir=cache_dir, progress=progress,
                                   **attn)
    except ValueError as e:     # an input the kernel refuses (checked before any compile)
        fail(str(e))
    rt = RichTable(title=report.summary())
    for c in ("bucket", "cases", "block sizes [source]", "status", "lower s", "compile s"):
        rt.add_column(c, overflow="fold")
    for v in report.variants:
        rt.add_row(str(v.bucket), "+".join(v.cases),
                   "\n".join(f"{c}: {_fmt_bs(bs)} [{src}]" for c, bs, src in v.block_sizes),
                   v.status + (f": {v.error[:300]}" if v.error else ""), f"{v.lower_s:.2f}", f"{v.compile_s:.2f}")
    console.print(rt)
    if json_out:
        _write_text(json_out, json.dumps(report.as_dict(), indent=2) + "\n")
    if not report.ok:
        raise typer.Exit(1)


def _write_text(path: Path, text: str) -> None:
    """Atomic write (a temporary file renamed into place): never a half-written report."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _load_for_verify(path: Path):
    from kernel.tables import TableError
    from rpa_tune.export import load_table_path
    try:
        return load_table_path(path)
    except (TableError, OSError) as e:
        fail(str(e))


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
