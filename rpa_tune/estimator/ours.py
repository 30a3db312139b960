"""Builders for the profiler child: this project's kernel, lowered for one workload.

On v5p the new tokens' K/V operand is placed in VMEM (``places_new_kv``: in decode, and in
prefill / mixed for shapes of at most 2 KiB of K/V per token). The kernel's KV-cache update
copies the new rows from that operand into the cache pages, and libtpu's static profiler
marks a copy between two HBM buffers *remote*: on v5e, v5p and v6e a kernel with one gets
0 estimated cycles (``NO_HBM_TO_HBM_PRICE``; a one-DMA Pallas kernel, HBM -> HBM: 0 cycles
and DMA_INSTRUCTION_TYPE_REMOTE, on TPU7x 620 cycles, local). Where the operand goes is
XLA's choice: VMEM in every program estimated before, but in v5p decode programs of two
or more KV heads XLA made it with an unfused pad, in HBM, and every such config crashed
("no estimate"). Placed in VMEM they are estimated, and the v5p programs XLA's placement
could estimate keep their cycles (``benchmarks/new_kv_placement.py``: 10 of 10 sampled
recorded configs, to the cycle; ``tests/test_estimator.py``). v5e and v6e keep XLA's
placement: the explicit one moved the q operand out of VMEM in a v5p prefill program of 8
KV heads (43,830 -> 42,292 cycles), so their new estimates might not compare with recorded
ones. Where the placement stays XLA's (v5e and v6e, and v5p prefill / mixed of more than
2 KiB of K/V per token), a config whose kernel gets no estimate is profiled again with the
operand in VMEM (``places_on_no_estimate``; XLA left it in HBM in 5 of the first 9 v5p
Llama-3-8B prefill configs tried). Only configs that had no estimate change, so no recorded
estimate does; a config's probes are all placed alike, but within a key the placed configs
and the others may differ by what the placement moves (the 3.5 % above; the two configs
XLA priced in the v5p Llama-3-8B page-128 prefill sweep kept their cycles placed). A placed
config that runs out of VMEM has that verdict (the compile evaluator retries it at another
limit, as any profiled compile); any other failure leaves the first crash its verdict (a
compile error from an operand serving keeps in HBM says nothing about the config). Serving
keeps the operand in HBM, so the estimates of every generation but TPU7x price the cache
update as a VMEM -> HBM write and the new rows' reads as VMEM -> VMEM copies
(``docs/estimator.md``).

An estimate lowers one case with the config's block sizes, but the kernel pads its q / new
K/V / output operands by the largest ``bq`` / ``bkv`` of all three cases
(``kernel.api.prepare_inputs``), and the other two cases' sizes would come from the tables
or ``RPA_{D,P,M}_BLOCK_SIZES`` of the process that lowers. On v5p the padding moves the
kernel's cycles (its operands may sit in VMEM): the v5p Llama-3-8B mixed probes of
(64, 512, 64, 512) cost 40,141 and 45,369 cycles under the tables of 2026-11-29 (prefill
(256, 256, 64, 256) at the probes' budget) and 41,312 and 46,548 under those of
2026-12-06, so the same config's estimate moved 3.9 % as the tables it was tuning were
rewritten. So the other cases take the heuristic's sizes (``heuristic_only`` of ``kernel.analysis``):
an estimate depends on its config, shape, workload and generation only.
"""
from __future__ import annotations

from kernel.config import BlockSizes, Case
from kernel.workload import ModelShape, ServingLimits, Workload

# Generations whose probe programs moved with the other cases' padding before it was the
# heuristic's (module doc): v5p's cycles; on TPU7x a decode config (1, 2048, 1, 1024) went
# out of VMEM at 32 MiB padded for prefill (512, 2048, 64, 512), fitting with the heuristic's.
# Their probe-cache keys and evaluator versions (``evaluators.compile``) changed with it, so
# their configs are priced again; v5e and v6e programs kept their cycles to the cycle
# however padded (docs/estimator.md, "Padding for the other cases"), and their records stand.
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
# one turned the VMEM OOM the compile backend retries at another limit into a compile
# error ("Too many buffers are colored in the alternate memory": Llama-3-8B prefill and
# mixed on v5p at a 56 MiB limit), a verdict on the config that serving would not give.
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
    metadata visible to the static profiler (``kernel.analysis.lower_for_estimate``), the
    new K/V operand in VMEM where ``places_new_kv`` says (module doc), or as
    ``place_new_kv`` says (False: where XLA puts it; for the checks of the placement)."""
    from kernel import analysis
    w = Workload(tuple(workload["q_lens"]), tuple(workload["kv_lens"]), tuple(workload["distribution"]))
    bs = BlockSizes(*block_sizes)
    case = Case.parse(case)
    shape = ModelShape(**model)
    if place_new_kv is None:
        place_new_kv = places_new_kv(tpu, case, shape)
    # the other cases' sizes pad the operands (``kernel.api.prepare_inputs``): the heuristic's,
    # never a table's or an override's (module doc)
    lowered = analysis.lower_for_estimate(w, bs, tpu, shape, ServingLimits(**limits), case, heuristic_only=True,
                                          new_kv_in_vmem=bool(place_new_kv), **(options or {}))
    return lowered, f"rpa_{case.value}_{bs.label()}"
