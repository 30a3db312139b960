"""The public RPA v3 kernel (tpu-inference, pinned) under the project's estimator."""
import importlib.util

import pytest

from rpa_tune import public_kernel

MODEL = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, q_dtype="bfloat16", kv_dtype="bfloat16")
LIMITS = dict(page_size=256, max_num_tokens=2048, max_num_seqs=128, max_model_len=8192)
INSTALL = f"pip install --no-deps tpu-inference=={public_kernel.PINNED_VERSION}"

needs_public = pytest.mark.skipif(importlib.util.find_spec("tpu_inference") is None,
                                  reason=f"tpu-inference is not installed ({INSTALL})")


def _request(workload, block_sizes, tpu="v6e", case="decode", options=None):
    return dict(workload=workload, block_sizes=list(block_sizes), tpu=tpu, model=MODEL, limits=LIMITS,
                case=case, options=options or {})


def _decode(n, ctx):
    return dict(q_lens=[1] * n, kv_lens=[ctx] * n, distribution=[n, n, n])


def test_missing_package_names_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setattr(public_kernel, "SEARCH_PATH", [str(tmp_path)])
    assert public_kernel.locate() is None
    assert public_kernel.installed_version() is None
    with pytest.raises(public_kernel.PublicKernelMissing) as e:
        public_kernel.load_kernel_module()
    msg = str(e.value)
    assert "\n" not in msg and INSTALL in msg


def test_version_mismatch_is_refused(monkeypatch):
    monkeypatch.setattr(public_kernel, "locate", lambda: "/somewhere/tpu_inference")
    monkeypatch.setattr(public_kernel, "installed_version", lambda: "0.0.1")
    with pytest.raises(public_kernel.PublicKernelMissing, match="0.0.1.*pinned to 0.32.0") as e:
        public_kernel.load_kernel_module()
    assert INSTALL in str(e.value)


@needs_public
def test_kernel_module_imports_without_vllm():
    import sys
    assert public_kernel.installed_version() == public_kernel.PINNED_VERSION
    k = public_kernel.load_kernel_module()
    assert k.__name__ == public_kernel.KERNEL_MODULE and hasattr(k, "ragged_paged_attention")
    assert "vllm" not in sys.modules


@needs_public
def test_tiny_decode_estimate_v6e():
    """4 decode sequences of 1024 tokens, page 256: every KV page is fetched (16 DMAs
    into VMEM) and the attention matmuls are in the trace."""
    from rpa_tune.estimator import profiler
    from rpa_tune.estimator.public import kernel_name
    from rpa_tune.estimator.trace import TraceStats
    r = profiler.profile("rpa_tune.estimator.public:lower", _request(_decode(4, 1024), (1, 512, 1, 512)),
                         timeout=300, rss_cap=3 << 30)
    assert r["status"] == "ok", r.get("message")
    assert r["cycles"] > 0
    assert r["kernels"] and all(k.startswith(kernel_name("decode", (1, 512, 1, 512))) for k in r["kernels"])
    trace = TraceStats.from_json(r["trace"])
    assert trace.dma_issues.get("hbm_to_vmem") == 16           # 4 sequences x 4 pages
    assert trace.granules("hbm_to_vmem") > 0                   # the prologue's page DMAs have static sizes
    assert trace.mxu_matmuls > 0 and trace.mxu_pushes > 0


@needs_public
def test_lower_rejects_bad_requests():
    from rpa_tune.estimator.public import lower
    with pytest.raises(ValueError, match="no prefill sequences"):
        lower(**_request(_decode(2, 512), (1, 256, 1, 256), case="prefill"))
    with pytest.raises(ValueError, match="same q_len"):
        lower(**_request(dict(q_lens=[128, 256], kv_lens=[128, 256], distribution=[0, 2, 2]),
                         (128, 256, 128, 256), case="prefill"))
    with pytest.raises(ValueError, match="unknown options"):
        lower(**_request(_decode(2, 512), (1, 256, 1, 256), options={"nope": 1}))


@needs_public
@pytest.mark.slow
def test_causal_prefill_matches_its_q_blocks():
    """Causal prefill 1 x 512 in q blocks of 128 costs about what its four q blocks cost as
    single-block workloads (a q block of r rows ending at e = a sequence q_len r, kv_len e):
    the causal KV loop's trip count is followed per q block. (v6e: on TPU7x a prefill
    sequence of several q blocks aborts the profiler.)"""
    from rpa_tune.estimator import profiler
    from rpa_tune.estimator.trace import TraceStats
    tpu, bs = "v6e", (128, 256, 128, 256)
    whole = profiler.profile("rpa_tune.estimator.public:lower",
                             _request(dict(q_lens=[512], kv_lens=[512], distribution=[0, 1, 1]), bs, tpu,
                                      "prefill"), timeout=900, rss_cap=4 << 30)
    assert whole["status"] == "ok", whole.get("message")
    parts = [profiler.profile("rpa_tune.estimator.public:lower",
                              _request(dict(q_lens=[128], kv_lens=[e], distribution=[0, 1, 1]), bs, tpu,
                                       "prefill"), timeout=900, rss_cap=4 << 30)
             for e in (128, 256, 384, 512)]
    assert all(p["status"] == "ok" for p in parts)
    mm = lambda r: TraceStats.from_json(r["trace"]).mxu_matmuls
    assert mm(whole) == sum(mm(p) for p in parts)
    assert 0.6 < whole["cycles"] / sum(p["cycles"] for p in parts) < 1.2


@pytest.mark.slow
def test_lowers_and_compiles_for_v4_where_the_kernel_has_no_defaults():
    """On v4 the public wrapper has no default block sizes (it raises): the lowering gives the
    cases it does not target the target's sizes, and the program compiles deviceless for v4
    (the compiler's VMEM verdict; v4's profiler refuses every program)."""
    from rpa_tune.estimator import public
    lowered, name = public.lower(workload=dict(q_lens=[1] * 8, kv_lens=[1024] * 8, distribution=[8, 8, 8]),
                                 block_sizes=[1, 1024, 1, 512], tpu="v4",
                                 model=dict(num_q_heads=32, num_kv_heads=8, head_dim=128),
                                 limits=dict(page_size=256, max_num_tokens=512, max_num_seqs=8, max_model_len=2048),
                                 case="decode")
    assert name.startswith("public_rpa_decode")
    lowered.compile()
