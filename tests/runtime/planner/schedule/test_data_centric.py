"""The Data-Centric Parallel paper's accumulation balancing (its DCP-inter) and recomputation choice
(its DCP-intra)."""
import functools
import itertools

import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

from hgraph.errors import HGraphError
from hgraph.runtime.planner.schedule.data_centric import (IntraCandidate, data_centric_accumulation,
                                                         data_centric_recomputation, idle_fraction)


def _most(budget, t):
    """The largest count g with g x t within the budget, as the tests measure it (1e-9 of slack: a
    budget of 1.999999999999993 ms holds two steps of 1 ms, as ``data_centric_accumulation``'s rounding says)."""
    return int(np.floor((budget + 1e-9) / t))


def _exhaustive_best_idle(times, gpus, budget):
    """The least Eq. 3 idle fraction over every accumulation vector g with g_j >= 1 and every g_j x T_j
    within the budget. Vectorised over all but the first batch's count: the whole product of the ranges
    holds up to 200^4 vectors (T = 1, 1, 1, 50 ms at G_max 4), whose one-by-one loop took 0.2 s to
    99 s by the examples hypothesis drew."""
    w = np.asarray(gpus, dtype=np.float64)
    spans = [np.arange(1, _most(budget, t) + 1) * t for t in times]       # g_j x T_j for every g_j
    rest = list(np.ix_(*spans[1:])) if len(spans) > 1 else []
    best = np.inf
    for first in spans[0]:
        parts = [np.float64(first), *rest]
        H = np.asarray(functools.reduce(np.maximum, parts))                 # the iteration time
        idle = sum(wj * (H - p) for wj, p in zip(w, parts)) / (w.sum() * H)
        fits = H <= budget + 1e-9
        if fits.any():
            best = min(best, float(np.asarray(idle)[fits].min()))
    return best


def test_exhaustive_search_is_the_loop_over_every_vector():
    """The vectorised yardstick equals the plain loop over ``itertools.product`` with the module's
    ``idle_fraction`` on small cases."""
    for times, gpus, g_max in (([10.0], [3], 2), ([7.0, 3.0], [1, 2], 3), ([5.0, 2.5, 4.0], [2, 1, 4], 2),
                               ([1.5, 9.0, 4.0, 2.0], [1, 8, 3, 2], 2)):
        budget = g_max * max(times)
        loop = min(idle_fraction(times, g, gpus)
                   for g in itertools.product(*[range(1, _most(budget, t) + 1) for t in times])
                   if max(gi * t for gi, t in zip(g, times)) <= budget + 1e-9)
        assert _exhaustive_best_idle(times, gpus, budget) == pytest.approx(loop, abs=1e-12)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(1.0, 50.0), min_size=1, max_size=4), st.integers(1, 4),
       st.lists(st.integers(1, 8), min_size=4, max_size=4))
@example([1.0, 1.999999999999993], 1, [1, 1, 1, 1])     # two 1 ms steps fit 2 - 7e-15 ms within the slack
@example([3.0, 11.0159], 3, [1, 1, 1, 1])                # 3 x 11.0159 // 11.0159 is 2.0 in floats
def test_inter_matches_exhaustive_search(times, g_max, gpus):
    gpus = gpus[:len(times)]
    plan = data_centric_accumulation(times, gpus, g_max=g_max)
    budget = g_max * max(times)
    best = _exhaustive_best_idle(times, gpus, budget)
    assert plan.idle_fraction == pytest.approx(best, abs=1e-9)
    assert plan.iteration_ms <= budget + 1e-9
    assert all(g >= 1 for g in plan.accumulation)


def test_inter_balances_short_batches_with_more_steps():
    plan = data_centric_accumulation([10.0, 5.0, 2.5], g_max=1)
    assert plan.accumulation == (1, 2, 4) and plan.idle_fraction == 0.0
    # G_min scales every count when all are below it.
    plan = data_centric_accumulation([10.0, 10.0], g_min=3)
    assert plan.accumulation == (3, 3)


def test_intra_picks_least_recomputation_and_best_throughput():
    GiB = 2**30
    cands = {
        (1, 4): IntraCandidate(t_f=2.0, m=1 * GiB, time_ms=300.0, mem_bytes=60 * GiB),
        (1, 8): IntraCandidate(t_f=1.0, m=0.5 * GiB, time_ms=170.0, mem_bytes=50 * GiB),
    }
    ch = data_centric_recomputation(cands, 80 * GiB, layers=32, seq_len=32768)
    # (1,4): 20 layers stash (r=12): 300-40=260 ms -> 32768/(4*260); (1,8): 30 layers stash
    # -> 32 layers fit? spare 30 GiB / 0.5 = 60 >= 32 -> r=0, 170-32=138 ms -> 32768/(8*138).
    thr4, thr8 = 32768 / (4 * 260.0), 32768 / (8 * 138.0)
    assert (ch.batch, ch.sp) == ((1, 4) if thr4 > thr8 else (1, 8))
    assert ch.recompute_layers == (12 if thr4 > thr8 else 0)
    assert ch.throughput == pytest.approx(max(thr4, thr8))


def test_intra_rejects_when_nothing_fits():
    with pytest.raises(HGraphError, match="fits"):
        data_centric_recomputation({(1, 1): IntraCandidate(1.0, 1.0, 10.0, 100.0)}, 50.0, 4, 10)
    with pytest.raises(HGraphError):
        data_centric_accumulation([])
