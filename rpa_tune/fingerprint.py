"""The kernel known by its program: digests of what the compiler receives.

``program_digest(lowered)`` hashes a lowered JAX program as the compiler gets it, without
what does not reach the compiled code: source locations (debug info), the names of the
private functions JAX outlines (``@_rpa_jit``, ``@_pad`` ...), and the Mosaic kernels'
``debug_locations``. Each Mosaic kernel body (MLIR bytecode inside the custom call's
``backend_config``) is parsed and printed as text without locations, so a comment or a
rename in ``kernel/`` gives the same digest and a change to the program a new one.

``CANONICAL`` is a fixed set of programs covering the kernel's code paths (the three cases
in one serving program, fp8 KV, head_dim 64 and 256, sliding window with soft cap, TPU7x's
chunk walk, and the static-profiler program of each case that the estimator prices, v5p's
with the new K/V operand placed in VMEM).
``kernel/program_fingerprint.json`` records their digests per JAX version for
``kernel.provenance.KERNEL_VERSION``; ``check()`` compares the code against it
(``rpa-tune fingerprint``; the test ``tests/test_fingerprint.py``), ``record()`` writes it
after a deliberate version bump (``rpa-tune fingerprint --record``).
"""
from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import re
from importlib import metadata

from kernel import provenance as kprov

_BACKEND_CONFIG = re.compile(r'backend_config = "((?:[^"\\]|\\.)*)"')
_PRIVATE_FUNC = re.compile(r"func\.func private @([A-Za-z0-9_$.]+)")


def _unescape(raw: str) -> str:
    """An MLIR string attribute's text (``\\22`` hex escapes) as the bytes it holds."""
    return re.sub(r"\\([0-9A-Fa-f]{2})", lambda m: chr(int(m.group(1), 16)), raw)


def _mosaic_text(body_b64: str) -> str:
    """A Mosaic kernel body (base64 MLIR bytecode) printed as MLIR text without locations."""
    from jax._src.interpreters import mlir
    from jax._src.lib import tpu
    from jaxlib.mlir import ir
    ctx = mlir.make_ir_context()
    tpu.register_dialect(ctx)
    with ctx, ir.Location.unknown():
        ctx.allow_unregistered_dialects = True
        module = ir.Module.parse(base64.b64decode(body_b64))
        return module.operation.get_asm(enable_debug_info=False)


def program_text(lowered) -> str:
    """The program ``lowered`` (``jax.stages.Lowered``) as canonical text (module doc)."""
    outer = lowered.compiler_ir("stablehlo").operation.get_asm(enable_debug_info=False)
    bodies: list[str] = []

    def kernel(m: re.Match) -> str:
        try:
            cfg = json.loads(_unescape(m.group(1)))
        except ValueError:
            return m.group(0)
        ccc = cfg.get("custom_call_config") if isinstance(cfg, dict) else None
        if not isinstance(ccc, dict) or "body" not in ccc:
            return m.group(0)
        bodies.append(_mosaic_text(ccc["body"]))
        rest = {k: v for k, v in ccc.items() if k not in ("body", "debug_locations")}
        other = {k: v for k, v in cfg.items() if k != "custom_call_config"}
        return f"backend_config = <kernel {len(bodies) - 1} {json.dumps([rest, other], sort_keys=True)}>"

    outer = _BACKEND_CONFIG.sub(kernel, outer)
    names = {}
    for name in _PRIVATE_FUNC.findall(outer):
        names.setdefault(name, f"f{len(names)}")
    if names:
        pattern = re.compile(r"@(" + "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))
                             + r")(?![A-Za-z0-9_$.])")
        outer = pattern.sub(lambda m: "@" + names[m.group(1)], outer)
    return "\n".join([outer, *(f"// kernel {i}\n{b}" for i, b in enumerate(bodies))])


def program_digest(lowered) -> str:
    """sha256 (24 hex digits) of ``program_text(lowered)``."""
    return hashlib.sha256(program_text(lowered).encode()).hexdigest()[:24]


# ------------------------------------------------------------------ the canonical programs
@dataclasses.dataclass(frozen=True)
class Canonical:
    label: str
    tpu: str
    model: dict
    limits: dict
    block_sizes: dict                 # case -> (bq, bkv, cq, ckv)
    options: dict = dataclasses.field(default_factory=dict)
    estimate: str | None = None       # a case: the static-profiler program of that case instead


_LLAMA8B = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, q_dtype="bfloat16", kv_dtype="bfloat16")
_LIMITS = dict(max_num_tokens=256, max_num_seqs=8, page_size=128, max_model_len=2048)
_SIZES = {"decode": (8, 512, 8, 256), "prefill": (128, 512, 128, 256), "mixed": (64, 512, 64, 256)}

CANONICAL = (
    Canonical("serve-v6e-bf16-d128", "v6e", _LLAMA8B, _LIMITS, _SIZES),
    Canonical("serve-v6e-fp8kv", "v6e", dict(_LLAMA8B, kv_dtype="float8_e4m3fn"), _LIMITS, _SIZES),
    Canonical("serve-v5e-d64", "v5e", dict(_LLAMA8B, head_dim=64), _LIMITS, _SIZES),
    Canonical("serve-v6e-d256-window-softcap", "v6e", dict(_LLAMA8B, num_q_heads=16, head_dim=256), _LIMITS,
              _SIZES, dict(sliding_window=1024, soft_cap=50.0)),
    Canonical("serve-tpu7x-bf16", "tpu7x", _LLAMA8B, _LIMITS, _SIZES),
    Canonical("estimate-v6e-decode", "v6e", _LLAMA8B, _LIMITS, _SIZES, estimate="decode"),
    Canonical("estimate-v6e-prefill", "v6e", _LLAMA8B, _LIMITS, _SIZES, estimate="prefill"),
    Canonical("estimate-v5p-mixed", "v5p", _LLAMA8B, _LIMITS, _SIZES, estimate="mixed"),
    Canonical("estimate-v5p-decode-new-kv-in-vmem", "v5p", _LLAMA8B, _LIMITS, _SIZES, estimate="decode"),
)

_ESTIMATE_WORKLOADS = {
    "decode": dict(q_lens=[1] * 8, kv_lens=[700] * 8, distribution=[8, 8, 8]),
    "prefill": dict(q_lens=[256], kv_lens=[256], distribution=[0, 1, 1]),
    "mixed": dict(q_lens=[1, 1, 96], kv_lens=[300, 300, 600], distribution=[0, 0, 3]),
}


def lower_canonical(c: Canonical):
    """``jax.stages.Lowered`` of one canonical program."""
    from kernel.workload import ModelShape, ServingLimits
    if c.estimate is None:
        from kernel.analysis import lower_deviceless
        return lower_deviceless(ModelShape(**c.model), ServingLimits(**c.limits), c.tpu, c.block_sizes,
                                **c.options)
    from .estimator import ours
    lowered, _ = ours.lower(workload=_ESTIMATE_WORKLOADS[c.estimate], block_sizes=c.block_sizes[c.estimate],
                            tpu=c.tpu, model=c.model, limits=c.limits, case=c.estimate, options=c.options)
    return lowered


def compute(labels=None) -> dict[str, str]:
    """``{label: program_digest}`` of the canonical programs (all, or those named)."""
    from kernel.analysis import quiet_libtpu
    quiet_libtpu()
    out = {}
    for c in CANONICAL:
        if labels is None or c.label in labels:
            out[c.label] = program_digest(lower_canonical(c))
    return out


def fingerprint(programs: dict[str, str]) -> str:
    """One digest (16 hex digits) of a ``{label: digest}`` set."""
    return hashlib.sha256(json.dumps(sorted(programs.items())).encode()).hexdigest()[:16]


@dataclasses.dataclass
class Check:
    status: str                   # "match" | "changed" | "unrecorded"
    jax_version: str | None
    changed: list[str]            # labels whose program differs from the record
    programs: dict[str, str]

    def line(self) -> str:
        kid = kprov.kernel_id()
        if self.status == "match":
            return (f"kernel {kid}: the {len(self.programs)} canonical programs match the recorded fingerprint "
                    f"{fingerprint(self.programs)} (jax {self.jax_version})")
        if self.status == "unrecorded":
            return (f"kernel {kid}: no fingerprint recorded under jax {self.jax_version}; record it with "
                    "`rpa-tune fingerprint --record`")
        return (f"kernel {kid}: the programs changed ({', '.join(self.changed)}) but KERNEL_VERSION did not: "
                "bump kernel.provenance.KERNEL_VERSION and run `rpa-tune fingerprint --record`")


def check(programs: dict[str, str] | None = None) -> Check:
    """The code's canonical programs against the record for this ``KERNEL_VERSION``."""
    jv = _jax_version()
    programs = compute() if programs is None else programs
    rec = kprov.recorded_fingerprint(jv)
    if rec is None:
        return Check("unrecorded", jv, [], programs)
    want = rec.get("programs", {})
    changed = sorted(k for k in set(want) | set(programs) if want.get(k) != programs.get(k))
    return Check("changed" if changed else "match", jv, changed, programs)


def record(programs: dict[str, str] | None = None) -> dict:
    """Write the canonical programs' digests for this ``KERNEL_VERSION`` and the installed
    JAX into ``kernel/program_fingerprint.json`` (other JAX versions' records of the same
    kernel version are kept; a new version starts a new file). Returns the record."""
    programs = compute() if programs is None else programs
    try:
        doc = json.loads(kprov.FINGERPRINT_FILE.read_text())
    except (OSError, ValueError):
        doc = {}
    if doc.get("kernel_version") != kprov.KERNEL_VERSION:
        doc = {"kernel_version": kprov.KERNEL_VERSION, "by_jax": {}}
    entry = {"fingerprint": fingerprint(programs), "programs": dict(sorted(programs.items()))}
    doc["by_jax"][_jax_version()] = entry
    tmp = kprov.FINGERPRINT_FILE.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    tmp.replace(kprov.FINGERPRINT_FILE)
    return entry


def _jax_version() -> str | None:
    try:
        return metadata.version("jax")
    except metadata.PackageNotFoundError:
        return None
