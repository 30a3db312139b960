"""The public RPA v3 kernel (PyPI ``tpu-inference``), imported for side-by-side estimates.

Only one module of that package is used: ``tpu_inference.kernels.ragged_paged_attention.
v3.kernel`` (it needs nothing but jax). The package's top-level ``__init__`` imports vllm
(and its engine), so it is never executed here: the installed ``tpu_inference`` directory
is located without importing it, an empty package object pointing at that directory is
registered under ``tpu_inference`` in ``sys.modules``, and the kernel module is imported
through it (its sub-package ``__init__`` files are licence headers only).

The package is installed without its dependencies (they pull vllm)::

    python -m pip install --no-deps tpu-inference==0.32.0

``scripts/setup.sh`` does that. The version is pinned: the estimator wraps the kernel's
internals (its kernel-body function, its SMEM metadata layout), which are not a public API.
"""
from __future__ import annotations

import importlib
import importlib.machinery
import importlib.metadata
import sys
import types

PINNED_VERSION = "0.32.0"
DISTRIBUTION = "tpu-inference"
PACKAGE = "tpu_inference"
KERNEL_MODULE = "tpu_inference.kernels.ragged_paged_attention.v3.kernel"
INSTALL_COMMAND = f"pip install --no-deps {DISTRIBUTION}=={PINNED_VERSION}"

# Where the package is looked for: None = sys.path (tests point it at an empty directory).
SEARCH_PATH: list[str] | None = None


class PublicKernelMissing(Exception):
    """The public kernel cannot be used: tpu-inference is missing or not the pinned version."""


def install_hint() -> str:
    return f"{sys.executable} -m {INSTALL_COMMAND}"


def _search_path() -> list[str]:
    return list(sys.path if SEARCH_PATH is None else SEARCH_PATH)


def locate() -> str | None:
    """The installed ``tpu_inference`` package directory, found without importing it."""
    spec = importlib.machinery.PathFinder.find_spec(PACKAGE, _search_path())
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def installed_version() -> str | None:
    """The installed tpu-inference version (from its dist-info), or None if not installed."""
    for dist in importlib.metadata.distributions(name=DISTRIBUTION, path=_search_path()):
        return dist.version
    for dist in importlib.metadata.distributions(name=PACKAGE, path=_search_path()):
        return dist.version
    return None


def check_installed() -> str:
    """The package directory; ``PublicKernelMissing`` unless the pinned version is installed."""
    where = locate()
    if where is None:
        raise PublicKernelMissing(f"{DISTRIBUTION}=={PINNED_VERSION} is not installed (the public RPA v3 "
                                  f"kernel); install it without its dependencies: {install_hint()}")
    version = installed_version()
    if version != PINNED_VERSION:
        found = "an unknown version" if version is None else f"version {version}"
        raise PublicKernelMissing(f"{DISTRIBUTION} at {where} is {found}, but the estimator is pinned to "
                                  f"{PINNED_VERSION}; install the pinned version: {install_hint()}")
    return where


def load_kernel_module() -> types.ModuleType:
    """``tpu_inference.kernels.ragged_paged_attention.v3.kernel``, imported without running
    ``tpu_inference/__init__.py``. Raises ``PublicKernelMissing`` (one line, with the
    install command) when the pinned version is not installed."""
    where = check_installed()
    loaded = sys.modules.get(KERNEL_MODULE)
    if loaded is not None and getattr(loaded, "__file__", "").startswith(where):
        return loaded
    pkg = sys.modules.get(PACKAGE)
    if pkg is None or list(getattr(pkg, "__path__", [])) != [where]:
        # Drop a stale entry (another location) and its submodules, then register the stub.
        for name in [n for n in sys.modules if n == PACKAGE or n.startswith(PACKAGE + ".")]:
            del sys.modules[name]
        pkg = types.ModuleType(PACKAGE, "tpu-inference, registered without running its __init__ "
                                        "(which imports vllm); only its kernels are used")
        pkg.__path__ = [where]
        pkg.__package__ = PACKAGE
        pkg.__spec__ = importlib.machinery.ModuleSpec(PACKAGE, None, is_package=True)
        pkg.__spec__.submodule_search_locations = [where]
        sys.modules[PACKAGE] = pkg
    try:
        return importlib.import_module(KERNEL_MODULE)
    except ImportError as e:
        raise PublicKernelMissing(f"cannot import {KERNEL_MODULE} from {where} ({e}); reinstall it: "
                                  f"{install_hint()}") from e
