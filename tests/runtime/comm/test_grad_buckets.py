"""The issue order of Push Gradient's buckets (``GradBuckets``) does not depend on timing.

A rank's buckets span several replica groups; the gradient hooks fire in whatever order backward
finishes the gradients. Whatever that order, a rank issues its buckets in the one global order, a
bucket never before its own gradients are final, and two ranks issue the buckets they share in the
same relative order. No process group is needed: the issuing function is replaced by a recorder.
"""
import itertools

import torch

from hgraph.comm_plan import ParamLayout, ReduceScatter
from hgraph.runtime.comm.grad_buckets import DEFAULT_BUCKET_BYTES, MIN_BUCKET_BYTES, GradBuckets, bucket_cap

ORDER = ("embed", "wq", "wk", "w1", "w2", "head")     # model order
# each parameter's reduce-scatters: 4 rows, over the groups its rows are replicated on
GROUPS = {"embed": [(0, 1)], "wq": [(0, 2)], "wk": [(0, 1), (0, 2)], "w1": [(1, 2)], "w2": [(0, 1)],
          "head": [(0, 2), (1, 2)]}


def _ops():
    ops = {}
    for name, groups in GROUPS.items():
        ops[name] = [ReduceScatter(g, 0, 4, ((g[0], 0, 2), (g[1], 2, 4)), 4 * 3 * 4) for g in groups]
    return ops


def _buckets(rank, bucket_bytes=1):
    """Rank ``rank``'s buckets (``bucket_bytes=1``: one reduce-scatter each) with a recording issuer."""
    ops = {n: [op for op in v if rank in op.group] for n, v in _ops().items()}
    layouts = {n: ParamLayout(n, (4, 3), 0) for n in ORDER}
    buckets = GradBuckets(rank, ORDER, ops, layouts, groups=None, contribution=None,
                          device=torch.device("cpu"), bucket_bytes=bucket_bytes)
    issued, ready = [], set()

    def issue(bucket):
        assert all(name in ready for name, _ in bucket.ops), "a bucket was issued before its gradients"
        issued.append((bucket.group, tuple(name for name, _ in bucket.ops)))

    buckets._issue = issue
    return buckets, issued, ready


def _fire(rank, readiness, bucket_bytes=1):
    buckets, issued, ready = _buckets(rank, bucket_bytes)
    for name in readiness:
        ready.add(name)
        buckets.ready(name, None)
    return buckets, issued


def test_every_readiness_order_issues_the_same_buckets_in_the_same_order():
    for rank in (0, 1, 2):
        buckets = _buckets(rank)[0]
        expected = [(b.group, tuple(n for n, _ in b.ops)) for b in buckets.buckets]
        assert len(expected) >= 3
        names = [n for n in ORDER if any(rank in g for g in GROUPS[n])]
        seen = set()
        for readiness in itertools.permutations(names):
            issued = _fire(rank, readiness)[1]
            assert issued == expected, (rank, readiness)
            seen.add(tuple(issued))
        assert len(seen) == 1


def test_a_bucket_ready_early_waits_for_its_predecessors():
    # rank 0's first bucket holds "head" (reverse model order): nothing goes before it is ready
    buckets, issued, ready = _buckets(0)
    for name in ("embed", "wq", "wk", "w2"):
        ready.add(name)
        buckets.ready(name, None)
    assert issued == [] and buckets.issued == 0
    ready.add("head")
    buckets.ready("head", None)
    assert len(issued) == len(buckets.buckets) == buckets.issued


def test_flush_issues_the_rest_in_order_after_a_partial_backward():
    buckets, issued, ready = _buckets(0)
    expected = [(b.group, tuple(n for n, _ in b.ops)) for b in buckets.buckets]
    ready.update(("head", "w2"))
    buckets.ready("w2", None)
    buckets.ready("head", None)
    partial = list(issued)
    ready.update(ORDER)
    buckets.flush({})
    assert 0 < len(partial) < len(expected) and issued == expected


def test_ranks_issue_the_buckets_they_share_in_the_same_relative_order():
    orders = {}
    for rank, readiness in ((0, ORDER), (1, tuple(reversed(ORDER))), (2, ("w1", "embed", "head", "wq", "wk", "w2"))):
        names = [n for n in readiness if any(rank in g for g in GROUPS[n])]
        orders[rank] = _fire(rank, names)[1]
    for a, b in itertools.combinations(orders, 2):
        shared = [x for x in orders[a] if x in orders[b]]
        assert shared, (a, b)
        assert shared == [x for x in orders[b] if x in orders[a]]


def test_a_bucket_of_several_parameters_waits_for_all_of_them():
    # larger buckets: rank 0's reduce-scatters of one group travel together, (0, 2)'s first
    buckets, issued, ready = _buckets(0, bucket_bytes=4 * 6 * 4 * 2)
    assert [(b.group, [n for n, _ in b.ops]) for b in buckets.buckets] == [
        ((0, 2), ["head", "wk", "wq"]), ((0, 1), ["w2", "wk", "embed"])]
    for name in ("wk", "w2", "embed", "head"):    # the second bucket is complete, the first is not
        ready.add(name)
        buckets.ready(name, None)
        assert issued == []
    ready.add("wq")
    buckets.ready("wq", None)
    assert [g for g, _ in issued] == [(0, 2), (0, 1)]


def test_a_small_groups_reductions_travel_in_several_buckets():
    """One bucket of a whole small model would go out only when backward ends: a group's reductions
    take at least ``MIN_BUCKETS`` buckets where each still holds ``MIN_BUCKET_BYTES``; a large model
    keeps DDP's cap."""
    mb = 1024 * 1024
    assert bucket_cap(400 * mb, DEFAULT_BUCKET_BYTES) == DEFAULT_BUCKET_BYTES
    assert bucket_cap(2 * mb, DEFAULT_BUCKET_BYTES) == 256 * 1024
    assert bucket_cap(100 * 1024, DEFAULT_BUCKET_BYTES) == MIN_BUCKET_BYTES
    assert bucket_cap(2 * mb, 1000) == 1000
    names = [f"w{i}" for i in range(16)]       # 16 reductions of 64 KB input each (2 rows of 4,096 x 2)
    ops = {n: [ReduceScatter((0, 1), 0, 4, ((0, 0, 2), (1, 2, 4)), 4 * 4096 * 4)] for n in names}
    layouts = {n: ParamLayout(n, (4, 4096), 0) for n in names}
    buckets = GradBuckets(0, names, ops, layouts, groups=None, contribution=None, device=torch.device("cpu"))
    assert [len(b.ops) for b in buckets.buckets] == [2] * 8


def test_what_follows_each_bucket_follows_it_in_backward_and_in_the_flush_alike():
    """``after_issue`` (the overlapped update's takes and its next step's all-gathers) runs after every
    bucket, whether backward issued it or the flush of a rank that ran no micro-batch: the two ranks
    issue what follows each bucket at the same point of the bucket order."""
    def sequence(in_backward):
        buckets, issued, ready = _buckets(0)
        buckets.after_issue = lambda: issued.append(("after", len(issued)))
        names = [n for n in ORDER if any(0 in g for g in GROUPS[n])]
        if in_backward:
            for name in reversed(names):           # backward finishes gradients in reverse model order
                ready.add(name)
                buckets.ready(name, None)
        else:
            ready.update(names)
        buckets.flush({})
        return issued

    backward, flushed = sequence(True), sequence(False)
    assert backward == flushed
    assert [kind for kind, _ in backward[1::2]] == ["after"] * (len(backward) // 2)


def test_peers_issue_a_shared_bucket_where_its_gradients_are_final_whatever_their_own_cuts():
    """Two TP peers (ranks 0 and 1) share ``norm``'s group and reduce their own pieces of ``wa`` and
    ``wb`` in groups of their own, cut differently (rank 0's pieces fit one bucket, rank 1's do not).
    Each must issue the shared bucket at the same point of backward (where ``norm``'s gradient is
    final), or the two would issue it on different sides of a TP collective of that backward: a
    deadlock on NCCL's in-order streams. Keyed by a bucket's first gradient, rank 0's bucket of ``wb``
    and ``wa`` went first and held the shared one until ``wa`` was final."""
    order = ("wa", "norm", "wb")                       # model order; backward finishes wb, norm, wa
    row = 4096                                         # fp32 elements per row: 32 KiB per row over 2 ranks

    def sequence(rank, own, width):
        pieces = ((own[0], 0, width), (own[1], width, 2 * width))
        ops = {"wa": [ReduceScatter(own, 0, 2 * width, pieces, 0)],
               "wb": [ReduceScatter(own, 0, 2 * width, pieces, 0)],
               "norm": [ReduceScatter((0, 1), 0, 2, ((0, 0, 1), (1, 1, 2)), 0)]}
        layouts = {n: ParamLayout(n, (2 * width if n != "norm" else 2, row), 0) for n in order}
        buckets = GradBuckets(rank, order, ops, layouts, groups=None, contribution=None,
                              device=torch.device("cpu"), bucket_bytes=2 * MIN_BUCKET_BYTES)
        events = []
        buckets._issue = lambda b: events.append(b.group)
        for name in reversed(order):
            events.append(name)
            buckets.ready(name, None)
        return buckets, events

    cut = {}
    for rank, own, width in ((0, (0, 2), 1), (1, (1, 3), 2)):
        buckets, events = sequence(rank, own, width)
        cut[rank] = [len(b.ops) for b in buckets.buckets if b.group == own]
        assert events.index((0, 1)) == events.index("norm") + 1, (rank, events)
    assert cut == {0: [2], 1: [1, 1]}        # the peers' own buckets are cut differently
