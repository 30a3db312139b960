"""Workloads the tuner evaluates block sizes on: seeded generators and user files.

A workload is a ``kernel.workload.Workload`` (per-sequence ``q_len``/``kv_len`` and the
case split). Generators are deterministic for a given seed and keep the number of
*distinct* ``(q_len, kv_len)`` pairs small: the compile backend's estimate unrolls one
loop per distinct pair, so a workload with 64 different lengths would compile for
minutes. Lengths are therefore drawn from the distribution and then quantised to a few
levels (equal-count quantile bins, each replaced by its mean), which keeps the total KV
tokens (the memory traffic) within rounding of the drawn sample.

* decode: ``num_seqs`` sequences with ``q_len = 1`` and context lengths drawn from
  ``--context`` (``lognormal:MEDIAN:SIGMA`` | ``uniform:LO:HI`` | ``fixed:N``),
  quantised to ``levels`` values. Default: 64 sequences, lognormal(median 2048, sigma
  0.8), 4 levels, clipped to ``[1, max_model_len]``.
* prefill: ``num_chunks`` chunks of ``chunk`` tokens (default 2 x 1024, capped by
  ``max_num_tokens``); each chunk's context is a whole number of earlier chunks of the
  same prompt, drawn uniformly from ``[0, max_context]`` (default 4096).
* mixed: a serving step of a chunked-prefill server that fills ``max_num_tokens`` (the
  steps a server pads to that bucket hold more than half of it): two "extend" requests
  (16-64 new tokens), eight speculative-decoding sequences (4 tokens each), sixteen
  decode-like sequences (1 token) and prefill chunks of at most 1024 tokens over the
  rest (a quarter of the bucket at least), contexts lognormal(2048, 0.8), quantised.
* verify (SGLang-JAX's target-verify stage): ``num_seqs`` sequences of ``draft`` tokens
  each (default 4: the draft tokens a speculative step verifies) on long contexts,
  lognormal(median 8192, sigma 0.5) unless ``--context`` gives another distribution,
  quantised to 4 levels; as many sequences as the bucket holds (``max_num_tokens //
  draft``) at most.
* mixed, as vLLM-TPU sends it (``vllm_mixed_workload``; ``make_workload`` uses it for the
  kernels in ``VLLM_STEP_KERNELS``, tpu-inference's): one step of tpu-inference's runner,
  which sorts a step's one-token sequences first and gives them to the decode kernel
  (request distribution ``(decodes, decodes, all)``): up to sixteen decode sequences in the
  decode range, and in the mixed range the multi-token sequences: eight speculative-decoding
  sequences (4 tokens), two extends (16-64 tokens) and prefill chunks of at most 1024 tokens
  (more where ``max_num_seqs`` leaves few sequences) over the rest, the first a new prompt's
  first chunk (no cached context), the others continuing prompts (a whole number of their
  chunk's tokens cached). The step fills its bucket.
* file (``--workload FILE``): JSON (a list of ``{"q_len":, "kv_len":}`` objects, or
  ``{"sequences": [...]}``) or CSV with columns ``q_len,kv_len`` and optionally
  ``case``. Without a ``case`` column, decode uses the rows with ``q_len == 1``, prefill
  the rows with ``q_len > 1`` and mixed all rows. Quantised to ``max_segments`` distinct
  pairs (default 8).
"""
from __future__ import annotations

import csv
import hashlib
import json
from pathlib import Path

import numpy as np

from kernel.config import Case
from kernel.workload import ServingLimits, Workload


class WorkloadError(ValueError):
    """A workload that cannot be built or read; the message says why."""


# ----------------------------------------------------------------------- identity
def workload_id(w: Workload) -> str:
    doc = json.dumps({"q": w.q_lens, "kv": w.kv_lens, "d": w.distribution}, separators=(",", ":"))
    return hashlib.sha256(doc.encode()).hexdigest()[:12]


def describe(w: Workload, origin: str = "") -> str:
    parts = []
    for case in (Case.DECODE, Case.PREFILL, Case.MIXED):
        lo, hi = w.case_range(case)
        if hi == lo:
            continue
        q, kv = w.q_lens[lo:hi], w.kv_lens[lo:hi]
        if case == Case.DECODE:
            parts.append(f"{case.value}: {hi - lo} seqs, kv {min(kv)}..{max(kv)} (mean {round(np.mean(kv))})")
        else:
            parts.append(f"{case.value}: {hi - lo} seqs, q {min(q)}..{max(q)} ({sum(q)} tokens), "
                         f"kv {min(kv)}..{max(kv)}")
    text = "; ".join(parts)
    return f"{text} [{origin}]" if origin else text


# --------------------------------------------------------------------- primitives
def parse_distribution(spec: str) -> tuple[str, tuple[float, ...]]:
    """``lognormal:MEDIAN:SIGMA`` | ``uniform:LO:HI`` | ``fixed:N``."""
    parts = str(spec).split(":")
    kind, args = parts[0].lower(), parts[1:]
    want = {"lognormal": 2, "uniform": 2, "fixed": 1}
    if kind not in want:
        raise WorkloadError(f"unknown context distribution {spec!r}; valid: lognormal:MEDIAN:SIGMA, "
                            "uniform:LO:HI, fixed:N")
    try:
        vals = tuple(float(a) for a in args)
    except ValueError:
        raise WorkloadError(f"context distribution {spec!r} has a non-numeric parameter") from None
    if len(vals) != want[kind] or any(v < 0 for v in vals) or (kind != "lognormal" and vals[0] < 0):
        raise WorkloadError(f"context distribution {spec!r} needs {want[kind]} non-negative numbers")
    if kind == "uniform" and vals[0] > vals[1]:
        raise WorkloadError(f"context distribution {spec!r}: LO > HI")
    return kind, vals


def draw_lengths(spec: str, n: int, rng: np.random.Generator) -> np.ndarray:
    kind, v = parse_distribution(spec)
    if kind == "lognormal":
        x = rng.lognormal(np.log(max(v[0], 1.0)), v[1], n)
    elif kind == "uniform":
        x = rng.uniform(v[0], v[1], n)
    else:
        x = np.full(n, v[0])
    return np.maximum(np.rint(x), 0).astype(np.int64)


def quantise(values, levels: int) -> list[int]:
    """Replace each of ``levels`` equal-count quantile bins (of the sorted values) by its
    rounded mean; returns values in the original order."""
    values = np.asarray(values, np.int64)
    if levels <= 0 or len(np.unique(values)) <= levels:
        return [int(v) for v in values]
    order = np.argsort(values, kind="stable")
    out = np.empty_like(values)
    for chunk in np.array_split(order, levels):
        out[chunk] = int(round(float(values[chunk].mean())))
    return [int(v) for v in out]


# --------------------------------------------------------------------- generators
def decode_workload(limits: ServingLimits, *, num_seqs: int = 64, context: str = "lognormal:2048:0.8",
                    levels: int = 4, seed: int = 0) -> tuple[Workload, str]:
    n = max(1, min(num_seqs, limits.max_num_seqs, limits.max_num_tokens))
    rng = np.random.default_rng([seed, 1])
    ctx = draw_lengths(context, n, rng)
    kv = np.clip(ctx + 1, 1, limits.max_model_len)
    kv = quantise(kv, levels)
    w = Workload.of_case(Case.DECODE, [1] * n, kv)
    return w, f"decode gen: {n} seqs, context {context}, {levels} levels, seed {seed}"


def prefill_workload(limits: ServingLimits, *, num_chunks: int = 2, chunk: int = 1024,
                     max_context: int = 4096, seed: int = 0) -> tuple[Workload, str]:
    chunk = max(1, min(chunk, limits.max_num_tokens, limits.max_model_len))
    n = max(1, min(num_chunks, limits.max_num_tokens // chunk, limits.max_num_seqs))
    rng = np.random.default_rng([seed, 2])
    max_prev = max(0, min(max_context, limits.max_model_len - chunk) // chunk)
    ctx = rng.integers(0, max_prev + 1, n) * chunk
    w = Workload.of_case(Case.PREFILL, [chunk] * n, [int(c) + chunk for c in ctx])
    return w, f"prefill gen: {n} chunks of {chunk}, context <= {max_context}, seed {seed}"


MIXED_CHUNK = 1024    # a mixed step's prefill chunks: at most this many tokens each


def mixed_workload(limits: ServingLimits, *, context: str = "lognormal:2048:0.8",
                   seed: int = 0) -> tuple[Workload, str]:
    """One chunked-prefill serving step that fills its token bucket: two extends, 8
    spec-decode and 16 decode sequences, and prefill chunks of at most ``MIXED_CHUNK``
    tokens (a quarter of the bucket at least) over the rest. A server pads a step's tokens
    up to the next bucket it compiled (vLLM-TPU: ``get_padded_token_len``), so the steps a
    bucket's kernel runs hold more than half its tokens; and tpu-inference's runner (its
    data-parallel path at least) sends every sequence of more than one query token to the
    mixed case (request distribution (decodes, decodes, all)), so at large buckets mixed is
    mostly prefill. Each chunk starts at a chunk boundary of its sequence."""
    rng = np.random.default_rng([seed, 3])
    T, S, L = limits.max_num_tokens, limits.max_num_seqs, limits.max_model_len
    small = [(2, int(rng.integers(16, 65))), (8, 4), (16, 1)]   # (count, q_len): extend, spec-decode, decode
    prefill = max(1, T // 4, T - sum(n * q for n, q in small))
    chunks = [(1, min(MIXED_CHUNK, prefill - i)) for i in range(0, prefill, MIXED_CHUNK)]
    q_lens: list[int] = []
    for count, q in chunks + small:
        for _ in range(count):
            if len(q_lens) < S and sum(q_lens) + q <= T:
                q_lens.append(min(q, L))
    if not q_lens:
        q_lens = [1]
    n_chunks = min(len(chunks), len(q_lens))
    ctx = draw_lengths(context, len(q_lens), rng)
    for i in range(n_chunks):
        ctx[i] = (ctx[i] // q_lens[i]) * q_lens[i]                # a chunk starts at a chunk boundary
    kv = [int(min(L, c + q)) for c, q in zip(ctx, q_lens)]
    # quantise contexts within each q_len group (at most 2 levels each)
    out_kv = list(kv)
    for q in sorted(set(q_lens)):
        idx = [i for i, x in enumerate(q_lens) if x == q]
        for i, v in zip(idx, quantise([kv[i] for i in idx], 2)):
            out_kv[i] = max(q, v)
    w = Workload.of_case(Case.MIXED, q_lens, out_kv)
    return w, (f"mixed gen: {len(q_lens)} seqs ({n_chunks} prefill chunks of <= {MIXED_CHUNK}, extend, spec-decode, "
               f"decode), context {context}, seed {seed}")


VERIFY_DRAFT = 4                          # draft tokens per sequence of a verify step
VERIFY_CONTEXT = "lognormal:8192:0.5"     # its contexts: long ones
DEFAULT_CONTEXT = "lognormal:2048:0.8"    # the decode / mixed generators' (and --context's) default


def verify_workload(limits: ServingLimits, *, num_seqs: int = 64, draft: int = VERIFY_DRAFT,
                    context: str = VERIFY_CONTEXT, levels: int = 4, seed: int = 0) -> tuple[Workload, str]:
    """A target-verify step: ``draft`` query tokens for each of ``num_seqs`` sequences (as
    many as the token bucket and ``max_num_seqs`` hold) after long contexts, quantised to
    ``levels`` values. Its sequences are in the workload's mixed range (the kernel that runs it)."""
    draft = max(1, min(int(draft), limits.max_num_tokens, limits.max_model_len))
    n = max(1, min(num_seqs, limits.max_num_seqs, limits.max_num_tokens // draft))
    rng = np.random.default_rng([seed, 4])
    ctx = draw_lengths(context, n, rng)
    kv = quantise(np.clip(ctx + draft, draft, limits.max_model_len), levels)
    w = Workload.of_case(Case.VERIFY, [draft] * n, [max(draft, int(v)) for v in kv])
    return w, f"verify gen: {n} seqs of {draft} draft tokens, context {context}, {levels} levels, seed {seed}"


# the kernels whose mixed case is tuned on vLLM-TPU's steps (``vllm_mixed_workload``)
VLLM_STEP_KERNELS = ("tpu-inference",)


def vllm_mixed_workload(limits: ServingLimits, *, context: str = DEFAULT_CONTEXT,
                        seed: int = 0) -> tuple[Workload, str]:
    """One step of vLLM-TPU (tpu-inference's runner) that fills its token bucket (module doc):
    the decode sequences in the decode range (the decode kernel runs them), the mixed kernel's
    sequences after them. Of the prefill chunks (at least two where the bucket has room for
    two of 8 tokens), the first has no cached context and the others start after a whole
    number of their own chunk's tokens of cached context."""
    rng = np.random.default_rng([seed, 5])
    T, S, L = limits.max_num_tokens, limits.max_num_seqs, limits.max_model_len
    n_dec = max(0, min(16, T // 8, S - 3))
    room, slots = T - n_dec, S - n_dec
    smalls = [4] * 8 + [int(rng.integers(16, 65))] * 2         # spec-decode, extends
    # keep the chunks at least a quarter of the step and a sequence each
    while smalls and (sum(smalls) > room - max(1, room // 4) or len(smalls) + 2 > slots):
        smalls.pop()
    rest = room - sum(smalls)
    n_chunks = max(1, min(max(2 if rest >= 16 else 1, -(-rest // MIXED_CHUNK)), slots - len(smalls)))
    sizes = [rest // n_chunks + (i < rest % n_chunks) for i in range(n_chunks)]
    multi = [min(q, L) for q in sizes + smalls if q > 0][:max(0, slots)]
    chunks = min(len(sizes), len(multi))
    ctx = draw_lengths(context, len(multi), rng)
    kv = []
    for i, q in enumerate(multi):
        if i < chunks:
            c = 0 if i == 0 else max(q, (int(ctx[i]) // q) * q)   # a fresh prompt, then continuing ones
        else:
            c = int(ctx[i])
        kv.append(int(min(L, c + q)))
    out_kv = list(kv)
    for q in sorted(set(multi)):                                  # at most 2 context levels per q_len
        idx = [i for i, x in enumerate(multi) if x == q and i != 0]
        for i, v in zip(idx, quantise([kv[i] for i in idx], 2)):
            out_kv[i] = max(q, v)
    dec_kv = quantise(np.clip(draw_lengths(context, n_dec, rng) + 1, 1, L), 2) if n_dec else []
    if not multi:                       # no room for a multi-token sequence: a decode step
        return Workload.of_case(Case.MIXED, [1] * n_dec, list(dec_kv)), "mixed gen (vLLM-TPU step): decode only"
    w = Workload([1] * n_dec + multi, list(dec_kv) + out_kv, (n_dec, n_dec, n_dec + len(multi)))
    return w, (f"mixed gen (vLLM-TPU step): {n_dec} decode seqs (decode kernel), {len(multi)} mixed seqs "
               f"({chunks} prefill chunks, the first without cached context; spec-decode, extends), "
               f"context {context}, seed {seed}")


# --------------------------------------------------------------------------- files
def read_workload_file(path: str | Path) -> list[tuple[int, int, str | None]]:
    """Rows ``(q_len, kv_len, case or None)`` from a JSON or CSV file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise WorkloadError(f"workload file {str(p)!r} cannot be read: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise WorkloadError(f"workload file {str(p)!r} is not UTF-8 text; expected JSON or CSV rows of "
                            "q_len, kv_len (optional case)") from None
    rows: list[tuple[int, int, str | None]] = []

    def add(q, kv, case, where):
        try:
            qi, kvi = int(q), int(kv)
        except (TypeError, ValueError):
            raise WorkloadError(f"{p}: {where}: q_len={q!r}, kv_len={kv!r} must be integers") from None
        if qi < 1 or kvi < qi:
            raise WorkloadError(f"{p}: {where}: need 1 <= q_len <= kv_len, got q_len={qi}, kv_len={kvi}")
        if case not in (None, ""):
            try:
                case = Case.parse(case).value
            except ValueError as e:
                raise WorkloadError(f"{p}: {where}: {e}") from None
        rows.append((qi, kvi, case or None))

    if p.suffix.lower() == ".json" or text.lstrip().startswith(("[", "{")):
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise WorkloadError(f"workload file {str(p)!r} is not valid JSON: {e}") from None
        seqs = doc.get("sequences") if isinstance(doc, dict) else doc
        if not isinstance(seqs, list):
            raise WorkloadError(f"{p}: expected a list of {{\"q_len\", \"kv_len\"}} objects or "
                                "{\"sequences\": [...]}")
        for i, s in enumerate(seqs):
            if not isinstance(s, dict) or "q_len" not in s or "kv_len" not in s:
                raise WorkloadError(f"{p}: sequence {i} must be an object with q_len and kv_len")
            add(s["q_len"], s["kv_len"], s.get("case"), f"sequence {i}")
    else:
        reader = csv.DictReader(text.splitlines())
        if not reader.fieldnames or not {"q_len", "kv_len"} <= set(reader.fieldnames):
            raise WorkloadError(f"{p}: a CSV workload needs a header with q_len,kv_len (and optionally case)")
        for i, r in enumerate(reader):
            add(r["q_len"], r["kv_len"], r.get("case"), f"row {i + 2}")
    if not rows:
        raise WorkloadError(f"workload file {str(p)!r} has no sequences")
    return rows


def quantise_pairs(pairs: list[tuple[int, int]], max_segments: int) -> list[tuple[int, int]]:
    """At most ``max_segments`` distinct ``(q_len, kv_len)`` pairs: equal-count bins of the
    sorted pairs, each replaced by its rounded mean (kv_len >= q_len kept)."""
    if len(set(pairs)) <= max_segments:
        return sorted(pairs)
    srt = sorted(pairs)
    out = []
    for chunk in np.array_split(np.arange(len(srt)), max_segments):
        qs = [srt[i][0] for i in chunk]
        kvs = [srt[i][1] for i in chunk]
        q = max(1, int(round(float(np.mean(qs)))))
        kv = max(q, int(round(float(np.mean(kvs)))))
        out += [(q, kv)] * len(chunk)
    return out


def file_workload(path: str | Path, case: Case | str, *, max_segments: int = 8) -> tuple[Workload, str]:
    case = Case.parse(case)
    rows = read_workload_file(path)
    has_case = any(c is not None for _, _, c in rows)
    if has_case:
        sel = [(q, kv) for q, kv, c in rows if c == case.value]
    elif case == Case.DECODE:
        sel = [(q, kv) for q, kv, _ in rows if q == 1]
    elif case == Case.PREFILL:
        sel = [(q, kv) for q, kv, _ in rows if q > 1]
    else:
        sel = [(q, kv) for q, kv, _ in rows]
    if not sel:
        raise WorkloadError(f"workload file {str(path)!r} has no {case.value} sequences "
                            f"({'case column' if has_case else 'decode: q_len == 1, prefill: q_len > 1'})")
    pairs = quantise_pairs(sel, max_segments)
    w = Workload.of_case(case, [q for q, _ in pairs], [kv for _, kv in pairs])
    note = f", quantised to {max_segments} segments" if len(set(sel)) > max_segments else ""
    return w, f"file {Path(path).name}: {len(sel)} {case.value} seqs{note}"


def make_workload(case: Case | str, limits: ServingLimits, *, seed: int = 0, path=None,
                  num_seqs: int = 64, context: str = "lognormal:2048:0.8", chunk: int = 1024,
                  num_chunks: int = 2, max_segments: int = 8, kernel: str | None = None) -> tuple[Workload, str]:
    """The workload of one case: from ``path`` if given, else the case's generator (mixed, for
    a ``kernel`` in ``VLLM_STEP_KERNELS``: vLLM-TPU's step, ``vllm_mixed_workload``).
    Raises ``WorkloadError`` when it does not fit ``limits``."""
    case = Case.parse(case)
    if path is not None:
        w, origin = file_workload(path, case, max_segments=max_segments)
    elif case == Case.DECODE:
        w, origin = decode_workload(limits, num_seqs=num_seqs, context=context, seed=seed)
    elif case == Case.PREFILL:
        w, origin = prefill_workload(limits, chunk=chunk, num_chunks=num_chunks, seed=seed)
    elif case == Case.VERIFY:
        w, origin = verify_workload(limits, num_seqs=num_seqs, seed=seed,
                                    context=VERIFY_CONTEXT if context == DEFAULT_CONTEXT else context)
    elif kernel in VLLM_STEP_KERNELS:
        w, origin = vllm_mixed_workload(limits, context=context, seed=seed)
    else:
        w, origin = mixed_workload(limits, context=context, seed=seed)
    try:
        w.check_fits(limits)
    except ValueError as e:
        raise WorkloadError(f"{case.value} workload ({origin}) does not fit the serving limits: {e}") from None
    return w, origin
