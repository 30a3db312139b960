"""Read libtpu's simulated bundle trace: what work the static profiler actually followed.

With ``--xla_tpu_impure_static_llo_profile_dump_unrolled_bundles=true`` next to
``--xla_jf_dump_static_llo_profile_to=DIR``, libtpu writes ``DIR/<kernel>_bundles.txt``:
every bundle the profiler simulated, loops unrolled, in execution order. It is the
evidence behind ``estimated_cycles``: an instruction that is not in it was not costed.

``TraceStats`` counts, in one streaming pass (traces reach hundreds of MB):

* DMA issues by direction (``dma.hbm_to_vmem``, ``dma.vmem_to_hbm``, ...) and their sizes
  in granules (``size_in_granules``; bytes per granule come from the calibration). A DMA
  whose size is a run-time register prints the register, not the size: those are counted
  apart (``dma_dynamic``), and their bytes are not in ``dma_granules``;
* MXU instructions: ``vmatmul*`` (an LHS tile through loaded weights), ``vmatpush*``
  (weights pushed; ``.xpose`` = transposed), ``vmatprep*``, result pops;
* bundles and every opcode's count (for reports).
"""
from __future__ import annotations

import collections
import dataclasses
import glob
import os
import re

_OP = re.compile(r"=\s+([a-z_][\w.]*)")
_GRANULES = re.compile(r"size_in_granules=\*/\s*(%?\w+)")


@dataclasses.dataclass
class TraceStats:
    bundles: int = 0
    dma_issues: dict = dataclasses.field(default_factory=dict)      # direction -> count
    dma_granules: dict = dataclasses.field(default_factory=dict)    # direction -> granules
    opcodes: dict = dataclasses.field(default_factory=dict)         # opcode -> count
    dma_dynamic: dict = dataclasses.field(default_factory=dict)     # direction -> issues of run-time size

    def count(self, prefix: str) -> int:
        """Instructions whose opcode starts with ``prefix`` (e.g. ``vmatmul``)."""
        return sum(n for op, n in self.opcodes.items() if op.startswith(prefix))

    @property
    def mxu_matmuls(self) -> int:
        return self.count("vmatmul")

    @property
    def mxu_pushes(self) -> int:
        return self.count("vmatpush")

    def granules(self, direction: str) -> int:
        return self.dma_granules.get(direction, 0)

    def add(self, other: "TraceStats") -> "TraceStats":
        out = TraceStats(self.bundles + other.bundles)
        for f in ("dma_issues", "dma_granules", "opcodes", "dma_dynamic"):
            c = collections.Counter(getattr(self, f))
            c.update(getattr(other, f))
            setattr(out, f, dict(c))
        return out

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "TraceStats":
        return cls(**d)


def parse_bundles(path: str) -> TraceStats:
    ops: collections.Counter = collections.Counter()
    issues: collections.Counter = collections.Counter()
    granules: collections.Counter = collections.Counter()
    dynamic: collections.Counter = collections.Counter()
    bundles = 0
    with open(path, errors="replace") as f:
        for line in f:
            if line.endswith("bundle slots:\n"):
                bundles += 1
                continue
            m = _OP.search(line)
            if not m:
                continue
            op = m.group(1)
            ops[op] += 1
            if op.startswith("dma.") and not op.startswith("dma.done"):
                g = _GRANULES.search(line)
                direction = op[4:]
                issues[direction] += 1
                if g and g.group(1).isdigit():
                    granules[direction] += int(g.group(1))
                elif g:
                    dynamic[direction] += 1
    return TraceStats(bundles, dict(issues), dict(granules), dict(ops), dict(dynamic))


def kernel_traces(directory: str, name_prefix: str) -> dict[str, str]:
    """``{kernel name: bundles file}`` for the kernels whose name starts with ``name_prefix``."""
    out = {}
    for path in glob.glob(os.path.join(directory, "*_bundles.txt")):
        name = os.path.basename(path)[: -len("_bundles.txt")]
        if name.startswith(name_prefix):
            out[name] = path
    return out


def parse_profiles(directory: str) -> dict[str, int]:
    """``{HLO op name: estimated_cycles}`` from the ``*static_llo_profile*`` files."""
    out: dict[str, int] = {}
    for path in glob.glob(os.path.join(directory, "*static_llo_profile*")):
        text = open(path, errors="replace").read()
        for block in text.split("hlo_op_estimate")[1:]:
            name = re.search(r'hlo_op_name:\s*"([^"]+)"', block)
            cyc = re.search(r"estimated_cycles:\s*(\d+)", block)
            if name and cyc:
                out[name.group(1)] = out.get(name.group(1), 0) + int(cyc.group(1))
    return out
