"""``rpa-tune check``: will the block sizes a server runs fit in the chip's VMEM?

For each case a server launches, the block sizes it will actually use are resolved as the
server resolves them: the override variable given with ``--env`` (tpu-inference:
``RPA_V3_{DECODE,PREFILL,MIXED}_BLOCK_SIZES``; ours: ``RPA_{D,P,M}_BLOCK_SIZES``), else ours'
tables (``kernel.tables``), else the kernel's own default (``TunedKernel.heuristic``: for
tpu-inference its ``get_default_block_sizes``, evaluated by the installed package for the
target generation). They are then compiled deviceless for the generation, without the
profiler, at the scoped VMEM limit the kernel runs with (``TunedKernel.compile_vmem_limit``
through ``evaluators.base.task_vmem_limit``: all of VMEM for tpu-inference; ours' own limit
for its scratch, or the one its table entry records): the compiler's verdict is the one a
server's compile gives. The program is the kernel as a server compiles it: the estimator's
builder with its deviceless-only changes off (``VERDICT_OPTIONS``: KV-cache write-back on,
no static loop bounds or unrolling), one sequence of the case (VMEM does not depend on the
batch: the kernel's scratch is sized by the block sizes and the shape).

When a case does not fit, the nearest tuples are tried: those a few halvings away (of
``bq`` with ``cq``, ``cq``, ``bkv`` with ``ckv``, ``ckv``; legal for the kernel), fewest
halvings first and, among as many halvings, the cheapest by the device-cost model
(``estimator.device_model``: its calibrated rates and latencies over the case's generated
workload at the bucket, labelled ``modelled``; no compile) until one compiles within the
limit (at most ``max_compiles``). Its modelled cost is printed beside the server's.

The cases checked by default: decode and mixed for a kernel vLLM-TPU runs
(``workloads.VLLM_STEP_KERNELS``: it never launches the prefill kernel), every case for the
others. Exit code (``main``): 0 every case fits, 1 one does not (or the kernel has no default
there), 2 bad input.
"""
from __future__ import annotations

import dataclasses
import time

from kernel.config import BlockSizes, Case, TuningKey, get_generation
from kernel.tables.env import ENV_BLOCK_SIZES, ENV_PUBLIC_BLOCK_SIZES

# the variables each kernel's server reads its block sizes from
ENV_VARS = {"tpu-inference": ENV_PUBLIC_BLOCK_SIZES, "rpa-tune": ENV_BLOCK_SIZES}
# the builder options that make the estimator's program the one a server compiles
VERDICT_OPTIONS = {"rpa_tune.estimator.public:lower": dict(
    update_kv_cache=True, bounded_loops=False, unrolled_loops=(), nonneg_div=False, int16_masks=True,
    bf16_exp=True, bf16_where=True)}
MAX_HALVINGS = 3


class CheckError(ValueError):
    """Bad input to the check (one line naming the value and what is valid)."""


@dataclasses.dataclass
class Verdict:
    status: str                     # ok | vmem_oom | compile_error
    seconds: float
    used_bytes: int | None = None
    limit_bytes: int | None = None
    message: str = ""


@dataclasses.dataclass
class CaseReport:
    case: str
    block_sizes: BlockSizes | None
    source: str                     # env:<var> | table:<...> | default
    limit: int | None = None
    verdict: Verdict | None = None
    cost: dict | None = None        # modelled price of the server's tuple
    fit: BlockSizes | None = None   # the nearest tuple that fits (when the server's does not)
    fit_cost: dict | None = None
    fit_halvings: int | None = None
    tried: list = dataclasses.field(default_factory=list)   # (bs, Verdict) of the search
    note: str = ""

    @property
    def fits(self) -> bool:
        return self.verdict is not None and self.verdict.status == "ok"

    def to_json(self) -> dict:
        v = self.verdict
        return dict(case=self.case, block_sizes=_t(self.block_sizes), source=self.source, vmem_limit_bytes=self.limit,
                    status=v.status if v else "no_default", fits=self.fits, seconds=v.seconds if v else None,
                    used_bytes=v.used_bytes if v else None, cost=self.cost, note=self.note,
                    fit=_t(self.fit), fit_cost=self.fit_cost, fit_halvings=self.fit_halvings,
                    tried=[dict(block_sizes=_t(b), status=t.status, seconds=t.seconds, used_bytes=t.used_bytes)
                           for b, t in self.tried])


def _t(bs):
    return None if bs is None else [int(v) for v in bs]


# ----------------------------------------------------------------------------- inputs
def parse_env_lines(lines, kernel: str) -> dict[Case, tuple[BlockSizes, str]]:
    """``NAME=bq,bkv,cq,ckv`` lines (the environment a server runs with; ``#`` comments and
    blank lines skipped) -> {case: (block sizes, variable)} for the variables ``kernel``'s
    server reads. An unknown variable or a malformed value is a ``CheckError``."""
    names = ENV_VARS.get(kernel)
    out = {}
    for raw in lines:
        line = raw.strip()
        if line.startswith("export "):
            line = line[len("export "):].strip()
        if not line or line.startswith("#"):
            continue
        name, sep, val = line.partition("=")
        name = name.strip()
        if names is None:
            raise CheckError(f"--env {raw!r}: --kernel {kernel} reads no block-size variables this check knows")
        case = next((c for c, v in names.items() if v == name), None)
        if not sep or case is None:
            raise CheckError(f"--env {raw!r}: expected NAME=bq,bkv,cq,ckv with NAME one of "
                             f"{', '.join(names.values())} (what --kernel {kernel} reads)")
        try:
            vals = [int(x) for x in val.strip().strip("'\"").split(",")]
        except ValueError:
            vals = []
        if len(vals) != 4 or any(v <= 0 for v in vals):
            raise CheckError(f"--env {raw!r}: {name} needs four positive ints bq,bkv,cq,ckv")
        out[case] = (BlockSizes(*vals), name)
    return out


def default_cases(kernel: str) -> list[Case]:
    from .workloads import VLLM_STEP_KERNELS
    if kernel in VLLM_STEP_KERNELS:
        return [Case.DECODE, Case.MIXED]
    return [Case.DECODE, Case.PREFILL, Case.MIXED]


def server_block_sizes(kern, key: TuningKey, env: dict, max_num_seqs: int) -> tuple[BlockSizes | None, str, int | None]:
    """(block sizes, where they come from, a table's VMEM limit or None) as the server
    resolves them (module doc)."""
    case = Case.parse(key.case)
    if case in env:
        bs, var = env[case]
        return bs, f"env:{var}", None
    found = kern.table_block_sizes(key)
    if found is not None:
        bs, source, limit = found
        return bs, source, limit
    bs = kern.heuristic(key, max_num_seqs=max_num_seqs)
    return bs, "default", None


# ----------------------------------------------------------------------------- verdicts
def kernel_limit(kern, model, limits, case, bs: BlockSizes, generation: str, table_limit: int | None) -> int:
    """The scoped VMEM limit the kernel runs ``bs`` with (``evaluators.base.task_vmem_limit``'s
    rule; a table entry's recorded limit first)."""
    if table_limit is not None:
        return int(table_limit)
    from kernel.hardware import tpu_info
    cap = int(tpu_info(generation).vmem_capacity_bytes)
    return int(kern.compile_vmem_limit(kern.predicted_vmem_bytes(model, limits, bs, case), cap))


def compile_verdict(kern, generation: str, case: Case, model, limits, bs: BlockSizes, limit: int,
                    sliding_window: int | None = None) -> Verdict:
    """The compiler's VMEM verdict on ``bs`` at ``limit`` (module doc), deviceless, in this process."""
    import dataclasses as dc
    import importlib

    from kernel.analysis import parse_vmem_oom
    module, _, fn = kern.builder.partition(":")
    lower = getattr(importlib.import_module(module), fn)
    q = 1 if case == Case.DECODE else min(bs.bq, limits.max_num_tokens, 16)
    kv = min(limits.max_model_len, max(q, limits.page_size))
    dist = {Case.DECODE: (1, 1, 1), Case.PREFILL: (0, 1, 1), Case.MIXED: (0, 0, 1)}[case]
    opts = dict(VERDICT_OPTIONS.get(kern.builder, {}), vmem_limit_bytes=int(limit))
    if sliding_window is not None:
        opts["sliding_window"] = int(sliding_window)
    t0 = time.perf_counter()
    try:
        lowered, _ = lower(workload=dict(q_lens=[q], kv_lens=[kv], distribution=list(dist)), block_sizes=list(bs),
                           tpu=generation, model=dc.asdict(model), limits=dc.asdict(limits), case=case.value,
                           options=opts)
        lowered.compile()
    except Exception as e:  # noqa: BLE001 - the verdict is the point
        msg = str(e)
        oom = parse_vmem_oom(msg)
        if oom:
            return Verdict("vmem_oom", time.perf_counter() - t0, oom.get("used_bytes"), oom.get("limit_bytes"),
                           f"{oom.get('kind')}: used {oom.get('used_bytes')} of {oom.get('limit_bytes')}")
        lines = [ln for ln in msg.strip().splitlines() if ln.strip()]
        return Verdict("compile_error", time.perf_counter() - t0, message=" | ".join(lines[-3:])[-600:])
    return Verdict("ok", time.perf_counter() - t0, limit_bytes=int(limit))


def modelled_cost(kern, key: TuningKey, model, limits, bs: BlockSizes, sliding_window=None) -> dict | None:
    """The device-cost model's time of one call of ``bs`` on the case's generated workload
    at the bucket (``estimator.device_model.price`` without a static estimate: ``modelled``)."""
    from .estimator import device_model
    from .workloads import WorkloadError, make_workload
    try:
        w, origin = make_workload(key.case, limits, kernel=kern.name)
        feats = device_model.features(kern, w, model, key.case, bs, limits.page_size, key.generation,
                                      sliding_window)
    except (WorkloadError, ValueError) as e:
        return dict(time_s=None, label="modelled", note=str(e))
    p = device_model.price(None, feats, key.generation)
    return dict(time_s=p["time_s"], label=p["label"], calibration=p["calibration"], workload=origin)


def halvings(bs: BlockSizes, case: Case, page_size: int, kern) -> list[tuple[BlockSizes, str]]:
    """The legal tuples one halving from ``bs`` (module doc), with what was halved."""
    bq, bkv, cq, ckv = bs
    out = []
    if case != Case.DECODE and bq > 1:
        out.append((BlockSizes(bq // 2, bkv, min(cq, bq // 2), ckv), "bq"))
    if cq > 1:
        out.append((BlockSizes(bq, bkv, cq // 2, ckv), "cq"))
    if bkv // 2 >= page_size:
        out.append((BlockSizes(bq, bkv // 2, cq, min(ckv, bkv // 2)), "bkv"))
    if ckv // 2 >= page_size:
        out.append((BlockSizes(bq, bkv, cq, ckv // 2), "ckv"))
    return [(b, w) for b, w in out if not kern.block_size_errors(case, b, page_size)]


def nearest_fit(kern, key: TuningKey, model, limits, bs: BlockSizes, table_limit, *, max_compiles: int = 6,
                sliding_window=None, progress=None):
    """(tuple that fits or None, halvings, its modelled cost, [(bs, Verdict)] tried)."""
    case = Case.parse(key.case)
    seen, frontier, tried = {bs}, [bs], []
    for dist in range(1, MAX_HALVINGS + 1):
        nxt = []
        for b in frontier:
            for c, _ in halvings(b, case, limits.page_size, kern):
                if c not in seen:
                    seen.add(c)
                    nxt.append(c)
        priced = [(modelled_cost(kern, key, model, limits, c, sliding_window), c) for c in nxt]
        priced.sort(key=lambda pc: ((pc[0] or {}).get("time_s") or float("inf"), tuple(pc[1])))
        for cost, c in priced:
            if len(tried) >= max_compiles:
                return None, None, None, tried
            limit = kernel_limit(kern, model, limits, case, c, key.generation, None)
            v = compile_verdict(kern, key.generation, case, model, limits, c, limit, sliding_window)
            tried.append((c, v))
            if progress:
                progress(c, v)
            if v.status == "ok":
                return c, dist, cost, tried
        frontier = nxt
    return None, None, None, tried


def check_case(kern, key: TuningKey, model, limits, env: dict, *, max_compiles: int = 6, sliding_window=None,
               progress=None) -> CaseReport:
    case = Case.parse(key.case)
    bs, source, table_limit = server_block_sizes(kern, key, env, limits.max_num_seqs)
    if bs is None:
        return CaseReport(case.value, None, source, note=f"{kern.name} has no default block sizes for "
                          f"{key.generation} {case.value} (its get_default_block_sizes raises there): the server "
                          f"needs the override variable")
    errs = kern.block_size_errors(case, bs, limits.page_size)
    if errs:
        raise CheckError(f"{source}: {case.value} block sizes {tuple(bs)} are not legal for {kern.name}: "
                         + "; ".join(errs))
    limit = kernel_limit(kern, model, limits, case, bs, key.generation, table_limit)
    rep = CaseReport(case.value, bs, source, limit)
    rep.verdict = compile_verdict(kern, key.generation, case, model, limits, bs, limit, sliding_window)
    rep.cost = modelled_cost(kern, key, model, limits, bs, sliding_window)
    if rep.verdict.status == "vmem_oom":
        rep.fit, rep.fit_halvings, rep.fit_cost, rep.tried = nearest_fit(
            kern, key, model, limits, bs, table_limit, max_compiles=max_compiles, sliding_window=sliding_window,
            progress=progress)
    return rep


# ----------------------------------------------------------------------------- text
def _mib(n) -> str:
    return "?" if n is None else f"{n / 2**20:.1f} MiB"


def _us(cost) -> str:
    t = (cost or {}).get("time_s")
    return "not priced" if t is None else f"{t * 1e6:,.1f} us ({cost['label']}, calibration {cost.get('calibration')})"


def describe(rep: CaseReport, kern, generation: str) -> list[str]:
    chip = get_generation(generation).device_kind
    if rep.block_sizes is None:
        return [f"{rep.case}: NO DEFAULT: {rep.note}"]
    v = rep.verdict
    src = {"default": "the kernel's default"}.get(rep.source, rep.source)
    head = f"{rep.case}: {tuple(rep.block_sizes)} ({src})"
    if v.status == "ok":
        return [f"{head}: fits {chip}'s VMEM at the kernel's limit {_mib(rep.limit)} [{v.seconds:.0f} s compile]"]
    if v.status == "compile_error":
        return [f"{head}: does not compile for {chip} ({v.message}) [{v.seconds:.0f} s]"]
    out = [f"{head}: DOES NOT FIT {chip}'s VMEM: the compiler needs {_mib(v.used_bytes)} of "
           f"{_mib(v.limit_bytes)} at the kernel's limit {_mib(rep.limit)} [{v.seconds:.0f} s compile]"]
    if rep.fit is None:
        out.append(f"  no tuple within {MAX_HALVINGS} halvings fits in {len(rep.tried)} compiles "
                   "(raise --max-compiles, or tune the key: rpa-tune sweep)")
        return out
    var = ENV_VARS.get(kern.name, {}).get(Case.parse(rep.case))
    ratio = ""
    if (rep.cost or {}).get("time_s") and (rep.fit_cost or {}).get("time_s"):
        ratio = f", {rep.fit_cost['time_s'] / rep.cost['time_s']:.2f}x the server's tuple's"
    out.append(f"  nearest that fits: {tuple(rep.fit)} ({rep.fit_halvings} halving"
               f"{'s' if rep.fit_halvings != 1 else ''}; {len(rep.tried)} compiles): {_us(rep.fit_cost)} per call"
               f"{ratio} ({_us(rep.cost)})")
    if var:
        out.append(f"  {var}={','.join(map(str, rep.fit))}")
    return out


# ----------------------------------------------------------------------------- CLI
def check_cmd(
    kernel: str = None, tpu: str = None, model: str = None, q_heads=None, kv_heads=None, head_dim=None,
    dtype=None, kv_dtype=None, page_size: int = 128, max_num_tokens: int = 2048, max_num_seqs: int = 128,
    max_model_len: int = 8192, sliding_window=None, case: str = None, env=(), max_compiles: int = 6,
    json_out: bool = False,
):
    """Will the block sizes the server uses compile within the chip's VMEM? Deviceless: per
    case, the compiler's verdict at the kernel's own VMEM limit, and where they do not fit
    the nearest tuple that does with its modelled cost. Exit 1 when a case does not fit."""
    import sys

    import typer

    from .cli_common import UsageError, fail, parse_cases, resolve_limits, resolve_model, value
    from .kernels import KernelError, get_kernel
    try:
        kern = get_kernel(value(kernel))
        if kern.name not in ENV_VARS:
            raise CheckError(f"--kernel {kern.name}: check knows how the servers of "
                             f"{' and '.join(ENV_VARS)} resolve their block sizes, not {kern.name}'s yet")
        kern.check_available()
        m, label = resolve_model(model, q_heads, kv_heads, head_dim, dtype, kv_dtype)
        limits = resolve_limits(page_size, max_num_tokens, max_num_seqs, max_model_len)
        cases = [Case.parse(c) for c in parse_cases(case)] if case else default_cases(kern.name)
        lines = []
        for item in env:
            from pathlib import Path
            p = Path(item)
            lines += p.read_text().splitlines() if "=" not in item and p.is_file() else [item]
        env_bs = parse_env_lines(lines, kern.name)
    except (UsageError, CheckError, KernelError) as e:
        fail(str(e))
    if sliding_window is not None and sliding_window >= max_model_len:
        fail(f"--sliding-window {sliding_window} is not below --max-model-len {max_model_len}")
    import os
    from .evaluators.base import worker_env
    os.environ.update(worker_env("compile", {}))      # deviceless compiles in this process (JAX on CPU)
    from .engine import problem_key
    reports = []
    for c in cases:
        key = problem_key(tpu, c, m, limits, sliding_window=sliding_window is not None)
        if not json_out:
            sys.stderr.write(f"checking {c.value} ({get_generation(tpu).device_kind}, {label}, "
                             f"{max_num_tokens} tokens): compiling deviceless ...\n")
        try:
            rep = check_case(kern, key, m, limits, env_bs, max_compiles=max_compiles, sliding_window=sliding_window,
                             progress=None if json_out else (lambda b, v: sys.stderr.write(
                                 f"  tried {tuple(b)}: {v.status} [{v.seconds:.0f} s]\n")))
        except CheckError as e:
            fail(str(e))
        reports.append(rep)
        if not json_out:
            print("\n".join(describe(rep, kern, tpu)), flush=True)
    bad = [r for r in reports if not r.fits]
    if json_out:
        from .ui import print_json
        print_json(dict(kernel=kern.name, generation=tpu, model=label, limits=dataclasses.asdict(limits),
                        cases=[r.to_json() for r in reports], fits=not bad))
    raise typer.Exit(1 if bad else 0)


from typing import List, Optional  # noqa: E402

import typer  # noqa: E402

from .cli_common import (TPU_METAVAR, HeadDim, JsonFlag, KernelChoice, KvDtypeOpt, KvHeads,  # noqa: E402
                         MaxModelLen, MaxNumSeqs, MaxNumTokens, Model, PageSize, QDtypeOpt, QHeads, parse_tpu)


def check(
    kernel: KernelChoice = typer.Option(..., "--kernel", case_sensitive=False, help="The server's kernel: "
                                        "tpu-inference (vLLM-TPU) or rpa-tune (this project's)."),
    tpu: str = typer.Option(..., "--tpu", parser=parse_tpu, metavar=TPU_METAVAR, help="The server's TPU "
                            "generation."),
    model: Model = "llama3-8b", q_heads: QHeads = None, kv_heads: KvHeads = None, head_dim: HeadDim = None,
    dtype: QDtypeOpt = None, kv_dtype: KvDtypeOpt = None, page_size: PageSize = 128,
    max_num_tokens: MaxNumTokens = 2048, max_num_seqs: MaxNumSeqs = 128, max_model_len: MaxModelLen = 8192,
    sliding_window: Optional[int] = typer.Option(None, "--sliding-window", min=1, help="The attention "
                                                 "window of the layers checked (tokens). Default: none."),
    case: Optional[str] = typer.Option(None, "--case", help="Comma-separated cases. Default: those the "
                                       "server launches (tpu-inference under vLLM-TPU: decode,mixed).",
                                       show_default=False),
    env: List[str] = typer.Option([], "--env", metavar="NAME=bq,bkv,cq,ckv|FILE", help="An override the "
                                  "server runs with (repeatable), or a file of such lines (an env file)."),
    max_compiles: int = typer.Option(6, "--max-compiles", min=1, help="Compiles the search for a tuple "
                                     "that fits may spend per case."),
    json_out: JsonFlag = False,
):
    """Will the server's block sizes fit in VMEM? Per case, the compiler's deviceless verdict at
    the kernel's own VMEM limit, and where they do not fit, the nearest tuple that does with its
    modelled cost. Exit 1 when a case does not fit."""
    check_cmd(kernel=kernel, tpu=tpu, model=model, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
              dtype=dtype, kv_dtype=kv_dtype, page_size=page_size, max_num_tokens=max_num_tokens,
              max_num_seqs=max_num_seqs, max_model_len=max_model_len, sliding_window=sliding_window, case=case,
              env=env, max_compiles=max_compiles, json_out=json_out)


def register(app) -> None:
    """Add ``check`` to the main app (one line in ``rpa_tune/cli.py``)."""
    app.command("check")(check)
