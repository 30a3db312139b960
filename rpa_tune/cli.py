"""``rpa-tune``: find the block sizes of the Ragged Paged Attention kernel.

Commands: ``sweep`` (tune), ``show`` (winners), ``verify`` (check winners in interpret
mode), ``doctor`` (what works on this machine). Bad input exits with code 2 and a
one-line message before anything is written.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

GENERATION_NAMES = ("v4", "v5e", "v5p", "v6e", "tpu7x")   # kernel.config.GENERATIONS (checked at run time)
CASE_CHOICES = ("decode", "prefill", "mixed", "all")
BACKEND_CHOICES = ("auto", "tpu", "compile", "interpret")
SEARCH_CHOICES = ("grid", "random", "tpe")
STATUS_NAMES = ("ok", "vmem_oom", "compile_error", "timeout", "wrong_result", "crash")
Q_DTYPES = ("bfloat16", "float32")
KV_DTYPES = ("bfloat16", "float8_e4m3fn")
HEAD_DIMS = (64, 128, 256)

app = typer.Typer(
    name="rpa-tune", no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode="rich",
    help="Tune the block sizes (bq, bkv, cq, ckv) of the Ragged Paged Attention TPU kernel.\n\n"
         "On a TPU VM configs are timed on the device; elsewhere they are compiled for the "
         "target TPU with libtpu (deviceless) and ranked by a static estimate.")


class UsageError(Exception):
    """Bad command-line input: reported in one line, exit code 2."""


def _fail(msg: str, code: int = 2):
    sys.stderr.write(f"rpa-tune: error: {msg}\n")
    sys.stderr.flush()
    raise typer.Exit(code)


def _choices(values):
    def complete(incomplete: str):
        return [v for v in values if v.startswith(incomplete)]
    return complete


def _preset_names():
    from .presets import PRESETS
    return list(PRESETS)


def _complete_presets(incomplete: str):
    return [p for p in _preset_names() if p.startswith(incomplete)]


def _one_of(name: str, value: str, valid) -> str:
    if value not in valid:
        raise UsageError(f"unknown {name} {value!r}; valid: {', '.join(valid)}")
    return value


def _positive(name: str, value: int) -> int:
    if value is None or value <= 0:
        raise UsageError(f"{name}={value} must be a positive integer")
    return value


# ============================================================================ sweep
def _resolve_model(model, q_heads, kv_heads, head_dim, dtype, kv_dtype):
    from kernel.workload import ModelShape
    from .presets import get_preset
    explicit = [q_heads, kv_heads, head_dim]
    if any(v is not None for v in explicit):
        if not all(v is not None for v in explicit):
            raise UsageError("an explicit shape needs --q-heads, --kv-heads and --head-dim together "
                             "(or use --model PRESET)")
        label = f"custom ({q_heads}/{kv_heads} heads, head_dim {head_dim})"
        base_q, base_kv = "bfloat16", "bfloat16"
    else:
        try:
            p = get_preset(model)
        except ValueError as e:
            raise UsageError(str(e)) from None
        q_heads, kv_heads, head_dim = p.num_q_heads, p.num_kv_heads, p.head_dim
        label = f"{p.name} ({p.description})"
        base_q, base_kv = p.q_dtype, p.kv_dtype
    q_dtype = dtype or base_q
    kvd = kv_dtype or base_kv
    _one_of("--dtype", q_dtype, Q_DTYPES)
    _one_of("--kv-dtype", kvd, KV_DTYPES)
    _positive("--q-heads", q_heads)
    _positive("--kv-heads", kv_heads)
    if head_dim not in HEAD_DIMS:
        raise UsageError(f"--head-dim {head_dim} is not supported by the kernel; valid: "
                         f"{', '.join(map(str, HEAD_DIMS))}")
    if q_heads % kv_heads:
        raise UsageError(f"--q-heads {q_heads} is not a multiple of --kv-heads {kv_heads} "
                         "(every KV head serves the same number of query heads)")
    return ModelShape(q_heads, kv_heads, head_dim, q_dtype, kvd), label


def _resolve_limits(page_size, max_num_tokens, max_num_seqs, max_model_len):
    from kernel.workload import ServingLimits
    for n, v in (("--page-size", page_size), ("--max-num-tokens", max_num_tokens),
                 ("--max-num-seqs", max_num_seqs), ("--max-model-len", max_model_len)):
        _positive(n, v)
    if page_size & (page_size - 1) or page_size < 8:
        raise UsageError(f"--page-size {page_size} must be a power of two >= 8")
    if max_model_len < page_size:
        raise UsageError(f"--max-model-len {max_model_len} is smaller than --page-size {page_size}")
    return ServingLimits(page_size=page_size, max_num_tokens=max_num_tokens, max_num_seqs=max_num_seqs,
                         max_model_len=max_model_len)


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


@app.command()
def sweep(
    tpu: str = typer.Option(..., "--tpu", help="Target TPU generation: v4, v5e, v5p, v6e or tpu7x.",
                            autocompletion=_choices(GENERATION_NAMES), show_default=False,
                            metavar="[v4|v5e|v5p|v6e|tpu7x]"),
    case: str = typer.Option("decode", "--case", help="Kernel case to tune: decode, prefill, mixed, or all (one "
                             "sweep each).", autocompletion=_choices(CASE_CHOICES),
                             metavar="[decode|prefill|mixed|all]"),
    model: str = typer.Option("llama3-8b", "--model", help="Model preset giving the per-shard attention shape "
                              "(llama3-8b, llama3-70b-tp8, qwen3-32b, ...; see `rpa-tune presets`; ignored when --q-heads/--kv-heads/--head-dim are given).",
                              autocompletion=_complete_presets, metavar="PRESET"),
    q_heads: Optional[int] = typer.Option(None, "--q-heads", help="Query heads per shard (explicit shape; needs "
                                          "--kv-heads and --head-dim). Default: from --model."),
    kv_heads: Optional[int] = typer.Option(None, "--kv-heads", help="KV heads per shard (explicit shape). "
                                           "Default: from --model."),
    head_dim: Optional[int] = typer.Option(None, "--head-dim", help="Head dimension: 64, 128 or 256 (explicit "
                                           "shape). Default: from --model."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Query dtype: bfloat16 or float32. Default: the "
                                        "preset's (bfloat16).", autocompletion=_choices(Q_DTYPES),
                                        metavar="[bfloat16|float32]"),
    kv_dtype: Optional[str] = typer.Option(None, "--kv-dtype", help="KV-cache dtype: bfloat16 or float8_e4m3fn. "
                                           "Default: the preset's (bfloat16).", autocompletion=_choices(KV_DTYPES),
                                           metavar="[bfloat16|float8_e4m3fn]"),
    page_size: int = typer.Option(128, "--page-size", help="KV-cache page size in tokens (power of two)."),
    max_num_tokens: int = typer.Option(2048, "--max-num-tokens", help="Token bucket the kernel is compiled for "
                                       "(part of the tuning key)."),
    max_num_seqs: int = typer.Option(128, "--max-num-seqs", help="Max sequences per batch."),
    max_model_len: int = typer.Option(8192, "--max-model-len", help="Max sequence length (part of the key)."),
    workload: Optional[Path] = typer.Option(None, "--workload", help="JSON/CSV file of per-sequence q_len, kv_len "
                                            "(optional case column) to tune on instead of the generated workload.",
                                            show_default=False),
    num_seqs: int = typer.Option(64, "--num-seqs", help="Generated decode workload: number of sequences."),
    context: str = typer.Option("lognormal:2048:0.8", "--context", help="Generated decode/mixed workloads: context "
                                "length distribution, lognormal:MEDIAN:SIGMA | uniform:LO:HI | fixed:N."),
    chunk: int = typer.Option(1024, "--chunk", help="Generated prefill workload: chunk size in tokens."),
    num_chunks: int = typer.Option(2, "--num-chunks", help="Generated prefill workload: number of chunks."),
    seed: int = typer.Option(0, "--seed", help="Seed of the workload generators and of random/tpe search."),
    backend: str = typer.Option("auto", "--backend", help="auto: tpu when a TPU of --tpu's generation is here, "
                                "else compile. tpu: time on the device. compile: deviceless libtpu compile, "
                                "ranked by the static estimate. interpret: correctness only (CPU).",
                                autocompletion=_choices(BACKEND_CHOICES), metavar="[auto|tpu|compile|interpret]"),
    search: str = typer.Option("tpe", "--search", help="grid (exhaustive), random (seeded) or tpe (Optuna; runs "
                               "grid when the candidates fit in --budget).", autocompletion=_choices(SEARCH_CHOICES)),
    budget: int = typer.Option(20, "--budget", help="Max configs per case (recorded ones included, so a rerun "
                               "resumes). The default decode space of llama3-8b has 18 candidates: the bare "
                               "`rpa-tune sweep --tpu v6e --case decode` evaluates all of them (a few minutes "
                               "with --jobs 2 on an idle 2-core machine)."),
    patience: int = typer.Option(10, "--patience", help="tpe: stop after this many evaluations without a 0.5% "
                                 "improvement (0: never)."),
    jobs: int = typer.Option(2, "--jobs", "-j", help="Parallel evaluations (worker processes); the tpu backend "
                             "uses 1."),
    timeout: float = typer.Option(900.0, "--timeout", help="Seconds per evaluation before it is killed and "
                                  "recorded as timeout."),
    results: Path = typer.Option(Path("results"), "--results", help="Results directory (append-only Parquet "
                                 "dataset; created on the first result)."),
    space: Optional[Path] = typer.Option(None, "--space", help="Search-space TOML file (default: the shipped "
                                         "search_spaces/<tpu>.toml).", show_default=False),
    retry: list[str] = typer.Option([], "--retry", help="Evaluate configs recorded with this status again "
                                    "(repeatable), e.g. --retry timeout --retry crash.",
                                    autocompletion=_choices(STATUS_NAMES), metavar="STATUS"),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan (candidates, pre-filter) and exit "
                                 "without evaluating or writing anything."),
):
    """Tune block sizes for one TPU generation and case(s); results go to --results."""
    try:
        specs, backend_note = _build_specs(**locals())
    except UsageError as e:
        _fail(str(e))
    from . import ui
    from .engine import run_sweep
    from .store import ResultStore
    store = ResultStore(results)
    outcomes = []
    for spec in specs:
        if dry_run:
            ui.print_plan(spec, backend_note, results)
            continue
        ui.print_header(spec, backend_note, results)
        with ui.SweepProgress() as progress:
            outcome = run_sweep(spec, store, events=progress)
        outcomes.append(outcome)
        ui.print_summary(outcome, store)
        if outcome.interrupted:
            raise typer.Exit(130)
    if len(outcomes) > 1:
        ui.print_overall(outcomes)


def _build_specs(*, tpu, case, model, q_heads, kv_heads, head_dim, dtype, kv_dtype, page_size, max_num_tokens,
                 max_num_seqs, max_model_len, workload, num_seqs, context, chunk, num_chunks, seed, backend,
                 search, budget, patience, jobs, timeout, results, space, retry, dry_run):
    """Validate every input and build one SweepSpec per case (no side effects)."""
    from kernel.config import GENERATIONS, Case
    _one_of("TPU", tpu, tuple(GENERATIONS))
    _one_of("case", case, CASE_CHOICES)
    _one_of("backend", backend, BACKEND_CHOICES)
    _one_of("search", search, SEARCH_CHOICES)
    for s in retry:
        _one_of("--retry status", s, STATUS_NAMES)
    for n, v in (("--budget", budget), ("--jobs", jobs), ("--num-seqs", num_seqs), ("--chunk", chunk),
                 ("--num-chunks", num_chunks)):
        _positive(n, v)
    if patience < 0:
        raise UsageError(f"--patience={patience} must be >= 0")
    if not timeout > 0:
        raise UsageError(f"--timeout={timeout} must be > 0 seconds")
    if results.exists() and not results.is_dir():
        raise UsageError(f"--results {str(results)!r} exists and is not a directory")
    m, model_label = _resolve_model(model, q_heads, kv_heads, head_dim, dtype, kv_dtype)
    limits = _resolve_limits(page_size, max_num_tokens, max_num_seqs, max_model_len)
    from .space import SpaceError, load_space
    try:
        sp = load_space(tpu, space)
    except SpaceError as e:
        raise UsageError(str(e)) from None
    from .workloads import WorkloadError, make_workload, parse_distribution
    try:
        parse_distribution(context)
    except WorkloadError as e:
        raise UsageError(f"--context: {e}") from None
    if workload is not None and not workload.is_file():
        raise UsageError(f"--workload {str(workload)!r} is not a file")
    cases = [Case.DECODE, Case.PREFILL, Case.MIXED] if case == "all" else [Case.parse(case)]
    specs = []
    from .engine import SweepSpec, problem_key
    if dry_run and backend == "auto":
        be, note = "compile", "dry run: auto not probed, assuming compile"
    else:
        be, note = _resolve_backend(backend, tpu)
    for c in cases:
        try:
            w, origin = make_workload(c, limits, seed=seed, path=workload, num_seqs=num_seqs, context=context,
                                      chunk=chunk, num_chunks=num_chunks)
            cs = sp.for_case(c)
        except (WorkloadError, SpaceError) as e:
            raise UsageError(str(e)) from None
        from .workloads import describe
        key = problem_key(tpu, c, m, limits)
        specs.append(SweepSpec(key=key, model=m, limits=limits, workload=w,
                               workload_desc=f"{describe(w)} [{origin}]", case_space=cs, backend=be,
                               search=search, budget=budget, seed=seed, jobs=jobs, timeout=timeout,
                               patience=patience, retry=tuple(retry), model_label=model_label))
    return specs, note


# ============================================================================= show
@app.command()
def show(
    results: Path = typer.Option(Path("results"), "--results", help="Results directory to read."),
    tpu: Optional[str] = typer.Option(None, "--tpu", help="Only this TPU generation. Default: all.",
                                      autocompletion=_choices(GENERATION_NAMES)),
    case: Optional[str] = typer.Option(None, "--case", help="Only this case. Default: all.",
                                       autocompletion=_choices(CASE_CHOICES[:3])),
    backend: Optional[str] = typer.Option(None, "--backend", help="Only results of this backend "
                                          "(tpu, compile). Default: all.", autocompletion=_choices(BACKEND_CHOICES[1:])),
    top: int = typer.Option(1, "--top", help="Configs listed per key (1: the winner only)."),
):
    """Best configs per tuning key as a table, with status counts and the gain over the heuristic."""
    if tpu is not None and tpu not in GENERATION_NAMES:
        _fail(f"unknown TPU {tpu!r}; valid: {', '.join(GENERATION_NAMES)}")
    if case is not None and case not in CASE_CHOICES[:3]:
        _fail(f"unknown case {case!r}; valid: {', '.join(CASE_CHOICES[:3])}")
    if backend is not None and backend not in ("tpu", "compile", "interpret"):
        _fail(f"unknown backend {backend!r}; valid: tpu, compile, interpret")
    if top <= 0:
        _fail(f"--top={top} must be a positive integer")
    if not results.is_dir():
        _fail(f"no results directory {str(results)!r} (run `rpa-tune sweep` first or pass --results DIR)")
    from . import ui
    from .report import winners
    from .store import ResultStore
    df = ResultStore(results).read()
    groups = winners(df, tpu=tpu, case=case, backend=backend, top=top)
    if not groups:
        _fail(f"no matching results in {str(results)!r}", code=1)
    ui.print_winners(groups, top=top)


# =========================================================================== verify
@app.command()
def verify(
    results: Path = typer.Option(Path("results"), "--results", help="Results directory to read and append to."),
    tpu: Optional[str] = typer.Option(None, "--tpu", help="Only winners for this TPU generation. Default: all.",
                                      autocompletion=_choices(GENERATION_NAMES)),
    case: Optional[str] = typer.Option(None, "--case", help="Only this case. Default: all.",
                                       autocompletion=_choices(CASE_CHOICES[:3])),
    top: int = typer.Option(1, "--top", help="Verify the best N configs per key."),
    jobs: int = typer.Option(2, "--jobs", "-j", help="Parallel interpret runs."),
    timeout: float = typer.Option(900.0, "--timeout", help="Seconds per config before it is killed."),
):
    """Run the chosen configs in interpret mode against the reference (CPU); record the verdicts.

    A config found wrong is recorded as wrong_result and is never shown as a winner again.
    Exit code 1 when any config is wrong.
    """
    if tpu is not None and tpu not in GENERATION_NAMES:
        _fail(f"unknown TPU {tpu!r}; valid: {', '.join(GENERATION_NAMES)}")
    if case is not None and case not in CASE_CHOICES[:3]:
        _fail(f"unknown case {case!r}; valid: {', '.join(CASE_CHOICES[:3])}")
    if top <= 0 or jobs <= 0 or not timeout > 0:
        _fail("--top, --jobs and --timeout must be positive")
    if not results.is_dir():
        _fail(f"no results directory {str(results)!r} (run `rpa-tune sweep` first or pass --results DIR)")
    from . import ui
    from .report import verify_winners
    from .store import ResultStore
    store = ResultStore(results)
    rows = verify_winners(store, tpu=tpu, case=case, top=top, jobs=jobs, timeout=timeout,
                          progress=ui.VerifyProgress())
    if not rows:
        _fail(f"no winners to verify in {str(results)!r}", code=1)
    ui.print_verify(rows)
    if any(r["status"] != "ok" for r in rows):
        raise typer.Exit(1)


# =========================================================================== doctor
@app.command()
def doctor(
    quick: bool = typer.Option(False, "--quick", help="Skip the trial compile / interpret runs (versions, "
                               "devices and paths only)."),
    tpu: str = typer.Option("v6e", "--tpu", help="Generation used for the trial deviceless compile.",
                            autocompletion=_choices(GENERATION_NAMES)),
):
    """Versions, devices, which backends work here, and the compilation cache directory."""
    if tpu not in GENERATION_NAMES:
        _fail(f"unknown TPU {tpu!r}; valid: {', '.join(GENERATION_NAMES)}")
    from . import ui
    from .report import doctor_report
    ui.print_doctor(doctor_report(tpu=tpu, quick=quick))


@app.command()
def presets():
    """List the shipped model presets (per-shard attention shapes)."""
    from . import ui
    from .presets import PRESETS
    ui.print_presets(PRESETS)


from .cli_tables import register as _register_tables  # noqa: E402  (export, diff, precompile)
_register_tables(app)


# export / diff / precompile live in cli_tables (tables workflow)
try:
    from .cli_tables import register as _register_tables
except ImportError:  # pragma: no cover - optional module
    _register_tables = None
if _register_tables is not None:
    _register_tables(app)


def main():  # pragma: no cover - console entry point helper
    app()


if __name__ == "__main__":  # pragma: no cover
    app()
