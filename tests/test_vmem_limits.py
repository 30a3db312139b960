"""VMEM verdicts at the limit each tuned kernel runs with (tpu-inference: all of VMEM).

The compile tests check the tuner's deviceless verdict against the compiler itself: a plain
compile (no profiler, what a server compiles) at the kernel's limit and at half of it."""
import dataclasses
import importlib.util

import pytest

from kernel.config import BlockSizes
from kernel.hardware import tpu_info
from kernel.workload import ModelShape, ServingLimits, Workload
from rpa_tune.estimator import profiler
from rpa_tune.evaluators import base
from rpa_tune.kernels import get_kernel

MiB = 1 << 20
PUBLIC = "rpa_tune.estimator.public:lower"
needs_public = pytest.mark.skipif(importlib.util.find_spec("tpu_inference") is None,
                                  reason="tpu-inference is not installed")


def _task(kernel, gen="tpu7x", bs=BlockSizes(1, 4096, 1, 1024), model=ModelShape(16, 8, 128), page=128,
          workload=None, max_model_len=8192):
    lim = ServingLimits(page_size=page, max_num_tokens=256, max_num_seqs=16, max_model_len=max_model_len)
    w = workload or Workload.of_case("decode", [1, 1], [512, 512])
    return base.Task("compile", gen, "decode", model, lim, w, bs, timeout=1800, kernel=kernel)


@pytest.mark.parametrize("gen", ["v5e", "v5p", "v6e", "tpu7x"])
def test_each_kernel_states_the_limit_it_runs_with(gen):
    """tpu-inference: all of VMEM (its call's default), for the compile backend's first
    compile and its device call alike; ours: its own call's default for its scratch."""
    cap = int(tpu_info(gen).vmem_capacity_bytes)
    pub, ours = get_kernel("tpu-inference"), get_kernel("rpa-tune")
    t = _task("tpu-inference", gen)
    assert pub.vmem_limit(cap) == cap == base.task_vmem_limit(t, pub, cap)
    assert ours.vmem_limit(cap, 4 * MiB) == base.initial_vmem_limit(4 * MiB, cap) == 16 * MiB
    t = _task("rpa-tune", gen)
    assert base.task_vmem_limit(t, ours, cap) == base.initial_vmem_limit(
        ours.predicted_vmem_bytes(t.model, t.limits, t.bs, t.case), cap) <= cap // 2


def test_profiled_compiles_of_the_public_kernel_get_the_vmem_size_override():
    """At scoped limit L the profiled program needs L more than the plain one: VMEM = the
    chip's + L; a caller's override (the VMEM the plain program is judged with) is replaced
    by it + L; our kernel's flags are left alone."""
    cap = int(tpu_info("tpu7x").vmem_capacity_bytes)
    flag = profiler.VMEM_OVERRIDE_FLAG
    req = dict(tpu="tpu7x", options={})
    assert profiler.deviceless_vmem_args(PUBLIC, req) == f"{flag}={2 * cap // 1024}"     # L = cap
    req = dict(tpu="tpu7x", options={"vmem_limit_bytes": 20 * MiB})
    assert profiler.deviceless_vmem_args(PUBLIC, req, "--x=1") == f"--x=1 {flag}={(cap + 20 * MiB) // 1024}"
    assert profiler.deviceless_vmem_args(PUBLIC, req, f"{flag}={2 * cap // 1024}") == \
        f"{flag}={(2 * cap + 20 * MiB) // 1024}"
    ours = "rpa_tune.estimator.ours:lower"
    assert profiler.deviceless_vmem_args(ours, req, "") == ""
    assert profiler.deviceless_vmem_args(ours, req, f"{flag}=5") == f"{flag}=5"


def _request(t, limit=None):
    w = t.workload
    opts = {} if limit is None else {"vmem_limit_bytes": int(limit)}
    return dict(workload=dict(q_lens=list(w.q_lens), kv_lens=list(w.kv_lens), distribution=list(w.distribution)),
                block_sizes=list(t.bs), tpu=t.generation, model=dataclasses.asdict(t.model),
                limits=dataclasses.asdict(t.limits), case=t.case, options=opts)


def _plain(t, limit):
    """The compiler's verdict without the profiler (a server's compile) at ``limit``."""
    from rpa_tune.evaluators.compile import CompileEvaluator
    return CompileEvaluator(profile=False)._plain_compile(t, int(limit), 600)


@needs_public
def test_a_config_needing_between_half_and_all_of_vmem_is_feasible_for_tpu_inference():
    """16 q / 8 KV heads, head_dim 128, (1, 4096, 1, 1024) on TPU7x: ~36 MiB of scratch.
    The plain compile fails at half the VMEM and fits at all of it; the profiled compile at
    the kernel's own limit (no limit given) fits and has an estimate."""
    t = _task("tpu-inference")
    cap = int(tpu_info("tpu7x").vmem_capacity_bytes)
    half = _plain(t, cap // 2)
    assert half["status"] == base.VMEM_OOM and half["vmem"]["kind"] == "scoped_limit", half
    assert cap // 2 < half["vmem"]["used_bytes"] < cap
    assert _plain(t, cap)["status"] == "ok"
    r = profiler.profile(PUBLIC, _request(t), timeout=600, bundles=False, rss_cap=6 << 30)
    assert r["status"] == "ok" and r["cycles"] > 0, r.get("message")


@needs_public
def test_a_config_needing_more_than_all_of_vmem_is_vmem_oom_for_tpu_inference():
    """(1, 8192, 1, 1024), twice the KV block: ~72 MiB of scratch, over TPU7x's 64 MiB.
    The plain compile fails at all of VMEM, and so does the profiled one."""
    t = _task("tpu-inference", bs=BlockSizes(1, 8192, 1, 1024))
    cap = int(tpu_info("tpu7x").vmem_capacity_bytes)
    assert _plain(t, cap)["status"] == base.VMEM_OOM
    r = profiler.profile(PUBLIC, _request(t), timeout=600, bundles=False, rss_cap=6 << 30)
    assert r["status"] == base.VMEM_OOM and r["vmem"]["used_bytes"] > cap, r.get("message")


@needs_public
@pytest.mark.slow
def test_pr_3102_split_and_default_are_priced_on_tpu7x(tmp_path, monkeypatch):
    """vllm-project/tpu-inference PR #3102's TPU7x decode split on a Qwen3-0.6B TP4 shard
    (4 q / 2 KV heads, head_dim 128, page 256, max_model_len 24576; 16 sequences of 4,608
    context): fetch 16384 / compute 4096 and the default 16384 / 16384 each need ~48 MiB
    of scratch, over half of TPU7x's VMEM. Both are priced at all of VMEM, audited
    complete, and the split below the default, as the PR measured on a device."""
    from kernel.analysis import quiet_libtpu
    from rpa_tune.estimator import compose
    from rpa_tune.evaluators.compile import CompileEvaluator
    quiet_libtpu()
    monkeypatch.setenv(compose.CACHE_ENV, str(tmp_path))       # compiled here, not read from a cache
    cap = int(tpu_info("tpu7x").vmem_capacity_bytes)
    w = Workload.of_case("decode", [1] * 16, [4608] * 16)
    out = {}
    for bs in (BlockSizes(1, 16384, 1, 4096), BlockSizes(1, 16384, 1, 16384)):
        t = _task("tpu-inference", bs=bs, model=ModelShape(4, 2, 128), page=256, workload=w, max_model_len=24576)
        assert _plain(t, cap // 2)["status"] == base.VMEM_OOM        # the old half-VMEM rule rejected it
        r = CompileEvaluator().evaluate(t)
        assert r.status == base.OK and r.audit == "complete" and r.metric > 0, r.message
        assert r.vmem_limit_bytes == cap
        out[bs.bkv // bs.ckv] = r.metric
    assert out[4] < out[1]
