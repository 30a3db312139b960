"""Many workers on one sweep through Optuna's storage (``rpa-tune sweep --storage URL``).

Storages (``open_storage``): ``postgresql://...`` (a fleet; needs ``psycopg2``, the
``distributed`` extra), ``sqlite:///path.db`` and an Optuna journal file (``*.journal``
or ``journal:///path``) on one machine.

The sweep itself is the engine's one loop (``engine.run_sweep``); ``StudyScheduler`` is
its scheduler here. Every worker runs the same search; each config it asks is claimed
through the study, so exactly one worker evaluates it, and the others wait for its row
and tell it to their search. So ``--retry``, ``--seeds`` and ``--refine`` mean what they
mean for one process: a row recorded with a ``--retry`` status before the worker joined is
evaluated again (once, by whichever worker claims it); the seeds come from the studies
of the key's other token buckets in the storage (and the worker's ``--results``); the
climb climbs from the best row of every worker.

One Optuna study per (tuned kernel, key, workload, backend): its name is a hash of those
(``study_name``). The study's user attribute ``rpa_tune`` records the identity every
worker must share (kernel version, evaluator version, the planned candidates' hash,
search, budget, refine, seed); a worker whose identity differs refuses to join
(``StudyMismatch``, naming what differs).

Claims are Optuna's own trial lifecycle: a config's trial is created WAITING and moved to
RUNNING through the storage (``set_trial_state_values``), which exactly one worker
manages. Each trial records the phase that asked it (heuristic / replay, seed, budget,
climb): the study's ``--budget`` and ``--refine`` hold across workers, counted in trial
order.

Worker death: a claimed trial's worker records heartbeats (RDB storages: Optuna's
heartbeat; journal files: the same rule through a trial attribute), and every worker
fails stale RUNNING trials (``optuna.storages.fail_stale_trials``) whose
``RetryHeartbeatStaleTrialCallback`` adds them back as WAITING, so another worker evaluates them.

Every finished row (the dict the Parquet store gets) is also stored as the trial's user
attribute ``row`` (JSON): ``rows_from_storage`` reads them for ``rpa-tune export`` and
``status``.
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import json
import math
import os
import socket
import threading
import time
from pathlib import Path

from kernel.config import BlockSizes

from .schedulers import DONE, OVER, PENDING, RUN, Grant, Scheduler

STUDY_PREFIX = "rpa-tune-"
DEFAULT_HEARTBEAT = 10.0
DEFAULT_GRACE = 60.0
MAX_RETRY = 3
IDENTITY_FIELDS = ("kernel", "kernel_version", "evaluator_version", "space", "search", "budget", "refine", "seed")
IDENTITY_DEFAULTS = {"refine": 0}       # studies made before the field existed
FIELD_WORDS = {"kernel_version": "kernel version (kernel hash)", "evaluator_version": "evaluator version",
               "space": "search space (planned candidates)", "kernel": "kernel", "refine": "--refine"}


class StorageError(Exception):
    """A --storage URL that cannot be used (scheme, path, driver, server): one line."""


class StudyMismatch(Exception):
    """This worker's sweep is not the study's (another kernel hash, space, ...)."""


# ------------------------------------------------------------------------ storage URLs
@dataclasses.dataclass(frozen=True)
class StorageURL:
    kind: str        # postgresql | sqlite | journal
    url: str         # what the storage is opened with (SQLAlchemy URL or journal path)
    given: str

    def display(self) -> str:
        """The URL without a password."""
        if self.kind != "postgresql":
            return self.given
        try:
            from sqlalchemy.engine import make_url
            return make_url(self.given).render_as_string(hide_password=True)
        except Exception:  # noqa: BLE001
            return self.given


def is_storage_url(text: str) -> bool:
    """Whether a ``--results`` value names a storage rather than a results path."""
    t = str(text)
    return "://" in t or t.endswith(".journal")


def parse_storage(text: str) -> StorageURL:
    """Validate ``--storage``; ``StorageError`` with the accepted forms otherwise."""
    t = str(text).strip()
    forms = "postgresql://USER[:PASSWORD]@HOST[:PORT]/DB, sqlite:///PATH.db or a journal file (PATH.journal or " \
            "journal:///PATH)"
    if t.startswith(("postgresql://", "postgresql+psycopg2://", "postgres://")):
        url = "postgresql+psycopg2://" + t.split("://", 1)[1]
        return StorageURL("postgresql", url, t)
    if t.startswith("sqlite:///"):
        path = Path(t[len("sqlite:///"):])
        if not str(path) or str(path) == ":memory:":
            raise StorageError(f"--storage {t!r}: an SQLite storage needs a file path ({forms})")
        if not path.parent.is_dir():
            raise StorageError(f"--storage {t!r}: directory {str(path.parent)!r} does not exist")
        return StorageURL("sqlite", t, t)
    if t.startswith("journal://"):
        path = Path(t[len("journal://"):])
    elif "://" not in t and t.endswith(".journal"):
        path = Path(t)
    else:
        raise StorageError(f"--storage {t!r} is not a supported storage; use {forms}")
    if not path.parent.is_dir():
        raise StorageError(f"--storage {t!r}: directory {str(path.parent)!r} does not exist")
    if path.exists() and not path.is_file():
        raise StorageError(f"--storage {t!r}: {str(path)!r} is not a file")
    return StorageURL("journal", str(path), t)


def _quiet_optuna():
    import optuna
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def open_storage(text: str, *, heartbeat: float | None = None, grace: float | None = None,
                 must_exist: bool = False):
    """An Optuna storage for ``text`` (``parse_storage``). With ``heartbeat``, stale trials
    are failed after ``grace`` s and retried (``retry_callback``). ``must_exist`` (readers:
    status, export): an SQLite or journal file that does not exist is an error, not created."""
    su = parse_storage(text)
    if must_exist and su.kind != "postgresql":
        path = su.url if su.kind == "journal" else su.url[len("sqlite:///"):]
        if not Path(path).is_file():
            raise StorageError(f"--storage {su.given!r}: no such file {path!r} (no sweep has used it)")
    optuna = _quiet_optuna()
    if su.kind == "journal":
        from optuna.storages.journal import JournalFileBackend
        try:
            return optuna.storages.JournalStorage(JournalFileBackend(su.url))
        except Exception as e:  # noqa: BLE001
            raise StorageError(f"--storage {su.given!r}: {_one_line(e)}") from None
    if su.kind == "postgresql":
        try:
            import psycopg2  # noqa: F401
        except ImportError:
            raise StorageError(f"--storage {su.display()!r} needs the PostgreSQL driver psycopg2: "
                               "pip install 'rpa-tune[distributed]' (or psycopg2-binary)") from None
    kw = {}
    if heartbeat:
        import inspect
        params = inspect.signature(optuna.storages.RDBStorage).parameters
        name = "heartbeat_stale_trial_callback" if "heartbeat_stale_trial_callback" in params else \
            "failed_trial_callback"     # Optuna < 4.9
        kw = {"heartbeat_interval": max(1, int(math.ceil(heartbeat))),
              "grace_period": max(2, int(math.ceil(grace or 0))), name: retry_callback(MAX_RETRY)}
    engine_kwargs = ({"connect_args": {"connect_timeout": 10}, "pool_pre_ping": True} if su.kind == "postgresql"
                     else {"connect_args": {"timeout": 120}})
    last = None
    storage = None
    for attempt in range(5):   # concurrent first workers may race on creating the schema
        try:
            import warnings
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)   # heartbeats
                storage = optuna.storages.RDBStorage(su.url, engine_kwargs=engine_kwargs, **kw)
            break
        except Exception as e:  # noqa: BLE001
            last = _one_line(e)
            if any(w in last for w in ("could not connect", "Connection refused", "could not translate",
                                       "does not exist", "authentication failed", "timeout expired")):
                break
            time.sleep(0.5 + attempt)
    if storage is None:
        raise StorageError(f"cannot open --storage {su.display()!r}: {last}")
    if su.kind == "sqlite":
        _sqlite_immediate(storage.engine)
    return storage


def retry_callback(max_retry: int | None):
    """Optuna's callback that adds a stale (or given back) trial again as WAITING
    (``RetryHeartbeatStaleTrialCallback``; ``RetryFailedTrialCallback`` before Optuna 4.9)."""
    try:
        from optuna.storages import RetryHeartbeatStaleTrialCallback as Retry
    except ImportError:  # pragma: no cover - Optuna < 4.9
        from optuna.storages import RetryFailedTrialCallback as Retry
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # "experimental" since Optuna 2.8
        return Retry(max_retry=max_retry)


def _sqlite_immediate(engine) -> None:
    """SQLite transactions take the write lock at BEGIN (``BEGIN IMMEDIATE``), so a
    read-then-write (WAITING -> RUNNING) is atomic between processes."""
    from sqlalchemy import event

    @event.listens_for(engine, "connect")
    def _connect(dbapi_connection, _record):
        dbapi_connection.isolation_level = None

    @event.listens_for(engine, "begin")
    def _begin(conn):
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    engine.dispose()


def lost_storage_message(e: BaseException, text: str) -> str | None:
    """One line for a storage that failed in the middle of a sweep (a database connection
    lost, a journal file gone unwritable), or None when ``e`` is not such a failure."""
    try:
        from sqlalchemy.exc import DBAPIError, OperationalError
        db = (DBAPIError, OperationalError)
    except ImportError:  # pragma: no cover - sqlalchemy comes with optuna
        db = ()
    from optuna.exceptions import StorageInternalError     # Optuna's wrapper of a failed commit
    if not isinstance(e, db + (OSError, StorageInternalError)):
        return None
    e = e.__cause__ or e
    try:
        where = parse_storage(text).display()
    except StorageError:
        where = text
    return (f"lost --storage {where!r} during the sweep: {_one_line(e)}. Finished rows are in --results "
            "and in the study; rerun the same command to continue (this worker's claimed configs come "
            "back after --grace)")


def _one_line(e: BaseException) -> str:
    text = str(getattr(e, "orig", None) or e)
    lines = [l.strip() for l in text.splitlines() if l.strip() and not l.strip().startswith("(Background")]
    return (" ".join(lines[:2]) or type(e).__name__)[:300]


# ----------------------------------------------------------------------------- studies
def study_name(kernel: str, key_id: str, wid: str, backend: str) -> str:
    doc = json.dumps([kernel, key_id, wid, backend])
    return STUDY_PREFIX + hashlib.sha256(doc.encode()).hexdigest()[:16]


def space_hash(candidates) -> str:
    return hashlib.sha256(json.dumps([list(map(int, c)) for c in candidates]).encode()).hexdigest()[:16]


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _dists(candidates):
    from optuna.distributions import CategoricalDistribution
    return {k: CategoricalDistribution(sorted({int(getattr(c, k)) for c in candidates}))
            for k in BlockSizes._fields}


def _bs_of(trial) -> BlockSizes | None:
    p = trial.params or (trial.system_attrs or {}).get("fixed_params") or {}
    if all(k in p for k in BlockSizes._fields):
        return BlockSizes(*(int(p[k]) for k in BlockSizes._fields))
    return None


def mismatch_message(name: str, have: dict, want: dict, where: str) -> str | None:
    have = {**IDENTITY_DEFAULTS, **have}
    diffs = [f"{FIELD_WORDS.get(f, f)} {have.get(f)!r} (this worker: {want.get(f)!r})"
             for f in IDENTITY_FIELDS if have.get(f) != want.get(f)]
    if not diffs:
        return None
    return (f"study {name} in {where} was started with another {', '.join(diffs)}; refusing to join it "
            "(run every worker with the same rpa-tune checkout and options, or use another --storage)")


# ---------------------------------------------------------------------- the scheduler
def _row_json(row: dict) -> str:
    def default(v):
        if isinstance(v, (_dt.datetime, _dt.date)):
            return v.isoformat()
        if hasattr(v, "item"):
            return v.item()
        return str(v)
    return json.dumps(row, default=default, allow_nan=True)


def _row_from_json(text: str) -> dict:
    r = json.loads(text)
    ts = r.get("timestamp")
    if isinstance(ts, str):
        try:
            r["timestamp"] = _dt.datetime.fromisoformat(ts)
        except ValueError:
            r["timestamp"] = None
    return r


def trial_rows(trials) -> list[dict]:
    """The result rows recorded on ``trials`` (their ``row`` attribute), in trial order."""
    return [_row_from_json(t.user_attrs["row"]) for t in trials if "row" in t.user_attrs]


class StudyScheduler(Scheduler):
    """The engine's scheduler for a study in a shared storage: one worker's handle on it.

    A config is claimed through one of its trials (``_acquire``): its row, when a trial
    holds one, answers it; a RUNNING trial means another worker evaluates it (PENDING);
    otherwise a WAITING trial of it (a new one, or one given back) is moved to RUNNING
    through the storage, which exactly one worker manages. Two workers that created a
    trial of one config at once each hold one; the higher-numbered gives way."""

    shared = True

    def __init__(self, storage, where: str, *, heartbeat: float = DEFAULT_HEARTBEAT,
                 grace: float = DEFAULT_GRACE, wait_s: float = 60.0):
        self.optuna = _quiet_optuna()
        self.storage, self.where = storage, where
        self.heartbeat, self.grace, self.wait_s = float(heartbeat), float(grace), float(wait_s)
        self.poll_s = max(0.2, min(0.5, self.heartbeat / 2))
        self.worker = worker_id()
        self.rdb = isinstance(storage, self.optuna.storages.RDBStorage)
        self.storage_s = 0.0          # wall time in storage calls after joining (claims, tells, stale checks;
        self.storage_calls = 0        # heartbeats run on their own thread and are not counted)
        self.join_s: float | None = None
        self.study = None
        self.name = ""
        self.created = False
        self.inflight: dict[int, BlockSizes] = {}      # trial id -> config (this worker's)
        self.numbers: dict[int, int] = {}              # trial id -> trial number
        self.base: dict[str, int] = {}                 # config id -> number of the trial holding its row
        self._seen = None                              # (when, the study's trials) last read
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._hb_thread = None
        self._last_stale_check = -math.inf

    # -- joining --------------------------------------------------------------------------
    def open(self, spec, plan, ctx, store) -> dict:
        self.spec, self.ctx = spec, ctx
        self.dists = _dists(plan.candidates) if plan.candidates else {}
        self.candidates = len(plan.candidates)
        self.name = study_name(ctx.kernel.name, spec.key_id, ctx.wid, spec.backend)
        self.identity = dict(kernel=ctx.kernel.name, kernel_version=ctx.kversion, evaluator_version=ctx.ev_version,
                             space=space_hash(plan.candidates), search=spec.search, budget=int(spec.budget),
                             seed=int(spec.seed), refine=int(spec.refine))
        t0 = time.perf_counter()
        self.study, self.created = self._join()
        recorded = store.recorded()
        if spec.backend == "compile":      # other token buckets' studies: the seeds (engine.sibling_configs)
            recorded.update(self._related_rows())
        for t in sorted(self.study.get_trials(deepcopy=False), key=lambda t: t.number):
            if "row" in t.user_attrs and not t.user_attrs.get("skipped"):
                row = _row_from_json(t.user_attrs["row"])
                recorded[row["config_id"]] = row
                self.base[row["config_id"]] = t.number
        self.join_s = time.perf_counter() - t0
        self._hb_thread = threading.Thread(target=self._beat_loop, daemon=True, name="rpa-tune-heartbeat")
        self._hb_thread.start()
        return recorded

    def _join(self):
        optuna = self.optuna
        try:
            study = optuna.create_study(study_name=self.name, storage=self.storage, direction="minimize",
                                        load_if_exists=False)
            study.set_user_attr("rpa_tune", self.identity)
            return study, True
        except optuna.exceptions.DuplicatedStudyError:
            study = optuna.load_study(study_name=self.name, storage=self.storage)
        deadline = time.monotonic() + self.wait_s
        attrs = study.user_attrs
        while "rpa_tune" not in attrs and time.monotonic() < deadline:   # its creator is about to set it
            time.sleep(0.2)
            attrs = study.user_attrs
        have = attrs.get("rpa_tune")
        if have is None:
            raise StudyMismatch(f"study {self.name} in {self.where} has no rpa-tune identity (not made by rpa-tune?)")
        msg = mismatch_message(self.name, have, self.identity, self.where)
        if msg:
            raise StudyMismatch(msg)
        return study, False

    def _related_rows(self) -> dict:
        """The rows of the storage's studies of the same kernel, generation, case and backend
        (another token bucket or workload)."""
        want = (self.ctx.kernel.name, self.spec.key.generation, self.spec.key.case, self.spec.backend)
        rows = {}
        for s in rpa_studies(self.storage):
            m = s.user_attrs.get("meta", {})
            if s.study_name != self.name and (m.get("kernel"), m.get("generation"), m.get("case"),
                                              m.get("backend")) == want:
                for r in trial_rows(self.storage.get_all_trials(s._study_id, deepcopy=False)):
                    rows[r["config_id"]] = r
        return rows

    def planned(self, total: int) -> None:
        self.total = int(total)
        if self.created or "meta" not in self.study.user_attrs:
            s = self.spec
            self.study.set_user_attr("meta", dict(
                key_id=s.key_id, workload_id=self.ctx.wid, workload=s.workload_desc, backend=s.backend,
                generation=s.key.generation, case=s.key.case, kernel=self.ctx.kernel.name, search=s.search,
                budget=int(s.budget), refine=int(s.refine), total=self.total, candidates=self.candidates))

    def _timed(self, t0: float) -> None:
        self.storage_s += time.perf_counter() - t0
        self.storage_calls += 1

    # -- heartbeats and stale trials ---------------------------------------------------------
    def _beat(self, tid: int) -> None:
        try:
            if self.rdb:
                self.storage.record_heartbeat(tid)
            else:
                self.storage.set_trial_user_attr(tid, "heartbeat", time.time())
        except Exception:  # noqa: BLE001 - a finished trial or a transient error: the next beat retries
            pass

    def _beat_loop(self) -> None:
        while not self._stop.wait(self.heartbeat):
            with self._lock:
                ids = list(self.inflight)
            for tid in ids:
                self._beat(tid)

    def close(self) -> None:
        self._stop.set()
        if self._hb_thread is not None:
            self._hb_thread.join(timeout=5)

    def tick(self) -> None:
        self.fail_stale()

    def fail_stale(self, force: bool = False) -> None:
        """Fail RUNNING trials whose worker stopped beating; each is added back as WAITING
        (at most ``MAX_RETRY`` times). Checks at most once per heartbeat interval.

        A worker marks a trial as owned (the "owned" attribute, the trial's own id: a retried
        trial inherits its failed attempt's attributes) after its first beat (``_own``). A
        trial taken by a worker that died before that beat has no heartbeat at all, and
        Optuna's stale check (RDB storages) passes over such a trial for ever: an unowned
        RUNNING trial is stale once --grace has passed since it started."""
        now = time.monotonic()
        if not force and now - self._last_stale_check < self.heartbeat:
            return
        self._last_stale_check = now
        t0 = time.perf_counter()
        try:
            if self.rdb:
                import warnings
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", self.optuna.exceptions.ExperimentalWarning)
                    self.optuna.storages.fail_stale_trials(self.study)
            now = time.time()
            TS = self.optuna.trial.TrialState
            for t in self.study.get_trials(deepcopy=False, states=(TS.RUNNING,)):
                if t._trial_id in self.inflight:
                    continue
                if self.rdb and t.user_attrs.get("owned") == t._trial_id:
                    continue                     # it has Optuna heartbeats: checked above
                start = t.datetime_start.timestamp() if t.datetime_start else 0.0
                last = start if self.rdb else max(float(t.user_attrs.get("heartbeat") or 0.0), start)
                if now - last <= self.grace:
                    continue
                try:
                    ok = self.storage.set_trial_state_values(t._trial_id, TS.FAIL)
                except self.optuna.exceptions.UpdateFinishedTrialError:
                    ok = False
                if ok:
                    retry_callback(MAX_RETRY)(self.study, self.storage.get_trial(t._trial_id))
        finally:
            self._timed(t0)

    # -- claiming -----------------------------------------------------------------------------
    def acquire(self, bs, cid, prev, redo, phase) -> Grant:
        t0 = time.perf_counter()
        try:
            return self._acquire(bs, prev, redo, phase, self.base.get(cid, -1) if redo else -1)
        finally:
            self._timed(t0)

    def _acquire(self, bs, prev, redo, phase, base: int) -> Grant:
        """``base``: the number of the trial whose row is evaluated again (``redo``); it and
        the trials before it no longer answer for the config."""
        TS = self.optuna.trial.TrialState
        for attempt in range(20):
            # the first look may be a moment old (every claim is then made and checked afresh)
            live = [t for t in self._trials_of(bs, self._trials(fresh=attempt > 0))
                    if t.number > base and not t.user_attrs.get("skipped")]
            rows = sorted((t for t in live if "row" in t.user_attrs), key=lambda t: t.number)
            if rows or any(t.state == TS.RUNNING for t in live):
                for t in live:          # another trial answers for it: close a copy made at the same time
                    if t.state == TS.WAITING and self._take(t._trial_id):
                        self._skip(t._trial_id, "duplicate", t.number)
                return Grant(DONE, row=_row_from_json(rows[0].user_attrs["row"])) if rows else Grant(PENDING)
            waiting = sorted((t for t in live if t.state == TS.WAITING), key=lambda t: t.number)
            if not waiting:
                if sum(t.state == TS.FAIL for t in live) > MAX_RETRY:
                    return Grant(DONE)          # every worker that took it died: given up
                waiting = [self._create(bs, phase)]
            mine = None
            for t in waiting:
                if self._take(t._trial_id):
                    if mine is None:
                        mine = t
                    else:
                        self._skip(t._trial_id, "duplicate", t.number)
            if mine is None:
                continue
            tid = mine._trial_id
            trials = self._trials(fresh=True)
            # a lower-numbered copy still WAITING would win over ours once someone took it:
            # take it first (then it is ours, and closed), or find it held (then ours gives way)
            lower = [t for t in trials if _bs_of(t) == bs and t.state == TS.WAITING and base < t.number < mine.number
                     and not t.user_attrs.get("skipped")]
            for t in lower:
                if self._take(t._trial_id):
                    self._skip(t._trial_id, "duplicate", t.number)
            if lower:
                trials = self._trials(fresh=True)
            if self._lost_race(bs, mine, base, trials):
                self._skip(tid, "duplicate", mine.number)
                continue
            if self._over(bs, mine.number, mine.user_attrs.get("phase", phase), trials):
                self._skip(tid, "budget", mine.number)
                return Grant(OVER)
            self._own(tid, mine.number, bs)
            if prev is not None and not redo:     # in this worker's results already
                self.record(tid, prev)
                return Grant(DONE, row=prev)
            return Grant(RUN, token=tid)
        return Grant(PENDING)

    def _trials(self, fresh: bool):
        """The study's trials: read again when ``fresh`` or older than ``poll_s`` (a worker
        asking about many configs another worker holds reads the study once per poll)."""
        now = time.monotonic()
        if fresh or self._seen is None or now - self._seen[0] > self.poll_s:
            self._seen = (now, self.study.get_trials(deepcopy=False))
        return self._seen[1]

    def _trials_of(self, bs, trials) -> list:
        """The trials of ``bs``; WAITING copies of a trial that was finished (a row, a skip)
        when its worker died are closed on the way."""
        out = []
        for t in trials:
            if _bs_of(t) != bs:
                continue
            out.append(t)
            if t.state == self.optuna.trial.TrialState.WAITING and (
                    "row" in t.user_attrs or t.user_attrs.get("skipped")) and self._take(t._trial_id):
                self._tell(t.number, _row_from_json(t.user_attrs["row"]) if "row" in t.user_attrs else None)
        return out

    def _create(self, bs, phase: str):
        """A new WAITING trial of ``bs`` (its phase recorded: ``_over``)."""
        optuna = self.optuna
        tid = self.storage.create_new_trial(self.study._study_id, template_trial=optuna.trial.create_trial(
            state=optuna.trial.TrialState.WAITING, params={k: int(v) for k, v in bs._asdict().items()},
            distributions=self.dists, user_attrs={"phase": phase}))
        return self.storage.get_trial(tid)

    def _take(self, tid: int) -> bool:
        """WAITING -> RUNNING through the storage (atomic: a row lock in PostgreSQL, an
        immediate transaction in SQLite, the journal's ordered log)."""
        try:
            return self.storage.set_trial_state_values(tid, self.optuna.trial.TrialState.RUNNING)
        except self.optuna.exceptions.UpdateFinishedTrialError:
            return False

    def _lost_race(self, bs, mine, base: int, trials) -> bool:
        """Whether another trial answers for ``bs``: one with a row, or RUNNING with a lower
        number than ``mine`` (every worker decides by the same order)."""
        TS = self.optuna.trial.TrialState
        return any(t._trial_id != mine._trial_id and t.number > base and not t.user_attrs.get("skipped")
                   and ("row" in t.user_attrs or (t.state == TS.RUNNING and t.number < mine.number))
                   for t in trials if _bs_of(t) == bs)

    def _over(self, bs, number: int, phase: str, trials) -> bool:
        """Whether the study's budget (head and strategy configs: ``--budget``; climb:
        ``--refine``) was spent by other configs' trials before trial ``number``."""
        if phase not in ("budget", "climb"):
            return False             # the heuristic, replays and seeds are always asked
        group, cap = (("climb",), self.spec.refine) if phase == "climb" else (("head", "budget"), self.spec.budget)
        seen = {_bs_of(t) for t in trials
                if t.number < number and t.user_attrs.get("phase") in group and not t.user_attrs.get("skipped")}
        seen.discard(bs)
        return len(seen) >= cap

    def _own(self, tid: int, number: int, bs) -> None:
        with self._lock:
            self.inflight[tid] = bs
            self.numbers[tid] = number
        self._beat(tid)          # first: an owned trial has a heartbeat (fail_stale)
        self.storage.set_trial_user_attr(tid, "worker", self.worker)
        self.storage.set_trial_user_attr(tid, "owned", tid)

    def _skip(self, tid: int, why: str, number: int) -> None:
        self.storage.set_trial_user_attr(tid, "skipped", why)
        self.storage.set_trial_user_attr(tid, "worker", self.worker)
        self.study.tell(number, state=self.optuna.trial.TrialState.PRUNED)

    def _tell(self, number: int, row: dict | None) -> None:
        """Log metric for an ok row, PRUNED otherwise."""
        m = (row or {}).get("metric")
        if row and row.get("status") == "ok" and m is not None and m > 0:
            self.study.tell(number, math.log(m))
        else:
            self.study.tell(number, state=self.optuna.trial.TrialState.PRUNED)

    # -- finishing ------------------------------------------------------------------------------
    def record(self, tid: int, row: dict) -> None:
        """Record ``row`` on the trial and tell Optuna."""
        t0 = time.perf_counter()
        try:
            number = self.numbers.pop(tid, None)
            try:
                self.storage.set_trial_user_attr(tid, "row", _row_json(row))
                self._tell(self.storage.get_trial(tid).number if number is None else number, row)
            except self.optuna.exceptions.UpdateFinishedTrialError:
                # failed as stale meanwhile (this worker's heartbeats were held up longer than
                # --grace) and given back: the row stays in this worker's results store
                pass
        finally:
            with self._lock:
                self.inflight.pop(tid, None)
            self._timed(t0)

    def give_back(self) -> None:
        """On Ctrl-C: fail this worker's RUNNING trials and add each back as WAITING."""
        with self._lock:
            ids = list(self.inflight)
            self.inflight.clear()
        for tid in ids:
            try:
                if self.storage.set_trial_state_values(tid, self.optuna.trial.TrialState.FAIL):
                    retry_callback(None)(self.study, self.storage.get_trial(tid))
            except Exception:  # noqa: BLE001 - stale detection gives it back later
                pass

    def finish(self, outcome) -> None:
        """The study's best and heuristic rows (every worker's), and its progress."""
        outcome.study, outcome.storage_join_s = self.name, self.join_s
        outcome.storage_s, outcome.storage_calls = self.storage_s, self.storage_calls
        if self.study is None or outcome.interrupted:
            return
        trials = self.study.get_trials(deepcopy=False)
        rows = {r["config_id"]: r for r in trial_rows(trials)}
        ok = [r for r in rows.values() if r.get("status") == "ok" and r.get("metric") is not None]
        if ok:
            outcome.best = min(ok, key=lambda r: r["metric"])
        h = [r for r in rows.values() if r.get("is_heuristic")]
        if h:
            outcome.heuristic_row = h[-1]
        workers = {t.user_attrs.get("worker") for t in trials} - {None}
        outcome.stop_reason = (f"study {self.name}: {len(rows)} of {self.total} configs done by {len(workers)} "
                               f"worker(s); {outcome.stop_reason}")


# ----------------------------------------------------------------------- reading back
def rpa_studies(storage) -> list:
    """The rpa-tune studies of a storage (FrozenStudy objects)."""
    return [s for s in storage.get_all_studies() if "rpa_tune" in s.user_attrs]


def rows_from_storage(text: str) -> list[dict]:
    """Every result row stored in the rpa-tune studies of ``text``, each evaluation once (a
    retried trial may carry the row of its failed attempt)."""
    storage = open_storage(text, must_exist=True)
    rows, seen = [], set()
    for s in rpa_studies(storage):
        for r in trial_rows(storage.get_all_trials(s._study_id, deepcopy=False)):
            if (r.get("config_id"), r.get("sweep_id")) not in seen:
                seen.add((r.get("config_id"), r.get("sweep_id")))
                rows.append(r)
    return rows


@dataclasses.dataclass
class StudyStatus:
    name: str
    meta: dict
    identity: dict
    total: int
    done: int
    running: int
    waiting: int
    left: int
    failed: int           # trials failed by a dead worker (given back)
    skipped: int
    counts: dict
    best: dict | None
    workers: list


def study_status(text: str) -> list[StudyStatus]:
    storage = open_storage(text, must_exist=True)
    import optuna
    TS = optuna.trial.TrialState
    out = []
    for s in rpa_studies(storage):
        trials = storage.get_all_trials(s._study_id, deepcopy=False)
        rows = {r["config_id"]: r for r in trial_rows(trials)}
        running = sum(1 for t in trials if t.state == TS.RUNNING and not t.user_attrs.get("skipped"))
        waiting = sum(1 for t in trials if t.state == TS.WAITING)
        meta = s.user_attrs.get("meta", {})
        total = int(meta.get("total") or 0)
        counts: dict = {}
        for r in rows.values():
            counts[r["status"]] = counts.get(r["status"], 0) + 1
        ok = [r for r in rows.values() if r.get("status") == "ok" and r.get("metric") is not None]
        out.append(StudyStatus(
            name=s.study_name, meta=meta, identity=s.user_attrs.get("rpa_tune", {}), total=total,
            done=len(rows), running=running, waiting=waiting, left=max(0, total - len(rows) - running),
            failed=sum(1 for t in trials if t.state == TS.FAIL),
            skipped=sum(1 for t in trials if t.user_attrs.get("skipped")), counts=counts,
            best=min(ok, key=lambda r: r["metric"]) if ok else None,
            workers=sorted({t.user_attrs["worker"] for t in trials if t.user_attrs.get("worker")})))
    return out
