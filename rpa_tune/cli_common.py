"""What every ``rpa-tune`` command shares: the error style, the ``--tpu`` alias rule, the
choice enums, and the model / serving-limits options with their validation.

Errors: every bad input (a Click usage error, an out-of-range or unknown choice, or a
``UsageError`` raised by a command) is reported as one line ``rpa-tune: error: ...`` on
stderr with exit code 2, before anything is written (``RpaTuneGroup``, ``fail``).
"""
from __future__ import annotations

import enum
import sys
from typing import Annotated, Optional

import typer
from typer.core import TyperGroup

try:      # recent Typer vendors Click as typer._click
    from typer._click.exceptions import ClickException
except ImportError:  # pragma: no cover - Typer with Click as a dependency
    from click.exceptions import ClickException

from kernel.config import GENERATIONS, Case, get_generation
from kernel.validate import SUPPORTED_HEAD_DIMS, SUPPORTED_KV_DTYPES, SUPPORTED_Q_DTYPES

from .evaluators.base import BACKENDS, STATUSES
from .kernels import kernel_names
from .search import SEARCHES

# the kernel's own constants (importing kernel.config / kernel.validate loads no JAX)
GENERATION_NAMES = tuple(GENERATIONS)      # v4, v5e, v5p, v6e, tpu7x
TPU_ALIASES = "any case; tpu-/tpu_ prefixes; v7x, 7x = tpu7x; v6 = v6e; v5lite = v5e; device kinds"
HEAD_DIMS = tuple(SUPPORTED_HEAD_DIMS)
PREFIX = "rpa-tune: error: "


class UsageError(Exception):
    """Bad command-line input: reported in one line, exit code 2."""


def fail(msg: str, code: int = 2):
    """Print one ``rpa-tune: error:`` line and exit with ``code`` (2: bad input)."""
    sys.stderr.write(PREFIX + " ".join(str(msg).split()) + "\n")
    sys.stderr.flush()
    raise typer.Exit(code)


class RpaTuneGroup(TyperGroup):
    """Typer group whose Click errors use the one-line style (instead of a usage box)."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        argv = list(sys.argv[1:] if args is None else args)
        try:
            rv = super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
        except ClickException as e:
            sys.stderr.write(PREFIX + _one_line(e, argv) + "\n")
            sys.exit(e.exit_code)
        except typer.Abort:
            sys.stderr.write("rpa-tune: aborted\n")
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


def _one_line(e: ClickException, argv: list[str]) -> str:
    """A Click error as one line that names the value given (range errors do not)."""
    msg = " ".join(e.format_message().replace("Value error, ", "").split())
    opts = getattr(getattr(e, "param", None), "opts", None) or []
    given = None
    for i, a in enumerate(argv):
        for o in opts:
            if a == o and i + 1 < len(argv):
                given = argv[i + 1]
            elif a.startswith(o + "="):
                given = a[len(o) + 1:]
    if given is not None and repr(given) not in msg and msg.startswith("Invalid value for "):
        head, _, rest = msg.partition(": ")
        msg = f"{head} {given!r}: {rest}"
    return msg


# ------------------------------------------------------------------------- TPU names
def parse_tpu(value) -> str:
    """The one alias rule for ``--tpu`` (``kernel.config.get_generation``): the canonical
    generation name, or ``typer.BadParameter`` naming the value and the valid names."""
    if value is None:
        return None
    try:
        return get_generation(value).name
    except ValueError:
        raise typer.BadParameter(f"unknown TPU {value!r}; valid: {', '.join(GENERATION_NAMES)} "
                                 f"({TPU_ALIASES})") from None


def _complete(values):
    def complete(incomplete: str):
        return [v for v in values if v.startswith(incomplete)]
    return complete


TPU_METAVAR = "[" + "|".join(GENERATION_NAMES) + "]"
Tpu = Annotated[str, typer.Option("--tpu", parser=parse_tpu, metavar=TPU_METAVAR, show_default=False,
                                  autocompletion=_complete(GENERATION_NAMES),
                                  help="Target TPU generation: v4, v5e, v5p, v6e or tpu7x (aliases: v7x, V6E, ...).")]
OptionalTpu = Annotated[Optional[str], typer.Option("--tpu", parser=parse_tpu, metavar=TPU_METAVAR,
                                                    autocompletion=_complete(GENERATION_NAMES),
                                                    help="Only this TPU generation (v4, v5e, v5p, v6e, tpu7x). "
                                                         "Default: all.")]


# ---------------------------------------------------------------------------- choices
def _choices(name: str, values) -> type[enum.Enum]:
    """A Typer choice enum whose members are ``values`` (kept where each concept is defined)."""
    return enum.Enum(name, {v: v for v in values}, type=str)


CaseChoice = _choices("CaseChoice", [c.value for c in Case])
SweepCase = _choices("SweepCase", [c.value for c in Case] + ["all"])
ResultBackend = _choices("ResultBackend", BACKENDS)
BackendChoice = _choices("BackendChoice", ["auto", *BACKENDS])
SearchChoice = _choices("SearchChoice", SEARCHES)
Status = _choices("Status", STATUSES)
QDtype = _choices("QDtype", SUPPORTED_Q_DTYPES)
KvDtype = _choices("KvDtype", SUPPORTED_KV_DTYPES)
KernelChoice = _choices("KernelChoice", kernel_names())
ExportFormat = _choices("ExportFormat", ["tables", "vllm-env", "sglang"])
KernelOpt = Annotated[KernelChoice, typer.Option(
    "--kernel", case_sensitive=False,
    help="The kernel to tune: rpa-tune (this project's, the default) or tpu-inference (the public RPA v3 that "
         "vLLM-TPU and SGLang-JAX run; pip package tpu-inference, installed by scripts/setup.sh); "
         "rpa_tune.kernels lists them.")]


def value(v):
    """The plain value of an enum choice (None stays None)."""
    return v.value if isinstance(v, enum.Enum) else v


# --------------------------------------------------------------- model and limits options
def _preset_names():
    from .presets import PRESETS
    return list(PRESETS)


def _complete_presets(incomplete: str):
    return [p for p in _preset_names() if p.startswith(incomplete)]


Model = Annotated[str, typer.Option(
    "--model", "-m", metavar="PRESET", autocompletion=_complete_presets,
    help="Model preset giving the per-shard attention shape (llama3-8b, llama3-70b-tp8, qwen3-32b, ...; "
         "see `rpa-tune presets`; ignored when --q-heads/--kv-heads/--head-dim are given).")]
QHeads = Annotated[Optional[int], typer.Option(
    "--q-heads", min=1, help="Query heads per shard (explicit shape; needs --kv-heads and --head-dim). "
                             "Default: from --model.")]
KvHeads = Annotated[Optional[int], typer.Option(
    "--kv-heads", min=1, help="KV heads per shard (explicit shape). Default: from --model.")]
HeadDim = Annotated[Optional[int], typer.Option(
    "--head-dim", min=1, help="Head dimension: 64, 128 or 256 (explicit shape). Default: from --model.")]
QDtypeOpt = Annotated[Optional[QDtype], typer.Option(
    "--dtype", help="Query dtype. Default: the preset's (bfloat16).", show_default=False)]
KvDtypeOpt = Annotated[Optional[KvDtype], typer.Option(
    "--kv-dtype", help="KV-cache dtype. Default: the preset's (bfloat16).", show_default=False)]
PageSize = Annotated[int, typer.Option("--page-size", min=8, help="KV-cache page size in tokens (power of two).")]
MaxNumTokens = Annotated[int, typer.Option("--max-num-tokens", min=1, help="Token bucket the kernel is compiled "
                                                                          "for (part of the tuning key).")]
MaxNumSeqs = Annotated[int, typer.Option("--max-num-seqs", min=1, help="Max sequences per batch.")]
MaxModelLen = Annotated[int, typer.Option("--max-model-len", min=1, help="Max sequence length (part of the key).")]
SlidingWindow = Annotated[Optional[int], typer.Option(
    "--sliding-window", min=1, help="Sliding-window attention size in tokens (part of the key: sliding-window "
                                    "yes/no). Default: none.")]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print a JSON document on stdout instead of tables "
                                                       "(progress and errors stay on stderr).")]


def resolve_model(model, q_heads, kv_heads, head_dim, dtype, kv_dtype):
    """``(ModelShape, label)`` from a preset or an explicit shape; ``UsageError`` otherwise."""
    from kernel.workload import ModelShape
    from .presets import get_preset
    dtype, kv_dtype = value(dtype), value(kv_dtype)
    explicit = [q_heads, kv_heads, head_dim]
    if any(v is not None for v in explicit):
        if not all(v is not None for v in explicit):
            raise UsageError("an explicit shape needs --q-heads, --kv-heads and --head-dim together "
                             "(or use --model PRESET)")
        label = f"custom ({q_heads}/{kv_heads} heads, head_dim {head_dim})"
        base_q, base_kv = "bfloat16", "bfloat16"
    else:
        try:
            p = get_preset(model)
        except ValueError as e:
            raise UsageError(str(e)) from None
        q_heads, kv_heads, head_dim = p.num_q_heads, p.num_kv_heads, p.head_dim
        label = f"{p.name} ({p.description})"
        base_q, base_kv = p.q_dtype, p.kv_dtype
    if head_dim not in HEAD_DIMS:
        raise UsageError(f"--head-dim {head_dim} is not supported by the kernel; valid: "
                         f"{', '.join(map(str, HEAD_DIMS))}")
    if q_heads % kv_heads:
        raise UsageError(f"--q-heads {q_heads} is not a multiple of --kv-heads {kv_heads} "
                         "(every KV head serves the same number of query heads)")
    return ModelShape(q_heads, kv_heads, head_dim, dtype or base_q, kv_dtype or base_kv), label


def resolve_limits(page_size, max_num_tokens, max_num_seqs, max_model_len):
    """``ServingLimits``; ``UsageError`` for a page size that is not a power of two or a
    model length below one page (ranges are checked by the options' ``min=``)."""
    from kernel.workload import ServingLimits
    if page_size & (page_size - 1) or page_size < 8:
        raise UsageError(f"--page-size {page_size} must be a power of two >= 8")
    if max_model_len < page_size:
        raise UsageError(f"--max-model-len {max_model_len} is smaller than --page-size {page_size}")
    return ServingLimits(page_size=page_size, max_num_tokens=max_num_tokens, max_num_seqs=max_num_seqs,
                         max_model_len=max_model_len)


def parse_int_list(name: str, text: str | None, *, minimum: int = 1) -> list[int] | None:
    """A comma-separated list of ints >= ``minimum`` (None when empty)."""
    if text is None or not text.strip():
        return None
    try:
        vals = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise UsageError(f"{name} {text!r} is not a comma-separated list of ints") from None
    bad = [v for v in vals if v < minimum]
    if not vals or bad:
        raise UsageError(f"{name} {text!r}: every value must be an int >= {minimum}")
    return vals


def parse_cases(text: str) -> list[str]:
    """A comma-separated list of case names (decode, prefill, mixed)."""
    names = [c.strip().lower() for c in text.split(",") if c.strip()]
    valid = [c.value for c in CaseChoice]
    bad = [c for c in names if c not in valid]
    if bad or not names:
        raise UsageError(f"--cases {text!r}: unknown case {bad[0]!r}; valid: {', '.join(valid)}" if bad else
                         f"--cases {text!r} names no case; valid: {', '.join(valid)}")
    return names
