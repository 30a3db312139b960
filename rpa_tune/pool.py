"""The local worker pool: ``jobs`` worker processes (``rpa_tune.worker``) for one backend.

Each worker lives in its own process group; an evaluation that exceeds its timeout gets
its whole group killed and is recorded as ``timeout``; a worker that dies (libtpu abort,
segfault, OOM kill) has its evaluation recorded as ``crash`` with the tail of its stderr.
Either way a fresh worker replaces it and the sweep goes on.
"""
from __future__ import annotations

import dataclasses
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from . import provenance
from .evaluators import base
from .evaluators.base import EvalResult, Task
from .worker import LOG_DIR_ENV, MARK, PARENT_ENV

WORKER_START_TIMEOUT = 300.0


def grace_seconds(timeout: float) -> float:
    """Time the engine waits past ``timeout`` before killing a worker (the evaluator
    itself is told ``timeout`` and normally returns first)."""
    return min(15.0, max(2.0, 0.1 * timeout))


# ============================================================================ workers
@dataclasses.dataclass
class _Job:
    id: int
    task: Task
    payload: object
    dispatched: float
    deadline: float | None = None


class _Worker:
    def __init__(self, backend: str, env: dict, log_dir: Path, index: int):
        self.log_path = log_dir / f"worker-{index}-{uuid.uuid4().hex[:6]}.log"
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rpa_tune.worker", backend], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self.log, env=env, start_new_session=True,
            text=True, bufsize=1)
        self.started = time.monotonic()
        self.ready_at: float | None = None
        self.job: _Job | None = None
        self.dead = False

    def kill(self) -> None:
        if self.dead:
            return
        self.dead = True
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except (OSError, ValueError):
                pass
        self.log.close()

    def stderr_tail(self, n: int = 1500) -> str:
        try:
            data = self.log_path.read_bytes()[-20000:].decode("utf-8", "replace")
        except OSError:
            return ""
        lines = [l for l in data.splitlines() if l.strip()]
        return " | ".join(lines[-10:])[-n:]


class WorkerPool:
    """``jobs`` worker processes for one backend; ``submit`` tasks, ``wait`` for results."""

    def __init__(self, backend: str, jobs: int, *, env: dict | None = None):
        self.backend = backend
        self.jobs = max(1, int(jobs))
        self.env = base.worker_env(backend, env, self.jobs)
        self.env[PARENT_ENV] = str(os.getpid())
        repo = str(provenance.REPO_DIR)
        self.env["PYTHONPATH"] = repo + (os.pathsep + self.env["PYTHONPATH"] if self.env.get("PYTHONPATH") else "")
        self._tmp = tempfile.TemporaryDirectory(prefix="rpa_tune_workers_")
        self.log_dir = Path(self._tmp.name)
        self.env[LOG_DIR_ENV] = self._tmp.name    # a worker removes it if we die by SIGKILL
        self._q: queue.Queue = queue.Queue()
        self._workers: list[_Worker | None] = [None] * self.jobs
        self._next_id = 0
        self._spawned = 0

    # -- worker lifecycle ----------------------------------------------------------------
    def _spawn(self, slot: int) -> _Worker:
        w = _Worker(self.backend, self.env, self.log_dir, self._spawned)
        self._spawned += 1
        self._workers[slot] = w
        threading.Thread(target=self._reader, args=(w,), daemon=True).start()
        return w

    def _reader(self, w: _Worker) -> None:
        try:
            for line in w.proc.stdout:
                if line.startswith(MARK):
                    try:
                        self._q.put((w, json.loads(line[len(MARK):])))
                    except json.JSONDecodeError:
                        pass
        except (OSError, ValueError):
            pass
        self._q.put((w, None))   # EOF: the worker exited

    # -- API -----------------------------------------------------------------------------
    @property
    def busy(self) -> int:
        return sum(1 for w in self._workers if w is not None and w.job is not None)

    def free_slots(self) -> int:
        return self.jobs - self.busy

    def submit(self, task: Task, payload=None) -> None:
        slot = next((i for i, w in enumerate(self._workers) if w is None or w.job is None), None)
        if slot is None:
            raise RuntimeError("no free worker")
        w = self._workers[slot]
        if w is None or w.dead or w.proc.poll() is not None:
            w = self._spawn(slot)
        self._next_id += 1
        job = _Job(self._next_id, task, payload, time.monotonic())
        if w.ready_at is not None:
            job.deadline = time.monotonic() + task.timeout + grace_seconds(task.timeout)
        w.job = job
        try:
            w.log.truncate(0)
        except OSError:
            pass
        try:
            w.proc.stdin.write(json.dumps({"id": job.id, "task": task.to_json()}) + "\n")
            w.proc.stdin.flush()
        except (OSError, ValueError):
            pass  # the reader thread reports the dead worker

    def wait(self, timeout: float | None = None) -> list[tuple[object, Task, EvalResult, float]]:
        """Block until at least one submitted task finished (or ``timeout`` s passed)."""
        done: list = []
        end = None if timeout is None else time.monotonic() + timeout
        while not done:
            now = time.monotonic()
            if end is not None and now >= end:
                break
            if self.busy == 0:
                break
            deadlines = [self._deadline(w) for w in self._workers if w is not None and w.job is not None]
            nearest = min(deadlines) if deadlines else now + 1.0
            limit = min(nearest, end) if end is not None else nearest
            try:
                w, msg = self._q.get(timeout=max(0.01, min(1.0, limit - now)))
                self._handle(w, msg, done)
                while True:   # drain whatever else is ready
                    w, msg = self._q.get_nowait()
                    self._handle(w, msg, done)
            except queue.Empty:
                pass
            self._check_deadlines(done)
        return done

    def _deadline(self, w: _Worker) -> float:
        if w.job.deadline is not None:
            return w.job.deadline
        return w.started + WORKER_START_TIMEOUT

    def _handle(self, w: _Worker, msg, done: list) -> None:
        if w.dead:
            return
        if msg is None:   # the worker died
            code = w.proc.poll()
            if code is None:
                try:
                    code = w.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    code = "?"
            job = w.job
            how = f"killed by signal {-code}" if isinstance(code, int) and code < 0 else f"exit code {code}"
            tail = w.stderr_tail()
            w.kill()
            if job is not None:
                w.job = None
                res = EvalResult(base.CRASH, "", message=f"worker process died ({how}): {tail}")
                done.append((job.payload, job.task, res, time.monotonic() - job.dispatched))
            return
        if msg.get("ready"):
            w.ready_at = time.monotonic()
            if w.job is not None and w.job.deadline is None:
                w.job.deadline = w.ready_at + w.job.task.timeout + grace_seconds(w.job.task.timeout)
            return
        job = w.job
        if job is None or msg.get("id") != job.id:
            return
        w.job = None
        res = EvalResult.from_json(msg["result"])
        done.append((job.payload, job.task, res, float(msg.get("eval_s") or time.monotonic() - job.dispatched)))

    def _check_deadlines(self, done: list) -> None:
        now = time.monotonic()
        for w in self._workers:
            if w is None or w.job is None or now < self._deadline(w):
                continue
            job = w.job
            w.job = None
            started = w.ready_at is not None
            w.kill()
            if started:
                res = EvalResult(base.TIMEOUT, "", message=f"evaluation exceeded --timeout {job.task.timeout:g} s "
                                 f"(worker killed after {now - job.dispatched:.0f} s)")
            else:
                res = EvalResult(base.CRASH, "", message=f"worker did not start within {WORKER_START_TIMEOUT:.0f} s: "
                                 + w.stderr_tail())
            done.append((job.payload, job.task, res, now - job.dispatched))

    def close(self) -> None:
        for w in self._workers:
            if w is not None:
                w.kill()
        self._workers = [None] * self.jobs
        try:
            self._tmp.cleanup()
        except OSError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
