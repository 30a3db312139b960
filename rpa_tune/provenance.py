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


def canonical_rows(table):
    """A results ``pyarrow.Table`` with legacy kernel source hashes read as the version ids
    they stand for (``kernel.provenance.LEGACY_IDS``) in ``kernel_hash``,
    ``kernel_source_hash`` and ``kernel_version``, and the resume ids (``config_id``) of
    such rows computed again from the id, so a sweep of the same version resumes them."""
    import pyarrow as pa
    import pyarrow.compute as pc
    if table.num_rows == 0 or "kernel_hash" not in table.column_names:
        return table
    legacy = pa.array(sorted(kprov.LEGACY_IDS))
    hit = pc.is_in(table["kernel_hash"], value_set=legacy)
    if not pc.any(hit).as_py() and not any(
            c in table.column_names and pc.any(pc.is_in(table[c], value_set=legacy)).as_py()
            for c in ("kernel_source_hash", "kernel_version")):
        return table
    from .store import config_id
    for col in ("kernel_hash", "kernel_source_hash", "kernel_version"):
        if col in table.column_names:
            vals = [kprov.canonical_kernel_id(v) for v in table[col].to_pylist()]
            table = table.set_column(table.column_names.index(col), col, pa.array(vals, pa.string()))
    if "config_id" in table.column_names:
        rows = table.select(["key_id", "workload_id", "bq", "bkv", "cq", "ckv", "backend", "kernel_hash",
                             "evaluator_version", "config_id"]).to_pylist()
        mask = hit.to_pylist()
        ids = [config_id(r["key_id"], r["workload_id"], (r["bq"], r["bkv"], r["cq"], r["ckv"]), r["backend"],
                         r["kernel_hash"], r["evaluator_version"]) if m else r["config_id"]
               for r, m in zip(rows, mask)]
        table = table.set_column(table.column_names.index("config_id"), "config_id", pa.array(ids, pa.string()))
    return table
