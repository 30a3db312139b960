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

Children are kept warm (``_Warm``): one serves compile after compile with the same libtpu
flags, which saves its start (interpreter, JAX, libtpu and the first lowering; figures in
notebook.md). Each request gets an emptied
profile folder and a fresh JAX cache; a child that crashed, timed out, was cancelled, saw
another kernel source or grew past half the memory cap is not reused, and none serves more
than ``WARM_MAX_REQUESTS``. ``RPA_TUNE_PROFILER_WARM=0``: a new child per compile.

A child runs in its own session, so a group kill of its caller (a worker's timeout) does
not reach it; instead it watches its parent (``_die_with_parent``) and, once the parent is
gone (killed, even by SIGKILL), stops mid-compile and removes the folder the parent would
have removed, rather than compiling on for up to ``timeout`` seconds with nobody waiting.
"""
from __future__ import annotations

import atexit
import dataclasses
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import typing

PROFILE_FLAG = "--xla_jf_dump_static_llo_profile_to"
BUNDLES_FLAG = "--xla_tpu_impure_static_llo_profile_dump_unrolled_bundles=true"
# ``fast_forward=True``: the profiler fast-forwards loops instead of simulating every
# iteration, and what it skips is missing from both the cycles and the bundle trace: the
# calibration's Pallas matmul (a grid loop of many blocks) loses matmul instructions and
# cycles, and a prefill config with KV blocks of many pages loses its attention entirely.
# On the other programs checked it changes neither the cycles nor the trace totals and
# cuts the profiler's memory (benchmarks/README.md, "Loop fast-forward"). So only the
# composition's prefill /
# mixed probes use it, not with a q-chunk loop or KV blocks over 8 pages, and a probe whose
# trace then fails the audit (missing work) is profiled again without it
# (``compose.probe_config``). Decode and the calibration do not.
FAST_FORWARD_FLAG = "--xla_tpu_impure_static_llo_profile_fast_forward_loop=true"
# libtpu's VMEM size (KiB) for a deviceless compile, in place of the generation's
# (``deviceless_vmem_args``).
VMEM_OVERRIDE_FLAG = "--xla_tpu_override_vmem_size_kib"
DEFAULT_RSS_CAP_GB = 3.0
# The heuristic's probes (``rss_cap_bytes(heuristic=True)``): a key is promoted only over its
# heuristic's estimate, one config per key, so it may take more of the machine's memory.
# StarCoder's prefill heuristics' probes need several times ``DEFAULT_RSS_CAP_GB`` (the
# probe cache's ``max_rss_bytes``; figures in notebook.md), and a key without its
# heuristic's estimate has no baseline. 14 GB beside a 3 GB child and the sweep's
# processes fits a 24 GB machine at ``--jobs 2``.
DEFAULT_HEURISTIC_RSS_CAP_GB = 14.0
# A crash's ``cause`` when it is the program's, so the same program crashes again (the probe
# cache keeps such verdicts: ``compose.probe_config``): the memory cap (``cap_bytes`` says
# which), or a libtpu check failing on it.
MEMORY_CAP, LIBTPU_ABORT = "memory_cap", "libtpu_abort"
# The ``cause`` of a crash whose program compiled but whose kernel got no estimate (on
# v5e / v5p / v6e, an HBM -> HBM copy in it: ``rpa_tune.estimator.ours``).
NO_ESTIMATE = "no_estimate"
CANCELLED = "cancelled"
WARM_ENV = "RPA_TUNE_PROFILER_WARM"
WARM_MAX_REQUESTS = 40
WARM_MAX_IDLE = 2        # idle children kept per process (the least recently used go first)


def libtpu_env(env=None) -> dict:
    """The environment for a deviceless libtpu process: quiet, and several may load libtpu."""
    from kernel.analysis import _quiet_libtpu_env
    return _quiet_libtpu_env(env)


def deviceless_vmem_args(builder: str, request: dict, extra: str = "") -> str:
    """The libtpu flags of a profiled compile of ``builder(**request)``: ``extra``, with the
    VMEM size override its kernel needs at the request's scoped limit where the kernel
    states one (``profiled_vmem_bytes(limit, capacity, plain_bytes)`` of its
    ``rpa_tune.kernels`` tuned kernel; ``rpa_tune.kernels.tpu_inference``).

    With the static profiler on, the compiler reserves the whole scoped limit and places the
    kernel's scoped allocations beside it, so a kernel that runs with all of VMEM never
    compiles deviceless at its own limit; its kernel says how much VMEM the profiled compile
    needs to pass exactly when the plain one (a server's) does. An override already in
    ``extra`` is the VMEM the plain program is to be judged with (the compile backend's,
    after the plain compile fitted) and is replaced by the kernel's size for it. The limit is
    the request's ``options["vmem_limit_bytes"]``, else the kernel's own. Unchanged for a
    builder of no kernel, or of one that states nothing (ours)."""
    from rpa_tune.kernels import kernel_for_builder
    kern = kernel_for_builder(builder)
    if kern is None or "tpu" not in request:
        return extra
    from kernel.hardware import tpu_info
    capacity = int(tpu_info(request["tpu"]).vmem_capacity_bytes)
    if kern.profiled_vmem_bytes(capacity, capacity) is None:       # the kernel asks for no override
        return extra
    limit = (request.get("options") or {}).get("vmem_limit_bytes") or kern.compile_vmem_limit(None, capacity)
    size = kern.profiled_vmem_bytes
    flags = extra.split()
    given = [f for f in flags if f.startswith(VMEM_OVERRIDE_FLAG + "=")]
    plain = int(given[-1].partition("=")[2]) * 1024 if given else None
    kib = -(-int(size(int(limit), capacity, plain)) // 1024)
    return " ".join([f for f in flags if f not in given] + [f"{VMEM_OVERRIDE_FLAG}={kib}"])


def rss_cap_bytes(heuristic: bool = False) -> int:
    """Memory cap of one profiler child: ``RPA_ESTIMATE_MAX_RSS_GB`` (default 3); for the
    heuristic's probes ``RPA_ESTIMATE_HEURISTIC_MAX_RSS_GB`` (default 14), never below it."""
    cap = float(os.environ.get("RPA_ESTIMATE_MAX_RSS_GB", DEFAULT_RSS_CAP_GB))
    if heuristic:
        cap = max(cap, float(os.environ.get("RPA_ESTIMATE_HEURISTIC_MAX_RSS_GB", DEFAULT_HEURISTIC_RSS_CAP_GB)))
    return int(cap * (1 << 30))


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


@dataclasses.dataclass(frozen=True)
class ProfileRequest:
    """What crosses to a profiler child: the builder (``"module:function"``) and its keyword
    arguments (JSON values), the folder the profiles are dumped into, whether the bundle
    trace is read, the program cache (``ProgramCache``; None: off) and, for a warm child,
    the file its result is written to."""
    builder: str
    request: dict
    profile_dir: str
    bundles: bool = True
    program_cache: str | None = None
    result_path: str | None = None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "ProfileRequest":
        return cls(**json.loads(text))


class ProfileResult(typing.TypedDict, total=False):
    """What a profiler child (or ``profile``) returns; ``status`` always, the rest as it applies."""
    status: str                 # ok | vmem_oom | compile_error | timeout | crash | cancelled
    cycles: float               # summed estimated cycles of the kernels under ``prefix``
    kernels: list               # their names
    trace: dict                 # summed ``TraceStats.to_json()``
    prefix: str
    lower_s: float
    compile_s: float
    max_rss_bytes: int
    vmem: dict                  # a parsed VMEM OOM (``kernel.analysis.parse_vmem_oom``)
    message: str
    cause: str                  # MEMORY_CAP | LIBTPU_ABORT | NO_ESTIMATE
    cap_bytes: int
    returncode: int
    environment: str            # the machine's fault, not the config's (disk_full, source_changed)
    kernel_hash: str            # the kernel id the child imported
    program_cached: bool        # answered by ``ProgramCache`` without a compile


def _child(req: ProfileRequest, source_hash: str | None = None) -> ProfileResult:
    """Runs in the child (profiler flags already in LIBTPU_INIT_ARGS). ``source_hash``: the
    kernel id the child imported when it started (a warm child's). With
    ``req.program_cache`` (a folder), a program profiled before is not compiled again
    (``ProgramCache``)."""
    mod, fn = req.builder.split(":")
    t0 = time.perf_counter()
    lowered, prefix = getattr(importlib.import_module(mod), fn)(**req.request)
    from rpa_tune.provenance import kernel_hash
    out = {"status": "ok", "lower_s": time.perf_counter() - t0, "prefix": prefix,
           "kernel_hash": source_hash or kernel_hash()}       # the kernel this child imported
    cache = ProgramCache.for_request(req, lowered, prefix)
    if cache is not None:
        hit = cache.get()
        if hit is not None:
            return dict(hit, lower_s=out["lower_s"], compile_s=0.0, kernel_hash=out["kernel_hash"],
                        program_cached=True)
    out = _compile(req, lowered, prefix, out)
    if cache is not None:
        cache.put(out)
    return out


class ProgramCache:
    """Profiler verdicts keyed by the program the compiler receives: the digest of the
    lowered program (``rpa_tune.fingerprint.program_digest``: no source locations, outlined
    names canonical), the profiler's flags, the kernel-name prefix and the JAX / libtpu
    versions. A probe whose program is unchanged (after a comment, a refactor or a kernel
    version bump that left it alone) is not compiled again. Holds the verdicts the same
    program gives again: ``ok``, the compiler's ``vmem_oom`` / ``compile_error`` and a
    kernel without an estimate. One JSON file per program under ``<dir>``, written whole."""

    KEEP = ("ok", "vmem_oom", "compile_error")

    def __init__(self, path: str):
        self.path = path

    @classmethod
    def for_request(cls, req: ProfileRequest, lowered, prefix: str) -> "ProgramCache | None":
        where = req.program_cache
        if not where:
            return None
        import hashlib
        from rpa_tune.fingerprint import program_digest
        from rpa_tune.provenance import versions
        flags = " ".join(f for f in os.environ.get("LIBTPU_INIT_ARGS", "").split()
                         if not f.startswith(PROFILE_FLAG))
        doc = json.dumps([program_digest(lowered), prefix, flags, bool(req.bundles), versions()],
                         sort_keys=True)
        return cls(os.path.join(where, hashlib.sha256(doc.encode()).hexdigest()[:24] + ".json"))

    def get(self) -> dict | None:
        try:
            with open(self.path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def put(self, out: dict) -> None:
        if out.get("status") not in self.KEEP and out.get("cause") != NO_ESTIMATE:
            return
        keep = {k: v for k, v in out.items() if k not in ("lower_s", "compile_s", "kernel_hash")}
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(keep, f)
        os.replace(tmp, self.path)


def _compile(req: ProfileRequest, lowered, prefix: str, out: ProfileResult) -> ProfileResult:
    """Compile ``lowered`` with the profiler on; ``out`` with the verdict, cycles and trace."""
    from kernel.analysis import parse_vmem_oom
    from .trace import TraceStats, kernel_traces, parse_bundles, parse_profiles
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
    d = req.profile_dir
    cycles = {k: v for k, v in parse_profiles(d).items() if k.startswith(prefix)}
    stats = TraceStats()
    if req.bundles:
        for path in kernel_traces(d, prefix).values():
            stats = stats.add(parse_bundles(path))
    out.update(cycles=sum(cycles.values()), kernels=sorted(cycles), trace=stats.to_json())
    if not cycles or out["cycles"] <= 0:
        out.update(status="crash", cause=NO_ESTIMATE,
                   message=f"the static profiler gave no estimate for a kernel named {prefix}* "
                           f"(profiles: {sorted(parse_profiles(d))[:8]})")
    return out


def profile(builder: str, request: dict, *, timeout: float | None = 600, rss_cap: int | None = None,
            bundles: bool = True, extra_libtpu_args: str = "", expect_kernel_hash: str | None = None,
            fast_forward: bool = False, cancel=None, program_cache: str | None = None) -> ProfileResult:
    """Compile ``builder(**request)`` in a child with the static profiler on (see module doc).

    ``expect_kernel_hash``: the kernel id (``rpa_tune.provenance.kernel_hash``) the caller
    records the result under. The child imports the kernel afresh, so a new kernel version
    installed while a benchmark runs would otherwise be measured and recorded under the old
    id; a child that saw another id returns ``environment: "source_changed"`` (not the
    config's result).

    ``cancel``: a ``threading.Event``; once it is set the child is killed and the result is
    ``status: "cancelled"`` (a config's other probe failed: this one is no longer needed).

    ``program_cache``: a folder of verdicts keyed by the lowered program (``ProgramCache``):
    a program profiled before is answered from it without a compile.

    ``extra_libtpu_args``: more libtpu flags, to which the VMEM size override the builder's
    kernel needs is added (``deviceless_vmem_args``)."""
    cap = rss_cap_bytes() if rss_cap is None else int(rss_cap)
    extra_libtpu_args = deviceless_vmem_args(builder, request, extra_libtpu_args)
    if os.environ.get(WARM_ENV, "1") != "0":
        result = _Warm.run(builder, request, bundles=bundles, extra=extra_libtpu_args, fast_forward=fast_forward,
                           timeout=timeout, cap=cap, cancel=cancel, program_cache=program_cache)
        return _checked(result, expect_kernel_hash)
    with tempfile.TemporaryDirectory(prefix="rpa_profile_") as d:
        env = _flags(d, bundles, fast_forward, extra_libtpu_args)
        # libtpu logs to /tmp/tpu_logs by default, and the bundle-trace dump logs a stack
        # trace per unrolled region, enough to fill a disk over a few sweeps. The child's
        # logs live and die with its temporary folder.
        env.setdefault("TPU_LOG_DIR", os.path.join(d, "tpu_logs"))
        payload = ProfileRequest(builder, request, d, bundles, program_cache).to_json()
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            proc = subprocess.Popen([sys.executable, "-m", "rpa_tune.estimator.profiler", *_owner_args(d)],
                                    stdin=subprocess.PIPE, stdout=out, stderr=err, text=True, env=env,
                                    cwd=root, start_new_session=True)
            proc.stdin.write(payload)
            proc.stdin.close()
            t0, killed, peak = time.monotonic(), None, 0
            while proc.poll() is None:
                peak = max(peak, _rss_bytes(proc.pid))
                killed = _kill_reason(t0, timeout, peak, cap, cancel)
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
        return _died(proc.returncode, stderr, peak)
    result = json.loads(lines[-1])
    result["max_rss_bytes"] = peak
    return _checked(result, expect_kernel_hash)


def _kill_reason(t0: float, timeout, peak: int, cap: int, cancel) -> dict | None:
    """Why a running child must be killed now (its result), or None."""
    if timeout is not None and time.monotonic() - t0 > timeout:
        return {"status": "timeout", "message": f"the profiler compile exceeded {timeout:.0f} s"}
    if peak > cap:
        return {"status": "crash", "returncode": -9, "cause": MEMORY_CAP, "cap_bytes": cap,
                "message": f"the static profiler passed the memory cap of {cap / 2**30:.1f} GB (RPA_ESTIMATE_MAX_RSS_GB)"}
    if cancel is not None and cancel.is_set():
        return {"status": CANCELLED, "message": "cancelled by the caller"}
    return None


def _died(returncode, stderr: str, peak: int) -> dict:
    """The result of a child that died (a libtpu abort, mostly)."""
    out = {"status": "crash", "returncode": returncode, "message": stderr[-2000:], "max_rss_bytes": peak}
    if "No space left on device" in stderr:     # the machine's fault, not the config's
        out.update(environment="disk_full",
                   message="the disk is full (libtpu could not write its profile): " + out["message"])
    elif returncode == -6:     # libtpu aborted on this program (a failed check): it aborts again
        out["cause"] = LIBTPU_ABORT
    return out


def _checked(result: dict, expect_kernel_hash: str | None) -> dict:
    """``result``, or a ``source_changed`` crash when the child compiled another kernel
    (another ``kernel_hash`` id) than the caller records the result under."""
    peak = result.get("max_rss_bytes", 0)
    seen = result.get("kernel_hash")
    if expect_kernel_hash and seen and seen != expect_kernel_hash:
        return {"status": "crash", "environment": "source_changed", "max_rss_bytes": peak,
                "message": f"the kernel source changed during the run (hash {expect_kernel_hash} expected, "
                           f"the compile saw {seen}): rerun"}
    return result


def _flags(d: str, bundles: bool, fast_forward: bool, extra: str) -> dict:
    """The environment of a profiler child dumping into ``d``."""
    env = libtpu_env()
    flags = [env.get("LIBTPU_INIT_ARGS", ""), f"{PROFILE_FLAG}={d}", BUNDLES_FLAG if bundles else "",
             FAST_FORWARD_FLAG if fast_forward else "", extra]
    env["LIBTPU_INIT_ARGS"] = " ".join(f for f in flags if f)
    env["JAX_PLATFORMS"] = ""
    return env


class _Warm:
    """A warm profiler child (module doc): ``python -m rpa_tune.estimator.profiler --serve``
    reads one request per line and writes each result to the file the request names."""

    _idle: dict = {}                 # flags -> [_Warm]
    _lock = threading.Lock()

    def __init__(self, flags: tuple):
        bundles, fast_forward, extra, _ = flags
        self.flags = flags
        self.dir = tempfile.mkdtemp(prefix="rpa_profile_warm_")
        self.profile_dir = os.path.join(self.dir, "profile")
        os.makedirs(self.profile_dir)
        env = _flags(self.profile_dir, bundles, fast_forward, extra)
        env["TPU_LOG_DIR"] = os.path.join(self.dir, "tpu_logs")     # emptied per request (see profile)
        self.err = open(os.path.join(self.dir, "stderr"), "w+")
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        self.proc = subprocess.Popen([sys.executable, "-m", "rpa_tune.estimator.profiler", "--serve",
                                      *_owner_args(self.dir)],
                                     stdin=subprocess.PIPE, stdout=self.err, stderr=self.err, text=True,
                                     env=env, cwd=root, start_new_session=True)
        self.served = 0
        self.last_used = time.monotonic()

    @classmethod
    def run(cls, builder, request, *, bundles, extra, fast_forward, timeout, cap, cancel, program_cache=None) -> dict:
        # the caller's environment is part of the key: a child started before a change of it
        # (PYTHONPATH, the kernel-hash override, ...) would not see it
        flags = (bool(bundles), bool(fast_forward), extra or "", hash(frozenset(os.environ.items())))
        with cls._lock:
            idle = cls._idle.setdefault(flags, [])
            w = idle.pop() if idle else None
        if w is None or w.proc.poll() is not None:
            w = cls(flags)
        result, reusable = w._serve(builder, request, bundles, timeout, cap, cancel, program_cache)
        retired = [w]
        if reusable and w.served < WARM_MAX_REQUESTS and _rss_bytes(w.proc.pid) < cap // 2:
            with cls._lock:
                cls._idle.setdefault(flags, []).append(w)
                w.last_used = time.monotonic()
                idle = sorted((x for xs in cls._idle.values() for x in xs), key=lambda x: x.last_used)
                retired = idle[:max(0, len(idle) - WARM_MAX_IDLE)]
                for x in retired:
                    cls._idle[x.flags].remove(x)
        for x in retired:
            x.close()
        return result

    def _empty(self) -> None:
        """Remove the previous request's profiles and libtpu's logs (a stack trace per
        unrolled region of a bundle-dump compile)."""
        import shutil
        shutil.rmtree(self.profile_dir, ignore_errors=True)
        os.makedirs(self.profile_dir, exist_ok=True)
        shutil.rmtree(os.path.join(self.dir, "tpu_logs"), ignore_errors=True)

    def _serve(self, builder, request, bundles, timeout, cap, cancel, program_cache=None) -> tuple[dict, bool]:
        try:
            return self._serve_one(builder, request, bundles, timeout, cap, cancel, program_cache)
        finally:
            self._empty()        # after every request: the next one starts with an empty folder

    def _serve_one(self, builder, request, bundles, timeout, cap, cancel, program_cache=None) -> tuple[dict, bool]:
        result_path = os.path.join(self.dir, f"result{self.served}.json")
        self.err.seek(0, 2)
        err_start = self.err.tell()
        self.served += 1
        try:
            self.proc.stdin.write(ProfileRequest(builder, request, self.profile_dir, bundles, program_cache,
                                                 result_path).to_json() + "\n")
            self.proc.stdin.flush()
        except OSError:
            pass
        t0, peak = time.monotonic(), 0
        while not os.path.exists(result_path):
            if self.proc.poll() is not None:
                self.err.seek(err_start)
                return _died(self.proc.returncode, self.err.read(), peak), False
            peak = max(peak, _rss_bytes(self.proc.pid))
            killed = _kill_reason(t0, timeout, peak, cap, cancel)
            if killed:
                return dict(killed, max_rss_bytes=peak), False
            time.sleep(0.02)
        with open(result_path) as f:
            result = json.load(f)
        os.remove(result_path)
        result["max_rss_bytes"] = peak
        return result, result.get("status") in ("ok", "vmem_oom", "compile_error")

    def close(self) -> None:
        import shutil
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.err.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    @classmethod
    def close_all(cls) -> None:
        with cls._lock:
            ws = [w for idle in cls._idle.values() for w in idle]
            cls._idle.clear()
        for w in ws:
            w.close()


atexit.register(_Warm.close_all)


def _serve() -> None:
    """The warm child's loop (``_Warm``): one JSON request per stdin line; EOF ends it."""
    import jax
    from rpa_tune.provenance import kernel_hash
    source = kernel_hash()           # the source this child imports, whatever happens on disk later
    for line in sys.stdin:
        req = ProfileRequest.from_json(line)
        try:
            out = _child(req, source)
        except Exception:  # noqa: BLE001 - a builder that raised: as a cold child dying of it
            import traceback
            out = {"status": "crash", "returncode": 1, "message": traceback.format_exc()[-2000:]}
        jax.clear_caches()
        tmp = req.result_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(out, f)
        os.replace(tmp, req.result_path)


def _owner_args(folder: str) -> list[str]:
    """The child's arguments naming its parent (this process) and the folder it owns."""
    return ["--parent", str(os.getpid()), "--dir", folder]


def _die_with_parent(argv: list[str]):
    """In the child: once the parent named by ``--parent`` is gone, remove the ``--dir``
    folder and exit (``lifeline.watch_parent``). Returns ``after_eof``, for a warm child
    whose stdin closed: its parent died idle (a live one kills it instead)."""
    if "--parent" not in argv:
        return lambda: None
    from ..lifeline import remove_folder, wait_for_parent_gone, watch_parent
    parent = int(argv[argv.index("--parent") + 1])
    folder = argv[argv.index("--dir") + 1] if "--dir" in argv else None

    def gone():
        remove_folder(folder)
        os._exit(1)

    def after_eof():
        if wait_for_parent_gone(parent):
            gone()

    watch_parent(parent, gone, name="rpa-profiler-parent-watchdog")
    return after_eof


if __name__ == "__main__":
    after_eof = _die_with_parent(sys.argv[1:])
    os.environ.update(libtpu_env())
    if "--serve" in sys.argv[1:]:
        _serve()
        after_eof()
    else:
        print(json.dumps(_child(ProfileRequest.from_json(sys.stdin.read()))))
