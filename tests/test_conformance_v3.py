"""scripts/conformance_v3.py on a smoke subset: the installed tpu-inference's own v3 and
head_dim-64 kernel tests, with our kernel in place of theirs (the full run is the script:
benchmarks/results/conformance_v3.md). A kernel that returns a wrong output fails its case,
so a pass is the test's own verdict on ours."""
import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("conformance_v3", REPO / "scripts" / "conformance_v3.py")
conf = importlib.util.module_from_spec(spec)
spec.loader.exec_module(conf)

pytestmark = pytest.mark.skipif(conf.tests_dir() is None or importlib.util.find_spec("absl") is None,
                                reason="tpu-inference's tests (tests/kernels) or absl-py not installed")

V3 = "v3::RaggedPagedAttentionKernelTest::"


def test_every_case_of_both_modules_is_listed():
    ids = conf.list_cases()
    assert sum(i.startswith("v3::") for i in ids) >= 60 and sum(i.startswith("hd64::") for i in ids) >= 30
    assert V3 + "test_kv_share_decode_input_kv_is_ignored" in ids


def test_invalid_arguments_and_a_kv_share_case_pass():
    for name in ("test_ragged_paged_attention_soft_cap_cannot_be_zero",
                 "test_kv_share_decode_input_kv_is_ignored"):
        r = conf.run_case(V3 + name)
        assert r["outcome"] == "pass", r


def test_a_wrong_kernel_fails_its_case(monkeypatch):
    import jax.numpy as jnp

    import kernel

    def zeros(queries, *args, **kwargs):        # the right shapes, a wrong output
        return jnp.zeros_like(queries), args[2]

    monkeypatch.setattr(kernel, "ragged_paged_attention", zeros)
    r = conf.run_case(V3 + "test_kv_share_decode_input_kv_is_ignored")
    assert r["outcome"] == "fail" and "np.abs(out1_np).max()) > 0.0" in r["reason"], r


def test_v3_default_block_size_tests_are_skipped_with_the_reason():
    r = conf.run_case("v3::GetDefaultBlockSizesTest::test_kernel_has_no_env_dependency")
    assert r["outcome"] == "skip" and "not a kernel" in r["reason"]
