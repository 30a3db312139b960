"""Server bring-up: compile every kernel variant a server will need before its first request.

``precompile(model, limits, ...)`` lowers and compiles, for each ``max_num_tokens``
bucket, the same jitted program ``kernel.ragged_paged_attention`` runs (the three cases in
one executable, block sizes resolved exactly as a call would: explicit -> env -> tables ->
heuristic), and reports each variant's compile time and the total.

* On a TPU (``tpu=None``): ``_rpa_jit.lower(...).compile()`` with the real shapes on the
  local device. This fills JAX's in-process cache (a later call with the same shapes does
  not compile again) and, when configured, JAX's persistent compilation cache, so the
  next start-up reads executables from disk instead of compiling.
* Deviceless (``tpu="v6e"`` etc.): compiles for that generation with libtpu and no TPU,
  which proves that every variant compiles (VMEM included), e.g. in CI. libtpu cannot load
  executables without a device ("PjRtCompiler must be constructed with a Client to call
  DeserializeLoadedExecutable"), so JAX's persistent cache is written but never read
  deviceless. Instead, when a cache directory is configured, a successful deviceless
  compile records the sha256 of the lowered module (with jax / jaxlib / libtpu versions,
  the topology and the XLA / libtpu flags) under ``<cache>/rpa-deviceless-verified``; the
  same module later is reported as ``cached`` (verified before) without compiling again.

``per_case=True`` compiles each case alone (one executable per case x bucket): what
``verify_entries`` uses to check table entries, and a way to see per-case compile times;
those executables are not the ones a serving call uses.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Iterable, Sequence

from .config import BlockSizes, CASES, Case, TuningKey, get_generation
from .workload import ModelShape, ServingLimits

log = logging.getLogger("kernel.precompile")

ATTN_OPTIONS = ("sm_scale", "sliding_window", "soft_cap", "q_scale", "k_scale", "v_scale",
                "chunk_prefill_size", "vmem_limit_bytes")
ARG_ORDER = ("queries", "keys", "values", "kv_cache", "kv_lens", "page_indices", "cu_q_lens", "distribution")
VERIFIED_SUBDIR = "rpa-deviceless-verified"


def default_token_buckets(max_num_tokens: int, min_bucket: int = 16) -> list[int]:
    """Powers of two from ``min_bucket`` up to ``max_num_tokens`` (and ``max_num_tokens``
    itself when it is not a power of two): the padding buckets serving stacks use."""
    out, b = [], min_bucket
    while b < max_num_tokens:
        out.append(b)
        b *= 2
    out.append(int(max_num_tokens))
    return sorted(set(out))


@dataclasses.dataclass
class Variant:
    bucket: int                                    # max_num_tokens of this executable
    cases: tuple[str, ...]
    block_sizes: tuple[tuple[str, BlockSizes, str], ...]   # (case, sizes, source)
    status: str = "pending"                        # compiled / cached / error
    lower_s: float = 0.0
    compile_s: float = 0.0
    error: str | None = None

    @property
    def seconds(self) -> float:
        return self.lower_s + self.compile_s

    def label(self) -> str:
        return f"t{self.bucket} " + " ".join(f"{c}{tuple(bs)}[{src.split(':')[0]}]"
                                               for c, bs, src in self.block_sizes)


@dataclasses.dataclass
class PrecompileReport:
    tpu: str
    deviceless: bool
    variants: list[Variant]
    total_s: float
    cache_dir: str | None

    @property
    def ok(self) -> bool:
        return all(v.status != "error" for v in self.variants)

    def counts(self) -> dict:
        out = {}
        for v in self.variants:
            out[v.status] = out.get(v.status, 0) + 1
        return out

    def summary(self) -> str:
        c = self.counts()
        parts = ", ".join(f"{n} {s}" for s, n in sorted(c.items()))
        mode = f"deviceless {self.tpu}" if self.deviceless else f"on {self.tpu}"
        return (f"precompile ({mode}): {len(self.variants)} variants ({parts}) in {self.total_s:.1f} s"
                + (f"; cache {self.cache_dir}" if self.cache_dir else "; no persistent cache"))

    def as_dict(self) -> dict:
        return {"tpu": self.tpu, "deviceless": self.deviceless, "total_s": self.total_s,
                "cache_dir": self.cache_dir,
                "variants": [{"bucket": v.bucket, "cases": list(v.cases), "status": v.status,
                              "lower_s": v.lower_s, "compile_s": v.compile_s, "error": v.error,
                              "block_sizes": [{"case": c, "block_sizes": list(bs), "source": s}
                                              for c, bs, s in v.block_sizes]}
                             for v in self.variants]}


# ------------------------------------------------------------------------ cache setup
def configure_cache(cache_dir: str | os.PathLike | None) -> str | None:
    """Point JAX's persistent compilation cache at ``cache_dir`` (lowering the size / time
    thresholds so every kernel variant is cached); ``None`` keeps JAX's current setting.
    Returns the directory in effect (or None)."""
    import jax
    if cache_dir is not None:
        cache_dir = str(Path(cache_dir).expanduser())
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return jax.config.jax_compilation_cache_dir or None


def _versions() -> str:
    import jax
    import jaxlib
    from .tables import libtpu_version
    return f"jax={jax.__version__};jaxlib={jaxlib.__version__};libtpu={libtpu_version()}"


def _module_digest(lowered, topology: str) -> str:
    h = hashlib.sha256()
    for part in (_versions(), topology, os.environ.get("LIBTPU_INIT_ARGS", ""),
                 os.environ.get("XLA_FLAGS", ""), lowered.as_text()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


# ------------------------------------------------------------------------ compilation
def _as_model(model) -> ModelShape:
    return model if isinstance(model, ModelShape) else ModelShape(**dict(model))


def _as_limits(limits) -> ServingLimits:
    return limits if isinstance(limits, ServingLimits) else ServingLimits(**dict(limits))


def _local_args(model: ModelShape, limits: ServingLimits, num_pages: int, committed: bool = True):
    import jax
    from .analysis import abstract_inputs
    # JAX keys its in-process cache on whether arguments are committed to a device
    sh = jax.sharding.SingleDeviceSharding(jax.devices()[0]) if committed else None
    return abstract_inputs(model, limits, None, num_pages, sharding=sh)


def _compile_one(model, limits, *, generation, deviceless, num_pages, cases, block_sizes, attn,
                 interpret, verified_dir, committed=True) -> Variant:
    from .analysis import abstract_inputs, serving_dims
    from .api import _rpa_jit, build_options, resolve_block_sizes
    v = Variant(bucket=limits.max_num_tokens, cases=tuple(cases), block_sizes=())
    try:
        t0 = time.perf_counter()
        args = (abstract_inputs(model, limits, generation, num_pages) if deviceless
                else _local_args(model, limits, num_pages, committed))
        dims = serving_dims(model, limits, args["kv_cache"].shape[0])
        explicit = {Case.parse(k): val for k, val in (block_sizes or {}).items()}
        sw = attn.get("sliding_window")
        v.block_sizes = tuple(
            (c, *resolve_block_sizes(Case(c), explicit.get(Case(c)), generation=generation, dims=dims,
                                     chunk_prefill_size=attn.get("chunk_prefill_size"),
                                     sliding_window=sw is not None))
            for c in cases)
        options = build_options(dims, generation, explicit, cases=tuple(cases), **attn)
        # sinks passed as the call passes them (positionally, None without attention sinks):
        # an argument left to its default is another jit signature, compiled again at the call
        lowered = _rpa_jit.lower(*(args[k] for k in ARG_ORDER), args.get("sinks"), options=options,
                                 interpret=interpret)
        v.lower_s = time.perf_counter() - t0
        digest = marker = None
        if deviceless and verified_dir is not None:
            digest = _module_digest(lowered, get_generation(generation).topology)
            marker = Path(verified_dir) / digest
            if marker.exists():
                v.status = "cached"
                return v
        t1 = time.perf_counter()
        lowered.compile()
        v.compile_s = time.perf_counter() - t1
        v.status = "compiled"
        if marker is not None:
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(json.dumps({"label": v.label(), "compile_s": v.compile_s}) + "\n")
    except Exception as e:  # noqa: BLE001 - reported per variant
        v.status = "error"
        v.error = f"{type(e).__name__}: {str(e)[:2000]}"
    return v


def _progress_wanted(progress) -> bool:
    if progress is not None:
        return bool(progress)
    return sys.stderr.isatty()


def _run(jobs: list[dict], *, progress, describe) -> list[Variant]:
    out = []
    bar = None
    if _progress_wanted(progress):
        try:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                       TimeElapsedColumn)
            bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                           TimeElapsedColumn(), transient=False)
        except ImportError:
            bar = None
    if bar is not None:
        with bar:
            task = bar.add_task("precompile", total=len(jobs))
            for job in jobs:
                bar.update(task, description=f"precompile {describe(job)}")
                v = _compile_one(**job)
                out.append(v)
                bar.console.log(f"{v.status:8s} {v.seconds:6.2f} s  {v.label()}"
                                + (f"  {v.error[:200]}" if v.error else ""))
                bar.advance(task)
    else:
        for i, job in enumerate(jobs):
            v = _compile_one(**job)
            out.append(v)
            lvl = logging.WARNING if v.status == "error" else logging.INFO
            log.log(lvl, "precompile [%d/%d] %s %.2f s (lower %.2f s, compile %.2f s) %s%s", i + 1,
                    len(jobs), v.status, v.seconds, v.lower_s, v.compile_s, v.label(),
                    f": {v.error[:500]}" if v.error else "")
    return out


def precompile(model, limits, *, token_buckets: Sequence[int] | None = None,
               num_pages: int | None = None, tpu: str | None = None,
               cases: Iterable = CASES, per_case: bool = False, block_sizes: dict | None = None,
               cache_dir: str | os.PathLike | None = None, progress: bool | None = None,
               interpret: bool = False, raise_on_error: bool = False, verify_cache: bool = True,
               committed: bool = True, **attn_options) -> PrecompileReport:
    """Compile every case x token-bucket variant a server needs, before serving.

    Args:
      model: ``ModelShape`` (or a dict of its fields): per-shard heads, head_dim, dtypes.
      limits: ``ServingLimits`` (or dict): page_size, max_num_tokens, max_num_seqs,
        max_model_len. ``token_buckets`` defaults to ``default_token_buckets(max_num_tokens)``.
      num_pages: KV-cache pages (default ``max_num_seqs * pages_per_seq``).
      tpu: None compiles for the local TPU; a generation name (``v5e``, ``v6e``,
        ``tpu7x``...) compiles deviceless for it.
      cases: cases in the executable; default all three (what a serving call runs).
      per_case: one executable per case x bucket instead of one per bucket.
      block_sizes: explicit ``{case: BlockSizes}`` (as the kernel call's ``*_block_sizes``).
      cache_dir: JAX persistent compilation cache directory to use (None: keep JAX's
        configuration, e.g. ``JAX_COMPILATION_CACHE_DIR``).
      progress: Rich progress bar (None: when stderr is a terminal); else log lines.
      interpret: compile the Pallas interpreter version on the local (CPU) device: for
        tests of the on-device path without a TPU.
      raise_on_error: raise ``RuntimeError`` if a variant fails.
      verify_cache: deviceless only: skip modules verified before (see module docstring).
      committed: on a device, compile for arguments committed to the first local device
        (``jax.device_put(x, device)``, outputs of jitted code on such arrays: what a server
        holds); False for uncommitted arrays (``jnp.asarray``, NumPy). JAX keys its
        in-process cache on this; the persistent cache serves both.
      **attn_options: the static options the server passes to every call (``sm_scale``,
        ``sliding_window``, ``soft_cap``, ``q_scale``, ``k_scale``, ``v_scale``,
        ``chunk_prefill_size``, ``vmem_limit_bytes``); they are part of the compiled program.
    """
    from .analysis import quiet_libtpu
    bad = [k for k in attn_options if k not in ATTN_OPTIONS]
    if bad:
        raise TypeError(f"precompile() got unknown options {bad}; valid: {ATTN_OPTIONS}")
    model, limits = _as_model(model), _as_limits(limits)
    cases = tuple(Case.parse(c).value for c in cases)
    buckets = sorted({int(b) for b in (token_buckets or default_token_buckets(limits.max_num_tokens))})
    if not buckets or any(b <= 0 for b in buckets):
        raise ValueError(f"token_buckets={token_buckets!r} must be positive ints")
    if num_pages is None:
        num_pages = limits.max_num_seqs * limits.pages_per_seq
    deviceless = tpu is not None
    interp = None
    if deviceless:
        quiet_libtpu()
        generation = get_generation(tpu).name
        label = generation
    else:
        import jax
        from .hardware import current_generation
        dev = jax.devices()[0]
        if interpret:
            from jax.experimental.pallas import tpu as pltpu
            interp = pltpu.InterpretParams()
        elif dev.platform != "tpu":
            raise RuntimeError(f"no local TPU (default device is {dev.platform}); pass tpu=<generation> "
                               f"to compile deviceless")
        generation = current_generation().name
        label = generation if interp is None else f"{generation} (Pallas interpreter on {dev.platform})"
    cache = configure_cache(cache_dir)
    verified_dir = str(Path(cache) / VERIFIED_SUBDIR) if (cache and deviceless and verify_cache) else None
    attn = dict(attn_options)
    groups = [(c,) for c in cases] if per_case else [cases]
    jobs = [dict(model=model, limits=dataclasses.replace(limits, max_num_tokens=b), generation=generation,
                 deviceless=deviceless, num_pages=num_pages, cases=g, block_sizes=block_sizes, attn=attn,
                 interpret=interp, verified_dir=verified_dir, committed=committed)
            for b in buckets for g in groups]
    t0 = time.perf_counter()
    variants = _run(jobs, progress=progress,
                    describe=lambda j: f"t{j['limits'].max_num_tokens} {'+'.join(j['cases'])}")
    report = PrecompileReport(tpu=label, deviceless=deviceless, variants=variants,
                              total_s=time.perf_counter() - t0, cache_dir=cache)
    log.info(report.summary())
    if raise_on_error and not report.ok:
        errs = [f"{v.label()}: {v.error}" for v in variants if v.status == "error"]
        raise RuntimeError(f"{len(errs)} variant(s) failed to compile:\n" + "\n".join(errs))
    return report


# ------------------------------------------------------------------ table verification
VERIFY_MAX_NUM_SEQS = 128
VERIFY_SLIDING_WINDOW = 1024


def entry_problem(key: TuningKey, max_num_seqs: int | None = None):
    """(ModelShape, ServingLimits, attention options) to compile a table key deviceless.
    ``max_num_seqs`` is not part of a key: ``min(max_num_tokens, VERIFY_MAX_NUM_SEQS)``."""
    model = ModelShape(key.num_q_heads, key.num_kv_heads, key.head_dim, key.q_dtype, key.kv_dtype)
    limits = ServingLimits(page_size=key.page_size, max_num_tokens=key.max_num_tokens,
                           max_num_seqs=max_num_seqs or min(key.max_num_tokens, VERIFY_MAX_NUM_SEQS),
                           max_model_len=key.max_model_len)
    attn = {"sliding_window": min(VERIFY_SLIDING_WINDOW, key.max_model_len)} if key.sliding_window else {}
    return model, limits, attn


def verify_entries(entries, *, progress: bool | None = None, cache_dir=None) -> list[tuple]:
    """Compile (deviceless, for each entry's generation) every entry's block sizes alone.
    Returns ``[(entry, Variant)]``."""
    from .analysis import quiet_libtpu
    quiet_libtpu()
    cache = configure_cache(cache_dir)
    jobs, ents = [], []
    for e in entries:
        model, limits, attn = entry_problem(e.key)
        if e.vmem_limit_bytes is not None:
            attn["vmem_limit_bytes"] = e.vmem_limit_bytes
        jobs.append(dict(model=model, limits=limits, generation=e.key.generation, deviceless=True,
                         num_pages=limits.max_num_seqs * limits.pages_per_seq, cases=(e.key.case,),
                         block_sizes={e.key.case: e.block_sizes}, attn=attn, interpret=None,
                         verified_dir=str(Path(cache) / VERIFIED_SUBDIR) if cache else None))
        ents.append(e)
    variants = _run(jobs, progress=progress, describe=lambda j: f"{j['generation']} {j['cases'][0]} "
                                                                f"t{j['limits'].max_num_tokens}")
    return list(zip(ents, variants))
