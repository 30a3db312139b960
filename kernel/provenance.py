"""The two hashes of the kernel sources, named for what they protect, and the libtpu version.

* ``kernel_source_hash()``: sha256 (16 hex digits) of ``KERNEL_SOURCE_FILES``, the files
  that determine the *compiled kernel*. Tuned-table entries record it
  (``provenance.kernel_hash`` in a table file); ``kernel.tables`` warns about (or, strict,
  refuses) entries tuned for another value.
* ``result_inputs_hash()``: sha256 (16 hex digits) of ``RESULT_INPUT_FILES``, the compiled
  kernel *plus* what shapes an evaluation (the estimate, the workload model, the heuristic
  a sweep compares against). Rows of the results store record it (column ``kernel_hash``);
  a sweep never reuses rows of another value, ``show`` marks them stale.

Plain Python (no JAX): the CLI and the tables use it without initialising a backend.
"""
from __future__ import annotations

import functools
import hashlib
from importlib import metadata
from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent

# Files whose source determines the compiled kernel (and so the validity of a table entry).
KERNEL_SOURCE_FILES = ("rpa.py", "api.py", "vmem.py", "config.py")

# The kernel files a recorded result depends on: the compiled kernel itself plus those that
# shape an evaluation: the estimate (analysis, metrics, hardware facts), the workload model
# and the heuristic each sweep compares against. Table loading, bring-up, validation and the
# reference are not in it: editing them does not make recorded results stale.
RESULT_INPUT_FILES = KERNEL_SOURCE_FILES + ("analysis.py", "steps.py", "metrics.py", "hardware.py",
                                            "workload.py", "heuristics.py")


def _files_hash(names) -> str:
    h = hashlib.sha256()
    for name in names:
        h.update(name.encode() + b"\0")
        try:
            h.update((KERNEL_DIR / name).read_bytes())
        except OSError:
            h.update(b"<missing>")
        h.update(b"\0")
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def kernel_source_hash() -> str:
    """The hash table entries are checked against (``KERNEL_SOURCE_FILES``)."""
    return _files_hash(KERNEL_SOURCE_FILES)


def result_inputs_hash() -> str:
    """The hash results-store rows carry (``RESULT_INPUT_FILES``); not cached, so a test or
    a long session sees edits."""
    return _files_hash(RESULT_INPUT_FILES)


@functools.lru_cache(maxsize=None)
def libtpu_version() -> str | None:
    for dist in ("libtpu", "libtpu-nightly"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None
