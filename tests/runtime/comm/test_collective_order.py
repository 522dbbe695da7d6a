"""The collective-order simulation: consistent sequences run to the end, an inconsistent order is a
named cycle, disagreeing members and missing operations are named."""
from __future__ import annotations

import pytest

from hgraph.runtime.comm.order.collective import Collective
from hgraph.runtime.comm.order.deadlock import first_mismatch, simulate


def ar(group, label="", shape=(4,)):
    return Collective("all_reduce", tuple(group), shape, "float32", label)


def test_consistent_order_over_two_groups_runs_to_the_end():
    g, w = (0, 1), (0, 1, 2, 3)
    seqs = {0: [ar(g), ar(w)], 1: [ar(g), ar(w)], 2: [ar((2, 3)), ar(w)], 3: [ar((2, 3)), ar(w)]}
    verdict = simulate(seqs)
    assert verdict.ok, verdict.problem
    assert verdict.collectives == 3        # two pair all-reduces and the world's, each counted once
    assert verdict.line() == "deadlock-free: 4 ranks, 3 collectives"


def test_opposite_orders_on_two_shared_groups_are_a_named_cycle():
    g, w = (0, 1), (0, 1, 2)
    seqs = {0: [ar(g, "push bucket 0"), ar(w, "loss")], 1: [ar(w, "loss"), ar(g, "push bucket 0")], 2: [ar(w, "loss")]}
    verdict = simulate(seqs)
    assert not verdict.ok
    assert verdict.problem.startswith("deadlock: ")
    assert {r for r, _, _ in verdict.waits} == {0, 1}
    assert "rank 0 waits in all_reduce on [0, 1] float32[4] (push bucket 0) at its operation 1 for rank 1" \
        in verdict.problem
    assert "rank 1 waits in all_reduce on [0, 1, 2] float32[4] (loss) at its operation 1 for rank 0" in verdict.problem


def test_three_ranks_in_a_ring_of_pair_groups():
    a, b, c = (0, 1), (1, 2), (0, 2)
    verdict = simulate({0: [ar(a), ar(c)], 1: [ar(b), ar(a)], 2: [ar(c), ar(b)]})
    assert not verdict.ok
    assert sorted(r for r, _, _ in verdict.waits) == [0, 1, 2]
    # the same operations, issued in one global order, run
    assert simulate({0: [ar(a), ar(c)], 1: [ar(a), ar(b)], 2: [ar(c), ar(b)]}).ok


def test_members_that_disagree_at_one_point_of_a_group_are_named():
    verdict = simulate({0: [ar((0, 1), shape=(4,))], 1: [ar((0, 1), shape=(8,))]})
    assert not verdict.ok
    assert verdict.problem == ("group [0, 1] disagrees: rank 0 issues all_reduce on [0, 1] float32[4] at its "
                               "operation 1, rank 1 issues all_reduce on [0, 1] float32[8] at its operation 1")
    # an uneven all-gather differs in shape per rank and agrees
    gathers = {r: [Collective("all_gather", (0, 1), (r + 1, 3), "float32")] for r in (0, 1)}
    assert simulate(gathers).ok


def test_a_rank_that_ends_early_is_named():
    verdict = simulate({0: [ar((0, 1)), ar((0, 1), "second")], 1: [ar((0, 1))]})
    assert not verdict.ok
    assert verdict.problem.endswith("for rank 1, which has finished its 1 operations")
    assert "(second) at its operation 2" in verdict.problem


def test_an_operation_outside_the_ranks_groups_is_named():
    verdict = simulate({0: [ar((1, 2))], 1: [ar((1, 2))], 2: [ar((1, 2))]})
    assert not verdict.ok and "a group it is not a member of" in verdict.problem


def test_point_to_point_batches_match_message_by_message():
    send = Collective.p2p(0, sends=[1], label="pp")
    recv = Collective.p2p(1, recvs=[0], label="pp")
    assert simulate({0: [send], 1: [recv]}).ok
    # a ring inside one batch on every rank completes
    ring = {r: [Collective.p2p(r, sends=[(r + 1) % 3], recvs=[(r - 1) % 3])] for r in range(3)}
    assert simulate(ring).ok
    # two messages to one peer need two receives
    assert not simulate({0: [Collective.p2p(0, sends=[1, 1])], 1: [Collective.p2p(1, recvs=[0])]}).ok
    # a send before a collective and its receive after it: each rank waits for the other
    verdict = simulate({0: [send, ar((0, 1))], 1: [ar((0, 1)), recv]})
    assert not verdict.ok
    assert "rank 0 waits in p2p send 1 (pp)" in verdict.problem


def test_first_mismatch_reads_each_groups_order():
    g = (0, 1)
    same = {0: [ar(g, "a"), ar((0,) + (2,), "x")], 1: [ar(g, "a")], 2: [ar((0, 2), "x")]}
    assert first_mismatch(same) is None
    differs = {0: [ar(g, "a", (4,)), ar(g, "b", (8,))], 1: [ar(g, "b", (8,)), ar(g, "a", (4,))]}
    line = first_mismatch(differs)
    assert line.startswith("collective order differs in group [0, 1] at its operation 1: rank ")
    short = {0: [ar(g), ar(g)], 1: [ar(g)]}
    assert first_mismatch(short).endswith("rank 1 issues nothing")


def test_a_thousand_ranks_run_in_one_process():
    world = tuple(range(1024))
    seqs = {}
    for r in world:
        tp = tuple(range(r - r % 8, r - r % 8 + 8))
        seqs[r] = [ar(tp, f"mb {i}") for i in range(20)] + [ar(world, "loss")]
    verdict = simulate(seqs)
    assert verdict.ok
    assert verdict.collectives == 128 * 20 + 1


@pytest.mark.parametrize("kind", ["scatter", "send"])
def test_unknown_kinds_are_refused(kind):
    with pytest.raises(ValueError, match="collective kind"):
        Collective(kind, (0, 1))
