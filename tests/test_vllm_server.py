"""vLLM-TPU as it calls tpu-inference's kernel: the mixed step it sends (decode sequences to the
decode kernel, prefill chunks with and without cached context to the mixed one) and the
``export --format vllm-env`` lines (DECODE and MIXED only, one tuple per server shape chosen
over the traffic's token buckets, per-bucket gains over the kernel's own default, warnings)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernel.config import Case
from kernel.workload import ServingLimits
from rpa_tune import kernels
from rpa_tune.workloads import MIXED_CHUNK, make_workload, workload_id
from tables_synth import key, row, write_results

RPA_TUNE = str(Path(sys.executable).with_name("rpa-tune"))
PUB = "tpu-inference"


def run(args):
    return subprocess.run([RPA_TUNE, *args], capture_output=True, text=True, env=dict(os.environ), timeout=600)


# ----------------------------------------------------------------------------- the mixed step
@pytest.mark.parametrize("t", [16, 64, 256, 1024, 2048, 8192])
@pytest.mark.parametrize("seqs", [8, 128])
def test_vllm_mixed_step_splits_decode_from_mixed_and_fills_its_bucket(t, seqs):
    lim = ServingLimits(page_size=128, max_num_tokens=t, max_num_seqs=seqs, max_model_len=8192)
    w, origin = make_workload("mixed", lim, kernel=PUB)
    w.check_fits(lim)
    d0, d1, n = w.distribution
    assert d0 == d1, "no prefill-kernel sequences: vLLM-TPU never passes chunk_prefill_size"
    assert all(q == 1 for q in w.q_lens[:d0]) and all(q > 1 for q in w.q_lens[d1:]), \
        "one-token sequences go to the decode kernel, the rest to the mixed kernel"
    assert t // 2 < w.num_tokens <= t, "a step a server pads to bucket t holds more than t / 2 tokens"
    mixed = list(zip(w.q_lens[d1:], w.kv_lens[d1:]))
    chunk_q = mixed[0][0]
    assert mixed[0][1] == chunk_q, "the first prefill chunk is a new prompt's (no cached context)"
    if t >= 64:
        assert d0 > 0, "decode tokens share the step"
        cont = [(q, kv) for q, kv in mixed[1:] if abs(q - chunk_q) <= 1]   # the other chunks
        assert any(kv > q for q, kv in cont), "continuing chunks with cached context"
    assert len(set(zip(w.q_lens, w.kv_lens))) <= 10
    # seeded; our kernel keeps its own generator (all sequences in the mixed range)
    assert workload_id(make_workload("mixed", lim, kernel=PUB)[0]) == workload_id(w)
    ours, _ = make_workload("mixed", lim, kernel="rpa-tune")
    assert ours.case_range(Case.MIXED) == (0, ours.num_seqs)


def test_vllm_mixed_chunks_are_at_most_the_chunk_with_many_sequences():
    lim = ServingLimits(page_size=128, max_num_tokens=8192, max_num_seqs=128, max_model_len=8192)
    w, _ = make_workload("mixed", lim, kernel=PUB)
    d = w.distribution[1]
    assert max(w.q_lens[d:]) <= MIXED_CHUNK and w.num_tokens == 8192


# ----------------------------------------------------------------------------- vllm-env
BUCKETS = (256, 1024, 4096)
# per case: two candidate tuples and their metrics per bucket, and the default's
DECODE_A, DECODE_B = (1, 1024, 1, 512), (1, 2048, 1, 1024)
MIXED_A, MIXED_B = (64, 512, 32, 256), (32, 1024, 16, 512)
METRICS = {  # bucket -> (default, A, B) in us
    "decode": {256: (3.0, 1.0, 2.0), 1024: (3.0, 2.5, 1.5), 4096: (9.0, 8.0, 5.0)},
    "mixed": {256: (30.0, 10.0, 20.0), 1024: (30.0, 25.0, 15.0), 4096: (90.0, 80.0, 50.0)},
}


def _rows(hq=32, hkv=8, d=128, sw=False, cases=("decode", "mixed", "prefill")):
    k = kernels.get_kernel(PUB)
    out, defaults = [], {}
    for case in cases:
        a, b = {"decode": (DECODE_A, DECODE_B), "mixed": (MIXED_A, MIXED_B),
                "prefill": ((64, 512, 32, 256), (128, 512, 64, 256))}[case]
        for t in BUCKETS:
            kk = key("v6e", case, hq=hq, hkv=hkv, d=d, t=t, l=8192, sw=sw)
            h = tuple(k.heuristic(kk))
            assert h not in (a, b)
            defaults[(case, t)] = h
            md, ma, mb = METRICS.get(case, METRICS["mixed"])[t]
            extra = dict(kernel=PUB, kernel_version=f"{PUB}==0.32.0", key_id=kernels.key_id(kk, PUB), workload="w")
            for bs, m, tag in ((h, md, "h"), (a, ma, "a"), (b, mb, "b")):
                out.append(row(kk, bs, m * 1e-6, is_heuristic=bs == h, config_id=f"{kk.id()}/{tag}", **extra))
    return out, defaults


def _env(stdout):
    env = {}
    for line in stdout.splitlines():
        if line and not line.startswith("#"):
            name, _, val = line.partition("=")
            env.setdefault(name, []).append(tuple(int(x) for x in val.split(",")))
    return env


def _expected(case, weights):
    """The tuple of least weighted total time, by hand."""
    tot = {i: sum(weights[t] * METRICS[case][t][i] for t in BUCKETS) for i in (1, 2)}
    return {1: DECODE_A if case == "decode" else MIXED_A, 2: DECODE_B if case == "decode" else MIXED_B}[
        min(tot, key=tot.get)], min(tot, key=tot.get)


def test_vllm_env_has_decode_and_mixed_only_chosen_over_the_buckets(tmp_path):
    rows, defaults = _rows()
    res = tmp_path / "res"
    write_results(res, rows)
    r = run(["export", "-r", str(res), "--format", "vllm-env"])
    assert r.returncode == 0, r.stderr
    env = _env(r.stdout)
    want_d, i_d = _expected("decode", {t: 1 for t in BUCKETS})
    want_m, i_m = _expected("mixed", {t: 1 for t in BUCKETS})
    assert env == {"RPA_V3_DECODE_BLOCK_SIZES": [want_d], "RPA_V3_MIXED_BLOCK_SIZES": [want_m]}
    assert "RPA_V3_PREFILL_BLOCK_SIZES=" not in r.stdout and "chunk_prefill_size" in r.stdout
    assert "0.30.0" in r.stdout and "#3395" in r.stdout
    # one line per bucket with its expected gain over that bucket's own default
    for case, i in (("decode", i_d), ("mixed", i_m)):
        for t in BUCKETS:
            md, chosen = METRICS[case][t][0], METRICS[case][t][i]
            line = next(l for l in r.stdout.splitlines() if l.startswith(f"#   {case} {t:>5} tokens"))
            assert f"{md / chosen - 1:+.1%}" in line and str(defaults[(case, t)]) in line and "(estimate)" in line
    # a server's traffic, mostly small decode and mixed steps: the other tuple wins
    traffic = tmp_path / "traffic.csv"
    traffic.write_text("case,tokens,count\ndecode,200,100\ndecode,1000,1\ndecode,3000,1\n"
                       "mixed,130,100\nmixed,900,1\nmixed,4000,1\nmixed,9000,5\n")
    r2 = run(["export", "-r", str(res), "--format", "vllm-env", "--traffic", str(traffic)])
    assert r2.returncode == 0, r2.stderr
    w = {256: 100, 1024: 1, 4096: 1}
    assert _env(r2.stdout) == {"RPA_V3_DECODE_BLOCK_SIZES": [_expected("decode", w)[0]],
                               "RPA_V3_MIXED_BLOCK_SIZES": [_expected("mixed", w)[0]]}
    assert _expected("decode", w)[0] != want_d
    assert "5 calls above the largest tuned bucket" in r2.stderr


def test_vllm_env_warns_for_head_dim_64_and_sliding_window(tmp_path):
    rows = _rows(hq=16, hkv=8, d=64, cases=("decode",))[0] + _rows(sw=True, cases=("mixed",))[0]
    res = tmp_path / "res"
    write_results(res, rows)
    r = run(["export", "-r", str(res), "--format", "vllm-env"])
    assert r.returncode == 0, r.stderr
    groups = r.stdout.split("\n\n")
    hd64 = next(g for g in groups if "head_dim 64" in g)
    assert "kernel_hd64.py" in hd64 and "WARNING" in hd64
    assert not _env(hd64), "nothing is set that the head_dim-64 kernel would ignore"
    assert f"# RPA_V3_DECODE_BLOCK_SIZES={','.join(map(str, _expected('decode', {t: 1 for t in BUCKETS})[0]))}" in hd64
    sw = next(g for g in groups if "sliding window" in g)
    assert "WARNING" in sw and "global-attention layers" in sw and _env(sw)


@pytest.mark.parametrize("text,match", [
    ("case,tokens\nprefill,64\n", "not one vLLM-TPU launches"),
    ("tokens\n64\n", "needs a header with case,tokens"),
    ("case,tokens,count\ndecode,x,1\n", "must be numbers"),
    ("{\"decode\": [1, 2]}", "must map token counts"),
    ("case,tokens,count\ndecode,64,0\n", "has no calls"),
])
def test_bad_traffic_files_are_one_line_and_exit_2(tmp_path, text, match):
    res = tmp_path / "res"
    write_results(res, _rows(cases=("decode",))[0])
    f = tmp_path / "t.csv"
    f.write_text(text)
    r = run(["export", "-r", str(res), "--format", "vllm-env", "--traffic", str(f)])
    assert r.returncode == 2 and match in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = run(["export", "-r", str(res), "--format", "sglang", "--traffic", str(f)])
    assert r.returncode == 2 and "--traffic applies to --format vllm-env" in r.stderr


def test_traffic_json_forms_agree(tmp_path):
    from rpa_tune.server_formats import read_traffic
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps([{"case": "decode", "tokens": 64, "count": 3}, {"case": "mixed", "tokens": 512}]))
    b.write_text(json.dumps({"decode": {"64": 3}, "mixed": {"512": 1}}))
    assert read_traffic(a) == read_traffic(b) == {"decode": {64: 3.0}, "mixed": {512: 1.0}}
