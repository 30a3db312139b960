"""The coverage the shipped tables promise: one place for the matrix of keys.

Generations x model shapes x cases x token buckets x page sizes (v4 only on a device:
``NEEDS_A_DEVICE``). ``tables/generate.sh``
sweeps it (``python -m rpa_tune.coverage plan`` prints its sweeps), ``rpa-tune report``
draws it as the coverage matrix, and ``tests/test_tables_shipped.py`` asserts the shipped
tables hold it.

Two plans of it, by backend (``plan(backend=...)``): ``compile`` (the default) prices every
key, each key's explore buckets searched and the others filled from their cached probes:
with the static estimate where the profiler can price the programs, and ``modelled``
(``compile_method``) where it cannot (v4, TPU7x prefill / mixed: ``needs_a_device`` says
why), from the walk's features alone with the plain compile as the VMEM judge
(``rpa_tune.evaluators.compile``); ``tpu`` times every key on the chip, every bucket
searched (a device run costs the same for any config, so there is nothing to fill from).
``plan --backend tpu --here`` keeps the generation of the TPU on this machine.

* Shapes are per shard (``rpa_tune.presets``), plus the attention options a model's keys
  are tuned with: Gemma-2-9B's layers soft-cap their logits at 50 and every other one
  attends to a 4096-token window (its ``sliding_window=true`` keys); Llama-3-8B is also
  tuned with an fp8 (``float8_e4m3fn``) KV cache.
* Page sizes: 128 for every shape; 256 too for the 128-wide bf16 shapes, the size
  vLLM-TPU's Pallas backend picks for model lengths of 4K-8K (``next_power_of_2(len) // 16``
  clamped to [16, 256]).
* Model length: one bucket, 8192; the lookup serves any shorter one from it
  (``kernel.tables.index``).
* Workloads per bucket (``SWEEP_WORKLOAD``): decode 64 sequences (lognormal context,
  median 2048) at every bucket; prefill up to eight 1024-token chunks, as many as fill the
  bucket (one chunk of the bucket below 1024); mixed one chunked-prefill step that fills
  the bucket, prefill chunks of at most 1024 tokens beside extends, spec-decode and decode
  sequences (``rpa_tune.workloads.mixed_workload``; the steps it no longer prices:
  ``RETIRED_SWEEP_WORKLOADS``). A bucket whose workload an explore bucket already prices is
  filled, not explored (``bucket_roles``).
"""
from __future__ import annotations

import dataclasses
import functools
import os
import shlex
import sys

CASES = ("decode", "prefill", "mixed")
GENERATIONS = ("v4", "v5e", "v5p", "v6e", "tpu7x")
# Generations no estimate can cover here, and why: the compile backend prices their keys
# ``modelled`` (``compile_method``), a device times them (``rpa-tune sweep --backend tpu``).
NEEDS_A_DEVICE = {
    "v4": "libtpu's static profiler refuses every v4 program ('Dma latency model is currently "
          "only supported on VF/VL/GF/GL'), so no v4 config has an estimate",
}
ESTIMABLE = tuple(g for g in GENERATIONS if g not in NEEDS_A_DEVICE)
# Cases of an estimable generation whose estimates are refused, and why: the compile backend
# prices them ``modelled`` (``compile_method``; ``plan(estimable_only=True)`` skips them),
# ``rpa-tune export`` does not promote their estimates, and a device times them.
_TPU7X_PROBES = ("libtpu's static profiler charges our TPU7x prefill / mixed programs a fixed latency that "
                 "hides their cached-KV work (32 of 62 probed configs' cycles did not grow with their KV "
                 "steps: rpa_tune.estimator.compose.inconsistent_probes), so none of their estimates can "
                 "be audited")
NEEDS_A_DEVICE_CASES = {("tpu7x", "prefill"): _TPU7X_PROBES, ("tpu7x", "mixed"): _TPU7X_PROBES}


def needs_a_device(generation: str, case: str) -> str | None:
    """Why keys of ``generation`` / ``case`` have no estimate here (they need the tpu
    backend on a device), or None when they are estimable."""
    return NEEDS_A_DEVICE.get(generation) or NEEDS_A_DEVICE_CASES.get((generation, case))


ESTIMATE, MODELLED = "estimate", "modelled"


def compile_method(generation: str, case: str) -> str:
    """How the compile backend prices keys of ``generation`` / ``case`` (aliases accepted):
    ``estimate`` (the static profiler's estimate under the device-cost model), or
    ``modelled`` where no estimate is possible (``needs_a_device`` says why): the
    device-cost model from the config's walk features alone, the plain deviceless compile
    still the VMEM judge. Every config of a key is priced one way, so a key's ranking never
    sets a modelled time against an estimate (``rpa-tune export`` ranks one method per key)."""
    from kernel.config import Case, get_generation
    return MODELLED if needs_a_device(get_generation(generation).name, Case.parse(case).value) else ESTIMATE
BUCKETS = (128, 256, 512, 1024, 2048, 4096, 8192)
# Buckets whose search proposes new configs; the others are filled from what these
# evaluated (``rpa_tune.engine.sibling_configs``: priced from cached probes) plus their
# heuristic, so a shape costs the compiles of three buckets' searches, not seven (fewer
# where explore buckets share a workload: ``bucket_roles``).
EXPLORE_BUCKETS = (128, 2048, 8192)
MAX_MODEL_LEN = 8192
MAX_NUM_SEQS = 128
GEMMA2_SOFT_CAP = 50.0
GEMMA2_WINDOW = 4096


@dataclasses.dataclass(frozen=True)
class Shape:
    """One row of the coverage matrix: a preset with the options its keys are tuned with."""
    name: str
    preset: str
    kv_dtype: str | None = None          # None: the preset's
    sliding_window: int | None = None    # the key's sliding_window flag, and the window swept
    soft_cap: float | None = None
    page_sizes: tuple[int, ...] = (128,)

    def sweep_args(self) -> list[str]:
        a = ["--model", self.preset]
        if self.kv_dtype:
            a += ["--kv-dtype", self.kv_dtype]
        if self.sliding_window:
            a += ["--sliding-window", str(self.sliding_window)]
        if self.soft_cap:
            a += ["--soft-cap", f"{self.soft_cap:g}"]
        return a


# cheapest to estimate first (KV heads per shard), so a run cut short still covers them
SHAPES: tuple[Shape, ...] = (
    Shape("llama3-70b-tp8", "llama3-70b-tp8", page_sizes=(128, 256)),
    Shape("starcoder-15b (MQA)", "starcoder-15b"),
    Shape("qwen3-32b-tp4", "qwen3-32b-tp4", page_sizes=(128, 256)),
    Shape("llama3-8b", "llama3-8b", page_sizes=(128, 256)),
    Shape("llama3-8b fp8 KV", "llama3-8b", kv_dtype="float8_e4m3fn"),
    Shape("llama3.2-1b", "llama3.2-1b"),
    Shape("gemma2-9b", "gemma2-9b", soft_cap=GEMMA2_SOFT_CAP),
    Shape("gemma2-9b window", "gemma2-9b", sliding_window=GEMMA2_WINDOW, soft_cap=GEMMA2_SOFT_CAP),
)

# What the shipped tables hold: (generation, shape name, case) of the plan whose every page
# size and bucket has a current entry, tuned for this kernel source and not on a retired
# sweep workload (``on_retired_workload``; ``tests/test_tables_shipped.py`` asserts it from
# the files; ``rpa-tune report``'s coverage matrix shows the rest). It is every triple an
# estimate can cover (``plan(estimable_only=True)``, TPU7x decode included): the tables
# cover the matrix but what needs a device, and a shape added to ``SHAPES`` is claimed,
# failing that test, until its tables ship.
COMPLETE: tuple[tuple[str, str, str], ...] = tuple(
    (g, s.name, c) for g in ESTIMABLE for s in SHAPES for c in CASES if not needs_a_device(g, c))

# the generated workload of every swept bucket (module doc): ``make_workload`` keywords, and
# the same as ``rpa-tune sweep`` options
SWEEP_WORKLOAD_OPTIONS = {"decode": {"num_seqs": 64}, "prefill": {"chunk": 1024, "num_chunks": 8},
                          "mixed": {}}
SWEEP_WORKLOAD = {c: [x for k, v in o.items() for x in ("--" + k.replace("_", "-"), str(v))]
                  for c, o in SWEEP_WORKLOAD_OPTIONS.items()}


def sweep_workload(case: str, page_size: int, bucket: int):
    """The batch the plan's sweep of ``case`` prices at token bucket ``bucket`` (module doc)."""
    from kernel.workload import ServingLimits
    from .workloads import make_workload
    limits = ServingLimits(page_size=page_size, max_num_tokens=bucket, max_num_seqs=MAX_NUM_SEQS,
                           max_model_len=MAX_MODEL_LEN)
    return make_workload(case, limits, **SWEEP_WORKLOAD_OPTIONS[case])[0]


@functools.lru_cache(maxsize=None)
def sweep_workload_id(case: str, page_size: int, bucket: int) -> str:
    """``workload_id`` of ``sweep_workload`` (as results and table provenance record it)."""
    from .workloads import workload_id
    return workload_id(sweep_workload(case, page_size, bucket))


# (case, token bucket) -> the workload_ids the plan's sweep priced there before and no longer
# does: mixed steps of one chunk of a quarter of the bucket, at most 512 tokens
# (``workloads.mixed_workload`` fills the bucket instead). Bucket 128's step is the same.
RETIRED_SWEEP_WORKLOADS: dict[tuple[str, int], tuple[str, ...]] = {
    ("mixed", 256): ("842075d70dd9",), ("mixed", 512): ("198b794248a1",), ("mixed", 1024): ("fc879d2cbea2",),
    **{("mixed", t): ("e2834d4ff7e2",) for t in (2048, 4096, 8192)}}


def on_retired_workload(entry) -> bool:
    """Whether a table entry was tuned on a batch the plan's sweep once priced at its key and
    no longer does (``RETIRED_SWEEP_WORKLOADS``). Such an entry is stale like one of an
    earlier kernel: shipped, used by the kernel, but not coverage. An entry tuned on any
    other workload (a user's own) is not judged; a sliding window or soft cap recorded after
    the batch's id ("...-sw4096-cap50") does not matter."""
    k = entry.key
    wid = (entry.provenance.get("workload_id") or "").partition("-")[0]
    return k.max_model_len == MAX_MODEL_LEN and wid in RETIRED_SWEEP_WORKLOADS.get((k.case, k.max_num_tokens), ())


def is_stale(entry, source: str) -> bool:
    """Shipped but not coverage: tuned for another kernel source than ``source``, or on a
    retired sweep workload (``on_retired_workload``)."""
    from kernel.tables import tuned_for_another_kernel
    return tuned_for_another_kernel(entry, source) or on_retired_workload(entry)


@functools.lru_cache(maxsize=None)
def bucket_roles(case: str, page_size: int) -> tuple[tuple, tuple]:
    """(explore buckets, fill buckets) of one key group. An explore bucket (``EXPLORE_BUCKETS``)
    whose sweep workload (``workload_id``, as results record it) equals that of a smaller
    explore bucket is filled instead: its fill evaluates that bucket's best configs on the
    same batch (``--seeds``), from the same cached probes, so it gets the same winner without
    a second search. Decode's 64 sequences are the same batch at every bucket (prefill's and
    mixed's batches fill their bucket)."""
    explore, seen = [], set()
    for t in EXPLORE_BUCKETS:
        wid = sweep_workload_id(case, page_size, t)
        if wid not in seen:
            seen.add(wid)
            explore.append(t)
    return tuple(explore), tuple(t for t in BUCKETS if t not in explore)


@dataclasses.dataclass(frozen=True)
class Sweep:
    """One ``rpa-tune sweep`` of the plan: buckets of one generation, shape, case and page
    size (the buckets share their configs' probe compiles). ``role``: ``explore`` (a
    search with the budget) or ``fill`` (the heuristic and the explored configs only:
    ``--budget 1``), run after the explore sweep of the same key."""
    generation: str
    shape: Shape
    case: str
    page_size: int
    buckets: tuple = BUCKETS
    role: str = "explore"

    def args(self) -> list[str]:
        return (["--tpu", self.generation, "--case", self.case] + self.shape.sweep_args()
                + ["--page-size", str(self.page_size), "--max-model-len", str(MAX_MODEL_LEN),
                   "--max-num-seqs", str(MAX_NUM_SEQS), "--buckets", ",".join(map(str, self.buckets))]
                + SWEEP_WORKLOAD[self.case])


BACKENDS = ("compile", "tpu")


def plan(generations=None, shapes=SHAPES, cases=CASES, estimable_only: bool = False,
         backend: str = "compile") -> list[Sweep]:
    """The matrix's sweeps for ``backend``, of every generation by default. ``compile``: an
    explore and a fill sweep per key (``bucket_roles``), priced as ``compile_method`` says
    (``modelled`` where no estimate is possible), as ``tables/generate.sh`` runs it;
    ``estimable_only``: only the keys an estimate can price (the estimable generations,
    without ``NEEDS_A_DEVICE_CASES``). ``tpu``: one explore sweep of every bucket per key."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: valid are {', '.join(BACKENDS)}")
    if generations is None:
        generations = ESTIMABLE if backend == "compile" and estimable_only else GENERATIONS
    out = []
    for s in shapes:
        for g in generations:
            for c in cases:
                if backend == "compile" and estimable_only and needs_a_device(g, c):
                    continue
                for p in s.page_sizes:
                    if backend == "tpu":
                        out.append(Sweep(g, s, c, p, BUCKETS, "explore"))
                        continue
                    explore, fill = bucket_roles(c, p)
                    out.append(Sweep(g, s, c, p, explore, "explore"))
                    out.append(Sweep(g, s, c, p, fill, "fill"))
    return out


def expected_keys(sweeps: list | None = None) -> list:
    """Every ``TuningKey`` of ``sweeps`` (default: the whole plan)."""
    from kernel.config import TuningKey
    from .presets import get_preset
    keys = []
    for sw in plan() if sweeps is None else sweeps:
        p = get_preset(sw.shape.preset)
        for t in sw.buckets:
            keys.append(TuningKey(sw.generation, sw.case, p.q_dtype, sw.shape.kv_dtype or p.kv_dtype,
                                  p.num_q_heads, p.num_kv_heads, p.head_dim, sw.page_size, t,
                                  MAX_MODEL_LEN, sw.shape.sliding_window is not None))
    return keys


def shard(sweeps: list[Sweep], index: int, count: int) -> list[Sweep]:
    """Part ``index`` (1-based) of ``count`` of a plan, for as many machines: the keys
    (generation, shape, case, page size) go to the part with the fewest keys so far, in
    plan order, each with its explore and fill sweeps (the fill prices what its explore
    evaluated, from probes cached on the machine that ran it), and a shape whose head_dim
    is padded to 128 lanes with its 128-wide twin (Llama-3.2-1B with Llama-3-8B: the same
    kernel programs, whose probe records the narrower one reads, ``compose.padded_twin``).
    The parts are disjoint, together the whole plan, each in plan order."""
    if not 1 <= index <= count:
        raise ValueError(f"shard {index}/{count}: the part must be 1..{count}")
    group_of = [_machine_group(sw) for sw in sweeps]
    groups: dict = {}
    for sw, g in zip(sweeps, group_of):
        groups.setdefault(g, set()).add((sw.generation, sw.shape, sw.case, sw.page_size))
    load, part = [0] * count, {}
    for g, keys in groups.items():
        k = min(range(count), key=lambda i: (load[i], i))
        part[g] = k
        load[k] += len(keys)
    return [sw for sw, g in zip(sweeps, group_of) if part[g] == index - 1]


def _machine_group(sw: Sweep) -> tuple:
    """What must run on one machine (``shard``): a key, or a key and its padded twin's."""
    from kernel.config import round_up
    from .presets import get_preset
    p = get_preset(sw.shape.preset)
    return (sw.generation, sw.case, sw.page_size, p.num_q_heads, p.num_kv_heads, round_up(p.head_dim, 128),
            p.q_dtype, sw.shape.kv_dtype or p.kv_dtype, sw.shape.sliding_window, sw.shape.soft_cap)


def parse_shard(text: str) -> tuple[int, int]:
    """``"K/N"`` -> (K, N), 1 <= K <= N; ValueError naming the value otherwise."""
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard {text!r}: expected K/N, e.g. 2/4 (part K of N)") from None
    if not 1 <= k <= n:
        raise ValueError(f"--shard {text!r}: K must be 1..N")
    return k, n


def tpu_here() -> tuple[str | None, str]:
    """(the generation of the TPU on this machine or None, what was found), by the tpu
    backend's device probe (a child process; the test-only stand-in device honoured)."""
    from .evaluators.tpu import probe_devices, tpu_generation_present
    probe = probe_devices()
    here = tpu_generation_present(probe)
    err = probe.get("error")
    err = " ".join(str(err[-1] if isinstance(err, list) and err else err or "").split())[-300:]
    found = f"a TPU {here} ({probe.get('device_kind')})" if here else (
        f"no TPU (platform {probe.get('platform')}" + (f", device {probe['device_kind']}" if probe.get("device_kind")
                                                       not in (None, "cpu") else "")
        + (f"; the device probe: {err}" if err else "") + ")")
    return here, found


def main(argv: list[str]) -> int:
    """``python -m rpa_tune.coverage plan [--backend compile|tpu] [--here] [--gen G]
    [--shape NAME] [--case C] [--shard K/N]`` (``--gen``, ``--shape``, ``--case``
    repeatable): one line per sweep of the plan (``--shard``: of its part K of N, ``shard``):
    its role, then its sweep arguments. ``compile`` (default): every generation and case,
    a line on stderr for those it prices ``modelled`` (``compile_method``); ``tpu``: every
    generation and case; ``--here``: only the generation of the TPU on this machine (exit 2
    in one line without one, or when ``--gen`` names another)."""
    import argparse
    ap = argparse.ArgumentParser(prog="python -m rpa_tune.coverage")
    ap.add_argument("command", choices=["plan"])
    ap.add_argument("--backend", choices=BACKENDS, default="compile")
    ap.add_argument("--here", action="store_true", help="tpu: only the generation of the TPU on this machine")
    ap.add_argument("--gen", action="append", choices=GENERATIONS)
    ap.add_argument("--shape", action="append", choices=[s.name for s in SHAPES])
    ap.add_argument("--case", action="append", choices=CASES)
    ap.add_argument("--shard", default="1/1", help="K/N: part K of N of the plan, for N machines")
    a = ap.parse_args(argv)
    try:
        part = parse_shard(a.shard)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    shapes = tuple(s for s in SHAPES if not a.shape or s.name in a.shape)
    cases = tuple(a.case or CASES)
    if a.here and a.backend != "tpu":
        print("error: --here plans for the TPU on this machine: it needs --backend tpu", file=sys.stderr)
        return 2
    if a.backend == "tpu":
        gens = tuple(a.gen or GENERATIONS)
        if a.here:
            here, found = tpu_here()
            if here is None:
                print(f"error: --backend tpu times on this machine's TPU and this machine has {found}: run it on "
                      "a TPU VM, or list the plan anywhere with tables/generate.sh --backend tpu --dry-run",
                      file=sys.stderr)
                return 2
            if here not in gens:
                print(f"error: this machine has {found}, not {' or '.join(gens)} (--gen): a device times "
                      "its own generation only", file=sys.stderr)
                return 2
            gens = (here,)
        sweeps = plan(generations=gens, shapes=shapes, cases=cases, backend="tpu")
    else:
        gens = tuple(a.gen or GENERATIONS)
        for g in gens:
            for c in cases:
                if compile_method(g, c) == MODELLED:
                    print(f"modelled {g} {c} (no estimate: {needs_a_device(g, c)})", file=sys.stderr)
        sweeps = plan(generations=gens, shapes=shapes, cases=cases)
    lines = [f"{sw.role} {shlex.join(sw.args())}\n" for sw in shard(sweeps, *part)]
    try:
        sys.stdout.writelines(lines)
        sys.stdout.flush()
    except BrokenPipeError:
        # the reader stopped early (`| head`): not an error; keep Python's exit-time flush quiet
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
