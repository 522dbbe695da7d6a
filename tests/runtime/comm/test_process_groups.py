"""GroupCache on 4 gloo processes: member-only creation in rounds (``create``), ``ensure`` of a shared
list, cached get, singletons, and a group never created refused.

The overlapping triangle (0, 1), (0, 2), (1, 2) is what member-only creation in one sorted order cannot
make in torch: rank 0 reaches (0, 2) holding one more process group than rank 2, so the two compute
different group names and wait on different store keys for ever. In rounds (one partition each, every
rank one ``new_group`` call, a pad when its part is itself or a group it holds) the members agree.
"""
import random

import pytest
import torch
import torch.distributed as dist

from hgraph.errors import HGraphError
from hgraph.program import GroupRound
from hgraph.runtime.comm.process_groups import GroupCache, group_key
from hgraph.runtime.train.launch import spawn

GROUPS = [[0, 1], [2, 3], [2, 0], [1, 3], [3], [0, 1, 2, 3], [1, 0]]


def _group_sum(cache, ranks, rank):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=cache.get(ranks))
    return t.item()


def _worker(rank, world_size):
    out = {}
    cache = GroupCache()
    order = list(GROUPS)
    random.Random(rank).shuffle(order)  # every rank lists the groups in its own order
    cache.ensure(order)
    out["after_ensure"] = vars(cache.stats()).copy()
    mine = [g for g in ({group_key(g) for g in GROUPS}) if rank in g and len(g) > 1]
    out["sums"] = {g: _group_sum(cache, g, rank) for g in sorted(mine)}
    out["after_get"] = vars(cache.stats()).copy()
    cache.ensure(GROUPS)  # nothing missing: no new collective call
    out["after_second_ensure"] = vars(cache.stats()).copy()
    out["single_is_none"] = cache.get([rank]) is None
    out["world_is_default"] = cache.get([3, 2, 1, 0]) is dist.group.WORLD
    try:
        cache.get([r for r in range(world_size) if r != rank][:2])
        out["non_member"] = "no error"
    except HGraphError as e:
        out["non_member"] = str(e)
    # a group never created is refused (made by its members alone it could hang)
    try:
        cache.get([0, 3] if rank in (0, 3) else [1, 2])
        out["missing"] = "no error"
    except HGraphError as e:
        out["missing"] = str(e)
    # rounds: the four triples of the four ranks (new groups, each rank in three, alone in one), then a
    # round of pairs every rank holds from ensure (pads), then the first rounds again (skipped)
    triples = [[(0, 1, 2), (3,)], [(0, 1, 3), (2,)], [(0, 2, 3), (1,)], [(1, 2, 3), (0,)], [(0, 1), (2, 3)]]
    rounds = [GroupRound(("triples", i), next(p for p in parts if rank in p)) for i, parts in enumerate(triples)]
    before = vars(cache.stats()).copy()
    cache.create(rounds)
    cache.create(rounds[:2])
    out["rounds"] = {k: v - before[k] for k, v in vars(cache.stats()).items()}
    out["round_sums"] = {p.part: _group_sum(cache, p.part, rank) for p in rounds if len(p.part) > 1}
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def results():
    return spawn(_worker, 4, timeout_s=60)


def test_ensure_creates_each_group_once_on_every_rank(results):
    for rank, out in enumerate(results):
        # (0,1), (0,2), (1,3), (2,3) in two rounds of disjoint pairs: each rank creates its two, no pad;
        # singletons and the world need no new group
        assert out["after_ensure"] == {"hits": 0, "misses": 2, "groups": 2, "pads": 0}
        assert out["after_second_ensure"]["misses"] == 2


def test_cached_groups_reduce_over_their_members(results):
    for rank, out in enumerate(results):
        expected = {g: float(sum(r + 1 for r in g)) for g in out["sums"]}
        assert out["sums"] == expected
        assert out["after_get"]["hits"] == 2 and out["after_get"]["misses"] == 2


def test_single_rank_and_world_groups(results):
    assert all(out["single_is_none"] and out["world_is_default"] for out in results)


def test_non_member_lookup_is_an_error(results):
    for rank, out in enumerate(results):
        assert f"rank {rank} is not a member" in out["non_member"]


def test_a_group_never_created_is_refused(results):
    for rank, out in enumerate(results):
        assert "has not created it" in out["missing"], out["missing"]


def test_rounds_create_overlapping_groups_member_only(results):
    """Each rank makes one new_group call per new round: its part, or a pad where its part is itself or
    a group it holds; a round seen before makes none. The groups then reduce over their members. (In
    one sorted order instead, rank 0 would reach (0, 1, 3) holding one group more than rank 3: a hang.)"""
    for rank, out in enumerate(results):
        assert out["rounds"]["misses"] == 3 and out["rounds"]["pads"] == 2, (rank, out["rounds"])
        triples = [g for g in [(0, 1, 2), (0, 1, 3), (0, 2, 3), (1, 2, 3), (0, 1), (2, 3)] if rank in g]
        assert out["round_sums"] == {g: float(sum(r + 1 for r in g)) for g in triples}, rank


def test_bad_rank_lists_without_processes():
    cache = GroupCache(rank=0, world_size=2)
    with pytest.raises(HGraphError, match="empty rank list"):
        cache.get([])
    with pytest.raises(HGraphError, match=r"ranks must lie in \[0, 2\)"):
        cache.get([0, 5])
    assert cache.get([0]) is None and [0] in cache
