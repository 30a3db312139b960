"""Search strategies: determinism, coverage, TPE's handling of infeasible configs, early stop."""

import pytest

from kernel.workload import ServingLimits
from rpa_tune.presets import get_preset
from rpa_tune.search import GridSearch, TpeSearch, make_search
from rpa_tune.space import context, enumerate_space, load_space
from tune_fakes import fake_metric

LIM = ServingLimits(page_size=128, max_num_tokens=2048, max_num_seqs=128, max_model_len=8192)
PREFILL = enumerate_space(load_space("v6e").for_case("prefill"),
                          context(get_preset("llama3-8b").model(), LIM, "v6e")).candidates
DECODE = enumerate_space(load_space("v6e").for_case("decode"),
                         context(get_preset("llama3-8b").model(), LIM, "v6e")).candidates


def drive(search, budget, objective=fake_metric, infeasible=()):
    """Sequential engine loop: returns the asked configs in order."""
    asked = []
    while len(asked) < budget and not search.should_stop():
        bs = search.ask()
        if bs is None:
            break
        asked.append(bs)
        if bs in infeasible:
            search.tell(bs, "vmem_oom", None)
        else:
            search.tell(bs, "ok", objective(bs))
    return asked


def test_grid_is_exhaustive_in_order_with_the_heuristic_first():
    first = DECODE[7]
    s = make_search("grid", DECODE, budget=100, first=first)
    asked = drive(s, 100)
    assert asked[0] == first and sorted(asked) == sorted(DECODE) and asked[1:] == [c for c in DECODE if c != first]


def test_random_is_seeded():
    a = drive(make_search("random", PREFILL, budget=400, seed=1), 400)
    b = drive(make_search("random", PREFILL, budget=400, seed=1), 400)
    c = drive(make_search("random", PREFILL, budget=400, seed=2), 400)
    assert a == b and a != c
    assert sorted(a) == sorted(PREFILL), "each candidate exactly once"


def test_tpe_falls_back_to_grid_for_small_spaces():
    s = make_search("tpe", DECODE, budget=len(DECODE))
    assert isinstance(s, GridSearch) and "tpe -> grid" in s.fallback
    assert isinstance(make_search("tpe", PREFILL, budget=20), TpeSearch)


def test_tpe_is_deterministic_and_only_asks_candidates():
    a = drive(make_search("tpe", PREFILL, budget=30, seed=5, patience=0), 30)
    b = drive(make_search("tpe", PREFILL, budget=30, seed=5, patience=0), 30)
    c = drive(make_search("tpe", PREFILL, budget=30, seed=6, patience=0), 30)
    assert a == b and a != c
    assert len(a) == 30 and len(set(a)) == 30
    assert set(a) <= set(PREFILL)


def test_tpe_prunes_infeasible_and_learns_from_outcomes():
    first = PREFILL[0]
    infeasible = {bs for bs in PREFILL if bs.bkv == 2048}
    s = make_search("tpe", PREFILL, budget=40, seed=0, first=first, patience=0)
    asked = drive(s, 40, infeasible=infeasible)
    assert asked[0] == first, "the heuristic is evaluated first"
    pruned = [t for t in s.study.trials if t.state.name == "PRUNED"]
    assert pruned, "infeasible / non-candidate combinations are told as pruned"
    # TPE concentrates on good regions: its second half is better than random picks on average
    best = min(fake_metric(bs) for bs in PREFILL)
    later = [fake_metric(bs) for bs in asked[20:] if bs not in infeasible]
    mean_all = sum(fake_metric(bs) for bs in PREFILL) / len(PREFILL)
    assert sum(later) / len(later) < mean_all
    assert min(fake_metric(bs) for bs in asked) <= best * 1.3


def test_tpe_stops_early_without_improvement():
    s = make_search("tpe", PREFILL, budget=200, seed=0, patience=6)
    asked = drive(s, 200, objective=lambda bs: 1e-3)      # flat: nothing ever improves
    assert len(asked) == 7 and "no improvement" in s.stop_reason


def test_resume_replay_reproduces_tpe_order():
    """Resuming tells the recorded outcomes in ask order: the continuation equals an
    uninterrupted run."""
    full = drive(make_search("tpe", PREFILL, budget=25, seed=3, patience=0), 25)
    s = make_search("tpe", PREFILL, budget=25, seed=3, patience=0)
    part = drive(s, 12)
    s2 = make_search("tpe", PREFILL, budget=25, seed=3, patience=0)
    recorded = {bs: fake_metric(bs) for bs in part}
    replay = []
    while len(replay) < 25:
        bs = s2.ask()
        replay.append(bs)
        s2.tell(bs, "ok", recorded.get(bs, fake_metric(bs)))
    assert replay == full


def test_unknown_search():
    with pytest.raises(ValueError, match="unknown search 'annealing'"):
        make_search("annealing", DECODE, budget=3)


@pytest.mark.parametrize("kind", ["tpe", "random", "grid"])
def test_seeds_come_after_the_heuristic_and_outside_the_budget(kind):
    """Configs another token bucket of the key evaluated (the engine's seeds) are asked
    right after the heuristic, in their order, without using the budget or the patience."""
    first, seeds = PREFILL[3], [PREFILL[40], PREFILL[3], PREFILL[7], PREFILL[40]]
    s = make_search(kind, PREFILL, budget=12, seed=1, first=first, patience=3, seeds=seeds)
    assert s.seeds == [PREFILL[40], PREFILL[7]]                      # the heuristic and repeats dropped
    worst = lambda bs: 1.0 if bs in (PREFILL[40], PREFILL[7]) else fake_metric(bs)
    asked = drive(s, 12 + len(s.seeds), objective=worst)
    assert asked[:3] == [first, PREFILL[40], PREFILL[7]]
    assert len(set(asked)) == len(asked)
    if kind != "grid":
        # two seeds that improve nothing did not count towards the patience of 3
        assert len(asked) > 4


def _basin(target):
    """A landscape with one optimum: cost grows with the log-distance of every block size
    from ``target``'s (no two dimensions compensate each other)."""
    import math
    return lambda bs: 1e-4 * (1 + sum(abs(math.log2(a / b)) for a, b in zip(bs, target)))


def test_neighbours_are_one_or_two_block_sizes_doubled_or_halved_or_both_pairs_tied():
    from rpa_tune.search import neighbours
    cands = set(PREFILL)
    for bs in PREFILL[::17]:
        nbs = neighbours(bs, cands)
        for nb in nbs:
            r = [a / b for a, b in zip(nb, bs)]
            moved = [x for x in r if x != 1]
            assert nb in cands and set(moved) <= {2.0, 0.5}
            # one or two block sizes, or all four with bq, cq tied and bkv, ckv tied
            assert 1 <= len(moved) <= 2 or (r[0] == r[2] and r[1] == r[3] and len(moved) == 4)
        sizes = [sum(a != b for a, b in zip(nb, bs)) for nb in nbs]
        assert sizes == sorted(sizes)                                   # smaller moves first


def test_the_climb_leaves_a_basin_only_a_tied_four_way_move_leaves():
    """The v5p decode trap, synthetic: the candidates keep cq = bq and ckv = bkv, the best is
    (2, 1024, 2, 1024) and (1, 2048, 1, 2048) beats every config one or two block sizes
    away. A climb from there reaches the best through the tied move (bq, cq doubled, bkv,
    ckv halved), and without it (the moves of at most two) it would stop."""
    from rpa_tune.search import neighbours
    from kernel.config import BlockSizes
    cands = [BlockSizes(q, kv, q, kv) for q in (1, 2, 4, 8) for kv in (256, 512, 1024, 2048, 4096)]
    score = {BlockSizes(2, 1024, 2, 1024): 1.0, BlockSizes(1, 2048, 1, 2048): 1.1}
    obj = lambda bs: score.get(bs, 2.0 + bs.bq / 100 + bs.bkv / 1e5)      # noqa: E731
    trap = BlockSizes(1, 2048, 1, 2048)
    small = [nb for nb in neighbours(trap, set(cands)) if sum(a != b for a, b in zip(nb, trap)) <= 2]
    assert small and all(obj(nb) > obj(trap) for nb in small)           # a trap for small moves
    s = make_search("tpe", cands, budget=1, seed=0, first=trap, patience=0, refine=30)
    asked = drive(s, 31, objective=obj)
    assert BlockSizes(2, 1024, 2, 1024) in asked and len(asked) == len(set(asked)) < 31
    assert "local optimum" in s.stop_reason and "(2, 1024, 2, 1024)" in s.stop_reason


@pytest.mark.parametrize("kind", ["tpe", "random"])
def test_refine_climbs_to_the_optimum_after_the_budget_and_stops_there(kind):
    """After its budget the search climbs from its best: on a landscape whose optimum is
    a chain of neighbour moves away, it ends on the optimum, asks nothing twice, stops by
    itself at the local optimum (saying so), and never exceeds budget + refine asks."""
    target = PREFILL[len(PREFILL) // 2]
    obj = _basin(target)
    first = max(PREFILL, key=obj)                                     # the worst config
    s = make_search(kind, PREFILL, budget=4, seed=5, first=first, patience=0, refine=200)
    asked = drive(s, 4 + 200, objective=obj)
    assert target in asked and len(asked) == len(set(asked)) < 4 + 200
    assert "local optimum" in s.stop_reason and str(tuple(target)) in s.stop_reason
    capped = make_search(kind, PREFILL, budget=4, seed=5, first=first, patience=0, refine=3)
    assert len(drive(capped, 1000, objective=obj)) == 4 + 3
    assert "3 asks were spent; best so far" in capped.stop_reason, capped.stop_reason
    plain = make_search(kind, PREFILL, budget=4, seed=5, first=first, patience=0)
    assert target not in drive(plain, 4, objective=obj)             # the budget alone did not find it


def test_refine_climbs_when_patience_runs_out_instead_of_stopping():
    obj = lambda bs: 1e-3                                             # flat: nothing ever improves
    s = make_search("tpe", PREFILL, budget=200, seed=0, patience=6, refine=5)
    asked = drive(s, 1000, objective=obj)
    assert len(asked) == 7 + 5 and "no improvement" not in s.stop_reason


@pytest.mark.parametrize("kind", ["tpe", "random"])
def test_each_ask_names_its_phase_and_a_spent_budget_moves_on_to_the_climb(kind):
    """``phase``: the heuristic and a replayed pick are the head, a seed is a seed, then the
    strategy's proposals (budget) and the climb's. ``spend`` (a shared study's budget used by
    other workers): the config is dropped, proposals end, and with ``refine`` the climb
    starts from the best told so far; without it the search stops, saying why."""
    from rpa_tune.search import neighbours
    first, replay, seed = PREFILL[3], PREFILL[11], PREFILL[40]
    s = make_search(kind, PREFILL, budget=12, seed=2, first=first, replay=[replay], seeds=[seed], refine=5)
    asked = drive(s, 3)
    assert asked == [first, replay, seed]
    assert [s.phase(b) for b in asked] == ["head", "head", "seed"]
    proposed = s.ask()
    assert s.phase(proposed) == "budget"
    s.spend(proposed)                                 # the study's budget is spent: not evaluated
    nxt = s.ask()
    best = min(asked, key=fake_metric)
    assert s.phase(nxt) == "climb" and nxt in neighbours(best, set(PREFILL))
    s.spend(nxt)                                      # the study's climb is spent too
    assert s.ask() is None
    plain = make_search(kind, PREFILL, budget=12, seed=2, first=first)
    drive(plain, 1)
    plain.spend(plain.ask())
    assert plain.ask() is None and "budget of 12 evaluations reached" in plain.stop_reason
