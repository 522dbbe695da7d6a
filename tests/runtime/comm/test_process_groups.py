"""GroupCache on 4 gloo processes: collective ensure, cached get, singletons, lazy creation."""
import random

import pytest
import torch
import torch.distributed as dist

from hgraph.errors import HGraphError
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
    # lazy creation: only the members ask for (1, 2)
    if rank in (1, 2):
        out["lazy_sum"] = _group_sum(cache, [2, 1], rank)
        out["lazy_stats"] = vars(cache.stats()).copy()
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def results():
    return spawn(_worker, 4, timeout_s=60)


def test_ensure_creates_each_group_once_on_every_rank(results):
    for rank, out in enumerate(results):
        # (0,1), (0,2), (1,3), (2,3): singletons and the world need no new group
        assert out["after_ensure"]["misses"] == 4
        assert out["after_ensure"]["groups"] == 2  # each rank is in two of the four pairs
        assert out["after_second_ensure"]["misses"] == 4


def test_cached_groups_reduce_over_their_members(results):
    for rank, out in enumerate(results):
        expected = {g: float(sum(r + 1 for r in g)) for g in out["sums"]}
        assert out["sums"] == expected
        assert out["after_get"]["hits"] == 2 and out["after_get"]["misses"] == 4


def test_single_rank_and_world_groups(results):
    assert all(out["single_is_none"] and out["world_is_default"] for out in results)


def test_non_member_lookup_is_an_error(results):
    for rank, out in enumerate(results):
        assert f"rank {rank} is not a member" in out["non_member"]


def test_lazy_get_creates_with_members_only(results):
    for rank in (1, 2):
        assert results[rank]["lazy_sum"] == 5.0
        assert results[rank]["lazy_stats"]["misses"] == 5
    assert "lazy_sum" not in results[0] and "lazy_sum" not in results[3]


def test_bad_rank_lists_without_processes():
    cache = GroupCache(rank=0, world_size=2)
    with pytest.raises(HGraphError, match="empty rank list"):
        cache.get([])
    with pytest.raises(HGraphError, match=r"ranks must lie in \[0, 2\)"):
        cache.get([0, 5])
    assert cache.get([0]) is None and [0] in cache
