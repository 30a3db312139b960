"""Work counts (kernel.metrics, rpa_tune.estimator.audit.needed) against brute-force counts."""
import numpy as np
import pytest

from kernel import metrics
from kernel.workload import ModelShape, Workload
from rpa_tune.estimator import audit

MODEL = ModelShape(32, 8, 128)


def _visible(q_len, kv_len, window):
    """(query position, key position) pairs a causal, optionally windowed, query sees."""
    ctx = kv_len - q_len
    return [(p, k) for p in range(ctx, kv_len) for k in range(p + 1) if not window or k > p - window]


def test_decode_bytes_are_the_papers_formula():
    n, ctx = 5, 300
    w = Workload.of_case("decode", [1] * n, [ctx] * n)   # the paper's ctx is kv_len (new token included)
    hkv, hq, d = MODEL.num_kv_heads, MODEL.num_q_heads, MODEL.head_dim
    assert metrics.hbm_bytes(w, MODEL) == n * d * ((ctx + 1) * 2 * hkv + 2 * hq) * 2


@pytest.mark.parametrize("window", [None, 1, 7, 64])
@pytest.mark.parametrize("q_len,kv_len", [(1, 1), (1, 200), (5, 5), (40, 90), (3, 300)])
def test_bytes_flops_and_needed_reads_count_what_the_queries_see(window, q_len, kv_len):
    w = Workload.of_case("mixed" if q_len > 1 else "decode", [q_len], [kv_len])
    pairs = _visible(q_len, kv_len, window)
    keys = {k for _, k in pairs}
    ctx = kv_len - q_len
    tok = 2 * MODEL.num_kv_heads * MODEL.head_dim * 2            # bf16 K+V of a token
    qo = q_len * 2 * MODEL.num_q_heads * MODEL.head_dim * 2
    assert metrics.hbm_bytes(w, MODEL, sliding_window=window) == (len(keys) + q_len) * tok + qo
    assert metrics.flops(w, MODEL, sliding_window=window) == 4 * MODEL.num_q_heads * MODEL.head_dim * len(pairs)
    need = audit.needed(w, MODEL, sliding_window=window)
    assert need.kv_read_bytes == len({k for k in keys if k < ctx}) * tok
    assert need.kv_write_bytes == q_len * tok
    assert need.hbm_bytes == metrics.hbm_bytes(w, MODEL, sliding_window=window)
    assert np.isfinite(need.flops)
