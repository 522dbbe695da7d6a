"""Pull Parameter and Push Gradient communication plans (the LNK operator of Hydraulis §5.2) as data.

The fp32 master copy of a parameter is sharded along its shard dimension over all ``N`` ranks
by ``hgraph.shard_rule`` (rank ``r`` owns ``[floor(r*S/N), floor((r+1)*S/N))``), whatever the strategy.

* **Pull** (``pull_plan``): each rank needs some ranges of the shard dimension in the working dtype.
  The owner casts its fp32 rows to the working dtype *before* sending, so a transfer's ``bytes`` are
  counted in the working dtype. Each needed piece is a ``LocalCopy`` when the rank owns it, else a
  ``Transfer`` from its owner. When every rank needs the whole parameter the plan is an all-gather
  (``PullPlan.is_all_gather``, concatenation in ``all_gather_ranks`` order).
* **Push** (``push_plan``): each rank holds partial gradients on some ranges; owners must end with the
  sum of all contributions on their segment. Replicas holding the same ranges first reduce-scatter
  (``ReduceScatter``: runs of one optimizer segment per member, a member keeping its own segment when
  it owns one; rows of the last fewer-than-a-run segments are not reduced but sent by every member);
  each member then forwards its reduced piece (or its own rows) to the owners of the rows
  (``Transfer``; the owner adds what it receives into its fp32 gradient) or adds it itself when it
  owns them (``LocalAdd``). This moves the least bytes a summing push can (``min_reduce_push_bytes``)
  up to the padding of segments that differ by one row. Which member receives which piece is
  chosen by min-cost matching (``passes/lnk/assignment``). When every rank of the world is one
  replica group contributing the whole parameter the plan is one plain reduce-scatter
  (``PushPlan.is_plain_reduce_scatter``) and no LNK traffic.

Plans are deterministic (sorted) and built on mutual slices (``mutual_slices``); by default adjacent
slices that travel between the same two ranks inside one contiguous range are coalesced into one op
(same bytes, fewer messages); ``coalesce=False`` keeps one op per mutual slice.

Execution order: ``plan.for_rank(r)`` lists the ops that involve rank ``r``: reduce-scatters, then
transfers, then local ops, each in the plan's global order (transfers sorted by ``(src, dst, lo)``).
Every rank issuing its ops in that order matches sends with receives and cannot deadlock even with
blocking point-to-point calls: the globally first unfinished transfer always has both of its ranks
waiting on it. With several parameters, every rank must walk the plans in one shared parameter order
(e.g. the model's parameter order) for the same argument to hold.

Plans for the same layout are computed once: the op lists depend only on the shard-dimension size,
bytes per row, world size, node size and layouts, so the layers of a model share them (LRU cache).
"""
from __future__ import annotations

import functools
from collections import defaultdict
from types import MappingProxyType
from typing import Mapping, Sequence

import numpy as np

from hgraph.comm_plan import (LocalAdd, LocalCopy, ParamLayout, PullPlan, PushPlan, ReduceScatter, Traffic,
                              Transfer, merge_ranges, uncovered_ranges)
from hgraph.passes.lnk.assignment import (LinkWeights, assign_pieces_by_load, assign_pieces_matrix,
                                          assign_pieces_sparse)
from hgraph.passes.lnk.mutual_slices import mutual_slices, normalise_ranges, slices_within
from hgraph.shard_rule import PlanError, Range, optimizer_segments, owner_chunks, owner_of, require_positive_int


# ---- plans -------------------------------------------------------------------------------------


# ---- pull --------------------------------------------------------------------------------------

def pull_plan(param: ParamLayout, needs: Mapping[int, Sequence[Range]], world_size: int, gpus_per_node: int,
              *, working_dtype_bytes: int | None = None, coalesce: bool = True) -> PullPlan:
    """Plan Pull Parameter for ``param``: ``needs[rank]`` lists the row ranges ``rank`` must hold in the
    working dtype (``working_dtype_bytes`` per element, default the master dtype's; the owner casts its
    fp32 rows before sending, so transfers are counted in the working dtype). Ranks absent from
    ``needs`` (other stages) get nothing. A rank's overlapping ranges are fetched once."""
    _check_world(world_size, gpus_per_node)
    wbytes = param.dtype_bytes if working_dtype_bytes is None else working_dtype_bytes
    require_positive_int(wbytes, "working_dtype_bytes")
    norm = _normalise_layout(needs, param.size, world_size, "needs")
    key = tuple(norm.items())
    slices, copies, transfers, assembly, all_gather = _pull_ops(
        param.size, param.row_elements * wbytes, world_size, key, coalesce)
    return PullPlan(param, world_size, gpus_per_node, wbytes, norm, slices, copies, transfers, assembly,
                    all_gather, Traffic(transfers, gpus_per_node))


@functools.lru_cache(maxsize=1024)
def _pull_ops(size: int, row_bytes: int, world_size: int, needs: tuple[tuple[int, tuple[Range, ...]], ...],
              coalesce: bool):
    """The ops of a pull plan, from hashable inputs: layers of one model repeat the same layout, so the
    plans of their parameters are computed once (the result is immutable)."""
    slices = mutual_slices(optimizer_segments(size, world_size), *(ranges for _, ranges in needs))
    copies: list[LocalCopy] = []
    transfers: list[Transfer] = []
    assembly: dict[int, tuple[tuple[Range, ...], ...]] = {}
    for rank, ranges in needs:
        held: list[Range] = []
        for lo, hi in merge_ranges(ranges):
            for run_lo, run_hi, owner in _owner_runs(slices_within(slices, lo, hi), size, world_size, coalesce):
                held.append((run_lo, run_hi))
                if owner == rank:
                    copies.append(LocalCopy(rank, run_lo, run_hi))
                else:
                    transfers.append(Transfer(owner, rank, run_lo, run_hi, (run_hi - run_lo) * row_bytes))
        assembly[rank] = tuple(_tile(lo, hi, held) for lo, hi in ranges)
    all_gather = (size > 0 and [r for r, _ in needs] == list(range(world_size))
                  and all(ranges == ((0, size),) for _, ranges in needs))
    return (tuple(slices), tuple(sorted(copies)), tuple(sorted(transfers)), MappingProxyType(assembly),
            all_gather)


def min_pull_bytes(param: ParamLayout, needs: Mapping[int, Sequence[Range]], world_size: int,
                   *, working_dtype_bytes: int | None = None) -> dict[int, int]:
    """The least bytes each needing rank must receive: the rows it needs (union) that it does not own."""
    wbytes = param.dtype_bytes if working_dtype_bytes is None else working_dtype_bytes
    norm = _normalise_layout(needs, param.size, world_size, "needs")
    segments = optimizer_segments(param.size, world_size)
    out = {}
    for rank in sorted(norm):
        rows = sum(hi - lo for lo, hi in merge_ranges(norm[rank]))
        rows -= _overlap(merge_ranges(norm[rank]), segments[rank])
        out[rank] = rows * param.row_elements * wbytes
    return out


# ---- push --------------------------------------------------------------------------------------

def replica_groups_from(contributions: Mapping[int, Sequence[Range]]) -> list[tuple[int, ...]]:
    """Group ranks whose non-empty contributed ranges are identical (sorted groups, sorted by first rank);
    ranks contributing nothing are left out."""
    by_layout: dict[tuple[Range, ...], list[int]] = defaultdict(list)
    for rank in sorted(contributions):
        key = tuple(sorted(r for r in normalise_ranges(contributions[rank], what=f"rank {rank} range")
                           if r[0] < r[1]))
        if key:
            by_layout[key].append(rank)
    return sorted(tuple(g) for g in by_layout.values())


def push_plan(param: ParamLayout, contributions: Mapping[int, Sequence[Range]], world_size: int,
              gpus_per_node: int, replica_groups: Sequence[Sequence[int]] | None = None, *,
              grad_dtype_bytes: int | None = None, weights: LinkWeights = LinkWeights(),
              coalesce: bool = True, cover: bool = True) -> PushPlan:
    """Plan Push Gradient for ``param``.

    ``contributions[rank]``: the disjoint row ranges on which ``rank`` holds a partial gradient (in
    ``grad_dtype_bytes`` per element, default the master dtype's). Together they must cover every row;
    each owner ends with the sum of all contributions on its segment. ``replica_groups``: sets of ranks
    holding identical ranges (e.g. the same TP rank of ``D`` pipelines); they reduce-scatter first.
    Contributors in no group act alone; ``None`` groups identical layouts (``replica_groups_from``).
    ``weights`` price a row sent intra- vs inter-node when choosing which member keeps which piece.
    ``cover=False``: the contributions may leave rows out (a shard group's part of the world,
    ``passes/lnk/shard_groups``); their owners receive nothing for them.
    """
    _check_world(world_size, gpus_per_node)
    gbytes = param.dtype_bytes if grad_dtype_bytes is None else grad_dtype_bytes
    require_positive_int(gbytes, "grad_dtype_bytes")
    size = param.size
    norm = _normalise_layout(contributions, size, world_size, "contributions")
    layout = {r: tuple(sorted(x for x in rs if x[0] < x[1])) for r, rs in norm.items()}
    for rank, ranges in layout.items():
        if sum(hi - lo for lo, hi in ranges) != sum(hi - lo for lo, hi in merge_ranges(ranges)):
            raise PlanError(f"rank {rank} contributes overlapping ranges {list(norm[rank])}: "
                            "a rank's gradient ranges must be disjoint")
    covered = merge_ranges(r for rs in layout.values() for r in rs)
    if cover and covered and covered != [(0, size)]:
        raise PlanError(f"parameter {param.name!r}: gradient contributions cover rows {covered} but the "
                        f"optimizer needs all rows [0, {size})")
    groups = _check_groups(replica_groups, layout, world_size) if replica_groups is not None \
        else replica_groups_from(layout)
    grouped = {r for g in groups for r in g}
    groups = sorted([*groups, *((r,) for r in layout if layout[r] and r not in grouped)])

    key = tuple((r, layout[r]) for r in sorted(layout))
    slices, scatters, transfers, adds = _push_ops(size, param.row_elements * gbytes, world_size, gpus_per_node,
                                                  key, tuple(groups), weights, coalesce)
    plain = (size > 0 and not transfers and groups == [tuple(range(world_size))]
             and all(layout.get(r) == ((0, size),) for r in range(world_size)))
    return PushPlan(param, world_size, gpus_per_node, gbytes, norm, tuple(groups), slices, scatters, transfers,
                    adds, plain, Traffic(transfers, gpus_per_node))


@functools.lru_cache(maxsize=1024)
def _push_ops(size: int, row_bytes: int, world_size: int, gpus_per_node: int,
              layout_items: tuple[tuple[int, tuple[Range, ...]], ...], groups: tuple[tuple[int, ...], ...],
              weights: LinkWeights, coalesce: bool):
    """The ops of a push plan, from hashable inputs (computed once per distinct layout, like ``_pull_ops``)."""
    layout = dict(layout_items)
    held: dict[int, list[Range]] = defaultdict(list)
    scatters: list[ReduceScatter] = []
    for group in groups:
        if len(group) == 1:
            held[group[0]].extend(layout[group[0]])
            continue
        group_scatters, group_held = replica_group_push(size, row_bytes, world_size, gpus_per_node,
                                                        layout[group[0]], group, weights)
        scatters.extend(group_scatters)
        for m, ranges in group_held.items():
            held[m].extend(ranges)

    slices = mutual_slices(optimizer_segments(size, world_size), *layout.values(), *held.values())
    transfers: list[Transfer] = []
    adds: list[LocalAdd] = []
    for rank in sorted(held):
        for lo, hi in sorted(held[rank]):
            for run_lo, run_hi, owner in _owner_runs(slices_within(slices, lo, hi), size, world_size, coalesce):
                if owner == rank:
                    adds.append(LocalAdd(rank, run_lo, run_hi))
                else:
                    transfers.append(Transfer(rank, owner, run_lo, run_hi, (run_hi - run_lo) * row_bytes))
    return tuple(slices), tuple(sorted(scatters)), tuple(sorted(transfers)), tuple(sorted(adds))


# a strategy's rank touches a few dozen (layout, group) pairs; a group at 12,288 GPUs holds thousands of
# pieces, so the cache is kept small enough not to pile up strategies' worth of them
@functools.lru_cache(maxsize=128)
def replica_group_push(size: int, row_bytes: int, world_size: int, gpus_per_node: int,
                       ranges: tuple[Range, ...], group: tuple[int, ...], weights: LinkWeights
                       ) -> tuple[tuple[ReduceScatter, ...], Mapping[int, tuple[Range, ...]]]:
    """The reduce-scatters of one replica ``group`` (two or more ranks contributing the same
    ``ranges``) and the rows each member holds after them (its reduced pieces, and the rows left to
    direct sends), which it forwards to their owners.

    A group's outcome depends on nothing outside it (the members' send loads are the group's own), so
    the push of the world (``push_plan``) and one rank's part of it (``passes/lnk/rank_plans``) both
    build on this, and the layers of a model (same size, same ranges, same group) share it.
    """
    held: dict[int, list[Range]] = defaultdict(list)
    scatters: list[ReduceScatter] = []
    sent_load: dict[int, int] = defaultdict(int)
    for lo, hi in sorted(ranges, key=lambda r: (r[0] - r[1], r[0])):   # largest first for balance
        runs, direct = _scatter_runs(lo, hi, len(group), size, world_size)
        if direct is not None:          # each member sends its own rows to the owners
            for m in group:
                held[m].append(direct)
        for run_lo, run_hi, pieces in runs:
            member_of = _choose_receivers(group, pieces, size, world_size, gpus_per_node, weights, sent_load)
            for (plo, phi), m in zip(pieces, member_of):
                sent_load[m] += sum(b - a for a, b, o in owner_chunks(plo, phi, size, world_size) if o != m)
                held[m].append((plo, phi))
            scatters.append(ReduceScatter(
                group, run_lo, run_hi, tuple(sorted((m, *pieces[p]) for p, m in enumerate(member_of))),
                (run_hi - run_lo) * row_bytes))
    return tuple(scatters), MappingProxyType({m: tuple(v) for m, v in held.items()})


def _scatter_runs(lo: int, hi: int, k: int, size: int, world_size: int
                  ) -> tuple[list[tuple[int, int, list[Range]]], Range | None]:
    """``[lo, hi)`` as reduce-scatter runs ``(run_lo, run_hi, k pieces)`` for a group of ``k`` ranks,
    and the range left to direct sends (or None).

    Pieces are optimizer segments (cut to the range), ``k`` consecutive ones per run, so a member that
    owns a piece can keep it: a row reduced at its owner needs no further message, which is what the
    least total push needs (``min_reduce_push_bytes``). Consecutive segments differ by at most one row,
    so a run pads as little as an even split. The rows of the last fewer-than-``k`` segments go from
    every member straight to their owner: ``k - 1`` messages per row when the owner is a member, ``k``
    otherwise, never more than a reduce-scatter and a forward, and no padding.
    """
    blocks = _scatter_blocks(lo, hi, size, world_size)
    full = len(blocks) // k * k
    runs = [(blocks[i][0], blocks[i + k - 1][1], blocks[i:i + k]) for i in range(0, full, k)]
    return runs, ((blocks[full][0], hi) if full < len(blocks) else None)


def _scatter_blocks(lo: int, hi: int, size: int, world_size: int) -> list[Range]:
    """The optimizer segments cut to ``[lo, hi)``; an empty segment inside it stays a (zero-row) piece,
    so a group of all ranks over the whole parameter is one reduce-scatter onto the optimizer layout."""
    return [(max(a, lo), min(b, hi)) for a, b in optimizer_segments(size, world_size)
            if (a < hi and lo < b) or (a == b and lo <= a < hi)]


def scatter_block_count(lo: int, hi: int, size: int, world_size: int) -> int:
    """``len(_scatter_blocks(lo, hi, size, world_size))`` by arithmetic, in O(1): segment ``r`` starts
    at ``a_r = floor(r S / N)`` and counts when ``a_r < hi`` (a prefix of the ranks) and
    ``a_{r+1} > lo`` or ``a_r >= lo`` (a suffix)."""
    if size == 0:
        return 0
    below = min(world_size, -(-hi * world_size // size))                 # ranks with a_r < hi
    first = max(0, min(-(-lo * world_size // size), -(-(lo + 1) * world_size // size) - 1))
    return max(0, below - first)


def reduce_scatters_range(lo: int, hi: int, k: int, size: int, world_size: int) -> bool:
    """Whether a replica group of ``k`` ranks contributing rows ``[lo, hi)`` reduce-scatters some of them
    (``replica_group_push`` makes a ``ReduceScatter`` for the range): it spans ``k`` segments or more."""
    return scatter_block_count(lo, hi, size, world_size) >= k


def _choose_receivers(group: tuple[int, ...], pieces: Sequence[Range], size: int, world_size: int,
                      gpus_per_node: int, weights: LinkWeights, sent_load: Mapping[int, int]) -> list[int]:
    """Which member keeps each reduce-scatter piece (see ``passes/lnk/assignment``): the cost matrices
    of the run are built a piece's owner chunk at a time, over every member at once.

    When the ``i``-th member owns all of the ``i``-th piece (every rank of the world reducing a whole
    parameter onto the optimizer layout) each keeps its own: that costs nothing, and every other
    matching costs more, so it is the one optimum, found without a ``k x k`` matrix."""
    chunks = [list(owner_chunks(plo, phi, size, world_size)) for plo, phi in pieces]
    if all(o == m for m, piece in zip(group, chunks) for _, _, o in piece):
        return list(group)
    default, special = _special_costs(group, chunks, gpus_per_node, weights)
    if len({sent_load.get(m, 0) for m in group}) == 1:     # equal loads: only owners and node mates differ
        return assign_pieces_sparse(group, default, special, sent_load.get(group[0], 0))
    member_of = assign_pieces_by_load(group, default, special, sent_load)
    if member_of is not None:
        return member_of
    k = len(group)
    ranks = np.asarray(group, dtype=np.int64)
    nodes = ranks // gpus_per_node
    link = np.zeros((k, k), dtype=np.int64)
    sent = np.zeros((k, k), dtype=np.int64)
    for p, piece in enumerate(chunks):
        for a, b, o in piece:
            away = ranks != o
            sent[p] += (b - a) * away
            link[p] += (b - a) * np.where(away, np.where(nodes == o // gpus_per_node, weights.intra, weights.inter), 0)
    return assign_pieces_matrix(group, link, sent, sent_load)


def _special_costs(group: tuple[int, ...], chunks: Sequence[Sequence[tuple[int, int, int]]],
                   gpus_per_node: int, weights: LinkWeights
                   ) -> tuple[list[tuple[int, int]], list[dict[int, tuple[int, int]]]]:
    """Per piece, its ``(link, sent)`` on a member that owns none of its rows and shares no node with
    their owners (every row sent inter-node), and on each other member (by position), found through
    the members of each node."""
    on_node: dict[int, list[int]] = defaultdict(list)
    for j, m in enumerate(group):
        on_node[m // gpus_per_node].append(j)
    default, special = [], []
    for piece in chunks:
        rows = sum(b - a for a, b, _ in piece)
        default.append((rows * weights.inter, rows))
        near = {j for _, _, o in piece for j in on_node.get(o // gpus_per_node, ())}
        costs = {}
        for j in sorted(near):
            m = group[j]
            costs[j] = (sum((b - a) * (weights.intra if o // gpus_per_node == m // gpus_per_node else weights.inter)
                            for a, b, o in piece if o != m),
                        sum(b - a for a, b, o in piece if o != m))
        special.append(costs)
    return default, special


def min_push_bytes(param: ParamLayout, contributions: Mapping[int, Sequence[Range]], world_size: int,
                   *, grad_dtype_bytes: int | None = None) -> dict[int, int]:
    """The least bytes each owner must receive: rows of its segment that another rank contributes
    (at least one reduced value per such row). Owners of empty segments are absent. It bounds what an
    owner receives in total, reduce-scatter traffic included, not the LNK transfers alone."""
    gbytes = param.dtype_bytes if grad_dtype_bytes is None else grad_dtype_bytes
    norm = _normalise_layout(contributions, param.size, world_size, "contributions")
    out = {}
    for owner, seg in enumerate(optimizer_segments(param.size, world_size)):
        if seg[0] == seg[1]:
            continue
        others = merge_ranges(r for rank, rs in norm.items() if rank != owner for r in rs)
        out[owner] = _overlap(others, seg) * param.row_elements * gbytes
    return out


def min_reduce_push_bytes(param: ParamLayout, contributions: Mapping[int, Sequence[Range]], world_size: int,
                          *, grad_dtype_bytes: int | None = None) -> int:
    """The least bytes any push can move in all (every rank's receipts summed), when values are summed
    on the way: a row with contributors ``C`` and owner ``o`` needs ``|C| - 1`` messages if ``o`` is in
    ``C`` (every contributor but the owner must send the row, or a partial sum including it, at least
    once) and ``|C|`` otherwise; a reduction chain ending at the owner reaches it.

    ``min_push_bytes`` (each owner receives each foreign row once) is this bound only when no row has
    two contributors besides its owner: with replicas, partial sums must meet somewhere before the
    owner, and that rank receives them too.
    """
    gbytes = param.dtype_bytes if grad_dtype_bytes is None else grad_dtype_bytes
    norm = _normalise_layout(contributions, param.size, world_size, "contributions")
    layouts = [merge_ranges(rs) for rs in norm.values()]
    segments = optimizer_segments(param.size, world_size)
    rows = 0
    for lo, hi in mutual_slices(segments, *layouts):
        contributors = [r for r, rs in zip(norm, layouts) if _overlap(rs, (lo, hi))]
        owner = next(o for o, (a, b) in enumerate(segments) if a <= lo and hi <= b)
        rows += (hi - lo) * (len(contributors) - (owner in contributors))
    return rows * param.row_elements * gbytes


# ---- numpy simulation --------------------------------------------------------------------------

def simulate_pull(plan: PullPlan, master: Mapping[int, np.ndarray]) -> dict[int, list[np.ndarray]]:
    """Apply ``plan`` to data: ``master[r]`` is rank ``r``'s optimizer shard (the parameter's shape with
    the shard dimension cut to its segment; ranks owning no rows may be absent). Returns, per needing
    rank, one array per needed range in ``plan.needs`` order, assembled only from the plan's ops."""
    dim = plan.param.shard_dim
    segments = optimizer_segments(plan.param.size, plan.world_size)

    def rows_of(owner: int, lo: int, hi: int) -> np.ndarray:
        base = segments[owner][0]
        return _take(master[owner], base, lo, hi, dim)

    got: dict[int, list[tuple[Range, np.ndarray]]] = defaultdict(list)
    for c in plan.local_copies:
        got[c.rank].append(((c.lo, c.hi), rows_of(c.rank, c.lo, c.hi)))
    for t in plan.transfers:
        got[t.dst].append(((t.lo, t.hi), rows_of(t.src, t.lo, t.hi)))
    out: dict[int, list[np.ndarray]] = {}
    for rank, needed in plan.needs.items():
        arrays = []
        for (lo, hi), tiles in zip(needed, plan.assembly[rank]):
            parts = [_lookup(got[rank], a, b, rank, dim) for a, b in tiles]
            if parts:
                arrays.append(np.concatenate(parts, axis=dim))
            else:
                shape = list(plan.param.shape)
                shape[dim] = 0
                arrays.append(np.zeros(shape, dtype=np.result_type(*master.values()) if master else np.float64))
        out[rank] = arrays
    return out


def simulate_push(plan: PushPlan, grads: Mapping[int, Sequence[np.ndarray]]) -> dict[int, np.ndarray]:
    """Apply ``plan`` to data: ``grads[r]`` holds one array per range of ``plan.contributions[r]`` (same
    order; the parameter's shape with the shard dimension cut to the range). Returns each owner's summed
    gradient shard for every rank owning at least one row, computed only from the plan's ops."""
    dim = plan.param.shard_dim
    buffers: dict[int, list[tuple[Range, np.ndarray]]] = defaultdict(list)
    own = {r: dict(zip(rs, grads[r])) for r, rs in plan.contributions.items()}
    for rank, ranges in own.items():
        reduced = [(rs.lo, rs.hi) for rs in plan.reduce_scatters if rank in rs.group]
        for (lo, hi), a in ranges.items():
            for plo, phi in uncovered_ranges(lo, hi, reduced):
                buffers[rank].append(((plo, phi), _take(a, lo, plo, phi, dim)))
    for rs in plan.reduce_scatters:
        total = sum(_take(a, lo, rs.lo, rs.hi, dim) for m in rs.group
                    for (lo, hi), a in own[m].items() if lo <= rs.lo and rs.hi <= hi)
        for rank, lo, hi in rs.pieces:
            buffers[rank].append(((lo, hi), _take(total, rs.lo, lo, hi, dim)))
    dtype = np.result_type(*[a for arrays in grads.values() for a in arrays]) if grads else np.float64
    out: dict[int, np.ndarray] = {}
    segments = optimizer_segments(plan.param.size, plan.world_size)
    for owner, (lo, hi) in enumerate(segments):
        if lo < hi:
            shape = list(plan.param.shape)
            shape[dim] = hi - lo
            out[owner] = np.zeros(shape, dtype=dtype)

    def add(owner: int, src: int, lo: int, hi: int) -> None:
        data = _lookup(buffers[src], lo, hi, src, dim)
        index = [slice(None)] * data.ndim
        index[dim] = slice(lo - segments[owner][0], hi - segments[owner][0])
        out[owner][tuple(index)] += data

    for t in plan.transfers:
        add(t.dst, t.src, t.lo, t.hi)
    for a in plan.local_adds:
        add(a.rank, a.rank, a.lo, a.hi)
    return out


# ---- helpers -----------------------------------------------------------------------------------

def _owner_runs(slices: Sequence[Range], size: int, world_size: int,
                coalesce: bool) -> list[tuple[int, int, int]]:
    """Contiguous mutual slices as ``(lo, hi, owner)``, merged per owner when ``coalesce``."""
    runs: list[list[int]] = []
    for lo, hi in slices:
        owner = owner_of(size, world_size, lo)
        if coalesce and runs and runs[-1][2] == owner and runs[-1][1] == lo:
            runs[-1][1] = hi
        else:
            runs.append([lo, hi, owner])
    return [(lo, hi, owner) for lo, hi, owner in runs]


def _tile(lo: int, hi: int, held: Sequence[Range]) -> tuple[Range, ...]:
    """``[lo, hi)`` as consecutive sub-ranges, each inside one held range (held ranges are disjoint)."""
    return tuple((max(lo, a), min(hi, b)) for a, b in sorted(held) if a < hi and lo < b)


def _overlap(ranges: Sequence[Range], seg: Range) -> int:
    return sum(max(0, min(hi, seg[1]) - max(lo, seg[0])) for lo, hi in ranges)


def _take(array: np.ndarray, base: int, lo: int, hi: int, dim: int) -> np.ndarray:
    index = [slice(None)] * array.ndim
    index[dim] = slice(lo - base, hi - base)
    return array[tuple(index)]


def _lookup(buffers: Sequence[tuple[Range, np.ndarray]], lo: int, hi: int, rank: int, dim: int) -> np.ndarray:
    """Rows ``[lo, hi)`` from the one buffer of ``rank`` that holds them (more or fewer is a plan bug)."""
    found = [(r, a) for r, a in buffers if r[0] <= lo and hi <= r[1]]
    if len(found) != 1:
        raise AssertionError(f"rank {rank} holds rows [{lo}, {hi}) in {len(found)} buffers, expected exactly 1")
    (base, _), array = found[0]
    return _take(array, base, lo, hi, dim)


def _normalise_layout(layout: Mapping[int, Sequence[Range]], size: int, world_size: int,
                      what: str) -> dict[int, tuple[Range, ...]]:
    out = {}
    for rank in sorted(layout):
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world_size:
            raise PlanError(f"{what}: rank {rank!r} is outside the world of {world_size} ranks")
        out[rank] = tuple(normalise_ranges(layout[rank], size=size, what=f"{what} of rank {rank}: range"))
    return out


def _check_groups(groups: Sequence[Sequence[int]], layout: Mapping[int, tuple[Range, ...]],
                  world_size: int) -> list[tuple[int, ...]]:
    seen: set[int] = set()
    out = []
    for group in groups:
        members = tuple(sorted(group))
        if not members:
            raise PlanError("replica groups must not be empty")
        for r in members:
            if r in seen:
                raise PlanError(f"rank {r} appears in more than one replica group")
            if r not in layout:
                raise PlanError(f"replica group {list(members)}: rank {r} contributes no gradient")
            seen.add(r)
        if any(layout[r] != layout[members[0]] for r in members):
            raise PlanError(f"replica group {list(members)} holds different ranges "
                            f"{[list(layout[r]) for r in members]}: replicas must hold the same layout")
        if layout[members[0]]:
            out.append(members)
    return out


def _check_world(world_size: int, gpus_per_node: int) -> None:
    require_positive_int(world_size, "world_size")
    require_positive_int(gpus_per_node, "gpus_per_node")


