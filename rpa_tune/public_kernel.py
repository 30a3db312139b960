"""The public RPA v3 kernels (PyPI ``tpu-inference`` and ``sglang-jax``), imported for
side-by-side estimates.

``tpu-inference``: the module-level functions below. ``sglang-jax``: ``SGLANG_JAX``, a
``PinnedPackage`` (the same loading for another distribution; end of this module).

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

# tpu-inference's own TPU version numbers of the generations its kernel knows
TPU_VERSION = {"v4": 4, "v5e": 5, "v5p": 5, "v6e": 6, "tpu7x": 7}

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


# ------------------------------------------------------------------------------ others
class PinnedPackage:
    """A pinned, ``--no-deps`` installed distribution whose kernel module is imported
    without running its package ``__init__`` files (those import the server): each package
    above the kernel module is registered as an empty package object pointing at its
    directory (``register_stubs``), and the kernel module is imported through them.

    ``optional_imports``: third-party modules that modules the kernel imports name at their
    top but that the kernel's code never calls (the server's dependencies, not installed
    with ``--no-deps``); while the kernel module is imported, each missing one is an empty
    placeholder module (any attribute is a placeholder object), removed afterwards."""

    def __init__(self, distribution: str, package: str, pinned: str, kernel_module: str,
                 what: str, optional_imports: tuple = (), stub_packages: tuple = ()):
        self.distribution, self.package, self.pinned = distribution, package, pinned
        self.stub_packages = tuple(stub_packages)
        self.kernel_module, self.what, self.optional_imports = kernel_module, what, tuple(optional_imports)

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {self.distribution}=={self.pinned}"

    def install_hint(self) -> str:
        return f"{sys.executable} -m {self.install_command}"

    def locate(self) -> str | None:
        spec = importlib.machinery.PathFinder.find_spec(self.package, _search_path())
        if spec is None or not spec.submodule_search_locations:
            return None
        return list(spec.submodule_search_locations)[0]

    def installed_version(self) -> str | None:
        for name in (self.distribution, self.package):
            for dist in importlib.metadata.distributions(name=name, path=_search_path()):
                return dist.version
        return None

    def check_installed(self) -> str:
        where = self.locate()
        if where is None:
            raise PublicKernelMissing(f"{self.distribution}=={self.pinned} is not installed ({self.what}); "
                                      f"install it without its dependencies: {self.install_hint()}")
        version = self.installed_version()
        if version != self.pinned:
            found = "an unknown version" if version is None else f"version {version}"
            raise PublicKernelMissing(f"{self.distribution} at {where} is {found}, but rpa-tune is pinned to "
                                      f"{self.pinned}; install the pinned version: {self.install_hint()}")
        return where

    def register_stubs(self, where: str) -> None:
        """Empty package objects for ``package``, every package between it and the kernel
        module, and ``stub_packages`` (their ``__init__`` files are not run), replacing stale
        ones."""
        import os
        top = sys.modules.get(self.package)
        if top is not None and list(getattr(top, "__path__", [])) == [where]:
            return
        for name in [n for n in sys.modules if n == self.package or n.startswith(self.package + ".")]:
            del sys.modules[name]
        names = {".".join(p.split(".")[:i]) for p in (self.kernel_module.rpartition(".")[0], *self.stub_packages)
                 for i in range(1, len(p.split(".")) + 1)}
        for name in sorted(names, key=lambda n: n.count(".")):
            path = os.path.join(where, *name.split(".")[1:])
            pkg = types.ModuleType(name, f"{self.distribution}, registered without running its __init__")
            pkg.__path__ = [path]
            pkg.__package__ = name
            pkg.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
            pkg.__spec__.submodule_search_locations = [path]
            sys.modules[name] = pkg

    def module(self, name: str) -> types.ModuleType:
        """``name`` (a module of the package), imported through the registered stubs with
        the missing ``optional_imports`` as placeholders. Raises ``PublicKernelMissing``."""
        where = self.check_installed()
        loaded = sys.modules.get(name)
        if loaded is not None and getattr(loaded, "__file__", "").startswith(where):
            return loaded
        self.register_stubs(where)
        added = []
        for opt in self.optional_imports:
            try:
                importlib.import_module(opt)
            except ImportError:
                for i in range(1, len(opt.split(".")) + 1):
                    part = ".".join(opt.split(".")[:i])
                    if part not in sys.modules:
                        sys.modules[part] = _Placeholder(part)
                        added.append(part)
        try:
            return importlib.import_module(name)
        except ImportError as e:
            raise PublicKernelMissing(f"cannot import {name} from {where} ({e}); reinstall it: "
                                      f"{self.install_hint()}") from e
        finally:
            for part in added:
                sys.modules.pop(part, None)

    def load_kernel_module(self) -> types.ModuleType:
        return self.module(self.kernel_module)


class _Placeholder(types.ModuleType):
    """A module that is not installed and never called: every attribute is a placeholder."""

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self.__name__}.{attr}")

    def __call__(self, *a, **kw):
        raise RuntimeError(f"{self.__name__} is not installed (a dependency of the server, not of its kernel)")


SGLANG_JAX = PinnedPackage(
    "sglang-jax", "sgl_jax", "0.1.0rc0",
    "sgl_jax.srt.kernels.ragged_paged_attention.ragged_paged_attention_v3",
    "SGLang-JAX's RPA v3 kernel",
    # sgl_jax/srt/utils/common_utils.py (its next_power_of_2, the table lookup's bucket
    # rounding) imports these at its top for the server's process and HTTP helpers
    optional_imports=("psutil", "zmq", "fastapi.responses"),
    stub_packages=("sgl_jax.srt.utils",))     # (its __init__ imports the server's helpers)
