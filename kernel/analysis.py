"""Deviceless compilation and workload-aware static cost estimates.

Two entry points:

* ``lower_deviceless(model, limits, tpu, block_sizes, cases)`` lowers the real kernel for a
  TPU generation with abstract inputs (no TPU needed); ``.compile()`` on the result is the
  VMEM judge (``RESOURCE_EXHAUSTED`` when a config does not fit).
* ``lower_for_estimate(workload, block_sizes, tpu, model, limits, case)`` lowers the same
  kernel code with the workload's metadata made visible to libtpu's static profiler:
  ``kv_lens`` and ``cu_q_lens`` are stored into SMEM at static addresses at kernel entry
  and read from there; the case's sequences are walked as *segments* of consecutive
  sequences with equal ``(q_len, kv_len)`` (one loop per segment, whose first iteration
  the profiler costs and multiplies by the trip count), and each segment's q-block loop
  is unrolled so causal trip counts that grow with the q-block index are costed exactly.
  Compile the result in a process started with
  ``LIBTPU_INIT_ARGS=--xla_jf_dump_static_llo_profile_to=DIR``; ``estimate()`` does all of
  that in a child process and returns the cycles.

Kernel correctness never depends on this module: static metadata only exists here.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from .config import BlockSizes, CASES, Case, cdiv, get_generation, get_kv_cache_shape, round_up
from .workload import ModelShape, ServingLimits, Workload

PROFILE_FLAG = "--xla_jf_dump_static_llo_profile_to"
MAX_UNROLLED_Q_BLOCKS = 64


def _quiet_libtpu_env(env=None):
    env = dict(os.environ if env is None else env)
    env.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    env.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    return env


def quiet_libtpu():
    """Silence libtpu's 'no TPU here' warnings and allow parallel libtpu processes."""
    os.environ.update(_quiet_libtpu_env())


def _sharding(tpu: str):
    import jax
    from jax.experimental import topologies
    topo = topologies.get_topology_desc(platform="tpu", topology_name=get_generation(tpu).topology)
    return jax.sharding.SingleDeviceSharding(topo.devices[0])


def abstract_inputs(model: ModelShape, limits: ServingLimits, tpu: str, num_pages: int | None = None):
    """``ShapeDtypeStruct``s of every kernel argument, placed on the deviceless TPU."""
    import jax
    import jax.numpy as jnp
    sh = _sharding(tpu)
    T, S = limits.max_num_tokens, limits.max_num_seqs
    if num_pages is None:
        num_pages = S * limits.pages_per_seq
    sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, jnp.dtype(dt), sharding=sh)
    return dict(
        queries=sds((T, model.num_q_heads, model.head_dim), model.q_dtype),
        keys=sds((T, model.num_kv_heads, model.head_dim), model.q_dtype),
        values=sds((T, model.num_kv_heads, model.head_dim), model.q_dtype),
        kv_cache=sds(get_kv_cache_shape(num_pages, limits.page_size, model.num_kv_heads,
                                        model.head_dim, jnp.dtype(model.kv_dtype)), model.kv_dtype),
        kv_lens=sds((S,), "int32"),
        page_indices=sds((S * limits.pages_per_seq,), "int32"),
        cu_q_lens=sds((S + 1,), "int32"),
        distribution=sds((3,), "int32"),
    )


def _dims(model: ModelShape, limits: ServingLimits, num_pages: int) -> dict:
    return dict(max_num_tokens=limits.max_num_tokens, num_q_heads=model.num_q_heads,
                num_kv_heads=model.num_kv_heads, head_dim=model.head_dim, num_pages=num_pages,
                page_size=limits.page_size, max_num_seqs=limits.max_num_seqs,
                pages_per_seq=limits.pages_per_seq, kv_dtype=model.kv_dtype, q_dtype=model.q_dtype)


def _block_dict(block_sizes) -> dict:
    if block_sizes is None:
        return {}
    if isinstance(block_sizes, dict):
        return {Case.parse(k): (None if v is None else BlockSizes.coerce(v)) for k, v in block_sizes.items()}
    raise ValueError(f"block_sizes must be a dict case -> (bq, bkv, cq, ckv), got {block_sizes!r}")


def lower_deviceless(model: ModelShape, limits: ServingLimits, tpu: str, block_sizes=None,
                     cases=("decode", "prefill", "mixed"), *, vmem_limit_bytes=None,
                     static_meta=None, num_pages: int | None = None, **attn_options):
    """Lower the kernel for TPU generation ``tpu`` without a TPU. Returns ``jax.stages.Lowered``."""
    import jax
    from .api import _rpa_jit, build_options
    cases = tuple(Case.parse(c).value for c in cases)
    args = abstract_inputs(model, limits, tpu, num_pages)
    dims = _dims(model, limits, args["kv_cache"].shape[0])
    options = build_options(dims, get_generation(tpu).name, _block_dict(block_sizes),
                            vmem_limit_bytes=vmem_limit_bytes, static_meta=static_meta,
                            cases=cases, **attn_options)
    fn = lambda *a: _rpa_jit(*a, options=options, interpret=None)
    order = ("queries", "keys", "values", "kv_cache", "kv_lens", "page_indices", "cu_q_lens", "distribution")
    return jax.jit(fn).lower(*(args[k] for k in order))


# ----------------------------------------------------------------- static workloads
def canonical_order(workload: Workload) -> Workload:
    """Sort each case's sequences by (q_len, kv_len): equal sequences become one segment.
    The kernel's cost does not depend on sequence order within a case."""
    parts = []
    for case in CASES:
        lo, hi = workload.case_range(case)
        pairs = sorted(zip(workload.q_lens[lo:hi], workload.kv_lens[lo:hi]))
        parts.append(Workload.of_case(case, [p[0] for p in pairs], [p[1] for p in pairs]) if pairs else None)
    return Workload.concat(*parts)


def static_meta_for(workload: Workload, limits: ServingLimits) -> tuple:
    """Per case: (segments, kv_lens, cu_q_lens) with segments = ((lo, hi, q_len), ...)."""
    w = canonical_order(workload)
    meta, _ = w.metadata(limits, shuffle_pages=False)
    kv = tuple(int(x) for x in meta["kv_lens"])
    cu = tuple(int(x) for x in meta["cu_q_lens"])
    per_case = []
    for case in CASES:
        lo, hi = w.case_range(case)
        segs = []
        s = lo
        while s < hi:
            e = s
            while e < hi and (w.q_lens[e], w.kv_lens[e]) == (w.q_lens[s], w.kv_lens[s]):
                e += 1
            segs.append((s, e, w.q_lens[s]))
            s = e
        per_case.append((tuple(segs), kv, cu))
    return tuple(per_case)


def lower_for_estimate(workload: Workload, block_sizes, tpu: str, model: ModelShape,
                       limits: ServingLimits, case: Case | str, **attn_options):
    """Lower one case's kernel with ``workload``'s metadata visible to the static profiler.

    ``block_sizes`` is the case's ``BlockSizes`` (or a dict case -> sizes). Compile the result
    with ``LIBTPU_INIT_ARGS=--xla_jf_dump_static_llo_profile_to=DIR`` set before libtpu
    loads; the profile of kernel ``rpa_<case>_<sizes>`` holds ``estimated_cycles``.
    """
    case = Case.parse(case)
    bsd = block_sizes if isinstance(block_sizes, dict) else {case: block_sizes}
    bsd = _block_dict(bsd)
    bs = bsd.get(case)
    lo, hi = workload.case_range(case)
    if hi == lo:
        raise ValueError(f"workload has no {case.value} sequences (distribution={workload.distribution})")
    if bs is not None and case != Case.DECODE:
        nq = max(cdiv(q, bs.bq) for q in workload.q_lens[lo:hi])
        if nq > MAX_UNROLLED_Q_BLOCKS:
            raise ValueError(f"a {case.value} sequence needs {nq} q blocks of bq={bs.bq}; the estimate "
                             f"unrolls at most {MAX_UNROLLED_Q_BLOCKS}: use a larger bq or shorter chunks")
    meta = static_meta_for(workload, limits)
    return lower_deviceless(model, limits, tpu, bsd, cases=(case.value,), static_meta=meta,
                            num_pages=max(2, sum(cdiv(k, limits.page_size) for k in workload.kv_lens) + 1),
                            **attn_options)


# ------------------------------------------------------------------ compile verdicts
_OOM_PATTERNS = (
    re.compile(r"Scoped allocation with size ([\d.]+)([KMG]?)(?:i?B)? and limit ([\d.]+)([KMG]?)"),
    re.compile(r"Used ([\d.]+)([KMG]?)(?:i?B)? of ([\d.]+)([KMG]?)(?:i?B)? vmem"),
    re.compile(r"Allocation \(size=(\d+)()\) would exceed memory \(size=(\d+)()\)"),
)
_UNIT = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_vmem_oom(message: str) -> dict | None:
    """``{"used_bytes", "limit_bytes", "kind"}`` from a VMEM RESOURCE_EXHAUSTED message, else None."""
    if "vmem" not in message.lower() and "would exceed memory" not in message:
        return None
    for kind, pat in zip(("scoped_limit", "capacity", "allocation"), _OOM_PATTERNS):
        m = pat.search(message)
        if m:
            used = float(m.group(1)) * _UNIT[m.group(2)]
            limit = float(m.group(3)) * _UNIT[m.group(4)]
            return {"used_bytes": int(used), "limit_bytes": int(limit), "kind": kind}
    return None


def _parse_profiles(directory: str) -> dict[str, int]:
    out = {}
    for path in glob.glob(os.path.join(directory, "*static_llo_profile*")):
        text = open(path).read()
        for block in text.split("hlo_op_estimate")[1:]:
            name = re.search(r'hlo_op_name:\s*"([^"]+)"', block)
            cyc = re.search(r"estimated_cycles:\s*(\d+)", block)
            if name and cyc:
                out[name.group(1)] = out.get(name.group(1), 0) + int(cyc.group(1))
    return out


def _estimate_in_this_process(req: dict) -> dict:
    """Runs in a child whose LIBTPU_INIT_ARGS has the profile flag (see ``estimate``)."""
    quiet_libtpu()
    from .api import Options  # noqa: F401  (import jax after env is set)
    model = ModelShape(**req["model"])
    limits = ServingLimits(**req["limits"])
    w = Workload(tuple(req["workload"]["q_lens"]), tuple(req["workload"]["kv_lens"]),
                 tuple(req["workload"]["distribution"]))
    case = Case.parse(req["case"])
    bs = BlockSizes(*req["block_sizes"])
    t0 = time.perf_counter()
    lowered = lower_for_estimate(w, bs, req["tpu"], model, limits, case, **req.get("options", {}))
    result = {"status": "ok", "lower_s": time.perf_counter() - t0}
    t1 = time.perf_counter()
    try:
        lowered.compile()
    except Exception as e:  # noqa: BLE001 - classify compiler verdicts
        msg = str(e)
        oom = parse_vmem_oom(msg)
        result.update(status="vmem_oom" if oom else "compile_error", message=msg[-2000:])
        if oom:
            result.update(vmem=oom)
        return result
    result["compile_s"] = time.perf_counter() - t1
    profiles = _parse_profiles(req["profile_dir"])
    prefix = f"rpa_{case.value}_{bs.label()}"
    cycles = sum(v for k, v in profiles.items() if k.startswith(prefix))
    result.update(cycles=cycles, profiles=profiles)
    return result


def estimate(workload: Workload, block_sizes: BlockSizes, tpu: str, model: ModelShape,
             limits: ServingLimits, case: Case | str, *, timeout: float | None = 600,
             **attn_options) -> dict:
    """Compile in a child process with the static profiler on; return its verdict.

    Keys: ``status`` (ok / vmem_oom / compile_error / timeout / crash), ``cycles`` (the
    kernel's static estimate), ``compile_s``, ``vmem`` (parsed OOM bytes), ``message``.
    """
    with tempfile.TemporaryDirectory(prefix="rpa_profile_") as d:
        req = dict(model=dataclasses.asdict(model), limits=dataclasses.asdict(limits),
                   workload=dict(q_lens=workload.q_lens, kv_lens=workload.kv_lens,
                                 distribution=workload.distribution),
                   case=Case.parse(case).value, block_sizes=list(BlockSizes.coerce(block_sizes)),
                   tpu=get_generation(tpu).name, profile_dir=d, options=attn_options)
        env = _quiet_libtpu_env()
        env["LIBTPU_INIT_ARGS"] = (env.get("LIBTPU_INIT_ARGS", "") + f" {PROFILE_FLAG}={d}").strip()
        env["JAX_PLATFORMS"] = ""
        try:
            proc = subprocess.run([sys.executable, "-m", "kernel.analysis"], input=json.dumps(req),
                                  capture_output=True, text=True, env=env, timeout=timeout,
                                  cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        except subprocess.TimeoutExpired:
            return {"status": "timeout", "message": f"compile exceeded {timeout} s"}
        lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
        if proc.returncode != 0 or not lines:
            return {"status": "crash", "returncode": proc.returncode, "message": proc.stderr[-2000:]}
        return json.loads(lines[-1])


if __name__ == "__main__":
    print(json.dumps(_estimate_in_this_process(json.loads(sys.stdin.read()))))
