"""The profiler's verdicts are kept per lowered program (``profiler.ProgramCache``): the same
program is answered without a compile, with the same cycles and trace; another program
(other block sizes) is compiled."""
import dataclasses
import os

from kernel.config import BlockSizes
from kernel.workload import ModelShape, ServingLimits, Workload
from rpa_tune.estimator import compose, profiler

LLAMA = ModelShape(32, 8, 128)
LIM = ServingLimits(max_num_tokens=64, max_num_seqs=8, page_size=128, max_model_len=2048)


def _request(bs) -> dict:
    w = Workload.of_case("decode", [1, 1], [300, 700])
    return dict(workload=dict(q_lens=list(w.q_lens), kv_lens=list(w.kv_lens), distribution=list(w.distribution)),
                block_sizes=list(bs), tpu="v6e", model=dataclasses.asdict(LLAMA), limits=dataclasses.asdict(LIM),
                case="decode")


def test_a_program_profiled_before_is_not_compiled_again(tmp_path):
    cache = str(tmp_path / "programs")
    first = profiler.profile(compose.OURS_BUILDER, _request(BlockSizes(2, 512, 2, 256)), timeout=600, program_cache=cache)
    assert first["status"] == "ok", first.get("message")
    assert not first.get("program_cached") and first["compile_s"] > 0
    assert len(os.listdir(cache)) == 1
    again = profiler.profile(compose.OURS_BUILDER, _request(BlockSizes(2, 512, 2, 256)), timeout=600, program_cache=cache)
    assert again["program_cached"] and again["compile_s"] == 0.0
    assert (again["cycles"], again["trace"], again["kernels"]) == (first["cycles"], first["trace"], first["kernels"])
    other = profiler.profile(compose.OURS_BUILDER, _request(BlockSizes(2, 256, 2, 256)), timeout=600, program_cache=cache)
    assert other["status"] == "ok" and not other.get("program_cached")
    assert other["cycles"] != first["cycles"] and len(os.listdir(cache)) == 2
