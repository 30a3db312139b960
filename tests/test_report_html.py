"""``rpa-tune report``: the static HTML page (heatmaps, winner / heuristic / gain, coverage)
on small synthetic results (no compile). The data functions are checked in-process against
numbers computed here from the rows; the command runs as a user runs it."""
from __future__ import annotations

import datetime
import html
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from tables_synth import entry, key, row, table
from kernel.provenance import kernel_id
from cli_checks import assert_one_error_line

SOURCE = kernel_id()      # table entries tuned for the current kernel source

RPA_TUNE = str(Path(sys.executable).with_name("rpa-tune"))
HOSTILE = '<script>alert("x")</script> & <b>bold</b>'
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# key A: v6e decode, llama3-8b's shape; key B: v6e prefill, llama3-70b-tp8's shape
KEY_A = key("v6e", "decode", hq=32, hkv=8, d=128, t=2048)
KEY_B = key("v6e", "prefill", hq=8, hkv=1, d=128, t=2048)
T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)

# (bq, bkv, cq, ckv) -> (status, metric, audit); the heuristic is flagged separately
A_CONFIGS = {
    (1, 512, 1, 128): ("ok", 3.0e-4, "complete"),
    (1, 1024, 1, 128): ("ok", 2.5e-4, "complete"),      # heuristic
    (1, 2048, 1, 128): ("ok", 2.2e-4, "incomplete"),
    (1, 512, 1, 256): ("ok", 2.4e-4, "complete"),
    (1, 1024, 1, 256): ("ok", 2.0e-4, "complete"),      # winner
    (1, 2048, 1, 256): ("vmem_oom", None, None),
    (1, 4096, 1, 512): ("compile_error", None, None),
}
A_HEURISTIC = (1, 1024, 1, 128)
B_CONFIGS = {
    (64, 512, 16, 128): ("ok", 9.0e-4, "complete"),
    (64, 1024, 16, 256): ("ok", 7.0e-4, "complete"),    # heuristic
    (128, 1024, 32, 256): ("ok", 7.5e-4, "complete"),
    (128, 512, 32, 128): ("crash", None, None),
    (64, 1024, 32, 256): ("ok", 8.0e-4, "complete"),
}
B_HEURISTIC = (64, 1024, 16, 256)
# key C: the heuristic's config failed (no gain), and `verify` found an ok config wrong
KEY_C = key("v5e", "mixed", hq=32, hkv=8, d=128, t=2048)
C_CONFIGS = {
    (64, 512, 16, 128): ("ok", 5.0e-4, "complete"),
    (64, 1024, 16, 256): ("ok", 4.0e-4, "complete"),    # found wrong by verify
    (128, 1024, 32, 256): ("vmem_oom", None, None),     # heuristic
}
C_HEURISTIC = (128, 1024, 32, 256)
C_WRONG = (64, 1024, 16, 256)


def _rows(k, configs, heuristic, workload):
    from rpa_tune.store import config_id
    out = []
    for i, (bs, (status, metric, audit)) in enumerate(sorted(configs.items())):
        r = row(k, bs, metric, status=status, timestamp=T0 + datetime.timedelta(seconds=i), audit=audit,
                is_heuristic=bs == heuristic, workload=workload, kernel="rpa-tune")
        r["cycles"] = None if metric is None else float(r["cycles"])
        r["config_id"] = config_id(k.id(), r["workload_id"], bs, r["backend"], r["kernel_hash"], "1")
        out.append(r)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    from rpa_tune.store import ResultStore
    res = tmp_path_factory.mktemp("report") / "results"
    store = ResultStore(res)
    for r in (_rows(KEY_A, A_CONFIGS, A_HEURISTIC, HOSTILE) + _rows(KEY_B, B_CONFIGS, B_HEURISTIC, "prefill w")
              + _rows(KEY_C, C_CONFIGS, C_HEURISTIC, "mixed w")):
        store.append([r])
    [wrong] = _rows(KEY_C, {C_WRONG: ("wrong_result", None, None)}, None, "interpret check")
    store.append([dict(wrong, backend="interpret", workload_id="small", config_id="verify-c")])
    return res


@pytest.fixture(scope="module")
def tables_dir(tmp_path_factory) -> Path:
    """Tables with one entry: key A promoted."""
    from rpa_tune.export import write_tables
    d = tmp_path_factory.mktemp("tables")
    write_tables({"v6e": table(entry(KEY_A, (1, 1024, 1, 256), promoted=True, metric=2.0e-4, kernel_hash=SOURCE))}, d)
    return d


@pytest.fixture(scope="module")
def data(results, tables_dir):
    from rpa_tune.export import load_table_path
    from rpa_tune.html_report import gather
    from rpa_tune.store import ResultStore
    return gather(ResultStore(results).read(), load_table_path(tables_dir).entries, results=str(results),
                  tables=str(tables_dir))


def _independent(configs, heuristic):
    ok = {bs: m for bs, (st, m, _) in configs.items() if st == "ok"}
    win = min(ok, key=ok.get)
    return win, heuristic, ok[heuristic] / ok[win], {(bs[2], bs[3]) for bs in configs}


def _section(data, k):
    [s] = [s for s in data.sections if s.group.key_id == k.id()]
    return s


@pytest.mark.parametrize("k,configs,heuristic", [(KEY_A, A_CONFIGS, A_HEURISTIC), (KEY_B, B_CONFIGS, B_HEURISTIC)])
def test_winner_heuristic_gain_panels_and_failures_match_the_rows(data, k, configs, heuristic):
    from rpa_tune.html_report import heatmap_figure
    win, heur, gain, panels = _independent(configs, heuristic)
    s = _section(data, k)
    hm = s.heatmap
    assert hm.winner == win and hm.heuristic == heur
    assert s.group.gain == pytest.approx(gain)
    assert set(hm.panels) == panels
    assert hm.failed == {bs: st for bs, (st, _, _) in configs.items() if st != "ok"}
    assert {bs: m for bs, (_, m) in hm.cells.items() if m is not None} == \
        {bs: m for bs, (st, m, _) in configs.items() if st == "ok"}
    audits = {}
    for st, _, a in configs.values():
        if st == "ok":
            audits[a] = audits.get(a, 0) + 1
    assert s.audit_counts == audits
    fig, axes = heatmap_figure(hm)
    assert len(axes) == len(panels)
    assert [ax.get_title() for ax in axes] == [f"cq={cq}, ckv={ckv}" for cq, ckv in sorted(panels)]


def test_failed_heuristic_and_a_config_found_wrong(data):
    s = _section(data, KEY_C)
    hm = s.heatmap
    assert hm.heuristic == C_HEURISTIC and s.group.heuristic is None and s.group.gain is None
    assert hm.failed == {C_HEURISTIC: "vmem_oom", C_WRONG: "wrong_result"}
    assert hm.winner == (64, 512, 16, 128)       # the faster config was wrong
    assert s.audit_counts == {"complete": 1}


def test_coverage_with_one_table_entry(data):
    from kernel.config import GENERATIONS
    from rpa_tune.presets import PRESETS
    from rpa_tune import coverage as matrix
    cov = data.coverage
    assert cov.generations == list(GENERATIONS) and cov.cases == ["decode", "prefill", "mixed"]
    assert cov.buckets == list(matrix.BUCKETS)
    shape = lambda p, kv=None: ((p.num_q_heads, p.num_kv_heads, p.head_dim, p.q_dtype, kv or p.kv_dtype), False)
    rows = [s for s, _ in cov.shapes]
    # the matrix's shapes first (Gemma-2 twice: its window keys are a row of their own), then
    # the presets it leaves out
    want = list(dict.fromkeys([(shape(PRESETS[s.preset], s.kv_dtype)[0], s.sliding_window is not None)
                               for s in matrix.SHAPES] + [shape(p) for p in PRESETS.values()]))
    assert rows == want and ((16, 8, 256, "bfloat16", "bfloat16"), True) in rows
    assert ((32, 8, 128, "bfloat16", "float8_e4m3fn"), False) in rows
    a, b = shape(PRESETS["llama3-8b"]), shape(PRESETS["llama3-70b-tp8"])
    expect = {("v6e", a, "decode", 2048): "tuned",           # promoted entry in the tables
              ("v6e", b, "prefill", 2048): "not promoted",   # results, no entry
              ("v5e", a, "mixed", 2048): "not promoted"}
    for cell_key, cell in cov.cells.items():
        g, _, c, _ = cell_key
        other = "needs a device" if matrix.NEEDS_A_DEVICE_CASES.get((g, c)) else "missing"
        assert cell.state == expect.get(cell_key, other), cell_key
    assert cov.cells[("tpu7x", a, "prefill", 2048)].state == "needs a device"
    # the page counts the matrix's rows apart from the presets it leaves out
    from rpa_tune.html_report import coverage_counts
    assert cov.matrix_rows == len(matrix.SHAPES)     # each a row of its own
    inside = set(rows[:cov.matrix_rows])
    line = coverage_counts(cov)
    n_in = sum(1 for k in cov.cells if k[1] in inside)
    mine, other = line.rstrip(".").split("; ")
    assert mine.startswith("The shipped matrix's rows: 1 tuned, 2 not promoted, 0 stale, ")
    assert sum(int(x.split()[0]) for x in mine.split(": ", 1)[1].removesuffix(" cells").split(", ")) == n_in
    assert other.startswith("the other rows: 0 tuned, 0 not promoted, 0 stale, ")
    assert cov.cells[("v6e", a, "decode", 2048)].keys == [KEY_A.id()]
    assert cov.cells[("v6e", b, "prefill", 2048)].anchor == _section(data, KEY_B).anchor


def test_not_promoted_table_entry_and_a_custom_shape(results):
    from rpa_tune.html_report import coverage
    from rpa_tune.store import ResultStore
    odd = key("v5e", "mixed", hq=4, hkv=4, d=64, t=512)
    old = key("v5p", "decode", t=256)
    cov = coverage(ResultStore(results).read(), [entry(KEY_A, (1, 512, 1, 128), promoted=False, kernel_hash=SOURCE),
                                                  entry(odd, (8, 512, 8, 128), promoted=True, kernel_hash=SOURCE),
                                                  entry(old, (1, 512, 1, 128), promoted=True, kernel_hash="earlier")])
    a = ((32, 8, 128, "bfloat16", "bfloat16"), False)
    assert cov.buckets == [128, 256, 512, 1024, 2048, 4096, 8192]
    assert cov.cells[("v6e", a, "decode", 2048)].state == "not promoted"
    assert cov.cells[("v5e", ((4, 4, 64, "bfloat16", "bfloat16"), False), "mixed", 512)].state == "tuned"
    assert cov.shapes[-1][1].startswith("custom")
    # an entry tuned for another kernel source is stale, whatever its promotion
    assert cov.cells[("v5p", ((32, 8, 128, "bfloat16", "bfloat16"), False), "decode", 256)].state == "stale"


def run(args, cwd=None):
    env = dict(os.environ, COLUMNS="250")
    return subprocess.run([RPA_TUNE, *map(str, args)], capture_output=True, text=True, env=env, timeout=120,
                          cwd=cwd)


def _png_size(p: Path) -> tuple[int, int]:
    head = p.read_bytes()[:24]
    assert head[:8] == PNG_MAGIC and head[12:16] == b"IHDR", p
    return struct.unpack(">II", head[16:24])


@pytest.fixture(scope="module")
def page(results, tables_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("out") / "report"
    r = run(["report", "--results", results, "--tables", tables_dir, "--out", out])
    assert r.returncode == 0, r.stderr
    return out


def test_page_images_escaping_and_estimate_label(page, data):
    from rpa_tune.html_report import DPI, figure_size
    text = (page / "index.html").read_text()
    pngs = sorted(page.glob("*.png"))
    assert len(pngs) == len(data.sections) == 3
    for s in data.sections:
        w, h = figure_size(s.heatmap)
        assert _png_size(page / s.image) == (round(w * DPI), round(h * DPI))
        assert f'src="{s.image}"' in text
    assert "<script" not in text and HOSTILE not in text
    assert html.escape(HOSTILE) in text
    assert "static compiler estimate (audited) through the calibrated device-cost model" in text
    assert text.count('class="c tuned"') == 1 and text.count('class="c not-promoted"') == 2
    assert "×1.25 (+25.0%)" in text          # key A: 2.5e-4 / 2.0e-4
    assert "incomplete: 1" in text
    # the cases no estimate can cover here are named under the matrix, with the reason
    assert "<b>Needs a device</b>: tpu7x prefill, tpu7x mixed: " in text
    assert html.escape(matrix_reason()) in text


def matrix_reason():
    from rpa_tune import coverage
    return coverage.NEEDS_A_DEVICE_CASES[("tpu7x", "prefill")]


def test_rerun_into_its_own_output_and_never_into_a_foreign_one(page, results, tables_dir, tmp_path):
    stale = page / "999-old.png"
    marker = json.loads((page / ".rpa-tune-report").read_text())
    (page / ".rpa-tune-report").write_text(json.dumps(dict(marker, files=marker["files"] + [stale.name])))
    stale.write_bytes(PNG_MAGIC)
    r = run(["report", "--results", results, "--tables", tables_dir, "--out", page, "--key", "decode"])
    assert r.returncode == 0, r.stderr
    assert not stale.exists() and len(list(page.glob("*.png"))) == 1
    foreign = tmp_path / "docs"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    r = run(["report", "--results", results, "--tables", tables_dir, "--out", foreign])
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--force" in r.stderr, r.stderr
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]
    r = run(["report", "--results", results, "--tables", tables_dir, "--out", foreign, "--force"])
    assert r.returncode == 0, r.stderr
    assert (foreign / "notes.txt").read_text() == "mine" and (foreign / "index.html").is_file()


def _bad(tmp: Path, results: Path, tables_dir: Path, name: str):
    (tmp / "empty").mkdir()
    (tmp / "a_file").write_text("x")
    return {
        "missing-results": (["--results", tmp / "nowhere", "--out", tmp / "o"], ["nowhere", "not a directory"]),
        "empty-results": (["--results", tmp / "empty", "--out", tmp / "o"], ["empty", "no result rows"]),
        "out-is-a-file": (["--results", results, "--out", tmp / "a_file"], ["a_file", "not a directory"]),
        "out-unwritable": (["--results", results, "--out", tmp / "a_file" / "sub"], ["a_file", "writable"]),
        "bad-tables": (["--results", results, "--tables", tmp / "nowhere", "--out", tmp / "o"],
                       ["--tables", "nowhere", "<generation>.json"]),
        "bad-limit": (["--results", results, "--limit", "0", "--out", tmp / "o"], ["--limit", "'0'"]),
    }[name]


@pytest.mark.parametrize("name", ["missing-results", "empty-results", "out-is-a-file", "out-unwritable",
                                  "bad-tables", "bad-limit"])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(name, tmp_path, results, tables_dir):
    args, needles = _bad(tmp_path, results, tables_dir, name)
    before = sorted(tmp_path.rglob("*"))
    r = run(["report", *args, *(["--tables", tables_dir] if "--tables" not in args else [])])
    assert_one_error_line(r, needles)
    assert sorted(tmp_path.rglob("*")) == before


def test_a_key_with_two_workloads_shows_the_table_entry_on_its_own_group(tmp_path):
    """A mixed key priced again on a new batch keeps its retired batch's rows: two groups. The
    entry's winner is marked on its own workload's group only, and the coverage cell links
    that group even where the other one comes first on the page."""
    from rpa_tune.html_report import gather, render_html
    from rpa_tune.store import ResultStore, config_id
    k = key("v6e", "mixed", hq=8, hkv=1, d=128, t=512)
    store = ResultStore(tmp_path / "results")
    landscapes = {"aaa-retired": {(32, 512, 16, 256): 3.0e-4, (64, 1024, 32, 512): 2.0e-4},
                  "zzz-current": {(32, 512, 16, 256): 1.0e-4, (64, 1024, 32, 512): 4.0e-4}}
    for n, (wid, configs) in enumerate(landscapes.items()):
        for i, (bs, metric) in enumerate(sorted(configs.items())):
            r = row(k, bs, metric, timestamp=T0 + datetime.timedelta(minutes=n, seconds=i), audit="complete",
                    is_heuristic=bs == (64, 1024, 32, 512), workload=wid, workload_id=wid, kernel="rpa-tune")
            r["config_id"] = config_id(k.id(), wid, bs, r["backend"], r["kernel_hash"], "1")
            store.append([r])
    e = entry(k, (32, 512, 16, 256), promoted=True, metric=1.0e-4, kernel_hash=SOURCE)
    e.provenance["workload_id"] = "zzz-current"
    data = gather(store.read(), [e])
    by_wid = {s.group.workload_id: s for s in data.sections}
    assert list(by_wid) == ["aaa-retired", "zzz-current"]          # the page's order: the retired one first
    # each group's own winner, from its rows
    assert {w: tuple(int(s.group.best[c]) for c in ("bq", "bkv", "cq", "ckv")) for w, s in by_wid.items()} == \
        {w: min(c, key=c.get) for w, c in landscapes.items()}
    assert by_wid["zzz-current"].table_workload_id is None
    assert by_wid["aaa-retired"].table_workload_id == "zzz-current"
    [cell] = [c for c in data.coverage.cells.values() if c.keys == [k.id()]]
    assert cell.state == "tuned" and cell.anchor == by_wid["zzz-current"].anchor
    page = render_html(data)
    assert page.count("tuned on workload zzz-current, another group") == 1
