"""The sparse receiver choice (equal loads: only owners and their node mates differ) finds a matching
of the same lexicographic cost as the dense one, on random groups and pieces."""
import random

import numpy as np
import pytest

from hgraph.passes.lnk.assignment import (LinkWeights, assign_pieces_by_load, assign_pieces_matrix,
                                          assign_pieces_sparse)
from hgraph.passes.lnk.plans import _choose_receivers, _special_costs


def _costs(group, chunks, gpn, w):
    k = len(group)
    link = np.zeros((k, k), dtype=np.int64)
    sent = np.zeros((k, k), dtype=np.int64)
    for p, piece in enumerate(chunks):
        for j, m in enumerate(group):
            for a, b, o in piece:
                if o != m:
                    sent[p, j] += b - a
                    link[p, j] += (b - a) * (w.intra if o // gpn == m // gpn else w.inter)
    return link, sent


def _lex_cost(group, member_of, link, sent, load):
    pos = {m: j for j, m in enumerate(group)}
    js = [pos[m] for m in member_of]
    assert sorted(js) == list(range(len(group))), "one piece per member"
    return (sum(int(link[p, j]) for p, j in enumerate(js)),
            sum(int(sent[p, j]) * (2 * load + int(sent[p, j])) for p, j in enumerate(js)),
            sum(p != j for p, j in enumerate(js)))


@pytest.mark.parametrize("seed", range(40))
def test_sparse_choice_costs_what_the_dense_one_costs(seed):
    rng = random.Random(seed)
    gpn = rng.choice([2, 4, 8])
    world = rng.choice([8, 16, 32])
    k = rng.randint(2, 8)
    group = tuple(sorted(rng.sample(range(world), k)))
    chunks = []
    for _ in range(k):      # a piece: up to two chunks of random owners, or empty
        owners = rng.sample(range(world), rng.choice([0, 1, 1, 1, 2]))
        chunks.append([(0, rng.randint(1, 5), o) for o in owners])
    w = LinkWeights(intra=rng.choice([0, 1, 2]), inter=8)
    load = rng.choice([0, 3])
    link, sent = _costs(group, chunks, gpn, w)
    sparse = assign_pieces_sparse(group, *_special_costs(group, chunks, gpn, w), load)
    dense = assign_pieces_matrix(group, link, sent, {m: load for m in group})
    assert _lex_cost(group, sparse, link, sent, load) == _lex_cost(group, dense, link, sent, load)


def test_a_large_first_reduce_scatter_takes_the_sparse_path():
    """7,680 replicas reducing one parameter over 12,288 segments (the heterogeneous 70B case): no
    7,680 x 7,680 matrix, and each member that owns a piece keeps it."""
    world, k = 12288, 7680
    group = tuple(range(0, world, 8)) + tuple(r for r in range(world) if r % 8 in (1, 2, 3, 4, 5))[:k - world // 8]
    group = tuple(sorted(group))
    pieces = [(r, r + 1) for r in range(k)]           # size == world: one row per segment
    member_of = _choose_receivers(group, pieces, world, world, 8, LinkWeights(), {})
    assert sorted(member_of) == list(group)
    owners = set(group)
    assert all(m == p for p, m in enumerate(member_of) if p in owners)


@pytest.mark.parametrize("seed", range(40))
def test_choice_by_load_costs_what_the_dense_one_costs(seed):
    """Loads that differ (a later reduce-scatter of a group): the min-cost flow over load levels finds
    a matching of the dense optimum's lexicographic cost."""
    rng = random.Random(100 + seed)
    gpn = rng.choice([2, 4, 8])
    world = rng.choice([8, 16, 32])
    k = rng.randint(2, 8)
    group = tuple(sorted(rng.sample(range(world), k)))
    chunks = []
    for _ in range(k):
        owners = rng.sample(range(world), rng.choice([0, 1, 1, 1, 2]))
        chunks.append([(0, rng.randint(1, 3), o) for o in owners])
    w = LinkWeights(intra=rng.choice([0, 1, 2]), inter=8)
    loads = {m: rng.choice([0, 2, 3]) for m in group}
    link, sent = _costs(group, chunks, gpn, w)
    default, special = _special_costs(group, chunks, gpn, w)
    by_load = assign_pieces_by_load(group, default, special, loads)
    dense = assign_pieces_matrix(group, link, sent, loads)

    def lex(member_of):
        pos = {m: j for j, m in enumerate(group)}
        js = [pos[m] for m in member_of]
        assert sorted(js) == list(range(k))
        return (sum(int(link[p, j]) for p, j in enumerate(js)),
                sum(int(sent[p, j]) * (2 * loads[group[j]] + int(sent[p, j])) for p, j in enumerate(js)),
                sum(p != j for p, j in enumerate(js)))
    assert lex(by_load) == lex(dense)
