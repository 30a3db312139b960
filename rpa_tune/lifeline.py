"""A child process that ends when the process that started it is gone.

The engine's workers and the estimator's profiler children run in their own session
(``start_new_session=True``): a group kill of their caller does not reach them, and
neither does anything when that caller dies by SIGKILL. ``watch_parent`` gives such a
child a daemon thread that polls its parent id and calls ``on_gone`` once the parent is
gone (the kernel reparents the child). A thread, because the main thread may sit in one
native call (a libtpu compile releases the GIL) for minutes, and Python runs signal
handlers only between bytecodes.

Stdlib only: profiler children import it before JAX.
"""
from __future__ import annotations

import os
import shutil
import threading
import time
from typing import Callable

POLL_S = 0.5


def parent_gone(parent: int) -> bool:
    """True once ``parent`` is no longer this process's parent."""
    return os.getppid() != parent


def watch_parent(parent: int, on_gone: Callable[[], object], *, name: str) -> None:
    """Call ``on_gone`` (which should end the process) once ``parent`` is gone: at once if it
    already is, else from a daemon thread polling every ``POLL_S`` seconds."""
    if parent_gone(parent):
        on_gone()
        return

    def watch():
        while not parent_gone(parent):
            time.sleep(POLL_S)
        on_gone()
    threading.Thread(target=watch, name=name, daemon=True).start()


def wait_for_parent_gone(parent: int, timeout_s: float = 5.0) -> bool:
    """Whether ``parent`` is gone within ``timeout_s``. For a child whose pipe from the parent
    closed, or that got the parent's death signal (``PR_SET_PDEATHSIG``): both can come
    before ``getppid`` shows the new parent (seen on this sandbox's kernel)."""
    deadline = time.monotonic() + timeout_s
    while not parent_gone(parent) and time.monotonic() < deadline:
        time.sleep(0.05)
    return parent_gone(parent)


def remove_folder(folder: str | os.PathLike | None) -> None:
    """Remove a folder the dead parent would have removed (nothing if it is already gone)."""
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
