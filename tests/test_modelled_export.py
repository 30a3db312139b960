"""Modelled prices (issue 101 item 5) through export, show and the sweep's version: a key is
ranked by one method, a modelled entry is written as modelled, never as an estimate."""
import pandas as pd
import pytest

from kernel.tables import Table
from rpa_tune import coverage
from rpa_tune import export as ex
from tables_synth import key, row, write_results


def _rows(k, method, metrics, **kw):
    """The heuristic and two other configs of ``k`` priced ``method``: ``metrics`` in that order."""
    h = tuple(ex.heuristic_for(k))
    cands = ([(1, 2048, 1, 512), (2, 512, 2, 512), (1, 4096, 1, 1024), (1, 256, 1, 256)] if k.case == "decode" else
             [(128, 1024, 64, 512), (64, 512, 64, 256), (32, 256, 32, 128), (256, 2048, 128, 512)])
    others = [c for c in cands if c != h]
    kw.setdefault("backend", "compile")
    return [row(k, bs, m, method=method, **kw) for bs, m in zip([h] + others, metrics)]


def _entries(rows):
    tables, reports = ex.build_tables(ex.normalize_results(pd.DataFrame(rows)))
    return {r.key: r.entry for r in reports if r.key is not None}


@pytest.mark.parametrize("gain", [0.01, 0.5])
def test_a_modelled_gain_never_promotes_but_a_failing_heuristic_does(gain):
    """A modelled entry is written as modelled; its gain over the heuristic does not promote it
    (modelled prices rank block sizes poorly), the compiler's verdict on the heuristic does."""
    k = key("tpu7x", "prefill", t=512)
    rows = _rows(k, "modelled", [2e-4, 2e-4 / (1 + gain), 3e-4])
    (e,) = _entries(rows).values()
    assert e.method == "modelled" and not e.promoted and e.gain == pytest.approx(gain, rel=1e-5)
    assert ("of a modelled price" in e.decision) == (gain > ex.ESTIMATE_MIN_GAIN), e.decision
    assert "estimates are refused" not in e.decision
    rows[0].update(status="vmem_oom", metric=None)
    (e,) = _entries(rows).values()
    assert e.method == "modelled" and e.promoted and "the heuristic" in e.decision and "failed" in e.decision
    assert tuple(e.block_sizes) == (rows[1]["bq"], rows[1]["bkv"], rows[1]["cq"], rows[1]["ckv"])


def test_a_key_is_ranked_by_one_method_the_compile_backends_of_today():
    """Modelled and estimate rows of one key are never compared: TPU7x prefill (no estimate
    possible) takes its modelled rows although the estimates are more recent and cheaper;
    v6e decode takes its estimates over modelled rows."""
    rows, want = [], {}
    for k, today in ((key("tpu7x", "prefill", t=512), "modelled"), (key("v6e", "decode", t=512), "estimate")):
        assert coverage.compile_method(k.generation, k.case) == today
        est = _rows(k, "estimate", [1e-4, 0.5e-4, 0.9e-4], kernel_hash="k0", timestamp="2026-01-02T00:00:00Z")
        mod = _rows(k, "modelled", [3e-4, 2e-4, 2.5e-4], kernel_hash="k1", timestamp="2026-01-01T00:00:00Z")
        rows += est + mod
        want[k] = (today, est if today == "estimate" else mod)
    got = _entries(rows)
    for k, (method, rs) in want.items():
        e = got[k]
        best = min(rs, key=lambda r: r["metric"])
        assert e.method == method and e.metric == best["metric"], (k.id(), e)
        assert (e.heuristic_metric, e.provenance["kernel_hash"]) == (rs[0]["metric"], rs[0]["kernel_hash"])


def test_export_writes_modelled_entries_to_the_files(tmp_path):
    from typer.testing import CliRunner

    from rpa_tune.cli import app
    k = key("v4", "decode", t=128)
    rows = _rows(k, "modelled", [2e-4, 1e-4, 3e-4])
    rows[0].update(status="vmem_oom", metric=None)
    write_results(tmp_path / "res", rows)
    r = CliRunner().invoke(app, ["export", "--results", str(tmp_path / "res"), "--out", str(tmp_path / "out")])
    assert r.exit_code == 0, r.output
    for f in ("v4.json", "v4.parquet"):
        (e,) = Table.read(tmp_path / "out" / f).entries
        assert e.method == "modelled" and e.promoted and e.metric == pytest.approx(1e-4)
    assert '"method": "modelled"' in (tmp_path / "out" / "v4.json").read_text()


def test_show_and_the_sweep_summary_say_modelled(tmp_path, monkeypatch):
    """``rpa-tune show`` labels a modelled winner's backend; the evaluator version of a
    modelled key differs from the estimate's of the same case (no shared resume id)."""
    from typer.testing import CliRunner

    from rpa_tune.cli import app
    from rpa_tune.evaluators import evaluator_version
    from rpa_tune.store import COLUMNS
    k = key("v4", "decode", t=128)
    rows = _rows(k, "modelled", [2e-4, 1e-4, 3e-4], workload="decode: synthetic", evaluator_version="x")
    df = pd.DataFrame([{c: r.get(c) for c in COLUMNS} for r in rows])
    df["timestamp"] = pd.to_datetime(df["timestamp"])
    df["is_heuristic"] = [True, False, False]
    write_results(tmp_path / "res", df.to_dict("records"))
    from rich.console import Console

    from rpa_tune import ui
    monkeypatch.setattr(ui, "out", Console(width=1000, highlight=False))   # (the module's console: any terminal)
    r = CliRunner().invoke(app, ["show", "--results", str(tmp_path / "res")])
    assert r.exit_code == 0, r.output
    assert "compile (modelled)" in r.output, r.output
    assert evaluator_version("compile", "decode", "v4").endswith("+modelled1")
    assert evaluator_version("compile", "prefill", "tpu7x") == evaluator_version("compile", "prefill", "v5p").replace(
        "+v5p1", "+tpu7x1") + "+modelled1"
    assert "modelled" not in evaluator_version("compile", "decode", "tpu7x")


def test_show_does_not_rank_a_keys_earlier_estimates_beside_its_modelled_prices():
    """TPU7x prefill keys hold estimates of an earlier evaluator version (cheaper, since the
    profiler hid their cached-KV work) and, once swept again, modelled prices: ``show``
    ranks the newest version's rows only, as export does."""
    from rpa_tune.report import winners
    from rpa_tune.store import COLUMNS
    k = key("tpu7x", "prefill", t=128)
    old = _rows(k, "estimate", [1e-5, 0.6e-5, 0.8e-5], evaluator_version="compile-5", timestamp="2026-01-01T00:00:00Z")
    new = _rows(k, "modelled", [3e-5, 2e-5, 2.5e-5], evaluator_version="compile-7+tpu7x1+modelled1",
                timestamp="2026-01-02T00:00:00Z")
    for i, r in enumerate(old + new):
        r.update(is_heuristic=i % 3 == 0, workload="prefill: synthetic", config_id=f"c{i}")
    df = pd.DataFrame([{c: r.get(c) for c in COLUMNS} for r in old + new])
    df["timestamp"] = pd.to_datetime(df["timestamp"])
    (g,) = winners(df, top=6)
    assert [r["method"] for r in g.rows] == ["modelled"] * 3 and g.best["metric"] == 2e-5
    assert g.heuristic["metric"] == 3e-5
