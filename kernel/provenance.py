"""Which kernel a result or a table entry was made with: a deliberate version, not source bytes.

``KERNEL_VERSION`` names the program this kernel compiles to. It is bumped by hand when a
change alters what the compiler receives (the lowered programs); a comment, a rename or a
refactor that compiles to the same programs leaves it, and so every result id, probe-cache
key and table entry, unchanged. ``rpa_tune.fingerprint`` lowers a fixed set of canonical
configs and hashes their programs; ``program_fingerprint.json`` beside this file records
those hashes per JAX version, and a test fails when the programs change while
``KERNEL_VERSION`` does not (``rpa-tune fingerprint --record`` after a bump).

``kernel_id()`` is what rows and tables record (``kernel_hash``): ``"k<KERNEL_VERSION>"``.
Rows and tables written before versions existed carry a 16-hex-digit hash of the source
files instead; ``LEGACY_IDS`` maps the hashes of the sources that compiled version 1's
programs to it, so those records stay current (``canonical_kernel_id``).

Plain Python (no JAX): the CLI and the tables use it without initialising a backend.
"""
from __future__ import annotations

import functools
import json
from importlib import metadata
from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent
KERNEL_VERSION = 1
FINGERPRINT_FILE = KERNEL_DIR / "program_fingerprint.json"

# Source hashes recorded before KERNEL_VERSION existed, for the sources whose programs are
# version 1's (the table hash of kernel/{rpa,api,vmem,config}.py and the results hash of those
# plus the estimator's kernel files, both at git 1343fa6).
LEGACY_IDS = {"8fd98531008dbd61": "k1", "81b0302971f33f93": "k1"}


def kernel_id(version: int = KERNEL_VERSION) -> str:
    """The id rows and table entries record for our kernel (``"k1"``)."""
    return f"k{int(version)}"


def canonical_kernel_id(value):
    """``value`` with a legacy source hash of a known version replaced by that version's id
    (``LEGACY_IDS``); anything else unchanged."""
    return LEGACY_IDS.get(value, value) if isinstance(value, str) else value


def recorded_fingerprint(jax_version: str | None = None) -> dict | None:
    """The recorded programs of this ``KERNEL_VERSION`` under ``jax_version`` (default: the
    installed JAX): ``{"fingerprint", "programs": {label: digest}}``, or None when none
    is recorded for it."""
    try:
        doc = json.loads(FINGERPRINT_FILE.read_text())
    except (OSError, ValueError):
        return None
    if doc.get("kernel_version") != KERNEL_VERSION:
        return None
    jv = jax_version or _version("jax")
    return (doc.get("by_jax") or {}).get(jv)


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=None)
def libtpu_version() -> str | None:
    for dist in ("libtpu", "libtpu-nightly"):
        v = _version(dist)
        if v is not None:
            return v
    return None
