"""Deviceless compiles with libtpu for real TPU generations (no TPU needed)."""
import pytest

from kernel.analysis import lower_deviceless, parse_vmem_oom
from kernel.config import BlockSizes
from kernel.workload import ModelShape, ServingLimits

LLAMA3_8B = ModelShape(32, 8, 128)


def _compile(tpu, case, page_size=128, max_num_tokens=512, block_sizes=None, **kw):
    limits = ServingLimits(page_size=page_size, max_num_tokens=max_num_tokens, max_num_seqs=128,
                           max_model_len=8192)
    return lower_deviceless(LLAMA3_8B, limits, tpu, block_sizes, cases=(case,), **kw).compile()


@pytest.mark.parametrize("case", ["decode", "prefill", "mixed"])
def test_llama3_8b_heuristic_compiles_v6e(case):
    compiled = _compile("v6e", case)
    assert f"rpa_{case}_" in compiled.as_text()


def test_tpu7x_decode_split_fetch_compute_compiles():
    compiled = _compile("tpu7x", "decode", page_size=256, block_sizes={"decode": (1, 2048, 1, 512)})
    assert "rpa_decode_bq1_bkv2048_cq1_ckv512" in compiled.as_text()


def test_vmem_oom_is_reported_with_bytes():
    # a 16 MiB-per-buffer KV block on v4 (16 MiB VMEM) cannot fit
    with pytest.raises(Exception) as ei:
        _compile("v4", "decode", block_sizes={"decode": BlockSizes(1, 4096, 1, 512)},
                 vmem_limit_bytes=8 << 20)
    info = parse_vmem_oom(str(ei.value))
    assert info is not None, str(ei.value)[:500]
    assert info["used_bytes"] > info["limit_bytes"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("tpu", ["v4", "v5e", "v5p", "v6e", "tpu7x"])
@pytest.mark.parametrize("case", ["decode", "prefill", "mixed"])
@pytest.mark.parametrize("page_size", [128, 256])
@pytest.mark.parametrize("max_num_tokens", [512, 8192])
def test_llama3_8b_heuristic_compiles_every_generation(tpu, case, page_size, max_num_tokens):
    compiled = _compile(tpu, case, page_size=page_size, max_num_tokens=max_num_tokens)
    assert f"rpa_{case}_" in compiled.as_text()
