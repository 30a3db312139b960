"""The TPU evaluator's device path, exercised on CPU (no device): what it records and how
export reads it (issue #102, item 1)."""
import numpy as np
import pytest

from rpa_tune import export as ex
from rpa_tune.evaluators import tpu
from tables_synth import key, row


def _measured_row(k, bs, median_s, rel_iqr, n=200, seed=0):
    """The row the TPU evaluator writes for ``n`` device samples around ``median_s`` whose
    interquartile range is about ``rel_iqr`` of it (its own statistics, its own EvalResult)."""
    rng = np.random.default_rng(seed)
    # a normal's IQR is 1.349 sigma
    times = median_s * (1 + rng.standard_normal(n) * rel_iqr / 1.349)
    res = tpu.timed_result(tpu.summarize_times(times), how="device time (test)")
    assert res.method == "measured" and res.spread == pytest.approx(rel_iqr, rel=0.3)
    return row(k, bs, res.metric, method=res.method, spread=res.spread, samples=res.samples)


def _select(rows, k):
    import pandas as pd
    _, reports = ex.build_tables(ex.normalize_results(pd.DataFrame(rows)))
    (rep,) = [r for r in reports if r.key == k]
    return rep.entry


@pytest.mark.parametrize("gain, rel_spread, promoted", [(0.10, 0.01, True), (0.01, 0.02, False)])
def test_export_promotes_a_device_timed_win_by_its_relative_spread(gain, rel_spread, promoted):
    k = key()
    h = tuple(ex.heuristic_for(k))
    other = next(c for c in [(1, 2048, 1, 512), (1, 512, 1, 512)] if c != h) if k.case == "decode" else \
        next(c for c in [(128, 1024, 64, 512), (64, 512, 64, 256)] if c != h)
    base = 500e-6
    rows = [_measured_row(k, h, base, rel_spread, seed=1),
            _measured_row(k, other, base / (1 + gain), rel_spread, seed=2)]
    e = _select(rows, k)
    assert e.method == "measured" and tuple(e.block_sizes) == other
    assert e.promoted is promoted, e.decision
    # the margin is twice the larger relative spread (floor 1 %), not a ratio of ratios
    assert 0.01 <= e.margin <= 2 * rel_spread * 1.3 + 1e-9
    assert e.spread < 0.1            # a fraction of the metric


def test_estimate_rows_keep_no_spread():
    k = key()
    h = tuple(ex.heuristic_for(k))
    e = _select([row(k, h, 1e-4, spread=None, samples=None)], k)
    assert e.spread == 0.0 and e.samples == 1
