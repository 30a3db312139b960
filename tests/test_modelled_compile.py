"""Modelled prices end to end (issue 101 item 5): where libtpu's profiler cannot price a
program (v4, TPU7x prefill / mixed) the compile backend records method ``modelled``, the
device-cost model of the walk's features alone, and the compiler's plain deviceless compile
judges VMEM. Checked against the model's formula computed here from the calibration's
constants and the chip's rates, and against the compiler's own verdict on the program a
server compiles (``prefilter.compiler_verdict``)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernel.config import BlockSizes
from kernel.hardware import tpu_info
from kernel.workload import ServingLimits, Workload
from rpa_tune import prefilter
from rpa_tune.estimator import device_model
from rpa_tune.evaluators import base
from rpa_tune.kernels import get_kernel
from rpa_tune.presets import get_preset

REPO = Path(__file__).resolve().parent.parent
LLAMA = get_preset("llama3-8b").model()


def _expected_time(feats: device_model.Features, generation: str) -> float:
    """The model's time without a static estimate, from its constants and the chip's rates."""
    cal, _ = device_model.calibration_for(generation)
    c, info = cal.constants, tpu_info(generation)
    bw = info.mem_bw_bytes_per_second
    peak = info.bf16_ops_per_second * min(1.0, feats.head_dim / info.mxu_column_size)   # the head_dim's MXU fill
    return (max(feats.hbm_bytes / (c["hbm_efficiency"] * bw), feats.mxu_flops / (c["mxu_efficiency"] * peak))
            + c["t_call_s"] + c["t_qblock_s"] * feats.qblocks)


def test_a_compile_sweep_of_a_v4_key_records_modelled_and_export_writes_it(tmp_path):
    """v4 (the profiler refuses every program): each row is ``modelled`` with the calibration
    named, no static estimate, the walk's features recorded and the model's time; the sweep's
    summary says modelled; export writes the key's entry with method modelled."""
    env = dict(os.environ, RPA_TUNE_PROBE_CACHE=str(tmp_path / "cache"))
    res = tmp_path / "res"
    cmd = [sys.executable, "-m", "rpa_tune.cli", "sweep", "--tpu", "v4", "--case", "decode", "--model", "llama3-8b",
           "--page-size", "128", "--max-num-tokens", "128", "--num-seqs", "8", "--budget", "2", "--jobs", "1",
           "--timeout", "600", "--results", str(res)]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "v4 decode — compile (modelled)" in r.stdout, r.stdout[-3000:]
    from rpa_tune.store import ResultStore
    df = ResultStore(res).read()
    assert len(df) == 2 and set(df["status"]) == {"ok"}, df[["status", "message"]].to_string()
    _, version = device_model.calibration_for("v4")
    model = LLAMA
    for row in df.to_dict("records"):
        assert row["method"] == "modelled" and row["evaluator_version"].endswith("+modelled1")
        assert row["calibration"] == version == "tpu7x-paper-1@v4"
        assert row["estimate_s"] != row["estimate_s"] and row["static_s"] != row["static_s"]   # NaN: no estimate
        assert row["cycles"] != row["cycles"]
        wj = json.loads(row["workload_json"])
        w = Workload(tuple(wj["q_lens"]), tuple(wj["kv_lens"]), tuple(wj["distribution"]))
        bs = BlockSizes(row["bq"], row["bkv"], row["cq"], row["ckv"])
        feats = device_model.features(get_kernel("rpa-tune"), w, model, "decode", bs, 128, "v4")
        assert row["walk_qblocks"] == feats.qblocks and row["walk_hbm_bytes"] == feats.hbm_bytes
        assert row["metric"] == pytest.approx(_expected_time(feats, "v4"), rel=1e-9)
        assert "modelled: no estimate" in row["message"] and "plain compile" in row["message"]
    out = tmp_path / "tables"
    r = subprocess.run([sys.executable, "-m", "rpa_tune.cli", "export", "--results", str(res), "--out", str(out)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    from kernel.tables import Table
    (e,) = Table.read(out / "v4.json").entries
    assert e.method == "modelled" and e.metric == pytest.approx(df["metric"].min())


def _task(gen, case, bs, workload, max_num_tokens):
    lim = ServingLimits(page_size=128, max_num_tokens=max_num_tokens, max_num_seqs=128, max_model_len=8192)
    return base.Task("compile", gen, case, LLAMA, lim, workload, BlockSizes(*bs), timeout=3600)


def _check_vmem_verdicts(gen, case, fits, over, max_num_tokens=2048):
    """The modelled evaluation of ``fits`` is ok and priced by the model; of ``over``,
    vmem_oom; each as the compiler judges the serving program at the limit the evaluation
    ended at."""
    from rpa_tune.coverage import sweep_workload
    from rpa_tune.evaluators.compile import CompileEvaluator
    w = sweep_workload(case, 128, max_num_tokens)
    for bs, want in ((fits, base.OK), (over, base.VMEM_OOM)):
        t = _task(gen, case, bs, w, max_num_tokens)
        r = CompileEvaluator().evaluate(t)
        assert r.method == "modelled" and r.status == want, (bs, r.status, r.message)
        ref = prefilter.compiler_verdict(t.model, t.limits, gen, case, t.bs, r.vmem_limit_bytes)
        assert ref["status"] == want, (bs, r.vmem_limit_bytes, ref)
        if want == base.OK:
            feats = device_model.features(get_kernel("rpa-tune"), w, t.model, case, t.bs, 128, gen)
            assert r.metric == pytest.approx(_expected_time(feats, gen), rel=1e-9)
            assert r.static_s is None and r.estimate_s is None and r.walk == feats.to_json()
        else:
            assert r.metric is None


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_a_modelled_v4_prefill_key_is_judged_by_the_compiler():
    """v4 (16 MiB of VMEM): (64, 512, 32, 256) fits, (128, 512, 64, 256) does not (about
    17 MiB of scratch), at every limit up to the chip's VMEM."""
    _check_vmem_verdicts("v4", "prefill", (64, 512, 32, 256), (128, 512, 64, 256))


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_a_modelled_tpu7x_prefill_key_is_judged_by_the_compiler():
    """TPU7x (64 MiB of VMEM), bucket 512: the heuristic's (128, 512, 64, 256) fits;
    (256, 4096, 256, 1024) does not (the serving program needs about 107 MiB)."""
    _check_vmem_verdicts("tpu7x", "prefill", (128, 512, 64, 256), (256, 4096, 256, 1024), max_num_tokens=512)
