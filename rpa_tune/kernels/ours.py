"""This project's kernel (``kernel.ragged_paged_attention``) as a tuned kernel."""
from __future__ import annotations

from kernel.config import BlockSizes, Case, TuningKey, get_generation

from . import DeviceCall, ProbePlan, TunedKernel


class Ours(TunedKernel):
    name = "rpa-tune"
    doc = "this project's kernel (kernel.ragged_paged_attention)"
    builder = "rpa_tune.estimator.ours:lower"
    writes_kv_cache = True
    interpretable = True
    records_vmem_limit = True
    rejudgeable = True

    def version(self) -> str:
        from kernel.provenance import kernel_id
        return kernel_id()

    def config_version(self) -> str:
        from ..provenance import kernel_hash
        return kernel_hash()          # the kernel id, or the tests' pinned value

    def fingerprint(self, version, jax_version):
        from kernel.provenance import canonical_kernel_id, kernel_id, recorded_fingerprint
        if canonical_kernel_id(version) != kernel_id() or not jax_version:
            return None
        rec = recorded_fingerprint(jax_version)
        return None if rec is None else rec["fingerprint"]

    def row_provenance(self, prov: dict) -> dict:
        return prov

    def block_size_errors(self, case, bs: BlockSizes, page_size: int) -> list[str]:
        from kernel.config import block_size_errors
        return block_size_errors(Case.parse(case), bs, page_size)

    def heuristic(self, key: TuningKey, *, max_num_seqs: int = 128) -> BlockSizes:
        from kernel.heuristics import heuristic_for_key
        return heuristic_for_key(key)

    def predicted_vmem_bytes(self, model, limits, bs: BlockSizes, case) -> int:
        from .. import prefilter
        return prefilter.predicted_bytes(model, limits, bs, case)

    def table_block_sizes(self, key: TuningKey):
        from kernel import tables as kt
        dims = dict(max_num_tokens=key.max_num_tokens, num_q_heads=key.num_q_heads, num_kv_heads=key.num_kv_heads,
                    head_dim=key.head_dim, page_size=key.page_size, pages_per_seq=key.max_model_len // key.page_size,
                    q_dtype=key.q_dtype, kv_dtype=key.kv_dtype)
        return kt.lookup_entry(key.case, generation=key.generation, dims=dims, sliding_window=key.sliding_window)

    def vmem_limit(self, capacity: int, predicted: int | None = None) -> int:
        """The scoped VMEM limit it runs with on a chip of ``capacity`` bytes of VMEM for a
        config of ``predicted`` scratch bytes, without a table's limit: its own call's
        (``kernel.vmem.default_vmem_limit``: scratch + 50 % + 2 MiB, at least 16 MiB, at most
        half the capacity). A table entry records the limit it was tuned with (the compile
        backend raises it, up to the capacity, where the compiler asks for more), and the
        kernel then runs with that one."""
        from ..evaluators.base import initial_vmem_limit
        return initial_vmem_limit(predicted, capacity)

    def compile_vmem_limit(self, predicted, capacity: int) -> int:
        return self.vmem_limit(capacity, predicted)

    def probe_plan(self, case: Case, bs: BlockSizes, tpu: str, model, page_size: int) -> ProbePlan:
        from ..estimator import ours
        gen = get_generation(tpu)
        tags = []
        if case == Case.MIXED:
            tags.append(("mixed_warm_up", True))       # (decode and prefill keep their cache keys)
        if case == Case.PREFILL:
            tags.append(("long_walk", True))
        if gen.name in ours.PADDING_SENSITIVE:
            tags.append(("other_cases", "heuristic"))  # (``estimator.ours`` module doc)
        # Prefill / mixed programs only (profiler.FAST_FORWARD_FLAG), not those with a q-chunk
        # loop (fast-forward skips its iterations) or KV blocks of more than 8 pages (which
        # lost all their attention to it); the audit's retry stays the guard.
        fast = case != Case.DECODE and not bs.q_chunk_loop and bs.bkv <= 8 * page_size
        return ProbePlan(skip_dead_chunks=gen.skip_dead_chunks, mixed_warm_up=True, long_walk=True,
                         fast_forward=fast, padded_twin=True,
                         place_new_kv_on_no_estimate=ours.places_on_no_estimate(tpu, case, model),
                         cache_tags=tuple(tags))

    def walk(self, workload, model, case, bs: BlockSizes, page_size: int, sliding_window=None):
        from ..estimator import audit
        return audit.walk_bytes(workload, model, case, bs, page_size, sliding_window=sliding_window)

    def refused_estimate(self, key: TuningKey) -> str | None:
        from ..coverage import NEEDS_A_DEVICE_CASES
        return NEEDS_A_DEVICE_CASES.get((key.generation, Case.parse(key.case).value))

    def composition_error(self, case, bs: BlockSizes, evaluator_version: str | None) -> float:
        from ..estimator.compose import composition_error
        return composition_error(case, bs, evaluator_version)

    def device_call(self, case: str, bs: BlockSizes, page_size: int, capacity: int, *, task=None) -> DeviceCall:
        import kernel
        kw = {} if task is None else device_kwargs(task)
        return DeviceCall(kernel.ragged_paged_attention, f"rpa_{case}_{bs.label()}", kwargs=kw)


def device_kwargs(task) -> dict:
    """The keyword arguments of our kernel's device call for ``task``: the attention options,
    the task's block sizes for its case and the heuristic's for the other two, computed for
    the call's own shapes (as the estimator's ``heuristic_only`` build resolves them: never
    ``RPA_{D,P,M}_BLOCK_SIZES`` or a table, which would make the timed program depend on
    the tables of the process timing it)."""
    from kernel.analysis import serving_dims
    from kernel.api import heuristic_block_sizes_for
    own = Case.parse(task.case)
    dims = serving_dims(task.model, task.limits)
    gen = get_generation(task.generation).name
    kw = dict(sm_scale=task.model.head_dim ** -0.5, sliding_window=task.sliding_window, soft_cap=task.soft_cap)
    for c, arg in ((Case.DECODE, "d_block_sizes"), (Case.PREFILL, "p_block_sizes"), (Case.MIXED, "m_block_sizes")):
        bs = task.bs if c == own else heuristic_block_sizes_for(c, generation=gen, dims=dims,
                                                                sliding_window=task.sliding_window is not None)
        kw[arg] = tuple(int(v) for v in bs)
    return kw


KERNEL = Ours()
