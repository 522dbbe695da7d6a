"""A per-rank cache of ``torch.distributed`` process groups keyed by their sorted rank tuple, each
created by its members only.

Strategies change between iterations, so the same TP / PP / CP rank sets come back again and again:
each is created once and reused. A rank creates only the groups it belongs to
(``dist.new_group(ranks, use_local_synchronization=True)``: non-members do not call, the barrier is
the members'), so what it does grows with its own groups, not with the world's.

**Rounds.** Member-only creation needs more than one shared order. torch names a group created with
local synchronisation by a hash of its ranks salted with the number of process groups the calling
process holds (``_hash_ranks_to_str`` salts with ``len(_world.pg_names)``: torch 2.13, as since 2.1), and
the members rendezvous under that name: members that hold different numbers of groups wait on
different store keys for ever. Creating each rank's groups in one sorted order is not enough (ranks 0,
1 and 2 creating (0, 1), (0, 2), (1, 2): rank 0 reaches (0, 2) holding two groups, rank 2 holding
one, and both hang). So groups are created in **rounds**: a round is one partition of the world into
groups (the TP groups of a strategy, the replica groups of one push layout, the shard groups), named
by a key every rank computes alike, and in each round every rank makes exactly one ``new_group``
call, for its own part, or for a group of itself alone (a *pad*) when its part is a single rank or a
group it already holds. Every rank then holds the same number of groups before every round, so the
members of a part agree on its name; a round's parts are disjoint, so every member of a part is at
that part in that round, and the rounds come in one order on every rank: nothing can wait in a cycle.
A round whose key was seen before is skipped by every rank (its partition exists everywhere), and a
round whose one part is the world is skipped too (the world group exists). Pads cost a process group
each (a few threads on gloo; on NCCL a communicator is only made at a group's first collective, never
for a pad); a caller keeps rounds few by keying equal partitions alike.

Contracts:

* ``create(rounds)``: every rank calls it with the same round keys in the same order, each with its
  own part (``hgraph.program.GroupRound``). Every process group a process creates must come from a
  cache's ``create`` / ``ensure``, or be one every rank creates and holds (a group of the whole world,
  as the asynchronous checkpoint's): the count above includes every group of the process.
* ``ensure(groups)``: the same list of groups on every rank (e.g. a caller's world list): the missing
  ones are packed into rounds of disjoint groups, in sorted order, the same on every rank.
* ``get(ranks)`` returns a group created before; a group never created is an error (made on the spot
  by its members alone, it could hang as above). A single-rank group needs no process group: ``get``
  returns ``None`` and the comm ops treat it as the identity. The group of all ranks is
  ``dist.group.WORLD``.
* ``stats()`` reports hits, misses (groups this rank created), pads and the number of cached groups.
* A rank set created again (by another cache of the process) is another group under another name
  (the salt differs), with a communicator of its own: keep one cache per process.

NCCL: member-only creation needs NCCL communicators made lazily (no ``device_id`` bound at
``init_process_group``: with one bound, torch splits new communicators from the world's, which
needs every rank of the world in the call).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Iterable, Optional, Sequence

import torch.distributed as dist
from torch.distributed import ProcessGroup

from hgraph.errors import HGraphError
from hgraph.program import GroupRound
from hgraph.shard_rule import replica_ranks, shard_group_ranks


def shard_groups_of(world_size: int, group_size: int) -> list[tuple[int, ...]]:
    """Every shard group (``--shard-group``: the all-gathers of a pull) and every set of replicas (the
    sum of a gradient shard across the groups) of more than one rank, in one order (the world's list:
    dumps and tests; a rank creates its own, ``shard_rounds``)."""
    groups = [shard_group_ranks(r, group_size) for r in range(0, world_size, group_size)]
    groups += [replica_ranks(r, group_size, world_size) for r in range(group_size)]
    return sorted({g for g in groups if len(g) > 1})


def shard_rounds(rank: int, world_size: int, group_size: int) -> list[GroupRound]:
    """``rank``'s shard group and its replicas (one rank per shard group) under ``--shard-group``, as
    the two rounds every rank creates (none when a partition is all single ranks)."""
    out = []
    if group_size > 1:
        out.append(GroupRound(("shard group", world_size, group_size), shard_group_ranks(rank, group_size)))
    if world_size // group_size > 1:
        out.append(GroupRound(("replicas", world_size, group_size), replica_ranks(rank, group_size, world_size)))
    return out


def group_key(ranks: Sequence[int]) -> tuple[int, ...]:
    """The cache key of a rank set: sorted, without duplicates."""
    return tuple(sorted({int(r) for r in ranks}))


def disjoint_rounds(groups: Iterable[tuple[int, ...]]) -> list[list[tuple[int, ...]]]:
    """``groups`` (sorted keys) packed first-fit, in order, into rounds of disjoint groups."""
    rounds: list[tuple[list[tuple[int, ...]], set[int]]] = []
    for g in groups:
        for members, used in rounds:
            if used.isdisjoint(g):
                members.append(g)
                used.update(g)
                break
        else:
            rounds.append(([g], set(g)))
    return [members for members, _ in rounds]


@dataclass
class GroupCacheStats:
    hits: int = 0
    misses: int = 0         # groups this rank created
    groups: int = 0
    pads: int = 0           # single-rank groups made to keep the rounds in step


class GroupCache:
    """Process groups of this rank, created once per rank set, by its members (see the module)."""

    def __init__(self, rank: Optional[int] = None, world_size: Optional[int] = None) -> None:
        initialised = dist.is_available() and dist.is_initialized()
        self.rank = rank if rank is not None else (dist.get_rank() if initialised else 0)
        self.world_size = (world_size if world_size is not None
                           else (dist.get_world_size() if initialised else 1))
        self._groups: dict[tuple[int, ...], ProcessGroup] = {}
        self._rounds: set[Hashable] = set()              # round keys done (the same on every rank)
        self._ensured: set[tuple[int, ...]] = set()      # groups of ``ensure`` lists (the same everywhere)
        self._pads: list[ProcessGroup] = []
        self._stats = GroupCacheStats()

    def _check(self, key: tuple[int, ...]) -> None:
        if not key:
            raise HGraphError("process group: empty rank list")
        if key[0] < 0 or key[-1] >= self.world_size:
            raise HGraphError(f"process group {list(key)}: ranks must lie in [0, {self.world_size})")

    def get(self, ranks: Sequence[int]) -> Optional[ProcessGroup]:
        """The group of ``ranks`` (this rank must be a member, the group created); ``None`` for a
        single rank."""
        key = group_key(ranks)
        self._check(key)
        if self.rank not in key:
            raise HGraphError(f"process group {list(key)}: rank {self.rank} is not a member")
        if len(key) == 1:
            return None
        if len(key) == self.world_size:
            return dist.group.WORLD
        group = self._groups.get(key)
        if group is None:
            raise HGraphError(f"process group {list(key)}: rank {self.rank} has not created it (groups are "
                              "created in rounds by every rank, GroupCache.create / ensure)")
        self._stats.hits += 1
        return group

    def create(self, rounds: Iterable[GroupRound]) -> None:
        """Create this rank's part of every round not done yet: the same keys, in the same order, on
        every rank (see the module)."""
        for rnd in rounds:
            if rnd.key in self._rounds:
                continue
            key = group_key(rnd.part)
            self._check(key)
            if self.rank not in key:
                raise HGraphError(f"process group round {rnd.key!r}: rank {self.rank} is not in its part "
                                  f"{list(key)}")
            self._rounds.add(rnd.key)
            if len(key) < self.world_size:       # the world is every rank's part: nobody calls
                self._create_part(key)

    def ensure(self, groups: Iterable[Sequence[int]]) -> None:
        """Create every missing group of ``groups``, the same list on every rank: the groups not
        ensured before, packed into rounds of disjoint groups in sorted order."""
        keys = sorted({group_key(g) for g in groups} - self._ensured)
        for key in keys:
            self._check(key)
        self._ensured.update(keys)
        for members in disjoint_rounds(k for k in keys if 1 < len(k) < self.world_size):
            self._create_part(next((k for k in members if self.rank in k), (self.rank,)))

    def _create_part(self, key: tuple[int, ...]) -> None:
        """This rank's one ``new_group`` call of a round: its part, or a pad."""
        if len(key) > 1 and key not in self._groups:
            self._groups[key] = dist.new_group(list(key), use_local_synchronization=True)
            self._stats.misses += 1
        else:       # keeps the count of groups this process holds equal to every other rank's
            self._pads.append(dist.new_group([self.rank], use_local_synchronization=True))
            self._stats.pads += 1

    def stats(self) -> GroupCacheStats:
        """Hits and misses of ``get`` / ``create`` / ``ensure``, pads and the number of groups this rank
        holds."""
        return GroupCacheStats(self._stats.hits, self._stats.misses, len(self._groups), self._stats.pads)

    def __contains__(self, ranks: Sequence[int]) -> bool:
        key = group_key(ranks)
        return len(key) == 1 or len(key) == self.world_size or key in self._groups
