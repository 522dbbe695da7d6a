"""A per-rank cache of ``torch.distributed`` process groups keyed by their sorted rank tuple.

Strategies change between iterations, so the same TP / PP / CP rank sets come back again and again:
each is created once and reused. Contracts:

* ``ensure(groups)`` creates every group that is missing **collectively**: ``dist.new_group`` must be
  called by *all* ranks for *every* group in the same order, even groups a rank is not part of.
  Callers therefore pass the same list on every rank (e.g. every group of every candidate strategy);
  the cache deduplicates it and walks it in sorted order, so the order of the list does not matter.
* ``get(ranks)`` returns the cached group. A miss is created on the spot with local synchronisation
  (only the members take part), which is safe only when every member asks for it too; prefer
  ``ensure`` up front.
* A single-rank group needs no process group: ``get`` returns ``None`` and the comm ops treat it as
  the identity. The group of all ranks is ``dist.group.WORLD``.
* ``stats()`` reports hits, misses (groups created) and the number of cached groups.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import torch.distributed as dist
from torch.distributed import ProcessGroup

from hgraph.errors import HGraphError
from hgraph.shard_rule import replica_ranks, shard_group_ranks


def shard_groups_of(world_size: int, group_size: int) -> list[tuple[int, ...]]:
    """Every shard group (``--shard-group``: the all-gathers of a pull) and every set of replicas (the
    sum of a gradient shard across the groups) of more than one rank, in one order for every rank."""
    groups = [shard_group_ranks(r, group_size) for r in range(0, world_size, group_size)]
    groups += [replica_ranks(r, group_size, world_size) for r in range(group_size)]
    return sorted({g for g in groups if len(g) > 1})


def group_key(ranks: Sequence[int]) -> tuple[int, ...]:
    """The cache key of a rank set: sorted, without duplicates."""
    return tuple(sorted({int(r) for r in ranks}))


@dataclass
class GroupCacheStats:
    hits: int = 0
    misses: int = 0
    groups: int = 0


class GroupCache:
    """Process groups of this rank, created once per rank set."""

    def __init__(self, rank: Optional[int] = None, world_size: Optional[int] = None) -> None:
        initialised = dist.is_available() and dist.is_initialized()
        self.rank = rank if rank is not None else (dist.get_rank() if initialised else 0)
        self.world_size = (world_size if world_size is not None
                           else (dist.get_world_size() if initialised else 1))
        self._groups: dict[tuple[int, ...], ProcessGroup] = {}
        self._collective: set[tuple[int, ...]] = set()  # keys made by ensure on every rank
        self._stats = GroupCacheStats()

    def _check(self, key: tuple[int, ...]) -> None:
        if not key:
            raise HGraphError("process group: empty rank list")
        if key[0] < 0 or key[-1] >= self.world_size:
            raise HGraphError(f"process group {list(key)}: ranks must lie in [0, {self.world_size})")

    def get(self, ranks: Sequence[int]) -> Optional[ProcessGroup]:
        """The group of ``ranks`` (this rank must be a member); ``None`` for a single rank."""
        key = group_key(ranks)
        self._check(key)
        if self.rank not in key:
            raise HGraphError(f"process group {list(key)}: rank {self.rank} is not a member")
        if len(key) == 1:
            return None
        if len(key) == self.world_size:
            return dist.group.WORLD
        group = self._groups.get(key)
        if group is not None:
            self._stats.hits += 1
            return group
        self._stats.misses += 1
        group = dist.new_group(list(key), use_local_synchronization=True)
        self._groups[key] = group
        return group

    def ensure(self, groups: Iterable[Sequence[int]]) -> None:
        """Create every missing group of ``groups``, collectively: pass the same list on every rank."""
        keys = sorted({group_key(g) for g in groups})
        for key in keys:
            self._check(key)
            if len(key) == 1 or len(key) == self.world_size or key in self._collective:
                continue
            group = dist.new_group(list(key))  # every rank calls this, members or not
            self._collective.add(key)
            self._stats.misses += 1
            if self.rank in key and key not in self._groups:
                self._groups[key] = group

    def stats(self) -> GroupCacheStats:
        """Hits and misses of ``get``/``ensure`` and the number of groups this rank holds."""
        return GroupCacheStats(self._stats.hits, self._stats.misses, len(self._groups))

    def __contains__(self, ranks: Sequence[int]) -> bool:
        key = group_key(ranks)
        return len(key) == 1 or len(key) == self.world_size or key in self._groups
