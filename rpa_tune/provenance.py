"""Where a result came from: package versions, the kernel's version id, git sha.

The kernel's identity is defined once, in ``kernel.provenance``: ``kernel_id()`` (``"k1"``),
a deliberate version bumped when its programs change (``rpa_tune.fingerprint`` checks that).
Results-store rows record it in ``kernel_hash`` (the column's name predates versions) and
``kernel_source_hash``; tables in their entries' ``provenance.kernel_hash``. Nothing here
imports JAX (versions come from package metadata), so the CLI can stamp rows without
initialising a backend.
"""
from __future__ import annotations

import functools
import os
import subprocess
from importlib import metadata

from kernel import provenance as kprov
from kernel.provenance import KERNEL_DIR

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


def kernel_hash() -> str:
    """What results-store rows record in their ``kernel_hash`` column and resume ids hold:
    our kernel's version id (``kernel.provenance.kernel_id``). ``$RPA_TUNE_KERNEL_HASH``
    pins another value instead (tests that need a second kernel version)."""
    return os.environ.get(KERNEL_HASH_ENV) or kprov.kernel_id()


def kernel_source_hash() -> str:
    """What an exported table entry records and the kernel checks tables against
    (``kernel.provenance.kernel_id``; never the test override)."""
    return kprov.kernel_id()


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
    """The provenance columns of a results-store row: ``kernel_hash`` (resume ids) and
    ``kernel_source_hash`` (what an exported entry records) both hold the kernel's id."""
    return dict(versions(), kernel_hash=kernel_hash(), kernel_source_hash=kernel_source_hash(),
                git_sha=git_sha())


def fingerprint_status() -> str:
    """One line: the recorded program fingerprint of this kernel version under the installed
    JAX, or that none is recorded (``rpa-tune fingerprint`` checks it against the code)."""
    rec = kprov.recorded_fingerprint()
    if rec is None:
        return (f"none recorded for kernel {kprov.kernel_id()} under jax {_version('jax')} "
                "(rpa-tune fingerprint --record)")
    return f"{rec['fingerprint']} (kernel {kprov.kernel_id()}, jax {_version('jax')}, {len(rec['programs'])} programs)"

