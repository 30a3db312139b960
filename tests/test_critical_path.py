"""benchmarks/critical_path.py: the static profiler's critical path of one config."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import critical_path as cp  # noqa: E402

SAMPLE = """Length to end: 500, %s1 = smov 42
Length to end: 499, %2 = vmatmul.mubr.bf16.mxu0 %v1
Length to end: 300, %v3 = vpop.f32.mrf.mxu0
Length to end: 298, %4 = vmax.xlane.f32.xlu0 %v3
Length to end: 100, %5 = vst [vmem:[#allocation1]] %v4
"""


def test_parse_and_charge_waits_to_the_instruction_waited_on():
    path = cp.parse_critical_path("noise\n" + SAMPLE)
    assert [n for n, _ in path] == [500, 499, 300, 298, 100]
    assert cp.opcode(path[1][1]) == "vmatmul.mubr.bf16.mxu0" and cp.opcode("%166 = vnop") == "vnop"
    ex = cp.excess_by_opcode(path)
    assert ex["vmatmul.mubr.bf16.mxu0"] == 198 and ex["vmax.xlane.f32.xlu0"] == 197 and ex["smov"] == 0
    assert max(cp.waits(path))[0] == 199


def test_path_length_is_the_estimate(tmp_path):
    """A real compile (v6e decode, 4 x 128 tokens): the critical path's first length to end
    is the kernel's estimated cycles, and its longest waits are printed."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "critical_path.py"), "--tpu", "v6e",
                        "--case", "decode", "--bs", "1,128,1,128", "--q-lens", "4x1", "--kv-lens", "4x128",
                        "--top", "3", "--keep", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    est = int(re.search(r"': (\d+)\}", r.stdout).group(1))
    on_path = int(re.search(r"instructions on the critical path, (\d+) cycles", r.stdout).group(1))
    assert est > 0 and on_path == est, r.stdout
    assert len(re.findall(r"^\s+\d+ \| ", r.stdout, re.M)) == 3


def test_bad_lengths_are_one_line():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "critical_path.py"), "--tpu", "v6e",
                        "--case", "decode", "--bs", "1,128,1,128", "--q-lens", "4xa", "--kv-lens", "4x128"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == ["critical_path: bad lengths '4xa'; use N, NxL or "
                                                                   "a comma list of ints"], r.stderr
