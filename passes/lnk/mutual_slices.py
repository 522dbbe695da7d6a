"""Layouts along a parameter's shard dimension and their common refinement (mutual slices).

Hydraulis §5.2 keeps the fp32 master parameters and optimizer states in one fixed layout (the
*optimization* layout) and lets each iteration's strategy pick its own *propagation* layout. The
interaction between them is planned on *mutual slices*: pieces of the shard dimension that lie
inside exactly one optimizer segment and are either wholly inside or wholly outside every
propagation range.

Conventions (everything here is about one parameter and its shard dimension of size ``S``):

* A range is a half-open pair ``(lo, hi)`` of row indices, ``0 <= lo <= hi <= S``.
* **Optimizer segments** (``hgraph.shard_rule.optimizer_segments``): rank ``r`` of ``N`` owns
  ``[floor(r*S/N), floor((r+1)*S/N))``. Sizes differ by at most one row; when ``S < N`` some ranks own
  an empty segment. The layout never depends on the strategy (the sharded optimizer reads the same rule).
* **Propagation ranges** of a strategy: TP rank ``t`` of a pipeline with TP degree ``k`` needs the
  ``t``-th of ``k`` even segments under the same floor rule; a replicated parameter needs ``[0, S)``;
  ranks of other pipeline stages need nothing (``propagation_needs``).
* **Mutual slices** (``mutual_slices``): the coarsest common refinement of any number of layouts,
  derived from the union of their boundaries, so uneven sizes work. For even layouts the paper uses
  the uniform grid of ``LCM(N, TP_max)`` (pull) or ``LCM(N, D*TP_max)`` (push) pieces
  (``pull_granularity``, ``push_granularity``, ``lcm_slices``). That grid is *a* common refinement;
  the coarsest one has ``a + b - gcd(a, b)`` pieces for two even layouts of ``a`` and ``b`` segments
  and every coarse slice is a union of consecutive LCM slices, so planning on coarse slices moves the
  same bytes in fewer messages. With floor boundaries the LCM grid refines both layouts for any
  ``S`` (``floor(k*S/L)`` with ``k = r*L/N`` is ``floor(r*S/N)``).
"""
from __future__ import annotations

import bisect
import math
from typing import Callable, Iterable, Sequence

from hgraph.comm_plan import merge_ranges
from hgraph.shard_rule import PlanError, Range, even_segments, shard_bounds
from hgraph.strategy import Scheme, Strategy

# ---- refinement --------------------------------------------------------------------------------

def mutual_slices(*layouts: Iterable[Range]) -> list[Range]:
    """The coarsest common refinement of ``layouts`` (each an iterable of ``(lo, hi)`` ranges).

    Returns the sorted, non-empty pieces between consecutive boundaries of all ranges that are covered
    by at least one range. Every returned slice lies wholly inside or wholly outside each input range,
    so it sits in exactly one optimizer segment when the optimizer layout is among ``layouts``.
    Empty ranges contribute no boundary.
    """
    ranges = [r for layout in layouts for r in normalise_ranges(layout)]
    ranges = [r for r in ranges if r[0] < r[1]]
    if not ranges:
        return []
    points = sorted({p for r in ranges for p in r})
    covered = merge_ranges(ranges)
    out: list[Range] = []
    for lo, hi in zip(points, points[1:]):
        i = bisect.bisect_right(covered, (lo, math.inf)) - 1
        if i >= 0 and covered[i][0] <= lo and hi <= covered[i][1]:
            out.append((lo, hi))
    return out


def slices_within(slices: Sequence[Range], lo: int, hi: int) -> list[Range]:
    """The slices of a sorted refinement that lie inside ``[lo, hi)`` (the range must be a union of them)."""
    if lo >= hi:
        return []
    i = bisect.bisect_left(slices, (lo, -1))
    out: list[Range] = []
    while i < len(slices) and slices[i][1] <= hi:
        out.append(slices[i])
        i += 1
    if not out or out[0][0] != lo or out[-1][1] != hi:
        raise AssertionError(f"[{lo}, {hi}) is not a union of the refinement's slices")
    return out


def normalise_ranges(ranges: Iterable[Range], *, size: int | None = None, what: str = "range") -> list[Range]:
    """Validate ranges as integer pairs ``0 <= lo <= hi (<= size)``; returns them as tuples in order."""
    out: list[Range] = []
    for r in ranges:
        try:
            lo, hi = r
        except (TypeError, ValueError):
            raise PlanError(f"{what} {r!r} is not a (lo, hi) pair") from None
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (lo, hi)):
            raise PlanError(f"{what} {r!r} must hold integer row indices")
        if not 0 <= lo <= hi or (size is not None and hi > size):
            limit = f" <= {size}" if size is not None else ""
            raise PlanError(f"{what} ({lo}, {hi}) is invalid: need 0 <= lo <= hi{limit}")
        out.append((lo, hi))
    return out


# ---- the paper's LCM figures -------------------------------------------------------------------

def lcm_granularity(*parts: int) -> int:
    """Least common multiple of segment counts: the paper's uniform mutual-slice granularity."""
    if not parts or any(not isinstance(p, int) or p < 1 for p in parts):
        raise PlanError(f"segment counts must be positive integers, got {parts!r}")
    return math.lcm(*parts)


def pull_granularity(world_size: int, tp_max: int) -> int:
    """``LCM(N, TP_max)``: the paper's number of uniform mutual slices for Pull Parameter."""
    return lcm_granularity(world_size, tp_max)


def push_granularity(world_size: int, num_pipelines: int, tp_max: int) -> int:
    """``LCM(N, D*TP_max)``: the paper's number of uniform mutual slices for Push Gradient (the extra
    ``D`` accounts for the reduce-scatter among the ``D`` pipelines holding the same TP range)."""
    return lcm_granularity(world_size, num_pipelines * tp_max)


def lcm_slices(size: int, *parts: int) -> list[Range]:
    """The paper's uniform grid: ``[0, size)`` in ``lcm(parts)`` floor-even pieces (empty ones dropped)."""
    return [r for r in even_segments(size, lcm_granularity(*parts)) if r[0] < r[1]]


def coarsest_count(a: int, b: int) -> int:
    """Number of slices in the coarsest refinement of two even layouts of ``a`` and ``b`` segments of a
    dimension divisible by ``lcm(a, b)``: ``a + b - gcd(a, b)`` (shared boundaries counted once)."""
    return a + b - math.gcd(a, b)


# ---- propagation layouts of a strategy ---------------------------------------------------------

StageOf = Callable[[int, Scheme], "int | None"]


def tp_range(size: int, tp: int, tp_rank: int, *, units: int | None = None) -> Range:
    """The rows TP rank ``tp_rank`` of ``tp`` holds of a TP-sharded dimension of ``size`` rows.

    ``units`` (e.g. KV heads) splits the dimension into equal units first; with fewer units than TP
    ranks (GQA) several TP ranks hold the same unit (rank ``t`` holds unit ``t*units // tp``).
    """
    if units is None:
        return even_segments(size, tp)[tp_rank]
    if units < 1 or size % units:
        raise PlanError(f"a shard dimension of {size} rows cannot be split into {units} equal units")
    if units % tp and tp % units:
        raise PlanError(f"{units} units cannot be spread over TP {tp}: one must divide the other")
    rows = size // units
    if units >= tp:
        first, last = shard_bounds(units, tp_rank, tp)
    else:
        first = tp_rank * units // tp
        last = first + 1
    return first * rows, last * rows


def propagation_needs(strategy: Strategy, size: int, *, stage_of: StageOf | int = 0,
                      tp_sharded: bool = True, units: int | None = None) -> dict[int, list[Range]]:
    """What each rank of ``strategy`` must pull of one parameter (rank -> ranges).

    ``stage_of(pipeline_index, scheme)`` gives the PP stage holding the parameter in that pipeline
    (``None``: no stage holds it); an int means the same stage everywhere. A TP-sharded parameter is
    split by ``tp_range``; a replicated one is needed whole. Every CP rank needs the same rows as its
    TP peer. Ranks of other stages are absent.
    """
    needs: dict[int, list[Range]] = {}
    for coord in strategy.coords():
        scheme = strategy.pipelines[coord.pipeline]
        if _stage(stage_of, coord.pipeline, scheme) != coord.stage:
            continue
        if tp_sharded:
            needs[coord.rank] = [tp_range(size, scheme.tp, coord.tp_rank, units=units)]
        else:
            needs[coord.rank] = [(0, size)]
    return needs


def propagation_contributions(strategy: Strategy, size: int, *, stage_of: StageOf | int = 0,
                              tp_sharded: bool = True, units: int | None = None) -> dict[int, list[Range]]:
    """The gradient ranges each rank pushes for one parameter (rank -> ranges), one per pipeline element.

    A TP-sharded parameter: every rank pushes the rows it holds (CP ranks and GQA duplicates push
    partial sums of the same rows; the owner's sum is the full gradient). A replicated parameter has
    the same full gradient on every TP rank of a (stage, CP rank), so the range is split among them
    (TP rank ``t`` pushes segment ``t`` of ``tp``) and each element is pushed once per CP rank.
    """
    if tp_sharded:
        return propagation_needs(strategy, size, stage_of=stage_of, tp_sharded=True, units=units)
    out: dict[int, list[Range]] = {}
    for coord in strategy.coords():
        scheme = strategy.pipelines[coord.pipeline]
        if _stage(stage_of, coord.pipeline, scheme) == coord.stage:
            out[coord.rank] = [even_segments(size, scheme.tp)[coord.tp_rank]]
    return out


def _stage(stage_of: StageOf | int, pipeline: int, scheme: Scheme) -> int | None:
    stage = stage_of(pipeline, scheme) if callable(stage_of) else stage_of
    if stage is not None and not 0 <= stage < scheme.pp:
        raise PlanError(f"stage {stage} of pipeline {pipeline} is outside its {scheme.pp} PP stages")
    return stage


