"""``--verify-collectives``: check the sequences the ranks actually issued in one step.

Every rank's ``CollectiveIssuer`` recorded what it issued (group, operation, shape, dtype, label).
``check_recorded`` gathers the sequences on rank 0 (each rank sends its own: O(its sequence) per
rank; rank 0 holds them all, as the checker must), which reads each group's order
(``deadlock.first_mismatch``: the first point where members disagree) and then runs them one
operation of a rank at a time (``deadlock.simulate``: a wait-for cycle NCCL could hang in, a rank
that ended early). Every rank gets rank 0's verdict, so all of them stop, or none.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch.distributed as dist

from hgraph.runtime.comm.order.collective import Collective
from hgraph.runtime.comm.order.deadlock import first_mismatch, simulate


def verdict_of(sequences: dict[int, Sequence[Collective]]) -> tuple[bool, str]:
    """``(ok, line)`` of the ranks' recorded sequences: ``deadlock-free: N ranks, K collectives`` or the
    first mismatch of a group's order, else the deadlock ``simulate`` names."""
    mismatch = first_mismatch(sequences)
    if mismatch is not None:
        return False, mismatch
    verdict = simulate(sequences)
    return verdict.ok, verdict.line()


def check_recorded(sequence: Sequence[Collective], rank: int, world_size: int) -> tuple[bool, str]:
    """Rank 0's verdict on every rank's ``sequence`` (collective on the default group: every rank
    calls it at the same point, after the step whose collectives it recorded)."""
    if world_size == 1 or not dist.is_initialized():
        return verdict_of({rank: list(sequence)})
    gathered: Optional[list] = [None] * world_size if rank == 0 else None
    dist.gather_object(list(sequence), gathered, dst=0)
    box: list = [verdict_of(dict(enumerate(gathered))) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]
