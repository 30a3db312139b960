"""``benchmarks/coverage_check.py``'s rule for an exhaustive grid a newer evaluator version is
pricing again: until every config is re-priced, the grid is no landscape (the exhaustive
check calls it pending, ``benchmarks/search_replay.py`` skips it)."""
import json
import sys
from pathlib import Path

import pandas as pd

from rpa_tune import coverage
from rpa_tune.store import ResultStore

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.coverage_check import chosen, configs, repriced_in_part, rows_of, sample  # noqa: E402

GRID = REPO / "tests" / "fixtures" / "exhaustive_grid.parquet"      # tests/fixtures/make_fixtures.py


def _one_grid():
    """A finished exhaustive grid of a sampled key (a fixture cut from the shipped check),
    as priced by today's evaluator version of its key: its key and its rows."""
    from benchmarks.coverage_check import current_version
    from rpa_tune.store import read_results_table
    rows = read_results_table([GRID]).table.to_pandas()
    (key_id,) = set(rows["key_id"])
    key = {k.id(): k for k in sample(0.05, 0)}[key_id]
    assert configs(rows) >= 4
    rows["evaluator_version"] = current_version(key)     # the rules under test, not the version, matter
    return key, rows


def _reprice(rows, n, when):
    """The first ``n`` configs of ``rows`` priced again by a newer evaluator version."""
    again = rows.sort_values(["bq", "bkv", "cq", "ckv"]).head(n).copy()
    again["evaluator_version"] = again["evaluator_version"].astype(str) + "-next"
    again["timestamp"] = when
    return again


def _records(df):
    """Store rows from a DataFrame (its missing values as None, not NaN)."""
    return df.astype(object).where(df.notna(), None).to_dict("records")


def test_a_grid_priced_again_in_part_is_named_until_every_config_is(tmp_path):
    key, rows = _one_grid()
    store = ResultStore(tmp_path)
    store.append(_records(rows))
    assert repriced_in_part(tmp_path, [key]) == set()          # one version throughout: a landscape

    n = len(rows)
    later = pd.Timestamp(rows["timestamp"].max()) + pd.Timedelta(hours=1)
    store.append(_records(_reprice(rows, n // 2, later)))
    assert repriced_in_part(tmp_path, [key]) == {key.id()}     # half the grid under the new version

    rest = rows.sort_values(["bq", "bkv", "cq", "ckv"]).iloc[n // 2:]
    store.append(_records(_reprice(rest, len(rest), later)))
    assert repriced_in_part(tmp_path, [key]) == set()          # all of it: a landscape again


def test_a_missing_results_directory_has_no_partial_grid(tmp_path):
    assert repriced_in_part(tmp_path / "absent", list(coverage.expected_keys())[:3]) == set()


def test_run_picks_the_sampled_keys_of_the_case_and_the_text_given():
    keys = sample(0.05, 0)
    target = next(k for k in keys if k.case == "prefill")
    assert chosen(keys, None, [target.id()]) == [target]
    decode = chosen(keys, ["decode"])
    assert decode and all(k.case == "decode" for k in decode)
    assert len(decode) < len(keys)
    # the filters combine: the prefill key's id with --case decode picks nothing
    assert chosen(keys, ["decode"], [target.id()]) == []
    # a text names every sampled key of one generation, in the sample's order
    v5p = chosen(keys, None, ["v5p/"])
    assert v5p == [k for k in keys if k.generation == "v5p"] and v5p
    assert chosen(keys) == keys


def test_a_key_text_in_no_sampled_key_is_refused_with_one_line(tmp_path, monkeypatch, capsys):
    from benchmarks import coverage_check
    out = tmp_path / "check.md"
    monkeypatch.setattr(sys, "argv", ["coverage_check.py", "--run", "--key", "v9x/nosuch",
                                      "--generated", str(tmp_path / "none"), "--results", str(tmp_path / "ex"),
                                      "--out", str(out)])
    assert coverage_check.main() == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'v9x/nosuch'" in err[0]
    assert not out.exists() and not (tmp_path / "ex").exists()     # nothing swept, nothing written


def test_the_report_counts_the_grid_configs_it_could_not_price(tmp_path, monkeypatch):
    """A grid config the exhaustive sweep tried but could not price (past the memory cap,
    audit incomplete) is in the grid's size, not among its priced configs."""
    from benchmarks import coverage_check
    key, rows = _one_grid()
    priced = rows_of(rows, key)
    n = configs(priced)
    gen = ResultStore(tmp_path / "gen")
    gen.append(_records(priced))                       # the budgeted search found the same best
    unpriced = priced.head(1).copy()
    unpriced["bq"] = int(unpriced["bq"].iloc[0]) * 1024    # a config the grid does not hold yet
    unpriced["metric"] = float("nan")                  # ok, but its audit incomplete: no price
    ex = ResultStore(tmp_path / "ex")
    ex.append(_records(priced))
    ex.append(_records(unpriced))
    (tmp_path / "ex" / "complete.json").write_text(json.dumps([key.id()]))
    out = tmp_path / "check.md"
    monkeypatch.setattr(sys, "argv", ["coverage_check.py", "--generated", str(tmp_path / "gen"),
                                      "--results", str(tmp_path / "ex"), "--out", str(out)])
    assert coverage_check.main() == 0
    row = next(line for line in out.read_text().splitlines() if line.startswith(f"| {key.id()} |"))
    assert row.split(" | ")[1] == f"{n + 1} ({n})"
    assert row.endswith("| +0.00% |")


def test_a_last_bit_below_the_grid_best_is_no_negative_gap(tmp_path, monkeypatch):
    """The same config priced by the budgeted search and by the grid can differ in the last
    bit of its estimate (the least-squares fit's rounding): the gap prints as +0.00%, not -0.00%."""
    import numpy as np
    from benchmarks import coverage_check
    key, rows = _one_grid()
    priced = rows_of(rows, key)
    ex = ResultStore(tmp_path / "ex")
    ex.append(_records(priced))
    (tmp_path / "ex" / "complete.json").write_text(json.dumps([key.id()]))
    best = priced.loc[[priced["metric"].idxmin()]].copy()
    best["metric"] = np.nextafter(float(best["metric"].iloc[0]), 0.0)     # one bit below the grid's
    ResultStore(tmp_path / "gen").append(_records(best))
    out = tmp_path / "check.md"
    monkeypatch.setattr(sys, "argv", ["coverage_check.py", "--generated", str(tmp_path / "gen"),
                                      "--results", str(tmp_path / "ex"), "--out", str(out)])
    assert coverage_check.main() == 0
    row = next(line for line in out.read_text().splitlines() if line.startswith(f"| {key.id()} |"))
    assert row.endswith("| +0.00% |")


def test_a_grid_priced_again_under_a_new_workload_is_pending_not_compared(tmp_path, monkeypatch):
    """A new evaluator version that also changes the workload (a new mixed workload) starts a
    group of its own: ``read_current`` keeps the older grid's rows beside it. Until every
    config is priced again the key is pending, not a gap between two workloads."""
    from benchmarks import coverage_check
    key, rows = _one_grid()
    later = pd.Timestamp(rows["timestamp"].max()) + pd.Timedelta(hours=1)
    half = _reprice(rows, len(rows) // 2, later)
    half["workload_id"] = half["workload_id"].astype(str) + "-new"
    half["metric"] = half["metric"] * 1.5              # another landscape: its best is not the old one
    ex = ResultStore(tmp_path / "ex")
    ex.append(_records(rows))
    ex.append(_records(half))
    (tmp_path / "ex" / "complete.json").write_text(json.dumps([key.id()]))
    assert repriced_in_part(tmp_path / "ex", [key]) == {key.id()}
    gen = ResultStore(tmp_path / "gen")
    gen.append(_records(rows_of(half, key)))           # the generation priced the new workload
    out = tmp_path / "check.md"
    monkeypatch.setattr(sys, "argv", ["coverage_check.py", "--generated", str(tmp_path / "gen"),
                                      "--results", str(tmp_path / "ex"), "--out", str(out)])
    assert coverage_check.main() == 0
    text = out.read_text()
    assert not any(line.startswith(f"| {key.id()} |") for line in text.splitlines())
    pending = next(line for line in text.splitlines() if line.startswith("Pending ("))
    assert key.id() in pending


def test_run_gives_each_sweep_the_probe_cache_named(tmp_path, monkeypatch):
    """``--run`` sweeps a sampled key with the probe cache the check names (by default the
    sweep's own: ``$RPA_TUNE_PROBE_CACHE`` or the user's cache directory, never one in the
    repository), the key's own token bucket, and marks the grid complete when it finishes."""
    from benchmarks import coverage_check
    key, rows = _one_grid()
    gen = ResultStore(tmp_path / "gen")
    gen.append(_records(rows_of(rows, key)))            # the generation has reached the key
    calls = []

    def fake_run(cmd, **kw):
        calls.append((cmd, kw))
        return type("Done", (), {"returncode": 0})()

    monkeypatch.setattr(coverage_check.subprocess, "run", fake_run)
    monkeypatch.delenv("RPA_TUNE_PROBE_CACHE", raising=False)
    assert "RPA_TUNE_PROBE_CACHE" not in coverage_check.probe_cache_env(None)      # the sweep's default
    monkeypatch.setenv("RPA_TUNE_PROBE_CACHE", str(tmp_path / "env-cache"))
    assert coverage_check.probe_cache_env(None)["RPA_TUNE_PROBE_CACHE"] == str(tmp_path / "env-cache")
    ex = tmp_path / "ex"
    monkeypatch.setattr(sys, "argv", ["coverage_check.py", "--run", "--key", key.id(), "--generated",
                                      str(tmp_path / "gen"), "--results", str(ex), "--out", str(tmp_path / "c.md"),
                                      "--probe-cache", str(tmp_path / "probes")])
    assert coverage_check.main() == 0
    assert len(calls) == 1
    cmd, kw = calls[0]
    assert kw["env"]["RPA_TUNE_PROBE_CACHE"] == str(tmp_path / "probes")
    assert cmd[cmd.index("--buckets") + 1] == str(key.max_num_tokens)
    assert cmd[cmd.index("--results") + 1] == str(ex)
    assert json.loads((ex / "complete.json").read_text()) == [key.id()]
