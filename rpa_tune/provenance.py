"""Where a result came from: package versions, the kernel's two hashes, git sha.

The hashes are defined once, in ``kernel.provenance`` (``kernel_source_hash``: what table
entries record; ``result_inputs_hash``: what results-store rows record). Nothing here
imports JAX (versions come from package metadata), so the CLI can stamp rows without
initialising a backend.
"""
from __future__ import annotations

import functools
import os
import subprocess
from importlib import metadata

from kernel import provenance as kprov
from kernel.provenance import KERNEL_DIR, KERNEL_SOURCE_FILES, RESULT_INPUT_FILES  # noqa: F401 (re-exported)

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


def result_inputs_hash() -> str:
    """The hash results-store rows record in their ``kernel_hash`` column
    (``kernel.provenance.result_inputs_hash``): a change to the kernel or to how it is
    estimated gives a new value, so results of an older kernel are never reused on resume.
    ``$RPA_TUNE_KERNEL_HASH`` pins it instead (tests; or resuming across kernel edits known
    not to matter)."""
    return os.environ.get(KERNEL_HASH_ENV) or kprov.result_inputs_hash()


kernel_hash = result_inputs_hash     # the name the results store's column keeps


def kernel_source_hash() -> str:
    """The hash tuned tables record and are checked against (``kernel.provenance``)."""
    return kprov.kernel_source_hash()


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
    """The provenance columns of a results-store row (``kernel_hash`` holds
    ``result_inputs_hash``; ``kernel_source_hash`` is what an exported entry records)."""
    return dict(versions(), kernel_hash=result_inputs_hash(), kernel_source_hash=kernel_source_hash(),
                git_sha=git_sha())
