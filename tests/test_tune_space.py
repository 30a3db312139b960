"""Search spaces: shipped files, legality rules, caps, deterministic enumeration, user files."""
import pytest

from kernel.config import GENERATIONS, BlockSizes, Case, block_size_errors
from kernel.workload import ServingLimits
from rpa_tune.presets import PRESETS, get_preset
from rpa_tune.space import SpaceError, context, enumerate_space, load_space, parse_space

LIMITS = ServingLimits(page_size=128, max_num_tokens=2048, max_num_seqs=128, max_model_len=8192)
LLAMA = get_preset("llama3-8b").model()


@pytest.mark.parametrize("gen", sorted(GENERATIONS))
def test_shipped_spaces_are_legal_and_deterministic(gen):
    space = load_space(gen)
    assert space.generation == gen
    for case in Case:
        for preset in PRESETS.values():
            ctx = context(preset.model(), LIMITS, gen)
            en = enumerate_space(space.for_case(case), ctx)
            assert en.candidates, f"{gen} {case.value} {preset.name}: empty space"
            assert en.candidates == enumerate_space(space.for_case(case), ctx).candidates
            assert en.candidates == sorted(en.candidates), "enumeration must be in ascending order"
            assert len(set(en.candidates)) == len(en.candidates)
            assert en.illegal + en.capped + len(en.candidates) == en.total
            for bs in en.candidates:
                assert not block_size_errors(case, bs, LIMITS.page_size)
                assert bs.bq % bs.cq == 0 and bs.bkv % bs.ckv == 0
                assert bs.bkv % LIMITS.page_size == 0 and bs.ckv % LIMITS.page_size == 0
                assert bs.bq <= LIMITS.max_num_tokens
                assert bs.bkv <= LIMITS.max_model_len
                if case == Case.DECODE:     # sequences per step; groups only for short blocks
                    assert bs.bq == bs.cq and (bs.bq == 1 or bs.bq * bs.bkv <= 4096)


def test_default_decode_space_llama_v6e():
    """The bare sweep's space: one sequence per step at bkv 128..4096 x ckv 128..1024 (page
    multiples), 18 configs, most of them splitting fetch (bkv) from compute (ckv); and 11
    groups of 2, 4 or 8 short sequences per step (bkv = ckv, bq * bkv <= 4096)."""
    en = enumerate_space(load_space("v6e").for_case("decode"), context(LLAMA, LIMITS, "v6e"))
    single = [bs for bs in en.candidates if bs.bq == 1]
    groups = [bs for bs in en.candidates if bs.bq > 1]
    assert len(single) == 18 and len(groups) == 11
    assert {bs.bkv for bs in single} == {128, 256, 512, 1024, 2048, 4096}
    assert {bs.ckv for bs in single} == {128, 256, 512, 1024}
    assert sum(bs.bkv != bs.ckv for bs in single) == 14
    assert {bs.bq for bs in groups} == {2, 4, 8}
    assert all(bs.bkv == bs.ckv and bs.bq * bs.bkv <= 4096 for bs in groups)
    # the size caps are what stop bkv at 4096 (16 MiB of merged K+V per block)
    assert en.reasons.get("bq * bkv * kv_bytes_per_token <= 16 * MiB", 0) > 0


def test_caps_scale_with_the_shape():
    """A 1-KV-head shard (4x less KV per token than head_dim 128 x 8 heads) gets longer blocks."""
    small = get_preset("llama3-70b-tp8").model()
    en = enumerate_space(load_space("tpu7x").for_case("decode"), context(small, LIMITS, "tpu7x"))
    assert max(bs.bkv for bs in en.candidates) == 8192   # capped by max_model_len, not bytes
    assert max(bs.ckv for bs in en.candidates) == 4096


def test_page_size_and_token_bucket_rules():
    lim = ServingLimits(page_size=256, max_num_tokens=128, max_num_seqs=64, max_model_len=4096)
    ctx = context(LLAMA, lim, "v6e")
    en = enumerate_space(load_space("v6e").for_case("prefill"), ctx)
    assert all(bs.bkv % 256 == 0 and bs.ckv % 256 == 0 for bs in en.candidates)
    assert all(bs.bq <= 128 for bs in en.candidates)
    assert {bs.bq for bs in en.candidates} == {32, 64, 128}
    # cq * group <= 512 on v6e (group 4)
    assert all(bs.cq * 4 <= 512 for bs in en.candidates)


def test_user_space_file(tmp_path):
    f = tmp_path / "mine.toml"
    f.write_text('''
rules = ["bq % cq == 0", "bkv % ckv == 0"]
[decode]
bq = [1]
cq = [1]
bkv = [512, 256, 512]
ckv = [256, 128]
caps = ["bkv * kv_bytes_per_token <= 2 * MiB"]
''')
    space = load_space("v5e", f)
    assert space.generation is None
    en = enumerate_space(space.for_case("decode"), context(LLAMA, LIMITS, "v5e"))
    assert en.candidates == [BlockSizes(1, 256, 1, 128), BlockSizes(1, 256, 1, 256),
                             BlockSizes(1, 512, 1, 128), BlockSizes(1, 512, 1, 256)]
    with pytest.raises(SpaceError, match=r"no \[prefill\] table"):
        space.for_case("prefill")


@pytest.mark.parametrize("doc,match", [
    ({"decode": {"bq": [1], "cq": [1], "bkv": [128], "ckv": [128], "rules": ["bkv < foo"]}}, "unknown name 'foo'"),
    ({"decode": {"bq": [1], "cq": [1], "bkv": [128], "ckv": [128], "rules": ["__import__('os')"]}}, "calls something"),
    ({"decode": {"bq": [1], "cq": [1], "bkv": [128], "ckv": [128], "rules": ["bq.real == 1"]}}, "Attribute"),
    ({"decode": {"bq": [1], "cq": [1], "bkv": [128], "ckv": [128], "rules": ["bq =="]}}, "not a valid expression"),
    ({"decode": {"bq": [1], "cq": [1], "bkv": [], "ckv": [128]}}, "non-empty list"),
    ({"decode": {"bq": [1], "cq": [1], "bkv": [128]}}, "missing candidate lists"),
    ({"decode": {"bq": [1], "cq": [1], "bkv": [128], "ckv": [128], "bogus": 1}}, "unknown keys"),
    ({"generation": "v9", "decode": {"bq": [1], "cq": [1], "bkv": [128], "ckv": [128]}}, "unknown TPU generation"),
    ({}, "defines none of the cases"),
])
def test_bad_space_files_are_rejected_with_a_reason(doc, match):
    with pytest.raises(SpaceError, match=match):
        parse_space(doc, "test.toml")


def test_space_for_another_generation_is_refused(tmp_path):
    f = tmp_path / "v4.toml"
    f.write_text((load_space("v4").source and open(load_space("v4").source).read()))
    with pytest.raises(SpaceError, match="is for generation 'v4', not 'v6e'"):
        load_space("v6e", f)
    with pytest.raises(SpaceError, match="not valid TOML"):
        (tmp_path / "bad.toml").write_text("[decode\n")
        load_space("v6e", tmp_path / "bad.toml")
