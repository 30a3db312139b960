"""kernel.precompile: deviceless variants, the persistent-cache path, no recompilation."""
import jax
import jax.numpy as jnp
import pytest
from jax._src import monitoring

import kernel
import kernel.api as kapi
from kernel import bringup
from kernel.workload import ModelShape, ServingLimits, Workload, make_inputs
from tables_synth import entry, isolated_tables, key, table  # noqa: F401

_compiles = []
monitoring.register_event_duration_secs_listener(
    lambda name, d, **kw: _compiles.append(kw.get("fun_name"))
    if name.endswith("backend_compile_duration") and "_rpa_jit" in str(kw.get("fun_name")) else None)

SMALL = ModelShape(8, 2, 128)


def test_default_token_buckets():
    assert bringup.default_token_buckets(512) == [16, 32, 64, 128, 256, 512]
    assert bringup.default_token_buckets(100) == [16, 32, 64, 100]
    assert bringup.default_token_buckets(8) == [8]


def test_precompile_small_model_deviceless(tmp_path, isolated_tables):
    limits = ServingLimits(page_size=128, max_num_tokens=64, max_num_seqs=16, max_model_len=2048)
    k = key("v5e", "decode", hq=8, hkv=2, t=32, l=2048)
    table(entry(k, (1, 512, 1, 256))).write_json(tmp_path / "t.json")
    isolated_tables(tmp_path / "t.json")
    cache = tmp_path / "cache"
    r = kernel.precompile(SMALL, limits, token_buckets=[16, 64], tpu="v5e", cache_dir=cache, progress=False,
                          sm_scale=128 ** -0.5)
    assert r.ok, [v.error for v in r.variants]
    assert r.deviceless and r.tpu == "v5e"
    assert [v.bucket for v in r.variants] == [16, 64]
    assert all(v.status == "compiled" and v.compile_s > 0 for v in r.variants)
    assert r.total_s >= sum(v.seconds for v in r.variants) * 0.99
    srcs = {v.bucket: {c: (tuple(bs), s) for c, bs, s in v.block_sizes} for v in r.variants}
    # t16 rounds up to the tabled t32 bucket; t64 is beyond it: heuristic
    assert srcs[16]["decode"][0] == (1, 512, 1, 256) and srcs[16]["decode"][1].endswith("(bucket)")
    assert srcs[64]["decode"][1] == "heuristic" and set(srcs[64]) == {"decode", "prefill", "mixed"}
    # warm: the same modules were verified before
    r2 = kernel.precompile(SMALL, limits, token_buckets=[16, 64], tpu="v5e", cache_dir=cache, progress=False,
                           sm_scale=128 ** -0.5)
    assert [v.status for v in r2.variants] == ["cached", "cached"]
    assert r2.total_s < r.total_s
    assert any((cache / bringup.VERIFIED_SUBDIR).iterdir())


def test_precompile_reports_errors(isolated_tables):
    limits = ServingLimits(page_size=128, max_num_tokens=16, max_num_seqs=8, max_model_len=1024)
    r = kernel.precompile(SMALL, limits, tpu="v6e", cases=["decode"], block_sizes={"decode": (1, 512, 1, 256)},
                          vmem_limit_bytes=1 << 10, progress=False)
    assert not r.ok and r.variants[0].status == "error" and r.variants[0].error
    with pytest.raises(RuntimeError, match="failed to compile"):
        kernel.precompile(SMALL, limits, tpu="v6e", cases=["decode"], vmem_limit_bytes=1 << 10,
                          progress=False, raise_on_error=True)


def test_precompile_without_tpu_needs_a_generation():
    with pytest.raises(RuntimeError, match="deviceless"):
        kernel.precompile(SMALL, ServingLimits(max_num_tokens=16), progress=False)


def test_unknown_option_rejected():
    with pytest.raises(TypeError, match="softcap"):
        kernel.precompile(SMALL, ServingLimits(max_num_tokens=16), tpu="v6e", softcap=3.0)


def _small_problem():
    model = ModelShape(4, 2, 128)
    limits = ServingLimits(page_size=16, max_num_tokens=16, max_num_seqs=4, max_model_len=64)
    return model, limits


def _call(inp):
    out, cache = kernel.ragged_paged_attention(**inp, interpret=True)
    return jax.block_until_ready(out)


def _device(inp):
    return {k: jnp.asarray(v) for k, v in inp.items()}


def test_same_bucket_twice_compiles_once_with_table_sizes(tmp_path, monkeypatch, isolated_tables):
    model, limits = _small_problem()
    # a table entry for a larger token bucket: the call's t16 rounds up to it
    k = key("v6e", "decode", hq=4, hkv=2, page=16, t=32, l=64)
    table(entry(k, (1, 32, 1, 16))).write_json(tmp_path / "t.json")
    isolated_tables(tmp_path / "t.json")
    monkeypatch.delenv("RPA_TPU_GENERATION", raising=False)        # CPU: v6e is the documented default
    seen = []
    real = kapi.build_options
    monkeypatch.setattr(kapi, "build_options", lambda *a, **kw: seen.append(real(*a, **kw)) or seen[-1])
    w1 = Workload.of_case("decode", [1, 1], [10, 40])
    w2 = Workload.of_case("decode", [1, 1, 1], [5, 17, 33])
    # the KV cache is donated: fresh device arrays per call
    inps = [_device(make_inputs(model, limits, w, seed=s, num_pages=12)) for s, w in enumerate((w1, w2, w1))]
    n0 = len(_compiles)
    _call(inps[0])
    n1 = len(_compiles)
    _call(inps[1])
    _call(inps[2])
    assert len(_compiles) == n1, "the second call of the same bucket recompiled"
    assert n1 - n0 == 1
    assert len(seen) == 3 and seen[0] == seen[1] == seen[2]
    assert seen[0].block_sizes[0] == (1, 32, 1, 16)


@pytest.mark.parametrize("committed", [True, False])
def test_precompile_on_local_device_warms_the_call(committed, isolated_tables):
    """The on-device path, exercised on CPU through the Pallas interpreter: after
    precompile, the first serving call of that bucket does not compile."""
    model, limits = _small_problem()
    w = Workload.of_case("decode", [1, 1], [12, 30 if committed else 31])
    inp = make_inputs(model, limits, w, seed=3, num_pages=10 if committed else 11)
    if committed:
        inp = {k: jax.device_put(v, jax.devices()[0]) for k, v in inp.items()}
    else:
        inp = _device(inp)
    r = kernel.precompile(model, limits, token_buckets=[16], num_pages=10 if committed else 11, interpret=True,
                          committed=committed, progress=False)
    assert r.ok and not r.deviceless and r.variants[0].status == "compiled"
    n0 = len(_compiles)
    _call(inp)
    assert len(_compiles) == n0, "the call after precompile compiled again"


def test_verify_entries_deviceless(isolated_tables):
    es = [entry(key("tpu7x", "decode", hq=8, hkv=1, page=256, t=16, l=4096), (1, 1024, 1, 512)),
          entry(key("v6e", "decode", hq=8, hkv=1, page=128, t=16, l=4096, sw=True), (1, 512, 1, 512))]
    out = bringup.verify_entries(es, progress=False)
    assert [v.status for _, v in out] == ["compiled", "compiled"], [v.error for _, v in out]
    assert out[0][1].block_sizes[0][1] == (1, 1024, 1, 512) and out[0][1].block_sizes[0][2] == "explicit"


def test_precompile_cli(tmp_path, isolated_tables):
    import json

    import typer
    from typer.testing import CliRunner

    from rpa_tune.cli_tables import register
    app = typer.Typer()
    register(app)
    app.callback()(lambda: None)
    runner = CliRunner()
    out = tmp_path / "report.json"
    r = runner.invoke(app, ["precompile", "--tpu", "v6e", "--model", "llama3-70b-tp8", "--max-num-tokens", "32",
                            "--buckets", "16,32", "--max-num-seqs", "8", "--max-model-len", "1024", "--cases", "decode",
                            "--json", str(out), "--no-progress"])
    assert r.exit_code == 0, r.output
    rep = json.loads(out.read_text())
    assert [v["bucket"] for v in rep["variants"]] == [16, 32]
    assert all(v["status"] == "compiled" for v in rep["variants"])
    # --verify-tables compiles a table's entries
    k = key("v6e", "decode", hq=8, hkv=1, t=16, l=1024)
    table(entry(k, (1, 512, 1, 256))).write_json(tmp_path / "t.json")
    r = runner.invoke(app, ["precompile", "--verify-tables", str(tmp_path / "t.json"), "--no-progress",
                            "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text())[0]["status"] == "compiled"
    bad = runner.invoke(app, ["precompile", "--tpu", "v6e", "--model", "nope"])
    assert bad.exit_code != 0 and "nope" in bad.output
