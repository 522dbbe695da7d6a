import itertools
import json
from collections import defaultdict

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from hgraph.errors import StrategyError
from hgraph.comm_plan import LocalAdd, LocalCopy, ParamLayout, ReduceScatter, Transfer
from hgraph.passes.lnk.assignment import LinkWeights
from hgraph.passes.lnk.mutual_slices import propagation_contributions, propagation_needs
from hgraph.passes.lnk.plans import (min_pull_bytes, min_push_bytes, pull_plan, push_plan, replica_groups_from,
                                     simulate_pull, simulate_push)
from hgraph.shard_rule import PlanError, optimizer_segments, segment_owner
from hgraph.strategy import Cluster, Scheme, Strategy

FAST = settings(max_examples=100, deadline=None)


# ---- helpers used by the checks -----------------------------------------------------------------

def full_tensor(param, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(-1000, 1000, size=param.shape)


def rows(array, lo, hi, dim):
    index = [slice(None)] * array.ndim
    index[dim] = slice(lo, hi)
    return array[tuple(index)]


def master_shards(param, full, world):
    return {r: rows(full, lo, hi, param.shard_dim) for r, (lo, hi) in enumerate(optimizer_segments(param.size, world))}


def check_pull(param, needs, world, gpn, wbytes=4):
    plan = pull_plan(param, needs, world, gpn, working_dtype_bytes=wbytes)
    full = full_tensor(param)
    got = simulate_pull(plan, master_shards(param, full, world))
    for rank, ranges in needs.items():
        assert len(got[rank]) == len(ranges)
        for (lo, hi), array in zip(ranges, got[rank]):
            np.testing.assert_array_equal(array, rows(full, lo, hi, param.shard_dim))
    # each rank receives exactly the rows it needs and does not own: the minimum
    minimum = {r: b for r, b in min_pull_bytes(param, needs, world, working_dtype_bytes=wbytes).items() if b}
    assert plan.recv_bytes() == minimum
    # a local copy is always the rank's own rows, a transfer always comes from the owner
    for c in plan.local_copies:
        assert segment_owner(param.size, world, c.lo) == c.rank == segment_owner(param.size, world, c.hi - 1)
    for t in plan.transfers:
        assert segment_owner(param.size, world, t.lo) == t.src == segment_owner(param.size, world, t.hi - 1)
        assert t.src != t.dst and t.bytes == (t.hi - t.lo) * param.row_elements * wbytes
    check_rank_order(plan, world)
    return plan


def expected_sums(param, contributions, grads, world):
    total = np.zeros(param.shape, dtype=np.int64)
    for rank, ranges in contributions.items():
        for (lo, hi), g in zip(ranges, grads[rank]):
            rows(total, lo, hi, param.shard_dim)[...] += g
    return {r: rows(total, lo, hi, param.shard_dim)
            for r, (lo, hi) in enumerate(optimizer_segments(param.size, world)) if lo < hi}


def random_grads(param, contributions, seed=1):
    rng = np.random.default_rng(seed)
    out = {}
    for rank, ranges in contributions.items():
        out[rank] = []
        for lo, hi in ranges:
            shape = list(param.shape)
            shape[param.shard_dim] = hi - lo
            out[rank].append(rng.integers(-1000, 1000, size=shape))
    return out


def check_push(param, contributions, world, gpn, groups=None):
    plan = push_plan(param, contributions, world, gpn, groups)
    grads = random_grads(param, contributions)
    got = simulate_push(plan, grads)
    want = expected_sums(param, contributions, grads, world)
    assert got.keys() == want.keys()
    for owner in want:
        np.testing.assert_array_equal(got[owner], want[owner])
    for rs in plan.reduce_scatters:
        assert sorted(m for m, _, _ in rs.pieces) == list(rs.group)
        pieces = sorted((lo, hi) for _, lo, hi in rs.pieces)
        assert pieces[0][0] == rs.lo and pieces[-1][1] == rs.hi
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))      # the pieces tile the range
    for t in plan.transfers:
        assert segment_owner(param.size, world, t.lo) == t.dst == segment_owner(param.size, world, t.hi - 1)
    # the minimum is a lower bound on all an owner receives, through the reduce-scatters and the LNK
    minimum = min_push_bytes(param, contributions, world)
    lnk, rs = plan.recv_bytes(), plan.reduce_scatter_recv_bytes()
    for owner, nbytes in minimum.items():
        assert lnk.get(owner, 0) + rs.get(owner, 0) >= nbytes
    check_rank_order(plan, world)
    return plan


def check_rank_order(plan, world):
    """Every transfer appears on both of its ranks in the same relative order, and issuing each rank's
    ops in order with blocking sends/receives and collectives finishes (no deadlock)."""
    queues = {r: list(plan.for_rank(r)) for r in range(world)}
    for t in plan.transfers:
        assert t in queues[t.src] and t in queues[t.dst]
    for a, b in itertools.combinations(range(world), 2):
        shared_a = [op for op in queues[a] if isinstance(op, Transfer) and {op.src, op.dst} == {a, b}]
        shared_b = [op for op in queues[b] if isinstance(op, Transfer) and {op.src, op.dst} == {a, b}]
        assert shared_a == shared_b
    heads = {r: 0 for r in range(world)}
    progress = True
    while progress:
        progress = False
        for r in range(world):
            if heads[r] == len(queues[r]):
                continue
            op = queues[r][heads[r]]
            if isinstance(op, (LocalCopy, LocalAdd)):
                heads[r] += 1
                progress = True
            elif isinstance(op, Transfer):
                peer = op.dst if op.src == r else op.src
                if heads[peer] < len(queues[peer]) and queues[peer][heads[peer]] == op:
                    heads[r] += 1
                    heads[peer] += 1
                    progress = True
            else:
                if all(heads[m] < len(queues[m]) and queues[m][heads[m]] == op for m in op.group):
                    for m in op.group:
                        heads[m] += 1
                    progress = True
    assert all(heads[r] == len(queues[r]) for r in range(world)), "ops deadlock when issued in for_rank order"


# ---- random strategies ---------------------------------------------------------------------------

@st.composite
def strategies_and_params(draw):
    schemes = draw(st.lists(st.builds(Scheme, st.sampled_from([1, 2, 4]), st.sampled_from([1, 2]),
                                      st.sampled_from([1, 1, 2])), min_size=1, max_size=4))
    while sum(p.num_ranks for p in schemes) > 16:
        schemes.pop()
    strategy = Strategy(tuple(schemes))
    world = strategy.num_ranks
    gpns = [g for g in (1, 2, 4, 8, 16) if _valid(strategy, world, g)]
    gpn = draw(st.sampled_from(gpns))
    kind = draw(st.sampled_from(["sharded", "replicated", "gqa"]))
    units = draw(st.sampled_from([1, 2])) if kind == "gqa" else None
    size = draw(st.integers(1, 40))
    if units:
        size = units * draw(st.integers(1, 12))
    other = draw(st.integers(1, 3))
    shard_dim = draw(st.sampled_from([0, 1]))
    shape = (size, other) if shard_dim == 0 else (other, size)
    fractions = draw(st.lists(st.floats(0, 0.999), min_size=len(schemes), max_size=len(schemes)))
    stage_of = lambda i, p: int(fractions[i] * p.pp)  # noqa: E731
    return strategy, gpn, kind, units, ParamLayout("w", shape, shard_dim), stage_of


def _valid(strategy, world, gpn):
    try:
        strategy.validate(Cluster(world, gpn))
        return True
    except StrategyError:
        return False


@FAST
@given(case=strategies_and_params())
def test_random_strategies_pull_reassembles_exactly(case):
    strategy, gpn, kind, units, param, stage_of = case
    needs = propagation_needs(strategy, param.size, stage_of=stage_of, tp_sharded=kind != "replicated",
                              units=units)
    plan = check_pull(param, needs, strategy.num_ranks, gpn, wbytes=2)
    every_rank_whole = (all(p.pp == 1 for p in strategy.pipelines)
                        and (kind == "replicated" or units == 1 or all(p.tp == 1 for p in strategy.pipelines)))
    assert plan.is_all_gather == every_rank_whole
    assert pull_plan(param, needs, strategy.num_ranks, gpn, working_dtype_bytes=2) == plan   # deterministic


@FAST
@given(case=strategies_and_params(), infer_groups=st.booleans())
def test_random_strategies_push_sums_exactly(case, infer_groups):
    strategy, gpn, kind, units, param, stage_of = case
    contrib = propagation_contributions(strategy, param.size, stage_of=stage_of,
                                        tp_sharded=kind != "replicated", units=units)
    if infer_groups:
        groups = None
    else:       # the integrator's way: the same (stage, TP rank, CP rank) layout across pipelines
        by_layout = defaultdict(list)
        for r, rs in contrib.items():
            by_layout[tuple(x for x in rs if x[0] < x[1])].append(r)
        groups = [g for key, g in by_layout.items() if key and len(g) > 1]
    plan = check_push(param, contrib, strategy.num_ranks, gpn, groups)
    world = strategy.num_ranks
    all_full = (all(p.pp == 1 for p in strategy.pipelines)
                and (all(p.tp == 1 for p in strategy.pipelines) or (kind == "gqa" and units == 1)))
    assert plan.is_plain_reduce_scatter == all_full
    if plan.is_plain_reduce_scatter and world > 1:
        (rs,) = plan.reduce_scatters
        assert rs.pieces == tuple((r, lo, hi) for r, (lo, hi) in enumerate(optimizer_segments(param.size, world)))
        assert plan.transfers == ()


# ---- hand cases: degenerate layouts --------------------------------------------------------------

def test_pure_data_parallel_is_all_gather_and_plain_reduce_scatter():
    param = ParamLayout("w", (10, 4), 0)
    s = Strategy.parse("DP4TP1PP1")
    pull = check_pull(param, propagation_needs(s, 10), 4, 8)
    assert pull.is_all_gather and pull.all_gather_ranks == (0, 1, 2, 3)
    assert pull.all_gather_segments == ((0, 2), (2, 5), (5, 7), (7, 10))
    push = check_push(param, propagation_contributions(s, 10), 4, 8)
    assert push.is_plain_reduce_scatter
    assert push.reduce_scatters == (ReduceScatter((0, 1, 2, 3), 0, 10,
                                                  ((0, 0, 2), (1, 2, 5), (2, 5, 7), (3, 7, 10)), 160),)
    assert push.transfers == () and push.total_bytes == 0
    # ring over chunks padded to the largest piece (3 rows x 4 columns x 4 bytes): 3 steps of 48 bytes
    assert push.reduce_scatter_recv_bytes() == {0: 144, 1: 144, 2: 144, 3: 144}
    as_json = json.loads(json.dumps(push.to_dict()))
    assert as_json["kind"] == "plain_reduce_scatter" and as_json["reduce_scatters"][0]["pieces"][1] == [1, 2, 5]
    assert push.local_adds == tuple(LocalAdd(r, lo, hi) for r, (lo, hi) in enumerate(optimizer_segments(10, 4)))


def test_layouts_that_disagree_are_not_degenerate():
    param = ParamLayout("w", (8, 2), 0)
    s = Strategy.parse("2xTP2PP1")
    assert not check_pull(param, propagation_needs(s, 8), 4, 4).is_all_gather
    assert not check_push(param, propagation_contributions(s, 8), 4, 4).is_plain_reduce_scatter
    # replicated pull on PP1 is an all-gather even with TP, a PP2 stage is not
    assert check_pull(param, propagation_needs(s, 8, tp_sharded=False), 4, 4).is_all_gather
    s2 = Strategy.parse("1xTP2PP2")
    assert not check_pull(param, propagation_needs(s2, 8, tp_sharded=False), 4, 4).is_all_gather
    # data parallel without declared replicas: correct, but every rank sends its rows itself
    dp = {r: [(0, 8)] for r in range(4)}
    alone = check_push(param, dp, 4, 4, groups=[])
    assert not alone.is_plain_reduce_scatter and alone.reduce_scatters == () and len(alone.transfers) == 12
    # a single rank: nothing to move, still the degenerate forms
    assert check_pull(param, {0: [(0, 8)]}, 1, 1).is_all_gather
    assert check_push(param, {0: [(0, 8)]}, 1, 1).is_plain_reduce_scatter


def test_tp2_pull_exact_ops():
    param = ParamLayout("w", (8, 3), 0)
    plan = check_pull(param, propagation_needs(Strategy.parse("2xTP2PP1"), 8), 4, 2, wbytes=2)
    assert plan.local_copies == (LocalCopy(0, 0, 2), LocalCopy(3, 6, 8))
    assert plan.transfers == (Transfer(0, 2, 0, 2, 12), Transfer(1, 0, 2, 4, 12), Transfer(1, 2, 2, 4, 12),
                              Transfer(2, 1, 4, 6, 12), Transfer(2, 3, 4, 6, 12), Transfer(3, 1, 6, 8, 12))
    assert plan.assembly[0] == (((0, 2), (2, 4)),)
    assert plan.intra_node_bytes == 24 and plan.inter_node_bytes == 48
    assert plan.for_rank(1) == (Transfer(1, 0, 2, 4, 12), Transfer(1, 2, 2, 4, 12), Transfer(2, 1, 4, 6, 12),
                                Transfer(3, 1, 6, 8, 12))
    as_json = json.loads(json.dumps(plan.to_dict()))
    assert as_json["transfers"][0] == [0, 2, 0, 2, 12] and as_json["kind"] == "lnk"
    assert as_json["bytes"] == plan.total_bytes == 72


def test_uneven_heterogeneous_pull_and_push_on_columns():
    # a row-parallel weight sharded on dim 1, 10 columns over 6 ranks, TP2 beside TP4
    param = ParamLayout("o_proj", (3, 10), 1)
    s = Strategy.parse("1xTP2PP1+1xTP4PP1")
    check_pull(param, propagation_needs(s, 10), 6, 2)
    check_push(param, propagation_contributions(s, 10), 6, 2)


def test_gqa_duplicated_needs_and_partial_gradients():
    param = ParamLayout("k_proj", (16, 4), 0)
    s = Strategy.parse("2xTP4PP1")
    needs = propagation_needs(s, 16, units=2)
    assert needs[0] == needs[1] == [(0, 8)]
    plan = check_pull(param, needs, 8, 4)
    # ranks 0 and 1 both need rows 0..7 (owned by ranks 0-3): each gets its own copy of every piece
    assert sorted(t.src for t in plan.transfers if t.dst == 1) == [0, 2, 3]
    assert sorted(t.src for t in plan.transfers if t.dst == 0) == [1, 2, 3]
    contrib = propagation_contributions(s, 16, units=2)
    push = check_push(param, contrib, 8, 4)
    assert replica_groups_from(contrib) == [(0, 1, 4, 5), (2, 3, 6, 7)]
    assert {rs.group for rs in push.reduce_scatters} == {(0, 1, 4, 5), (2, 3, 6, 7)}


def test_overlapping_needs_of_one_rank_are_fetched_once():
    param = ParamLayout("w", (12,), 0)
    plan = check_pull(param, {0: [(2, 9), (6, 12)], 1: [(0, 3)]}, 3, 1)
    assert sum(t.hi - t.lo for t in plan.transfers if t.dst == 0) == 8      # rows 4..12 once


def test_coalesce_off_gives_one_op_per_mutual_slice():
    param = ParamLayout("w", (12, 2), 0)
    needs = {0: [(0, 12)], 1: [(0, 6)], 2: [(3, 12)]}
    merged = pull_plan(param, needs, 3, 1)
    split = pull_plan(param, needs, 3, 1, coalesce=False)
    assert merged.total_bytes == split.total_bytes and merged.slices == split.slices
    assert len(split.transfers) > len(merged.transfers)
    for t in split.transfers:
        assert (t.lo, t.hi) in split.slices
    full = full_tensor(param)
    got = simulate_pull(split, master_shards(param, full, 3))
    np.testing.assert_array_equal(got[2][0], full[3:12])


def test_scalar_parameter():
    param = ParamLayout("scale", (), 0)
    assert param.size == 1 and param.row_elements == 1
    plan = pull_plan(param, {r: [(0, 1)] for r in range(3)}, 3, 8)
    assert plan.is_all_gather and plan.all_gather_segments == ((0, 0), (0, 0), (0, 1))


# ---- sender choice -------------------------------------------------------------------------------

def test_member_that_owns_a_piece_keeps_it():
    # 2xTP4PP1 on 8 ranks, 4 per node: the TP-rank-0 replicas (0, 4) reduce rows owned by ranks 0 and 1
    param = ParamLayout("w", (16, 2), 0)
    s = Strategy.parse("2xTP4PP1")
    plan = check_push(param, propagation_contributions(s, 16), 8, 4)
    rs0 = next(rs for rs in plan.reduce_scatters if rs.group == (0, 4))
    assert rs0.pieces == ((0, 0, 2), (4, 2, 4))
    assert LocalAdd(0, 0, 2) in plan.local_adds


def test_intra_node_receiver_is_preferred():
    # 8 ranks, 4 per node, 8 rows: rank r owns row r. Replicas 1 (node 0) and 5 (node 1) hold rows 3..4;
    # row 3 belongs to rank 3 (node 0), row 4 to rank 4 (node 1): each piece should stay on its node.
    param = ParamLayout("w", (8, 2), 0)
    contrib = {0: [(0, 3)], 1: [(3, 5)], 5: [(3, 5)], 2: [(5, 8)]}
    plan = check_push(param, contrib, 8, 4, groups=[(1, 5)])
    assert plan.reduce_scatters[0].pieces == ((1, 3, 4), (5, 4, 5))
    assert Transfer(1, 3, 3, 4, 8) in plan.transfers and Transfer(5, 4, 4, 5, 8) in plan.transfers
    replicas = [t for t in plan.transfers if t.src in (1, 5)]
    assert all(plan.is_intra_node(t) for t in replicas)
    # with the group listed the other way round the answer is the same
    assert push_plan(param, contrib, 8, 4, [(5, 1)]).reduce_scatters == plan.reduce_scatters


def test_bytes_per_sender_are_balanced_across_reduce_scatters():
    # 6 ranks each on its own node, 12 rows (2 per rank); replicas 0 and 1 hold rows 4..7 and 8..11,
    # each split 1 + 2 rows owned by others: the 2-row pieces should go to different members.
    param = ParamLayout("w", (12,), 0)
    contrib = {0: [(4, 7), (8, 11)], 1: [(4, 7), (8, 11)], 2: [(0, 4), (7, 8), (11, 12)]}
    plan = check_push(param, contrib, 6, 1, groups=[(0, 1)])
    sent = plan.send_bytes()
    assert sent[0] == sent[1] == 3 * 4


@FAST
@given(case=strategies_and_params(), inter=st.integers(1, 16))
def test_sender_choice_is_optimal_per_reduce_scatter(case, inter):
    strategy, gpn, kind, units, param, stage_of = case
    contrib = propagation_contributions(strategy, param.size, stage_of=stage_of,
                                        tp_sharded=kind != "replicated", units=units)
    weights = LinkWeights(1, inter)
    plan = push_plan(param, contrib, strategy.num_ranks, gpn, weights=weights)
    world = strategy.num_ranks

    def cost(member, lo, hi):
        total = 0
        for row in range(lo, hi):
            owner = segment_owner(param.size, world, row)
            if owner != member:
                total += weights.intra if owner // gpn == member // gpn else weights.inter
        return total

    for rs in plan.reduce_scatters:
        if len(rs.group) > 5:
            continue
        pieces = [(lo, hi) for _, lo, hi in sorted(rs.pieces, key=lambda p: p[1])]
        chosen = sum(cost(m, lo, hi) for m, lo, hi in rs.pieces)
        best = min(sum(cost(m, lo, hi) for m, (lo, hi) in zip(perm, pieces))
                   for perm in itertools.permutations(rs.group))
        assert chosen == best


# ---- bad input -----------------------------------------------------------------------------------

PARAM = ParamLayout("w", (8, 2), 0)


@pytest.mark.parametrize("call, match", [
    (lambda: pull_plan(PARAM, {4: [(0, 8)]}, 4, 4), "rank 4 is outside the world of 4"),
    (lambda: pull_plan(PARAM, {0: [(0, 9)]}, 4, 4), r"\(0, 9\) is invalid"),
    (lambda: pull_plan(PARAM, {0: [(0, 8)]}, 0, 4), "world_size must be a positive integer"),
    (lambda: pull_plan(PARAM, {0: [(0, 8)]}, 4, 4, working_dtype_bytes=0), "working_dtype_bytes"),
    (lambda: push_plan(PARAM, {0: [(0, 5), (4, 8)]}, 4, 4), "overlapping"),
    (lambda: push_plan(PARAM, {0: [(0, 5)], 1: [(6, 8)]}, 4, 4), "cover rows"),
    (lambda: push_plan(PARAM, {0: [(0, 8)], 1: [(0, 4)], 2: [(4, 8)]}, 4, 4, [(0, 1)]), "same layout"),
    (lambda: push_plan(PARAM, {0: [(0, 8)], 1: [(0, 8)]}, 4, 4, [(0, 1), (1,)]), "more than one"),
    (lambda: push_plan(PARAM, {0: [(0, 8)]}, 4, 4, [(0, 3)]), "rank 3 contributes no gradient"),
    (lambda: ParamLayout("w", (8, 2), 2), "shard_dim 2"),
    (lambda: ParamLayout("w", (8, -1), 0), "shape"),
])
def test_bad_input_is_one_clear_plan_error(call, match):
    with pytest.raises(PlanError, match=match):
        call()


# ---- the benchmark runs in a tiny configuration --------------------------------------------------

def test_bench_lnk_tiny(capsys):
    from hgraph.tools.bench import lnk as bench_lnk
    assert bench_lnk.main(["--model", "tiny", "--world-size", "8", "--gpus-per-node", "4",
                           "--strategy", "2xTP2PP2", "--strategy", "DP8TP1PP1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    het, dp = out["results"]
    assert het["pull_bytes"] == het["pull_min_bytes"] > 0 and het["all_gathers"] == 0
    assert dp["all_gathers"] == dp["plain_reduce_scatters"] == dp["params"] and dp["push_bytes"] == 0
    assert bench_lnk.main(["--model", "tiny", "--world-size", "6", "--strategy", "2xTP2PP1"]) == 2
