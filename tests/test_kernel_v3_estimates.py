"""Deviceless estimates (libtpu's static profiler, no TPU) of the RPA v3 features on v5e,
v6e and TPU7x: non-causal prefill, ``update_kv_cache=False``, a float8_e5m2 cache, a
head_dim that is not a multiple of 128, attention sinks and the head_dim-64 layout
(``kernel.ragged_paged_attention_hd64``). Each program profiles with cycles and its page
DMAs in the trace; where a feature changes the work, the estimate moves the right way
(non-causal prefill costs more than causal where dead chunks are skipped, no cache update issues fewer writes).
Slow tier: each case compiles a program per generation."""
import dataclasses

import pytest

from kernel.config import BlockSizes
from kernel.workload import ModelShape, ServingLimits, Workload
from rpa_tune.estimator import compose, profiler
from rpa_tune.estimator.trace import TraceStats

pytestmark = pytest.mark.slow

LIM = ServingLimits(page_size=128, max_num_tokens=512, max_num_seqs=16, max_model_len=8192)
LLAMA = ModelShape(32, 8, 128)
GENS = ("v5e", "v6e", "tpu7x")
DECODE = (Workload.of_case("decode", [1] * 3, [300, 1025, 77]), BlockSizes(1, 256, 1, 128))
PREFILL = (Workload.of_case("prefill", [256], [256 + 384]), BlockSizes(128, 256, 128, 128))


def profile(case, workload, bs, gen, model=LLAMA, **options):
    req = dict(workload=dict(q_lens=list(workload.q_lens), kv_lens=list(workload.kv_lens),
                             distribution=list(workload.distribution)),
               block_sizes=list(bs), tpu=gen, model=dataclasses.asdict(model), limits=dataclasses.asdict(LIM),
               case=case, options=options)
    r = profiler.profile(compose.OURS_BUILDER, req, timeout=900)
    assert r["status"] == "ok", r.get("message")
    assert r["cycles"] > 0
    tr = TraceStats.from_json(r["trace"])
    assert tr.dma_issues.get("hbm_to_vmem", 0) > 0, tr.dma_issues
    return r, tr


@pytest.mark.parametrize("gen", GENS)
def test_non_causal_prefill_costs_more_than_causal(gen):
    """Where dead chunks are skipped (v5e, v6e), causal prefill skips the chunks past the
    diagonal and non-causal computes them; TPU7x computes every chunk of a step either way
    (``TpuGeneration.skip_dead_chunks``), so there the two are within a few per cent."""
    from kernel.config import get_generation
    w, bs = PREFILL
    causal, _ = profile("prefill", w, bs, gen)
    full, _ = profile("prefill", w, bs, gen, use_causal_mask=False)
    if get_generation(gen).skip_dead_chunks:
        assert full["cycles"] > causal["cycles"]
    else:
        assert abs(full["cycles"] / causal["cycles"] - 1) < 0.1


@pytest.mark.parametrize("gen", GENS)
@pytest.mark.parametrize("case", ["decode", "prefill"])
def test_no_cache_update_issues_no_cache_write(gen, case):
    w, bs = DECODE if case == "decode" else PREFILL
    writes = lambda tr: sum(n for d, n in tr.dma_issues.items() if d.endswith("to_hbm"))
    _, with_update = profile(case, w, bs, gen)
    _, without = profile(case, w, bs, gen, update_kv_cache=False)
    # the output's writes stay; the cache's are gone (where XLA put the new K/V: VMEM or HBM)
    assert writes(without) < writes(with_update), (without.dma_issues, with_update.dma_issues)


@pytest.mark.parametrize("gen", GENS)
@pytest.mark.parametrize("what", ["e5m2", "head_dim80", "sinks", "hd64", "hd64-fp8-sinks"])
def test_v3_features_are_estimable(gen, what):
    model, options = LLAMA, {}
    if what == "e5m2":
        model = ModelShape(32, 8, 128, kv_dtype="float8_e5m2")
    elif what == "head_dim80":
        model = ModelShape(32, 8, 80)
    elif what == "sinks":
        options = dict(attention_sink=True)
    elif what == "hd64":
        model, options = ModelShape(32, 8, 64), dict(kv_layout="hd64")
    else:
        model = ModelShape(32, 8, 64, kv_dtype="float8_e4m3fn")
        options = dict(kv_layout="hd64", attention_sink=True)
    for case, (w, bs) in (("decode", DECODE), ("prefill", PREFILL)):
        profile(case, w, bs, gen, model, **options)
