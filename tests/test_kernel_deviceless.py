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


@pytest.mark.parametrize("tpu", ["v4", "v5e", "v5p", "v6e", "tpu7x"])
def test_decode_groups_compile_every_generation(tpu):
    """Decode with 2 sequences per KV step (bq = cq = 2: kernel/rpa.py compute_group; 4
    of them at 128 tokens need 8.04 MB of scoped VMEM, past v4's default limit of 8 MB)."""
    compiled = _compile(tpu, "decode", block_sizes={"decode": (2, 128, 2, 128)})
    assert "rpa_decode_bq2_bkv128_cq2_ckv128" in compiled.as_text()


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


def _mosaic_text(monkeypatch, model, tpu, case, block_sizes):
    """The Mosaic MLIR of one case's kernel, as lowered for ``tpu`` (before serialization)."""
    from jax._src import tpu_custom_call
    seen = []
    original = tpu_custom_call._lower_mosaic_module_to_asm

    def spy(module, **kw):
        seen.append(str(module))
        return original(module, **kw)

    monkeypatch.setattr(tpu_custom_call, "_lower_mosaic_module_to_asm", spy)
    limits = ServingLimits(page_size=128, max_num_tokens=512, max_num_seqs=8, max_model_len=2048)
    lower_deviceless(model, limits, tpu, {case: block_sizes}, cases=(case,))
    texts = [t for t in seen if f"rpa_{case}_" in t]
    assert len(texts) == 1, f"expected one rpa_{case} Mosaic module, got {len(texts)}"
    return texts[0]


@pytest.mark.parametrize("kv_dtype,pk,mlir_type", [("bfloat16", 2, "bf16"), ("float8_e4m3fn", 4, "f8E4M3FN")],
                         ids=["bf16", "fp8"])
@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("case,block_sizes", [("decode", (1, 1024, 1, 512)), ("prefill", (64, 512, 64, 256))])
def test_kv_split_is_one_strided_word_load_per_packed_row(monkeypatch, head_dim, case, block_sizes, kv_dtype, pk,
                                                          mlir_type):
    """The compiled-only K/V split (kernel/rpa.py, kv_words), read from the Mosaic the
    compiler receives: the KV block (pages, page, packed rows, pk, Dp) is viewed as uint32
    words, (pages * page * rows, Dp), a word holding pk entries (bf16: one head's (K, V);
    fp8: two heads' (K, V, K, V)), and each packed row's chunk is one load of ckv word
    rows at a stride of one token's packed rows (per 128-lane tile when head_dim > 128).
    A wrong view, stride or shape fails here; the same start and stride arithmetic runs in
    the interpreter (tests/test_kernel_interpret.py), and the byte order within a word is
    the one pltpu.bitcast defines (checked there as well)."""
    import re
    hkv, ckv = 8, block_sizes[3]
    text = _mosaic_text(monkeypatch, ModelShape(32, hkv, head_dim, kv_dtype=kv_dtype), "v6e", case, block_sizes)
    shape = lambda s: [int(d) for d in s.split("x")]
    # the KV scratch buffer: (2 slots, pages, page, rows, pk, Dp)
    bufs = {tuple(shape(m)) for m in re.findall(rf"memref<(2x\d+x128x\d+x{pk}x\d+)x{mlir_type}", text)}
    assert len(bufs) == 1, bufs
    _, pages, page, rows, _, dp = next(iter(bufs))
    assert dp == head_dim and pages * page == block_sizes[1] and rows >= 2 * hkv // pk
    words = pages * page * rows
    casts = re.findall(rf"tpu\.memref_bitcast %\w+ : memref<(\d+x\d+)x{mlir_type}.*?> -> memref<(\d+x\d+)xi32", text)
    # (q / o blocks are viewed as words too: test_q_and_o_blocks_are_strided_word_accesses)
    casts = [(a, b) for a, b in casts if shape(a)[0] == pk * words]
    assert casts and all(shape(a) == [pk * words, dp] and shape(b) == [words, dp] for a, b in casts), casts[:3]
    nt = head_dim // 128
    loads = re.findall(r"tpu\.strided_load %\w+\[[^\]]*\] \{strides = array<i32: (\d+), (\d+)>\} : "
                       r"memref<(\d+x\d+)xi32.*?>, vector<(\d+x\d+)xi32>", text)
    loads = [ld for ld in loads if shape(ld[2])[0] == words * nt]
    assert len(loads) >= (2 * hkv // pk) * nt, f"{len(loads)} strided word loads for {2 * hkv // pk} packed rows"
    for row_stride, lane_stride, src, out in loads:
        assert (int(row_stride), int(lane_stride)) == (rows * nt, 1)
        assert shape(src) == [words * nt, 128]
        assert shape(out) == [ckv, 128]


@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("model_heads", [(32, 8), (16, 8), (8, 1)], ids=["gqa4", "gqa2", "mqa8"])
def test_q_and_o_blocks_are_strided_word_accesses(monkeypatch, head_dim, model_heads):
    """The compiled-only q / o paths (kernel/rpa.py, load_q / finalize) in the Mosaic the
    compiler receives: a bf16 block buffer (2, bq, heads, G, Dp), heads padded by
    kernel.vmem.q_buffer_heads, is viewed as uint32 words (bq * heads * G / 2, Dp), and
    each (KV head, query-head pair) is one strided load of bq word rows (one per
    128-lane tile) at a stride of one token's words; o the same with strided stores. The
    interpreter runs the same starts and strides (tests/test_kernel_interpret.py)."""
    import re
    from kernel.vmem import q_buffer_heads
    hq, hkv = model_heads
    g, bq = hq // hkv, 64
    text = _mosaic_text(monkeypatch, ModelShape(hq, hkv, head_dim), "v6e", "prefill", (bq, 512, bq, 256))
    shape = lambda s: [int(d) for d in s.split("x")]
    heads = q_buffer_heads(hkv, g, "bfloat16")
    assert heads == (hkv + 1 if hkv * g // 2 % 8 == 0 else hkv)
    assert re.search(rf"memref<2x{bq}x{heads}x{g}x{head_dim}xbf16", text)
    words, nt = bq * heads * g // 2, head_dim // 128
    casts = re.findall(r"tpu\.memref_bitcast %\w+ : memref<(\d+x\d+)xbf16.*?> -> memref<(\d+x\d+)xi32", text)
    assert sum(shape(a) == [2 * words, head_dim] and shape(b) == [words, head_dim] for a, b in casts) >= 2
    for op, n in (("strided_load", hkv * g // 2 * nt), ("strided_store", hkv * g // 2 * nt)):
        found = re.findall(rf"tpu\.{op} %\w+\[[^\]]*\](?:, %\w+)? \{{strides = array<i32: (\d+), (\d+)>\}} : "
                           r"memref<(\d+x\d+)xi32.*?>, vector<(\d+x\d+)xi32>", text)
        mine = [f for f in found if shape(f[2])[0] == words * nt]
        assert len(mine) >= n and len(mine) % n == 0, (op, len(mine), n, found[:3])   # per traced body
        assert all((int(a), int(b)) == (heads * g // 2 * nt, 1) and shape(v) == [bq, 128] for a, b, _, v in mine)
