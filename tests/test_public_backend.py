"""tpu-inference's RPA v3 as a second tuned kernel: its rules and baseline, a real deviceless
sweep of it, the vLLM-TPU / SGLang-JAX exports, the bring-up lookup and the comparison."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kernel.config import BlockSizes
from kernel.workload import ModelShape, ServingLimits, Workload, make_inputs
from rpa_tune import kernels, public_kernel
from rpa_tune.kernels import tpu_inference
from tables_synth import isolated_tables, key, row, write_results  # noqa: F401 (fixture)

REPO = Path(__file__).resolve().parents[1]
RPA_TUNE = str(Path(sys.executable).with_name("rpa-tune"))
PUB = "tpu-inference"


def run(args, env=None, timeout=600, cwd=None):
    e = dict(os.environ, **(env or {}))
    return subprocess.run([RPA_TUNE, *args], capture_output=True, text=True, env=e, timeout=timeout, cwd=cwd)


# ----------------------------------------------------------------------------- rules, baseline
@pytest.mark.parametrize("bs", [(1, 256, 1, 128), (1, 256, 1, 96), (1, 192, 1, 64), (8, 256, 3, 128),
                                (16, 512, 8, 512), (4, 128, 4, 256), (2, 128, 1, 128)])
def test_legality_is_the_public_kernels_own_validation(bs):
    """Our statement of its rules against the package's static_validate_inputs."""
    mod = public_kernel.load_kernel_module()
    model, page = ModelShape(8, 2, 128), 64
    limits = ServingLimits(page_size=page, max_num_tokens=32, max_num_seqs=4, max_model_len=1024)
    inp = make_inputs(model, limits, Workload.of_case("decode", [1, 1], [70, 9]))
    ours = tpu_inference.public_block_size_errors(BlockSizes(*bs), page)
    try:
        mod.static_validate_inputs(**inp, d_block_sizes=tuple(bs))
        theirs = None
    except ValueError as e:
        theirs = str(e)
    assert (ours == []) == (theirs is None), (bs, ours, theirs)


def test_baseline_is_the_public_default_and_legal():
    k = kernels.get_kernel(PUB)
    for gen in ("v5e", "v6e", "tpu7x"):
        for case in ("decode", "prefill", "mixed"):
            kk = key(gen, case, t=512, l=4096)
            bs = k.heuristic(kk)
            assert bs is not None and not k.block_size_errors(case, bs, kk.page_size), (gen, case, bs)
            if case == "decode":
                assert bs.bq == bs.cq == 1 and bs.bkv <= kk.max_model_len
    # tpu-inference has no default for v4 (its get_default_block_sizes raises there)
    assert k.heuristic(key("v4", "decode")) is None


def test_public_decode_walk_covers_the_new_token():
    """The public kernel's decode KV walk (its _fetch_bkv: blocks of bkv over all kv_len
    tokens, one DMA per page) against ours (the kv_len - 1 cached tokens' pages, the new
    token in the last step unless it starts a block), as the composition prices them."""
    from rpa_tune.estimator.compose import pipeline_steps, probes
    bs, page = BlockSizes(1, 512, 1, 256), 128
    for kv in (1, 128, 129, 512, 513, 1000, 1025):
        steps = pipeline_steps(bs, page, [kv], walk_new=True)
        want = [min(512, kv - i * 512) for i in range(-(-kv // 512))]
        assert [p for p, *_ in steps] == [-(-n // page) for n in want], kv
    # a new token that starts a block: a step of its own for the public kernel, not ours
    assert len(pipeline_steps(bs, page, [513])) == 1 and len(pipeline_steps(bs, page, [513], walk_new=True)) == 2
    # elsewhere both attend to it in their last step: the probes' walks have the same steps
    for p in probes("decode", bs, page):
        ours, theirs = pipeline_steps(bs, page, p.kv_lens), pipeline_steps(bs, page, p.kv_lens, walk_new=True)
        assert [c for _, c, *_ in ours] == [c for _, c, *_ in theirs], p.kv_lens


# ----------------------------------------------------------------------------- sweep (CLI)
def test_missing_package_is_one_line_with_the_install_command(tmp_path):
    code = ("import sys; import rpa_tune.public_kernel as p; p.SEARCH_PATH = [sys.argv.pop(1)]; "
            "from rpa_tune.cli import app; sys.argv[0] = 'rpa-tune'; app()")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path), "sweep", "--tpu", "v6e", "--kernel", PUB,
                        "--results", str(tmp_path / "res")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and public_kernel.INSTALL_COMMAND in lines[0], r.stderr
    assert not (tmp_path / "res").exists()


def test_interpret_backend_is_refused_for_the_public_kernel(tmp_path):
    r = run(["sweep", "--tpu", "v6e", "--kernel", PUB, "--backend", "interpret", "--results", str(tmp_path / "r")])
    assert r.returncode == 2 and "interpreter" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_public_sweep_records_ok_rows_and_prints_the_env_line(tmp_path):
    """A real deviceless sweep of the public kernel (v6e decode, the kernel's own default plus
    one more config), then the vLLM env export of its result."""
    res = tmp_path / "res"
    args = ["sweep", "--tpu", "v6e", "--kernel", PUB, "--case", "decode", "--q-heads", "8", "--kv-heads", "1",
            "--head-dim", "128", "--max-model-len", "1024", "--max-num-tokens", "64", "--num-seqs", "8",
            "--context", "fixed:700", "--search", "grid", "--budget", "2", "--jobs", "1", "--results", str(res),
            "--json"]
    r = run(args, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    from rpa_tune.store import ResultStore
    df = ResultStore(res).read()
    assert len(df) == 2 and set(df["kernel"]) == {PUB}
    assert set(df["kernel_version"]) == {f"{PUB}=={public_kernel.PINNED_VERSION}"}
    assert all(k.startswith(f"{PUB}:v6e/decode/") for k in df["key_id"])
    ok = df[df["status"] == "ok"]
    assert len(ok) == 2, df[["bq", "bkv", "status", "message"]].to_string()
    assert ok["metric"].notna().all() and (ok["audit"] == "complete").all(), ok["message"].tolist()
    # each estimate is a time no faster than the workload's HBM bound
    assert (ok["metric"] >= ok["memory_bound_s"] * 0.999).all()
    heur = df[df["is_heuristic"]]
    assert len(heur) == 1 and tuple(heur.iloc[0][["bq", "bkv", "cq", "ckv"]]) == tuple(
        kernels.get_kernel(PUB).heuristic(_key_of(df.iloc[0])))
    # resuming records nothing new
    r2 = run(args, timeout=300)
    assert r2.returncode == 0 and len(ResultStore(res).read()) == 2
    # our kernel's export ignores these rows; the env export prints the line
    e = run(["export", "-r", str(res), "--format", "vllm-env"])
    assert e.returncode == 0, e.stderr
    best = ok.sort_values("metric").iloc[0]
    promoted = [l for l in e.stdout.splitlines() if l.startswith("RPA_V3_DECODE_BLOCK_SIZES=")]
    if promoted:
        assert promoted == [f"RPA_V3_DECODE_BLOCK_SIZES={best.bq},{best.bkv},{best.cq},{best.ckv}"]
    else:
        assert "decode: the kernel's default is kept" in e.stdout
    o = run(["export", "-r", str(res), "-o", str(tmp_path / "tables")])
    assert o.returncode == 1 and "no usable rpa-tune result rows" in o.stderr


def _key_of(r):
    from kernel.config import TuningKey
    import dataclasses
    return TuningKey(**{f.name: (r[f.name].item() if hasattr(r[f.name], "item") else r[f.name])
                        for f in dataclasses.fields(TuningKey)})


# ----------------------------------------------------------------------------- exports
def _public_rows():
    """Synthetic public-kernel results: two keys (decode and prefill of one shape) with the
    kernel's default and a faster config, and one key where the default wins."""
    k = kernels.get_kernel(PUB)
    rows = []
    for case, best, hq, t in (("decode", (1, 1024, 1, 1024), 32, 64), ("prefill", (64, 512, 32, 256), 32, 64),
                              ("decode", None, 24, 256)):
        kk = key("v6e", case, hq=hq, t=t, l=8192)
        h = k.heuristic(kk)
        extra = dict(kernel=PUB, kernel_version=f"{PUB}==0.32.0", key_id=kernels.key_id(kk, PUB), workload="w")
        rows.append(row(kk, h, 2e-4, is_heuristic=True, config_id=f"{kk.id()}/h", **extra))
        other = best or (1, 512, 1, 512)
        rows.append(row(kk, other, 1e-4 if best else 3e-4, is_heuristic=False, config_id=f"{kk.id()}/b", **extra))
    return rows


def test_vllm_env_export_is_deterministic_and_parses_back(tmp_path):
    res = tmp_path / "res"
    write_results(res, _public_rows())
    outs = [run(["export", "-r", str(res), "--format", "vllm-env"]) for _ in range(2)]
    assert outs[0].returncode == 0, outs[0].stderr
    assert outs[0].stdout == outs[1].stdout
    env = {}
    groups = outs[0].stdout.split("\n\n")
    for g in groups:
        for l in g.splitlines():
            if not l.startswith("#"):
                name, _, val = l.partition("=")
                env.setdefault(name, []).append(tuple(int(x) for x in val.split(",")))
    # no PREFILL line: vLLM-TPU never launches the prefill kernel (tests/test_vllm_server.py)
    assert env == {"RPA_V3_DECODE_BLOCK_SIZES": [(1, 1024, 1, 1024)]}
    # the group of the key where the default won says so and sets nothing
    g24 = next(g for g in groups if "24 q heads" in g)
    assert "the kernel's default is kept" in g24
    assert not [l for l in g24.splitlines() if l and not l.startswith("#")]
    # --out writes the same text; an existing file needs --replace
    f = tmp_path / "rpa.env"
    assert run(["export", "-r", str(res), "--format", "vllm-env", "-o", str(f)]).returncode == 0
    assert f.read_text() == outs[0].stdout
    r = run(["export", "-r", str(res), "--format", "vllm-env", "-o", str(f)])
    assert r.returncode == 2 and "--replace" in r.stderr
    r = run(["export", "-r", str(res), "--format", "vllm-env", "--kernel", "rpa-tune"])
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1


def test_sglang_export_imports_and_looks_up(tmp_path):
    res = tmp_path / "res"
    write_results(res, _public_rows())
    f = tmp_path / "tuned_rpa.py"
    # (--replace-measured: these keys are in SGLang-JAX's own measured table, which an
    # estimate does not replace unless asked; tests/test_sglang_jax.py covers that)
    r = run(["export", "-r", str(res), "--format", "sglang", "--replace-measured", "-o", str(f)])
    assert r.returncode == 0, r.stderr
    text = f.read_text()
    r2 = run(["export", "-r", str(res), "--format", "sglang", "--replace-measured"])
    assert r2.stdout == text
    spec = importlib.util.spec_from_file_location("tuned_rpa", f)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    t = mod.TUNED_BLOCK_SIZES_V3
    assert set(t) == {"TPU v6e"}
    # SGLang-JAX's key: (stage, window, q dtype, kv dtype, q heads, kv heads, head_dim, page, tokens)
    assert t["TPU v6e"][("d", None, "bfloat16", "bfloat16", 32, 8, 128, 128, 64)] == (1, 1024, 1, 1024)
    assert mod.lookup("TPU v6e", "p", None, "bfloat16", "bfloat16", 32, 8, 128, 128, 64) == (64, 512, 32, 256)
    # normalised as its lookup does: 60 tokens and head_dim 96 fall on the 64 / 128 entry
    assert mod.lookup("TPU v6e", "d", None, "bfloat16", "bfloat16", 32, 8, 96, 128, 60) == (1, 1024, 1, 1024)
    # the key that kept the default is not in the table
    assert mod.lookup("TPU v6e", "d", None, "bfloat16", "bfloat16", 24, 8, 128, 128, 256) is None
    assert "Not written" in text


# ----------------------------------------------------------------------------- bring-up
def test_bring_up_lookup_order(tmp_path, isolated_tables, monkeypatch):
    res = tmp_path / "res"
    write_results(res, _public_rows())
    tables = tmp_path / "tables"
    r = run(["export", "-r", str(res), "--kernel", PUB, "-o", str(tables)])
    assert r.returncode == 0, r.stderr
    files = sorted(p.relative_to(tables).as_posix() for p in tables.rglob("*.json"))
    assert files == [f"{PUB}/v6e.json"]
    from kernel import tables as kt
    monkeypatch.delenv("RPA_V3_DECODE_BLOCK_SIZES", raising=False)
    monkeypatch.setenv("RPA_TPU_INFERENCE_TABLE", str(tables / PUB))
    kt.reset()
    shape = dict(generation="v6e", q_dtype="bfloat16", kv_dtype="bfloat16", num_q_heads=32, num_kv_heads=8,
                 head_dim=128, page_size=128, pages_per_seq=64)
    # exact key; a smaller token bucket uses the bucket above; mixed has no entry: absent
    assert kt.block_sizes_for(**shape, max_num_tokens=64) == {"d_block_sizes": (1, 1024, 1, 1024),
                                                               "p_block_sizes": (64, 512, 32, 256)}
    assert kt.block_sizes_for(**shape, max_num_tokens=16)["d_block_sizes"] == (1, 1024, 1, 1024)
    assert kt.block_sizes_for(**shape, max_num_tokens=128) == {}
    # the override variable vLLM reads wins
    monkeypatch.setenv("RPA_V3_DECODE_BLOCK_SIZES", "1,512,1,256")
    assert kt.block_sizes_for(**shape, max_num_tokens=64)["d_block_sizes"] == (1, 512, 1, 256)
    monkeypatch.setenv("RPA_V3_DECODE_BLOCK_SIZES", "1,512")
    with pytest.raises(ValueError, match="RPA_V3_DECODE_BLOCK_SIZES"):
        kt.block_sizes_for(**shape, max_num_tokens=64)
    # our kernel's tables never take the public kernel's file
    isolated_tables(tables / PUB)
    got = kt.loaded()
    assert len(got.index) == 0 and any("a table of kernel tpu-inference" in w for w in got.warnings)


# ----------------------------------------------------------------------------- compare
def test_compare_reports_each_kernels_best_and_the_ratio(tmp_path):
    from rpa_tune.provenance import kernel_hash
    res = tmp_path / "res"
    kk = key("v6e", "decode", t=64)
    pub = [r for r in _public_rows() if r["key_id"] == kernels.key_id(kk, PUB)]
    for r in pub:
        r["kernel_hash"] = f"{PUB}=={public_kernel.PINNED_VERSION}"
        r["backend"] = "compile"
    ours = [row(kk, (1, 512, 1, 512), 0.8e-4, kernel_hash=kernel_hash(), is_heuristic=True,
                config_id="o1", backend="compile", workload="w"),
            row(kk, (1, 1024, 1, 512), 0.9e-4, kernel_hash=kernel_hash(), is_heuristic=False,
                config_id="o2", backend="compile", workload="w")]
    write_results(res, pub + ours)
    r = run(["compare", "--results", str(res), "--json"])
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert len(doc) == 1
    c = doc[0]
    assert c["best"]["rpa-tune"]["block_sizes"] == [1, 512, 1, 512]
    assert c["best"][PUB]["block_sizes"] == [1, 1024, 1, 1024]
    assert c["ratio"] == pytest.approx(0.8)
    assert np.isclose(c["heuristic"][PUB]["metric"], 2e-4)


def test_a_table_of_the_other_kernel_is_never_overwritten(tmp_path):
    """Exporting our rows into the public kernel's table directory (or the reverse) is refused
    in one line, and the existing table is left as it was."""
    from tables_synth import row as our_row
    res, tables = tmp_path / "res", tmp_path / "tables"
    write_results(res, _public_rows())
    assert run(["export", "-r", str(res), "--kernel", PUB, "-o", str(tables)]).returncode == 0
    public_file = tables / PUB / "v6e.json"
    before = public_file.read_bytes()
    ours = tmp_path / "ours"
    kk = key("v6e", "decode", t=64)
    write_results(ours, [our_row(kk, (1, 512, 1, 512), 1e-4, is_heuristic=False, config_id="o1", workload="w")])
    r = run(["export", "-r", str(ours), "-o", str(tables / PUB)])
    assert r.returncode == 2 and "a table of kernel tpu-inference" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and public_file.read_bytes() == before
    # --out naming the kernel's own directory is not nested once more
    assert run(["export", "-r", str(res), "--kernel", PUB, "-o", str(tables / PUB)]).returncode == 0
    assert not (tables / PUB / PUB).exists() and public_file.read_bytes() == before


def test_sglang_bucket_keeps_the_key_whose_values_are_the_buckets():
    from kernel.tables import Table
    from rpa_tune.server_formats import sglang_module
    from tables_synth import entry
    a = entry(key("v6e", "decode", hq=24, t=64), (1, 512, 1, 512))      # 24 heads: looked up as 32
    b = entry(key("v6e", "decode", hq=32, t=64), (1, 1024, 1, 1024))
    text, notes = sglang_module({"v6e": Table((a, b), info={"kernel": PUB})})
    ns = {}
    exec(text, ns)
    assert ns["lookup"]("TPU v6e", "d", None, "bfloat16", "bfloat16", 32, 8, 128, 128, 64) == (1, 1024, 1, 1024)
    assert any("replaced" in n for n in notes)
