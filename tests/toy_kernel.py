"""A third tuned kernel for the tests: our kernel's program under another name, with rules
and a baseline of its own (only KV blocks up to 1024 tokens; the baseline (8, 512, 8, 512)
for decode, (64, 512, 64, 256) otherwise). Registered through ``$RPA_TUNE_EXTRA_KERNELS``
(``toy_kernel:KERNEL`` with this folder on ``PYTHONPATH``), in every process of a sweep."""
from kernel.config import BlockSizes, Case

from rpa_tune.kernels import ProbePlan, TunedKernel
from rpa_tune.kernels.ours import KERNEL as OURS


def lower(**request):
    """The profiler child's builder: our kernel's program (``rpa_tune.estimator.ours.lower``)."""
    from rpa_tune.estimator import ours
    return ours.lower(**request)


class Toy(TunedKernel):
    name = "toy"
    doc = "a toy kernel for the tests (our program, other rules)"
    builder = "toy_kernel:lower"
    writes_kv_cache = True
    table_subdir = "toy"

    def version(self):
        return "toy==1"

    def block_size_errors(self, case, bs, page_size):
        errs = OURS.block_size_errors(case, bs, page_size)
        return errs + ([f"bkv={bs.bkv}: the toy takes KV blocks of at most 1024 tokens"] if bs.bkv > 1024 else [])

    def heuristic(self, key, *, max_num_seqs=128):
        return BlockSizes(8, 512, 8, 512) if key.case == "decode" else BlockSizes(64, 512, 64, 256)

    def probe_plan(self, case, bs, tpu, model, page_size):
        plan = OURS.probe_plan(case, bs, tpu, model, page_size)
        return ProbePlan(**{**plan.__dict__, "padded_twin": False, "cache_tags": plan.cache_tags + (("toy", 1),)})


KERNEL = Toy()
