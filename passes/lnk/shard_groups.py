"""Pull and Push plans when the optimizer shards inside groups of G ranks (hierarchical sharding).

With ``--shard-group G`` the fp32 masters and moments are sharded over each group of ``G``
consecutive ranks (``hgraph.shard_rule.shard_group_ranks``) and replicated across the ``N / G``
groups: rank ``r`` owns ``group_shard_bounds(S, r, G)``, whatever the strategy, so switching still
moves no state. A group's plans are today's plans (``passes/lnk/plans``) over its ``G`` ranks: the
needs and contributions of its members, ranks translated to ``0..G-1`` (``world_size=G``), and the
ops translated back. So

* **Pull** gathers inside the rank's own group (every member owns one shard of every parameter);
* **Push** reduce-scatters and sends inside the group (LNK to the group's owners; contributions may
  leave rows out, ``push_plan(cover=False)``: a group holding a few TP ranks or one stage), and the
  runtime then sums each shard across the groups (``hgraph.shard_rule.replica_ranks``), an owner whose
  group contributed nothing adding exact zeros.

A rank therefore talks to at most ``G - 1`` peers in Pull and Push plus its ``N / G - 1`` replicas
in the all-reduces: with G a node, its point-to-point peers do not grow with the world.

The plans of all groups are merged into one ``PullPlan`` / ``PushPlan`` in world ranks with
``shard_group = G`` (``for_rank`` and the byte figures as before); ``G = N`` is exactly today's
plan. ``groups=`` plans only some groups (the rank's own: what a bench or a rank needs), which costs
what those groups exchange, not the world.

Link costs: a group's plan sees its members' nodes exactly when the group is node-aligned (``G`` a
multiple of the ranks per node, or dividing it); otherwise the receiver choice prices nodes by the
members' places in the group (the bytes moved are the same).
"""
from __future__ import annotations

from typing import Iterable, Mapping, Optional, Sequence

from hgraph.comm_plan import (LocalAdd, LocalCopy, ParamLayout, PullPlan, PushPlan, ReduceScatter, Traffic,
                              Transfer)
from hgraph.passes.lnk.assignment import LinkWeights
from hgraph.passes.lnk.plans import pull_plan, push_plan
from hgraph.shard_rule import PlanError, Range, require_positive_int


def check_shard_group(shard_group: Optional[int], world_size: int) -> int:
    """``G`` (``None``: the world) after checking it divides the world size."""
    if shard_group is None:
        return world_size
    require_positive_int(shard_group, "shard group")
    if world_size % shard_group:
        raise PlanError(f"shard group {shard_group} does not divide the world of {world_size} ranks")
    return shard_group


def _by_group(layout: Mapping[int, Sequence[Range]], size: int) -> dict[int, dict[int, Sequence[Range]]]:
    """``layout`` split per shard group, ranks translated to their place in the group."""
    out: dict[int, dict[int, Sequence[Range]]] = {}
    for rank in sorted(layout):
        out.setdefault(rank // size, {})[rank % size] = layout[rank]
    return out


def _slices(plans: Sequence) -> tuple[Range, ...]:
    """The common refinement of the groups' mutual slices."""
    cuts = sorted({c for p in plans for lo, hi in p.slices for c in (lo, hi)})
    return tuple(zip(cuts, cuts[1:]))


def shard_group_pull_plan(param: ParamLayout, needs: Mapping[int, Sequence[Range]], world_size: int,
                          gpus_per_node: int, shard_group: Optional[int], *,
                          working_dtype_bytes: int | None = None, coalesce: bool = True,
                          groups: Optional[Iterable[int]] = None) -> PullPlan:
    """``pull_plan`` with the optimizer sharded over groups of ``shard_group`` ranks (``None`` or the
    world: ``pull_plan`` itself). ``groups``: plan only these shard groups (indices ``rank // G``)."""
    size = check_shard_group(shard_group, world_size)
    if size == world_size:
        return pull_plan(param, needs, world_size, gpus_per_node, working_dtype_bytes=working_dtype_bytes,
                         coalesce=coalesce)
    for rank in needs:
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise PlanError(f"needs: rank {rank!r} is outside the world of {world_size} ranks")
    split = _by_group(needs, size)
    wanted = sorted(split) if groups is None else sorted(g for g in set(groups) if g in split)
    plans = {g: pull_plan(param, split[g], size, gpus_per_node, working_dtype_bytes=working_dtype_bytes,
                          coalesce=coalesce) for g in wanted}
    copies, transfers, assembly, norm = [], [], {}, {}
    for g, plan in plans.items():
        base = g * size
        copies += [LocalCopy(base + c.rank, c.lo, c.hi) for c in plan.local_copies]
        transfers += [Transfer(base + t.src, base + t.dst, t.lo, t.hi, t.bytes) for t in plan.transfers]
        assembly.update((base + r, a) for r, a in plan.assembly.items())
        norm.update((base + r, n) for r, n in plan.needs.items())
    all_gather = (len(plans) == world_size // size and all(p.is_all_gather for p in plans.values()))
    transfers.sort()
    wbytes = next(iter(plans.values())).working_dtype_bytes if plans else (working_dtype_bytes or param.dtype_bytes)
    return PullPlan(param, world_size, gpus_per_node, wbytes, dict(sorted(norm.items())),
                    _slices(list(plans.values())), tuple(sorted(copies)), tuple(transfers), assembly,
                    all_gather, Traffic(tuple(transfers), gpus_per_node), shard_group=size)


def shard_group_push_plan(param: ParamLayout, contributions: Mapping[int, Sequence[Range]], world_size: int,
                          gpus_per_node: int, shard_group: Optional[int],
                          replica_groups: Sequence[Sequence[int]] | None = None, *,
                          grad_dtype_bytes: int | None = None, weights: LinkWeights = LinkWeights(),
                          coalesce: bool = True, groups: Optional[Iterable[int]] = None) -> PushPlan:
    """``push_plan`` with the optimizer sharded over groups of ``shard_group`` ranks (``None`` or the
    world: ``push_plan`` itself): each group's owners end with the sum of their group's contributions
    on their shard (the runtime sums the shards across the groups). ``replica_groups`` are cut at the
    shard groups' edges. ``groups``: plan only these shard groups."""
    size = check_shard_group(shard_group, world_size)
    if size == world_size:
        return push_plan(param, contributions, world_size, gpus_per_node, replica_groups,
                         grad_dtype_bytes=grad_dtype_bytes, weights=weights, coalesce=coalesce)
    for rank in contributions:
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise PlanError(f"contributions: rank {rank!r} is outside the world of {world_size} ranks")
    split = _by_group(contributions, size)
    local_groups: dict[int, list[tuple[int, ...]]] = {}
    for members in replica_groups or ():
        for g, part in _by_group({r: () for r in members}, size).items():
            local_groups.setdefault(g, []).append(tuple(part))
    wanted = sorted(split) if groups is None else sorted(g for g in set(groups) if g in split)
    plans = {g: push_plan(param, split[g], size, gpus_per_node,
                          local_groups.get(g, []) if replica_groups is not None else None,
                          grad_dtype_bytes=grad_dtype_bytes, weights=weights, coalesce=coalesce, cover=False)
             for g in wanted}
    norm, rgroups, scatters, transfers, adds = {}, [], [], [], []
    for g, plan in plans.items():
        base = g * size
        norm.update((base + r, c) for r, c in plan.contributions.items())
        rgroups += [tuple(base + r for r in grp) for grp in plan.replica_groups]
        scatters += [ReduceScatter(tuple(base + r for r in rs.group), rs.lo, rs.hi,
                                   tuple((base + m, lo, hi) for m, lo, hi in rs.pieces), rs.bytes)
                     for rs in plan.reduce_scatters]
        transfers += [Transfer(base + t.src, base + t.dst, t.lo, t.hi, t.bytes) for t in plan.transfers]
        adds += [LocalAdd(base + a.rank, a.lo, a.hi) for a in plan.local_adds]
    plain = len(plans) == world_size // size and all(p.is_plain_reduce_scatter for p in plans.values())
    gbytes = next(iter(plans.values())).grad_dtype_bytes if plans else (grad_dtype_bytes or param.dtype_bytes)
    transfers.sort()
    return PushPlan(param, world_size, gpus_per_node, gbytes, dict(sorted(norm.items())), tuple(sorted(rgroups)),
                    _slices(list(plans.values())), tuple(sorted(scatters)), tuple(transfers), tuple(sorted(adds)),
                    plain, Traffic(tuple(transfers), gpus_per_node), shard_group=size)
