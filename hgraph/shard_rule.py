"""The even split of a dimension over ranks: the one shard rule of the system.

A dimension of ``size`` rows split over ``parts`` ranks gives rank ``i`` the half-open range
``[floor(i*size/parts), floor((i+1)*size/parts))``: ranges differ by at most one row, tile the
dimension in rank order, and may be empty when ``size < parts``.

The rule places the fp32 master parameters and optimizer states on all N ranks (the same for every
strategy), or on each group of G consecutive ranks (``--shard-group``: sharded inside a group,
replicated across the ``N / G`` groups; ``group_shard_bounds``), cuts a tensor into TP segments, and slices a sequence's tokens under sequence parallelism.
The compiler's LNK plans and the runtime's optimizer, collectives, weight sources and checkpoints all
read it from here, so they cannot drift apart. ``ShardLayout`` is one rank's shard of one parameter.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from hgraph.errors import HGraphError

Range = tuple[int, int]


class PlanError(HGraphError, ValueError):
    """A layout or plan request that cannot be planned (bad ranges, ranks, groups)."""


def shard_bounds(size: int, rank: int, parts: int) -> Range:
    """The range ``[lo, hi)`` of a dimension of ``size`` that ``rank`` of ``parts`` owns."""
    return (rank * size) // parts, ((rank + 1) * size) // parts


def shard_sizes(size: int, parts: int) -> list[int]:
    """How many rows of ``size`` each of ``parts`` ranks owns, in rank order."""
    return [hi - lo for lo, hi in (shard_bounds(size, r, parts) for r in range(parts))]


def even_segments(size: int, parts: int) -> list[Range]:
    """Every rank's range (``shard_bounds``), in rank order, after checking the arguments."""
    require_size(size)
    require_positive_int(parts, "number of segments")
    return [shard_bounds(size, r, parts) for r in range(parts)]


def optimizer_segments(size: int, world_size: int) -> list[Range]:
    """The optimization layout: ``result[r]`` is the range of the shard dimension owned by rank ``r``;
    the same for every strategy."""
    return even_segments(size, world_size)


def shard_group_ranks(rank: int, group_size: int) -> tuple[int, ...]:
    """The shard group of ``rank``: the ``group_size`` consecutive ranks that shard the optimizer
    states among them (a group of the world's ``N / G``; ``group_size = N``: the world)."""
    base = rank - rank % group_size
    return tuple(range(base, base + group_size))


def replica_ranks(rank: int, group_size: int, world_size: int) -> tuple[int, ...]:
    """The ranks holding the same optimizer shards as ``rank``: one per shard group, at its place."""
    return tuple(range(rank % group_size, world_size, group_size))


def group_shard_bounds(size: int, rank: int, group_size: int) -> Range:
    """The rows of a dimension of ``size`` that ``rank`` owns when the optimizer shards over groups
    of ``group_size`` consecutive ranks (``shard_bounds`` of its place in its group)."""
    return shard_bounds(size, rank % group_size, group_size)


def owner_of(size: int, parts: int, row: int) -> int:
    """The rank whose range holds ``row`` (unchecked; ``segment_owner`` checks).

    ``floor(r*S/N) <= i`` iff ``r*S < (i+1)*N``, so the owner is ``((i+1)*N - 1) // S``.
    """
    return ((row + 1) * parts - 1) // size


def segment_owner(size: int, world_size: int, index: int) -> int:
    """The rank whose optimizer segment holds row ``index`` (0 <= index < size)."""
    require_size(size)
    require_positive_int(world_size, "world size")
    if not 0 <= index < size:
        raise PlanError(f"row {index} is outside the shard dimension of size {size}")
    return owner_of(size, world_size, index)


def owner_chunks(lo: int, hi: int, size: int, parts: int) -> Iterator[tuple[int, int, int]]:
    """``[lo, hi)`` cut at the ranks' range boundaries, as ``(lo, hi, owner)`` in row order."""
    while lo < hi:
        owner = owner_of(size, parts, lo)
        end = min(hi, shard_bounds(size, owner, parts)[1])
        yield lo, end, owner
        lo = end


@dataclass(frozen=True)
class ShardLayout:
    """Where one parameter's shard sits: full shape, shard dimension and this rank's range."""

    name: str
    full_shape: tuple[int, ...]
    dim: int
    lo: int
    hi: int

    @property
    def shard_shape(self) -> tuple[int, ...]:
        shape = list(self.full_shape) or [1]  # a 0-d parameter is handled as shape [1]
        shape[self.dim] = self.hi - self.lo
        return tuple(shape)

    def slice_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a full tensor (a view)."""
        return full.reshape(self.full_shape or (1,)).narrow(self.dim, self.lo, self.hi - self.lo)


def require_size(size: int) -> None:
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise PlanError(f"shard dimension size must be a non-negative integer, got {size!r}")


def require_positive_int(value: object, what: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PlanError(f"{what} must be a positive integer, got {value!r}")
