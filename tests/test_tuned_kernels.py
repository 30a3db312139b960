"""One tuned-kernel interface (``rpa_tune.kernels``): a third kernel is one module. A toy
kernel (``tests/toy_kernel.py``: our program under other rules and another baseline) is
registered through ``$RPA_TUNE_EXTRA_KERNELS`` and swept deviceless end to end, then
exported into its own tables folder."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RPA_TUNE = str(Path(sys.executable).with_name("rpa-tune"))


def test_no_code_outside_the_implementations_asks_which_kernel_it_is():
    """The kernels' names appear as values (defaults, the comparison's two sides), never as
    a condition: no ``is_ours``, no comparison of a kernel or builder with a literal name."""
    pattern = re.compile(r"is_ours|(==|!=)\s*[\"'](rpa-tune|tpu-inference)[\"']|"
                         r"[\"'](rpa-tune|tpu-inference)[\"']\s*(==|!=)|builder\s*(==|!=)")
    impl = REPO / "rpa_tune" / "kernels"
    found = [f"{p.relative_to(REPO)}:{i}: {line.strip()}"
             for d in ("rpa_tune", "benchmarks") for p in sorted((REPO / d).rglob("*.py")) if impl not in p.parents
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, "\n".join(found)


def test_a_toy_third_kernel_sweeps_deviceless_and_exports_its_own_tables(tmp_path):
    env = dict(os.environ, RPA_TUNE_EXTRA_KERNELS="toy_kernel:KERNEL",
               PYTHONPATH=os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               RPA_TUNE_PROBE_CACHE=str(tmp_path / "probes"))
    res, tables = tmp_path / "res", tmp_path / "tables"
    args = ["sweep", "--tpu", "v6e", "--kernel", "toy", "--case", "decode", "--q-heads", "8", "--kv-heads", "1",
            "--head-dim", "128", "--max-model-len", "2048", "--max-num-tokens", "64", "--num-seqs", "8",
            "--context", "fixed:700", "--search", "grid", "--budget", "2", "--jobs", "1", "--results", str(res)]
    r = subprocess.run([RPA_TUNE, *args], capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    from rpa_tune.store import ResultStore
    df = ResultStore(res).read()
    assert len(df) == 2 and set(df["kernel"]) == {"toy"} and set(df["kernel_version"]) == {"toy==1"}
    assert all(k.startswith("toy:v6e/decode/") for k in df["key_id"])
    assert (df["status"] == "ok").all(), df[["bq", "bkv", "status", "message"]].to_string()
    assert (df["bkv"] <= 1024).all()                       # its own rule
    heur = df[df["is_heuristic"]]
    assert len(heur) == 1 and tuple(heur.iloc[0][["bq", "bkv", "cq", "ckv"]]) == (8, 512, 8, 512)
    e = subprocess.run([RPA_TUNE, "export", "-r", str(res), "--kernel", "toy", "-o", str(tables)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert e.returncode == 0, e.stderr[-2000:]
    doc = json.loads((tables / "toy" / "v6e.json").read_text())
    assert doc["info"]["kernel"] == "toy" and len(doc["entries"]) == 1
    assert not list(tables.glob("*.json"))                 # nothing in our kernel's place
