"""Search spaces: declarative TOML files of candidate block sizes, legality rules and caps.

A space file (``search_spaces/<generation>.toml`` at the repository root, shipped in the
wheel as ``rpa_tune/_search_spaces``; or your own via ``--space``)
looks like::

    generation = "v6e"            # optional; "*" or absent: any generation
    rules = ["bq % cq == 0", ...] # legality rules for every case
    caps  = ["bkv <= round_up(max_model_len, page_size)"]   # size caps for every case

    [decode]
    bq  = [1, 2, 4]                               # decode: sequences per KV step
    cq  = [1, 2, 4]
    bkv = [128, 256, 512, 1024, 2048, 4096]
    ckv = [128, 256, 512, 1024]
    rules = ["cq == bq"]                          # added to the top-level rules
    caps  = ["bq * bkv * kv_bytes_per_token <= 16 * MiB"]

Rules and caps are Python-like boolean expressions over the names listed in
``EXPRESSION_NAMES`` (block sizes, the problem's dimensions and the chip's VMEM), with
``min``, ``max``, ``cdiv`` and ``round_up``; nothing else is allowed. A config is a
candidate when it passes every rule and cap *and* ``kernel.block_size_errors`` (the
kernel's own legality rules always apply, whatever the file says).

Enumeration is deterministic: the product of the candidate lists in ascending order,
``bq`` outermost and ``ckv`` innermost.
"""
from __future__ import annotations

import ast
import dataclasses
import importlib.resources
import itertools
import tomllib
from pathlib import Path

import numpy as np

from kernel.config import BlockSizes, Case, CASES, block_size_errors, cdiv, kv_bytes_per_token, round_up
from kernel.workload import ModelShape, ServingLimits

def _space_dir() -> Path:
    """Package data ``rpa_tune/_search_spaces`` of an installed wheel (importlib.resources),
    else ``search_spaces/`` at the root of the source checkout (what people edit)."""
    data = importlib.resources.files(__package__).joinpath("_search_spaces")
    if data.is_dir():
        return Path(str(data))
    return Path(__file__).resolve().parent.parent / "search_spaces"


SPACE_DIR = _space_dir()
KNOBS = ("bq", "bkv", "cq", "ckv")

EXPRESSION_NAMES = {
    "bq": "query tokens per fetched block", "bkv": "KV tokens per fetched block",
    "cq": "query tokens per compute step", "ckv": "KV tokens per compute step",
    "page_size": "KV-cache page size (tokens)", "max_num_tokens": "token bucket",
    "max_num_seqs": "max sequences per batch", "max_model_len": "max sequence length",
    "num_q_heads": "query heads per shard", "num_kv_heads": "KV heads per shard",
    "group": "num_q_heads // num_kv_heads", "head_dim": "head dimension",
    "head_dim_padded": "head_dim rounded up to 128 lanes",
    "kv_bytes_per_token": "bytes of merged, packed K+V of all KV heads per token (cache layout)",
    "q_bytes_per_token": "bytes of Q of all query heads per token (lane-padded)",
    "vmem_capacity": "VMEM bytes per TensorCore (jax tpu_info)",
    "mxu": "MXU column size (128 or 256)",
    "KiB": "1024", "MiB": "1024 * 1024",
}
FUNCTIONS = {"min": min, "max": max, "cdiv": cdiv, "round_up": round_up}


class SpaceError(ValueError):
    """A space file that cannot be used; the message names the file and the problem."""


_ALLOWED_NODES = (
    ast.Expression, ast.BoolOp, ast.And, ast.Or, ast.UnaryOp, ast.Not, ast.USub, ast.UAdd,
    ast.BinOp, ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Mod, ast.Div,
    ast.Compare, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE,
    ast.Name, ast.Load, ast.Constant, ast.Call,
)


@dataclasses.dataclass(frozen=True)
class Rule:
    """One boolean expression, validated at load time."""

    text: str
    code: object = dataclasses.field(compare=False, repr=False)
    where: str = dataclasses.field(default="", compare=False, repr=False)

    @classmethod
    def parse(cls, text: str, where: str) -> "Rule":
        try:
            tree = ast.parse(text, mode="eval")
        except SyntaxError as e:
            raise SpaceError(f"{where}: rule {text!r} is not a valid expression ({e.msg})") from None
        for node in ast.walk(tree):
            if not isinstance(node, _ALLOWED_NODES):
                what = "**" if isinstance(node, ast.Pow) else type(node).__name__
                raise SpaceError(f"{where}: rule {text!r} uses {what}, which is not allowed (allowed: "
                                 "+ - * / // %, comparisons, and/or/not, min/max/cdiv/round_up, the names "
                                 "of EXPRESSION_NAMES and numbers)")
            if isinstance(node, ast.Call):
                if not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS or node.keywords:
                    raise SpaceError(f"{where}: rule {text!r} calls something other than "
                                     f"{sorted(FUNCTIONS)} with positional arguments")
            elif isinstance(node, ast.Name) and node.id not in EXPRESSION_NAMES and node.id not in FUNCTIONS:
                raise SpaceError(f"{where}: rule {text!r} uses unknown name {node.id!r}; known names: "
                                 f"{', '.join(EXPRESSION_NAMES)}")
            elif isinstance(node, ast.Constant) and not isinstance(node.value, (int, float)):
                raise SpaceError(f"{where}: rule {text!r} has a non-numeric constant {node.value!r}")
        return cls(text, compile(tree, where, "eval"), where)

    def holds(self, ns: dict) -> bool:
        try:
            return bool(eval(self.code, {"__builtins__": {}}, {**FUNCTIONS, **ns}))  # noqa: S307 (validated AST)
        except ArithmeticError as e:      # division or modulo by zero (no power: values stay small)
            used = {n.id: ns[n.id] for n in ast.walk(ast.parse(self.text, mode="eval"))
                    if isinstance(n, ast.Name) and n.id in ns}
            raise SpaceError(f"{self.where}: rule {self.text!r} cannot be evaluated ({e}) for "
                             + ", ".join(f"{k}={v}" for k, v in used.items())) from None


@dataclasses.dataclass(frozen=True)
class CaseSpace:
    case: Case
    bq: tuple[int, ...]
    bkv: tuple[int, ...]
    cq: tuple[int, ...]
    ckv: tuple[int, ...]
    rules: tuple[Rule, ...]
    caps: tuple[Rule, ...]

    @property
    def size(self) -> int:
        return len(self.bq) * len(self.bkv) * len(self.cq) * len(self.ckv)

    def product(self):
        for bq, bkv, cq, ckv in itertools.product(self.bq, self.bkv, self.cq, self.ckv):
            yield BlockSizes(bq, bkv, cq, ckv)


@dataclasses.dataclass(frozen=True)
class Space:
    generation: str | None          # None: any
    source: str
    cases: dict

    def for_case(self, case: Case | str) -> CaseSpace:
        case = Case.parse(case)
        if case == Case.VERIFY and case not in self.cases and Case.MIXED in self.cases:
            return self.cases[Case.MIXED]     # verify runs in a mixed kernel: the mixed candidates
        if case not in self.cases:
            raise SpaceError(f"{self.source}: no [{case.value}] table in this space file")
        return self.cases[case]


@dataclasses.dataclass
class Enumeration:
    """The candidates of one case for one problem, and why the others were dropped."""

    candidates: list          # BlockSizes, in enumeration order
    total: int                # size of the raw product
    illegal: int = 0          # failed a rule or the kernel's legality check
    capped: int = 0           # failed a size cap
    reasons: dict = dataclasses.field(default_factory=dict)   # first failing rule text -> count


def _int_list(value, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not value or not all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value):
        raise SpaceError(f"{where} must be a non-empty list of positive ints, got {value!r}")
    return tuple(sorted(set(value)))


def _rules(value, where: str) -> tuple[Rule, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise SpaceError(f"{where} must be a list of expression strings, got {value!r}")
    return tuple(Rule.parse(v, where) for v in value)


def parse_space(doc: dict, source: str) -> Space:
    known_top = {"generation", "description", "rules", "caps"} | {c.value for c in CASES}
    unknown = set(doc) - known_top
    if unknown:
        raise SpaceError(f"{source}: unknown top-level keys {sorted(unknown)}; expected "
                         f"{sorted(known_top)}")
    gen = doc.get("generation")
    if gen in (None, "*", ""):
        gen = None
    else:
        from kernel.config import get_generation
        try:
            gen = get_generation(gen).name
        except ValueError as e:
            raise SpaceError(f"{source}: {e}") from None
    top_rules = _rules(doc.get("rules"), f"{source}: rules")
    top_caps = _rules(doc.get("caps"), f"{source}: caps")
    cases = {}
    for case in CASES:
        sect = doc.get(case.value)
        if sect is None:
            continue
        if not isinstance(sect, dict):
            raise SpaceError(f"{source}: [{case.value}] must be a table")
        unknown = set(sect) - set(KNOBS) - {"rules", "caps"}
        if unknown:
            raise SpaceError(f"{source}: [{case.value}] has unknown keys {sorted(unknown)}")
        missing = [k for k in KNOBS if k not in sect]
        if missing:
            raise SpaceError(f"{source}: [{case.value}] is missing candidate lists {missing}")
        cases[case] = CaseSpace(
            case=case, **{k: _int_list(sect[k], f"{source}: [{case.value}].{k}") for k in KNOBS},
            rules=top_rules + _rules(sect.get("rules"), f"{source}: [{case.value}].rules"),
            caps=top_caps + _rules(sect.get("caps"), f"{source}: [{case.value}].caps"))
    if not cases:
        raise SpaceError(f"{source}: defines none of the cases {[c.value for c in CASES]}")
    return Space(gen, source, cases)


def default_space_path(generation: str) -> Path:
    return SPACE_DIR / f"{generation}.toml"


def load_space(generation: str, path: str | Path | None = None) -> Space:
    """The shipped space of ``generation``, or the file at ``path``."""
    p = Path(path) if path is not None else default_space_path(generation)
    try:
        doc = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise SpaceError(f"space file {str(p)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SpaceError(f"space file {str(p)!r} cannot be read: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise SpaceError(f"space file {str(p)!r} is not valid TOML: {e}") from None
    space = parse_space(doc, str(p))
    if space.generation is not None and space.generation != generation:
        raise SpaceError(f"space file {str(p)!r} is for generation {space.generation!r}, "
                         f"not {generation!r}")
    return space


def context(model: ModelShape, limits: ServingLimits, generation: str) -> dict:
    """The names rules may use, for one problem."""
    from kernel.hardware import tpu_info
    info = tpu_info(generation)
    dp = round_up(model.head_dim, 128)
    return dict(
        page_size=limits.page_size, max_num_tokens=limits.max_num_tokens,
        max_num_seqs=limits.max_num_seqs, max_model_len=limits.max_model_len,
        num_q_heads=model.num_q_heads, num_kv_heads=model.num_kv_heads, group=model.group,
        head_dim=model.head_dim, head_dim_padded=dp,
        kv_bytes_per_token=kv_bytes_per_token(model.num_kv_heads, model.head_dim, model.kv_dtype),
        q_bytes_per_token=model.num_q_heads * dp * np.dtype(model.q_dtype).itemsize,
        vmem_capacity=int(info.vmem_capacity_bytes), mxu=int(info.mxu_column_size),
        KiB=1024, MiB=1024 ** 2)


def check_config(cs: CaseSpace, bs: BlockSizes, ctx: dict, legality=None) -> tuple[str, str] | None:
    """None when ``bs`` is a candidate, else ``("illegal" | "capped", reason)``.
    ``legality``: the tuned kernel's rules (``rpa_tune.kernels.TunedKernel.block_size_errors``;
    default ours, ``kernel.block_size_errors``)."""
    errs = (legality or block_size_errors)(cs.case, bs, ctx["page_size"])
    if errs:    # (the tuned kernel's rules; the label groups them in the plan's reasons)
        return "illegal", "kernel.block_size_errors: " + errs[0]
    ns = dict(ctx, bq=bs.bq, bkv=bs.bkv, cq=bs.cq, ckv=bs.ckv)
    for r in cs.rules:
        if not r.holds(ns):
            return "illegal", r.text
    for r in cs.caps:
        if not r.holds(ns):
            return "capped", r.text
    return None


def enumerate_space(cs: CaseSpace, ctx: dict, legality=None) -> Enumeration:
    out = Enumeration(candidates=[], total=cs.size)
    for bs in cs.product():
        verdict = check_config(cs, bs, ctx, legality)
        if verdict is None:
            out.candidates.append(bs)
            continue
        kind, reason = verdict
        if kind == "illegal":
            out.illegal += 1
        else:
            out.capped += 1
        if reason.startswith("kernel.block_size_errors"):
            reason = "kernel.block_size_errors"
        out.reasons[reason] = out.reasons.get(reason, 0) + 1
    return out
