"""Run the installed tpu-inference's own RPA v3 kernel tests against our kernel.

The test modules are the ones installed with the ``tpu-inference`` package
(``<site-packages>/tests/kernels/ragged_paged_attention_kernel_v3_test.py`` and
``..._v3_hd64_test.py``). Each is loaded from its file, and the kernel function it calls
(``ragged_paged_attention`` / ``ragged_paged_attention_hd64``, the names it imported from
tpu-inference) is replaced by ours (``kernel.ragged_paged_attention`` /
``kernel.ragged_paged_attention_hd64``), run in the Pallas TPU interpreter on CPU. Every
argument a test passes reaches our kernel unchanged; ``interpret=True`` is the only one
added. The tests keep their own inputs, their own reference function (tpu-inference's
``ref_ragged_paged_attention*``), their tolerances and their assertions. Their "needs a
TPU v4+ / v5+" guards are answered yes (we run in the interpreter); tests of v3's own
default block-size heuristic (``GetDefaultBlockSizesTest``) test no kernel and are skipped
with that reason.

Usage::

    python scripts/conformance_v3.py                 # every case, report to benchmarks/results/conformance_v3.md
    python scripts/conformance_v3.py -k kv_share     # cases whose id contains a substring
    python scripts/conformance_v3.py --list          # the case ids
    python scripts/conformance_v3.py --jobs 2        # cases in 2 worker processes

Exit 0 when no case fails, 1 otherwise, 2 on bad input (e.g. tpu-inference not installed).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
import traceback
import unittest
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MODULES = {
    # short name -> (test file under <site-packages>/tests/kernels, the kernel name it calls, ours)
    "v3": ("ragged_paged_attention_kernel_v3_test.py", "ragged_paged_attention", "ragged_paged_attention"),
    "hd64": ("ragged_paged_attention_kernel_v3_hd64_test.py", "ragged_paged_attention_hd64",
             "ragged_paged_attention_hd64"),
}
# test classes that exercise no kernel
NOT_A_KERNEL_TEST = {"GetDefaultBlockSizesTest": "tests v3's own default block-size heuristic, not a kernel"}
DEFAULT_OUT = REPO / "benchmarks" / "results" / "conformance_v3.md"


def tests_dir() -> Path | None:
    """``<site-packages>/tests/kernels`` of the installed tpu-inference, or None."""
    spec = importlib.util.find_spec("tpu_inference")
    if spec is None or not spec.submodule_search_locations:
        return None
    d = Path(list(spec.submodule_search_locations)[0]).parent / "tests" / "kernels"
    return d if d.is_dir() else None


def tpu_inference_version() -> str:
    from importlib import metadata
    try:
        return metadata.version("tpu-inference")
    except metadata.PackageNotFoundError:
        return "unknown"


def _stub_server_modules():
    """Stand-ins for the two tpu-inference modules the head_dim-64 kernel module imports at
    its top for its tuned-block-size lookup, which imports vllm and torch (not installed:
    tpu-inference is installed ``--no-deps``): ``tpu_inference.logger`` (``init_logger``, a
    standard logger) and ``tpu_inference.utils`` (any attribute is a function that raises).
    Neither is reached by the tests' reference functions."""
    import logging
    import types

    def unavailable(name):
        def fn(*_a, **_k):
            raise RuntimeError(f"tpu_inference.utils.{name} is a stand-in here (torch / vllm are not installed)")
        return fn

    for name, attrs in (("tpu_inference.logger", {"init_logger": logging.getLogger}),
                        ("tpu_inference.utils", None)):
        if name in sys.modules:
            continue
        try:
            importlib.import_module(name)
        except ImportError:
            mod = types.ModuleType(name, f"stand-in for {name} (vllm / torch are not installed)")
            if attrs:
                mod.__dict__.update(attrs)
            else:
                mod.__getattr__ = unavailable
            sys.modules[name] = mod


def load_module(short: str):
    """The installed test module ``short`` with our kernel in place of tpu-inference's."""
    import functools

    import kernel
    from rpa_tune.public_kernel import load_kernel_module
    load_kernel_module()    # registers tpu_inference without running its __init__ (which imports vllm)
    _stub_server_modules()
    fname, theirs, ours = MODULES[short]
    path = tests_dir() / fname
    spec = importlib.util.spec_from_file_location(f"_tpu_inference_conformance_{short}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ours_fn = getattr(kernel, ours, None)
    if ours_fn is None:
        def ours_fn(*_a, **_k):
            raise NotImplementedError(f"our kernel has no {ours}")
    call = functools.partial(ours_fn, interpret=True)
    call.__name__ = ours
    setattr(mod, theirs, call)
    return mod


def _cases(short: str, mod):
    """(case id, test) of every test of ``mod`` (parameterized cases expanded)."""
    loader = unittest.TestLoader()
    out = []
    for name in sorted(dir(mod)):
        cls = getattr(mod, name)
        if not (isinstance(cls, type) and issubclass(cls, unittest.TestCase)) or cls.__module__ != mod.__name__:
            continue
        for test in loader.loadTestsFromTestCase(cls):
            out.append((f"{short}::{cls.__name__}::{test._testMethodName}", test))
    return out


def list_cases(modules=tuple(MODULES)) -> list[str]:
    return [cid for short in modules for cid, _ in _cases(short, load_module(short))]


class _Result(unittest.TestResult):
    def __init__(self):
        super().__init__()
        self.outcome, self.reason = "pass", ""

    def addFailure(self, test, err):
        self.outcome, self.reason = "fail", _short(err)

    def addError(self, test, err):
        self.outcome, self.reason = "error", _short(err)

    def addSkip(self, test, reason):
        self.outcome, self.reason = "skip", reason


def _short(err) -> str:
    etype, value, tb = err
    lines = [ln for ln in str(value).strip().splitlines() if ln.strip()]
    msg = " / ".join(lines[:6])
    if not msg and tb is not None:      # a bare assert: its line
        frame = traceback.extract_tb(tb)[-1]
        msg = f"{frame.line} (line {frame.lineno} of {Path(frame.filename).name})"
    return f"{etype.__name__}: {msg}"[:600]


def run_case(cid: str) -> dict:
    """Run one case (by id); returns ``{id, outcome, reason, seconds}``."""
    from unittest import mock

    from jax._src import test_util as jtu
    short, cls_name, _ = cid.split("::")
    if cls_name in NOT_A_KERNEL_TEST:
        return dict(id=cid, outcome="skip", reason=NOT_A_KERNEL_TEST[cls_name], seconds=0.0)
    mod = load_module(short)
    test = dict(_cases(short, mod)).get(cid)
    if test is None:
        return dict(id=cid, outcome="error", reason="no such case", seconds=0.0)
    res = _Result()
    t0 = time.perf_counter()
    # the interpreter stands in for a TPU: the tests' "TPU v4+ / v5+" guards answer yes
    with mock.patch.object(jtu, "is_device_tpu_at_least", lambda *a, **k: True):
        try:
            test.run(res)
        except Exception:       # a crash outside the test's own handling
            res.outcome, res.reason = "error", _short(sys.exc_info())
    return dict(id=cid, outcome=res.outcome, reason=res.reason, seconds=round(time.perf_counter() - t0, 1))


def _worker(cids, queue):
    for cid in cids:
        try:
            queue.put(run_case(cid))
        except Exception:
            queue.put(dict(id=cid, outcome="error", reason=traceback.format_exc()[-600:], seconds=0.0))


def run_all(cids: list[str], jobs: int = 1, echo=print) -> list[dict]:
    results = []
    if jobs <= 1:
        for cid in cids:
            r = run_case(cid)
            echo(f"{r['outcome']:5s} {r['seconds']:7.1f}s  {cid}  {r['reason'][:160]}")
            results.append(r)
        return results
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(cids[i::jobs], queue)) for i in range(jobs)]
    for p in procs:
        p.start()
    for _ in cids:
        r = queue.get()
        echo(f"{r['outcome']:5s} {r['seconds']:7.1f}s  {r['id']}  {r['reason'][:160]}")
        results.append(r)
    for p in procs:
        p.join()
    order = {c: i for i, c in enumerate(cids)}
    return sorted(results, key=lambda r: order[r["id"]])


def render(results: list[dict], argv: list[str]) -> str:
    import jax
    counts = {}
    for r in results:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    lines = [
        "# Conformance: tpu-inference's RPA v3 kernel tests against our kernel",
        "",
        f"`python scripts/conformance_v3.py {' '.join(argv)}`".replace("  ", " ").replace(" `", "`"),
        f"tpu-inference {tpu_inference_version()}, jax {jax.__version__}, our kernel "
        f"{__import__('kernel.provenance', fromlist=['kernel_id']).kernel_id()}, Pallas TPU interpreter on CPU.",
        "",
        "Each case is the installed package's own test (its inputs, its reference function, its "
        "tolerances and assertions) with our `kernel.ragged_paged_attention` / "
        "`kernel.ragged_paged_attention_hd64` in place of tpu-inference's, every argument passed "
        "unchanged (`interpret=True` added). The script is `scripts/conformance_v3.py`.",
        "",
        "Totals: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) + f" (of {len(results)}).",
        "",
        "| case | outcome | seconds | reason |",
        "|---|---|---:|---|",
    ]
    for r in results:
        reason = r["reason"].replace("|", "\\|").replace("\n", " ")
        lines.append(f"| `{r['id']}` | {r['outcome']} | {r['seconds']} | {reason} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-k", dest="substr", action="append", default=[],
                    help="run only the cases whose id contains this substring (repeatable: any)")
    ap.add_argument("--modules", default="v3,hd64", help="comma list of: " + ", ".join(MODULES))
    ap.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    ap.add_argument("--list", action="store_true", help="print the case ids and exit")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="the report (Markdown); '-' for none")
    args = ap.parse_args(argv)
    if tests_dir() is None:
        print("tpu-inference with its tests (tests/kernels) is not installed: nothing to run", file=sys.stderr)
        return 2
    modules = [m.strip() for m in args.modules.split(",") if m.strip()]
    bad = [m for m in modules if m not in MODULES]
    if bad:
        print(f"--modules {','.join(bad)}: unknown; valid: {', '.join(MODULES)}", file=sys.stderr)
        return 2
    if args.jobs < 1:
        print(f"--jobs {args.jobs}: must be a positive int", file=sys.stderr)
        return 2
    cids = list_cases(modules)
    if args.substr:
        cids = [c for c in cids if any(s in c for s in args.substr)]
    if args.list:
        print("\n".join(cids))
        return 0
    if not cids:
        print(f"no case id contains any of {args.substr}", file=sys.stderr)
        return 2
    results = run_all(cids, args.jobs)
    if args.out != "-":
        Path(args.out).write_text(render(results, argv))
        print(f"wrote {args.out}")
    failed = [r for r in results if r["outcome"] in ("fail", "error")]
    print(f"{len(results) - len(failed)} of {len(results)} cases pass or skip; {len(failed)} fail")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
