"""Search strategies over a case's candidate configs: grid, random, TPE (Optuna).

All three share one ask/tell interface driven by the engine:

* ``ask()`` returns the next ``BlockSizes`` to evaluate (None: nothing more to ask);
* ``tell(bs, status, metric)`` reports its outcome (``metric`` in seconds for ``ok``).

The candidate list given to a search is already legal and VMEM-pre-filtered (infeasible
configs never reach TPE). The kernel's heuristic config, when it is a candidate, is
asked first by every strategy so that every sweep measures the default it improves on.

* ``grid``: every candidate in enumeration order.
* ``random``: a seeded permutation of the candidates.
* ``tpe``: Optuna's TPE sampler (seeded) over the candidates' values of ``bq, bkv, cq,
  ckv``. Combinations that are not candidates (illegal or pre-filtered) are told as
  pruned without evaluation, so TPE learns to avoid them; configs the compiler finds
  infeasible are told as pruned too. It stops early when ``patience`` evaluations in a
  row have not improved the best metric by more than 0.5%. When the space has no more
  candidates than the budget, TPE runs ``grid`` instead (exhaustive is then cheaper).

``seeds``: configs asked right after the heuristic and outside the budget: the engine
passes the configs a sweep of the same key at another token bucket evaluated (their
compiles are cached, so pricing them again costs next to nothing), and TPE learns from
them before its own proposals. They do not count towards ``patience`` either.

``replay``: configs this sweep's own search picked in an earlier run (the engine reads them
from the store); asked with the head and inside the budget, so a rerun of a finished sweep
asks nothing new even when the seeds have changed since (the other buckets grew) and the
search would now propose other configs. A replayed config is never also a seed, is always
asked (the engine's limit takes at least the head), and spends no patience.

``refine``: after its budget (or its patience), a search climbs from the best config told
so far: it asks the best's neighbours (``neighbours``: one or two of bq, bkv, cq, ckv
doubled or halved, or bq with cq and bkv with ckv) not asked yet, moving on whenever one
beats it, until every neighbour of the best has been evaluated (a local optimum) or
``refine`` climb asks are spent. On the exhaustively swept v5e mixed key (Llama-3-70B TP8
at the 2048 bucket) TPE alone came within 2 % of the exhaustive best for 8 of 20 seeds at
budget 12 and 14 of 20 at budget 24 (worst +27 %): its landscape has a basin whose best is
two block sizes away from the optimum. Budget 12 and a climb of at most 32 found the
optimum for 20 of 20 there and on the other swept prefill and mixed keys, and for 19 of 20
on v5p decode bucket 512 (benchmarks/README.md, "Search"). The engine counts ``refine``
outside the budget.

Same seed and same outcomes give the same order (with one job; parallel jobs change the
order in which outcomes reach TPE). Resuming replays the recorded outcomes through
``tell`` in ask order, so an interrupted TPE sweep continues where it stopped.
"""
from __future__ import annotations

import itertools
import math
import warnings

import numpy as np

from kernel.config import BlockSizes

SEARCHES = ("grid", "random", "tpe")
SEEDED = "seed"     # the ``search`` a results row records for a config asked as a seed
IMPROVEMENT = 0.005


def usable_seeds(candidates, first, seeds, replay=()) -> list[BlockSizes]:
    """The seeds a search asks: candidates only, not the heuristic (asked first anyway) nor
    a replayed config (inside the budget), once each, in the given order."""
    cands = set(map(BlockSizes.coerce, candidates))
    skip = {first, *map(BlockSizes.coerce, replay)}
    return list(dict.fromkeys(b for b in map(BlockSizes.coerce, seeds) if b in cands and b not in skip))


# A climbing step, as (dimension, factor) pairs over (bq, bkv, cq, ckv): one block size
# doubled or halved; then two at once; last, both pairs tied (bq with cq, bkv with ckv),
# one scaled up and the other down or both the same way. The tied four-way move is what a
# decode space needs: its candidates keep cq = bq and often ckv = bkv, so (1, 2048, 1, 2048)
# and (2, 1024, 2, 1024) were not neighbours and a climb stopped on the worse one (v5p
# decode bucket 512: 2 of 20 replayed seeds within 2 % of the exhaustive best, 19 of 20
# with the tied move; benchmarks/README.md, "Search").
MOVES = tuple(itertools.chain(
    (((d, f),) for d in range(4) for f in (2, 0.5)),
    (((d, f), (e, g)) for d, e in itertools.combinations(range(4), 2) for f in (2, 0.5) for g in (2, 0.5)),
    (((0, f), (2, f), (1, g), (3, g)) for f in (2, 0.5) for g in (2, 0.5))))


def neighbours(bs: BlockSizes, candidates) -> list[BlockSizes]:
    """The candidates one climbing step from ``bs``: one block size doubled or halved, then
    two at once (a KV block and its compute chunk often move together), then the query pair
    and the KV pair each scaled together (``MOVES``), in a fixed order."""
    cands = candidates if isinstance(candidates, (set, frozenset)) else set(candidates)
    out = []
    for move in MOVES:
        v = list(bs)
        for d, f in move:
            v[d] = int(v[d] * f)
        nb = BlockSizes(*v)
        if nb != bs and nb in cands and nb not in out:
            out.append(nb)
    return out


class Search:
    name = ""

    def __init__(self, candidates, *, budget: int, seed: int = 0, first: BlockSizes | None = None,
                 patience: int = 0, seeds=(), replay=(), refine: int = 0):
        self.candidates = [BlockSizes(*c) for c in candidates]
        self._cand_set = set(self.candidates)
        self.refine = int(refine)
        self._climbing = False
        self._climbed = 0
        self._proposed = 0
        self._asked: set[BlockSizes] = set()
        self._told: dict[BlockSizes, float | None] = {}
        self.budget = int(budget)
        self.seed = int(seed)
        self.first = first if first in set(self.candidates) else None
        self.replay = usable_seeds(self.candidates, self.first, replay)
        self.seeds = usable_seeds(self.candidates, self.first, seeds, self.replay)
        self._free = set(self.seeds) | set(self.replay)     # no patience spent on them
        self.patience = int(patience)
        self.best = math.inf
        self.since_best = 0
        self.stop_reason = ""
        self.fallback = ""
        self._phase: dict[BlockSizes, str] = {}
        self._spent = False

    def ask(self) -> BlockSizes | None:
        """The next config to evaluate: the strategy's (``_propose``), then the climb."""
        if not self._climbing:
            if self._spent or (self.refine and self._proposed >= max(len(self.head), self.budget + len(self.seeds))):
                if not self.refine:
                    return None
                self._climbing = True
            else:
                bs = self._propose()
                if bs is not None:
                    self._proposed += 1
                    self._asked.add(bs)
                    self._phase.setdefault(bs, "seed" if bs in set(self.seeds) else "head" if bs in set(
                        self.head) else "budget")
                    return bs
                if not self.refine:
                    return None
                self._climbing = True
        bs = self._climb()
        if bs is not None:
            self._phase.setdefault(bs, "climb")
        return bs

    def phase(self, bs: BlockSizes) -> str:
        """What asked ``bs``: ``head`` (the heuristic, a replayed pick), ``seed`` (outside the
        budget), ``budget`` (the strategy) or ``climb`` (``refine``)."""
        return self._phase.get(bs, "budget")

    def spend(self, bs: BlockSizes) -> None:
        """``bs`` will not be evaluated: the shared budget of its phase is spent (other
        workers of a shared study used it). A strategy's proposal ends the proposals (the
        climb follows, with ``refine``); a climb's ends the climb."""
        self._asked.discard(bs)
        if self.phase(bs) == "climb":
            self._climbed = self.refine
            self.stop_reason = f"the study's {self.refine} climb asks were spent by its workers"
        else:
            self._spent = True
            if not self.refine:
                self.stop_reason = f"budget of {self.budget} evaluations reached (by the study's workers)"

    def _propose(self) -> BlockSizes | None:
        raise NotImplementedError

    def _climb(self) -> BlockSizes | None:
        ok = [(m, bs) for bs, m in self._told.items() if m is not None]
        if not ok:
            return None
        best = min(ok)[1]
        nxt = next((nb for nb in neighbours(best, self._cand_set) if nb not in self._asked), None)
        if nxt is None:
            if not self.waiting:
                self.stop_reason = f"refined to a local optimum: every neighbour of {tuple(best)} evaluated"
            return None
        if self._climbed >= self.refine:
            if not self.waiting:
                self.stop_reason = (f"the climb's {self.refine} asks were spent; best so far {tuple(best)}, "
                                    "some of its neighbours not evaluated")
            return None
        self._climbed += 1
        self._asked.add(nxt)
        return nxt

    @property
    def waiting(self) -> bool:
        """Climbing, with asked configs not told yet: it may have more to ask once they are."""
        return self._climbing and any(bs not in self._told for bs in self._asked)

    def tell(self, bs: BlockSizes, status: str, metric: float | None) -> None:
        good = status == "ok" and metric is not None and math.isfinite(metric)
        self._told[bs] = metric if good else None
        self._asked.add(bs)
        if self._climbing:            # the climb: patience no longer applies
            if good:
                self.best = min(self.best, metric)
            return
        if bs in self._free:          # free: only the best moves
            if good:
                self.best = min(self.best, metric)
            return
        if good:
            if metric < self.best * (1 - IMPROVEMENT):
                self.best = metric
                self.since_best = 0
                return
            self.best = min(self.best, metric)
        self.since_best += 1

    def should_stop(self) -> bool:
        if self._climbing:
            return False
        if self.patience > 0 and self.since_best >= self.patience and math.isfinite(self.best):
            if self.refine:           # out of patience: climb from the best instead of stopping
                self._climbing = self._proposed >= len(self.head)    # (after the head: replays)
                return False
            self.stop_reason = f"no improvement > {IMPROVEMENT:.1%} in {self.patience} evaluations"
            return True
        return False

    @property
    def head(self) -> list[BlockSizes]:
        """What every strategy asks first: the heuristic, its replayed picks, then the seeds."""
        return ([self.first] if self.first is not None else []) + self.replay + self.seeds

    def _ordered(self, order) -> list[BlockSizes]:
        head = self.head
        return head + [b for b in order if b not in set(head)]


class GridSearch(Search):
    name = "grid"

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self._queue = self._ordered(self.candidates)
        self.patience = 0   # exhaustive: never stops early

    def _propose(self):
        return self._queue.pop(0) if self._queue else None


class RandomSearch(Search):
    name = "random"

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        rng = np.random.default_rng([self.seed, 17])
        perm = [self.candidates[i] for i in rng.permutation(len(self.candidates))]
        self._queue = self._ordered(perm)

    def _propose(self):
        return self._queue.pop(0) if self._queue else None


class TpeSearch(Search):
    name = "tpe"
    MAX_MISSES = 200

    def __init__(self, *a, jobs: int = 1, **kw):
        super().__init__(*a, **kw)
        import optuna
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self._optuna = optuna
        self._cands = set(self.candidates)
        self._values = {k: sorted({getattr(c, k) for c in self.candidates}) for k in BlockSizes._fields}
        self._dists = {k: optuna.distributions.CategoricalDistribution(v) for k, v in self._values.items()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # multivariate / constant_liar are "experimental"
            sampler = optuna.samplers.TPESampler(
                seed=self.seed, n_startup_trials=min(10, max(4, self.budget // 4)), multivariate=True,
                constant_liar=jobs > 1)
        self.study = optuna.create_study(direction="minimize", sampler=sampler)
        self._trials: dict[BlockSizes, object] = {}   # in flight
        self._seen: dict[BlockSizes, tuple] = {}       # told outcomes
        self._rng = np.random.default_rng([self.seed, 29])
        for bs in self.head:
            self.study.enqueue_trial(bs._asdict())

    def _params(self, trial) -> BlockSizes:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return BlockSizes(*(trial.suggest_categorical(k, self._values[k]) for k in BlockSizes._fields))

    def _tell_known(self, trial, status, metric):
        TS = self._optuna.trial.TrialState
        if status == "ok" and metric is not None and metric > 0:
            self.study.tell(trial, math.log(metric))
        else:
            self.study.tell(trial, state=TS.PRUNED)

    def _propose(self):
        TS = self._optuna.trial.TrialState
        for _ in range(self.MAX_MISSES):
            if len(self._seen) + len(self._trials) >= len(self._cands):
                return None
            trial = self.study.ask()
            bs = self._params(trial)
            if bs not in self._cands:
                self.study.tell(trial, state=TS.PRUNED)       # illegal or VMEM-infeasible: never evaluated
                continue
            if bs in self._seen:
                self._tell_known(trial, *self._seen[bs])
                continue
            if bs in self._trials:
                self.study.tell(trial, state=TS.FAIL)         # already in flight
                continue
            self._trials[bs] = trial
            return bs
        # TPE keeps proposing known / illegal configs: hand it an unexplored candidate
        rest = [c for c in self.candidates if c not in self._seen and c not in self._trials]
        if not rest:
            return None
        bs = rest[int(self._rng.integers(len(rest)))]
        self.study.enqueue_trial(bs._asdict())
        trial = self.study.ask()
        self._trials[bs] = trial
        return bs

    def spend(self, bs):
        super().spend(bs)
        trial = self._trials.pop(bs, None)
        if trial is not None:
            self.study.tell(trial, state=self._optuna.trial.TrialState.FAIL)

    def tell(self, bs, status, metric):
        super().tell(bs, status, metric)
        self._seen[bs] = (status, metric)
        trial = self._trials.pop(bs, None)
        if trial is not None:
            self._tell_known(trial, status, metric)


def make_search(kind: str, candidates, *, budget: int, seed: int = 0, first=None, patience: int = 0,
                jobs: int = 1, seeds=(), replay=(), refine: int = 0) -> Search:
    """A search of ``kind``; ``tpe`` becomes ``grid`` when the candidates fit in the budget
    (plus the seeds, which are outside it)."""
    if kind not in SEARCHES:
        raise ValueError(f"unknown search {kind!r}; valid: {SEARCHES}")
    free = len(usable_seeds(candidates, first, seeds, replay))
    kw = dict(budget=budget, seed=seed, first=first, seeds=seeds, replay=replay, refine=refine)
    if kind == "grid" or (kind == "tpe" and len(candidates) <= budget + free):
        s = GridSearch(candidates, **kw)
        if kind == "tpe":
            s.fallback = f"tpe -> grid: {len(candidates)} candidates fit in the budget of {budget}"
        return s
    if kind == "random":
        return RandomSearch(candidates, patience=0, **kw)
    return TpeSearch(candidates, patience=patience, jobs=jobs, **kw)
