"""The rank's choke point for its collectives (``runtime/comm/order/issue``): what it records, that the
strict order completes each operation before the next, and that an inconsistent order across three gloo
ranks runs in the free order but hangs under the strict one, where the hang names its cycle (ranks,
groups, operations) within a bounded timeout."""
from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from hgraph.runtime.comm.order.collective import Collective
from hgraph.runtime.comm.order.issue import CollectiveHang, CollectiveIssuer
from hgraph.runtime.comm.order.verify import check_recorded, verdict_of
from hgraph.runtime.train.launch import spawn


class _Work:
    """A work that completes when ``done`` is set (counts its waits)."""

    def __init__(self, done: bool = True) -> None:
        self.done, self.waits = done, 0

    def wait(self, timeout=None):
        self.waits += 1
        if not self.done:
            raise RuntimeError("Operation timed out!")
        return True

    def is_completed(self) -> bool:
        return self.done


def test_records_each_operation_with_its_group_shape_dtype_and_scoped_label():
    issuer = CollectiveIssuer(1, 4, record=True)
    issuer.begin_step(7)
    t = torch.zeros(3, 2)
    with issuer.scope("mb 0 F"):
        issuer.issue("all_reduce", None, t, _Work, "tp_reduce")
        with issuer.scope("x"):
            issuer.p2p([2], [0, 0], lambda: [_Work(), _Work()], "pp_send")
    issuer.run("all_reduce", None, torch.zeros((), dtype=torch.float64), _Work, "loss")
    assert issuer.sequence == [
        Collective("all_reduce", (0, 1, 2, 3), (3, 2), "float32", "mb 0 F tp_reduce"),
        Collective.p2p(1, sends=[2], recvs=[0, 0], label="mb 0 F x pp_send"),
        Collective("all_reduce", (0, 1, 2, 3), (), "float64", "loss"),
    ]
    assert issuer.position == 3 and issuer.last().label == "loss"
    issuer.begin_step(8)
    assert issuer.sequence == [] and issuer.position == 0 and issuer.last() is None


def test_without_record_only_the_position_is_kept():
    issuer = CollectiveIssuer(0, 2)
    issuer.issue("all_gather", None, torch.zeros(4), _Work, "pull gather 0")
    assert issuer.sequence == [] and issuer.position == 1
    assert issuer.last() == Collective("all_gather", (0, 1), (4,), "float32", "pull gather 0")


def test_strict_order_waits_for_each_operation_before_returning_and_free_does_not():
    for order, waits in (("free", 0), ("strict", 1)):
        issuer = CollectiveIssuer(0, 2, order=order)
        work = _Work()
        issuer.issue("all_reduce", None, torch.zeros(1), lambda: work, "a")
        assert work.waits == waits
        batch = _Work()           # a batch whose one work stands for its two messages: waited once
        returned = issuer.p2p([1], [1], lambda: [batch, batch], "b")
        assert batch.waits == waits and len(returned) == 2
        # what the strict order returns was waited for: waiting again does not reach the backend
        for w in returned:
            w.wait()
        assert batch.waits == (1 if order == "strict" else 2)


def test_a_bad_order_name_is_refused():
    with pytest.raises(ValueError, match="collective order 'loose'"):
        CollectiveIssuer(0, 1, order="loose")


# ---- three gloo ranks -------------------------------------------------------------------------
PAIRS = [(0, 1), (1, 2), (0, 2)]
#: each rank's two groups in an order no global order explains: 0 -> 1 -> 2 -> 0 wait for each other
CYCLIC = {0: [(0, 1), (0, 2)], 1: [(1, 2), (0, 1)], 2: [(0, 2), (1, 2)]}
#: the same operations in one global order ((0, 1) < (1, 2) < (0, 2)): no cycle
CONSISTENT = {0: [(0, 1), (0, 2)], 1: [(0, 1), (1, 2)], 2: [(1, 2), (0, 2)]}


def _three_ranks(rank, world):
    groups = {pair: dist.new_group(list(pair)) for pair in PAIRS}     # every rank, one order
    out = {}

    def issue_all(issuer, plan):
        tensors = [torch.full((4,), float(rank + 1)) for _ in plan]
        works = [issuer.issue("all_reduce", groups[g], t,
                              lambda g=g, t=t: dist.all_reduce(t, group=groups[g], async_op=True), f"op {k}")
                 for k, (g, t) in enumerate(zip(plan, tensors))]
        for w in works:
            w.wait()
        return [t[0].item() for t in tensors]

    # free: gloo runs each group on its own threads, so the cyclic order completes; what the ranks
    # recorded is checked as --verify-collectives checks it
    recorder = CollectiveIssuer(rank, world, record=True)
    out["free"] = issue_all(recorder, CYCLIC[rank])
    out["verified_cyclic"] = check_recorded(recorder.sequence, rank, world)
    consistent = CollectiveIssuer(rank, world, order="strict", hang_s=30, record=True)
    out["consistent_strict"] = issue_all(consistent, CONSISTENT[rank])
    out["verified_consistent"] = check_recorded(consistent.sequence, rank, world)
    # strict: the first operation of every rank waits for a peer that waits in another group
    issuer = CollectiveIssuer(rank, world, order="strict", hang_s=2.0)
    issuer.begin_step(5)
    first, second = CYCLIC[rank]
    t1, t2 = torch.ones(4), torch.ones(4)
    pending = []
    try:
        issuer.issue("all_reduce", groups[first], t1,
                     lambda: pending.append(dist.all_reduce(t1, group=groups[first], async_op=True)) or pending[-1],
                     "push bucket 0")
        out["hang"] = None
    except CollectiveHang as exc:
        out["hang"] = str(exc)
    # drain, so the groups end consistent: the second operations meet the peers' first ones
    w2 = dist.all_reduce(t2, group=groups[second], async_op=True)
    w2.wait(datetime.timedelta(seconds=30))
    pending[0].wait(datetime.timedelta(seconds=30))
    out["stopped"] = issuer.stopped_line(grace_s=1.0)
    return out


@pytest.fixture(scope="module")
def three():
    return spawn(_three_ranks, 3, timeout_s=60)


def test_an_inconsistent_order_runs_free_on_gloo(three):
    assert [sorted(r["free"]) for r in three] == [[3.0, 4.0], [3.0, 5.0], [4.0, 5.0]]
    assert [sorted(r["consistent_strict"]) for r in three] == [[3.0, 4.0], [3.0, 5.0], [4.0, 5.0]]


def test_an_inconsistent_order_hangs_under_strict_and_names_its_cycle(three):
    for rank, r in enumerate(three):
        line = r["hang"]
        assert line is not None, f"rank {rank} did not hang"
        assert line.startswith(f"collective order: rank {rank} made no progress for 2 s at step 5 under "
                               "--collective-order strict: a cycle: ")
        for who, group in ((0, "[0, 1]"), (1, "[1, 2]"), (2, "[0, 2]")):
            assert f"rank {who} waits in all_reduce on {group} float32[4] (push bucket 0) (its operation 1)" in line
        assert len(line.splitlines()) == 1


def test_a_failed_collective_says_where_each_ranks_sequence_stopped(three):
    for r in three:
        assert r["stopped"] == "; ".join(
            f"rank {k}: stopped after 1 operations, the last all_reduce on {list(CYCLIC[k][0])} float32[4] "
            "(push bucket 0)" for k in range(3))


def test_verify_collectives_gives_every_rank_the_verdict_on_what_the_ranks_recorded(three):
    """The cyclic order that ran free is a deadlock NCCL could hang in: every rank gets rank 0's
    verdict naming the cycle; the consistent one is deadlock-free."""
    assert all(r["verified_consistent"] == (True, "deadlock-free: 3 ranks, 3 collectives") for r in three)
    verdicts = {r["verified_cyclic"] for r in three}
    assert len(verdicts) == 1
    ok, line = verdicts.pop()
    assert not ok and line.startswith("deadlock: rank 0 waits in all_reduce on [0, 1] float32[4] (op 0)")


def _ar(group, label, shape=(4,)):
    return Collective("all_reduce", group, shape, "float32", label)


def test_a_recorded_mismatch_names_the_ranks_and_the_first_differing_operation():
    """Two members of a group issue its operations in different orders (two push buckets swapped on one
    rank): the first point of the group's order where they differ, before any deadlock search."""
    g = (0, 1)
    ok, line = verdict_of({0: [_ar(g, "push bucket 0", (4,)), _ar(g, "push bucket 1", (8,))],
                           1: [_ar(g, "push bucket 1", (8,)), _ar(g, "push bucket 0", (4,))]})
    assert not ok
    assert line == ("collective order differs in group [0, 1] at its operation 1: rank 0 issues all_reduce on "
                    "[0, 1] float32[4] (push bucket 0) (its operation 1), rank 1 issues all_reduce on [0, 1] "
                    "float32[8] (push bucket 1) (its operation 1)")
    assert verdict_of({0: [_ar(g, "a")], 1: [_ar(g, "a")]}) == (True, "deadlock-free: 2 ranks, 1 collectives")


def test_a_bucket_over_an_earlier_stage_of_the_ranks_pipeline_waits_for_the_backwards_end():
    """Such a member (a tied parameter's) still waits for this rank's gradient: issued from the backward
    hooks, the bucket would stand in front of that send (the deadlock the strict order found)."""
    from hgraph.runtime.comm.push import spans_earlier_stages
    from hgraph.strategy import Strategy

    tied = Strategy.parse("1xTP1PP2+1xTP2PP1")
    assert spans_earlier_stages(tied, 1)((0, 1))           # stage 1 with stage 0 of its pipeline
    assert not spans_earlier_stages(tied, 0)((0, 1))       # stage 0 has no earlier stage
    assert not spans_earlier_stages(tied, 2)((0, 2))       # another pipeline's ranks do not wait for rank 2
    deep = Strategy.parse("1xTP2PP2")
    assert spans_earlier_stages(deep, 3)((1, 3)) and not spans_earlier_stages(deep, 3)((2, 3))
