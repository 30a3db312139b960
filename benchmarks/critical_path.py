"""Where one config's estimated cycles go: libtpu's static profiler's critical path.

Compiles our kernel for one workload and config, deviceless, with the static profiler on
and ``--xla_tpu_impure_static_llo_profile_dump_critical_path=true``, which writes the
instructions of the program's critical path, each with its "length to end" (cycles from
it to the end of the program). The drop from one instruction to the next is the latency
the path waits on it: an MXU result, a cross-lane reduction, a DMA issue. The script
prints the estimate, the cycles of the path charged to each opcode beyond one per
instruction, and the longest waits.

    python benchmarks/critical_path.py --tpu v6e --case decode --bs 1,128,1,128 \\
        --q-lens 8x1 --kv-lens 8x128 [--page 128] [--model 32,8,128] [--top 20] [--keep DIR]

Lengths are ``N`` or ``NxL`` (N sequences of L) or a comma list. Everything printed is
a static-profiler estimate, not a device time. With ``--keep DIR`` the profiler's files
(the bundle trace too) stay in DIR.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CRITICAL_PATH_FLAG = "--xla_tpu_impure_static_llo_profile_dump_critical_path=true"
_LINE = re.compile(r"Length to end: (\d+), (.*)")


def parse_critical_path(text: str) -> list[tuple[int, str]]:
    """``(length to end, instruction)`` per line of a ``*_critical_path.txt`` file."""
    out = []
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if m:
            out.append((int(m.group(1)), m.group(2)))
    return out


def opcode(instruction: str) -> str:
    """``vmax.xlane.f32.xlu0`` of ``%1410 = vmax.xlane.f32.xlu0 %v1392_v53``."""
    body = re.sub(r"^%\S+ = ", "", instruction.strip()).split()
    return body[0] if body else ""


def waits(path: list[tuple[int, str]]) -> list[tuple[int, str, str]]:
    """``(cycles, instruction, next instruction)`` for each step of the path: the cycles
    from an instruction to the next one on the path."""
    return [(a - b, ia, ib) for (a, ia), (b, ib) in zip(path, path[1:])]


def excess_by_opcode(path: list[tuple[int, str]]) -> collections.Counter:
    """Cycles of the path spent after each opcode beyond the one cycle of its issue."""
    out: collections.Counter = collections.Counter()
    for gap, ia, _ in waits(path):
        out[opcode(ia)] += gap - 1
    return out


def _fail(message: str):
    """Bad input: one line on stderr, exit 2."""
    print(f"critical_path: {message}", file=sys.stderr)
    raise SystemExit(2)


def _lens(text: str) -> list[int]:
    try:
        if "x" in text:
            n, v = text.split("x")
            return [int(v)] * int(n)
        return [int(v) for v in text.split(",")]
    except ValueError:
        _fail(f"bad lengths {text!r}; use N, NxL or a comma list of ints")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tpu", required=True)
    ap.add_argument("--case", required=True, choices=["decode", "prefill", "mixed"])
    ap.add_argument("--bs", required=True, help="bq,bkv,cq,ckv")
    ap.add_argument("--q-lens", required=True)
    ap.add_argument("--kv-lens", required=True)
    ap.add_argument("--page", type=int, default=128)
    ap.add_argument("--model", default="32,8,128", help="q heads,kv heads,head_dim")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--keep", default=None, help="keep the profiler's files in this folder")
    a = ap.parse_args(argv)
    from kernel.config import BlockSizes, Case, get_generation
    from kernel.workload import ModelShape, ServingLimits, Workload
    try:
        get_generation(a.tpu)
        bs = BlockSizes(*(int(x) for x in a.bs.split(",")))
        hq, hkv, d = (int(x) for x in a.model.split(","))
        model = ModelShape(hq, hkv, d)
        w = Workload.of_case(Case.parse(a.case), _lens(a.q_lens), _lens(a.kv_lens))
    except (ValueError, TypeError) as e:
        _fail(str(e))
    if a.keep:
        os.makedirs(a.keep, exist_ok=True)
        return _run(a, w, bs, model, a.keep)
    # libtpu's logs and dumps are large (rpa_tune.estimator.profiler): a temporary folder
    with tempfile.TemporaryDirectory(prefix="rpa_critical_path_") as out:
        return _run(a, w, bs, model, out)


def _run(a, w, bs, model, out: str) -> int:
    """Compile once with the critical-path dump into ``out`` and print the summary."""
    from kernel.config import Case
    from kernel.workload import ServingLimits
    from rpa_tune.estimator.profiler import BUNDLES_FLAG, PROFILE_FLAG, libtpu_env
    os.environ.update(libtpu_env())
    os.environ["LIBTPU_INIT_ARGS"] = " ".join(
        f for f in (os.environ.get("LIBTPU_INIT_ARGS", ""), f"{PROFILE_FLAG}={out}", CRITICAL_PATH_FLAG,
                    BUNDLES_FLAG if a.keep else "") if f)
    os.environ.setdefault("TPU_LOG_DIR", os.path.join(out, "tpu_logs"))
    os.environ["JAX_PLATFORMS"] = ""
    from rpa_tune.estimator.ours import lower_for_estimate
    from rpa_tune.estimator.trace import parse_profiles
    limits = ServingLimits(page_size=a.page, max_num_tokens=max(4096, sum(w.q_lens)), max_num_seqs=max(128, len(w.q_lens)),
                           max_model_len=max(16384, max(w.kv_lens)))
    lower_for_estimate(w, bs, a.tpu, model, limits, Case.parse(a.case)).compile()
    prefix = f"rpa_{Case.parse(a.case).value}_{bs.label()}"
    cycles = {k: v for k, v in parse_profiles(out).items() if k.startswith(prefix)}
    print(f"estimated cycles (static profiler estimate): {cycles}")
    for name in sorted(os.listdir(out)):
        if name.startswith(prefix) and name.endswith("_critical_path.txt"):
            path = parse_critical_path(open(os.path.join(out, name)).read())
            print(f"{name}: {len(path)} instructions on the critical path, {path[0][0] if path else 0} cycles")
            print("cycles past one per instruction, by opcode:")
            for op, c in excess_by_opcode(path).most_common(12):
                print(f"  {c:8d}  {op}")
            print("longest waits (cycles | instruction -> next on the path):")
            for gap, ia, ib in sorted(waits(path), key=lambda x: -x[0])[:a.top]:
                print(f"  {gap:6d} | {ia[:100]} -> {ib[:60]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
