"""benchmarks/fidelity.py: the rows, ratios and growths it builds from recorded prices (no
compile), and a row that cannot be priced kept with its reason."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

# a small recorded fixture: measured µs per context, and prices as ``fidelity.price`` returns them
MEASURED = {512: 100.0, 1024: 150.0, 2048: 300.0, 4096: 500.0}
ABORT = "profiler abort: \"No DMA issue node found for sync flag\""


def _ok(us, bs=(1, 512, 1, 512), src="default", split=None):
    d = dict(status="ok", time_us=us, block_sizes=list(bs), config_source=src, audit="complete", reasons=[])
    if split is not None:
        d["split_time_us"] = split
    return d


PRICED = {
    512: {"tpu-inference": _ok(80.0, split=41.0), "rpa-tune": _ok(40.0, src="table", split=21.0)},
    1024: {"tpu-inference": _ok(200.0, split=101.0), "rpa-tune": _ok(100.0, src="table", split=51.0)},
    2048: {"tpu-inference": dict(status="crash", reason=ABORT, block_sizes=[1, 2048, 1, 2048]),
           "rpa-tune": _ok(240.0, src="heuristic", split=121.0)},
    4096: {"tpu-inference": _ok(1000.0, split=501.0), "rpa-tune": _ok(600.0, src="heuristic", split=301.0)},
}


def test_ratios_and_growth_follow_the_recorded_figures():
    import fidelity
    rows = fidelity.build_rows(MEASURED, PRICED)
    assert [r["context"] for r in rows] == [512, 1024, 2048, 4096]
    first, second = rows[0], rows[1]
    assert abs(first["estimate_over_measured"] - 80 / 100) < 1e-12
    assert abs(first["ours_over_public"] - 40 / 80) < 1e-12
    assert first["measured_growth"] is None and first["estimated_growth"] is None     # no row before it
    assert abs(second["measured_growth"] - 150 / 100) < 1e-12
    assert abs(second["estimated_growth"] - 200 / 80) < 1e-12
    assert abs(second["growth_ratio"] - (200 / 80) / (150 / 100)) < 1e-12
    assert abs(second["ours_growth"] - 100 / 40) < 1e-12


def test_an_unpriced_row_is_kept_with_its_reason_and_breaks_only_its_growths():
    import fidelity
    rows = fidelity.build_rows(MEASURED, PRICED)
    bad, after = rows[2], rows[3]
    assert bad["public_us"] is None and bad["estimate_over_measured"] is None and bad["ours_over_public"] is None
    assert bad["public"]["reason"] == ABORT
    assert abs(bad["measured_growth"] - 2.0) < 1e-12            # the measurement's growth is still shown
    assert bad["estimated_growth"] is None and bad["growth_ratio"] is None
    assert abs(bad["ours_growth"] - 240 / 100) < 1e-12          # ours was priced at both rows
    # the row after it has no estimated growth either (its previous row has no estimate)
    assert after["estimated_growth"] is None and abs(after["measured_growth"] - 500 / 300) < 1e-12
    assert abs(after["estimate_over_measured"] - 1000 / 500) < 1e-12
    text = "\n".join(fidelity.render_case("decode", rows))
    row_line = next(l for l in text.splitlines() if l.startswith("| 2,048 |"))
    assert "not priced" in row_line
    assert f"- decode 2,048, public (1, 2048, 1, 2048): not priced: crash: {ABORT}" in text


def test_a_context_without_prices_is_listed_not_dropped():
    import fidelity
    rows = fidelity.build_rows({**MEASURED, 8192: 900.0}, PRICED)
    assert rows[-1]["context"] == 8192 and rows[-1]["public"]["status"] == "missing"
    assert "- decode 8,192, public : not priced: missing: not priced" in "\n".join(fidelity.render_case("decode", rows))


def test_table_columns_match_its_header_and_label_per_core_and_the_split():
    import fidelity
    for case in ("decode", "prefill"):
        lines = [l for l in fidelity.render_case(case, fidelity.build_rows(MEASURED, PRICED)) if l.startswith("|")]
        widths = {l.count("|") for l in lines}
        assert len(widths) == 1, lines
        assert "1 core" in lines[0] and "measured, chip" in lines[0]
        assert ("split over 2 cores" in lines[0]) == (case == "decode")
    dec = fidelity.render_case("decode", fidelity.build_rows(MEASURED, PRICED))
    assert "| 41 |" in dec[2] and "| 21 |" in dec[2]       # the split prices are printed as recorded


def test_the_paper_rows_are_the_reference_tables():
    import fidelity
    # Tables 4 and 8: 512 ... 32768, excl. prep (spot checks against the paper's rows)
    assert sorted(fidelity.MEASURED["decode"]) == [512 << i for i in range(7)]
    assert sorted(fidelity.MEASURED["prefill"]) == [512 << i for i in range(7)]
    assert fidelity.MEASURED["decode"][8192] == 641 and fidelity.MEASURED["prefill"][4096] == 246


def test_a_stand_in_config_is_marked_wherever_its_figure_is_used():
    import fidelity
    stand_in = dict(_ok(900.0, bs=(1, 2048, 1, 2048), src="stand-in", split=450.0), fallback_for=[1, 4096, 1, 4096],
                    default_status="vmem_oom", default_reason="Used 76.28M of 63.94M vmem")
    priced = dict(PRICED)
    priced[4096] = {**PRICED[4096], "tpu-inference": stand_in}
    rows = fidelity.build_rows(MEASURED, priced)
    assert rows[3]["public_stand_in"] and abs(rows[3]["estimate_over_measured"] - 900 / 500) < 1e-12
    priced2 = dict(priced)
    priced2[2048] = {**PRICED[2048], "tpu-inference": _ok(400.0)}
    rows2 = fidelity.build_rows(MEASURED, priced2)
    assert rows2[3]["growth_stand_in"] and abs(rows2[3]["estimated_growth"] - 900 / 400) < 1e-12
    assert not rows2[2]["growth_stand_in"]
    text = fidelity.render_case("decode", rows2)
    line = next(l for l in text if l.startswith("| 4,096 |"))
    assert "900†" in line and "1.80†" in line and "2.25×†" in line and "(1, 2048, 1, 2048)†" in line
    assert any(n.startswith("- decode 4,096, public: its default (1, 4096, 1, 4096) not priced: vmem_oom: Used 76.28M")
               and "stand-in (1, 2048, 1, 2048)†" in n for n in text)
