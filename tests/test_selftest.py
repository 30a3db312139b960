"""`rpa-tune selftest` (issue #102, item 3): refused in one line without a TPU; on the
stand-in device (``tests/fake_tpu.py``: CPU, our kernel in the Pallas interpreter) the whole
command runs its quick matrix and writes its report, whose rows and verdict follow what the
device did: right outputs pass, a wrong compiled path is a FAIL row and exit 1."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import fake_tpu
from kernel.config import BlockSizes, block_size_errors
from rpa_tune import selftest

TESTS = str(Path(__file__).resolve().parent)
RPA_TUNE = str(Path(sys.executable).with_name("rpa-tune"))


def _env(tmp, fake=None, **extra):
    e = {k: v for k, v in os.environ.items() if k not in ("RPA_TUNE_FAKE_TPU", "RPA_TUNE_TPU_TIMING",
                                                          "RPA_TUNE_EVALUATOR_OVERRIDE")}
    e.update({"PYTHONPATH": TESTS + os.pathsep + e.get("PYTHONPATH", ""), "JAX_PLATFORMS": "cpu",
              "JAX_ENABLE_COMPILATION_CACHE": "false", "JAX_COMPILATION_CACHE_DIR": str(tmp / "jax-cache"),
              "COLUMNS": "200"})
    if fake:
        e["RPA_TUNE_FAKE_TPU"] = fake
    e.update(extra)
    return e


def _selftest(tmp, *args, env):
    out = tmp / "report"
    r = subprocess.run([RPA_TUNE, "selftest", "--quick", "--out", str(out), *args], env=env, capture_output=True,
                       text=True, timeout=600)
    return r, out


@pytest.mark.skipif(Path("/dev/accel0").exists(), reason="this machine has a TPU")
def test_without_a_tpu_one_line_and_exit_2(tmp_path):
    r, out = _selftest(tmp_path, env=_env(tmp_path))
    assert r.returncode == 2 and r.stdout == "", r.stdout
    assert r.stderr.startswith("rpa-tune: error: no TPU here") and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "Traceback" not in r.stderr and not out.exists()
    r, _ = _selftest(tmp_path, env=_env(tmp_path, RPA_TUNE_TPU_TIMING="stopwatch"))
    assert r.returncode == 2 and "'stopwatch'" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def _bs(v):
    return BlockSizes(*v)


def test_quick_selftest_on_the_stand_in_device_passes_and_reports(tmp_path):
    """Every quick check right on the device (bit-exact cache, error within the tolerance),
    both kernels' probes timed by the tpu backend beside their estimates (here the stand-in's:
    1.25 x the stand-in's device time), and the report says what ran where."""
    env = _env(tmp_path, "fake_tpu:v6e", RPA_TUNE_EVALUATOR_OVERRIDE="fake_tpu:estimate_evaluator")
    r, out = _selftest(tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("selftest PASS: 2/2 checks passed on TPU v6 lite"), r.stdout
    rep = json.loads((out / "selftest.json").read_text())
    md = (out / "selftest.md").read_text()
    assert rep["schema"] == selftest.SCHEMA and rep["verdict"] == "PASS" and rep["quick"] is True
    assert rep["device"]["device_kind"] == "TPU v6 lite" and rep["device"]["generation"] == "v6e"
    assert rep["device"]["tensorcores_per_chip"] == 1 and "stand-in" in rep["device"]["stand_in"]
    for k in ("jax_version", "jaxlib_version", "libtpu_version", "tpu_inference", "kernel_id"):
        assert rep["versions"][k], k
    assert rep["timing_method"] == "trace" and rep["scope"].startswith("per core")
    # correctness: the quick rows, each case of a ragged batch in one call
    assert [c["name"] for c in rep["checks"]] == [c.name for c in selftest.checks(quick=True)]
    for c in rep["checks"]:
        assert c["status"] == "PASS" and c["case"] == "decode+prefill+mixed" and c["problems"] == []
        assert 0 <= c["max_abs_err"] <= c["tolerance"] and c["cache_bytes_differing"] == 0
        assert all(not block_size_errors(case, _bs(bs), c["page_size"]) for case, bs in c["block_sizes"].items())
    assert {c["head_dim"] for c in rep["checks"]} == {64, 128} and {c["page_size"] for c in rep["checks"]} == {128, 256}
    assert {c["kv_dtype"] for c in rep["checks"]} == {"bfloat16", "float8_e4m3fn"}
    # probes: both kernels, measured by the device path and estimated by the compile workers
    assert [(p["kernel"], p["case"]) for p in rep["probes"]] == [("rpa-tune", "decode"), ("tpu-inference", "decode")]
    for p in rep["probes"]:
        m, e = p["measured"], p["estimate"]
        assert m["status"] == "ok" and m["method"] == "measured" and "timing trace" in m["message"]
        assert m["metric"] == pytest.approx(fake_tpu.device_time(_bs(p["block_sizes"])), rel=0.01)
        assert 0.003 < m["spread"] < 0.03 and m["samples"] >= 20
        assert e["status"] == "ok" and e["method"] == "estimate" and e["audit"] == "complete"
        assert e["metric"] == pytest.approx(fake_tpu.ESTIMATE_FACTOR * fake_tpu.device_time(_bs(p["block_sizes"])))
        assert p["estimate_over_measured"] == pytest.approx(fake_tpu.ESTIMATE_FACTOR, rel=0.01)
    # the Markdown: one row per check and probe, the labels, the chip, the verdict
    assert md.startswith("# rpa-tune selftest: PASS") and "Not a TPU" in md
    assert md.count("| **PASS** |") == 2 and "bit-exact" in md
    assert "`measured`" in md and "`estimate`" in md and "per core" in md and "TPU v6 lite" in md
    for p in rep["probes"]:
        assert f"| {p['kernel']} | decode | `{p['key']}` |" in md and "| `estimate`, complete | 1.25 |" in md


def test_a_wrong_compiled_path_is_a_fail_row_and_exit_1(tmp_path):
    """The stand-in's run of our kernel is wrong for head_dim 64 only, and the public
    kernel's stand-in output is off: the head_dim-64 row fails (with its error), the other
    passes, the public probe's device check fails; the verdict is FAIL, exit 1. Estimates
    off: each probe says so."""
    r, out = _selftest(tmp_path, "--no-estimate", env=_env(tmp_path, "fake_tpu:v6e_wrong"))
    assert r.returncode == 1, r.stderr[-3000:]
    rep = json.loads((out / "selftest.json").read_text())
    md = (out / "selftest.md").read_text()
    status = {c["head_dim"]: c for c in rep["checks"]}
    assert status[128]["status"] == "PASS"
    bad = status[64]
    assert bad["status"] == "FAIL" and bad["max_abs_err"] == pytest.approx(1.0, abs=0.05)
    assert any("outputs off" in p for p in bad["problems"]) and bad["cache_bytes_differing"] == 0
    assert rep["verdict"] == "FAIL" and rep["failed_checks"] == [bad["name"]]
    assert rep["failed_probes"] == ["tpu-inference decode"]
    ours, public = rep["probes"]
    assert ours["measured"]["status"] == "ok" and public["measured"]["status"] == "wrong_result"
    assert all(p["estimate"] == {"status": "unavailable", "reason": "not computed (--no-estimate)"}
               for p in rep["probes"])
    assert md.startswith("# rpa-tune selftest: FAIL") and md.count("| **FAIL** |") == 1
    assert f"* {bad['name']}: " in md and "wrong_result" in md
    assert r.stdout.startswith("selftest FAIL: 1/2 checks passed") and bad["name"] in r.stdout


def test_the_full_matrix_covers_every_path_and_its_sizes_are_legal():
    """What the full run checks on a chip (not run here: minutes of interpreter per row)."""
    full = selftest.checks(quick=False)
    assert {c.case for c in full} == {"decode", "prefill", "mixed"}
    assert any(len(c.cases) == 3 for c in full)                       # ragged batches of all three
    for case in ("decode", "prefill", "mixed"):
        rows = [c for c in full if c.cases == [case]]
        assert {c.model.head_dim for c in rows} == {64, 128, 256}, case
        assert {c.page_size for c in rows} == {128, 256} and any("float8" in c.model.kv_dtype for c in rows)
        assert any(c.sliding_window for c in rows) and any(c.soft_cap for c in rows)
        assert any(c.block_sizes for c in rows) and any(not c.block_sizes for c in rows)
    for c in selftest.CHECKS:
        c.workload.check_fits(c.limits)
        for case, bs in c.block_sizes:
            assert not block_size_errors(case, bs, c.page_size), (c.name, case)
        # several KV blocks for some sequence of each case the row holds, at its explicit sizes
        for case, bs in c.block_sizes:
            if case in c.cases:
                lo, hi = c.workload.case_range(case)
                assert max(c.workload.kv_lens[lo:hi]) > bs.bkv, (c.name, case)
    assert len({c.name for c in selftest.CHECKS}) == len(selftest.CHECKS)


def test_the_report_labels_each_deviceless_price_by_its_method():
    """A probe's deviceless column names the compile backend's method (``estimate``, or
    ``modelled`` where no static estimate is possible, with the reason as a note) and a
    missing one says why; the ratio is deviceless / measured."""
    def probe(kernel, e, measured=1e-4):
        ratio = e["metric"] / measured if e.get("status") == "ok" else None
        return dict(kernel=kernel, case="prefill", shape="s", key="tpu7x/prefill/k", workload={},
                    block_sizes=[16, 512, 16, 256], estimate=e, estimate_over_measured=ratio,
                    measured=dict(status="ok", method="measured", metric=measured, spread=0.01, samples=50))
    rep = dict(verdict="PASS", quick=False, elapsed_s=1.0, created="now", timing_method="trace", scope="per core: x",
               device=dict(device_kind="TPU7x", generation="tpu7x", devices=1, tensorcores_per_chip=2, device_0={},
                           stand_in=None),
               versions={k: "v" for k in ("jax_version", "jaxlib_version", "libtpu_version", "tpu_inference",
                                          "rpa_tune_version", "kernel_id", "git_sha", "python")},
               checks=[], probes=[
                   probe("tpu-inference", dict(status="ok", method="estimate", metric=1.5e-4, audit="complete",
                                               calibration="tpu7x-paper-1")),
                   probe("rpa-tune", dict(status="ok", method="modelled", metric=0.5e-4, calibration="tpu7x-paper-1",
                                          message="modelled: no estimate (the profiler hides the KV work)")),
                   probe("rpa-tune", dict(status="unavailable", reason="not computed (--no-estimate)"))])
    md = selftest.markdown(rep)
    rows = [line for line in md.splitlines() if line.startswith("| tpu-inference |") or line.startswith("| rpa-tune |")]
    assert len(rows) == 3
    assert "| 150.0 | `estimate`, complete, tpu7x-paper-1 | 1.50 |" in rows[0]
    assert "| 50.0 | `modelled`, tpu7x-paper-1 | 0.50 |" in rows[1]
    assert "| unavailable | - | - |" in rows[2]
    assert "* rpa-tune prefill, deviceless: modelled: no estimate (the profiler hides the KV work)" in md
    assert "* rpa-tune prefill, deviceless: not computed (--no-estimate)" in md
    assert "`modelled` = " in md and "TensorCores per chip | 2" in md
