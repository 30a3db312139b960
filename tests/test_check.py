"""``rpa-tune check``: the VMEM verdict on the block sizes a server will use, deviceless.

vllm-project/tpu-inference #2803: Qwen3-VL-8B (32 q / 8 KV heads, head_dim 128) at tensor
parallelism 1 on one TPU7x chip, ``--max-model-len 4096 --max-num-batched-tokens 2048
--max-num-seqs 8``, page 256: the mixed kernel's default ``RPAm-p_256-bq_512_256-bkv_2048_512``
ran out of VMEM ("Used 76.58M of 64.00M vmem") when the server compiled it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernel.config import BlockSizes
from rpa_tune import kernels
from tables_synth import key

RPA_TUNE = str(Path(sys.executable).with_name("rpa-tune"))
ISSUE_2803 = ["--kernel", "tpu-inference", "--tpu", "v7x", "--q-heads", "32", "--kv-heads", "8", "--head-dim", "128",
              "--page-size", "256", "--max-num-tokens", "2048", "--max-num-seqs", "8", "--max-model-len", "4096"]


def run(args, timeout=1200):
    return subprocess.run([RPA_TUNE, "check", *args], capture_output=True, text=True, env=dict(os.environ),
                          timeout=timeout)


def test_issue_2803_does_not_fit_and_the_tuple_printed_does():
    from kernel.hardware import tpu_info
    r = run(ISSUE_2803 + ["--case", "mixed", "--json"])
    assert r.returncode == 1, r.stderr[-2000:]
    doc = json.loads(r.stdout)
    (c,) = doc["cases"]
    # the server's tuple is the package's own default for the key (get_default_block_sizes)
    kk = key("tpu7x", "mixed", hq=32, hkv=8, d=128, page=256, t=2048, l=4096)
    default = kernels.get_kernel("tpu-inference").heuristic(kk, max_num_seqs=8)
    assert tuple(c["block_sizes"]) == tuple(default) == (512, 2048, 256, 512), "the issue's RPAm-p_256-bq_512_256-bkv_2048_512"
    assert c["source"] == "default" and c["status"] == "vmem_oom" and not c["fits"]
    cap = tpu_info("tpu7x").vmem_capacity_bytes
    assert c["vmem_limit_bytes"] == cap, "judged at the limit tpu-inference runs with: all of VMEM"
    assert c["used_bytes"] > cap, "the compiler's own figure, over the chip's 64 MiB"
    fit = BlockSizes(*c["fit"])
    assert c["fit_halvings"] >= 1 and fit != default and all(a <= b for a, b in zip(fit, default))
    assert c["tried"][-1]["status"] == "ok" and c["fit_cost"]["label"] == "modelled" and c["fit_cost"]["time_s"] > 0
    # the tuple it prints, given back as the server's override: it fits (exit 0)
    var = f"RPA_V3_MIXED_BLOCK_SIZES={','.join(map(str, fit))}"
    r2 = run(ISSUE_2803 + ["--case", "mixed", "--env", var])
    assert r2.returncode == 0, r2.stdout + r2.stderr[-2000:]
    assert f"{tuple(fit)} (env:RPA_V3_MIXED_BLOCK_SIZES): fits" in r2.stdout


@pytest.mark.parametrize("extra,match", [
    (["--env", "RPA_V3_MIXED_BLOCK_SIZES=512,2048"], "four positive ints"),
    (["--env", "RPA_M_BLOCK_SIZES=64,512,32,256"], "NAME one of RPA_V3_DECODE_BLOCK_SIZES"),
    (["--env", "RPA_V3_MIXED_BLOCK_SIZES=64,500,32,250"], "not legal for tpu-inference"),
    (["--case", "sideways"], "unknown case 'sideways'"),
    (["--head-dim", "96"], "--head-dim 96 is not supported"),
])
def test_bad_input_is_one_line_and_exit_2(extra, match):
    args = list(ISSUE_2803)
    if "--head-dim" in extra:
        i = args.index("--head-dim")
        del args[i:i + 2]
    r = run(args + ["--case", "mixed"] + extra if "--case" not in extra else args + extra, timeout=300)
    assert r.returncode == 2 and match in r.stderr, r.stderr
    assert len([ln for ln in r.stderr.splitlines() if ln.startswith("rpa-tune: error:")]) == 1
    assert "Traceback" not in r.stderr
