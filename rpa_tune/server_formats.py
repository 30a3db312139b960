"""Tuned tables of tpu-inference's RPA v3 in the forms its servers read.

* ``vllm_env``: environment lines for vLLM-TPU. tpu-inference (0.32.0) reads
  ``RPA_V3_DECODE_BLOCK_SIZES``, ``RPA_V3_PREFILL_BLOCK_SIZES`` and
  ``RPA_V3_MIXED_BLOCK_SIZES``, each ``bq,bkv,cq,ckv``, and passes them to the kernel as its
  ``d/p/m_block_sizes`` (``tpu_inference/envs.py``, ``rpa_block_size_kwargs``). The
  variables are process-wide, so the lines come in one group per server shape (everything
  of a key but its case); a user keeps the group of their deployment.
* ``sglang_module``: a Python module with SGLang-JAX's v3 table layout
  (``sgl_jax/srt/kernels/ragged_paged_attention/tuned_block_sizes_v3.py``):
  ``TUNED_BLOCK_SIZES_V3[device_name][key] = (bq, bkv, cq, ckv)`` with ``key = (stage,
  sliding_window, q_dtype, kv_dtype, q_heads, kv_heads, head_dim, page_size,
  max_num_tokens)``; ``stage`` is ``d``, ``p``, ``m`` or ``v`` (verify); ``sliding_window``
  None or the window in tokens; heads, page size and token count as its lookup normalises
  them (next power of two; ``head_dim`` rounded up to 128); ``device_name`` as its
  ``get_device_name`` spells the device (``TPU v6e``, ``TPU v5e``, ``TPU v7`` ...). The
  module also has ``lookup(...)`` with the same normalisation, so it can be checked alone.
  SGLang-JAX keys each call by its own padded token count, so every power-of-two bucket
  from 1 token up to a shape's largest tuned bucket gets an entry: the tuned bucket's own,
  or, for a bucket no sweep priced, the nearest tuned bucket's (a comment says which).
  Where the installed sglang-jax's table already holds a key (entries it measured on a
  device), an entry of ours that was not measured is left out, with a note, and theirs
  stays in force after the merge (``replace_measured`` writes ours over them).

Only promoted entries are written (an entry that kept the kernel's default adds nothing a
server does not already do); the others appear as comments saying why.
"""
from __future__ import annotations

import re

from kernel.config import TuningKey, get_generation
from kernel.tables import Entry, Table

CASE_VARS = {"decode": "RPA_V3_DECODE_BLOCK_SIZES", "prefill": "RPA_V3_PREFILL_BLOCK_SIZES",
             "mixed": "RPA_V3_MIXED_BLOCK_SIZES"}
STAGES = {"decode": "d", "prefill": "p", "mixed": "m", "verify": "v"}


def _entries(tables: dict[str, Table]) -> list[Entry]:
    return [e for g in sorted(tables) for e in tables[g].entries]


def _shape(key: TuningKey) -> tuple:
    return (key.generation, key.q_dtype, key.kv_dtype, key.num_q_heads, key.num_kv_heads, key.head_dim,
            key.page_size, key.max_num_tokens, key.max_model_len, key.sliding_window)


def _header(tables: dict[str, Table], comment: str) -> list[str]:
    versions = sorted({str(t.info.get("kernel_version")) for t in tables.values() if t.info.get("kernel_version")})
    methods = sorted({e.method for e in _entries(tables)})
    how = {"estimate": "estimate: deviceless libtpu compile, audited static-profiler cycles",
           "measured": "measured on a TPU"}
    return [f"{comment} Block sizes for tpu-inference's RPA v3 ({', '.join(versions) or 'version unknown'}), "
            f"written by `rpa-tune export`.",
            f"{comment} Method: {'; '.join(how.get(m, m) for m in methods)}."]


def vllm_env(tables: dict[str, Table]) -> str:
    """``NAME=bq,bkv,cq,ckv`` lines per server shape, each group under a comment naming it."""
    groups: dict[tuple, list[Entry]] = {}
    for e in _entries(tables):
        groups.setdefault(_shape(e.key), []).append(e)
    lines = _header(tables, "#")
    lines.append("# One group per server shape: put the lines of yours in the environment of vLLM.")
    for shape, es in sorted(groups.items()):
        k = es[0].key
        lines += ["", f"# {k.generation}: q {k.q_dtype} / kv {k.kv_dtype}, {k.num_q_heads} q heads x "
                      f"{k.num_kv_heads} KV heads per shard, head_dim {k.head_dim}, page {k.page_size}, "
                      f"max_num_tokens {k.max_num_tokens}, max_model_len {k.max_model_len}"
                      + (", sliding window" if k.sliding_window else "")]
        for e in sorted(es, key=lambda e: list(CASE_VARS).index(e.key.case)):
            if e.promoted:
                gain = f", {e.gain:+.1%} over the kernel's default" if e.gain is not None else ""
                lines.append(f"# {e.key.case}: {e.method} {e.metric * 1e6:,.1f} us{gain}")
                lines.append(f"{CASE_VARS[e.key.case]}={','.join(str(int(v)) for v in e.block_sizes)}")
            else:
                lines.append(f"# {e.key.case}: the kernel's default is kept ({e.decision})")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- SGLang-JAX
def sglang_device_name(generation: str) -> str:
    """SGLang-JAX's spelling of a device (its ``get_device_name``): "TPU v6 lite" -> "TPU v6e",
    "TPU v5 lite" -> "TPU v5e", "TPU7x" -> "TPU v7", "TPU v5" and "TPU v4" unchanged."""
    kind = get_generation(generation).device_kind
    if kind.endswith(" lite"):
        return kind[:-len(" lite")] + "e"
    if kind == "TPU7x":
        return "TPU v7"
    return kind


# SGLang-JAX reads its v3 table on these devices only (its wrapper: ``tpu_version in (6, 7)``)
SGLANG_READS = ("TPU v6e", "TPU v7")


def _pow2(n: int) -> int:
    return 1 << (int(n) - 1).bit_length()


def sglang_key(key: TuningKey, window: int | None, tokens: int | None = None) -> tuple:
    return (STAGES[key.case], window, key.q_dtype, key.kv_dtype, _pow2(key.num_q_heads), _pow2(key.num_kv_heads),
            -(-key.head_dim // 128) * 128, _pow2(key.page_size), _pow2(tokens or key.max_num_tokens))


def _on_bucket(key: TuningKey) -> bool:
    """Whether the key's own values are those SGLang-JAX's normalisation gives (no rounding)."""
    return (key.num_q_heads == _pow2(key.num_q_heads) and key.num_kv_heads == _pow2(key.num_kv_heads)
            and key.head_dim % 128 == 0 and key.page_size == _pow2(key.page_size)
            and key.max_num_tokens == _pow2(key.max_num_tokens))


def _window(e: Entry) -> int | None:
    """The sliding window of an entry's sweep (its workload id ends in ``-sw<N>``)."""
    m = re.search(r"-sw(\d+)$", e.provenance.get("workload_id") or "")
    return int(m.group(1)) if m else None


def installed_sglang_table() -> tuple[dict | None, str | None]:
    """(SGLang-JAX's own ``TUNED_BLOCK_SIZES_V3`` from the installed sglang-jax, its version),
    or (None, why) when it cannot be read here."""
    from .public_kernel import SGLANG_JAX, PublicKernelMissing
    try:
        mod = SGLANG_JAX.module("sgl_jax.srt.kernels.ragged_paged_attention.tuned_block_sizes_v3")
    except PublicKernelMissing as e:
        return None, str(e)
    return mod.TUNED_BLOCK_SIZES_V3, f"sglang-jax=={SGLANG_JAX.installed_version()}"


_LOOKUP = """

def _pow2(n):
    return 1 << (int(n) - 1).bit_length()


def _dtype_name(d):
    if isinstance(d, str):
        return d
    import numpy as np
    return np.dtype(d).name


def lookup(device_name, stage, sliding_window, q_dtype, kv_dtype, num_q_heads, num_kv_heads, head_dim,
           page_size, max_num_tokens, tokens_per_seq=None):
    \"\"\"(bq, bkv, cq, ckv) for a call, normalised as SGLang-JAX's v3 lookup does (verify: bq and cq
    capped at tokens_per_seq); None if absent.\"\"\"
    key = (stage, sliding_window, _dtype_name(q_dtype), _dtype_name(kv_dtype), _pow2(num_q_heads), _pow2(num_kv_heads),
           -(-int(head_dim) // 128) * 128, _pow2(page_size), _pow2(max_num_tokens))
    hit = TUNED_BLOCK_SIZES_V3.get(device_name, {}).get(key)
    if hit is not None and stage == "v" and tokens_per_seq is not None:
        hit = (min(hit[0], tokens_per_seq), hit[1], min(hit[2], tokens_per_seq), hit[3])
    return hit
"""


def sglang_module(tables: dict[str, Table], *, theirs: dict | None = None, theirs_source: str | None = None,
                  replace_measured: bool = False) -> tuple[str, list[str]]:
    """(module source, notes). Notes name what was left out: entries not promoted, a
    sliding-window entry whose window is unknown, several of our keys that fall on one
    SGLang-JAX key (other ``max_model_len``, or head counts / page / tokens its lookup rounds
    up: the one whose own values are the bucket's is kept, else the first in key order), and
    entries of SGLang-JAX's own table (``theirs``: device -> key -> sizes, measured on its
    devices) that an unmeasured entry of ours would replace (kept unless ``replace_measured``).
    Every power-of-two token bucket up to a shape's largest tuned one is written (module doc)."""
    tuned: dict[str, dict[tuple, tuple]] = {}
    notes, comments, exact, methods = [], {}, {}, {}
    for e in sorted(_entries(tables), key=lambda e: e.key):
        window = _window(e) if e.key.sliding_window else None
        if not e.promoted:
            notes.append(f"{e.key.id()}: not written, the kernel's default is kept ({e.decision})")
            continue
        if e.key.sliding_window and window is None:
            notes.append(f"{e.key.id()}: not written, its sliding window is not in its provenance")
            continue
        dev = sglang_device_name(e.key.generation)
        k = sglang_key(e.key, window)
        if k in tuned.setdefault(dev, {}):
            if _on_bucket(e.key) and not _on_bucket(exact[(dev, k)]):
                notes.append(f"{comments[(dev, k)]}: replaced on {dev} {k} by {e.key.id()}, whose own values are "
                             "the bucket's")
            else:
                notes.append(f"{e.key.id()}: not written, {dev} {k} is already set by {comments[(dev, k)]}")
                continue
        exact[(dev, k)] = e.key
        tuned[dev][k] = tuple(int(v) for v in e.block_sizes)
        comments[(dev, k)] = f"{e.key.id()} ({e.method})"
        methods[(dev, k)] = e.method
    # every bucket a server calls with, up to each shape's largest tuned bucket
    per_dev: dict[str, dict[tuple, tuple]] = {}
    for dev, entries in tuned.items():
        shapes: dict[tuple, list[int]] = {}
        for k in entries:
            shapes.setdefault(k[:-1], []).append(k[-1])
        for shape, buckets in shapes.items():
            buckets.sort()
            for b in (1 << i for i in range(buckets[-1].bit_length())):
                src = min(buckets, key=lambda t: (abs(t.bit_length() - b.bit_length()), -t))
                k, from_k = (*shape, b), (*shape, src)
                per_dev.setdefault(dev, {})[k] = entries[from_k]
                if b != src:
                    comments[(dev, k)] = f"{comments[(dev, from_k)]}, tuned at {src} tokens"
                    methods[(dev, k)] = methods[(dev, from_k)]
    # SGLang-JAX's own (device-measured) entries win over entries of ours not measured
    if theirs is not None:
        for dev in sorted(per_dev):
            for k in sorted(per_dev[dev], key=repr):
                their = (theirs.get(dev) or {}).get(k)
                if their is None:
                    continue
                ours = per_dev[dev][k]
                if methods[(dev, k)] == "measured" or replace_measured:
                    if tuple(their) != ours:
                        comments[(dev, k)] += f"; replaces {theirs_source or 'sglang-jax'}'s {tuple(their)}"
                    continue
                notes.append(f"{dev} {k}: kept {theirs_source or 'sglang-jax'}'s device-measured {tuple(their)} "
                             f"over our {methods[(dev, k)]} {ours} (not written; --replace-measured writes ours)")
                del per_dev[dev][k]
    unread = sorted(d for d in per_dev if d not in SGLANG_READS and per_dev[d])
    if unread:
        notes.append(f"{', '.join(unread)}: SGLang-JAX reads its v3 table on {' and '.join(SGLANG_READS)} only "
                     "(these entries are for callers that pass the block sizes themselves)")
    versions = sorted({str(t.info.get("kernel_version")) for t in tables.values() if t.info.get("kernel_version")})
    lines = ['"""' + f"Block sizes for RPA v3 ({', '.join(versions) or 'version unknown'}) in SGLang-JAX's layout, "
             "written by `rpa-tune export`.", "", _header(tables, "")[1].strip(), "",
             "SGLang-JAX's v3 layout: TUNED_BLOCK_SIZES_V3[device_name][(stage, sliding_window, q_dtype, "
             "kv_dtype, q_heads, kv_heads, head_dim, page_size, max_num_tokens)] = (bq, bkv, cq, ckv).",
             "Every power-of-two token bucket up to each shape's largest tuned one is written.",
             "Merge into sgl_jax's table: for dev, t in TUNED_BLOCK_SIZES_V3.items(): "
             "theirs.setdefault(dev, {}).update(t)", '"""', "", "TUNED_BLOCK_SIZES_V3 = {"]
    for dev in sorted(per_dev):
        lines.append(f"    {dev!r}: {{")
        for k in sorted(per_dev[dev], key=repr):
            lines.append(f"        {k!r}: {per_dev[dev][k]!r},  # {comments[(dev, k)]}")
        lines.append("    },")
    lines.append("}")
    if notes:
        lines += ["", "# Not written:"] + [f"#   {n}" for n in notes]
    return "\n".join(lines) + "\n" + _LOOKUP, notes
