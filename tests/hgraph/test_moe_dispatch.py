"""The EP form's pieces without processes (``hgraph.moe_dispatch``): the experts' split over the EP ranks,
the splits a count exchange gives, and the whole form over a group of one, which is ``moe_layer`` to the
bit, gradients included. (Several ranks: ``tests/runtime/comm/test_expert_exchange.py``.)"""
import pytest
import torch

from hgraph import moe, moe_dispatch
from hgraph.errors import HGraphError
from hgraph.runtime.comm.context import CommContext


def test_experts_split_evenly_over_the_ep_ranks():
    assert moe_dispatch.expert_bounds(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert moe_dispatch.expert_bounds(8, 3) == [(0, 2), (2, 5), (5, 8)]      # the shard rule's floors
    with pytest.raises(HGraphError, match="4 experts cannot be split over 8 EP ranks"):
        moe_dispatch.expert_bounds(4, 8)


def test_splits_from_the_exchanged_counts():
    # EP rank 1 of 2 with experts [2, 4): it sends its rows of experts 0-1 to rank 0 and 2-3 to itself, and
    # receives rank 0's and its own rows of experts 2 and 3
    splits = moe_dispatch.exchange_splits([3, 0, 1, 2], [4, 5, 1, 2], 2, 1)
    assert splits.send == (3, 3) and splits.recv == (9, 3)
    assert splits.received == ((4, 5), (1, 2)) and splits.per_expert == (5, 7) and splits.experts == (2, 4)
    with pytest.raises(HGraphError, match="received 3 counts, expected 4"):
        moe_dispatch.exchange_splits([3, 0, 1, 2], [4, 5, 1], 2, 1)


@pytest.mark.parametrize("normalize", [False, True])
def test_a_group_of_one_is_moe_layer_bitwise(normalize):
    g = torch.Generator().manual_seed(0)
    experts, hidden, inter = 4, 8, 6
    x = torch.randn(1, 7, hidden, generator=g, requires_grad=True)
    router = torch.randn(experts, hidden, generator=g, requires_grad=True)
    weights = [torch.randn(experts, inter, hidden, generator=g, requires_grad=True) for _ in range(2)] + \
        [torch.randn(experts, hidden, inter, generator=g, requires_grad=True)]
    comm = CommContext.single(bindings={"ep": [0]})
    got = moe_dispatch.moe_layer_ep(comm, x, router, *weights, top_k=2, normalize_top_k=normalize, key="ep")
    want = moe.moe_layer(x, router, *weights, top_k=2, normalize_top_k=normalize)
    assert torch.equal(got, want)
    r = torch.randn(want.shape, generator=g)
    for a, b in zip(torch.autograd.grad(got, [x, router, *weights], r), torch.autograd.grad(want, [x, router, *weights], r)):
        assert torch.equal(a, b)


def test_without_a_runtime_the_exchanges_are_one_clear_error():
    x, router = torch.randn(3, 8), torch.randn(4, 8)
    routing = moe_dispatch.route_tokens(x, router, top_k=2)
    with pytest.raises(HGraphError, match="moe_split_exchange needs peers"):
        moe_dispatch.moe_layer_ep(None, x, router, *[torch.randn(4, 6, 8)] * 2, torch.randn(4, 8, 6), top_k=2,
                                  key="ep")
    assert routing.rows.shape == (6, 8) and routing.counts.sum() == 6


def test_the_rank_experts_count_must_match_its_split():
    x, router = torch.randn(3, 8), torch.randn(4, 8)
    splits = moe_dispatch.exchange_splits([2, 2, 1, 1], [2, 2, 1, 1], 1, 0)
    with pytest.raises(HGraphError, match=r"holds experts \[0, 4\) but 2 experts' weights are given"):
        moe_dispatch.local_experts(x, splits, *[torch.randn(2, 6, 8)] * 2, torch.randn(2, 8, 6))
