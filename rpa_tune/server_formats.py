"""Tuned tables of tpu-inference's RPA v3 in the forms its servers read.

* ``vllm_env``: environment lines for vLLM-TPU. tpu-inference reads
  ``RPA_V3_DECODE_BLOCK_SIZES``, ``RPA_V3_PREFILL_BLOCK_SIZES`` and
  ``RPA_V3_MIXED_BLOCK_SIZES``, each ``bq,bkv,cq,ckv`` (``tpu_inference/envs.py``), and its
  call sites pass them to the kernel as ``d/p/m_block_sizes`` (``rpa_block_size_kwargs``):
  ``layers/jax/attention/attention.py`` from 0.26.0 (PR #3102), and
  ``layers/common/attention_interface.py``'s ``sharded_ragged_paged_attention`` (MaxText, most
  JAX models, vLLM's PyTorch models) from 0.30.0 (PR #3395); never the head_dim-64 kernel
  (``kernel_hd64.py``). vLLM-TPU never passes ``chunk_prefill_size``, without which the
  kernel launches no prefill kernel, so only DECODE and MIXED lines are written. The
  variables are process-wide: one tuple per case serves every token bucket, chosen over the
  traffic's buckets (``choose_server_tuple``), with each bucket's expected gain over the
  kernel's own default for that bucket; one group per server shape (a key without its case
  and bucket).
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

import dataclasses
import re

from kernel.config import TuningKey, get_generation
from kernel.tables import Entry, Table

CASE_VARS = {"decode": "RPA_V3_DECODE_BLOCK_SIZES", "prefill": "RPA_V3_PREFILL_BLOCK_SIZES",
             "mixed": "RPA_V3_MIXED_BLOCK_SIZES"}
STAGES = {"decode": "d", "prefill": "p", "mixed": "m", "verify": "v"}


def _entries(tables: dict[str, Table]) -> list[Entry]:
    return [e for g in sorted(tables) for e in tables[g].entries]


def _shape(key: TuningKey) -> tuple:
    """A vLLM-TPU server shape: everything of a key but its case and token bucket (the
    variables are process-wide, so one tuple serves every bucket the server compiles)."""
    return (key.generation, key.q_dtype, key.kv_dtype, key.num_q_heads, key.num_kv_heads, key.head_dim,
            key.page_size, key.max_model_len, key.sliding_window)


def _header(tables: dict[str, Table], comment: str) -> list[str]:
    versions = sorted({str(t.info.get("kernel_version")) for t in tables.values() if t.info.get("kernel_version")})
    methods = sorted({e.method for e in _entries(tables)})
    how = {"estimate": "estimate: deviceless libtpu compile, audited static-profiler cycles",
           "measured": "measured on a TPU"}
    return [f"{comment} Block sizes for tpu-inference's RPA v3 ({', '.join(versions) or 'version unknown'}), "
            f"written by `rpa-tune export`.",
            f"{comment} Method: {'; '.join(how.get(m, m) for m in methods)}."]


# --------------------------------------------------------------------------- vLLM-TPU
VLLM_CASES = ("decode", "mixed")     # the kernels vLLM-TPU launches (never prefill: module doc)
VLLM_READERS = (
    "# Read by tpu-inference >= 0.30.0 on every path to the RPA v3 kernel: layers/common/attention_interface.py "
    "(sharded_ragged_paged_attention: MaxText, tpu-inference's JAX models such as Llama 3, Qwen 3 and Gemma 4, "
    "and vLLM's PyTorch models through layers/vllm/backends/flash_attn.py; PR #3395). 0.26.0 to 0.29.x read "
    "them only on layers/jax/attention/attention.py (Llama 4, DeepSeek V3); earlier releases ignore them.",
    "# No RPA_V3_PREFILL_BLOCK_SIZES: tpu-inference launches its prefill kernel only when the call passes "
    "chunk_prefill_size, which vLLM-TPU never does; every step that is not all decode runs the MIXED kernel.",
    "# One tuple per variable serves every token bucket the server compiles (the variables are process-wide): "
    "each is the tuple with the least total time over the traffic's buckets.")


class TrafficError(ValueError):
    """A traffic file that cannot be read (the message names the file and the problem)."""


def read_traffic(path) -> dict[str, dict[int, float]]:
    """``{case: {tokens: calls}}`` from a traffic file: the kernel calls a server makes, by
    case and by the step's scheduled tokens. CSV with a header ``case,tokens[,count]`` (a
    missing count is 1), or JSON ``[{"case":, "tokens":, "count":}, ...]`` or ``{"decode":
    {"64": 120, ...}, "mixed": {...}}``. Cases: decode, mixed."""
    import csv
    import json
    from pathlib import Path
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TrafficError(f"traffic file {str(p)!r} cannot be read: {getattr(e, 'strerror', None) or e}") from None
    rows = []
    if text.lstrip().startswith(("[", "{")):
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise TrafficError(f"traffic file {str(p)!r} is not valid JSON: {e}") from None
        if isinstance(doc, dict):
            for case, per in doc.items():
                if not isinstance(per, dict):
                    raise TrafficError(f"{p}: {case!r} must map token counts to call counts")
                rows += [(case, t, n, f"{case}/{t}") for t, n in per.items()]
        elif isinstance(doc, list):
            for i, r in enumerate(doc):
                if not isinstance(r, dict) or "case" not in r or "tokens" not in r:
                    raise TrafficError(f"{p}: item {i} must be an object with case and tokens (and count)")
                rows.append((r["case"], r["tokens"], r.get("count", 1), f"item {i}"))
        else:
            raise TrafficError(f"{p}: expected a list of {{case, tokens, count}} objects or {{case: {{tokens: count}}}}")
    else:
        reader = csv.DictReader(text.splitlines())
        if not reader.fieldnames or not {"case", "tokens"} <= set(reader.fieldnames):
            raise TrafficError(f"{p}: a CSV traffic file needs a header with case,tokens (and optionally count)")
        rows = [(r["case"], r["tokens"], r.get("count") or 1, f"row {i + 2}") for i, r in enumerate(reader)]
    out: dict[str, dict[int, float]] = {}
    for case, tokens, count, where in rows:
        case = str(case).strip().lower()
        if case not in VLLM_CASES:
            raise TrafficError(f"{p}: {where}: case {case!r} is not one vLLM-TPU launches; valid: "
                               f"{', '.join(VLLM_CASES)}")
        try:
            t, n = int(tokens), float(count)
        except (TypeError, ValueError):
            raise TrafficError(f"{p}: {where}: tokens={tokens!r}, count={count!r} must be numbers") from None
        if t < 1 or not n >= 0:
            raise TrafficError(f"{p}: {where}: need tokens >= 1 and count >= 0, got {t}, {count}")
        out.setdefault(case, {})[t] = out.get(case, {}).get(t, 0.0) + n
    if not any(sum(v.values()) > 0 for v in out.values()):
        raise TrafficError(f"traffic file {str(p)!r} has no calls")
    return out


def bucket_weights(buckets, calls: dict[int, float] | None) -> tuple[dict[int, float], float]:
    """(bucket -> calls, calls above the largest bucket). A step of ``t`` tokens runs in the
    smallest bucket of at least ``t`` (vLLM-TPU pads a step's tokens up to the next bucket
    it compiled). Without traffic (``calls`` None): one call per bucket (the default mix)."""
    buckets = sorted(buckets)
    if calls is None:
        return {b: 1.0 for b in buckets}, 0.0
    w, over = {b: 0.0 for b in buckets}, 0.0
    for t, n in calls.items():
        b = next((b for b in buckets if b >= t), None)
        if b is None:
            over += n
        else:
            w[b] += n
    return w, over


@dataclasses.dataclass
class ServerChoice:
    """The one tuple of a server shape and case, and how it does in each bucket."""
    case: str
    block_sizes: tuple | None            # None: keep the kernel's default
    reason: str
    method: str = ""
    per_bucket: list = dataclasses.field(default_factory=list)   # (bucket, calls, default bs, default s, s, gain)
    gain: float | None = None            # over the traffic: total default time / total time - 1


def _group_rows(entry: Entry, rows: list[dict]) -> tuple[dict, set]:
    """(config -> export.ConfigStats, disqualified configs) of ``entry``'s comparison group:
    the rows its export compared (method, workload, newest evaluator version)."""
    from kernel.config import BlockSizes
    from . import export
    from .store import newest_evaluator
    wid = entry.provenance.get("workload_id")
    ok = [r for r in rows if export._str(r.get("status")) == "ok" and export._str(r.get("method")) == entry.method
          and export._str(r.get("workload_id")) == wid and export._clean(r.get("metric")) is not None
          and float(r["metric"]) > 0]
    disq = {export._row_bs(r) for r in rows if export._str(r.get("status")) in export.DISQUALIFYING}
    stats = export._aggregate(newest_evaluator(ok))
    return {tuple(int(v) for v in BlockSizes(*bs)): s for bs, s in stats.items()}, {tuple(int(v) for v in b) for b in disq}


def choose_server_tuple(entries: list[Entry], rows_of, calls: dict[int, float] | None) -> ServerChoice:
    """The tuple with the least total time over ``entries``' buckets weighted by ``calls``
    (``bucket_weights``), among the configurations priced in every weighted bucket and
    failing in none; promoted when it beats the kernel's default (each bucket's own) by more
    than the export's margin over the traffic, or where the default fails."""
    from . import export
    case = entries[0].key.case
    weights, _ = bucket_weights([e.key.max_num_tokens for e in entries], calls)
    used = [e for e in sorted(entries, key=lambda e: e.key.max_num_tokens) if weights[e.key.max_num_tokens] > 0]
    if not used:
        return ServerChoice(case, None, "the traffic has no calls in these buckets")
    groups = {e.key.max_num_tokens: _group_rows(e, rows_of(e.key)) for e in used}
    method = "/".join(sorted({e.method for e in used}))
    common = set.intersection(*(set(s) - d for s, d in groups.values()))
    if not common:
        return ServerChoice(case, None, "no configuration was priced in every bucket of the traffic", method)

    def total(bs):
        return sum(weights[b] * groups[b][0][bs].metric for b in groups)
    best = min(common, key=lambda bs: (total(bs), bs))
    per, fails, dtot, btot = [], [], 0.0, 0.0
    for e in used:
        b = e.key.max_num_tokens
        stats, disq = groups[b]
        dbs = tuple(int(v) for v in e.heuristic_block_sizes) if e.heuristic_block_sizes else None
        d = stats.get(dbs) if dbs is not None else None
        t = stats[best].metric
        if dbs is not None and dbs in disq:
            fails.append(b)
        gain = d.metric / t - 1.0 if d is not None and dbs not in disq else None
        per.append((b, weights[b], dbs, d.metric if d is not None else None, t, gain))
        if d is not None:
            dtot += weights[b] * d.metric
            btot += weights[b] * t
    gain = dtot / btot - 1.0 if btot and all(g is not None for *_, g in per) else None
    margin = max(export._margin(e.method, groups[e.key.max_num_tokens][0][best], None) for e in used)
    if all(best == p[2] for p in per):
        return ServerChoice(case, None, "the kernel's default is the best tuple in every bucket", method, per, 0.0)
    if fails:
        why = f"the kernel's default fails at {', '.join(map(str, fails))} tokens"
        return ServerChoice(case, best, why, method, per, gain)
    if gain is None:
        return ServerChoice(case, None, "the kernel's default was not priced in every bucket: no baseline",
                            method, per)
    if gain <= margin:
        return ServerChoice(case, None, f"gain {gain:+.1%} over the traffic is within the margin {margin:.0%}",
                            method, per, gain)
    return ServerChoice(case, best, f"gain {gain:+.1%} over the traffic > margin {margin:.0%}", method, per, gain)


def vllm_env(tables: dict[str, Table], rows: list[dict], traffic: dict | None = None) -> tuple[str, list[str]]:
    """(``NAME=bq,bkv,cq,ckv`` lines for vLLM-TPU, notes): per server shape (``_shape``) one
    DECODE and one MIXED tuple chosen over the traffic's token buckets
    (``choose_server_tuple``; ``traffic``: ``read_traffic``'s, None: every bucket of the
    results once), each bucket's expected gain over the kernel's own default, and warnings
    where the variables do not do what the lines say (sliding window, head_dim 64).
    ``rows``: the result rows the tables were exported from (export's ``read_results``)."""
    by_key: dict[TuningKey, list[dict]] = {}
    from . import export
    for r in rows:
        try:
            by_key.setdefault(export._row_key(r), []).append(r)
        except (TypeError, ValueError):
            continue
    groups: dict[tuple, dict[str, list[Entry]]] = {}
    for e in _entries(tables):
        if e.key.case in VLLM_CASES:
            groups.setdefault(_shape(e.key), {}).setdefault(e.key.case, []).append(e)
    notes = []
    lines = _header(tables, "#") + list(VLLM_READERS)
    lines.append("# Traffic: " + ("the calls of the traffic file, by case and token bucket."
                                  if traffic is not None else "the default mix, one call in every token bucket "
                                  "of the results (pass --traffic FILE for a server's own)."))
    lines.append("# One group per server shape: put the lines of yours in the environment of vLLM.")
    for shape, cases in sorted(groups.items()):
        k = next(iter(cases.values()))[0].key
        lines += ["", f"# {k.generation}: q {k.q_dtype} / kv {k.kv_dtype}, {k.num_q_heads} q heads x "
                      f"{k.num_kv_heads} KV heads per shard, head_dim {k.head_dim}, page {k.page_size}, "
                      f"max_model_len {k.max_model_len}" + (", sliding window" if k.sliding_window else "")]
        inert = k.head_dim == 64
        if inert:
            lines.append("# WARNING: head_dim 64 runs tpu-inference's kernel_hd64.py, which never receives these "
                         "variables (its call site passes them only to the head_dim-128 kernel): the lines below "
                         "are commented out, they would change nothing.")
        if k.sliding_window:
            lines.append("# WARNING: tuned for the model's sliding-window layers; the variables are process-wide, "
                         "so its global-attention layers run the same tuples (tune that shape too and choose).")
        else:
            lines.append("# Note: a model with sliding-window layers runs these tuples on them too (process-wide).")
        for case in VLLM_CASES:
            es = cases.get(case)
            if not es:
                lines.append(f"# {case}: no results")
                continue
            ch = choose_server_tuple(es, lambda key: by_key.get(key, []), (traffic or {}).get(case)
                                     if traffic is not None else None)
            if traffic is not None:
                _, over = bucket_weights([e.key.max_num_tokens for e in es], traffic.get(case, {}))
                if over:
                    notes.append(f"{k.generation} h{k.num_q_heads}x{k.num_kv_heads} {case}: {over:g} calls above the "
                                 f"largest tuned bucket ({max(e.key.max_num_tokens for e in es)}) are not counted")
            for b, w, dbs, d, t, g in ch.per_bucket:
                dflt = f"default {dbs} {d * 1e6:,.1f} us" if d is not None else f"default {dbs} not priced"
                gain = f"{g:+.1%}" if g is not None else "n/a"
                lines.append(f"#   {case} {b:>5} tokens, {w:g} calls: {t * 1e6:,.1f} us vs {dflt}: {gain} "
                             f"({ch.method})")
            if ch.block_sizes is None:
                lines.append(f"# {case}: the kernel's default is kept ({ch.reason})")
                continue
            line = f"{CASE_VARS[case]}={','.join(map(str, ch.block_sizes))}"
            lines.append(f"# {case}: {ch.reason} ({ch.method})")
            lines.append(("# " if inert else "") + line)
    return "\n".join(lines) + "\n", notes


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
