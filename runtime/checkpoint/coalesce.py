"""A checkpoint's chunks: each parameter's shards coalesced into a number of DCP chunks that does not
grow with the world.

Written as the optimizer holds them, a checkpoint's ``.metadata`` would list a chunk per parameter,
moment and rank of the first shard group: at ``--shard-group world`` it grows with the world (the zoo's
70B at 12,288 ranks: 17 million chunks, 2.5 GB that rank 0 builds for a minute and a half and every
rank reads for a minute on resume; ``python -m hgraph.tools.bench.cluster_scale --counts``). So each
*entry* (a parameter's masters, or one of its Adam moments) is cut instead into chunks of
``MIN_CHUNK_BYTES`` or more (an entry smaller than that is one chunk; blocks are whole ranks, so a
chunk may miss it by the rows of a rank or two), each the rows of a block of consecutive ranks of the
first shard group:

* an entry of ``B`` bytes over ``G`` ranks has ``min(G, rows, max(1, B // MIN_CHUNK_BYTES))`` blocks,
  block ``c`` holding ranks ``shard_bounds(G, c, blocks)`` (``chunk_count``, ``block_at``), so the
  ``.metadata`` holds at most ``3 x parameters + state bytes / MIN_CHUNK_BYTES`` chunks whatever the
  world (70B: about 15,000), and a chunk is never finer than one rank's rows (an entry of large
  shards is written by its owners, as before);
* one member of the block writes the chunk: the ``item``-th (mod the block's size), ``item`` being
  the entry's place in the state (``3 x parameter + moment``), so the entries of a block spread over
  its members: every rank writes about its own share of the state plus at most a chunk or two, and
  never a whole large parameter (a chunk holds less than twice ``MIN_CHUNK_BYTES``, or one rank's
  rows when those are larger);
* the other members send it their rows, point to point (``gather_chunks``: one
  ``batch_isend_irecv`` of the block's members, no world collective, a rank's peers are its blocks'
  members). A writer gathers from every rank of its block that holds rows (``Chunk.sources``): at most
  G, about ``G / blocks``; under ``--shard-group world`` at 12,288 ranks (70B) up to about 2,000 ranks
  of one or two rows each, once per save (``cluster_scale --counts`` reports the largest).

Why a minimum size rather than a fixed number of chunks per entry: a fixed number ``K`` puts
``1/K`` of every entry on one writer whatever its size (a 70B embedding's moments: 1.6 GB a writer
for ``K = 8``), or needs ``K`` large enough for the largest entry, which multiplies every small
entry's chunks; with a minimum size a writer holds at most about twice that per chunk, small entries
are one chunk each, and the count follows the state's bytes, not the world's ranks. 64 MiB keeps
DCP's per-chunk costs (a storage entry, an archive header, one read item per overlapping chunk on
resume) far below the bytes they carry.

A resume reads any chunking (``rows_read.RowsPlanner`` / ``RowsReader``), and ``dcp.load`` into a
plain model sees the same entries in full-tensor shapes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from hgraph.shard_rule import owner_of, shard_bounds

#: the least bytes of a chunk (an entry smaller than that is one chunk); see the module for why
MIN_CHUNK_BYTES = 64 << 20


@dataclass(frozen=True)
class Chunk:
    """Rows ``[lo, hi)`` of an entry along its shard dimension: those of ranks ``[first, stop)`` of the
    shard group, written by ``writer``."""

    first: int
    stop: int
    lo: int
    hi: int
    writer: int

    @property
    def sources(self) -> int:
        """How many ranks of the block hold rows of it (each at least one row when any rank has none)."""
        return min(self.stop - self.first, self.hi - self.lo)


@dataclass(frozen=True)
class Entry:
    """One tensor of the state as the optimizer shards it: ``item``, its place in the state (it picks
    the block member that writes); the full shape (``()`` for a 0-d parameter, handled as ``(1,)``),
    the shard dimension and the bytes of one element."""

    item: int
    full_shape: tuple[int, ...]
    dim: int
    itemsize: int = 4

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.full_shape) or (1,)

    @property
    def rows(self) -> int:
        return self.shape[self.dim]

    @property
    def row_bytes(self) -> int:
        return self.itemsize * (math.prod(self.shape) // self.rows if self.rows else 0)


def chunk_count(entry: Entry, group_size: int, min_bytes: int = MIN_CHUNK_BYTES) -> int:
    """How many blocks of ranks ``entry`` is cut into: chunks of at least ``min_bytes``, at most one
    per rank, at least one."""
    return max(1, min(group_size, entry.rows, entry.rows * entry.row_bytes // max(1, min_bytes)))


def block_at(entry: Entry, block: int, group_size: int, count: int) -> Chunk:
    """Block ``block`` of ``count`` of ``entry`` over a shard group of ``group_size`` ranks (its rows may
    be empty when the entry has fewer rows than ranks)."""
    first, stop = shard_bounds(group_size, block, count)
    lo = shard_bounds(entry.rows, first, group_size)[0]
    hi = shard_bounds(entry.rows, stop - 1, group_size)[1]
    return Chunk(first, stop, lo, hi, first + entry.item % (stop - first))


def own_block(entry: Entry, rank: int, group_size: int, min_bytes: int = MIN_CHUNK_BYTES) -> Chunk:
    """The block holding ``rank`` (a rank of the first shard group): arithmetic, no list of blocks."""
    count = chunk_count(entry, group_size, min_bytes)
    return block_at(entry, owner_of(group_size, count, rank), group_size, count)


def chunks(entry: Entry, group_size: int, min_bytes: int = MIN_CHUNK_BYTES) -> list[Chunk]:
    """Every chunk of ``entry`` that holds rows, in row order (what the ``.metadata`` lists)."""
    count = chunk_count(entry, group_size, min_bytes)
    out = [block_at(entry, c, group_size, count) for c in range(count)]
    return [c for c in out if c.hi > c.lo]


def _exchange_device(group: Optional[dist.ProcessGroup], device: torch.device) -> torch.device:
    # gloo's point-to-point takes host tensors only (a CUDA send aborts the process)
    return torch.device("cpu") if dist.get_backend(group) == "gloo" else device


def gather_chunks(entries: Sequence[Entry], shards: Sequence[torch.Tensor], rank: int, group_size: int,
                  group: Optional[dist.ProcessGroup] = None,
                  min_bytes: int = MIN_CHUNK_BYTES) -> dict[int, torch.Tensor]:
    """The chunks this rank writes, by entry item, gathered from the rows of its blocks' members.

    ``shards[i]``: this rank's rows of ``entries[i]`` (shard shape); ``rank`` is this rank's place in
    the first shard group (``rank < group_size``; ranks of the other groups write nothing and do not
    call). Point to point within each block only (``group``: the save's process group, whose ranks are
    the shard group's places); the chunks come back on the host.
    """
    ops, pieces = [], {}
    for entry, shard in zip(entries, shards):
        block = own_block(entry, rank, group_size, min_bytes)
        if block.hi <= block.lo:
            continue
        device = _exchange_device(group, shard.device)
        if block.writer != rank:
            if shard.numel():
                ops.append(dist.P2POp(dist.isend, shard.to(device).contiguous(), _peer(group, block.writer),
                                      group, tag=entry.item))
            continue
        parts = []
        for src in range(block.first, block.stop):
            lo, hi = shard_bounds(entry.rows, src, group_size)
            if hi <= lo:
                continue
            if src == rank:
                parts.append(shard.reshape(_rows_shape(entry, hi - lo)))
                continue
            buf = torch.empty(_rows_shape(entry, hi - lo), dtype=shard.dtype, device=device)
            ops.append(dist.P2POp(dist.irecv, buf, _peer(group, src), group, tag=entry.item))
            parts.append(buf)
        pieces[entry.item] = (entry, parts)
    if ops:
        # only the block's members take part: NCCL allows that on a group that has run a collective
        # before (a run's world group has; the asynchronous checkpoint's group is gloo)
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return {item: torch.cat([p.to("cpu") for p in parts], dim=entry.dim).contiguous()
            for item, (entry, parts) in pieces.items()}


def _rows_shape(entry: Entry, rows: int) -> list[int]:
    shape = list(entry.shape)
    shape[entry.dim] = rows
    return shape


def _peer(group: Optional[dist.ProcessGroup], rank: int) -> int:
    """The global rank of ``rank`` of ``group`` (``P2POp`` names peers by their global rank)."""
    return rank if group is None or group is dist.group.WORLD else dist.get_global_rank(group, rank)
