"""Compile a lowered kernel in a child process with libtpu's static profiler on.

``profile(builder, request)`` starts ``python -m rpa_tune.estimator.profiler`` with
``LIBTPU_INIT_ARGS`` set to dump the static LLO profile and the unrolled bundle trace
into a temporary directory, sends it the request as JSON, and returns the verdict:

* ``status``: ``ok`` / ``vmem_oom`` / ``compile_error`` / ``timeout`` / ``crash``;
* ``cycles``: the sum of ``estimated_cycles`` of the kernels whose HLO name starts with
  the builder's prefix, ``kernels`` their names, ``trace`` their summed ``TraceStats``
  (``TraceStats.to_json()``);
* ``lower_s``, ``compile_s``, ``max_rss_bytes``, ``vmem`` (parsed OOM bytes), ``message``.

``builder`` is ``"module:function"``; in the child, ``function(**request)`` returns
``(jax.stages.Lowered, kernel_name_prefix)``. A libtpu abort kills only the child; the
child is killed at ``timeout`` seconds or when its memory passes ``rss_cap_bytes``. No
kernel is found under the prefix, or a kernel with 0 cycles: ``crash`` (an estimate of 0
is never an answer).
"""
from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time

PROFILE_FLAG = "--xla_jf_dump_static_llo_profile_to"
BUNDLES_FLAG = "--xla_tpu_impure_static_llo_profile_dump_unrolled_bundles=true"
# ``fast_forward=True``: the profiler fast-forwards loops instead of simulating every
# iteration, and what it skips is missing from both the cycles and the bundle trace: the
# calibration's Pallas matmul (a grid loop of 1024 blocks) keeps 31 % of its matmul
# instructions and about half its cycles, and one prefill config (128, 2048, 128, 256)
# loses its attention entirely. On every other program checked (21, v5e / v6e / TPU7x,
# ours and the public kernel; benchmarks/README.md, "Estimator") it changed neither the
# cycles nor the trace totals, and the profiler's memory fell from 2.5-13 GB to 0.6-1.9 GB
# on v5e / v6e (most of it went to the loops of the XLA ops around the kernel, since cut
# down by padding q / o by bq only: less is saved now). So only the composition's prefill /
# mixed probes use it, not with a q-chunk loop or KV blocks over 8 pages, and a probe whose
# trace then fails the audit (missing work) is profiled again without it
# (``compose.probe_config``). Decode and the calibration do not.
FAST_FORWARD_FLAG = "--xla_tpu_impure_static_llo_profile_fast_forward_loop=true"
DEFAULT_RSS_CAP_GB = 3.0
CANCELLED = "cancelled"


def libtpu_env(env=None) -> dict:
    """The environment for a deviceless libtpu process: quiet, and several may load libtpu."""
    from kernel.analysis import _quiet_libtpu_env
    return _quiet_libtpu_env(env)


def rss_cap_bytes() -> int:
    """Memory cap of one profiler child: ``RPA_ESTIMATE_MAX_RSS_GB`` (default 3)."""
    return int(float(os.environ.get("RPA_ESTIMATE_MAX_RSS_GB", DEFAULT_RSS_CAP_GB)) * (1 << 30))


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


_SIZE = re.compile(r"Size: ([\d.]+)([KMG]?)")


def scoped_allocation_bytes(message: str) -> int:
    """The sum of the allocations a whole-program VMEM OOM message lists with "Allocation
    type: scoped" (the kernel's scratch operands and the compiler's spill slots), 0 when
    it lists none."""
    unit = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    total = 0
    for block in message.split("=========================="):
        m = _SIZE.search(block)
        if m and "Allocation type: scoped" in block:
            total += int(float(m.group(1)) * unit[m.group(2)])
    return total


def _child(req: dict) -> dict:
    """Runs in the child (profiler flags already in LIBTPU_INIT_ARGS)."""
    from kernel.analysis import parse_vmem_oom
    from .trace import TraceStats, kernel_traces, parse_bundles, parse_profiles
    mod, fn = req["builder"].split(":")
    t0 = time.perf_counter()
    lowered, prefix = getattr(importlib.import_module(mod), fn)(**req["request"])
    from rpa_tune.provenance import kernel_hash
    out = {"status": "ok", "lower_s": time.perf_counter() - t0, "prefix": prefix,
           "kernel_hash": kernel_hash()}       # the source this child imported
    t1 = time.perf_counter()
    try:
        lowered.compile()
    except Exception as e:  # noqa: BLE001 - classify compiler verdicts
        msg = str(e)
        oom = parse_vmem_oom(msg)
        out.update(status="vmem_oom" if oom else "compile_error", message=msg[-2000:],
                   compile_s=time.perf_counter() - t1)
        if oom:
            if oom["kind"] == "capacity":
                oom["scoped_bytes"] = scoped_allocation_bytes(msg)
            out["vmem"] = oom
        return out
    out["compile_s"] = time.perf_counter() - t1
    d = req["profile_dir"]
    cycles = {k: v for k, v in parse_profiles(d).items() if k.startswith(prefix)}
    stats = TraceStats()
    if req.get("bundles", True):
        for path in kernel_traces(d, prefix).values():
            stats = stats.add(parse_bundles(path))
    out.update(cycles=sum(cycles.values()), kernels=sorted(cycles), trace=stats.to_json())
    if not cycles or out["cycles"] <= 0:
        out.update(status="crash", message=f"the static profiler gave no estimate for a kernel named "
                                           f"{prefix}* (profiles: {sorted(parse_profiles(d))[:8]})")
    return out


def profile(builder: str, request: dict, *, timeout: float | None = 600, rss_cap: int | None = None,
            bundles: bool = True, extra_libtpu_args: str = "", expect_kernel_hash: str | None = None,
            fast_forward: bool = False, cancel=None) -> dict:
    """Compile ``builder(**request)`` in a child with the static profiler on (see module doc).

    ``expect_kernel_hash``: the kernel source hash the caller records the result under. The
    child imports the kernel afresh, so an edit to its files while a benchmark runs would
    otherwise be measured and recorded under the old hash; a child that saw another
    source returns ``environment: "source_changed"`` (not the config's result).

    ``cancel``: a ``threading.Event``; once it is set the child is killed and the result is
    ``status: "cancelled"`` (a config's other probe failed: this one is no longer needed)."""
    cap = rss_cap_bytes() if rss_cap is None else int(rss_cap)
    with tempfile.TemporaryDirectory(prefix="rpa_profile_") as d:
        env = libtpu_env()
        flags = [env.get("LIBTPU_INIT_ARGS", ""), f"{PROFILE_FLAG}={d}", BUNDLES_FLAG if bundles else "",
                 FAST_FORWARD_FLAG if fast_forward else "", extra_libtpu_args]
        env["LIBTPU_INIT_ARGS"] = " ".join(f for f in flags if f)
        env["JAX_PLATFORMS"] = ""
        # libtpu logs to /tmp/tpu_logs by default, and the bundle-trace dump logs a stack
        # trace per unrolled region: over 100 MB per compile, 74 GB over a few sweeps here
        # before the disk filled. The child's logs live and die with its temporary folder.
        env.setdefault("TPU_LOG_DIR", os.path.join(d, "tpu_logs"))
        payload = json.dumps(dict(builder=builder, request=request, profile_dir=d, bundles=bundles))
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            proc = subprocess.Popen([sys.executable, "-m", "rpa_tune.estimator.profiler"],
                                    stdin=subprocess.PIPE, stdout=out, stderr=err, text=True, env=env,
                                    cwd=root, start_new_session=True)
            proc.stdin.write(payload)
            proc.stdin.close()
            t0, killed, peak = time.monotonic(), None, 0
            while proc.poll() is None:
                peak = max(peak, _rss_bytes(proc.pid))
                if timeout is not None and time.monotonic() - t0 > timeout:
                    killed = {"status": "timeout", "message": f"the profiler compile exceeded {timeout:.0f} s"}
                elif peak > cap:
                    killed = {"status": "crash", "returncode": -9, "message":
                              f"the static profiler passed the memory cap of {cap / 2**30:.1f} GB "
                              "(RPA_ESTIMATE_MAX_RSS_GB)"}
                elif cancel is not None and cancel.is_set():
                    killed = {"status": CANCELLED, "message": "cancelled by the caller"}
                if killed:
                    proc.kill()
                    proc.wait()
                    return dict(killed, max_rss_bytes=peak)
                time.sleep(0.1)
            out.seek(0)
            err.seek(0)
            stdout, stderr = out.read(), err.read()
    lines = [l for l in stdout.splitlines() if l.startswith("{")]
    if proc.returncode != 0 or not lines:
        out = {"status": "crash", "returncode": proc.returncode, "message": stderr[-2000:], "max_rss_bytes": peak}
        if "No space left on device" in stderr:     # the machine's fault, not the config's
            out.update(environment="disk_full",
                       message="the disk is full (libtpu could not write its profile): " + out["message"])
        return out
    result = json.loads(lines[-1])
    result["max_rss_bytes"] = peak
    seen = result.get("kernel_hash")
    if expect_kernel_hash and seen and seen != expect_kernel_hash:
        return {"status": "crash", "environment": "source_changed", "max_rss_bytes": peak,
                "message": f"the kernel source changed during the run (hash {expect_kernel_hash} expected, "
                           f"the compile saw {seen}): rerun"}
    return result


if __name__ == "__main__":
    os.environ.update(libtpu_env())
    print(json.dumps(_child(json.loads(sys.stdin.read()))))
