"""The kernel is known by its program (``rpa_tune.fingerprint``), not by its source bytes.

* The code's canonical programs match the fingerprint recorded for ``KERNEL_VERSION``: a
  change to the compiled programs without a version bump fails here.
* In a scratch copy of the repository, a comment on every line-1 of ``kernel/`` and renames
  of private functions (one of them a function JAX outlines by name into the program)
  leave the kernel id, the programs, a resume id and a probe-cache key unchanged; a real
  change to a program (fp8's clipping bound) changes that program's digest only.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LABELS = ["serve-v6e-bf16-d128", "serve-v6e-fp8kv", "estimate-v6e-decode"]

# In a subprocess (the scratch copy's modules, not this process's): the kernel id, the
# digests of LABELS, a resume id and a probe-cache key of one config.
PROBE = r"""
import json, sys
from rpa_tune import fingerprint, provenance, store
from rpa_tune.estimator import compose
labels = json.loads(sys.argv[1])
doc = dict(builder="rpa_tune.estimator.ours:lower", case="decode", bs=[8, 512, 8, 256], tpu="v6e",
           model=dict(num_q_heads=32, num_kv_heads=8, head_dim=128, q_dtype="bfloat16", kv_dtype="bfloat16"),
           limits=dict(max_num_tokens=64, max_num_seqs=8, page_size=128, max_model_len=2048), options={})
print(json.dumps(dict(kernel_id=provenance.kernel_hash(), programs=fingerprint.compute(labels),
                      config_id=store.config_id("key", "wl", (8, 512, 8, 256), "compile", provenance.kernel_hash(), "e"),
                      cache_key=compose._cache_key(doc))))
"""


def _probe(root: Path) -> dict:
    env = {k: v for k, v in __import__("os").environ.items() if k != "RPA_TUNE_KERNEL_HASH"}
    env["PYTHONPATH"] = str(root)
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(LABELS)], cwd=root, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _scratch(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    for d in ("kernel", "rpa_tune"):
        shutil.copytree(REPO / d, root / d, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    return root


def _edit(path: Path, fn) -> None:
    path.write_text(fn(path.read_text()))


def test_programs_match_the_recorded_fingerprint():
    from rpa_tune import fingerprint
    c = fingerprint.check()
    if c.status == "unrecorded":
        pytest.skip(c.line())
    assert c.status == "match", c.line()


def test_comments_and_renames_change_nothing_a_program_change_is_caught(tmp_path):
    root = _scratch(tmp_path)
    before = _probe(root)
    for f in sorted((root / "kernel").rglob("*.py")):
        _edit(f, lambda s: "# an edit that is only a comment\n" + s.replace("\n\n\n", "\n\n\n# and another\n", 1))
    renames = {"_rpa_jit": "_rpa_jitted_call", "_unsigned_scalar_op": "_u32_scalar_op", "_like_runs": "_runs_alike"}
    for f in sorted((root / "kernel").rglob("*.py")):
        _edit(f, lambda s: re.sub(r"\b(" + "|".join(renames) + r")\b", lambda m: renames[m.group(1)], s))
    assert "_rpa_jitted_call" in (root / "kernel" / "api.py").read_text()
    assert _probe(root) == before
    # a real change to one program: fp8's clipping bound (the new K/V quantization)
    _edit(root / "kernel" / "api.py", lambda s: s.replace("FP8_MAX = 448.0", "FP8_MAX = 440.0"))
    after = _probe(root)
    changed = sorted(k for k in LABELS if after["programs"][k] != before["programs"][k])
    assert changed == ["serve-v6e-fp8kv"]
