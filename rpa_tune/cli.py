"""``rpa-tune``: find the block sizes of the Ragged Paged Attention kernel.

Commands: ``sweep`` (tune; ``--storage`` shares one sweep among many workers), ``status``
(progress of a shared sweep), ``show`` (winners), ``compare`` (our kernel vs tpu-inference's), ``verify`` (check winners in interpret
mode), ``report`` (a static HTML page: heatmaps and coverage; ``html_report``), ``doctor`` (what works
on this machine); ``export``, ``diff`` and ``precompile`` in
``cli_tables``. Bad input exits with code 2 and a one-line message before anything is
written (``cli_common``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .cli_common import (BackendChoice, HeadDim, JsonFlag, KernelOpt, KvDtypeOpt, KvHeads, MaxModelLen,
                         MaxNumSeqs, MaxNumTokens, Model, OptionalTpu, PageSize, QDtypeOpt, QHeads, ResultBackend,
                         RpaTuneGroup, SearchChoice, Status, SweepCase, CaseChoice, Tpu, UsageError, fail,
                         parse_int_list, resolve_limits, resolve_model, value)
from .kernels import DEFAULT as DEFAULT_KERNEL

app = typer.Typer(
    name="rpa-tune", cls=RpaTuneGroup, no_args_is_help=True, pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    help="Tune the block sizes (bq, bkv, cq, ckv) of the Ragged Paged Attention TPU kernel.\n\n"
         "On a TPU VM configs are timed on the device; elsewhere they are compiled for the "
         "target TPU with libtpu (deviceless) and ranked by a static estimate.")

_fail = fail     # older name


def _resolve_backend(backend: str, generation: str) -> tuple[str, str]:
    """(backend, why) for ``auto``; checks that ``tpu`` is possible here."""
    if backend in ("compile", "interpret"):
        return backend, "requested"
    from .evaluators.tpu import probe_devices, tpu_generation_present
    probe = probe_devices()
    here = tpu_generation_present(probe)
    if backend == "tpu":
        if here != generation:
            found = f"TPU {here}" if here else f"no TPU ({probe.get('platform')})"
            raise UsageError(f"--backend tpu needs a TPU {generation} here, found {found}; "
                             "use --backend compile to compile deviceless")
        return "tpu", f"TPU {here} present"
    if here == generation:
        return "tpu", f"auto: a TPU {generation} is present"
    return "compile", ("auto: no TPU here" if here is None else f"auto: this TPU is {here}, not {generation}") + \
        " -> deviceless compile + static estimate"


# ============================================================================ sweep
@app.command()
def sweep(
    tpu: Tpu,
    kernel: KernelOpt = DEFAULT_KERNEL,
    case: SweepCase = typer.Option(SweepCase.decode, "--case", case_sensitive=False,
                                   help="Kernel case to tune; all: one sweep per case."),
    model: Model = "llama3-8b",
    q_heads: QHeads = None,
    kv_heads: KvHeads = None,
    head_dim: HeadDim = None,
    dtype: QDtypeOpt = None,
    kv_dtype: KvDtypeOpt = None,
    page_size: PageSize = 128,
    max_num_tokens: MaxNumTokens = 2048,
    buckets: Optional[str] = typer.Option(None, "--buckets", help="Comma-separated token buckets to sweep one "
                                          "after the other (one key each), e.g. 256,512,2048; replaces "
                                          "--max-num-tokens.", show_default=False),
    max_num_seqs: MaxNumSeqs = 128,
    max_model_len: MaxModelLen = 8192,
    sliding_window: Optional[int] = typer.Option(None, "--sliding-window", min=1, help="Tune the key of a "
                                                 "sliding-window attention layer: the kernel runs with this "
                                                 "window (tokens), and the results go to the key's "
                                                 "sliding_window=true entry. Default: full attention.",
                                                 show_default=False),
    soft_cap: Optional[float] = typer.Option(None, "--soft-cap", min=0.001, help="Tune with logit soft-capping "
                                             "(cap * tanh(logits / cap), e.g. 50 for Gemma-2), as the model's "
                                             "layers run; the key does not record it. Default: none.",
                                             show_default=False),
    workload: Optional[Path] = typer.Option(None, "--workload", help="JSON/CSV file of per-sequence q_len, kv_len "
                                            "(optional case column) to tune on instead of the generated workload.",
                                            show_default=False),
    num_seqs: int = typer.Option(64, "--num-seqs", min=1, help="Generated decode workload: number of sequences."),
    context: str = typer.Option("lognormal:2048:0.8", "--context", help="Generated decode/mixed workloads: context "
                                "length distribution, lognormal:MEDIAN:SIGMA | uniform:LO:HI | fixed:N."),
    chunk: int = typer.Option(1024, "--chunk", min=1, help="Generated prefill workload: chunk size in tokens."),
    num_chunks: int = typer.Option(2, "--num-chunks", min=1, help="Generated prefill workload: number of chunks."),
    seed: int = typer.Option(0, "--seed", help="Seed of the workload generators and of random/tpe search."),
    backend: BackendChoice = typer.Option(BackendChoice.auto, "--backend", case_sensitive=False,
                                          help="auto: tpu when a TPU of --tpu's generation is here, else "
                                          "compile. tpu: time on the device. compile: deviceless libtpu "
                                          "compile, ranked by the static estimate. interpret: correctness "
                                          "only (CPU)."),
    search: SearchChoice = typer.Option(SearchChoice.tpe, "--search", case_sensitive=False,
                                        help="grid (exhaustive), random (seeded) or tpe (Optuna; runs grid "
                                        "when the candidates fit in --budget)."),
    budget: int = typer.Option(20, "--budget", min=1, help="Max configs per case (recorded ones included, so a "
                               "rerun resumes). The default decode space of llama3-8b has 18 candidates: the "
                               "bare `rpa-tune sweep --tpu v6e --case decode` evaluates all of them (a few "
                               "minutes with --jobs 2 on an idle 2-core machine)."),
    patience: int = typer.Option(10, "--patience", min=0, help="tpe: stop after this many evaluations without a "
                                 "0.5% improvement (0: never)."),
    refine: int = typer.Option(0, "--refine", min=0, help="tpe / random: after --budget (or --patience), climb "
                               "from the best config: evaluate its neighbours (one or two block sizes doubled "
                               "or halved, or bq with cq and bkv with ckv) while one beats it, at most this many "
                               "more (0: no climb)."),
    seeds: int = typer.Option(0, "--seeds", min=0, help="--buckets with the compile backend: each bucket's "
                              "search first evaluates what the other buckets of the key evaluated ok (in "
                              "--results, and with --storage in the storage's studies); only "
                              "the N best of each other bucket, per batch and evaluator version priced there (0: all "
                              "of them)."),
    jobs: int = typer.Option(2, "--jobs", "-j", min=1, help="Parallel evaluations (worker processes); with the "
                             "compile backend each compiles its config's probes on cores / jobs processes "
                             "(RPA_TUNE_PROBE_WORKERS overrides); the tpu backend uses 1."),
    timeout: float = typer.Option(900.0, "--timeout", min=0.001, help="Seconds per evaluation before it is "
                                  "killed and recorded as timeout."),
    results: Path = typer.Option(Path("results"), "--results", help="Results directory (append-only Parquet "
                                 "dataset; created on the first result)."),
    space: Optional[Path] = typer.Option(None, "--space", help="Search-space TOML file (default: the shipped "
                                         "search_spaces/<tpu>.toml).", show_default=False),
    retry: list[Status] = typer.Option([], "--retry", case_sensitive=False,
                                       help="Evaluate configs recorded with this status again (repeatable), "
                                       "e.g. --retry timeout --retry crash."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan (candidates, pre-filter) and exit "
                                 "without evaluating or writing anything."),
    storage: Optional[str] = typer.Option(None, "--storage", help="Share the sweep with every worker started with "
                                          "the same command and URL: postgresql://USER@HOST/DB (a fleet), "
                                          "sqlite:///PATH.db or PATH.journal (one machine). Configs are claimed "
                                          "through Optuna's storage (none is evaluated twice); --retry, "
                                          "--seeds and --refine apply to the shared sweep; rows go to "
                                          "--results and to the storage. Default: this process alone.",
                                          show_default=False),
    heartbeat: float = typer.Option(10.0, "--heartbeat", min=1, help="--storage: seconds between a worker's "
                                    "heartbeats for the configs it evaluates."),
    grace: float = typer.Option(60.0, "--grace", min=2, help="--storage: a config whose worker has not beaten "
                                "for this long is given back to the study and evaluated by another worker."),
    json_out: JsonFlag = False,
):
    """Tune block sizes for one TPU generation and case(s); results go to --results."""
    try:
        specs, backend_note = _build_specs(
            tpu=tpu, case=value(case), model=model, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
            dtype=dtype, kv_dtype=kv_dtype, page_size=page_size, max_num_tokens=max_num_tokens, buckets=buckets,
            max_num_seqs=max_num_seqs, max_model_len=max_model_len, workload=workload, num_seqs=num_seqs,
            context=context, chunk=chunk, num_chunks=num_chunks, seed=seed, backend=value(backend),
            search=value(search), budget=budget, patience=patience, refine=refine, seeds=seeds, jobs=jobs,
            timeout=timeout, results=results, space=space, retry=[value(r) for r in retry], dry_run=dry_run,
            sliding_window=sliding_window, kernel=value(kernel), soft_cap=soft_cap)
        if storage is not None:
            from .distributed import StorageError, parse_storage
            try:
                parse_storage(storage)
            except StorageError as e:
                raise UsageError(str(e)) from None
    except UsageError as e:
        fail(str(e))
    from . import ui
    from .engine import run_sweep
    from .store import ResultStore
    store = ResultStore(results)
    opened = None
    if storage is not None and not dry_run:
        from .distributed import StorageError, open_storage
        try:
            opened = open_storage(storage, heartbeat=heartbeat, grace=max(grace, 2 * heartbeat))
        except StorageError as e:
            fail(str(e))
    outcomes = []
    for spec in specs:
        if dry_run:
            ui.print_plan(spec, backend_note, results, json_out=json_out)
            continue
        if opened is None:
            ui.print_header(spec, backend_note, results)
            with ui.sweep_progress() as progress:
                outcome = run_sweep(spec, store, events=progress)
        else:
            from .distributed import StorageError, StudyMismatch, StudyScheduler, lost_storage_message, parse_storage
            where = parse_storage(storage).display()
            ui.print_header(spec, backend_note, results, storage=where)
            sched = StudyScheduler(opened, where, heartbeat=heartbeat, grace=max(grace, 2 * heartbeat))
            try:
                with ui.sweep_progress() as progress:
                    outcome = run_sweep(spec, store, scheduler=sched, events=progress)
            except (StudyMismatch, StorageError) as e:
                fail(str(e))
            except Exception as e:  # noqa: BLE001 - the storage went away mid-sweep
                msg = lost_storage_message(e, storage)
                if msg is None:
                    raise
                fail(msg, code=1)
        outcomes.append(outcome)
        if not json_out:
            ui.print_summary(outcome, store)
        if outcome.interrupted:
            break
    if json_out and not dry_run:
        ui.print_json([ui.outcome_dict(o) for o in outcomes])
    elif len(outcomes) > 1:
        ui.print_overall(outcomes)
    if any(o.interrupted for o in outcomes):
        raise typer.Exit(130)


def _build_specs(*, tpu, case, model, q_heads, kv_heads, head_dim, dtype, kv_dtype, page_size, max_num_tokens,
                 max_num_seqs, max_model_len, workload, num_seqs, context, chunk, num_chunks, seed, backend,
                 search, budget, patience, jobs, timeout, results, space, retry, dry_run, buckets=None, refine=0,
                 seeds=0, sliding_window=None, kernel=DEFAULT_KERNEL, soft_cap=None):
    """Validate every input and build one SweepSpec per bucket x case (no side effects)."""
    from kernel.config import Case
    from .kernels import KernelError, get_kernel
    if results.exists() and not results.is_dir():
        raise UsageError(f"--results {str(results)!r} exists and is not a directory")
    try:
        kern = get_kernel(kernel)
        kern.check_available()
    except KernelError as e:
        raise UsageError(f"--kernel {kernel}: {e}") from None
    if backend == "interpret" and not kern.interpretable:
        from .evaluators.interpret import INTERPRET_UNSUPPORTED
        raise UsageError("--backend interpret: " + INTERPRET_UNSUPPORTED.format(kern.name))
    m, model_label = resolve_model(model, q_heads, kv_heads, head_dim, dtype, kv_dtype)
    if sliding_window is not None and sliding_window >= max_model_len:
        raise UsageError(f"--sliding-window {sliding_window} is not below --max-model-len {max_model_len}: "
                         "such a window hides no token (tune the full-attention key: omit --sliding-window)")
    token_buckets = parse_int_list("--buckets", buckets) or [max_num_tokens]
    limits_per_bucket = [resolve_limits(page_size, t, max_num_seqs, max_model_len) for t in sorted(set(token_buckets))]
    from .space import SpaceError, load_space
    try:
        sp = load_space(tpu, space)
    except SpaceError as e:
        raise UsageError(str(e)) from None
    from .workloads import WorkloadError, describe, make_workload, parse_distribution
    try:
        parse_distribution(context)
    except WorkloadError as e:
        raise UsageError(f"--context: {e}") from None
    if workload is not None and not workload.is_file():
        raise UsageError(f"--workload {str(workload)!r} is not a file")
    cases = [Case.DECODE, Case.PREFILL, Case.MIXED] if case == "all" else [Case.parse(case)]
    if any(c.value not in kern.cases for c in cases):
        raise UsageError(f"--case {case}: not a stage of --kernel {kern.name}; valid: {', '.join(kern.cases)}")
    from .engine import SweepSpec, plan_sweep, problem_key
    if dry_run and backend == "auto":
        be, note = "compile", "dry run: auto not probed, assuming compile"
    else:
        be, note = _resolve_backend(backend, tpu)
    specs = []
    for limits in limits_per_bucket:
        for c in cases:
            try:
                w, origin = make_workload(c, limits, seed=seed, path=workload, num_seqs=num_seqs, context=context,
                                          chunk=chunk, num_chunks=num_chunks, kernel=kern.name)
                cs = sp.for_case(c)
            except (WorkloadError, SpaceError) as e:
                raise UsageError(str(e)) from None
            key = problem_key(tpu, c, m, limits, sliding_window=sliding_window is not None)
            window = f", sliding window {sliding_window}" if sliding_window is not None else ""
            window += f", soft cap {soft_cap:g}" if soft_cap is not None else ""
            spec = SweepSpec(key=key, model=m, limits=limits, workload=w,
                             workload_desc=f"{describe(w)}{window} [{origin}]", case_space=cs, backend=be,
                             search=search, budget=budget, seed=seed, jobs=jobs, timeout=timeout,
                             patience=patience, refine=refine, seeds=seeds, retry=tuple(retry),
                             model_label=model_label,
                             sliding_window=sliding_window, kernel=kern.name, soft_cap=soft_cap)
            try:
                plan = plan_sweep(spec)
            except SpaceError as e:
                raise UsageError(str(e)) from None
            if not plan.candidates or plan.total == plan.illegal + plan.capped:
                why = "; ".join(f"{n} x {r}" for r, n in sorted(plan.reasons.items(), key=lambda x: -x[1])[:3])
                raise UsageError(f"{sp.source}: no legal candidate for {spec.key_id} ({plan.total} in the space: "
                                 f"{plan.illegal} illegal, {plan.capped} over a size cap, {plan.prefiltered} "
                                 f"rejected by the VMEM pre-filter" + (f"; {why}" if why else "") + ")")
            specs.append(spec)
    return specs, note


# ============================================================================= show
def _results_store(results: Path):
    """The results store ``show``, ``compare`` and ``verify`` read; exit 2 if there is none."""
    if not results.is_dir():
        fail(f"no results directory {str(results)!r} (run `rpa-tune sweep` first or pass --results DIR)")
    from .store import ResultStore
    return ResultStore(results)


# the options show and compare read results with
ResultsDir = Annotated[Path, typer.Option("--results", help="Results directory to read.")]
CaseFilter = Annotated[Optional[CaseChoice], typer.Option("--case", case_sensitive=False,
                                                          help="Only this case. Default: all.")]
BackendFilter = Annotated[Optional[ResultBackend], typer.Option(
    "--backend", case_sensitive=False, help="Only results of this backend. Default: tpu and compile.")]


@app.command()
def show(
    results: ResultsDir = Path("results"),
    tpu: OptionalTpu = None,
    case: CaseFilter = None,
    backend: BackendFilter = None,
    top: int = typer.Option(1, "--top", min=1, help="Configs listed per key (1: the winner only)."),
    json_out: JsonFlag = False,
):
    """Best configs per tuning key as a table, with status counts and the gain over the heuristic."""
    df = _results_store(results).read_current()
    from . import ui
    from .report import winners
    groups = winners(df, tpu=tpu, case=value(case), backend=value(backend), top=top)
    if json_out:
        ui.print_json([ui.group_dict(g) for g in groups])
        if not groups:
            raise typer.Exit(1)
        return
    if not groups:
        fail(f"no matching results in {str(results)!r}", code=1)
    ui.print_winners(groups, top=top)


# ========================================================================== compare
@app.command()
def compare(
    results: ResultsDir = Path("results"),
    tpu: OptionalTpu = None,
    case: CaseFilter = None,
    backend: BackendFilter = None,
    json_out: JsonFlag = False,
):
    """This project's kernel against tpu-inference's RPA v3, per key tuned for both: each at
    its best, the same workload and method, and the ratio."""
    df = _results_store(results).read_current()
    from . import ui
    from .report import compare_kernels
    rows = compare_kernels(df, tpu=tpu, case=value(case), backend=value(backend))
    if json_out:
        ui.print_json([ui.comparison_dict(c) for c in rows])
    elif rows:
        ui.print_comparison(rows)
    if not rows:
        fail(f"no key in {str(results)!r} is tuned for both kernels (sweep the same key with --kernel rpa-tune "
             "and --kernel tpu-inference)", code=1)


# =========================================================================== report
@app.command()
def report(
    results: ResultsDir = Path("results"),
    out: Path = typer.Option(..., "--out", "-o", help="Directory for index.html and its PNG heatmaps: new, "
                             "empty, or holding an earlier report (see --force).", show_default=False),
    tables: Optional[Path] = typer.Option(None, "--tables", help="Tables directory the coverage matrix takes "
                                          "'tuned' from. Default: the shipped tables.", show_default=False),
    tpu: OptionalTpu = None,
    case: CaseFilter = None,
    backend: BackendFilter = None,
    key: Optional[str] = typer.Option(None, "--key", help="Only keys whose id contains this text, e.g. "
                                      "v6e/decode or h8x1 (the coverage matrix always covers every key).",
                                      show_default=False),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="At most this many keys (in `show`'s "
                                        "order). Default: all.", show_default=False),
    force: bool = typer.Option(False, "--force", help="Write into a non-empty --out that holds no earlier "
                               "report (its other files are left alone)."),
):
    """A static HTML page of the results: per key the winner, the heuristic, the gain and a
    heatmap over the block sizes; and a coverage matrix of generation x model shape x case x
    token bucket against the tables."""
    from .html_report import ReportError, check_out
    if not results.is_dir():
        fail(f"--results {str(results)!r} is not a directory (give the directory `rpa-tune sweep --results` "
             "wrote)")
    try:
        check_out(out, force)
    except ReportError as e:
        fail(str(e))
    from kernel.tables import TableError
    from kernel.tables.loading import shipped_table_dir
    from .export import load_table_path
    tdir = tables if tables is not None else shipped_table_dir()
    if tdir is None:
        fail("no shipped tables found; pass --tables DIR (a directory of <generation>.json tables)")
    if not Path(tdir).is_dir():
        fail(f"--tables {str(tdir)!r} is not a directory (give a directory of <generation>.json tables, as "
             "`rpa-tune export --out` writes)")
    try:
        entries = load_table_path(tdir).entries
    except (TableError, OSError) as e:
        fail(f"--tables {str(tdir)!r}: {e}")
    from .store import ResultStore
    df = ResultStore(results).read_current()
    if df.empty:
        fail(f"--results {str(results)!r} holds no result rows (no readable *.parquet files); give the directory "
             "`rpa-tune sweep --results` wrote")
    from .html_report import gather, write_report
    data = gather(df, entries, results=str(results), tables=str(tdir), tpu=tpu, case=value(case),
                  backend=value(backend), key=key, limit=limit)
    if not data.sections:
        fail(f"no matching results in {str(results)!r}" + (f" for --key {key!r}" if key else ""), code=1)
    try:
        written = write_report(data, out, force)
    except ReportError as e:
        fail(str(e))
    from . import ui
    ui.out.print(f"wrote {out / 'index.html'}: {len(data.sections)} key(s), {len(written) - 2} heatmap(s)",
                 soft_wrap=True, markup=False)


# =========================================================================== verify
@app.command()
def verify(
    results: Path = typer.Option(Path("results"), "--results", help="Results directory to read and append to."),
    tpu: OptionalTpu = None,
    case: Optional[CaseChoice] = typer.Option(None, "--case", case_sensitive=False,
                                              help="Only this case. Default: all."),
    top: int = typer.Option(1, "--top", min=1, help="Verify the best N configs per key."),
    jobs: int = typer.Option(2, "--jobs", "-j", min=1, help="Parallel interpret runs."),
    timeout: float = typer.Option(900.0, "--timeout", min=0.001, help="Seconds per config before it is killed."),
):
    """Run the chosen configs in interpret mode against the reference (CPU); record the verdicts.

    A config found wrong is recorded as wrong_result and is never shown as a winner again.
    Exit code 1 when any config is wrong.
    """
    store = _results_store(results)
    from . import ui
    from .report import verify_winners
    rows = verify_winners(store, tpu=tpu, case=value(case), top=top, jobs=jobs, timeout=timeout,
                          progress=ui.VerifyProgress())
    if not rows:
        fail(f"no winners to verify in {str(results)!r}", code=1)
    ui.print_verify(rows)
    if any(r["status"] != "ok" for r in rows):
        raise typer.Exit(1)


# =========================================================================== doctor
@app.command()
def doctor(
    quick: bool = typer.Option(False, "--quick", help="Skip the trial compile / interpret runs (versions, "
                               "devices, tables and paths only)."),
    tpu: Tpu = "v6e",
):
    """Versions, devices, which backends work here, the loaded tables and the compilation cache."""
    from . import ui
    from .report import doctor_report
    ui.print_doctor(doctor_report(tpu=tpu, quick=quick))


@app.command()
def fingerprint(
    record: bool = typer.Option(False, "--record", help="Write the programs' digests for the current "
                                "KERNEL_VERSION and JAX into kernel/program_fingerprint.json (after a "
                                "deliberate version bump)."),
    json_out: JsonFlag = False,
):
    """Lower the kernel's canonical programs deviceless and check them against the fingerprint
    recorded for its KERNEL_VERSION (exit 1 when they changed without a version bump)."""
    from . import fingerprint as fp
    from . import ui
    check = fp.check()
    if record:
        fp.record(check.programs)
        check = fp.check(check.programs)
    if json_out:
        ui.print_json(dict(status=check.status, jax_version=check.jax_version, changed=check.changed,
                           fingerprint=fp.fingerprint(check.programs), programs=check.programs))
    else:
        print(check.line())
    if check.status == "changed":
        raise typer.Exit(1)


@app.command()
def status(
    storage: str = typer.Option(..., "--storage", help="The URL the workers were started with "
                                "(postgresql://..., sqlite:///PATH.db, PATH.journal)."),
    json_out: JsonFlag = False,
):
    """Progress of the sweeps in a --storage: per study, configs done / running / left, best so far, workers seen."""
    from . import ui
    from .distributed import StorageError, parse_storage, study_status
    try:
        where = parse_storage(storage).display()
        studies = study_status(storage)
    except StorageError as e:
        fail(str(e))
    if json_out:
        ui.print_json([ui.status_dict(s) for s in studies])
    else:
        ui.print_status(studies, where)
    if not studies:
        fail(f"no rpa-tune study in {where}", code=1)


@app.command()
def selftest(
    quick: bool = typer.Option(False, "--quick", help="A few rows of each part (minutes, not the full matrix)."),
    out: Path = typer.Option(Path("rpa-tune-selftest"), "--out", "-o", help="Directory for selftest.md and "
                             "selftest.json (created; earlier reports there are replaced)."),
    estimate: bool = typer.Option(True, "--estimate/--no-estimate", help="Estimate each probe deviceless "
                                  "(compile workers on the CPU, beside the device work) to set beside its "
                                  "device time."),
    jobs: int = typer.Option(2, "--jobs", "-j", min=1, help="Compile workers for the estimates."),
    json_out: JsonFlag = False,
):
    """On a TPU VM: our kernel on the chip against the reference (every case, head_dim 64 / 128 /
    256, fp8 KV, window, soft cap, pages 128 / 256, ragged batches), and a probe set timed for
    both kernels beside their deviceless estimates; one report (Markdown + JSON) to attach to
    an issue. Exit 1 when anything failed; without a TPU, one line and exit 2."""
    from .selftest import SelftestError, main as run_selftest
    if out.exists() and not out.is_dir():
        fail(f"--out {str(out)!r} exists and is not a directory")
    try:
        code = run_selftest(quick=quick, out=out, estimate=estimate, jobs=jobs, json_out=json_out)
    except SelftestError as e:
        fail(str(e))
    raise typer.Exit(code)


@app.command()
def presets():
    """List the shipped model presets (per-shard attention shapes)."""
    from . import ui
    from .presets import PRESETS
    ui.print_presets(PRESETS)


# export / diff / precompile live in cli_tables (tables workflow)
from .cli_tables import register as _register_tables  # noqa: E402
_register_tables(app)
from .cli_calibrate import register as _register_calibrate  # noqa: E402  (calibrate: cli_calibrate)
_register_calibrate(app)
from .check import register as _register_check  # noqa: E402  (check: rpa_tune/check.py)
_register_check(app)


def main():  # pragma: no cover - console entry point helper
    app()


if __name__ == "__main__":  # pragma: no cover
    app()
