"""This project's kernel and the public RPA v3 kernel, side by side, under one estimator.

Both kernels are compiled deviceless by the same profiler child (``rpa_tune.estimator.
profiler``: libtpu's static profiler with the unrolled bundle trace on), every compile is
audited against the work its piece needs (``rpa_tune.estimator.audit``), and both go
through the same time model: the device-cost model (``rpa_tune.estimator.device_model``,
the generation's calibration) over the static ``max(cycles / calibrated clock, bytes / HBM
BW, FLOPs / achievable MXU peak)``, with each kernel's own walk counted for its fixed costs.
Each kernel is reported at its best config of the same
candidate set (``CANDIDATES``; the short-context decode rows: ``SHORT_DECODE_CANDIDATES``),
ours also at decode groups of several sequences per step where they can pay off
(``GROUP_CANDIDATES``: the public kernel has no such dimension).
Ours is ``rpa_tune.estimator.ours:lower``; the public one is tpu-inference
0.32.0's kernel module, lowered by ``rpa_tune.estimator.public:lower`` (its metadata made
visible to the profiler; module doc there).

Method (the same for both kernels; whole compiles of the large workloads do not fit in
memory for every kernel and generation, so each workload is built from compiles of its
pieces by a rule stated here and checked where a whole compile fits):

* decode, n identical sequences: whole compiles of a = 8 and b = 16 sequences (ours' decode
  groups of bq sequences per step: of 8 and 16 groups, a = 8 bq and b = 16 bq sequences;
  from 8 and 16 sequences, a group of 8 would be one static body against a loop of two,
  and the extrapolation far off), extrapolated linearly in n
  (``c(n) = c_a + (n - a) (c_b - c_a) / (b - a)``).
  Checked against whole 128-sequence compiles in the ``--check`` rows.
* causal prefill, one sequence of L tokens: a whole compile for L <= 1024; longer ones
  from whole compiles of 256, 512 and 1024 tokens, fitted as ``a + b (q blocks) + c (KV
  steps)`` (the items of a causal sequence, ``causal_items``) and extrapolated. Checked
  against the public kernel's whole 2K compile in ``--check`` (ours does not fit in memory
  whole at 2K). The sum of q blocks each compiled as a chunk after the earlier tokens is
  not a rule for either kernel: ours computes every chunk of a KV step, and a chunk's
  cached context adds steps a whole sequence does not have.
* the mixed step: one whole compile.

What differs between the two programs: the public kernel is lowered with its KV-cache
write-back off (with it on, the profiler aborts; its new tokens are read from the cache
instead of the new-KV array, the same bytes into VMEM), so its write bytes are not in its
trace; its audit checks reads and MXU work only. Run-time-sized DMAs print no size in the
trace: as the tuner does (``compose.probe_config``), the read audit of the public kernel
counts each of them at one page at most (``audit.page_bytes``), so it proves the fetches
are issued, not their sizes (the audit's notes say where that was used).

    python benchmarks/vs_public.py --tpu v6e [--tpu tpu7x ...] [--only decode] [--check decode --check prefill]

A run over some generations or cases replaces only its own rows (and their notes) of the
table it writes; the other rows are kept (``merge_tables``). A generation run for every
case loses its rows that the run no longer produces.

Variants (``--variants``; table in ``benchmarks/results/vs_public_variants.md``): the same
method and candidates for other model shapes and attention options, ``VARIANTS``: head_dim
64 (Llama-3.2-1B), head_dim 256 (Gemma-2-9B, one chip), an fp8 (e4m3) KV cache with
``k_scale = v_scale = 1.0`` and a sliding window of 1024, each on decode 128 x 2048 (x 8192
with the window), page 128, and a whole causal prefill of 1024 tokens (not with the
window: 1024 tokens see at most 1024). Options reach both builders as the request's
``options`` (``sliding_window``, ``k_scale``, ``v_scale``). The public kernel is its
``kernel.py`` for every head_dim (tpu-inference serves head_dim 64 with another module,
``kernel_hd64.py``, which ``rpa_tune.estimator.public`` does not lower). With a sliding
window the time model's byte count (``kernel.metrics.hbm_bytes``) is the keys the queries
see, so the memory bound and MBU are the window's.

    python benchmarks/vs_public.py --variants --tpu v6e [--tpu tpu7x ...] [--only decode]

Pieces are cached in the user's cache directory (``cache_path``: ``$RPA_TUNE_VS_PUBLIC_CACHE``,
else ``$XDG_CACHE_HOME`` or ``~/.cache``, ``rpa-tune/vs_public.jsonl``; each with its trace, so
later audit rules apply without a compile), keyed by our kernel's version / the public
package's version (a rerun resumes; a new kernel version re-measures ours). The table is
written to ``benchmarks/results/vs_public.md``, and the pieces of the current versions that the
tables read, without their traces, to ``benchmarks/results/vs_public_pieces.jsonl`` (kept in
git, a few hundred kB; a rerun on a new machine starts from them).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernel.config import BlockSizes, Case, cdiv  # noqa: E402
from kernel.workload import ModelShape, ServingLimits, Workload  # noqa: E402
from rpa_tune.estimator import audit, compose, profiler  # noqa: E402
from rpa_tune.estimator.calibration import calibration  # noqa: E402
from rpa_tune.estimator.trace import TraceStats  # noqa: E402
from kernel.hardware import tpu_info  # noqa: E402
from rpa_tune.evaluators.base import next_vmem_limit  # noqa: E402
from rpa_tune.provenance import kernel_hash  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
PIECES = os.path.join(HERE, "results", "vs_public_pieces.jsonl")
CACHE_ENV = "RPA_TUNE_VS_PUBLIC_CACHE"
# what a table reads of a piece (and what decides whether it is compiled again)
PIECE_FIELDS = ("key", "status", "cycles", "message", "audit", "vmem_limit_bytes", "vmem_rule", "retried")
MODEL = ModelShape(32, 8, 128)      # Llama-3-8B: 32 q / 8 KV heads, head_dim 128, bf16
KERNELS = {"ours": compose.OURS_BUILDER, "public": "rpa_tune.estimator.public:lower"}
CANDIDATES = {
    Case.DECODE: [BlockSizes(1, 512, 1, 512), BlockSizes(1, 1024, 1, 1024), BlockSizes(1, 2048, 1, 1024)],
    Case.PREFILL: [BlockSizes(128, 512, 128, 256), BlockSizes(256, 1024, 128, 512), BlockSizes(256, 256, 128, 256)],
    Case.MIXED: [BlockSizes(64, 512, 64, 256), BlockSizes(128, 512, 64, 256)],
}
DECODE_LENS = (512, 2048, 8192)
# Short-context decode (the ">= 1.5x the public kernel at <= 1K"): page 128, each
# kernel at its best of blocks no longer than 512 tokens.
SHORT_DECODE_LENS = (128, 256)
SHORT_DECODE_CANDIDATES = [BlockSizes(1, 128, 1, 128), BlockSizes(1, 256, 1, 256), BlockSizes(1, 512, 1, 512)]
# Ours only: decode with bq = cq > 1 sequences per KV step (kernel/rpa.py compute_group), a
# dimension the public kernel does not have (its decode q block is one sequence's tokens).
# Added where it can pay off (short blocks; at 2K a group estimates even with one sequence
# per step).
GROUP_CANDIDATES = {
    "short": [BlockSizes(b, n, b, n) for n in (128, 256) for b in (2, 4, 8)],
    512: [BlockSizes(b, 512, b, 512) for b in (2, 4)],
}


def decode_candidates(kernel: str, L: int, short: bool = False) -> list[BlockSizes]:
    base = SHORT_DECODE_CANDIDATES if short else CANDIDATES[Case.DECODE]
    if kernel != "ours":
        return base
    return base + GROUP_CANDIDATES.get("short" if short else L, [])
PAGES = (128, 256)
PREFILL_LENS = (1024, 2048, 4096)
MIXED_STEP = ([4, 4, 4, 4, 128], [2048, 2048, 2048, 2048, 640])   # 4 speculative-decode rows + a chunk
RSS_CAP = 14 << 30
# VMEM OOM retries (``piece``): 1 raised the scoped limit once; 2 also lowers it after a
# whole-program OOM under the profiler (``rpa_tune.evaluators.base.next_vmem_limit``); 3 the
# public kernel at the limit it runs with, all of VMEM (``_with_vmem_retries``)
VMEM_RULE = 3


@dataclasses.dataclass(frozen=True)
class Variant:
    """A model shape and the attention options both kernels are lowered with."""
    name: str
    model: ModelShape = MODEL
    sliding_window: int | None = None
    kv_scale: float | None = None        # k_scale = v_scale (an fp8 cache's dequantization)

    @property
    def options(self) -> dict:
        opts = {}
        if self.sliding_window:
            opts["sliding_window"] = int(self.sliding_window)
        if self.kv_scale is not None:
            opts["k_scale"] = opts["v_scale"] = float(self.kv_scale)
        return opts

    def key(self) -> list:
        """What the variant adds to a piece's cache key (nothing for ``BASE``: the main
        table's keys are unchanged)."""
        return [] if self == BASE else [dataclasses.asdict(self.model), self.options]


BASE = Variant("Llama-3-8B, bf16")
VARIANTS = (
    Variant("head_dim 64 (Llama-3.2-1B: 32 q / 8 KV heads)", ModelShape(32, 8, 64)),
    Variant("head_dim 256 (Gemma-2-9B: 16 q / 8 KV heads)", ModelShape(16, 8, 256)),
    Variant("fp8 KV (Llama-3-8B, e4m3, k/v scale 1.0)",
            ModelShape(32, 8, 128, kv_dtype="float8_e4m3fn"), kv_scale=1.0),
    Variant("sliding window 1024 (Llama-3-8B)", MODEL, sliding_window=1024),
)
VARIANT_DECODE = (2048, 128)         # (context, page); with a window: WINDOW_DECODE
WINDOW_DECODE = (8192, 128)
VARIANT_PREFILL = 1024


def limits(page: int) -> ServingLimits:
    return ServingLimits(page_size=page, max_num_tokens=4096, max_num_seqs=128, max_model_len=16384)


# --------------------------------------------------------------------------- pieces
def _version(kernel: str) -> str:
    """What a cached piece depends on besides its workload: our kernel's version id
    (``rpa_tune.provenance.kernel_hash``), or the pinned public package's version."""
    if kernel == "ours":
        return kernel_hash()
    from rpa_tune.public_kernel import installed_version
    return f"tpu-inference {installed_version()}"


def _key(kernel, gen, case, bs, page, q_lens, kv_lens, variant: Variant = BASE) -> str:
    return json.dumps([kernel, _version(kernel), gen, case.value, list(bs), page, list(q_lens), list(kv_lens)]
                      + variant.key())


def cache_path() -> str:
    """The pieces cache: ``$RPA_TUNE_VS_PUBLIC_CACHE``, else ``rpa-tune/vs_public.jsonl`` in
    the user's cache directory (``$XDG_CACHE_HOME``, else ``~/.cache``)."""
    from rpa_tune import user_cache_dir
    return os.environ.get(CACHE_ENV) or user_cache_dir("vs_public.jsonl")


def _read_jsonl(path: str) -> dict:
    out = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    d = json.loads(line)
                    out[d["key"]] = d
                except (ValueError, KeyError, TypeError):
                    continue
    return out


def _load_cache() -> dict:
    """The shipped pieces, then the cache's (a cached piece keeps its trace: it wins)."""
    out = _read_jsonl(PIECES)
    out.update(_read_jsonl(cache_path()))
    return out


_CACHE: dict = {}
_USED: dict = {}         # key -> the piece as this run's tables read it


def _use(rec: dict) -> dict:
    _USED[rec["key"]] = rec
    return rec


def write_pieces(used: dict, path: str = PIECES) -> int:
    """Write ``path``: the pieces ``used`` (``PIECE_FIELDS`` only: no trace) merged into the
    ones it holds, keeping only pieces of the current versions of both kernels (``_version``),
    sorted by key. Returns how many it holds."""
    versions = {_version("ours"), _version("public")}
    kept = {k: r for k, r in _read_jsonl(path).items() if json.loads(k)[1] in versions}
    kept.update(used)
    kept = {k: {f: r[f] for f in PIECE_FIELDS if f in r} for k, r in kept.items()}
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        for k in sorted(kept):
            f.write(json.dumps(kept[k], sort_keys=True) + "\n")
    os.replace(tmp, path)
    return len(kept)


def _cached(key: str) -> dict | None:
    """The recorded piece under ``key``, reloading the file first (another run may have
    measured it meanwhile)."""
    if key not in _CACHE:
        _CACHE.update(_load_cache())
    return _CACHE.get(key)


def _record(rec: dict) -> None:
    """Keep ``rec`` and append it to the cache."""
    _CACHE[rec["key"]] = rec
    os.makedirs(os.path.dirname(cache_path()), exist_ok=True)
    with open(cache_path(), "a") as f:
        f.write(json.dumps(rec) + "\n")


def piece(kernel: str, gen: str, case: Case, bs: BlockSizes, page: int, q_lens, kv_lens,
          variant: Variant = BASE) -> dict:
    """One whole compile of one kernel on one workload: cycles and the audit of its trace."""
    key = _key(kernel, gen, case, bs, page, q_lens, kv_lens, variant)
    w = Workload.of_case(case, list(q_lens), list(kv_lens))
    old = _cached(key)
    if old and old["status"] == "ok" and old.get("trace"):      # audited by today's rules
        return _use(dict(old, audit=_audit(kernel, gen, case, page, w, variant, old["trace"]).to_json()))
    if old and not _compile_again(kernel, old):
        return _use(old)
    req = dict(workload=dict(q_lens=list(w.q_lens), kv_lens=list(w.kv_lens), distribution=list(w.distribution)),
               block_sizes=list(bs), tpu=gen, model=dataclasses.asdict(variant.model),
               limits=dataclasses.asdict(limits(page)), case=case.value)
    t0 = time.time()
    expect = json.loads(key)[1] if kernel == "ours" else None

    def compile_once(options):
        return profiler.profile(KERNELS[kernel], dict(req, options=options) if options else req, timeout=1800,
                                rss_cap=RSS_CAP, bundles=True, expect_kernel_hash=expect)

    r, limit = _with_vmem_retries(gen, variant, compile_once)
    rec = dict(key=key, status=r["status"], cycles=r.get("cycles"), wall_s=time.time() - t0,
               max_rss_bytes=r.get("max_rss_bytes"), message=(r.get("message") or "")[-300:],
               vmem_limit_bytes=limit, retried=True, vmem_rule=VMEM_RULE)
    if r["status"] == "ok":
        rec["trace"] = r["trace"]       # a few kB: later audit rules apply without a compile
        rec["audit"] = _audit(kernel, gen, case, page, w, variant, r["trace"]).to_json()
    if r.get("environment"):        # e.g. a full disk: the machine's failure, not recorded
        raise SystemExit(f"vs_public: {r['message'][:300]}")
    _record(rec)
    tag = "" if variant == BASE else f" [{variant.name}]"
    print(f"  {kernel:6s} {gen:5s} {case.value:7s} {tuple(bs)} page {page} q={_short(q_lens)} kv={_short(kv_lens)}{tag}:"
          f" {rec['status']} {rec['cycles'] or ''} ({rec['wall_s']:.0f} s, "
          f"{(rec['max_rss_bytes'] or 0) / 2**30:.1f} GB)", flush=True)
    return _use(rec)


def _with_vmem_retries(gen: str, variant: Variant, run):
    """``(result, limit)`` of ``run(options)`` (the variant's options; None limit: the limit
    the kernel runs with, the tuner's rule, ``rpa_tune.evaluators.base.task_vmem_limit``:
    each builder defaults to it, all of VMEM for the public kernel, whose profiled compiles
    get the VMEM size override, ``profiler.deviceless_vmem_args``), compiled again after a
    VMEM OOM as the tuner does (rpa_tune.evaluators.compile): with the scoped limit the
    compiler asked for, or, after a whole-program OOM under the profiler, the least limit
    the kernel's scoped allocations fit in (``next_vmem_limit``; never a limit already
    tried). (No plain compile decides here: a public config within the profiler's own few
    tens of KiB of the capacity stays ``vmem_oom``; docs/estimator.md.)"""
    limit, tried = None, set()
    r = run(dict(variant.options))
    while r["status"] == "vmem_oom":
        new = next_vmem_limit(r.get("vmem") or {}, limit, int(tpu_info(gen).vmem_capacity_bytes), tried)
        if new is None:
            break
        limit = new
        tried.add(new)
        r = run({**variant.options, "vmem_limit_bytes": limit})
    return r, limit


def _compile_again(kernel: str, rec: dict) -> bool:
    """Whether a recorded piece without a trace must be compiled again: a VMEM OOM recorded
    before today's retry rule (``VMEM_RULE``), or a public piece (audited without its page
    bound)."""
    return ((rec["status"] == "vmem_oom" and rec.get("vmem_rule", 1 if rec.get("retried") else 0) < VMEM_RULE)
            or (kernel == "public" and rec["status"] == "ok"))


def _audit(kernel: str, gen: str, case: Case, page: int, w: Workload, variant: Variant, trace: dict):
    """The audit of one piece's trace, by the tuner's rules (``compose.probe_config``): the
    public kernel's write-back is off (its writes are not in the program; module doc) and
    each of its run-time-sized page DMAs moves at most one page."""
    need = audit.needed(w, variant.model, case, sliding_window=variant.sliding_window)
    page_bytes = None
    if kernel == "public":
        need = dataclasses.replace(need, kv_write_bytes=0)
        page_bytes = audit.page_bytes(page, variant.model)
    return audit.audit_trace(TraceStats.from_json(trace), need, calibration(gen), page_bytes)


def composed_piece(gen: str, case: Case, bs: BlockSizes, page: int, q_lens, kv_lens,
                   variant: Variant = BASE) -> dict:
    """Our kernel on one workload priced from the config's probes (``compose.probe_config``,
    the tuner's compile backend), for a workload whose whole compile fails (TPU7x prefill:
    XLA puts the whole sequence's operands in VMEM beside the kernel's scratch, while the
    probes fit). The public kernel has no such rule: its step plan is not ours."""
    key = json.dumps(["ours-composed", kernel_hash(), gen, case.value, list(bs), page, list(q_lens), list(kv_lens)]
                     + variant.key())
    old = _cached(key)
    if old and not (old["status"] == "vmem_oom" and old.get("vmem_rule", 1) < VMEM_RULE):
        return _use(old)
    t0 = time.time()

    def probe_once(options):
        pr = compose.probe_config(builder=compose.OURS_BUILDER, case=case, bs=bs, tpu=gen,
                                  model=dataclasses.asdict(variant.model), limits=dataclasses.asdict(limits(page)),
                                  options=options or None, timeout=1800)
        if pr.get("environment"):
            raise SystemExit(f"vs_public: {pr['message'][:300]}")
        return pr

    pr, limit = _with_vmem_retries(gen, variant, probe_once)
    rec = dict(key=key, status=pr["status"], cycles=None, wall_s=time.time() - t0,
               max_rss_bytes=pr.get("max_rss_bytes"), message=(pr.get("message") or "")[-300:],
               vmem_limit_bytes=limit, vmem_rule=VMEM_RULE)
    if pr["status"] == "ok":
        w = Workload.of_case(case, list(q_lens), list(kv_lens))
        rec["cycles"] = int(round(compose.model_from_json(pr["model"]).cycles(w)))
        rec["audit"] = dict(verdict=pr["audit"], reasons=list(pr.get("reasons") or []))
    _record(rec)
    tag = "" if variant == BASE else f" [{variant.name}]"
    print(f"  ours   {gen:5s} {case.value:7s} {tuple(bs)} page {page} q={_short(q_lens)} kv={_short(kv_lens)}{tag}:"
          f" composed from probes: {rec['status']} {rec['cycles'] or ''} ({rec['wall_s']:.0f} s)", flush=True)
    return _use(rec)


def _short(xs) -> str:
    xs = list(xs)
    return f"{xs[0]}x{len(xs)}" if len(set(xs)) == 1 and len(xs) > 1 else ",".join(map(str, xs))


# --------------------------------------------------------------------------- composition rules
@dataclasses.dataclass
class Estimate:
    status: str                 # ok, or the first failing piece's status
    cycles: float | None = None
    audit: str = audit.COMPLETE
    reasons: tuple = ()
    message: str = ""
    composed: bool = False      # priced from probes (composed_piece), not from whole compiles
    page_bound: bool = False    # the read audit counted run-time-sized DMAs at one page each


def _combine(recs: list[dict], cycles_fn) -> Estimate:
    bad = next((r for r in recs if r["status"] != "ok"), None)
    if bad:
        return Estimate(bad["status"], message=bad["message"])
    reasons = tuple(x for r in recs for x in r["audit"]["reasons"])
    return Estimate("ok", float(cycles_fn([r["cycles"] for r in recs])),
                    audit.INCOMPLETE if reasons else audit.COMPLETE, reasons,
                    page_bound=any(r["audit"].get("notes") for r in recs))


def decode_estimate(kernel, gen, bs, page, n, L, variant: Variant = BASE) -> Estimate:
    ms = (8 * bs.bq, 16 * bs.bq)      # 8 and 16 steps' sequences (bq > 1: ours' decode groups)
    recs = [piece(kernel, gen, Case.DECODE, bs, page, [1] * m, [L] * m, variant) for m in ms]
    return _combine(recs, lambda c: c[0] + (n - ms[0]) * (c[1] - c[0]) / (ms[1] - ms[0]))


WHOLE_PREFILL = (256, 512, 1024)   # causal sequences compiled whole (both kernels fit in memory)


def causal_items(bs: BlockSizes, L: int) -> list[float]:
    """(1, q blocks, KV steps) of one causal sequence of L tokens: q block i reads the
    ``cdiv(min((i + 1) bq, L), bkv)`` KV blocks up to its last row."""
    nq = cdiv(L, bs.bq)
    return [1.0, nq, sum(cdiv(min((i + 1) * bs.bq, L), bs.bkv) for i in range(nq))]


def prefill_estimate(kernel, gen, bs, L, variant: Variant = BASE) -> Estimate:
    """A whole compile when ``L`` is in ``WHOLE_PREFILL``; else cycles = a + b q blocks +
    c KV steps fitted to the whole compiles of ``WHOLE_PREFILL`` (module doc). Ours, when a
    whole compile runs out of VMEM: composed from the config's probes (``composed_piece``)."""
    if L in WHOLE_PREFILL:
        est = _combine([piece(kernel, gen, Case.PREFILL, bs, 128, [L], [L], variant)], lambda c: c[0])
    else:
        lens = [n for n in WHOLE_PREFILL if n >= bs.bq]
        recs = [piece(kernel, gen, Case.PREFILL, bs, 128, [n], [n], variant) for n in lens]

        def total(c):
            x = np.array([causal_items(bs, n) for n in lens])
            coef = np.linalg.lstsq(x, np.array(c, dtype=float), rcond=None)[0]
            return float(np.array(causal_items(bs, L)) @ coef)
        est = _combine(recs, total)
    if kernel == "ours" and est.status == "vmem_oom":
        comp = _combine([composed_piece(gen, Case.PREFILL, bs, 128, [L], [L], variant)], lambda c: c[0])
        if comp.status == "ok":
            return dataclasses.replace(comp, composed=True)
    return est


def mixed_estimate(kernel, gen, bs) -> Estimate:
    return _combine([piece(kernel, gen, Case.MIXED, bs, 128, *MIXED_STEP)], lambda c: c[0])


# --------------------------------------------------------------------------- table
def rows(gens, only):
    """(gen, workload name, case, Workload, {kernel: {bs: Estimate}}, variant)"""
    for gen in gens:
        if not only or "decode" in only:
            for L in SHORT_DECODE_LENS:
                w = Workload.of_case("decode", [1] * 128, [L] * 128)
                yield gen, f"short decode 128 x {L}, page 128", Case.DECODE, w, {
                    k: {bs: decode_estimate(k, gen, bs, 128, 128, L) for bs in decode_candidates(k, L, short=True)}
                    for k in KERNELS}, BASE
            for L in DECODE_LENS:
                for page in PAGES:
                    w = Workload.of_case("decode", [1] * 128, [L] * 128)
                    yield gen, f"decode 128 x {L}, page {page}", Case.DECODE, w, {
                        k: {bs: decode_estimate(k, gen, bs, page, 128, L) for bs in decode_candidates(k, L)}
                        for k in KERNELS}, BASE
        if not only or "prefill" in only:
            for L in PREFILL_LENS:
                w = Workload.of_case("prefill", [L], [L])
                yield gen, f"causal prefill 1 x {L}", Case.PREFILL, w, {
                    k: {bs: prefill_estimate(k, gen, bs, L) for bs in CANDIDATES[Case.PREFILL]} for k in KERNELS}, BASE
        if not only or "mixed" in only:
            w = Workload.of_case("mixed", *MIXED_STEP)
            yield gen, "mixed: 4 x spec-4 at 2K + 128 after 512", Case.MIXED, w, {
                k: {bs: mixed_estimate(k, gen, bs) for bs in CANDIDATES[Case.MIXED]} for k in KERNELS}, BASE


def variant_rows(gens, only):
    """The rows of ``VARIANTS`` (module doc), in the form of ``rows``: per generation, each
    variant's decode (``VARIANT_DECODE``, or ``WINDOW_DECODE`` with a window) and causal
    prefill of ``VARIANT_PREFILL`` tokens (not with a window)."""
    for gen in gens:
        for v in VARIANTS:
            if not only or "decode" in only:
                L, page = WINDOW_DECODE if v.sliding_window else VARIANT_DECODE
                w = Workload.of_case("decode", [1] * 128, [L] * 128)
                yield gen, f"{v.name}: decode 128 x {L}, page {page}", Case.DECODE, w, {
                    k: {bs: decode_estimate(k, gen, bs, page, 128, L, v) for bs in CANDIDATES[Case.DECODE]}
                    for k in KERNELS}, v
            if (not only or "prefill" in only) and not v.sliding_window:
                L = VARIANT_PREFILL
                w = Workload.of_case("prefill", [L], [L])
                yield gen, f"{v.name}: causal prefill 1 x {L}", Case.PREFILL, w, {
                    k: {bs: prefill_estimate(k, gen, bs, L, v) for bs in CANDIDATES[Case.PREFILL]}
                    for k in KERNELS}, v


TUNED = {"ours": "rpa-tune", "public": "tpu-inference"}     # the tuned kernel of each builder


def best(ests: dict, w: Workload, case: Case, gen: str, variant: Variant = BASE, kernel: str | None = None,
         page: int = 128):
    """The config with the least time among complete-audit estimates (an incomplete one
    wins only when no candidate is complete, and is marked); of configs at the same time
    (both at a physical bound), the one with fewer cycles. With ``kernel`` ("ours" /
    "public"), the time is the device-cost model's over the static estimate (the walk of
    that kernel at ``page``; ``rpa_tune.estimator.device_model``), else the static time."""
    from rpa_tune.estimator import device_model
    from rpa_tune.kernels import get_kernel

    def tm(bs, e):
        feats = None if kernel is None else device_model.features(
            get_kernel(TUNED[kernel]), w, variant.model, case, bs, page, gen, variant.sliding_window)
        return device_model.time_model(e.cycles, w, variant.model, gen, case,
                                       sliding_window=variant.sliding_window, features=feats)
    ok = [(bs, e, tm(bs, e)) for bs, e in ests.items() if e.status == "ok"]
    if not ok:
        return None
    complete = [x for x in ok if x[1].audit == audit.COMPLETE]
    return min(complete or ok, key=lambda x: (x[2]["time_s"], x[1].cycles))


def fmt_cell(b) -> tuple[str, str, str]:
    """(time, MBU / MFU at that time, cycles @ config; bound) of a kernel's best config."""
    if b is None:
        return "fails", "", ""
    bs, e, t = b
    mark = ("" if e.audit == audit.COMPLETE else " (audit incomplete)") + (" (composed)" if e.composed else "")
    return (f"{t['time_s'] * 1e6:,.0f} µs{mark}", f"{t['mbu']:.0%} / {t['mfu']:.0%}",
            f"{e.cycles / 1e3:,.0f}k @ {tuple(bs)}; {t['active_bound']}{'' if t['rate_ok'] else ', rate > peak'}")


_KEY_LINES = ("Ran out of memory", "Check failed", "RESOURCE_EXHAUSTED", "memory cap", "exceeded", "Error", "error")


# Profiler aborts whose recorded tail (the last 300 characters) holds only a stack or an
# HLO dump: what the full message says (seen in reruns).
_KNOWN_ABORTS = (
    ("static_llo_profile/llo_execution_graph.cc",
     "profiler abort: \"No DMA issue node found for sync flag\" (dma_latency_model.cc; the TPU7x "
     "prefill abort of rpa_tune/estimator/public.py's module doc)"),
    ("in HLO [pad_maximum_fusion]",
     "profiler abort in XLA's fp8 pad fusion before the kernel (the public wrapper's merge_kv of the "
     "new K/V: vpack.c.b16.b8), not in the kernel"),
    ("in HLO [public_rpa_prefill",
     "profiler abort simulating the public prefill kernel (an operand of vpack.c.f32.bf16; the v5e "
     "prefill abort of rpa_tune/estimator/public.py's module doc)"),
    ("in HLO [reshape.8.refs_8_]",
     "profiler abort in an XLA fusion of the fp8 operands before the kernel (HLO reshape.8: \"Expected "
     "vector-f32, got vector-int32 ... vadd.f32\"), not in the kernel"),
)


def _one_line(message: str, width: int = 200) -> str:
    """The line of a failure message that says what failed (a crash's message ends in a
    stack dump), on one line for the markdown notes."""
    for mark, reason in _KNOWN_ABORTS:
        if mark in (message or ""):
            return reason
    lines = [" ".join(l.split()) for l in (message or "").replace("\\n", "\n").splitlines()]
    lines = [l for l in lines if l and not l.startswith(("@", "https://", "***", "E1", "F1", "==="))]
    pick = next((l for l in lines if any(k in l for k in _KEY_LINES)), lines[-1] if lines else "")
    at = min((pick.find(k) for k in _KEY_LINES if k in pick), default=0)
    return pick[at:at + width]


def merge_tables(old_text: str, rows: list[str], notes: list[str], rerun_gens=()) -> tuple[list[str], list[str]]:
    """``rows`` / ``notes`` of a run merged into the table file they replace (``old_text``):
    a row is keyed by its generation and workload, a new row takes its old row's place, the
    old rows of workloads not run are kept (so ``--tpu v6e`` does not drop the v5e and
    TPU7x rows) except in ``rerun_gens``, generations run for every case, whose rows not
    produced again are gone (a renamed or dropped workload); a workload new to the table
    goes after the last row of its generation. Notes follow their rows."""
    key = lambda line: tuple(c.strip() for c in line.split("|")[1:3])
    new = {key(l): l for l in rows}
    old_rows = [l for l in old_text.split("\n\n", 1)[0].splitlines()[2:]
                if l.startswith("| ") and (key(l) in new or key(l)[0] not in rerun_gens)]
    out = [new.pop(key(l), l) for l in old_rows]
    for k, line in new.items():
        last = max((i for i, l in enumerate(out) if key(l)[0] == k[0]), default=len(out) - 1)
        out.insert(last + 1, line)

    def note_key(line, keys):
        return max((k for k in keys if line.startswith(f"- {k[0]} {k[1]}, ")), key=lambda k: len(k[1]), default=None)
    run = {key(l) for l in rows}
    old_keys = [key(l) for l in old_rows]
    kept = [l for l in old_text.splitlines() if l.startswith("- ") and note_key(l, old_keys) not in run]
    every = [key(l) for l in out]
    by_key = {}
    for line in kept + notes:
        by_key.setdefault(note_key(line, every), []).append(line)
    return out, [n for k in every + [None] for n in by_key.get(k, [])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tpu", action="append", default=None)
    ap.add_argument("--only", action="append", choices=["decode", "prefill", "mixed"], default=None,
                    help="only these cases (repeatable; default: all)")
    ap.add_argument("--check", action="append", choices=["decode", "prefill"], default=[],
                    help="also compile whole workloads to check that rule (repeatable)")
    ap.add_argument("--variants", action="store_true",
                    help="the VARIANTS table (head_dim 64 / 256, fp8 KV, sliding window) instead of the main one")
    ap.add_argument("--out", default=None, help="default: results/vs_public.md (--variants: vs_public_variants.md)")
    ap.add_argument("--pieces", default=PIECES, help="where the pieces the tables read are kept (default: %(default)s)")
    args = ap.parse_args()
    if args.out is None:
        args.out = os.path.join(HERE, "results", "vs_public_variants.md" if args.variants else "vs_public.md")
    _CACHE.update(_load_cache())
    gens = args.tpu or ["v6e"]
    lines = ["| gen | workload | ours: time | ours: MBU / MFU | ours: cycles @ best config; bound | public: time | "
             "public: MBU / MFU | public: cycles @ best; bound | ours / public (time) |",
             "|---|---|---:|---:|---|---:|---:|---|---:|"]
    notes = []
    for gen, name, case, w, per, v in (variant_rows if args.variants else rows)(gens, args.only):
        page = int(re.search(r"page (\d+)", name).group(1)) if "page" in name else 128
        b = {k: best(per[k], w, case, gen, v, k, page) for k in KERNELS}
        o, p = fmt_cell(b["ours"]), fmt_cell(b["public"])
        ratio = f"{b['ours'][2]['time_s'] / b['public'][2]['time_s']:.2f}" if b["ours"] and b["public"] else ""
        lines.append(f"| {gen} | {name} | {' | '.join(o)} | {' | '.join(p)} | {ratio} |")
        print(lines[-1], flush=True)
        for k in KERNELS:
            paged = []
            for bs, e in per[k].items():
                if e.status != "ok":
                    notes.append(f"- {gen} {name}, {k} {tuple(bs)}: {e.status}: {_one_line(e.message)}")
                elif e.reasons:
                    notes.append(f"- {gen} {name}, {k} {tuple(bs)}: audit incomplete: {'; '.join(e.reasons)[:200]}")
                elif e.page_bound:
                    paged.append(str(tuple(bs)))
            if paged:
                notes.append(f"- {gen} {name}, {k} {', '.join(paged)}: read audit complete with each run-time-sized "
                             "DMA counted at one page at most (`audit.page_bytes`)")
    if os.path.exists(args.out):
        with open(args.out) as f:
            merged, notes = merge_tables(f.read(), lines[2:], notes, rerun_gens=() if args.only else gens)
        lines = lines[:2] + merged
    if args.check:
        lines += ["", "Checks of the composition rules against whole compiles (cycles):", "",
                  "| kernel | gen | workload | config | whole | by the rule | rule / whole |", "|---|---|---|---|---:|---:|---:|"]
        for gen in gens:
            for k in KERNELS if "decode" in args.check else ():
                bs = CANDIDATES[Case.DECODE][1]
                whole = piece(k, gen, Case.DECODE, bs, 256, [1] * 128, [2048] * 128)
                rule = decode_estimate(k, gen, bs, 256, 128, 2048)
                lines.append(_check_line(k, gen, "decode 128 x 2048, page 256", bs, whole, rule))
            if "prefill" not in args.check:
                continue
            bs = CANDIDATES[Case.PREFILL][0]
            whole = piece("public", gen, Case.PREFILL, bs, 128, [2048], [2048])
            rule = prefill_estimate("public", gen, bs, 2048)
            lines.append(_check_line("public", gen, "causal prefill 1 x 2048", bs, whole, rule))
    text = "\n".join(lines + ([""] + notes if notes else [])) + "\n"
    print(text)
    with open(args.out, "w") as f:
        f.write(text)
    n = write_pieces(_USED, args.pieces)
    print(f"{len(_USED)} pieces read; {args.pieces} holds {n}")


def _check_line(k, gen, name, bs, whole, rule: Estimate) -> str:
    if whole["status"] != "ok" or rule.status != "ok":
        return f"| {k} | {gen} | {name} | {tuple(bs)} | {whole['status']} | {rule.status} | |"
    return (f"| {k} | {gen} | {name} | {tuple(bs)} | {whole['cycles']:,} | {rule.cycles:,.0f} | "
            f"{rule.cycles / whole['cycles']:.3f} |")


if __name__ == "__main__":
    main()
