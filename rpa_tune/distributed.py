"""Many workers on one sweep through Optuna's storage (``rpa-tune sweep --storage URL``).

Storages (``open_storage``): ``postgresql://...`` (a fleet; needs ``psycopg2``, the
``distributed`` extra), ``sqlite:///path.db`` and an Optuna journal file (``*.journal``
or ``journal:///path``) on one machine.

One Optuna study per (tuned kernel, key, workload, backend): its name is a hash of those
(``study_name``). The study's user attribute ``rpa_tune`` records the identity every
worker must share (kernel version, evaluator version, the planned candidates' hash,
search, budget, seed); a worker whose identity differs refuses to join
(``StudyMismatch``, naming what differs).

Claiming work is Optuna's own trial lifecycle: the worker that creates the study adds
the planned configs as WAITING trials (grid / random, and TPE whose candidates fit in the
budget); a worker claims one by moving it WAITING -> RUNNING through the storage
(``set_trial_state_values``, atomic in each storage: a row lock in PostgreSQL, an
immediate transaction in SQLite, the journal's ordered log), so exactly one worker gets
it. TPE with a budget smaller than the space asks the shared study's TPE sampler for new
trials instead; a proposal already claimed by an earlier trial (lower trial number) is a
duplicate and is told PRUNED with ``skipped=duplicate`` instead of being evaluated.

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
import uuid
from pathlib import Path

from kernel.config import BlockSizes

STUDY_PREFIX = "rpa-tune-"
DEFAULT_HEARTBEAT = 10.0
DEFAULT_GRACE = 60.0
MAX_RETRY = 3
IDENTITY_FIELDS = ("kernel", "kernel_version", "evaluator_version", "space", "search", "budget", "seed")
FIELD_WORDS = {"kernel_version": "kernel version (kernel hash)", "evaluator_version": "evaluator version",
               "space": "search space (planned candidates)", "kernel": "kernel"}


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
    diffs = [f"{FIELD_WORDS.get(f, f)} {have.get(f)!r} (this worker: {want.get(f)!r})"
             for f in IDENTITY_FIELDS if have.get(f) != want.get(f)]
    if not diffs:
        return None
    return (f"study {name} in {where} was started with another {', '.join(diffs)}; refusing to join it "
            "(run every worker with the same rpa-tune checkout and options, or use another --storage)")


# ------------------------------------------------------------------------ the session
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


class Session:
    """One worker's handle on one sweep's study: join (or create), claim, finish."""

    def __init__(self, storage, spec, plan, ctx, *, where: str, heartbeat: float = DEFAULT_HEARTBEAT,
                 grace: float = DEFAULT_GRACE, wait_s: float = 60.0):
        optuna = _quiet_optuna()
        self.optuna = optuna
        self.storage, self.spec, self.plan, self.ctx = storage, spec, plan, ctx
        self.heartbeat, self.grace = float(heartbeat), float(grace)
        self.worker = worker_id()
        self.rdb = isinstance(storage, optuna.storages.RDBStorage)
        self.cands = list(plan.candidates)
        self.cand_set = set(self.cands)
        self.dists = _dists(self.cands) if self.cands else {}
        self.storage_s = 0.0          # wall time in storage calls after joining (claims, tells, stale checks;
        self.storage_calls = 0        # heartbeats run on their own thread and are not counted)
        self.sample_mode = spec.search == "tpe" and len(self.cands) > spec.budget
        self.planned = self._planned()
        self.total = len(self.planned) if not self.sample_mode else min(spec.budget, len(self.cands))
        self.name = study_name(ctx.kernel.name, spec.key_id, ctx.wid, spec.backend)
        self.identity = dict(kernel=ctx.kernel.name, kernel_version=ctx.kversion, evaluator_version=ctx.ev_version,
                             space=space_hash(self.cands), search=spec.search, budget=int(spec.budget),
                             seed=int(spec.seed))
        self.exhausted_reason = ""
        self.misses = 0
        self.inflight: dict[int, BlockSizes] = {}      # trial id -> config (this worker's)
        self.numbers: dict[int, int] = {}              # trial id -> trial number
        self._study_attrs: dict = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._hb_thread = None
        self._last_stale_check = -math.inf
        sampler = None
        if self.sample_mode:
            import warnings
            seed = int(hashlib.sha256(f"{spec.seed}:{self.worker}:{uuid.uuid4()}".encode()).hexdigest()[:8], 16)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=min(10, max(4, spec.budget // 4)),
                                                     multivariate=True, constant_liar=True)
        t0 = time.perf_counter()
        self.study, self.created = self._join(sampler, where, wait_s)
        self.join_s = time.perf_counter() - t0     # creating / loading the study (and enqueueing the plan)

    # -- joining --------------------------------------------------------------------------
    def _planned(self) -> list[BlockSizes]:
        if self.sample_mode:
            return [self.plan.heuristic] if self.plan.heuristic is not None else []
        from .search import make_search
        s = make_search(self.spec.search, self.cands, budget=self.spec.budget, seed=self.spec.seed,
                        first=self.plan.heuristic)
        out = []
        while len(out) < self.spec.budget:
            bs = s.ask()
            if bs is None:
                break
            out.append(bs)
        return out

    def meta(self) -> dict:
        s = self.spec
        return dict(key_id=s.key_id, workload_id=self.ctx.wid, workload=s.workload_desc, backend=s.backend,
                    generation=s.key.generation, case=s.key.case, kernel=self.ctx.kernel.name,
                    search=s.search, budget=int(s.budget), total=self.total, candidates=len(self.cands),
                    sample_mode=self.sample_mode)

    def _join(self, sampler, where, wait_s):
        optuna = self.optuna
        try:
            study = optuna.create_study(study_name=self.name, storage=self.storage, direction="minimize",
                                        sampler=sampler, load_if_exists=False)
            created = True
        except optuna.exceptions.DuplicatedStudyError:
            study = optuna.load_study(study_name=self.name, storage=self.storage, sampler=sampler)
            created = False
        if created:
            study.set_user_attr("rpa_tune", self.identity)
            study.set_user_attr("meta", self.meta())
            self._enqueue(study, self.planned)
            study.set_user_attr("enqueued", "creator")
            return study, True
        deadline = time.monotonic() + wait_s
        attrs = study.user_attrs
        while "rpa_tune" not in attrs and time.monotonic() < deadline:
            time.sleep(0.2)
            attrs = study.user_attrs
        have = attrs.get("rpa_tune")
        if have is None:
            raise StudyMismatch(f"study {self.name} in {where} has no rpa-tune identity (not made by rpa-tune?)")
        msg = mismatch_message(self.name, have, self.identity, where)
        if msg:
            raise StudyMismatch(msg)
        while not attrs.get("enqueued") and time.monotonic() < deadline:
            time.sleep(0.2)
            attrs = study.user_attrs
        if not attrs.get("enqueued"):     # its creator died before enqueueing: add what is missing
            known = {_bs_of(t) for t in study.get_trials(deepcopy=False)}
            self._enqueue(study, [bs for bs in self.planned if bs not in known])
            study.set_user_attr("enqueued", "joiner")
        return study, False

    def _enqueue(self, study, configs) -> None:
        optuna = self.optuna
        study.add_trials([optuna.trial.create_trial(
            state=optuna.trial.TrialState.WAITING, params={k: int(v) for k, v in bs._asdict().items()},
            distributions=self.dists, user_attrs={"planned": True}) for bs in configs])

    def _timed(self, t0: float) -> None:
        self.storage_s += time.perf_counter() - t0
        self.storage_calls += 1

    # -- heartbeats and stale trials ---------------------------------------------------------
    def start_heartbeats(self) -> None:
        self._hb_thread = threading.Thread(target=self._beat_loop, daemon=True, name="rpa-tune-heartbeat")
        self._hb_thread.start()

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
    def _claimed_elsewhere(self, tid: int, number: int, bs: BlockSizes) -> bool:
        """Whether another trial owns ``bs``: one with a row (done), or RUNNING with a lower
        number. Lower-numbered RUNNING trials whose config is not yet known are waited for
        (a few seconds), so every worker decides by the same order."""
        TS = self.optuna.trial.TrialState
        deadline = time.monotonic() + 10.0
        while True:
            unknown = False
            for t in self.study.get_trials(deepcopy=False):
                if t._trial_id == tid or t.user_attrs.get("skipped"):
                    continue
                other = _bs_of(t)
                if t.state == TS.RUNNING and t.number < number and other is None:
                    unknown = True
                    continue
                if other != bs:
                    continue
                if "row" in t.user_attrs or (t.state == TS.RUNNING and t.number < number):
                    return True
            if not unknown or time.monotonic() > deadline:
                return False
            time.sleep(0.05)

    def _skip(self, tid: int, why: str) -> None:
        self.storage.set_trial_user_attr(tid, "skipped", why)
        self.storage.set_trial_user_attr(tid, "worker", self.worker)
        self.study.tell(self.storage.get_trial(tid).number, state=self.optuna.trial.TrialState.PRUNED)

    def _may_duplicate(self, trial) -> bool:
        """Whether another trial may hold the same config: always when TPE proposes configs
        or the study's plan was completed by a joining worker; for a plan enqueued once by
        the study's creator only a retried trial (its first attempt failed, so no)."""
        if self.sample_mode or self.study_user_attr("enqueued") != "creator":
            return True
        return False

    def study_user_attr(self, name):
        if name not in self._study_attrs:
            self._study_attrs = self.study.user_attrs
        return self._study_attrs.get(name)

    def _own(self, trial, number: int) -> None:
        tid = trial._trial_id
        with self._lock:
            self.inflight[tid] = _bs_of(trial)
            self.numbers[tid] = number
        self._beat(tid)          # first: an owned trial has a heartbeat (fail_stale)
        self.storage.set_trial_user_attr(tid, "worker", self.worker)
        self.storage.set_trial_user_attr(tid, "owned", tid)

    def _pop_waiting(self):
        TS = self.optuna.trial.TrialState
        for t in self.study.get_trials(deepcopy=False, states=(TS.WAITING,)):
            try:
                if self.storage.set_trial_state_values(t._trial_id, TS.RUNNING):
                    return self.storage.get_trial(t._trial_id)
            except self.optuna.exceptions.UpdateFinishedTrialError:
                continue
        return None

    def claim(self):
        """(trial id, BlockSizes) this worker now owns, or None (nothing claimable now)."""
        t0 = time.perf_counter()
        try:
            return self._claim()
        finally:
            self._timed(t0)

    def _claim(self):
        TS = self.optuna.trial.TrialState
        for _ in range(400):
            trial = self._pop_waiting()
            if trial is None:
                if not self.sample_mode:
                    self.exhausted_reason = "every planned config claimed"
                    return None
                trial = self._sample()
                if trial is None:
                    return None
            bs = _bs_of(trial)
            tid, number = trial._trial_id, trial.number
            inherited = trial.user_attrs     # a retried trial carries its failed attempt's attributes
            if inherited.get("skipped"):     # its worker died while skipping it
                self._skip(tid, str(inherited["skipped"]))
                continue
            if "row" in inherited:           # its worker died between recording the row and the tell
                self.numbers[tid] = number
                self.finish(tid, _row_from_json(inherited["row"]))
                continue
            if bs is None or bs not in self.cand_set:
                self._skip(tid, "not a candidate")
                self.misses += 1
                continue
            for k, v in bs._asdict().items():     # popped trials keep their params; set any missing
                if k not in trial.params:
                    self.storage.set_trial_param(tid, k, self.dists[k].to_internal_repr(int(v)), self.dists[k])
            self._own(trial, number)
            if self._may_duplicate(trial) and self._claimed_elsewhere(tid, number, bs):
                with self._lock:
                    self.inflight.pop(tid, None)
                self._skip(tid, "duplicate")
                self.misses += 1
                continue
            if self.sample_mode and self._over_budget(number):
                with self._lock:
                    self.inflight.pop(tid, None)
                self._skip(tid, "budget")
                self.exhausted_reason = f"budget of {self.spec.budget} evaluations reached"
                return None
            self.misses = 0
            return tid, bs
        self.exhausted_reason = "TPE proposed only known or illegal configs"
        return None

    def _sample(self):
        TS = self.optuna.trial.TrialState
        trials = self.study.get_trials(deepcopy=False)
        owned = {_bs_of(t) for t in trials if not t.user_attrs.get("skipped") and t.state != TS.FAIL
                 and ("row" in t.user_attrs or t.state in (TS.RUNNING, TS.WAITING))}
        if self._count_claims(trials, None) >= self.spec.budget:
            self.exhausted_reason = f"budget of {self.spec.budget} evaluations reached"
            return None
        if self._patience_reached(trials):
            return None
        rest = [c for c in self.cands if c not in owned]
        if not rest:
            self.exhausted_reason = "every candidate evaluated"
            return None
        if self.misses >= 50:      # TPE keeps proposing known / illegal configs: an unexplored one
            bs = rest[int(hashlib.sha256(f"{self.worker}{len(trials)}".encode()).hexdigest()[:8], 16) % len(rest)]
            self._enqueue(self.study, [bs])
            self.misses = 0
            return self._pop_waiting()
        trial = self.study.ask(self.dists)
        return self.storage.get_trial(trial._trial_id)

    def _count_claims(self, trials, below: int | None) -> int:
        TS = self.optuna.trial.TrialState
        seen = set()
        for t in trials:
            if below is not None and t.number >= below:
                continue
            if t.user_attrs.get("skipped") or t.state == TS.FAIL:
                continue
            bs = _bs_of(t)
            if bs in self.cand_set and ("row" in t.user_attrs or t.state in (TS.RUNNING, TS.WAITING)):
                seen.add(bs)
        return len(seen)

    def _over_budget(self, number: int) -> bool:
        return self._count_claims(self.study.get_trials(deepcopy=False), number) >= self.spec.budget

    def _patience_reached(self, trials) -> bool:
        from .search import Search
        if self.spec.patience <= 0:
            return False
        s = Search([], budget=self.spec.budget, patience=self.spec.patience)
        for t in sorted(trials, key=lambda t: t.number):
            if "row" in t.user_attrs:
                r = json.loads(t.user_attrs["row"])
                s.tell(None, r.get("status"), r.get("metric"))
        if s.should_stop():
            self.exhausted_reason = s.stop_reason
            return True
        return False

    # -- finishing ------------------------------------------------------------------------------
    def finish(self, tid: int, row: dict) -> None:
        """Record ``row`` on the trial and tell Optuna (log metric for ok, PRUNED otherwise)."""
        t0 = time.perf_counter()
        try:
            TS = self.optuna.trial.TrialState
            number = self.numbers.pop(tid, None)
            try:
                self.storage.set_trial_user_attr(tid, "row", _row_json(row))
                if number is None:
                    number = self.storage.get_trial(tid).number
                m = row.get("metric")
                if row.get("status") == "ok" and m is not None and m > 0:
                    self.study.tell(number, math.log(m))
                else:
                    self.study.tell(number, state=TS.PRUNED)
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

    def others_running(self) -> int:
        TS = self.optuna.trial.TrialState
        t0 = time.perf_counter()
        try:
            return sum(1 for t in self.study.get_trials(deepcopy=False, states=(TS.RUNNING, TS.WAITING))
                       if t._trial_id not in self.inflight and not t.user_attrs.get("skipped"))
        finally:
            self._timed(t0)

    def study_rows(self) -> list[dict]:
        return trial_rows(self.study.get_trials(deepcopy=False))


# ------------------------------------------------------------------- the worker loop
def run_distributed(spec, store, storage_text: str, *, events=None, pool_env: dict | None = None,
                    heartbeat: float = DEFAULT_HEARTBEAT, grace: float = DEFAULT_GRACE, storage=None):
    """``engine.run_sweep`` as one of many workers of the study in ``storage_text``.

    Rows go to ``store`` (this worker's) and to the study. Raises ``StorageError`` /
    ``StudyMismatch`` before evaluating anything."""
    from . import engine
    from .evaluators import base
    events = events or engine.Events()
    t_start = time.monotonic()
    su = parse_storage(storage_text)
    plan = engine.plan_sweep(spec)
    ctx = engine.sweep_context(spec)
    outcome = engine.Outcome(spec, plan, counts={s: 0 for s in base.STATUSES})
    if storage is None:
        storage = open_storage(storage_text, heartbeat=heartbeat, grace=grace)
    sess = Session(storage, spec, plan, ctx, where=su.display(), heartbeat=heartbeat, grace=grace)
    outcome.study = sess.name
    recorded = store.recorded()
    sweep_id = uuid.uuid4().hex[:12]
    before = {r["config_id"] for r in sess.study_rows()}
    events.start(spec, plan, sess.total)
    poll = max(0.2, min(0.5, heartbeat / 2))
    pool = engine.WorkerPool(spec.backend, 1 if spec.backend == "tpu" else spec.jobs, env=pool_env)
    sess.start_heartbeats()
    try:
        while True:
            sess.fail_stale()
            exhausted = False
            while not exhausted and pool.free_slots() > 0:
                got = sess.claim()
                if got is None:
                    exhausted = True
                    break
                tid, bs = got
                prev = recorded.get(ctx.config_id(bs))
                if prev is not None and prev["status"] not in spec.retry:   # in this worker's results already
                    prev = dict(prev, is_heuristic=bs == plan.heuristic)
                    sess.finish(tid, prev)
                    outcome.resumed += 1
                    engine.note_row(outcome, prev)
                    events.resumed(prev)
                    continue
                pool.submit(engine.make_task(spec, plan, bs), (tid, bs))
                events.dispatched(bs)
            if pool.busy == 0:
                if sess.others_running() == 0:
                    sess.fail_stale(force=True)
                    if sess.others_running() == 0:
                        break
                time.sleep(poll)      # others evaluate; their stale trials come back to us
                continue
            for (tid, bs), task, res, eval_s in pool.wait(timeout=poll):
                row = ctx.row(plan, bs, res, eval_s, sweep_id)
                # the study first: a worker killed between the two writes leaves the row in the
                # study (not redone, and exported from there) rather than only in its own store
                try:
                    sess.finish(tid, row)
                finally:
                    store.append([row])
                recorded[row["config_id"]] = row
                outcome.evaluated += 1
                engine.note_row(outcome, row)
                events.finished(row, outcome)
        rows = sess.study_rows()
        outcome.resumed += len({r["config_id"] for r in rows} & before)
        ok = [r for r in rows if r.get("status") == base.OK and r.get("metric") is not None]
        if ok:
            outcome.best = min(ok, key=lambda r: r["metric"])
        h = [r for r in rows if r.get("is_heuristic")]
        if h:
            outcome.heuristic_row = h[0]
        workers = {t.user_attrs.get("worker") for t in sess.study.get_trials(deepcopy=False)} - {None}
        done = len({r["config_id"] for r in rows})
        outcome.stop_reason = (f"study {sess.name}: {done} of {sess.total} configs done by {len(workers)} "
                               f"worker(s); {sess.exhausted_reason or 'nothing left'}")
    except KeyboardInterrupt:
        sess.give_back()
        outcome.interrupted = True
        outcome.stop_reason = "interrupted: this worker's claimed configs were given back to the study"
    finally:
        sess.close()
        pool.close()
        outcome.elapsed_s = time.monotonic() - t_start
        outcome.storage_s, outcome.storage_calls = sess.storage_s, sess.storage_calls
        outcome.storage_join_s = sess.join_s
    return outcome


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
