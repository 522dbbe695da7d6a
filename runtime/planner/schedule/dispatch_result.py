"""The result of dispatching a mini-batch's documents across the pipelines of a strategy, and what
every dispatch method (``dispatch``) shares to build one: each distinct scheme's document costs and
packed-latency surrogate (``SchemeCosts``), the check that some pipeline holds every document, and
the packing of each pipeline's documents (``pack_dispatch``, ``packing.pack_pipeline``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from hgraph.errors import HGraphError
from hgraph.runtime.planner.schedule.packing import PackResult, pack_pipeline
from hgraph.runtime.planner.schedule.relief import doc_relief_ms, unrelieved_len
from hgraph.strategy import Scheme


@dataclass
class DispatchResult:
    """Per pipeline: positions of its documents in ``lengths`` and its packing."""

    assignment: list[np.ndarray]
    packs: list[PackResult]
    latency: float
    bound: float | None = None  # a proven lower bound, when the method has one (cpsat)
    # True when ``bound`` is of a model restricted to fewer micro-batch slots than the App. C range
    # allows (then it bounds that model only, not every dispatch).
    bound_restricted: bool = False
    # The longest-first passes' dispatches (``dispatch_fast``), reused when a screened candidate
    # gets the full method.
    greedy_starts: list | None = None
    polished: bool = True  # packs include the packing local search

    @property
    def latencies(self) -> list[float]:
        return [p.latency for p in self.packs]


class SchemeCosts:
    """Per distinct scheme: coefficients, limits and every document's cost."""

    def __init__(self, scheme: Scheme, cost, lengths: np.ndarray):
        self.scheme = scheme
        self.a, self.b, self.c = cost.dispatch_coeffs(scheme)
        self.k = scheme.pp - 1
        self.cap = cost.max_len(scheme)
        # the micro-batch size the surrogate counts V by: what packing fills (``relief.packing_capacity``)
        self.pack_cap = max(min(cost.microbatch_capacity(scheme), unrelieved_len(cost, scheme)), 1)
        self.util = cost.util_len(scheme)
        # a document's cost: its compute, and what relief adds to it alone (past the plain MaxLen)
        self.t = self.a * lengths.astype(np.float64) ** 2 + self.b * lengths + doc_relief_ms(cost, scheme, lengths)

    def estimate(self, S: float, L: int, tmax: float, n: int) -> float:
        """Packed-latency surrogate of a pipeline holding ``n`` docs, cost ``S``, ``L`` tokens."""
        if n == 0:
            return 0.0
        k, c = self.k, self.c
        # App. C range of V (as packing.microbatch_range), inlined: this runs per candidate move.
        vmin = -(-L // self.pack_cap) or 1
        vmax = L // self.util
        if vmax > n:
            vmax = n
        if vmax < vmin:
            vmax = vmin
        # f(V) = (k+V)(S/V + c) is convex for V <= S/tmax and increasing beyond.
        knee = S / tmax if tmax > 0 else float(vmax)
        if k > 0 and c > 0:
            v0 = math.sqrt(k * S / c)
        elif k > 0:
            v0 = float(vmax)
        else:
            v0 = float(vmin)
        if v0 > knee:
            v0 = knee
        V = int(v0)
        if V < vmin:
            V = vmin
        elif V > vmax:
            V = vmax
        best = (k + V) * (max(S / V, tmax) + c)
        if V < vmax:
            V += 1
            val = (k + V) * (max(S / V, tmax) + c)
            if val < best:
                best = val
        return best


def estimate_many(S: np.ndarray, L: np.ndarray, tmax: np.ndarray, n: np.ndarray, k: np.ndarray, c: np.ndarray,
                  cap: np.ndarray, util: np.ndarray, *, counts: bool = False):
    """``SchemeCosts.estimate`` of many pipelines at once, each with its scheme's ``k, c, cap, util``
    (arrays of one shape; the same results as the scalar form).

    With ``PP = 1`` and ``c > 0`` everywhere (the schemes chosen at 1024 GPUs and up),
    ``V (max(S/V, t_max) + c)`` grows with ``V``, so the scalar form always keeps ``V = vmin``:
    that is computed alone, with the same expression (the same floats), at a third of the work.

    ``counts=True`` returns the number of micro-batches each estimate is for as well (0 for an
    empty pipeline)."""
    vmin = np.maximum(-(-L // cap), 1)
    if not k.any() and bool((c > 0).all()):
        est = np.where(n > 0, vmin * (np.maximum(S / vmin, tmax) + c), 0.0)
        return (est, np.where(n > 0, vmin, 0)) if counts else est
    vmax = np.maximum(np.minimum(L // util, n), vmin)
    with np.errstate(divide="ignore", invalid="ignore"):
        knee = np.where(tmax > 0, S / np.where(tmax > 0, tmax, 1.0), vmax)
        v0 = np.where(k > 0, np.where(c > 0, np.sqrt(k * S / np.where(c > 0, c, 1.0)), vmax), vmin)
        V = np.clip(np.floor(np.minimum(v0, knee)).astype(np.int64), vmin, vmax)
        best = (k + V) * (np.maximum(S / np.maximum(V, 1), tmax) + c)
        V2 = V + 1
        val = (k + V2) * (np.maximum(S / V2, tmax) + c)
    second = (V < vmax) & (val < best)
    est = np.where(n > 0, np.where(second, val, best), 0.0)
    return (est, np.where(n > 0, np.where(second, V2, V), 0)) if counts else est


def check_eligible(lengths: np.ndarray, groups: list[SchemeCosts]) -> None:
    if lengths.size == 0:
        return
    cap = max(g.cap for g in groups)
    if int(lengths.max()) > cap:
        raise HGraphError(
            f"a document of {int(lengths.max())} tokens is longer than the largest MaxLen {cap} of the pipelines "
            f"({', '.join(sorted({str(g.scheme) for g in groups}))})")


def scheme_costs(pipelines: Sequence[Scheme], cost, lengths: np.ndarray) -> tuple[list[SchemeCosts], list[int]]:
    groups: list[SchemeCosts] = []
    index: dict[Scheme, int] = {}
    of: list[int] = []
    for p in pipelines:
        if p not in index:
            index[p] = len(groups)
            groups.append(SchemeCosts(p, cost, lengths))
        of.append(index[p])
    return groups, of


def pack_dispatch(lengths: np.ndarray, pipelines: Sequence[Scheme], cost, members: list[list[int]],
            polish: bool = True) -> DispatchResult:
    assignment = [np.asarray(sorted(m), dtype=np.int64) for m in members]
    packs = [pack_pipeline(lengths[a], p, cost, improve=polish) for a, p in zip(assignment, pipelines)]
    packs = [PackResult([a[mb] for mb in pk.microbatches], pk.mb_times, pk.latency) for a, pk in zip(assignment, packs)]
    return DispatchResult(assignment, packs, max((p.latency for p in packs), default=0.0), polished=polish)
