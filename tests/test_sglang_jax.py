"""SGLang-JAX's RPA v3 as a tuned kernel (``--kernel sglang-jax``): its rules and baseline
against the installed package's own functions, its VMEM rule, the verify stage's workload,
a deviceless decode compile, and the SGLang-JAX export looked up by sglang-jax's own lookup
function (every token bucket a server calls with; its device-measured entries kept)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from kernel.config import BlockSizes, Case
from rpa_tune import kernels
from rpa_tune.public_kernel import SGLANG_JAX
from tables_synth import key, row, write_results

RPA_TUNE = str(Path(sys.executable).with_name("rpa-tune"))
SGL = "sglang-jax"
TBS = "sgl_jax.srt.kernels.ragged_paged_attention.tuned_block_sizes_v3"


def run(args, timeout=600):
    return subprocess.run([RPA_TUNE, *args], capture_output=True, text=True, env=dict(os.environ), timeout=timeout)


class _Device:
    def __init__(self, kind):
        self.device_kind = kind


@pytest.fixture
def on_device(monkeypatch):
    """``use(generation)``: sglang-jax's own device probes (``util.get_tpu_version``,
    ``jax_utils.get_device_name``, ``pltpu.get_tpu_info``) see that generation's TPU."""
    from kernel.config import get_generation
    from kernel.hardware import tpu_info
    util = SGLANG_JAX.module("sgl_jax.srt.kernels.ragged_paged_attention.util")
    jax_utils = SGLANG_JAX.module("sgl_jax.srt.utils.jax_utils")
    K = SGLANG_JAX.load_kernel_module()

    def use(generation):
        fake = types.SimpleNamespace(devices=lambda: [_Device(get_generation(generation).device_kind)])
        monkeypatch.setattr(util, "jax", fake)
        monkeypatch.setattr(jax_utils, "jax", fake)
        info = types.SimpleNamespace(vmem_capacity_bytes=int(tpu_info(generation).vmem_capacity_bytes))
        monkeypatch.setattr(K, "pltpu", types.SimpleNamespace(get_tpu_info=lambda: info))
        monkeypatch.setattr(K, "get_tpu_version", util.get_tpu_version)
    return use


# ----------------------------------------------------------------------------- rules, baseline, VMEM
@pytest.mark.parametrize("bs", [(1, 256, 1, 128), (1, 256, 1, 96), (8, 256, 3, 128), (16, 512, 8, 512),
                                (4, 128, 4, 256), (2, 128, 1, 128)])
def test_legality_is_sglang_jax_own_validation(bs):
    import jax.numpy as jnp
    mod = SGLANG_JAX.load_kernel_module()
    page, hkv, d = 64, 2, 128
    q = jnp.zeros((16, 8, d), jnp.bfloat16)
    kv = jnp.zeros((16, hkv, d), jnp.bfloat16)
    cache = jnp.zeros(mod.get_kv_cache_shape(8, page, hkv, d, jnp.bfloat16), jnp.bfloat16)
    i32 = lambda n: jnp.zeros((n,), jnp.int32)
    ours = kernels.get_kernel(SGL).block_size_errors("mixed", BlockSizes(*bs), page)
    try:
        mod.static_validate_inputs(q, kv, kv, cache, i32(4), i32(16), i32(5), i32(5), i32(3), m_block_sizes=tuple(bs))
        theirs = None
    except ValueError as e:
        theirs = str(e)
    assert (ours == []) == (theirs is None), (bs, ours, theirs)


def test_baseline_is_its_own_default_at_its_vmem_limit(on_device):
    k = kernels.get_kernel(SGL)
    mod = SGLANG_JAX.load_kernel_module()
    import jax.numpy as jnp
    for gen, full in (("v5e", False), ("v6e", False), ("tpu7x", True)):
        on_device(gen)
        from kernel.hardware import tpu_info
        cap = int(tpu_info(gen).vmem_capacity_bytes)
        # its VMEM rule, read from its own get_vmem_limit on that device
        assert mod.get_vmem_limit() == k.vmem_limit(cap, generation=gen) == (cap if full else cap // 2)
        for case, rcase in (("decode", mod.RpaCase.DECODE), ("mixed", mod.RpaCase.MIXED),
                            ("verify", mod.RpaCase.MIXED)):
            kk = key(gen, case, t=512, l=4096)
            bs = k.heuristic(kk, max_num_seqs=64)
            d = mod.get_default_block_sizes(jnp.bfloat16, jnp.bfloat16, 32, 8, 128, 128, 512, 64, 4096 // 128,
                                            case=rcase, vmem_limit_bytes=mod.get_vmem_limit())
            assert bs == BlockSizes(d["bq_sz"], d["bkv_sz"], d["bq_csz"], d["bkv_csz"]), (gen, case)
            assert not k.block_size_errors(case, bs, 128)
            assert bs.bq == 1 if case == "decode" else bs.bq <= 32      # its cap outside decode
    assert k.heuristic(key("v4", "decode")) is None                      # it raises on v4
    assert k.vmem_limit(64 << 20, generation="v5p") == 32 << 20         # v5p: half, though TPU7x's size


def test_verify_is_its_stage_only_and_its_workload_is_draft_tokens_on_long_contexts():
    from kernel.workload import ServingLimits
    from rpa_tune.workloads import make_workload
    lim = ServingLimits(page_size=128, max_num_tokens=256, max_num_seqs=128, max_model_len=16384)
    w, origin = make_workload("verify", lim, seed=1)
    lo, hi = w.case_range(Case.VERIFY)
    assert (lo, hi) == w.case_range(Case.MIXED) and hi - lo == 256 // 4 and set(w.q_lens) == {4}
    assert min(w.kv_lens) > 1024 and "verify gen" in origin
    assert "verify" in kernels.get_kernel(SGL).cases and "verify" not in kernels.get_kernel("rpa-tune").cases
    r = run(["sweep", "--tpu", "v6e", "--case", "verify", "--kernel", "tpu-inference", "--dry-run"])
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "verify" in r.stderr


def test_a_decode_config_compiles_deviceless_at_its_vmem_limit():
    from rpa_tune.estimator.sglang import lower
    w = dict(q_lens=[1] * 4, kv_lens=[700, 700, 1500, 1500], distribution=[4, 4, 4])
    model = dict(num_q_heads=8, num_kv_heads=2, head_dim=128, q_dtype="bfloat16", kv_dtype="bfloat16")
    limits = dict(page_size=128, max_num_tokens=16, max_num_seqs=4, max_model_len=2048)
    lowered, name = lower(workload=w, block_sizes=(1, 512, 1, 512), tpu="v6e", model=model, limits=limits,
                          case="decode")
    assert name == "sglang_rpa_decode_bq1_bkv512_cq1_ckv512"
    text = lowered.as_text()
    assert name in text and str(64 << 20) in text         # its VMEM limit on v6e: half of 128 MiB
    lowered.compile()


# ----------------------------------------------------------------------------- export
TUNED = {  # key -> (heuristic, faster config): promoted entries of ours (page 64: not in SGLang-JAX's table)
    key("v6e", "decode", hq=16, hkv=2, page=64, t=2048, l=8192): ((1, 2048, 1, 2048), (1, 1024, 1, 1024)),
    key("v6e", "verify", hq=16, hkv=2, page=64, t=256, l=8192): ((16, 1024, 16, 512), (4, 2048, 4, 1024)),
    key("tpu7x", "mixed", hq=16, hkv=2, page=64, t=512, l=8192): ((8, 1024, 8, 1024), (32, 512, 32, 512)),
    # in SGLang-JAX's own measured table (TPU v6e, decode, 32 x 8 heads, page 128, 64 tokens)
    key("v6e", "decode", hq=32, hkv=8, t=64, l=8192): ((1, 2048, 1, 2048), (1, 512, 1, 512)),
}


def _rows():
    rows = []
    for kk, (heur, best) in TUNED.items():
        extra = dict(kernel=SGL, kernel_version=f"{SGL}==0.1.0rc0", key_id=kernels.key_id(kk, SGL))
        rows.append(row(kk, heur, 3e-4, is_heuristic=True, config_id=f"{kk.id()}/h", **extra))
        rows.append(row(kk, best, 1e-4, is_heuristic=False, config_id=f"{kk.id()}/b", **extra))
    return rows


def _import(path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_export_is_looked_up_by_sglang_jax_own_function(tmp_path, on_device, monkeypatch):
    res = tmp_path / "res"
    write_results(res, _rows())
    f = tmp_path / "tuned_rpa.py"
    r = run(["export", "-r", str(res), "--format", "sglang", "-o", str(f)])     # kernel from the rows
    assert r.returncode == 0, r.stderr
    # the estimate does not replace SGLang-JAX's device-measured entry: the export says so
    assert "kept sglang-jax==0.1.0rc0's device-measured (1, 2048, 1, 2048)" in r.stderr
    ours = _import(f).TUNED_BLOCK_SIZES_V3
    tbs = SGLANG_JAX.module(TBS)
    theirs = {dev: dict(t) for dev, t in tbs.TUNED_BLOCK_SIZES_V3.items()}
    merged = {dev: dict(t) for dev, t in theirs.items()}
    for dev, t in ours.items():                       # as the module's docstring says to merge
        merged.setdefault(dev, {}).update(t)
    monkeypatch.setattr(tbs, "TUNED_BLOCK_SIZES_V3", merged)
    looked = 0
    for kk, (_, best) in TUNED.items():
        on_device(kk.generation)
        dev = {"v6e": "TPU v6e", "tpu7x": "TPU v7"}[kk.generation]
        stage = {"decode": "d", "mixed": "m", "verify": "v"}[kk.case]
        for n in range(1, kk.max_num_tokens + 1):      # every call size up to the bucket, small batches too
            tps = 4 if stage == "v" else None
            got = tbs.get_tuned_block_sizes_v3(stage, "bfloat16", "bfloat16", kk.num_q_heads, kk.num_kv_heads,
                                               kk.head_dim, kk.page_size, n, sliding_window=None, tokens_per_seq=tps)
            their = theirs.get(dev, {}).get((stage, None, "bfloat16", "bfloat16", kk.num_q_heads, kk.num_kv_heads,
                                             kk.head_dim, kk.page_size, 1 << (n - 1).bit_length()))
            assert their is None or kk.page_size == 128
            want = their or best            # theirs where they measured the bucket, ours elsewhere
            if stage == "v":
                want = (min(want[0], tps), want[1], min(want[2], tps), want[3])
            assert got == want, (kk.id(), n, got, want)
            looked += 1
    assert looked == 2048 + 256 + 512 + 64
    # every entry of the module is one their lookup finds
    for dev, t in ours.items():
        for k, v in t.items():
            assert merged[dev][k] == v
    # asked: ours replaces theirs
    g = tmp_path / "replaced.py"
    r = run(["export", "-r", str(res), "--format", "sglang", "--replace-measured", "-o", str(g)])
    assert r.returncode == 0, r.stderr
    assert _import(g).TUNED_BLOCK_SIZES_V3["TPU v6e"][("d", None, "bfloat16", "bfloat16", 32, 8, 128, 128, 64)] \
        == (1, 512, 1, 512)
