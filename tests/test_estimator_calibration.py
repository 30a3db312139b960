"""The shipped static-profiler calibration (rpa_tune/data/calibration.json) and its probes."""
import math

import pytest

from kernel.hardware import tpu_info
from rpa_tune.estimator import calibration as cal

GENS = ("v4", "v5e", "v5p", "v6e", "tpu7x")


@pytest.mark.parametrize("gen", GENS)
def test_shipped_calibration_loads(gen):
    c = cal.calibration(gen)
    assert c.generation == gen
    assert c.profiler_supported == (gen != "v4")
    assert c.versions.get("libtpu") and c.versions.get("jax")


@pytest.mark.parametrize("gen", GENS)
def test_shipped_calibration_is_physically_consistent(gen):
    c = cal.calibration(gen)
    info = tpu_info(gen)
    cols = info.mxu_column_size
    assert c.mxu_column_size == cols
    # clock: JAX's peak over the modelled peak, and a plausible TPU clock
    assert c.peak_flop_per_cycle == c.mxu_equivalents * 2 * cols ** 2
    assert c.clock_hz == pytest.approx(info.bf16_ops_per_second / c.peak_flop_per_cycle)
    assert 0.5e9 <= c.clock_hz <= 3e9
    assert c.seconds(c.clock_hz) == pytest.approx(1.0)
    # the instruction and DMA units
    assert c.flops_per_vmatmul > 0 and c.flops_per_vmatmul % (2 * cols * cols) == 0
    g = c.dma_granule_bytes
    assert g == int(g) and int(g) & (int(g) - 1) == 0
    assert c.mxu_units_in_trace >= 1
    if not c.profiler_supported:
        assert c.mxu_flop_per_cycle is None and c.hbm_bytes_per_cycle is None
        return
    # the profiler's MXU rate is below its modelled peak, and close to it
    assert 0.75 * c.peak_flop_per_cycle <= c.mxu_flop_per_cycle <= c.peak_flop_per_cycle
    # HBM: one DMA stream at the derived clock within 2x of JAX's bandwidth
    bw = c.hbm_bytes_per_cycle * c.clock_hz
    assert bw == pytest.approx(c.hbm_bw_bytes_per_second)
    assert 0.5 <= bw / info.mem_bw_bytes_per_second <= 2.0
    assert c.dma_latency_cycles > 0
    # the profiler does not cap concurrent DMAs: 2 in flight beat 1, 8 beat 2
    assert c.hbm_bytes_per_cycle < c.hbm_bytes_per_cycle_double_buffered
    assert c.dma_concurrency_speedup_8 > 2
    # contraction depth 128: full rate on 128-wide MXUs, about half on 256-wide ones
    assert 0 < c.k128_efficiency <= 1.05 and 0 < c.n128_efficiency <= 1.05
    if cols == 128:
        assert c.k128_efficiency > 0.9
    else:
        assert c.k128_efficiency < 0.6


def test_clock_of_the_profiled_generations_follows_the_matmul_rate():
    # the derived clock is JAX's peak over ceil(rate / (2 cols^2)) arrays: consistent with
    # the raw probe cycles shipped in the same file.
    for gen in GENS[1:]:
        c = cal.calibration(gen)
        runs = c.raw["probes"]["matmul"]["runs"]
        rate = (runs[1]["flops"] - runs[0]["flops"]) / (runs[1]["cycles"] - runs[0]["cycles"])
        assert rate == pytest.approx(c.mxu_flop_per_cycle)
        assert c.mxu_equivalents == math.ceil(rate / (2 * c.mxu_column_size ** 2) - 0.02)


def test_aliases_resolve():
    assert cal.calibration("v7x").generation == "tpu7x"
    assert cal.calibration("TPU v6 lite").generation == "v6e"


def test_unknown_generation_raises_naming_it():
    with pytest.raises(ValueError, match="v9x"):
        cal.calibration("v9x")


def test_missing_entry_raises_naming_it(monkeypatch):
    monkeypatch.setattr(cal, "load_all", lambda: {"generations": {}})
    with pytest.raises(ValueError, match="v5e"):
        cal.calibration("v5e")


def test_table_formats_every_generation():
    text = cal.format_table(cal.load_all()["generations"])
    for gen in GENS:
        assert gen in text.splitlines()[0]
    assert "derived clock" in text


@pytest.mark.slow
def test_remeasure_v6e_matches_shipped():
    shipped = cal.calibration("v6e")
    fresh = cal.Calibration.from_entry(cal.measure("v6e"))
    for field in ("clock_hz", "mxu_flop_per_cycle", "peak_flop_per_cycle", "flops_per_vmatmul",
                  "k128_efficiency", "n128_efficiency", "hbm_bytes_per_cycle", "dma_latency_cycles",
                  "hbm_bytes_per_cycle_double_buffered", "dma_granule_bytes"):
        assert getattr(fresh, field) == pytest.approx(getattr(shipped, field), rel=0.02), field
    assert fresh.mxu_equivalents == shipped.mxu_equivalents
