"""Builders for the profiler child: this project's kernel, lowered for one workload.

On v5p the new tokens' K/V operand is placed in VMEM (``places_new_kv``: in decode, and in
prefill / mixed for shapes of at most 2 KiB of K/V per token). The kernel's KV-cache update
copies the new rows from that operand into the cache pages, and libtpu's static profiler
marks a copy between two HBM buffers *remote*: on v5e, v5p and v6e a kernel with one gets
0 estimated cycles (``NO_HBM_TO_HBM_PRICE``; TPU7x prices such a copy as a local DMA).
Where the operand goes is XLA's choice: in v5p decode programs of two or more KV heads XLA
makes it with an unfused pad, in HBM, and such a config gets no estimate. Placed in VMEM
they are estimated, and the v5p programs XLA's placement can estimate keep their cycles
(benchmarks/README.md, "New K/V placement on v5p"; ``tests/test_estimator.py``). v5e and
v6e keep XLA's placement: the explicit one can move other operands too (the q operand, in a
v5p prefill program of 8 KV heads), so their estimates might not compare with recorded
ones. Where the placement stays XLA's (v5e and v6e, and v5p prefill / mixed of more than
2 KiB of K/V per token), a config whose kernel gets no estimate is profiled again with the
operand in VMEM (``places_on_no_estimate``). Only configs that had no estimate change, so
no recorded estimate does; a config's probes are all placed alike, but within a key the
placed configs and the others may differ by what the placement moves. A placed
config that runs out of VMEM has that verdict (the compile evaluator retries it at another
limit, as any profiled compile); any other failure leaves the first crash its verdict (a
compile error from an operand serving keeps in HBM says nothing about the config). Serving
keeps the operand in HBM, so the estimates of every generation but TPU7x price the cache
update as a VMEM -> HBM write and the new rows' reads as VMEM -> VMEM copies
(docs/estimator.md, "The new K/V operand on v5p").

An estimate lowers one case with the config's block sizes, but the kernel pads its q / new
K/V / output operands by the largest ``bq`` / ``bkv`` of all three cases
(``kernel.api.prepare_inputs``), and the other two cases' sizes would come from the tables
or ``RPA_{D,P,M}_BLOCK_SIZES`` of the process that lowers. On v5p the padding moves the
kernel's cycles (its operands may sit in VMEM), so a config's estimate would move as the
tables it is tuning are rewritten. So the other cases take the heuristic's sizes
(``heuristic_only`` of ``kernel.analysis``): an estimate depends on its config, shape,
workload and generation only (docs/estimator.md, "Padding for the other cases").
"""
from __future__ import annotations

import dataclasses

import numpy as np

from kernel import analysis
from kernel.config import BlockSizes, Case, cdiv, get_kv_cache_shape, round_up
from kernel.workload import ModelShape, ServingLimits, Workload

# Generations whose probe programs depend on the other cases' padding (module doc): v5p's
# cycles; on TPU7x a decode config padded for a large prefill config can run out of VMEM.
# Their evaluator versions (``evaluators.compile``) name the heuristic's padding; v5e and
# v6e programs keep their cycles however padded (docs/estimator.md, "Padding for the other
# cases").
PADDING_SENSITIVE = frozenset({"v5p", "tpu7x"})

# Generations whose static profiler gives a kernel with an HBM -> HBM DMA 0 cycles
# (tests/test_estimator.py, on a one-DMA kernel; TPU7x the control). v4's profiler
# aborts on our programs whatever the placement ("Dma latency model is currently only
# supported on VF/VL/GF/GL", on the XLA ops before the kernel).
NO_HBM_TO_HBM_PRICE = frozenset({"v5e", "v5p", "v6e"})
# Generations whose estimates place the new K/V operand in VMEM (module doc).
PLACE_NEW_KV = frozenset({"v5p"})
# Prefill / mixed place it only for shapes whose largest operand (``NEW_KV_MAX_ROWS`` rows:
# a probe's 4096 tokens and a KV block of 2048 rows of padding) is at most this fraction of
# the VMEM, so that every config of a key is lowered alike (the operand's size varies with
# the config there; in decode it is at most 4 MiB). Beside the kernel's own buffers a larger
# one can turn the VMEM OOM the compile backend retries at another limit into a compile
# error ("Too many buffers are colored in the alternate memory"), a verdict on the config
# that serving would not give.
NEW_KV_VMEM_FRACTION = 0.25
NEW_KV_MAX_ROWS = 4096 + 2048


def places_new_kv(tpu: str, case: Case | str, model: ModelShape) -> bool:
    """Whether the estimate of ``case`` for ``model`` on ``tpu`` places the new K/V
    operand in VMEM (module doc)."""
    from kernel.config import get_generation, kv_bytes_per_token
    from kernel.hardware import tpu_info
    gen = get_generation(tpu).name
    if gen not in PLACE_NEW_KV:
        return False
    if Case.parse(case) == Case.DECODE:
        return True
    row_bytes = kv_bytes_per_token(model.num_kv_heads, model.head_dim, model.kv_dtype)
    return row_bytes * NEW_KV_MAX_ROWS <= tpu_info(gen).vmem_capacity_bytes * NEW_KV_VMEM_FRACTION


def places_on_no_estimate(tpu: str, case: Case | str, model: ModelShape) -> bool:
    """Whether a config whose kernel gets no estimate with the new K/V operand where XLA
    puts it is profiled again with it in VMEM (``compose.probe_config``): on the
    generations whose profiler prices an HBM -> HBM copy at 0 cycles, where
    ``places_new_kv`` does not place it already (module doc)."""
    from kernel.config import get_generation
    return get_generation(tpu).name in NO_HBM_TO_HBM_PRICE and not places_new_kv(tpu, case, model)


def lower(*, workload: dict, block_sizes, tpu: str, model: dict, limits: dict, case: str,
          options: dict | None = None, place_new_kv: bool | None = None):
    """``(Lowered, kernel name prefix)`` of one case of ``kernel`` with ``workload``'s
    metadata visible to the static profiler (``lower_for_estimate``), the
    new K/V operand in VMEM where ``places_new_kv`` says (module doc), or as
    ``place_new_kv`` says (False: where XLA puts it; for the checks of the placement)."""
    w = Workload(tuple(workload["q_lens"]), tuple(workload["kv_lens"]), tuple(workload["distribution"]))
    bs = BlockSizes(*block_sizes)
    case = Case.parse(case)
    shape = ModelShape(**model)
    if place_new_kv is None:
        place_new_kv = places_new_kv(tpu, case, shape)
    # the other cases' sizes pad the operands (``kernel.api.prepare_inputs``): the heuristic's,
    # never a table's or an override's (module doc)
    lowered = lower_for_estimate(w, bs, tpu, shape, ServingLimits(**limits), case, heuristic_only=True,
                                          new_kv_in_vmem=bool(place_new_kv), **(options or {}))
    return lowered, f"rpa_{case.value}_{bs.label()}"


# ------------------------------------------------------------ the analysis program
def estimate_limits(workload: Workload, limits: ServingLimits, block_sizes: dict) -> ServingLimits:
    """``limits`` cut down to what ``workload`` uses: token budget = its tokens (at least
    the largest ``bq``), sequence budget = its sequences; page size and max_model_len kept."""
    bq = max([b.bq for b in block_sizes.values() if b is not None] + [1])
    return dataclasses.replace(limits, max_num_tokens=round_up(max(workload.num_tokens, bq, 8), 8),
                               max_num_seqs=max(1, workload.num_seqs))


def estimate_num_pages(workload: Workload, model: ModelShape, limits: ServingLimits, tpu: str) -> int:
    """Pages of the KV cache an estimate compiles with: the workload's own, and at least
    enough for the cache to be twice the generation's VMEM. XLA keeps a cache that size
    in HBM, as a serving cache always is; XLA places a cache cut to a small workload's
    size in VMEM (even donated), and the kernel's page DMAs are then costed VMEM -> VMEM. The size costs the profiler nothing more: its cycles, time and memory do not
    depend on the number of pages."""
    from kernel.hardware import tpu_info
    page_bytes = int(np.prod(get_kv_cache_shape(1, limits.page_size, model.num_kv_heads, model.head_dim,
                                                np.dtype(model.kv_dtype)))) * np.dtype(model.kv_dtype).itemsize
    need = sum(cdiv(k, limits.page_size) for k in workload.kv_lens) + 1
    return max(need, cdiv(2 * int(tpu_info(tpu).vmem_capacity_bytes), page_bytes))


def lower_for_estimate(workload: Workload, block_sizes, tpu: str, model: ModelShape,
                       limits: ServingLimits, case: Case | str, **attn_options):
    """Lower one case's kernel with ``workload``'s metadata visible to the static profiler.

    ``block_sizes`` is the case's ``BlockSizes`` (or a dict case -> sizes). Compile the result
    with ``LIBTPU_INIT_ARGS=--xla_jf_dump_static_llo_profile_to=DIR`` set before libtpu
    loads; the profile of kernel ``rpa_<case>_<sizes>`` holds ``estimated_cycles``.
    """
    case = Case.parse(case)
    bsd = block_sizes if isinstance(block_sizes, dict) else {case: block_sizes}
    bsd = {Case.parse(k): (None if v is None else BlockSizes.coerce(v)) for k, v in bsd.items()}
    lo, hi = workload.case_range(case)
    if hi == lo:
        raise ValueError(f"workload has no {case.value} sequences (distribution={workload.distribution})")
    # Only the workload's own sizes: the profiler's memory and time grow with the array
    # sizes (max_num_tokens, pages), and nothing the kernel does per step depends on them
    # (its VMEM scratch depends on the block sizes and the model only).
    limits = estimate_limits(workload, limits, bsd)
    meta = analysis.static_meta_for(workload, limits)
    # fp8: see kernel.analysis.lower_deviceless. head_dim > 128: the profiler spends far more time and
    # memory on each XLA op that pads or fills the q / new-KV / output operands than on
    # the kernel itself.
    attn_options.setdefault("prepared_operands", np.dtype(model.kv_dtype).itemsize == 1 or model.head_dim > 128)
    return analysis.lower_deviceless(model, limits, tpu, bsd, cases=(case.value,), static_meta=meta,
                            num_pages=estimate_num_pages(workload, model, limits, tpu),
                            **attn_options)
