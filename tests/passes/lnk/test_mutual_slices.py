import math

import pytest
from hypothesis import given, settings, strategies as st

from hgraph.comm_plan import merge_ranges
from hgraph.passes.lnk.mutual_slices import (coarsest_count, lcm_granularity, lcm_slices, mutual_slices,
                                             propagation_contributions, propagation_needs, pull_granularity,
                                             push_granularity, tp_range)
from hgraph.shard_rule import PlanError, even_segments, optimizer_segments, segment_owner
from hgraph.strategy import Scheme, Strategy

FAST = settings(max_examples=60, deadline=None)


# ---- optimizer layout ----------------------------------------------------------------------------

def test_optimizer_segments_hand_cases():
    assert optimizer_segments(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert optimizer_segments(10, 4) == [(0, 2), (2, 5), (5, 7), (7, 10)]
    assert optimizer_segments(2, 4) == [(0, 0), (0, 1), (1, 1), (1, 2)]      # fewer rows than ranks
    assert optimizer_segments(0, 3) == [(0, 0)] * 3


@FAST
@given(size=st.integers(0, 200), world=st.integers(1, 33))
def test_optimizer_segments_tile_evenly_and_owner_agrees(size, world):
    segs = optimizer_segments(size, world)
    assert len(segs) == world and segs[0][0] == 0 and segs[-1][1] == size
    assert all(a[1] == b[0] for a, b in zip(segs, segs[1:]))
    lengths = [hi - lo for lo, hi in segs]
    assert max(lengths) - min(lengths) <= 1
    for rank, (lo, hi) in enumerate(segs):
        assert (lo, hi) == (rank * size // world, (rank + 1) * size // world)
        for row in range(lo, hi):
            assert segment_owner(size, world, row) == rank


@pytest.mark.parametrize("call, match", [
    (lambda: even_segments(5, 0), "positive integer"),
    (lambda: even_segments(-1, 2), "non-negative"),
    (lambda: segment_owner(4, 2, 4), "outside the shard dimension"),
    (lambda: mutual_slices([(3, 1)]), "invalid"),
    (lambda: mutual_slices([(0, 1.5)]), "integer"),
    (lambda: mutual_slices([(0,)]), "pair"),
    (lambda: lcm_granularity(4, 0), "positive"),
])
def test_bad_input_is_one_clear_error(call, match):
    with pytest.raises(PlanError, match=match):
        call()


# ---- refinement ----------------------------------------------------------------------------------

ranges_st = st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)).map(lambda t: (min(t), max(t))),
                     min_size=0, max_size=5)


@FAST
@given(layouts=st.lists(ranges_st, min_size=1, max_size=4))
def test_mutual_slices_is_the_coarsest_common_refinement(layouts):
    slices = mutual_slices(*layouts)
    ranges = [r for layout in layouts for r in layout if r[0] < r[1]]
    # sorted, disjoint, non-empty, and exactly covering the union of the ranges
    assert all(lo < hi for lo, hi in slices)
    assert all(a[1] <= b[0] for a, b in zip(slices, slices[1:]))
    assert merge_ranges(slices) == merge_ranges(ranges)
    # every slice is wholly inside or wholly outside every range
    for lo, hi in slices:
        for a, b in ranges:
            assert hi <= a or b <= lo or (a <= lo and hi <= b)
    # coarsest: every cut between touching slices is a boundary of some range
    bounds = {p for r in ranges for p in r}
    assert all(a[1] in bounds for a, b in zip(slices, slices[1:]) if a[1] == b[0])


def test_fig7_granularities_and_the_coarsest_refinement():
    # Fig. 7: optimizer states in 4 segments, gradients after the reduce-scatter in 6 -> 12 mutual slices.
    assert lcm_granularity(4, 6) == 12
    assert push_granularity(4, 3, 2) == 12          # N=4, D=3 pipelines of TP_max=2 -> 6 gradient pieces
    for size in (24, 25, 37):                      # also sizes the 12-way grid does not divide
        grid = lcm_slices(size, 4, 6)
        assert len(grid) == 12
        # the uniform LCM grid refines both layouts, even with floor boundaries
        assert mutual_slices(grid, even_segments(size, 4), even_segments(size, 6)) == grid
    # the coarsest refinement needs only 4 + 6 - gcd(4, 6) = 8 slices; each is a union of LCM slices
    coarse = mutual_slices(even_segments(24, 4), even_segments(24, 6))
    assert len(coarse) == coarsest_count(4, 6) == 8
    grid = lcm_slices(24, 4, 6)
    assert all(any(g[0] == lo for g in grid) and any(g[1] == hi for g in grid) for lo, hi in coarse)


@pytest.mark.parametrize("world, tp_max, lcm, coarse", [
    (8, 4, 8, 8),        # TP divides N: the optimizer layout already refines TP
    (4, 8, 8, 8),
    (6, 4, 12, 8),       # LCM grid of 12 vs coarsest 6 + 4 - 2
    (16, 8, 16, 16),
])
def test_pull_granularity_against_coarsest(world, tp_max, lcm, coarse):
    assert pull_granularity(world, tp_max) == lcm
    size = 3 * lcm
    assert len(mutual_slices(optimizer_segments(size, world), even_segments(size, tp_max))) == coarse


@FAST
@given(a=st.integers(1, 12), b=st.integers(1, 12), mult=st.integers(1, 3), extra=st.integers(0, 30))
def test_even_layouts_refinement_counts(a, b, mult, extra):
    size = mult * math.lcm(a, b)
    assert len(mutual_slices(even_segments(size, a), even_segments(size, b))) == coarsest_count(a, b)
    any_size = size + extra
    grid = even_segments(any_size, math.lcm(a, b))
    grid = [g for g in grid if g[0] < g[1]]
    assert mutual_slices(grid, even_segments(any_size, a), even_segments(any_size, b)) == grid


# ---- propagation layouts of strategies -----------------------------------------------------------

def test_propagation_needs_tp_sharded_heterogeneous():
    s = Strategy.parse("2xTP2PP1+1xTP4PP1")
    needs = propagation_needs(s, 16)
    assert needs == {0: [(0, 8)], 1: [(8, 16)], 2: [(0, 8)], 3: [(8, 16)],
                     4: [(0, 4)], 5: [(4, 8)], 6: [(8, 12)], 7: [(12, 16)]}


def test_propagation_needs_stage_replicated_and_cp():
    s = Strategy.parse("1xTP2PP2+1xTP1PP1CP2")
    needs = propagation_needs(s, 10, stage_of=lambda i, p: p.pp - 1, tp_sharded=False)
    # pipeline 0: ranks 0,1 = stage 0, ranks 2,3 = stage 1; pipeline 1: ranks 4,5 = CP ranks of stage 0
    assert needs == {2: [(0, 10)], 3: [(0, 10)], 4: [(0, 10)], 5: [(0, 10)]}
    sharded = propagation_needs(s, 10, stage_of=lambda i, p: 0)
    assert sharded == {0: [(0, 5)], 1: [(5, 10)], 4: [(0, 10)], 5: [(0, 10)]}


def test_gqa_units_duplicate_needs():
    assert [tp_range(16, 4, t, units=2) for t in range(4)] == [(0, 8), (0, 8), (8, 16), (8, 16)]
    assert [tp_range(16, 2, t, units=4) for t in range(2)] == [(0, 8), (8, 16)]
    with pytest.raises(PlanError, match="equal units"):
        tp_range(10, 2, 0, units=4)
    with pytest.raises(PlanError, match="divide"):
        tp_range(12, 4, 0, units=6)


def test_contributions_split_replicated_parameters_among_tp_ranks():
    s = Strategy.parse("1xTP2PP1CP2+1xTP1PP1")
    contrib = propagation_contributions(s, 9, tp_sharded=False)
    # ranks 0,1 (CP 0) and 2,3 (CP 1) split the rows; the TP1 pipeline pushes everything
    assert contrib == {0: [(0, 4)], 1: [(4, 9)], 2: [(0, 4)], 3: [(4, 9)], 4: [(0, 9)]}
    with pytest.raises(PlanError, match="outside its 1 PP stages"):
        propagation_needs(s, 9, stage_of=1)


def test_needs_never_ask_for_rows_beyond_the_dimension():
    s = Strategy.homogeneous(1, Scheme(4, 1))
    needs = propagation_needs(s, 3)             # fewer rows than TP ranks: some ranges are empty
    assert [r for rs in needs.values() for r in rs] == [(0, 0), (0, 1), (1, 2), (2, 3)]
