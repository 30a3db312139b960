"""`rpa-tune calibrate` (issue 101, item 7) on CPU.

The device run: the real command, the real TPU worker and evaluator (device call, check
against the reference, profiler-trace timing) on the stand-in device of ``tests/fake_tpu.py``
(``ModelledTpu``), whose device times are ``device_model.device_time`` under KNOWN constants
with a noise of at most 1 % per call: the fitted constants must recover KNOWN, the
leave-one-out errors stay small, and the written calibration is what
``device_model.price`` then prices TPU7x with, by its version.

Stubbed to keep the module under a minute: (1) the static estimates (the compile backend's
deviceless probe compiles take minutes per config) are ``fake_tpu.recorded_static``, stand-in
values the fake device's times are built on too; the compile path is checked separately with
a fake compile evaluator in the compile worker; (2) the probe set is scaled down (8
sequences of up to 2K context, prefill up to 1K, our kernel on one decode probe of 2
sequences: our kernel runs in the Pallas interpreter and the reference is computed on the
host). The full probe set's shape is checked without running it.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

import fake_tpu
from cli_checks import assert_one_error_line
from rpa_tune import calibrate as cal_mod
from rpa_tune.estimator import device_model

TESTS = str(Path(__file__).resolve().parent)
RPA_TUNE = str(Path(sys.executable).with_name("rpa-tune"))
GEN = "tpu7x"
KNOWN = {"hbm_efficiency": 0.8, "mxu_efficiency": 0.35, "t_call_s": 3e-6, "t_qblock_s": 0.3e-6}
PAPER_FIXTURE = Path(__file__).resolve().parents[1] / "rpa_tune" / "data" / "paper_tpu7x_rpa_v3.json"


def small_probes() -> list:
    pub, _ = cal_mod.probe_set(GEN, ("tpu-inference",), seqs=8, decode=(512, 1024, 2048), prefill=(512, 1024))
    two, _ = cal_mod.probe_set(GEN, ("tpu-inference",), seqs=2, decode=(1024,), prefill=())
    ours, _ = cal_mod.probe_set(GEN, ("rpa-tune",), seqs=2, decode=(512,), prefill=())
    # another series (2 sequences): fewer q blocks than the 8-sequence rows
    two = [dataclasses.replace(p, name=p.name.replace(":decode", ":decode-2seq")) for p in two]
    return pub + two + ours


def stub_static(probes, progress):
    """The compile backend's static estimates, stubbed (module doc)."""
    return {p.name: (fake_tpu.recorded_static(p.task("compile", 60.0)), "") for p in probes}


def _env(tmp: Path) -> dict:
    e = {"RPA_TUNE_FAKE_TPU": "fake_tpu:modelled_tpu7x", fake_tpu.CONSTANTS_ENV: json.dumps(KNOWN),
         "PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", ""), "XDG_CACHE_HOME": str(tmp / "xdg"),
         "JAX_ENABLE_COMPILATION_CACHE": "false", "JAX_COMPILATION_CACHE_DIR": str(tmp / "jax-cache"),
         "COLUMNS": "250"}
    return e


@pytest.fixture(scope="module")
def device_run(tmp_path_factory):
    """`rpa-tune calibrate --tpu tpu7x --backend tpu --json` in this process (its probe set
    and static estimates stubbed, module doc); its workers on the stand-in device."""
    from typer.testing import CliRunner
    from rpa_tune.cli import app
    tmp = tmp_path_factory.mktemp("calibrate")
    mp = pytest.MonkeyPatch()
    for k, v in _env(tmp).items():
        mp.setenv(k, v)
    mp.delenv(device_model.ENV, raising=False)
    mp.delenv("RPA_TUNE_TPU_TIMING", raising=False)
    probes = small_probes()
    mp.setattr(cal_mod, "probe_set", lambda gen, kernels=cal_mod.KERNELS, **kw: (probes, []))
    mp.setattr(cal_mod, "static_estimates", stub_static)
    try:
        r = CliRunner().invoke(app, ["calibrate", "--tpu", GEN, "--backend", "tpu", "--json"])
    finally:
        mp.undo()
    return dict(result=r, probes=probes, tmp=tmp)


@pytest.fixture
def its_cache(device_run, monkeypatch):
    """The device run's user cache (where it wrote its calibration), no explicit file."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(device_run["tmp"] / "xdg"))
    monkeypatch.delenv(device_model.ENV, raising=False)
    return device_run


def _doc(run) -> dict:
    r = run["result"]
    assert r.exit_code == 0, (r.output, r.exception)
    return json.loads(r.stdout)


def test_device_run_times_every_probe_through_the_tpu_evaluator(device_run):
    doc = _doc(device_run)
    rows = {r["name"]: r for r in doc["rows"]}
    assert sorted(rows) == sorted(p.name for p in device_run["probes"]) and doc["left_out"] == []
    assert {r["kernel"] for r in rows.values()} == {"tpu-inference", "rpa-tune"}
    for p in device_run["probes"]:
        r = rows[p.name]
        # the median of the trace's kernel events, read by the evaluator's own reader: the
        # stand-in's time of this call
        assert r["measured_s"] == pytest.approx(fake_tpu.modelled_device_time(p.task("tpu", 60), KNOWN), rel=0.005)
        static = fake_tpu.recorded_static(p.task("compile", 60))
        assert r["static_s"] == static and r["label"] == ("modelled" if static is None else "estimate")


def test_the_fit_recovers_the_known_constants(device_run):
    cal = _doc(device_run)["calibration"]
    c = cal["constants"]
    for k in ("hbm_efficiency", "mxu_efficiency"):
        assert c[k] == pytest.approx(KNOWN[k], rel=0.05), (k, c)
    for k in ("t_call_s", "t_qblock_s"):
        assert c[k] == pytest.approx(KNOWN[k], rel=0.15), (k, c)
    assert cal["fitted_rows"] == len(device_run["probes"]) and cal["generation"] == GEN
    assert len(cal["leave_one_out"]) == len(device_run["probes"])
    assert max(abs(v) for v in cal["leave_one_out"].values()) < 0.05, cal["leave_one_out"]
    assert max(abs(v) for v in cal["fit_residuals"].values()) < 0.02


def test_the_written_calibration_prices_that_generation(its_cache):
    device_run = its_cache
    doc = _doc(device_run)
    version = doc["calibration"]["version"]
    assert version == f"{GEN}-device-1"
    path = Path(cal_mod.user_calibration_path(GEN))
    assert path.is_relative_to(device_run["tmp"] / "xdg")
    assert str(path) in doc["written"]
    assert json.loads(path.read_text())["generations"][GEN]["version"] == version
    cal, named = device_model.calibration_for(GEN)
    assert named == version and cal.constants == doc["calibration"]["constants"]
    # the compile backend's price of a call: under the written constants, naming them
    p = device_run["probes"][0]
    feats = cal_mod.probe_features(p)
    static = fake_tpu.recorded_static(p.task("compile", 60))
    priced = device_model.price(static, feats, GEN)
    assert priced["calibration"] == version
    assert priced["time_s"] == pytest.approx(device_model.device_time(static, feats, GEN, cal.constants)["time_s"])
    assert priced["time_s"] == pytest.approx(device_model.device_time(static, feats, GEN, KNOWN)["time_s"], rel=0.03)
    # the rows it was fitted to, beside it: a fixture that refits to the same constants
    rows_file = Path(cal_mod.rows_path(str(path)))
    assert str(rows_file) in doc["written"]
    gen, _, rows = cal_mod.load_fixture(str(rows_file))
    assert gen == GEN and [m.row.name for m in rows] == [r["name"] for r in doc["rows"]]
    refit = device_model.fit([m.row for m in rows])
    for k, v in doc["calibration"]["constants"].items():
        assert refit[k] == pytest.approx(v, rel=1e-3)
    # the next calibration of the generation counts on
    assert cal_mod.next_version(GEN, "device", cal_mod.known_paths(GEN)) == f"{GEN}-device-2"


def test_an_explicit_calibration_file_comes_before_the_users(its_cache, tmp_path, monkeypatch):
    other = tmp_path / "other.json"
    device_model.write(device_model.DeviceCalibration("explicit-1", GEN, dict(KNOWN)), str(other))
    monkeypatch.setenv(device_model.ENV, str(other))
    assert device_model.calibration_for(GEN)[1] == "explicit-1"
    monkeypatch.delenv(device_model.ENV)
    assert device_model.calibration_for(GEN)[1] == f"{GEN}-device-1"


def test_an_unreadable_user_calibration_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(device_model.ENV, raising=False)
    p = Path(cal_mod.user_calibration_path("v5e"))
    p.parent.mkdir(parents=True)
    p.write_text("{not json")
    with pytest.raises(ValueError, match=str(p)):
        device_model.calibration_for("v5e")


# ------------------------------------------------------------------ the compile backend's estimates
class FakeCompile:
    """A compile evaluator answering by probe (injected in the compile worker)."""
    name, method, version = "compile", "estimate", "fake"

    def evaluate(self, task):
        from rpa_tune.evaluators.base import EvalResult
        ctx = task.workload.kv_lens[0]
        if ctx == 512:
            return EvalResult("ok", "estimate", metric=2e-5, estimate_s=1.5e-5, audit="complete")
        if ctx == 1024:
            return EvalResult("ok", "estimate", metric=2e-5, estimate_s=1.5e-5, audit="incomplete",
                              message="trace misses the cached KV")
        return EvalResult("vmem_oom", "estimate", message="scoped_limit: used 1 of 0")


def make_evaluator(backend):
    return FakeCompile()


def test_static_estimates_come_from_the_compile_worker(monkeypatch):
    monkeypatch.setenv("RPA_TUNE_EVALUATOR_OVERRIDE", "test_calibrate:make_evaluator")
    monkeypatch.setenv("PYTHONPATH", TESTS + os.pathsep + os.environ.get("PYTHONPATH", ""))
    probes, _ = cal_mod.probe_set(GEN, ("tpu-inference",), seqs=2, decode=(512, 1024, 2048), prefill=())
    got = cal_mod.static_estimates(probes)
    assert got[probes[0].name] == (1.5e-5, "")
    assert got[probes[1].name][0] is None and "audit incomplete" in got[probes[1].name][1]
    assert got[probes[2].name][0] is None and "vmem_oom" in got[probes[2].name][1]


def test_the_full_probe_set():
    probes, skipped = cal_mod.probe_set(GEN)
    assert skipped == []
    names = [p.name for p in probes]
    for kn in ("tpu-inference", "rpa-tune"):
        assert [n for n in names if n.startswith(f"{kn}:decode/")] == [f"{kn}:decode/{c}" for c in
                                                                       (512, 1024, 2048, 4096, 8192, 16384, 32768)]
        assert [n for n in names if n.startswith(f"{kn}:prefill/")] == [f"{kn}:prefill/{c}" for c in
                                                                        (512, 1024, 2048, 4096, 8192)]
    for p in probes:
        assert p.limits.page_size == 256 and (p.model.num_q_heads, p.model.num_kv_heads, p.model.head_dim) == (16, 4, 128)
        ctx = int(p.name.rsplit("/", 1)[1])
        if p.case == "decode":
            assert p.workload.q_lens == (1,) * 128 and p.workload.kv_lens == (ctx,) * 128
        else:
            assert p.workload.q_lens == (ctx,) and p.workload.kv_lens == (ctx,)
    # a chip with one TensorCore runs the whole model's heads on it
    one, _ = cal_mod.probe_set("v6e")
    assert {(p.model.num_q_heads, p.model.num_kv_heads) for p in one} == {(32, 8)}


# ------------------------------------------------------------------ recorded rows
def write_fixture(path: Path) -> list:
    """The paper's rows' shape (the public kernel on TPU7x, 128 x 512 ... 32K decode, causal
    prefill 512 ... 8K, at its defaults), times from KNOWN constants with a noise of at most
    1 %; the workload in each form the format allows; one row marked not to be fitted."""
    probes, _ = cal_mod.probe_set(GEN, ("tpu-inference",))
    rows = []
    for p in probes:
        static = fake_tpu.recorded_static(p.task("compile", 60))
        t = device_model.device_time(static, cal_mod.probe_features(p), GEN, KNOWN)["time_s"]
        t *= 1 + 0.01 * (2 * zlib.crc32(p.name.encode()) / 2**32 - 1)
        rows.append(dict(name=p.name.split(":")[1], case=p.case, block_sizes=list(p.bs), measured_s=t, static_s=static,
                         seqs=len(p.workload.q_lens), q_lens=[p.workload.q_lens[0]], kv_lens=[p.workload.kv_lens[0]]))
    last = rows[-1]       # every sequence listed
    last["q_lens"], last["kv_lens"] = last["q_lens"] * last["seqs"], last["kv_lens"] * last["seqs"]
    del last["seqs"]
    first = rows[0]       # one pair's copies as a "workload"
    first["workload"] = dict(seqs=first.pop("seqs"), q_len=first.pop("q_lens")[0], kv_len=first.pop("kv_lens")[0])
    rows[len(rows) // 2]["fitted"] = False
    rows[len(rows) // 2]["measured_s"] *= 3       # (not fitted: it must not pull the fit)
    path.write_text(json.dumps(dict(source="test rows", generation=GEN, kernel="tpu-inference", page_size=256,
                                    model=dict(num_q_heads=16, num_kv_heads=4, head_dim=128), rows=rows)))
    return rows


def _cli(args, tmp: Path, **env):
    e = dict(os.environ, XDG_CACHE_HOME=str(tmp / "xdg"), COLUMNS="250", **env)
    e.pop("RPA_TUNE_FAKE_TPU", None)
    e.pop(device_model.ENV, None)
    return subprocess.run([RPA_TUNE, "calibrate", *args], capture_output=True, text=True, env=e, timeout=300)


def test_from_fixture_fits_the_recorded_rows_and_reports_them(tmp_path):
    fx = tmp_path / "fx.json"
    rows = write_fixture(fx)
    r = _cli(["--from-fixture", str(fx), "--json"], tmp_path)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    c = doc["calibration"]["constants"]
    for k in KNOWN:
        assert c[k] == pytest.approx(KNOWN[k], rel=0.1), (k, c)
    assert [x["name"] for x in doc["rows"]] == [x["name"] for x in rows]
    fitted = [x for x in doc["rows"] if x["fitted"]]
    assert len(fitted) == len(rows) - 1 == doc["calibration"]["fitted_rows"]
    assert max(abs(x["leave_one_out_error"]) for x in fitted) < 0.05
    (off,) = [x for x in doc["rows"] if not x["fitted"]]
    assert off["leave_one_out_error"] is None and off["fit_error"] == pytest.approx(1 / 3 - 1, abs=0.02)
    assert doc["calibration"]["version"] == f"{GEN}-fixture-1" and doc["written"] == []
    assert not (tmp_path / "xdg").exists()
    # the report: every constant with its meaning, every row with its errors
    r = _cli(["--from-fixture", str(fx), "--out", str(tmp_path / "c.json"), "--version", "t-1"], tmp_path)
    assert r.returncode == 0, r.stderr
    for k in device_model.CONSTANTS:
        assert k in r.stdout and device_model.MEANING[k][:40] in r.stdout
    for x in rows:
        assert x["name"] in r.stdout
    assert "leave-one-out" in r.stdout and "modelled" in r.stdout and "estimate" in r.stdout
    assert json.loads((tmp_path / "c.json").read_text())["generations"][GEN]["version"] == "t-1"
    assert f"RPA_TUNE_DEVICE_CALIBRATION={tmp_path / 'c.json'}" in r.stdout


@pytest.mark.skipif(not PAPER_FIXTURE.exists(), reason="the paper's rows are not recorded yet")
def test_the_papers_rows_refit_to_the_shipped_calibration():
    """The package's TPU7x calibration is the fit of the paper's rows: calibrate on the
    recorded fixture gives its constants again."""
    import importlib.resources
    gen, _, rows = cal_mod.load_fixture(str(PAPER_FIXTURE))
    assert gen == GEN and all(len(m.row.feats.__dict__) for m in rows)
    decode = [m for m in rows if m.case == "decode"]
    assert decode and all(m.row.feats.qblocks == 128 for m in decode)      # 128 sequences each
    rep = cal_mod.fit_rows(rows, "check", "paper")
    shipped = json.loads(importlib.resources.files("rpa_tune.data").joinpath(device_model.DATA_FILE).read_text())
    c = shipped["generations"][GEN]["constants"]
    for k in device_model.CONSTANTS:
        assert rep.calibration.constants[k] == pytest.approx(c[k], rel=1e-3, abs=1e-9), k


# ------------------------------------------------------------------ bad input
def test_bad_input_is_one_line(tmp_path):
    fx = tmp_path / "fx.json"
    write_fixture(fx)
    assert_one_error_line(_cli(["--tpu", "v9", "--backend", "tpu"], tmp_path), ["'v9'", "tpu7x"])
    assert_one_error_line(_cli(["--from-fixture", str(tmp_path / "none.json")], tmp_path), ["none.json", "no such"])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"generation": "v9", "rows": []}))
    assert_one_error_line(_cli(["--from-fixture", str(bad)], tmp_path), ["bad.json", "v9"])
    assert_one_error_line(_cli(["--from-fixture", str(fx), "--tpu", "v6e"], tmp_path), ["v6e", "tpu7x"])
    assert_one_error_line(_cli(["--tpu", GEN, "--backend", "compile"], tmp_path), ["'compile'", "valid: tpu"])
    assert_one_error_line(_cli(["--tpu", GEN, "--version", "a b", "--from-fixture", str(fx)], tmp_path), ["'a b'"])
    # no TPU here, no stand-in: refused before anything runs or is written
    if not cal_mod_tpu_here():
        assert_one_error_line(_cli(["--tpu", GEN, "--backend", "tpu"], tmp_path), ["needs a TPU tpu7x", "no TPU"])
    assert not (tmp_path / "xdg").exists()


def cal_mod_tpu_here() -> bool:
    from rpa_tune.evaluators import tpu
    return bool(tpu._accelerator_nodes())
