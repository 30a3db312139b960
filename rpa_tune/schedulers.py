"""Who evaluates which config of a sweep: the scheduler half of ``engine.run_sweep``.

The engine's one loop asks its search for configs and hands each to a scheduler
(``acquire``), which answers with a ``Grant``:

* ``RUN``: evaluate it here (the grant's ``token`` comes back with the row, ``record``);
* ``DONE``: its row is known (recorded earlier, or by another worker): tell it, do not
  evaluate it;
* ``PENDING``: another worker evaluates it now; ask again later (``poll_s``);
* ``OVER``: the shared budget of the config's phase is spent (another worker's configs
  used it): do not evaluate it, and propose no more of that phase.

Two implementations, as Optuna has one storage base and a class per backend:
``LocalScheduler`` (this process alone; the results store is the only record) and
``distributed.StudyScheduler`` (a study in a shared Optuna storage: SQLite, PostgreSQL
or a journal file).
"""
from __future__ import annotations

import dataclasses

RUN, DONE, PENDING, OVER = "run", "done", "pending", "over"
PHASES = ("head", "seed", "budget", "climb")     # what asked a config (``search.Search.phase``)


@dataclasses.dataclass
class Grant:
    kind: str
    token: object = None          # RUN: handed back to ``record``
    row: dict | None = None       # DONE: the row (None: given up after repeated worker deaths)


class Scheduler:
    """The base: what the engine calls, in this order. ``open`` may refuse (raise) before
    anything is evaluated or written."""

    shared = False           # other processes take part (their outcomes reach this search)
    poll_s = 0.0             # how often PENDING configs are asked about again

    def open(self, spec, plan, ctx, store) -> dict:
        """Join the sweep; return the rows known so far (config_id -> row): resume, the
        seeds from other token buckets and the search's earlier picks read them."""
        raise NotImplementedError

    def planned(self, total: int) -> None:
        """How many configs this sweep plans to evaluate (for progress readers)."""

    def acquire(self, bs, cid: str, prev: dict | None, redo: bool, phase: str) -> Grant:
        """Whether this process evaluates ``bs`` (config id ``cid``). ``prev``: the row known
        for it when the sweep started; ``redo``: evaluate it again all the same
        (``--retry``, a crashed heuristic)."""
        raise NotImplementedError

    def record(self, token, row: dict) -> None:
        """``row`` finished the evaluation granted with ``token`` (written before the store)."""

    def tick(self) -> None:
        """Called once per loop turn (stale-claim checks)."""

    def give_back(self) -> None:
        """Interrupted: hand back what this process claimed."""

    def finish(self, outcome) -> None:
        """Complete ``outcome`` (stop reason, best over every worker's rows)."""

    def close(self) -> None:
        pass


class LocalScheduler(Scheduler):
    """This process alone: every config is evaluated here unless the results store
    already holds it."""

    def open(self, spec, plan, ctx, store) -> dict:
        return store.recorded()

    def acquire(self, bs, cid, prev, redo, phase) -> Grant:
        if prev is not None and not redo:
            return Grant(DONE, row=prev)
        return Grant(RUN)
