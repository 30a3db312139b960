"""Where a result came from: package versions, kernel source hash, git sha.

Nothing here imports JAX (versions come from package metadata), so the CLI can stamp
rows without initialising a backend.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import subprocess
from importlib import metadata
from pathlib import Path

KERNEL_DIR = Path(importlib.util.find_spec("kernel").origin).resolve().parent  # without importing JAX
REPO_DIR = KERNEL_DIR.parent


def _version(*dists: str) -> str | None:
    for d in dists:
        try:
            return metadata.version(d)
        except metadata.PackageNotFoundError:
            continue
    return None


@functools.lru_cache(maxsize=None)
def versions() -> dict:
    return dict(jax_version=_version("jax"), jaxlib_version=_version("jaxlib"),
                libtpu_version=_version("libtpu", "libtpu-nightly"),
                rpa_tune_version=_version("rpa-tune"))


KERNEL_HASH_ENV = "RPA_TUNE_KERNEL_HASH"


# The kernel files a recorded result depends on: the compiled kernel itself (the files
# ``kernel.tables.KERNEL_SOURCE_FILES`` names) plus those that shape an evaluation: the
# estimate (analysis, metrics, hardware facts), the workload model and the heuristic each
# sweep compares against. Table loading, bring-up, validation and the reference are not in
# it: editing them does not make recorded results stale.
RESULT_INPUT_FILES = ("rpa.py", "api.py", "vmem.py", "config.py",
                      "analysis.py", "steps.py", "metrics.py", "hardware.py", "workload.py", "heuristics.py")


def kernel_hash() -> str:
    """sha256 (16 hex digits) of the ``RESULT_INPUT_FILES`` of ``kernel/``: a change to the
    kernel or to how it is estimated gives a new hash, so results of an older kernel are
    never reused on resume. ``$RPA_TUNE_KERNEL_HASH`` pins it instead (tests; or resuming
    across kernel edits known not to matter)."""
    pinned = os.environ.get(KERNEL_HASH_ENV)
    if pinned:
        return pinned
    h = hashlib.sha256()
    for name in RESULT_INPUT_FILES:
        h.update(name.encode() + b"\0" + (KERNEL_DIR / name).read_bytes() + b"\0")
    return h.hexdigest()[:16]


def kernel_source_hash() -> str | None:
    """The hash tuned tables are checked against (``kernel.tables.kernel_source_hash``),
    when the kernel provides it."""
    try:
        from kernel import tables
        fn = getattr(tables, "kernel_source_hash", None)
        return fn() if fn else None
    except Exception:  # noqa: BLE001 - provenance must never stop a sweep
        return None


@functools.lru_cache(maxsize=None)
def git_sha() -> str | None:
    """``HEAD`` of the repository holding the kernel, ``-dirty`` when it has local changes."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_DIR, capture_output=True,
                             text=True, timeout=10)
        if sha.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_DIR,
                               capture_output=True, text=True, timeout=10)
        return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def provenance() -> dict:
    return dict(versions(), kernel_hash=kernel_hash(), kernel_source_hash=kernel_source_hash(),
                git_sha=git_sha())
