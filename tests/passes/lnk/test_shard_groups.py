"""Plans of hierarchical sharding (``passes/lnk/shard_groups``), without processes.

The optimizer shards over groups of G consecutive ranks: a group's pull and push ops stay inside it,
are today's plans over its members (byte-minimal within the group), and the push's per-group sums,
added across the groups, give every owner the sum of the whole world's contributions. G = world is
today's plan exactly.
"""
from collections import defaultdict

import numpy as np
import pytest
from hypothesis import given, strategies as st
from tests.passes.lnk.test_lnk_plans import (FAST, check_rank_order, expected_sums, full_tensor, master_shards,
                                             random_grads, rows, strategies_and_params)

from hgraph.comm_plan import ParamLayout, ReduceScatter, Transfer
from hgraph.passes.lnk.mutual_slices import propagation_contributions, propagation_needs
from hgraph.passes.lnk.plans import min_pull_bytes, pull_plan, push_plan, simulate_pull, simulate_push
from hgraph.passes.lnk.shard_groups import shard_group_pull_plan, shard_group_push_plan
from hgraph.shard_rule import PlanError, group_shard_bounds, shard_group_ranks
from hgraph.strategy import Cluster, Strategy


def _divisors(n):
    return [g for g in range(1, n + 1) if n % g == 0]


def _local(layout, g, size):
    return {r - g * size: v for r, v in layout.items() if r // size == g}


def _ops_ranks(op):
    if isinstance(op, Transfer):
        return {op.src, op.dst}
    if isinstance(op, ReduceScatter):
        return set(op.group)
    return {op.rank}


@FAST
@given(case=strategies_and_params(), pick=st.integers(0, 10))
def test_group_pulls_stay_in_the_group_are_byte_minimal_there_and_reassemble_exactly(case, pick):
    strategy, gpn, kind, units, param, stage_of = case
    world = strategy.num_ranks
    size = _divisors(world)[pick % len(_divisors(world))]
    needs = propagation_needs(strategy, param.size, stage_of=stage_of, tp_sharded=kind != "replicated", units=units)
    plan = shard_group_pull_plan(param, needs, world, gpn, size, working_dtype_bytes=2)
    assert plan.group_size == size
    full = full_tensor(param)
    for rank in range(world):
        for op in plan.for_rank(rank):
            assert _ops_ranks(op) <= set(shard_group_ranks(rank, size))
    for t in plan.transfers:          # from the owner of the rows in the group layout
        assert all(group_shard_bounds(param.size, t.src, size)[0] <= x <= group_shard_bounds(param.size, t.src, size)[1]
                   for x in (t.lo, t.hi))
    for g in range(world // size):
        local_needs = _local(needs, g, size)
        local = pull_plan(param, local_needs, size, gpn, working_dtype_bytes=2)
        got = simulate_pull(local, master_shards(param, full, size))
        for rank, ranges in local_needs.items():
            for (lo, hi), array in zip(ranges, got[rank]):
                np.testing.assert_array_equal(array, rows(full, lo, hi, param.shard_dim))
        # each member receives exactly the rows it needs that it does not own: the group's minimum
        minimum = {r + g * size: b for r, b in min_pull_bytes(param, local_needs, size, working_dtype_bytes=2).items()}
        recv = plan.recv_bytes()
        assert {r: recv.get(r, 0) for r in minimum} == minimum
        assert [(t.src - g * size, t.dst - g * size, t.lo, t.hi) for t in plan.transfers if t.src // size == g] == \
            [(t.src, t.dst, t.lo, t.hi) for t in local.transfers]
    check_rank_order(plan, world)
    every_rank_whole = (all(p.pp == 1 for p in strategy.pipelines)
                        and (kind == "replicated" or units == 1 or all(p.tp == 1 for p in strategy.pipelines)))
    assert plan.is_all_gather == every_rank_whole


@FAST
@given(case=strategies_and_params(), pick=st.integers(0, 10))
def test_group_pushes_summed_across_groups_give_every_owner_the_world_sum(case, pick):
    strategy, gpn, kind, units, param, stage_of = case
    world = strategy.num_ranks
    size = _divisors(world)[pick % len(_divisors(world))]
    contrib = propagation_contributions(strategy, param.size, stage_of=stage_of, tp_sharded=kind != "replicated",
                                        units=units)
    by_layout = defaultdict(list)
    for r, rs in contrib.items():
        by_layout[tuple(x for x in rs if x[0] < x[1])].append(r)
    groups = [g for key, g in by_layout.items() if key and len(g) > 1]
    plan = shard_group_push_plan(param, contrib, world, gpn, size, groups)
    for rank in range(world):
        for op in plan.for_rank(rank):
            assert _ops_ranks(op) <= set(shard_group_ranks(rank, size))
    check_rank_order(plan, world)
    grads = random_grads(param, contrib)
    want = expected_sums(param, contrib, grads, size)       # the world's sum on each shard of a group
    summed = {}
    for g in range(world // size):
        local_contrib = _local(contrib, g, size)
        if not any(lo < hi for rs in local_contrib.values() for lo, hi in rs):
            continue                  # a group without gradient rows: its owners add zeros
        local_groups = [tuple(r - g * size for r in grp if r // size == g) for grp in groups]
        local = push_plan(param, local_contrib, size, gpn, [x for x in local_groups if x], cover=False)
        got = simulate_push(local, _local(grads, g, size))
        for owner, array in got.items():
            summed[owner] = summed.get(owner, 0) + array
    assert summed.keys() == want.keys()
    for owner in want:
        np.testing.assert_array_equal(summed[owner], want[owner])


def test_shard_group_of_the_world_is_todays_plan_exactly():
    strategy = Strategy.parse("1xTP2PP2+1xTP2PP1+2xTP1PP1")
    world = strategy.num_ranks
    param = ParamLayout("w", (13, 3), 0)
    stage_of = lambda i, p: 0  # noqa: E731
    needs = propagation_needs(strategy, param.size, stage_of=stage_of, tp_sharded=True)
    contrib = propagation_contributions(strategy, param.size, stage_of=stage_of, tp_sharded=True)
    for g in (None, world):
        assert shard_group_pull_plan(param, needs, world, 4, g) == pull_plan(param, needs, world, 4)
        assert shard_group_push_plan(param, contrib, world, 4, g) == push_plan(param, contrib, world, 4)
    assert Cluster(world, 4, shard_group=world).shard_group is None


def test_plain_data_parallel_in_groups_gathers_and_reduce_scatters_inside_each_group():
    param = ParamLayout("w", (10, 2), 0)
    world, size = 8, 4
    whole = {r: [(0, 10)] for r in range(world)}
    pull = shard_group_pull_plan(param, whole, world, 8, size)
    push = shard_group_push_plan(param, whole, world, 8, size, [tuple(range(world))])
    assert pull.is_all_gather and all(t.src // size == t.dst // size for t in pull.transfers)
    assert pull.all_gather_group(5) == (4, 5, 6, 7) and pull.all_gather_segments == ((0, 2), (2, 5), (5, 7), (7, 10))
    assert push.is_plain_reduce_scatter and push.transfers == ()
    assert [rs.group for rs in push.reduce_scatters] == [(0, 1, 2, 3), (4, 5, 6, 7)]


def test_only_the_asked_groups_are_planned():
    strategy = Strategy.parse("4xTP2PP1")
    param = ParamLayout("w", (16, 4), 0)
    needs = propagation_needs(strategy, param.size, stage_of=lambda i, p: 0, tp_sharded=True)
    one = shard_group_pull_plan(param, needs, 8, 8, 4, groups=[1])
    every = shard_group_pull_plan(param, needs, 8, 8, 4)
    assert set(one.needs) == {4, 5, 6, 7}
    assert all(one.for_rank(r) == every.for_rank(r) for r in range(4, 8))


@pytest.mark.parametrize("g, match", [(3, "does not divide"), (0, "positive integer"), (True, "positive integer")])
def test_a_bad_shard_group_is_one_plan_error(g, match):
    with pytest.raises(PlanError, match=match):
        shard_group_pull_plan(ParamLayout("w", (4,), 0), {0: [(0, 4)]}, 8, 8, g)
