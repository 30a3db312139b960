"""Per-generation calibration of libtpu's static profiler: clock, MXU rate, HBM rate.

libtpu's static profiler (``profiler.profile``) reports cycles, never seconds. This module
measures the profiler's *own* rates with probe kernels compiled deviceless, and derives
from them what is needed to turn its cycles into time and to count work in its traces.
The results ship as package data (``rpa_tune/data/calibration.json``); ``calibration(gen)``
reads them, ``measure(gen)`` re-runs the probes, and
``python -m rpa_tune.estimator.calibration [--tpu GEN ...] [--write]`` regenerates the file.

Probes (all single-core: every grid dimension ``arbitrary``; bf16 operands, f32 accumulation):

* ``matmul``: a tiled Pallas matmul (grid over M, N, K blocks, BlockSpec pipelining from
  HBM, f32 accumulator in VMEM), compiled at two contraction lengths K and 2K. The
  *steady-state* MXU rate is the marginal one, ``(FLOPs(2K) - FLOPs(K)) / (cycles(2K) -
  cycles(K))``: pipeline fill and the output write-back cancel in the difference.
* ``depth``: no DMA at all: operands are built in VMEM scratch and a static loop runs
  ``acc += a @ b`` with a contraction depth of 128 or 256 (M = N = 1024), and with an output
  width N of 128 or 256 (K = 1024) -- the head_dim of an attention's QK^T resp. PV. Each is
  compiled at two repeat counts; the marginal rate per repeat gives FLOP/cycle.
* ``copy``: a Pallas kernel whose input stays in HBM (``memory_space=pl.ANY``, donated, at
  least twice the generation's VMEM so XLA cannot place it in VMEM) copies chunks into VMEM
  scratch with ``make_async_copy``, with 1 (serial), 2 (double-buffered) or 8 DMAs in
  flight. The trace must show only ``dma.hbm_to_vmem`` issues for the input.

Derived numbers (``Calibration``):

* ``mxu_flop_per_cycle``: the matmul probe's steady-state FLOP/cycle.
* ``mxu_equivalents``: ``mxu_flop_per_cycle / (2 * cols^2)`` (cols = JAX's MXU column
  size), rounded *up* (the modelled peak cannot be below a rate the profiler achieved): the
  number of ``cols x cols`` arrays, each doing one multiply-accumulate per cell per cycle,
  that the profiler's rate corresponds to. ``peak_flop_per_cycle = mxu_equivalents * 2 *
  cols^2``. This is a rate, not necessarily the number of MXUs the trace names
  (``mxu_units_in_trace``): on v6e and TPU7x the trace issues to ``mxu0``/``mxu1`` only, but
  each carries two 256x256 equivalents of work per cycle.
* ``clock_hz = bf16_ops_per_second (JAX's tpu_info) / peak_flop_per_cycle``. This is a
  derived clock: it is exactly the clock at which the profiler's modelled MXU peak equals
  JAX's published peak, so times from cycles at this clock are on the same footing as
  MFU against JAX's peak. It depends on ``mxu_equivalents``: had the rate been read as
  2 arrays of 256^2 on v6e, the clock would be 2x higher (3.5 GHz) and every time 2x shorter.
* ``hbm_bytes_per_cycle``: bytes per cycle of one DMA stream in steady state (the slope of
  a serial copy's cycles in the chunk size); ``dma_latency_cycles`` the fixed cost per DMA
  (issue to completion beyond the bytes). ``hbm_bw_bytes_per_second`` = that rate x
  ``clock_hz``, and ``hbm_bw_ratio_to_jax`` against JAX's ``mem_bw_bytes_per_second``.
  The profiler does **not** cap the aggregate: ``n`` DMAs in flight move ``~n`` times the
  bytes per cycle (``dma_concurrency_speedup_8``: 8 in flight vs 1). The double-buffered
  probe's marginal rate is ``hbm_bytes_per_cycle_double_buffered``. An HBM roofline (bytes
  / JAX's bandwidth) must therefore be applied on top of any cycle estimate.
* ``k128_efficiency``: FLOP/cycle at contraction depth 128 over that at 256 (same M, N);
  ``n128_efficiency``: output width 128 over 256 (same M, K); ``*_fraction_of_peak``
  against ``peak_flop_per_cycle``.
* ``flops_per_vmatmul``: FLOPs of the matmul probe / its ``vmatmul*`` instructions (the
  most MXU work one instruction carries: K >= cols); ``flops_per_vmatmul_k128`` the same
  in the K=128 probe (half of it on 256-wide MXUs); ``dma_granule_bytes``: bytes copied /
  ``size_in_granules`` of the copy probe.

v4: libtpu 0.0.50.1's static profiler refuses every v4 kernel ("Dma latency model is
currently only supported on VF/VL/GF/GL", even for a kernel without DMA), so there are no
v4 cycles to convert. Its entry is built from the compiler's static bundle listing (written
before the profiler gives up): ``flops_per_vmatmul``, ``dma_granule_bytes`` and the MXUs the
code names (4, as in JAX's table; on v5e / v5p, same MXU width, that count equals the
profiler's measured rate), from which the clock is derived the same way; ``clock_source``
says so and the cycle-based fields are ``None``. FLOP per bundle of the unrolled listing is
recorded but is not a rate (the listing does not charge MXU occupancy: it exceeds any peak).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.resources
import json
import math
import os
import re
import subprocess
import sys
import tempfile

GENERATIONS = ("v4", "v5e", "v5p", "v6e", "tpu7x")
DATA_FILE = "calibration.json"
BUILDER = "rpa_tune.estimator.calibration"
MiB = 1 << 20


# ---------------------------------------------------------------------------- builders
def _sharding(tpu: str):
    from kernel.analysis import _sharding as deviceless_sharding
    return deviceless_sharding(tpu)


def lower_matmul(*, tpu: str, m: int, n: int, k: int, bm: int, bn: int, bk: int,
                 vmem_limit_bytes: int | None = None, name: str = "calib_matmul"):
    """Tiled bf16 matmul ``(m, k) @ (k, n)``, f32 accumulation, grid ``(m/bm, n/bn, k/bk)``."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu
    nk = k // bk

    def kernel(a_ref, b_ref, o_ref, acc_ref):
        @pl.when(pl.program_id(2) == 0)
        def _():
            acc_ref[...] = jnp.zeros_like(acc_ref)

        acc_ref[...] += jnp.dot(a_ref[...], b_ref[...], preferred_element_type=jnp.float32)

        @pl.when(pl.program_id(2) == nk - 1)
        def _():
            o_ref[...] = acc_ref[...].astype(o_ref.dtype)

    call = pl.pallas_call(
        kernel, grid=(m // bm, n // bn, nk),
        in_specs=[pl.BlockSpec((bm, bk), lambda i, j, l: (i, l)),
                  pl.BlockSpec((bk, bn), lambda i, j, l: (l, j))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, l: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m, n), jnp.bfloat16),
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",) * 3,
                                             vmem_limit_bytes=vmem_limit_bytes),
        name=name)
    sh = _sharding(tpu)
    a = jax.ShapeDtypeStruct((m, k), jnp.bfloat16, sharding=sh)
    b = jax.ShapeDtypeStruct((k, n), jnp.bfloat16, sharding=sh)
    return jax.jit(call).lower(a, b), name


def lower_mxu_loop(*, tpu: str, m: int, n: int, k: int, reps: int, unroll: bool = False,
                   name: str = "calib_mxu_loop"):
    """No DMA: ``a (m, k)`` and ``b (k, n)`` are filled in VMEM scratch, then a static loop
    runs ``acc += a @ b`` ``reps`` times. The kernel's only operand is a tiny HBM array it
    aliases to its output and never touches (so no DMA is issued)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    def kernel(x_ref, o_ref, a_ref, b_ref, acc_ref):
        a_ref[...] = jnp.ones_like(a_ref)
        b_ref[...] = jnp.ones_like(b_ref)
        acc_ref[...] = jnp.zeros_like(acc_ref)

        def body(r, carry):
            acc_ref[...] += jnp.dot(a_ref[...], b_ref[...], preferred_element_type=jnp.float32)
            return carry
        jax.lax.fori_loop(0, reps, body, 0, unroll=unroll)

    anyspec = pl.BlockSpec(memory_space=pl.ANY)
    call = pl.pallas_call(
        kernel, in_specs=[anyspec], out_specs=anyspec,
        out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        scratch_shapes=[pltpu.VMEM((m, k), jnp.bfloat16), pltpu.VMEM((k, n), jnp.bfloat16),
                        pltpu.VMEM((m, n), jnp.float32)],
        input_output_aliases={0: 0},
        compiler_params=pltpu.CompilerParams(has_side_effects=True),
        name=name)
    x = jax.ShapeDtypeStruct((8, 128), jnp.float32, sharding=_sharding(tpu))
    return jax.jit(call, donate_argnums=0).lower(x), name


def lower_copy(*, tpu: str, chunk_bytes: int, chunks: int, depth: int, src_bytes: int,
               name: str = "calib_copy"):
    """Copy ``chunks`` consecutive chunks of an HBM array into VMEM with ``depth`` DMAs in
    flight (``depth`` VMEM buffers, one DMA semaphore each; Python-unrolled, static sizes)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu
    lanes = 1024
    rows = chunk_bytes // (4 * lanes)
    total_rows = max(rows * chunks, src_bytes // (4 * lanes))

    def kernel(x_hbm, o_ref, buf, sem):
        def copy(i):
            s = i % depth
            return pltpu.make_async_copy(x_hbm.at[pl.ds(i * rows, rows)], buf.at[s], sem.at[s])
        for i in range(min(depth, chunks)):
            copy(i).start()
        for i in range(chunks):
            copy(i).wait()
            if i + depth < chunks:
                copy(i + depth).start()
        o_ref[...] = buf[(chunks - 1) % depth, :8, :]

    call = pl.pallas_call(
        kernel,
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
        out_shape=jax.ShapeDtypeStruct((8, lanes), jnp.float32),
        scratch_shapes=[pltpu.VMEM((depth, rows, lanes), jnp.float32), pltpu.SemaphoreType.DMA((depth,))],
        compiler_params=pltpu.CompilerParams(vmem_limit_bytes=depth * chunk_bytes + 4 * MiB),
        name=name)
    x = jax.ShapeDtypeStruct((total_rows, lanes), jnp.float32, sharding=_sharding(tpu))
    return jax.jit(call, donate_argnums=0).lower(x), name


# ------------------------------------------------------------------------ probe plans
def _plan(generation: str) -> dict:
    """Probe sizes per generation (compile in seconds, < 1 GB RSS)."""
    from kernel.hardware import tpu_info
    info = tpu_info(generation)
    cols = info.mxu_column_size
    vmem = int(info.vmem_capacity_bytes)
    if vmem <= 16 * MiB:      # v4: smaller blocks
        mm = dict(m=1024, n=1024, bm=512, bn=512, bk=512, k=(1024, 2048), vmem_limit_bytes=12 * MiB)
    elif cols >= 256:
        mm = dict(m=2048, n=2048, bm=1024, bn=1024, bk=1024, k=(4096, 8192), vmem_limit_bytes=48 * MiB)
    else:
        mm = dict(m=2048, n=2048, bm=1024, bn=1024, bk=1024, k=(2048, 4096), vmem_limit_bytes=48 * MiB)
    depth = {  # name: (m, n, k, (reps, 2 * reps))
        "k128": (1024, 1024, 128, (16, 32)),
        "k256": (1024, 1024, 256, (8, 16)),
        "n128": (1024, 128, 1024, (8, 16)),
        "n256": (1024, 256, 1024, (4, 8)),
    }
    chunk = 4 * MiB if vmem > 16 * MiB else 2 * MiB
    copy = dict(small=1 * MiB, large=chunk, chunks=16, src_bytes=max(2 * vmem, 256 * MiB))
    return dict(matmul=mm, depth=depth, copy=copy)


# ----------------------------------------------------------------------- measurement
def _versions() -> dict:
    out = {}
    for pkg in ("jax", "jaxlib", "libtpu"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def _mxu_units(opcodes: dict) -> int:
    units = {m.group(1) for op in opcodes for m in [re.search(r"\.mxu(\d+)$", op)] if m}
    return len(units)


def _trace_summary(tr: dict) -> dict:
    from .trace import TraceStats
    st = TraceStats.from_json(tr)
    return dict(bundles=st.bundles, vmatmul=st.mxu_matmuls, vmatpush=st.mxu_pushes,
                vmatprep=st.count("vmatprep"),
                mxu_pops=sum(n for op, n in st.opcodes.items()   # result pops: .mrf (v4-v6e), .mrb (TPU7x)
                             if op.startswith("vpop") and (".mrf" in op or ".mrb" in op)),
                mxu_units=_mxu_units(st.opcodes), dma_issues=st.dma_issues, dma_granules=st.dma_granules)


def _run(builder_fn: str, request: dict, *, timeout: float) -> dict:
    """One profiler compile; raises with the profiler's message unless it succeeded."""
    from .profiler import profile
    r = profile(f"{BUILDER}:{builder_fn}", request, timeout=timeout)
    if r.get("status") != "ok":
        raise RuntimeError(f"{builder_fn}({request}) on the static profiler: {r.get('status')}: "
                           f"{str(r.get('message', ''))[-600:]}")
    return dict(cycles=int(r["cycles"]), compile_s=round(r.get("compile_s", 0.0), 2),
                max_rss_bytes=int(r.get("max_rss_bytes", 0)), trace=_trace_summary(r["trace"]))


def _listing(builder_fn: str, request: dict, *, timeout: float) -> dict:
    """The compiler's bundle listing for a kernel the profiler refuses (v4): run the
    profiler child in a directory we keep, let it fail, read what libtpu wrote."""
    from . import profiler
    from .trace import kernel_traces, parse_bundles
    with tempfile.TemporaryDirectory(prefix="rpa_calib_") as d:
        env = profiler.libtpu_env()
        env["LIBTPU_INIT_ARGS"] = f"{profiler.PROFILE_FLAG}={d} {profiler.BUNDLES_FLAG}"
        env["JAX_PLATFORMS"] = ""
        payload = json.dumps(dict(builder=f"{BUILDER}:{builder_fn}", request=request, profile_dir=d,
                                  bundles=True))
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        proc = subprocess.run([sys.executable, "-m", "rpa_tune.estimator.profiler"], input=payload,
                              capture_output=True, text=True, env=env, cwd=root, timeout=timeout)
        reason = next((l.split("failed: ", 1)[1] for l in proc.stderr.splitlines()
                       if "Static LLO profiling of" in l and "failed: " in l), None)
        paths = kernel_traces(d, request.get("name") or "calib_")
        if not paths:
            raise RuntimeError(f"{builder_fn}: libtpu wrote no bundle listing (rc {proc.returncode}): "
                               f"{proc.stderr[-600:]}")
        from .trace import TraceStats
        st = TraceStats()
        for p in paths.values():
            st = st.add(parse_bundles(p))
    return dict(returncode=proc.returncode, profiler_error=reason, trace=_trace_summary(st.to_json()))


def _marginal(work_a: float, work_b: float, cyc_a: float, cyc_b: float) -> float:
    if cyc_b <= cyc_a:
        raise RuntimeError(f"non-increasing cycles ({cyc_a} -> {cyc_b}): the probe is not in steady state")
    return (work_b - work_a) / (cyc_b - cyc_a)


def _flops(m, n, k, reps=1):
    return 2.0 * m * n * k * reps


def _hw(generation: str) -> dict:
    from kernel.config import get_generation
    from kernel.hardware import tpu_info
    g = get_generation(generation)
    i = tpu_info(generation)
    return dict(generation=g.name, topology=g.topology, device_kind=g.device_kind,
                bf16_ops_per_second=float(i.bf16_ops_per_second),
                mem_bw_bytes_per_second=float(i.mem_bw_bytes_per_second),
                mxu_column_size=int(i.mxu_column_size), num_mxus=int(i.num_mxus),
                vmem_capacity_bytes=int(i.vmem_capacity_bytes))


def measure(generation: str, *, timeout: float = 600, log=None) -> dict:
    """Run the probes for one generation and derive its calibration (the JSON entry)."""
    from kernel.config import get_generation
    gen = get_generation(generation).name
    say = log or (lambda *_: None)
    hw = _hw(gen)
    plan = _plan(gen)
    if gen == "v4":
        return _measure_listing_only(gen, hw, plan, timeout=timeout, say=say)
    cols = hw["mxu_column_size"]
    probes: dict = {}

    # (a) tiled HBM matmul at K and 2K
    mm = dict(plan["matmul"])
    ks = mm.pop("k")
    runs = []
    for k in ks:
        say(f"{gen}: matmul {mm['m']}x{mm['n']}x{k} blocks ({mm['bm']},{mm['bn']},{mm['bk']})")
        r = _run("lower_matmul", dict(tpu=gen, k=k, **mm), timeout=timeout)
        r.update(k=k, flops=_flops(mm["m"], mm["n"], k))
        runs.append(r)
    probes["matmul"] = dict(shape=dict(m=mm["m"], n=mm["n"]), blocks=dict(bm=mm["bm"], bn=mm["bn"], bk=mm["bk"]),
                            vmem_limit_bytes=mm["vmem_limit_bytes"], runs=runs)
    steady = _marginal(runs[0]["flops"], runs[1]["flops"], runs[0]["cycles"], runs[1]["cycles"])
    big = runs[-1]
    achieved = big["flops"] / big["cycles"]
    flops_per_vmatmul = big["flops"] / big["trace"]["vmatmul"]
    units = big["trace"]["mxu_units"]
    equiv = math.ceil(steady / (2 * cols ** 2) - 0.02)
    peak = equiv * 2 * cols ** 2
    clock = hw["bf16_ops_per_second"] / peak

    # (b) contraction depth and output width
    rates = {}
    probes["depth"] = {}
    for label, (m, n, k, reps) in plan["depth"].items():
        rr = []
        for rep in reps:
            say(f"{gen}: mxu loop {label}: ({m}, {k}) @ ({k}, {n}) x {rep}")
            r = _run("lower_mxu_loop", dict(tpu=gen, m=m, n=n, k=k, reps=rep), timeout=timeout)
            r.update(reps=rep, flops=_flops(m, n, k, rep))
            rr.append(r)
        rates[label] = _marginal(rr[0]["flops"], rr[1]["flops"], rr[0]["cycles"], rr[1]["cycles"])
        probes["depth"][label] = dict(m=m, n=n, k=k, runs=rr, flop_per_cycle=rates[label],
                                      flops_per_vmatmul=rr[-1]["flops"] / rr[-1]["trace"]["vmatmul"])

    # (c) HBM -> VMEM copies
    cp = plan["copy"]
    n = cp["chunks"]

    def copy(chunk, chunks, depth):
        say(f"{gen}: copy {chunks} x {chunk / MiB:g} MiB, {depth} in flight")
        r = _run("lower_copy", dict(tpu=gen, chunk_bytes=chunk, chunks=chunks, depth=depth,
                                    src_bytes=cp["src_bytes"]), timeout=timeout)
        issues = r["trace"]["dma_issues"]
        if issues.get("hbm_to_vmem", 0) != chunks or any(d.startswith("vmem_to_vmem") for d in issues):
            raise RuntimeError(f"copy probe on {gen}: expected {chunks} hbm_to_vmem DMAs, trace has {issues}")
        r.update(chunk_bytes=chunk, chunks=chunks, depth=depth, bytes=chunk * chunks)
        return r

    s1, s2, l1 = copy(cp["small"], n, 1), copy(cp["small"], 2 * n, 1), copy(cp["large"], n, 1)
    d2a, d2b = copy(cp["large"], n // 2, 2), copy(cp["large"], n, 2)
    d8 = copy(cp["small"], 4 * n, 8)
    s4 = copy(cp["small"], 4 * n, 1)
    stream = n * (cp["large"] - cp["small"]) / (l1["cycles"] - s1["cycles"])
    per_dma_small = (s2["cycles"] - s1["cycles"]) / n
    latency = per_dma_small - cp["small"] / stream
    double = _marginal(d2a["bytes"], d2b["bytes"], d2a["cycles"], d2b["cycles"])
    speedup8 = s4["cycles"] / d8["cycles"]
    granule = l1["bytes"] / l1["trace"]["dma_granules"]["hbm_to_vmem"]
    probes["copy"] = dict(src_bytes=cp["src_bytes"], runs=[s1, s2, l1, d2a, d2b, d8, s4])

    derived = dict(
        mxu_flop_per_cycle=steady, mxu_flop_per_cycle_whole=achieved, mxu_equivalents=equiv,
        peak_flop_per_cycle=float(peak), mxu_steady_fraction_of_peak=steady / peak,
        clock_hz=clock, clock_source="jax bf16_ops_per_second / profiler peak FLOP per cycle",
        mxu_units_in_trace=units, flops_per_vmatmul=flops_per_vmatmul,
        flops_per_vmatmul_k128=probes["depth"]["k128"]["flops_per_vmatmul"],
        k128_flop_per_cycle=rates["k128"], k256_flop_per_cycle=rates["k256"],
        k128_efficiency=rates["k128"] / rates["k256"], k128_fraction_of_peak=rates["k128"] / peak,
        k256_fraction_of_peak=rates["k256"] / peak,
        n128_efficiency=rates["n128"] / rates["n256"], n128_fraction_of_peak=rates["n128"] / peak,
        hbm_bytes_per_cycle=stream, dma_latency_cycles=latency,
        hbm_bytes_per_cycle_double_buffered=double, dma_concurrency_speedup_8=speedup8,
        hbm_bw_bytes_per_second=stream * clock, hbm_bw_ratio_to_jax=stream * clock / hw["mem_bw_bytes_per_second"],
        hbm_bw_double_buffered_bytes_per_second=double * clock,
        dma_granule_bytes=granule,
    )
    return dict(generation=gen, profiler_supported=True, hardware=hw, versions=_versions(),
                derived=derived, probes=probes)


def _measure_listing_only(gen, hw, plan, *, timeout, say) -> dict:
    """v4: the profiler refuses the generation; read the compiler's static listing."""
    cols = hw["mxu_column_size"]
    m, n, k = 512, 512, 512
    listings = []
    for reps in (2, 4):
        say(f"{gen}: static listing of an unrolled mxu loop ({m}, {k}) @ ({k}, {n}) x {reps}")
        r = _listing("lower_mxu_loop", dict(tpu=gen, m=m, n=n, k=k, reps=reps, unroll=True), timeout=timeout)
        r.update(reps=reps, flops=_flops(m, n, k, reps))
        listings.append(r)
    a, b = listings
    per_bundle = (b["flops"] - a["flops"]) / (b["trace"]["bundles"] - a["trace"]["bundles"])
    say(f"{gen}: static listing of a copy")
    cp = _listing("lower_copy", dict(tpu=gen, chunk_bytes=plan["copy"]["large"], chunks=4, depth=1,
                                     src_bytes=plan["copy"]["src_bytes"]), timeout=timeout)
    g = cp["trace"]["dma_granules"].get("hbm_to_vmem")
    granule = plan["copy"]["large"] * 4 / g if g else None
    # No cycle rate exists: the listing packs MXU instructions without the occupancy the
    # profiler would charge (FLOP per bundle is not a rate). Fall back to the MXUs the code
    # names, which on v5e / v5p (same 128-wide MXU) equal the profiler's measured rate.
    equiv = b["trace"]["mxu_units"]
    peak = equiv * 2 * cols ** 2
    reason = a["profiler_error"] or cp["profiler_error"]
    derived = dict(
        mxu_flop_per_cycle=None, mxu_flop_per_cycle_whole=None, mxu_flop_per_bundle=per_bundle,
        mxu_equivalents=equiv, peak_flop_per_cycle=float(peak), mxu_steady_fraction_of_peak=None,
        clock_hz=hw["bf16_ops_per_second"] / peak,
        clock_source="jax bf16_ops_per_second / (MXUs named in the listing * 2 * cols^2); profiler unsupported",
        mxu_units_in_trace=b["trace"]["mxu_units"], flops_per_vmatmul=b["flops"] / b["trace"]["vmatmul"],
        flops_per_vmatmul_k128=None,
        k128_flop_per_cycle=None, k256_flop_per_cycle=None, k128_efficiency=None, k128_fraction_of_peak=None,
        k256_fraction_of_peak=None, n128_efficiency=None, n128_fraction_of_peak=None,
        hbm_bytes_per_cycle=None, dma_latency_cycles=None, hbm_bytes_per_cycle_double_buffered=None,
        dma_concurrency_speedup_8=None, hbm_bw_bytes_per_second=None, hbm_bw_ratio_to_jax=None,
        hbm_bw_double_buffered_bytes_per_second=None, dma_granule_bytes=granule,
    )
    return dict(generation=gen, profiler_supported=False, profiler_error=reason, hardware=hw,
                versions=_versions(), derived=derived,
                probes=dict(mxu_listing=dict(m=m, n=n, k=k, runs=listings),
                            copy_listing=dict(chunk_bytes=plan["copy"]["large"], chunks=4, run=cp)))


# ------------------------------------------------------------------------- shipped data
@dataclasses.dataclass(frozen=True)
class Calibration:
    """One generation's calibration (see the module doc for each field's meaning)."""

    generation: str
    profiler_supported: bool
    clock_hz: float
    clock_source: str
    mxu_column_size: int
    mxu_equivalents: int
    peak_flop_per_cycle: float
    mxu_flop_per_cycle: float | None
    mxu_units_in_trace: int
    flops_per_vmatmul: float
    flops_per_vmatmul_k128: float | None
    k128_efficiency: float | None
    k128_fraction_of_peak: float | None
    n128_efficiency: float | None
    hbm_bytes_per_cycle: float | None
    dma_latency_cycles: float | None
    hbm_bytes_per_cycle_double_buffered: float | None
    dma_concurrency_speedup_8: float | None
    hbm_bw_bytes_per_second: float | None
    hbm_bw_ratio_to_jax: float | None
    dma_granule_bytes: float | None
    jax_bf16_ops_per_second: float
    jax_mem_bw_bytes_per_second: float
    versions: dict = dataclasses.field(compare=False, hash=False)
    raw: dict = dataclasses.field(compare=False, hash=False, repr=False)

    def seconds(self, cycles: float) -> float:
        """Cycles of this generation's profiler as seconds at the derived clock."""
        return float(cycles) / self.clock_hz

    @classmethod
    def from_entry(cls, entry: dict) -> "Calibration":
        d, hw = entry["derived"], entry["hardware"]
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        return cls(generation=entry["generation"], profiler_supported=bool(entry["profiler_supported"]),
                   mxu_column_size=hw["mxu_column_size"], jax_bf16_ops_per_second=hw["bf16_ops_per_second"],
                   jax_mem_bw_bytes_per_second=hw["mem_bw_bytes_per_second"], versions=entry["versions"],
                   raw=entry, **kw)


def _data_path():
    return importlib.resources.files("rpa_tune").joinpath("data", DATA_FILE)


def load_all() -> dict:
    """The shipped JSON (``{"generations": {name: entry}}``), or ``{}`` if absent."""
    p = _data_path()
    if not p.is_file():
        return {}
    return json.loads(p.read_text())


def calibration(generation: str) -> Calibration:
    """The shipped calibration of ``generation``; ValueError naming it when absent."""
    from kernel.config import get_generation
    try:
        name = get_generation(generation).name
    except ValueError as e:
        raise ValueError(f"no calibration for TPU generation {generation!r}: {e}") from None
    entry = load_all().get("generations", {}).get(name)
    if entry is None:
        raise ValueError(f"no calibration for TPU generation {generation!r} in rpa_tune/data/{DATA_FILE}; "
                         f"run: python -m rpa_tune.estimator.calibration --tpu {name} --write")
    return Calibration.from_entry(entry)


# --------------------------------------------------------------------------- reporting
def _fmt(v, spec, scale=1.0, suffix=""):
    return "n/a" if v is None else f"{v / scale:{spec}}{suffix}"


ROWS = (
    ("profiler costs kernels", lambda e, d: "yes" if e["profiler_supported"] else "NO (listing only)"),
    ("MXU FLOP/cycle, steady", lambda e, d: _fmt(d["mxu_flop_per_cycle"], ",.0f")),
    ("MXU FLOP/cycle, whole probe", lambda e, d: _fmt(d["mxu_flop_per_cycle_whole"], ",.0f")),
    ("MXU FLOP/bundle (listing)", lambda e, d: _fmt(d.get("mxu_flop_per_bundle"), ",.0f")),
    ("MXU cols (JAX) / JAX num_mxus", lambda e, d: f"{e['hardware']['mxu_column_size']} / {e['hardware']['num_mxus']}"),
    ("MXU equivalents", lambda e, d: str(d["mxu_equivalents"])),
    ("MXUs named in trace", lambda e, d: str(d["mxu_units_in_trace"])),
    ("modelled peak FLOP/cycle", lambda e, d: _fmt(d["peak_flop_per_cycle"], ",.0f")),
    ("steady / peak", lambda e, d: _fmt(d["mxu_steady_fraction_of_peak"], ".1%")),
    ("JAX bf16 peak", lambda e, d: _fmt(e["hardware"]["bf16_ops_per_second"], ".1f", 1e12, " TF/s")),
    ("derived clock", lambda e, d: _fmt(d["clock_hz"], ".3f", 1e9, " GHz")),
    ("FLOPs per vmatmul", lambda e, d: _fmt(d["flops_per_vmatmul"], ",.0f")),
    ("FLOPs per vmatmul, K=128", lambda e, d: _fmt(d.get("flops_per_vmatmul_k128"), ",.0f")),
    ("K=128 / K=256 rate", lambda e, d: _fmt(d["k128_efficiency"], ".1%")),
    ("K=128 / peak", lambda e, d: _fmt(d["k128_fraction_of_peak"], ".1%")),
    ("K=256 / peak", lambda e, d: _fmt(d["k256_fraction_of_peak"], ".1%")),
    ("N=128 / N=256 rate", lambda e, d: _fmt(d["n128_efficiency"], ".1%")),
    ("HBM B/cycle, one DMA", lambda e, d: _fmt(d["hbm_bytes_per_cycle"], ",.0f")),
    ("DMA latency (cycles)", lambda e, d: _fmt(d["dma_latency_cycles"], ",.0f")),
    ("HBM B/cycle, 2 in flight", lambda e, d: _fmt(d["hbm_bytes_per_cycle_double_buffered"], ",.0f")),
    ("8 in flight vs 1 (speedup)", lambda e, d: _fmt(d["dma_concurrency_speedup_8"], ".2f", 1, "x")),
    ("HBM GB/s, one DMA @clock", lambda e, d: _fmt(d["hbm_bw_bytes_per_second"], ",.0f", 1e9)),
    ("HBM GB/s, 2 in flight", lambda e, d: _fmt(d["hbm_bw_double_buffered_bytes_per_second"], ",.0f", 1e9)),
    ("JAX HBM GB/s", lambda e, d: _fmt(e["hardware"]["mem_bw_bytes_per_second"], ",.0f", 1e9)),
    ("one DMA / JAX", lambda e, d: _fmt(d["hbm_bw_ratio_to_jax"], ".2f")),
    ("DMA granule bytes", lambda e, d: _fmt(d["dma_granule_bytes"], ".0f")),
)


def format_table(entries: dict) -> str:
    gens = [g for g in GENERATIONS if g in entries] + [g for g in entries if g not in GENERATIONS]
    head = ["quantity"] + gens
    body = [[label] + [fn(entries[g], entries[g]["derived"]) for g in gens] for label, fn in ROWS]
    widths = [max(len(r[i]) for r in [head] + body) for i in range(len(head))]
    line = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    out = [line(head), line(["-" * w for w in widths])] + [line(r) for r in body]
    v = next(iter(entries.values()))["versions"]
    out.append("")
    out.append(f"jax {v.get('jax')}, jaxlib {v.get('jaxlib')}, libtpu {v.get('libtpu')}")
    for g in gens:
        if not entries[g]["profiler_supported"]:
            out.append(f"{g}: static profiler refuses it ({entries[g].get('profiler_error')}); "
                       "figures from the compiler's bundle listing")
    return "\n".join(out)


def write(entries: dict, path=None) -> str:
    """Merge ``entries`` into the shipped JSON (other generations kept)."""
    path = str(path or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", DATA_FILE))
    data = {}
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
    gens = dict(data.get("generations", {}))
    gens.update(entries)
    data = {"about": "libtpu static-profiler calibration; see rpa_tune/estimator/calibration.py and "
                     "benchmarks/calibration.md",
            "generations": {g: gens[g] for g in sorted(gens, key=lambda g: (g not in GENERATIONS, GENERATIONS.index(g) if g in GENERATIONS else 0, g))}}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1, sort_keys=False)
        f.write("\n")
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rpa_tune.estimator.calibration", description=__doc__.split("\n")[0])
    ap.add_argument("--tpu", nargs="+", default=list(GENERATIONS), help="generations (default: all five)")
    ap.add_argument("--write", action="store_true", help=f"merge the results into rpa_tune/data/{DATA_FILE}")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per probe compile")
    ap.add_argument("--show", action="store_true", help="print the shipped table, measure nothing")
    args = ap.parse_args(argv)
    if args.show:
        print(format_table(load_all().get("generations", {})))
        return 0
    from kernel.config import get_generation
    entries = {}
    for g in args.tpu:
        name = get_generation(g).name
        entries[name] = measure(name, timeout=args.timeout, log=lambda s: print(s, file=sys.stderr, flush=True))
    print(format_table(entries))
    if args.write:
        print(f"\nwrote {write(entries)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
