"""``--shard-group``: over how many ranks the optimizer states are sharded (hierarchical sharding).

The fp32 masters and Adam's moments are sharded over each group of ``G`` consecutive ranks and
replicated across the ``N / G`` groups (``hgraph.shard_rule.shard_group_ranks``): a rank's Pull and
Push stay inside its group, and each gradient shard is summed across the groups by all-reduces
among its replicas.
A smaller G bounds the peers a rank talks to (G = a node: its point-to-point peers no longer grow
with the world) at the price of ``N / G`` copies of the model states.

Values: an integer dividing the world size; ``world`` (G = N: every rank holds ``1/N`` of the states,
the layout before shard groups); ``auto``: ``choose_shard_group`` picks G from the memory budget and
the links. Default ``world``: it keeps every existing run, its memory and the planner's memory model
(which counts the states at ``1/N``) as they were; a cluster user asks for ``auto`` (or a node, 8).
"""
from __future__ import annotations

from typing import Optional, Union

from hgraph.errors import HGraphError
from hgraph.runtime.engine.model_states import MASTER_BYTES, MOMENT_BYTES, STEP_TRANSIENT_BYTES

WORLD, AUTO = "world", "auto"

#: ``auto`` lets the model states (masters, moments and the step's transient gradient segments) take
#: at most this share of a rank's memory budget: the rest holds one strategy's working weights, their
#: gradients and the activations that bound each scheme's longest micro-batch
STATE_SHARE = 0.5

#: bytes per parameter element of the model states, divided by G on each rank
STATE_BYTES = MASTER_BYTES + MOMENT_BYTES + STEP_TRANSIENT_BYTES


def parse_shard_group(value: Union[int, str, None], world_size: int,
                      option: str = "--shard-group") -> Union[int, str]:
    """``value`` as an integer G dividing ``world_size`` or ``"auto"`` (``world``/None: the world size);
    anything else one line naming ``option``, the value and what is allowed."""
    allowed = f"allowed: an integer dividing the world size {world_size}, {WORLD} or {AUTO}"
    if value is None:
        return world_size
    text = str(value).strip().lower()
    if text == WORLD:
        return world_size
    if text == AUTO:
        return AUTO
    try:
        g = int(text)
    except ValueError:
        raise HGraphError(f"{option} {value!r}: not a number; {allowed}") from None
    if isinstance(value, bool) or g < 1 or world_size % g:
        raise HGraphError(f"{option} {value!r}: does not divide the world size {world_size}; {allowed}")
    return g


def choose_shard_group(world_size: int, gpus_per_node: int, parameters: int,
                       memory_budget: Optional[float]) -> tuple[int, str]:
    """``auto``: the smallest G whose model states fit the memory budget, among a node and its
    multiples (a group inside a node talks over its fast links; each node more is one more hop over
    the slower inter-node network, so the smallest group that fits has the fewest), G dividing the
    world; the world when no such group fits or the world is within one node. ``parameters``: the
    model's parameter elements; ``memory_budget``: bytes per rank (None: unknown, a node is taken).
    Returns G and a sentence saying why."""
    node = min(gpus_per_node, world_size)
    candidates = [g for g in range(node, world_size + 1, node) if world_size % g == 0] or [world_size]
    if world_size <= gpus_per_node:
        return world_size, f"the world ({world_size} ranks) is within one node"
    if memory_budget is None:
        return candidates[0], (f"a node ({candidates[0]} ranks): no device memory budget to size the "
                               "model states against")
    for g in candidates:
        states = STATE_BYTES * parameters / g
        if states <= STATE_SHARE * memory_budget:
            return g, (f"the smallest node multiple whose model states fit: {states / 2**30:.2f} GiB per rank, "
                       f"at most {STATE_SHARE:g} of the {memory_budget / 2**30:.2f} GiB budget")
    return world_size, (f"no node multiple holds the model states in {STATE_SHARE:g} of the "
                        f"{memory_budget / 2**30:.2f} GiB budget: sharded over the whole world")


def resolve_shard_group(value: Union[int, str, None], world_size: int, gpus_per_node: int, parameters: int,
                        device_memory: Union[float, str, None]) -> tuple[int, str]:
    """The run's G from its ``--shard-group`` value; for ``auto`` also why (``choose_shard_group``,
    ``device_memory`` in bytes, or not a number: unknown), else an empty sentence."""
    g = parse_shard_group(value, world_size)
    if g != AUTO:
        return g, ""
    budget = float(device_memory) if isinstance(device_memory, (int, float)) else None
    return choose_shard_group(world_size, gpus_per_node, parameters, budget)
