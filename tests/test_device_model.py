"""The device-cost model (rpa_tune/estimator/device_model.py): its fit recovers known constants,
the shipped TPU7x calibration is the fit of the paper fixture, a modelled price is never an
estimate, and recorded rows are re-priced under a new calibration without a compile."""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest

from rpa_tune import store
from rpa_tune.estimator import device_model as dm

KNOWN = {"hbm_efficiency": 0.9, "mxu_efficiency": 0.35, "t_call_s": 8e-6, "t_qblock_s": 0.5e-6}


def _rows(noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for i, ctx in enumerate((512, 1024, 2048, 4096, 8192, 16384)):       # memory-bound decode, estimated
        f = dm.Features(128, 128, 128 * ctx // 256, 128 * ctx * 2048.0, 1e9)
        static = f.hbm_bytes / 3.7e12 * 1.02 if i > 3 else None
        t = dm.device_time(static, f, "tpu7x", KNOWN)["time_s"] * (1 + noise * rng.standard_normal())
        rows.append(dm.Row(f"decode/{ctx}", "tpu7x", t, static, f))
    for s in (1024, 2048, 4096, 8192, 16384):                              # compute-bound prefill, modelled
        f = dm.Features(s // 512, s // 512 * 2, 0, 1e6, 4.0 * s * s / 2 * 128 * 16)
        t = dm.device_time(None, f, "tpu7x", KNOWN)["time_s"] * (1 + noise * rng.standard_normal())
        rows.append(dm.Row(f"prefill/{s}", "tpu7x", t, None, f))
    return rows


def test_fit_recovers_known_constants():
    got = dm.fit(_rows())
    for k, v in KNOWN.items():
        assert got[k] == pytest.approx(v, rel=0.03), k


def test_leave_one_out_small_with_noise_and_large_when_constants_are_wrong():
    rows = _rows(noise=0.01)
    loo = dm.leave_one_out(rows)
    assert max(abs(v) for v in loo.values()) < 0.06
    wrong = dict(KNOWN, t_call_s=40e-6)
    assert max(abs(v) for v in dm.errors(rows, wrong).values()) > 0.2


def test_modelled_is_never_an_estimate():
    f = dm.Features(4, 8, 0, 1e6, 1e12)
    assert dm.device_time(None, f, "tpu7x", KNOWN)["label"] == dm.MODELLED
    assert dm.device_time(1e-3, f, "tpu7x", KNOWN)["label"] == dm.ESTIMATE
    assert dm.price(None, f, "tpu7x")["label"] == dm.MODELLED
    from kernel.tables.schema import METHODS
    assert dm.MODELLED in METHODS and dm.ESTIMATE in METHODS


def test_shipped_tpu7x_calibration_is_the_fit_of_the_paper_fixture():
    import importlib.resources
    import sys
    sys.path.insert(0, str(importlib.resources.files("rpa_tune").parent / "benchmarks"))
    import fidelity
    fixture = json.loads(importlib.resources.files("rpa_tune.data").joinpath("paper_tpu7x_rpa_v3.json").read_text())
    fit = fidelity.calibrate_on_paper(fixture["rows"])
    shipped, version = dm.calibration_for("tpu7x")
    assert version == shipped.version == fit["calibration"].version
    for k in dm.CONSTANTS:
        assert fit["calibration"].constants[k] == pytest.approx(shipped.constants[k], rel=1e-3), k
    # the decode rows, priced by the profiler: leave-one-out within 15 %
    assert all(abs(v) <= 0.15 for k, v in fit["calibration"].leave_one_out.items() if k.startswith("decode/"))


def _table(rows):
    cols = {name: [] for name in store.COLUMNS}
    for r in rows:
        for name in store.COLUMNS:
            cols[name].append(r.get(name))
    return pa.Table.from_pydict(cols, schema=store.SCHEMA)


def _row(static, qblocks, calibration, metric, **kw):
    return dict(generation="tpu7x", key_id="k", kernel="rpa-tune", workload_id="w", status="ok", method="estimate",
                estimate_s=static, static_s=static, metric=metric, calibration=calibration, walk_qblocks=qblocks,
                walk_steps=qblocks, walk_pages=0, walk_hbm_bytes=1.0, walk_mxu_flops=1.0, **kw)


def test_recorded_rows_are_repriced_without_a_compile():
    cal, version = dm.calibration_for("tpu7x")
    # A: faster static estimate, many q blocks; B: slower, few. Under no calibration A wins;
    # the calibrated per-q-block cost makes B win.
    a = _row(100e-6, 1000, "old-0", 100e-6, bq=1)
    b = _row(150e-6, 10, "old-0", 150e-6, bq=2)
    t = store.reprice(_table([a, b]))
    got = t.select(["bq", "metric", "calibration"]).to_pylist()
    assert {r["calibration"] for r in got} == {version}
    want = {r["bq"]: dm.device_time(r["estimate_s"], dm.Features(r["walk_qblocks"], r["walk_steps"], 0, 1.0, 1.0),
                                    "tpu7x", cal.constants)["time_s"] for r in (a, b)}
    assert {r["bq"]: r["metric"] for r in got} == pytest.approx(want)
    assert min(got, key=lambda r: r["metric"])["bq"] == 2


def test_a_group_with_an_unfeatured_row_reads_static():
    legacy = _row(120e-6, None, None, 120e-6, bq=1)
    legacy.update(walk_steps=None)
    new = _row(150e-6, 10, "old-0", 999.0, bq=2)
    got = store.reprice(_table([legacy, new])).select(["bq", "metric", "calibration"]).to_pylist()
    assert [r["calibration"] for r in got] == ["none", "none"]
    assert {r["bq"]: r["metric"] for r in got} == {1: 120e-6, 2: 150e-6}
