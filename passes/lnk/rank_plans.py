"""One rank's part of the Pull Parameter and Push Gradient plans, without planning the world.

``pull_plan`` / ``push_plan`` (``passes/lnk/plans``) plan one parameter for every rank at once, which
grows with the world size (1,024 ranks took minutes). A training rank runs only its own ops, so here a
parameter's layout is described per *role*: ``(role, ranges)`` pairs, where every rank of a role holds
the same ranges and ``RoleRanks.of(role)`` lists them by rank arithmetic. One rank's ops then follow
from its own ranges, its optimizer segment and the roles that touch that segment:

* pull: what it needs, cut at the owners' segment boundaries (its receives and local copies), and what
  the ranks of every role needing rows of its segment take from it (its sends);
* push: the reduce-scatters of its replica group and what it forwards after them
  (``plans.replica_group_push``, the same function the world's plan runs), and what the groups
  covering its segment forward to it.

The result is exactly ``plan.for_rank(rank)`` of the world's plan (coalesced plans, the default), in
the same order; tests compare the two. The work is the rank's peers and the groups it reduces with or
receives from, never the world (``WorkCount``).

``passes.instantiate.StrategyLayout.rank_lnk_ops`` is the one place that calls these for a rank and a
parameter; the optimizer layout they plan against (every rank of ``world_size`` owning one even
segment, ``hgraph.shard_rule.optimizer_segments``) is its input.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence

from hgraph.comm_plan import LocalAdd, LocalCopy, ParamLayout, Transfer, merge_ranges
from hgraph.passes.lnk.assignment import LinkWeights
from hgraph.passes.lnk.plans import replica_group_push
from hgraph.shard_rule import Range, owner_chunks, shard_bounds

#: A parameter's layout per role: ``(role, ranges)`` for each role that holds it (no role twice).
RoleLayout = tuple[tuple[Hashable, tuple[Range, ...]], ...]


@dataclass
class WorkCount:
    """What one rank's plans of one parameter visited: ranks (owners, peers and group members looked
    at), ops made, and the replica groups whose outcome was computed or read."""

    ranks: int = 0
    ops: int = 0
    groups: set = field(default_factory=set)     # replica groups whose outcome was computed or read


class RoleRanks:
    """The ranks of each role, computed on first use by ``ranks_of(role)`` and kept (sorted tuples)."""

    def __init__(self, ranks_of: Callable[[Hashable], Sequence[int]]) -> None:
        self._ranks_of = ranks_of
        self._cache: dict[Hashable, tuple[int, ...]] = {}

    def of(self, role: Hashable) -> tuple[int, ...]:
        ranks = self._cache.get(role)
        if ranks is None:
            ranks = self._cache[role] = tuple(sorted(self._ranks_of(role)))
        return ranks


def _clip(ranges: Sequence[Range], seg: Range) -> list[Range]:
    """The parts of ``ranges`` inside ``seg``, each range on its own (a range is one op of the plan)."""
    lo, hi = seg
    return [(max(a, lo), min(b, hi)) for a, b in ranges if a < hi and lo < b]


def rank_pull_ops(param: ParamLayout, needs: RoleLayout, role: Hashable, rank: int, world_size: int,
                  roles: RoleRanks, working_dtype_bytes: int, work: WorkCount | None = None) -> tuple:
    """``pull_plan(param, needs of every rank, world_size, ...).for_rank(rank)`` from the role layout:
    ``role`` is the rank's own (it may hold nothing of ``param``)."""
    size, row_bytes = param.size, param.row_elements * working_dtype_bytes
    transfers: list[Transfer] = []
    copies: list[LocalCopy] = []
    own = dict(needs).get(role)
    for lo, hi in merge_ranges(own or ()):
        for a, b, owner in owner_chunks(lo, hi, size, world_size):
            if work is not None:
                work.ranks += 1
            if owner == rank:
                copies.append(LocalCopy(rank, a, b))
            else:
                transfers.append(Transfer(owner, rank, a, b, (b - a) * row_bytes))
    seg = shard_bounds(size, rank, world_size)
    if seg[0] < seg[1]:
        for other, ranges in needs:
            parts = _clip(merge_ranges(ranges), seg)    # a rank's overlapping needs are fetched once
            if not parts:
                continue
            peers = roles.of(other)
            if work is not None:
                work.ranks += len(peers)
            transfers += [Transfer(rank, d, a, b, (b - a) * row_bytes) for d in peers if d != rank for a, b in parts]
    if work is not None:
        work.ops += len(transfers) + len(copies)
    return (*sorted(transfers), *sorted(copies))


def push_groups(contributions: RoleLayout, roles: RoleRanks) -> list[tuple[tuple[Range, ...], tuple[Hashable, ...]]]:
    """The replica groups of a push as ``(ranges, roles)``: the roles contributing identical ranges (as
    ``instantiate`` groups ranks), in first-seen order; their ranks are the group."""
    by_ranges: dict[tuple[Range, ...], list[Hashable]] = {}
    for role, ranges in contributions:
        by_ranges.setdefault(tuple(ranges), []).append(role)
    return [(r, tuple(rs)) for r, rs in by_ranges.items()]


def rank_push_ops(param: ParamLayout, contributions: RoleLayout, role: Hashable, rank: int, world_size: int,
                  gpus_per_node: int, roles: RoleRanks, weights: LinkWeights = LinkWeights(),
                  work: WorkCount | None = None) -> tuple:
    """``push_plan(param, contributions of every rank, world_size, gpus_per_node, replica_groups=ranks
    with identical ranges).for_rank(rank)`` from the role layout (master-dtype gradients)."""
    size, row_bytes = param.size, param.row_elements * param.dtype_bytes
    scatters, transfers, adds = [], [], []
    seg = shard_bounds(size, rank, world_size)
    for ranges, group_roles in push_groups(contributions, roles):
        layout = tuple(sorted(r for r in ranges if r[0] < r[1]))
        mine = role in group_roles
        touches_segment = seg[0] < seg[1] and bool(_clip(layout, seg))
        if not layout or not (mine or touches_segment):
            continue
        members = roles.of(group_roles[0]) if len(group_roles) == 1 else \
            tuple(sorted(r for g in group_roles for r in roles.of(g)))
        if len(members) == 1:
            held = {members[0]: layout}
        else:
            group_scatters, held = replica_group_push(size, row_bytes, world_size, gpus_per_node, layout,
                                                      members, weights)
            if mine:
                scatters += group_scatters
        if work is not None:
            work.ranks += len(members)
            work.groups.add(members)
        if mine:
            for lo, hi in sorted(held.get(rank, ())):
                for a, b, owner in owner_chunks(lo, hi, size, world_size):
                    if owner == rank:
                        adds.append(LocalAdd(rank, a, b))
                    else:
                        transfers.append(Transfer(rank, owner, a, b, (b - a) * row_bytes))
        if touches_segment:
            for m, rows in held.items():
                if m != rank:
                    transfers += [Transfer(m, rank, a, b, (b - a) * row_bytes) for a, b in _clip(rows, seg)]
    if work is not None:
        work.ops += len(scatters) + len(transfers) + len(adds)
    return (*sorted(scatters), *sorted(transfers), *sorted(adds))
