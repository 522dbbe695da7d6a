"""The communication plans of Pull Parameter and Push Gradient as data: the LNK op types.

A plan is built by the compiler (``hgraph.passes.lnk``) and run by the runtime (``hgraph.runtime.comm``);
both read these types, so they live in the IR. The fp32 master copy of a parameter is sharded along its
shard dimension over all ``N`` ranks by ``hgraph.shard_rule`` (rank ``r`` owns
``[floor(r*S/N), floor((r+1)*S/N))``), whatever the strategy. See ``hgraph.passes.lnk.plans`` for how
plans are made and in what order a rank runs their ops.
"""
from __future__ import annotations

import functools
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional, Sequence, Union

from hgraph.shard_rule import PlanError, Range, optimizer_segments, require_positive_int, shard_group_ranks

# ---- ranges ------------------------------------------------------------------------------------

def merge_ranges(ranges: Iterable[Range]) -> list[Range]:
    """Sorted union of ranges as disjoint, non-touching ranges (empty ranges dropped)."""
    out: list[list[int]] = []
    for lo, hi in sorted(r for r in ranges if r[0] < r[1]):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


def uncovered_ranges(lo: int, hi: int, covered: Sequence[Range]) -> list[Range]:
    """The parts of ``[lo, hi)`` outside every range of ``covered`` (non-empty, sorted)."""
    out, at = [], lo
    for a, b in merge_ranges(c for c in covered if c[0] < hi and lo < c[1]):
        if a > at:
            out.append((at, a))
        at = max(at, b)
    if at < hi:
        out.append((at, hi))
    return out


# ---- the parameter and the ops -----------------------------------------------------------------

@dataclass(frozen=True)
class ParamLayout:
    """One parameter: its full shape, the dimension sharded by the optimizer and TP, and the bytes per
    element of its fp32 master copy. A 0-d parameter (``shape == ()``, ``shard_dim == 0``) is planned
    as one row of one element (its executor views it as shape ``(1,)``)."""

    name: str
    shape: tuple[int, ...]
    shard_dim: int
    dtype_bytes: int = 4

    def __post_init__(self) -> None:
        shape = tuple(self.shape)
        if any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in shape):
            raise PlanError(f"parameter {self.name!r}: shape must be a tuple of sizes, got {self.shape!r}")
        if not shape and self.shard_dim == 0:       # a 0-d parameter plans as one row of one element
            require_positive_int(self.dtype_bytes, f"parameter {self.name!r} dtype_bytes")
            return
        if not isinstance(self.shard_dim, int) or not -len(shape) <= self.shard_dim < len(shape):
            raise PlanError(f"parameter {self.name!r}: shard_dim {self.shard_dim!r} is outside its "
                            f"{len(shape)} dimensions")
        require_positive_int(self.dtype_bytes, f"parameter {self.name!r} dtype_bytes")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "shard_dim", self.shard_dim % len(shape))

    @property
    def size(self) -> int:
        """Rows along the shard dimension (1 for a 0-d parameter)."""
        return self.shape[self.shard_dim] if self.shape else 1

    @property
    def row_shape(self) -> tuple[int, ...]:
        """The shape of one row (the other dimensions; ``()`` for a 0-d parameter)."""
        return tuple(d for i, d in enumerate(self.shape) if i != self.shard_dim)

    @property
    def row_elements(self) -> int:
        """Elements of one row (the product of the other dimensions)."""
        return math.prod(d for i, d in enumerate(self.shape) if i != self.shard_dim)

    def slice_bytes(self, lo: int, hi: int, dtype_bytes: int | None = None) -> int:
        """Bytes of rows ``[lo, hi)`` in ``dtype_bytes`` per element (default: the master dtype)."""
        return (hi - lo) * self.row_elements * (self.dtype_bytes if dtype_bytes is None else dtype_bytes)


@dataclass(frozen=True, order=True)
class Transfer:
    """Rank ``src`` sends rows ``[lo, hi)`` to rank ``dst`` (``bytes`` on the wire)."""

    src: int
    dst: int
    lo: int
    hi: int
    bytes: int


@dataclass(frozen=True, order=True)
class LocalCopy:
    """Pull: rank ``rank`` owns rows ``[lo, hi)`` and copies (casts) them from its master shard."""

    rank: int
    lo: int
    hi: int


@dataclass(frozen=True, order=True)
class LocalAdd:
    """Push: rank ``rank`` owns rows ``[lo, hi)`` and adds the reduced gradient it holds into its shard."""

    rank: int
    lo: int
    hi: int


@dataclass(frozen=True, order=True)
class ReduceScatter:
    """Push: the ranks of ``group`` (sorted) sum their gradients of rows ``[lo, hi)``; member ``rank``
    receives the reduced rows ``[plo, phi)`` for each ``(rank, plo, phi)`` of ``pieces`` (listed in
    group order, so the i-th input chunk of a torch reduce-scatter is ``pieces[i]``'s rows). Pieces are
    optimizer segments cut to the range (or the even floor split of a range shorter than one segment
    per member); sizes differ by at most one row. ``bytes``: each member's input."""

    group: tuple[int, ...]
    lo: int
    hi: int
    pieces: tuple[tuple[int, int, int], ...]
    bytes: int


PullOp = Union[Transfer, LocalCopy]


PushOp = Union[ReduceScatter, Transfer, LocalAdd]


# ---- plans -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Traffic:
    """Byte accounting shared by both plans."""

    transfers: tuple[Transfer, ...]
    gpus_per_node: int

    def is_intra_node(self, t: Transfer) -> bool:
        return t.src // self.gpus_per_node == t.dst // self.gpus_per_node

    @property
    def total_bytes(self) -> int:
        return sum(t.bytes for t in self.transfers)

    @property
    def intra_node_bytes(self) -> int:
        return sum(t.bytes for t in self.transfers if self.is_intra_node(t))

    @property
    def inter_node_bytes(self) -> int:
        return self.total_bytes - self.intra_node_bytes

    def recv_bytes(self) -> dict[int, int]:
        """Transfer bytes received per rank (ranks receiving nothing are absent)."""
        out: dict[int, int] = defaultdict(int)
        for t in self.transfers:
            out[t.dst] += t.bytes
        return dict(sorted(out.items()))

    def send_bytes(self) -> dict[int, int]:
        """Transfer bytes sent per rank (ranks sending nothing are absent)."""
        out: dict[int, int] = defaultdict(int)
        for t in self.transfers:
            out[t.src] += t.bytes
        return dict(sorted(out.items()))


class _TransferFigures:
    """Byte figures of a plan's LNK transfers (reduce-scatter traffic excluded), from its ``_traffic``."""

    _traffic: "Traffic"
    total_bytes = property(lambda self: self._traffic.total_bytes)
    intra_node_bytes = property(lambda self: self._traffic.intra_node_bytes)
    inter_node_bytes = property(lambda self: self._traffic.inter_node_bytes)

    def recv_bytes(self) -> dict[int, int]:
        """Transfer bytes received per rank."""
        return self._traffic.recv_bytes()

    def send_bytes(self) -> dict[int, int]:
        """Transfer bytes sent per rank."""
        return self._traffic.send_bytes()

    def is_intra_node(self, t: Transfer) -> bool:
        return self._traffic.is_intra_node(t)


@dataclass(frozen=True)
class PullPlan(_TransferFigures):
    """How ranks get the working-dtype rows they need of one parameter from its optimizer owners.

    ``assembly[rank][i]`` lists, in order, the sub-ranges that tile ``needs[rank][i]``; each lies inside
    exactly one op of that rank (a ``LocalCopy`` of the rank or a ``Transfer`` to it).
    """

    param: ParamLayout
    world_size: int
    gpus_per_node: int
    working_dtype_bytes: int
    needs: Mapping[int, tuple[Range, ...]]
    slices: tuple[Range, ...]
    local_copies: tuple[LocalCopy, ...]
    transfers: tuple[Transfer, ...]
    assembly: Mapping[int, tuple[tuple[Range, ...], ...]]
    is_all_gather: bool
    _traffic: Traffic = field(repr=False, compare=False)
    #: ranks over which the optimizer shards the parameter (``hgraph.shard_rule.shard_group_ranks``;
    #: ``None``: the world): ops never leave a shard group, and an all-gather gathers inside each
    shard_group: Optional[int] = None

    @property
    def group_size(self) -> int:
        """The size of a shard group (the world when the optimizer shards over all ranks)."""
        return self.shard_group or self.world_size

    @property
    def all_gather_ranks(self) -> tuple[int, ...]:
        """Rank order of the all-gather of rank 0's shard group (chunk ``i`` comes from its ``i``-th
        rank; another group's is ``all_gather_group``); empty unless ``is_all_gather``."""
        return self.all_gather_group(0)

    def all_gather_group(self, rank: int) -> tuple[int, ...]:
        """The ranks ``rank`` all-gathers with, in chunk order (its shard group); empty unless
        ``is_all_gather``."""
        return shard_group_ranks(rank, self.group_size) if self.is_all_gather else ()

    @property
    def all_gather_segments(self) -> tuple[Range, ...]:
        """Rows contributed by each rank of an all-gather's group (uneven by one row when G does not
        divide S: the executor pads chunks to the largest for an equal-size all-gather)."""
        if not self.is_all_gather:
            return ()
        return tuple(optimizer_segments(self.param.size, self.group_size))

    def for_rank(self, rank: int) -> tuple[PullOp, ...]:
        """Ops involving ``rank``: its transfers (sends and receives) in global order, then its copies."""
        return self._ops_by_rank.get(rank, ())

    @functools.cached_property
    def _ops_by_rank(self) -> dict[int, tuple[PullOp, ...]]:
        # one pass over the ops for every rank (instantiating 64 ranks asked each rank in turn: O(N^2))
        return _index_by_rank(((t, (t.src, t.dst)) for t in self.transfers),
                              ((c, (c.rank,)) for c in self.local_copies))

    @property
    def local_bytes(self) -> int:
        """Working-dtype bytes produced by local copies."""
        return sum(self.param.slice_bytes(c.lo, c.hi, self.working_dtype_bytes) for c in self.local_copies)

    def to_dict(self) -> dict:
        """JSON-ready plan: the figures of ``summary`` plus every op as a list of integers."""
        return {**self.summary(),
                "all_gather_ranks": list(self.all_gather_ranks),
                "local_copies": [[c.rank, c.lo, c.hi] for c in self.local_copies],
                "transfers": [[t.src, t.dst, t.lo, t.hi, t.bytes] for t in self.transfers]}

    def summary(self) -> dict:
        """JSON-ready figures of the plan."""
        recv = self.recv_bytes()
        return {"param": self.param.name, "kind": "all_gather" if self.is_all_gather else "lnk",
                "mutual_slices": len(self.slices), "transfers": len(self.transfers),
                "local_copies": len(self.local_copies), "bytes": self.total_bytes,
                "intra_node_bytes": self.intra_node_bytes, "inter_node_bytes": self.inter_node_bytes,
                "local_bytes": self.local_bytes, "max_recv_bytes": max(recv.values(), default=0)}


@dataclass(frozen=True)
class PushPlan(_TransferFigures):
    """How partial gradients of one parameter reach the optimizer owners, summed.

    Order of execution: ``reduce_scatters`` (replicas sum a range, each member keeps one piece), then
    ``transfers`` (the sender's source is the unique buffer it holds containing the rows: its reduced
    piece, or its own contribution for rows that no reduce-scatter of its carries, ``uncovered_ranges``)
    and ``local_adds``.
    An owner's gradient is the sum of its local adds and of the transfers it receives.
    """

    param: ParamLayout
    world_size: int
    gpus_per_node: int
    grad_dtype_bytes: int
    contributions: Mapping[int, tuple[Range, ...]]
    replica_groups: tuple[tuple[int, ...], ...]
    slices: tuple[Range, ...]
    reduce_scatters: tuple[ReduceScatter, ...]
    transfers: tuple[Transfer, ...]
    local_adds: tuple[LocalAdd, ...]
    is_plain_reduce_scatter: bool
    _traffic: Traffic = field(repr=False, compare=False)
    #: as ``PullPlan.shard_group``: each group's owners end with the sum of their group's contributions,
    #: and the runtime then sums each shard across the groups (``hgraph.shard_rule.replica_ranks``)
    shard_group: Optional[int] = None

    @property
    def group_size(self) -> int:
        """The size of a shard group (the world when the optimizer shards over all ranks)."""
        return self.shard_group or self.world_size

    def for_rank(self, rank: int) -> tuple[PushOp, ...]:
        """Ops involving ``rank``: its reduce-scatters, transfers (global order), then its local adds."""
        return self._ops_by_rank.get(rank, ())

    @functools.cached_property
    def _ops_by_rank(self) -> dict[int, tuple[PushOp, ...]]:
        return _index_by_rank(((rs, rs.group) for rs in self.reduce_scatters),
                              ((t, (t.src, t.dst)) for t in self.transfers),
                              ((a, (a.rank,)) for a in self.local_adds))

    def reduce_scatter_recv_bytes(self) -> dict[int, int]:
        """Bytes each member receives in its reduce-scatters: a ring over chunks padded to the largest
        piece (what an equal-chunk reduce-scatter moves), ``(k - 1) x largest piece`` per member."""
        out: dict[int, int] = defaultdict(int)
        for rs in self.reduce_scatters:
            largest = max(self.param.slice_bytes(lo, hi, self.grad_dtype_bytes) for _, lo, hi in rs.pieces)
            for rank in rs.group:
                out[rank] += (len(rs.group) - 1) * largest
        return dict(sorted(out.items()))

    @property
    def reduce_scatter_bytes(self) -> int:
        return sum(self.reduce_scatter_recv_bytes().values())

    def to_dict(self) -> dict:
        """JSON-ready plan: the figures of ``summary`` plus every op as lists of integers."""
        return {**self.summary(),
                "reduce_scatters": [{"group": list(rs.group), "lo": rs.lo, "hi": rs.hi,
                                     "pieces": [list(p) for p in rs.pieces]} for rs in self.reduce_scatters],
                "transfers": [[t.src, t.dst, t.lo, t.hi, t.bytes] for t in self.transfers],
                "local_adds": [[a.rank, a.lo, a.hi] for a in self.local_adds]}

    def summary(self) -> dict:
        """JSON-ready figures of the plan."""
        send = self.send_bytes()
        return {"param": self.param.name,
                "kind": "plain_reduce_scatter" if self.is_plain_reduce_scatter else "rs+lnk",
                "mutual_slices": len(self.slices), "reduce_scatters": len(self.reduce_scatters),
                "reduce_scatter_bytes": self.reduce_scatter_bytes, "transfers": len(self.transfers),
                "local_adds": len(self.local_adds), "bytes": self.total_bytes,
                "intra_node_bytes": self.intra_node_bytes, "inter_node_bytes": self.inter_node_bytes,
                "max_send_bytes": max(send.values(), default=0)}


def _index_by_rank(*kinds: Iterable[tuple[object, Sequence[int]]]) -> dict[int, tuple]:
    """``rank -> ops involving it``, kind after kind, each kind in its given order (an op listed once
    per rank even when it names the rank twice)."""
    out: dict[int, list] = defaultdict(list)
    for ops in kinds:
        for op, ranks in ops:
            for r in dict.fromkeys(ranks):
                out[r].append(op)
    return {r: tuple(v) for r, v in out.items()}

