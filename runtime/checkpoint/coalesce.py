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
  world (70B: 13,053), and a chunk is never finer than one rank's rows (an entry of large
  shards is written by its owners, as before);
* one member of the block writes the chunk: the ``item``-th (mod the block's size), ``item`` being
  the entry's place in the state (``3 x parameter + moment``), so the entries of a block spread over
  its members: every rank writes about its own share of the state plus at most a chunk or two, and
  never a whole large parameter (a chunk holds less than twice ``MIN_CHUNK_BYTES``, or one rank's
  rows when those are larger);
* the other members' rows reach it point to point up a tree rooted at it (``gather_chunks``: in each
  round a rank receives from at most ``FAN_IN - 1 = 7`` others, and sends once, in ``log_8`` of the
  block's size rounds of one ``batch_isend_irecv`` each; no world collective). A chunk gathers the rows
  of every rank of its block that holds some (``Chunk.sources``: about ``G / blocks``, under
  ``--shard-group world`` at 12,288 ranks up to 8,192 ranks of one element each for a 70B norm weight:
  five rounds), once per save (``cluster_scale --counts`` reports both). A rank inside the tree holds
  its subtree's rows (at most the chunk) until it passes them on; the tree's places are counted from
  the writer, so they too differ from entry to entry.

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

from hgraph.runtime.comm.p2p import host_staged
from hgraph.shard_rule import owner_of, shard_bounds

#: the least bytes of a chunk (an entry smaller than that is one chunk); see the module for why
MIN_CHUNK_BYTES = 64 << 20
#: the most ranks a rank receives rows from in one round of a chunk's gather (``gather_chunks``)
FAN_IN = 8


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
    def row_elements(self) -> int:
        return math.prod(self.shape) // self.rows if self.rows else 0

    @property
    def row_bytes(self) -> int:
        return self.itemsize * self.row_elements


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


def gather_chunks(entries: Sequence[Entry], shards: Sequence[torch.Tensor], rank: int, group_size: int,
                  group: Optional[dist.ProcessGroup] = None, min_bytes: int = MIN_CHUNK_BYTES,
                  fan_in: Optional[int] = None) -> dict[int, torch.Tensor]:
    """The chunks this rank writes, by entry item, gathered from the rows of its blocks' members.

    ``shards[i]``: this rank's rows of ``entries[i]`` (shard shape); ``rank`` is this rank's place in
    the first shard group (``rank < group_size``; ranks of the other groups write nothing and do not
    call). Point to point within each block only (``group``: the save's process group, whose ranks are
    the shard group's places), up a tree rooted at the writer (``_Tree``: a rank receives from at most
    ``fan_in - 1`` others a round, whatever the block's size), one ``batch_isend_irecv`` a round; the
    chunks come back on the host.
    """
    fan_in = fan_in or FAN_IN
    held: dict[int, tuple[_Tree, int, list[torch.Tensor]]] = {}    # item -> (tree, place, its pieces)
    for entry, shard in zip(entries, shards):
        block = own_block(entry, rank, group_size, min_bytes)
        if block.hi <= block.lo:
            continue
        tree = _Tree(entry, block, group_size, fan_in)
        # gloo's point-to-point takes host tensors only (a CUDA send aborts the process)
        device = torch.device("cpu") if host_staged(shard.device, group) else shard.device
        held[entry.item] = (tree, tree.place(rank), [shard.contiguous().reshape(-1).to(device)])
    for level in range(max((t.depth for t, _, _ in held.values()), default=0)):
        step = fan_in ** level
        ops, sent = [], []
        for item, (tree, q, pieces) in held.items():
            if level >= tree.depth or q % step:
                continue
            if q % (step * fan_in):           # up to the parent, once: the rows of this rank's subtree
                flat = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
                if flat.numel():
                    ops.append(dist.P2POp(dist.isend, flat, _peer(group, tree.rank_at(q - q % (step * fan_in))),
                                          group, tag=item))
                sent.append(item)
                continue
            for child in range(q + step, min(q + step * fan_in, tree.size), step):
                n = tree.elements(child, step)
                if n:
                    buf = torch.empty(n, dtype=pieces[0].dtype, device=pieces[0].device)
                    ops.append(dist.P2POp(dist.irecv, buf, _peer(group, tree.rank_at(child)), group, tag=item))
                    pieces.append(buf)
        if ops:
            # only the block's members take part: NCCL allows that on a group that has run a collective
            # before (a run's world group has; the asynchronous checkpoint's group is gloo)
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        for item in sent:
            del held[item]
    return {item: tree.assemble(torch.cat([p.to("cpu") for p in pieces])) for item, (tree, _, pieces) in held.items()}


def gather_rounds(ranks: int, fan_in: Optional[int] = None) -> int:
    """The rounds of a gather tree over a block of ``ranks`` ranks: the least ``R`` with
    ``fan_in ** R >= ranks``."""
    fan_in, rounds = fan_in or FAN_IN, 0
    while fan_in ** rounds < ranks:
        rounds += 1
    return rounds


class _Tree:
    """One entry's gather over its block: place ``q`` is the rank ``q`` after the writer (wrapping
    round the block), so the writer is place 0; at round ``L`` the places that are multiples of
    ``fan_in ** (L + 1)`` receive the rows of the next ``fan_in - 1`` subtrees of ``fan_in ** L``
    places, which send them (the rows of their places, in place order) and are done."""

    def __init__(self, entry: Entry, block: Chunk, group_size: int, fan_in: int) -> None:
        self.entry, self.block, self.group_size = entry, block, group_size
        self.size = block.stop - block.first
        self.depth = gather_rounds(self.size, fan_in)

    def place(self, rank: int) -> int:
        return (rank - self.block.writer) % self.size

    def rank_at(self, place: int) -> int:
        return self.block.first + (self.block.writer - self.block.first + place) % self.size

    def _rows(self, first: int, stop: int) -> int:
        """Rows of the ranks ``[first, stop)`` (consecutive ranks hold consecutive rows)."""
        if stop <= first:
            return 0
        return shard_bounds(self.entry.rows, stop - 1, self.group_size)[1] - shard_bounds(self.entry.rows, first, self.group_size)[0]

    def elements(self, place: int, count: int) -> int:
        """Elements of the rows of places ``[place, place + count)`` (at most two runs of ranks)."""
        count = min(count, self.size - place)
        start = self.rank_at(place)
        tail = min(count, self.block.stop - start)
        rows = self._rows(start, start + tail) + self._rows(self.block.first, self.block.first + count - tail)
        return rows * self.entry.row_elements

    def assemble(self, flat: torch.Tensor) -> torch.Tensor:
        """The chunk from its places' rows, each flattened, in place order (the ranks from the writer on,
        then those before it): each rank's rows cut out and put back in rank order along the dimension."""
        pieces, at = [], 0
        for place in range(self.size):
            rank = self.rank_at(place)
            rows = self._rows(rank, rank + 1)
            n = rows * self.entry.row_elements
            if rows:
                pieces.append((rank, flat[at:at + n].reshape(_rows_shape(self.entry, rows))))
            at += n
        return torch.cat([t for _, t in sorted(pieces, key=lambda p: p[0])], dim=self.entry.dim).contiguous()


def _rows_shape(entry: Entry, rows: int) -> list[int]:
    shape = list(entry.shape)
    shape[entry.dim] = rows
    return shape


def _peer(group: Optional[dist.ProcessGroup], rank: int) -> int:
    """The global rank of ``rank`` of ``group`` (``P2POp`` names peers by their global rank)."""
    return rank if group is None or group is dist.group.WORLD else dist.get_global_rank(group, rank)
