"""A worker process: evaluates tasks one at a time for the engine.

``python -m rpa_tune.worker BACKEND``: reads one JSON request per line on stdin
(``{"id": N, "task": {...}}``) and writes one JSON line per result on its original
stdout, prefixed with ``MARK`` (anything else the process prints, JAX and libtpu logs
included, goes to stderr). The engine runs each worker in its own session: a timeout
kills the whole process group (the compile backend's profiler child included). The
worker dies with the engine (``PR_SET_PDEATHSIG``), taking its children with it.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback

from .lifeline import remove_folder, wait_for_parent_gone, watch_parent

MARK = "@@rpa-tune@@ "
PARENT_ENV = "RPA_TUNE_PARENT_PID"
LOG_DIR_ENV = "RPA_TUNE_WORKER_LOG_DIR"


def _die_with_parent() -> None:
    """SIGTERM when the engine dies (even by SIGKILL), and on SIGTERM kill our group. Once
    the engine is gone, also remove its workers' log folder (``LOG_DIR_ENV``), which its
    exit would have removed."""
    parent = os.environ.get(PARENT_ENV)

    def on_term(signum, frame):  # noqa: ARG001
        try:
            # (the engine's death signal can come before the kernel reparents us)
            if parent and wait_for_parent_gone(int(parent), 2.0):
                _remove_the_engines_logs()
            os.killpg(os.getpgrp(), signal.SIGKILL)
        finally:
            os._exit(143)
    signal.signal(signal.SIGTERM, on_term)
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    # The SIGTERM above waits while the main thread sits in a long native call (an
    # in-process libtpu compile can take minutes): the watchdog does not.
    if parent:
        watch_parent(int(parent), lambda: on_term(None, None), name="rpa-tune-parent-watchdog")


def _remove_the_engines_logs() -> None:
    remove_folder(os.environ.get(LOG_DIR_ENV))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    backend = argv[0]
    _die_with_parent()
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)   # stray prints (libraries) go to stderr, never into the result channel
    sys.stdout = sys.stderr

    def send(obj):
        out.write(MARK + json.dumps(obj) + "\n")
        out.flush()

    from .evaluators import COMPILE_ERROR, EvalResult, Task, get_evaluator
    evaluator = get_evaluator(backend)
    send({"ready": True, "pid": os.getpid()})
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        t0 = time.perf_counter()
        try:
            task = Task.from_json(req["task"])
            res = evaluator.evaluate(task)
        except Exception as e:  # noqa: BLE001 - an evaluator bug must not kill the sweep
            tb = traceback.format_exc(limit=6)
            res = EvalResult(COMPILE_ERROR, getattr(evaluator, "method", "") or "",
                             message=f"{type(e).__name__}: {e} | {tb[-1500:]}")
        send({"id": req["id"], "result": res.to_json(), "eval_s": time.perf_counter() - t0})
    # stdin closed: the engine died (it stops a live worker by SIGKILL, never by EOF), and
    # its death may reach us as this EOF before the SIGTERM
    parent = os.environ.get(PARENT_ENV)
    if parent and wait_for_parent_gone(int(parent)):
        _remove_the_engines_logs()
    return 0


if __name__ == "__main__":
    sys.exit(main())
