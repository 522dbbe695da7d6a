"""Packing the documents of one pipeline into micro-batches (Hydraulis Eq. 1, App. C).

Minimise ``(PP - 1 + V) * max_j (sum_{i in j} (a l_i^2 + b l_i) + c)`` subject to every
micro-batch holding at most ``MaxLen(P)`` tokens, with ``V`` pruned to
``[max(ceil(sum l / MaxLen), 1), min(sum l / UtilLen, U)]``. When capacity makes every ``V`` of that
range infeasible the range is widened upwards (``V = U`` always fits). A document past the length
the engine runs without relief also carries what relief adds to it alone (``relief.doc_relief_ms``),
and no micro-batch is packed past that length beyond the longest document (``relief.packing_capacity``).

``fast``: for each ``V``, in increasing order of the bound ``(PP-1+V) * (max(S/V, t_max) + c)``,
longest-processing-time-first with capacity; stop when the bound passes the best found; then
move/swap local search on the best. ``cpsat``: the same ``V`` range solved with ortools CP-SAT
(time-boxed, hinted with the fast solution), the yardstick.
"""
from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass

import numpy as np

from hgraph.errors import HGraphError
from hgraph.runtime.planner.schedule.relief import doc_relief_ms, packing_capacity
from hgraph.strategy import Scheme

# CP-SAT works on integers: costs are scaled to this many units per ms.
CPSAT_UNITS_PER_MS = 1000


@dataclass
class PackResult:
    """Micro-batches of one pipeline as arrays of positions into the packed ``lengths``."""

    microbatches: list[np.ndarray]
    mb_times: list[float]
    latency: float

    @property
    def num_microbatches(self) -> int:
        return len(self.microbatches)


def microbatch_range(total_tokens: int, num_docs: int, max_len: int, util_len: int) -> tuple[int, int]:
    """App. C pruning: ``V`` in ``[max(ceil(sum/MaxLen), 1), min(floor(sum/UtilLen), U)]``.

    The upper end is raised to the lower end when the bounds cross (few short documents).
    """
    vmin = max(-(-int(total_tokens) // int(max_len)), 1)
    vmax = min(int(total_tokens) // max(int(util_len), 1), int(num_docs))
    return vmin, max(vmin, vmax)


def _lpt_with_capacity(times: list[float], lens: list[int], order: list[int], V: int,
                       cap: int) -> list[list[int]] | None:
    """Largest first onto the least-loaded micro-batch with room; None when some item fits nowhere."""
    heap = [(0.0, j) for j in range(V)]
    room = [cap] * V
    bins: list[list[int]] = [[] for _ in range(V)]
    for i in order:
        li = lens[i]
        skipped = []
        while heap:
            load, j = heapq.heappop(heap)
            if room[j] >= li:
                break
            skipped.append((load, j))
        else:
            return None
        bins[j].append(i)
        room[j] -= li
        heapq.heappush(heap, (load + times[i], j))
        for item in skipped:
            heapq.heappush(heap, item)
    return bins


def _improve(bins: list[list[int]], times: list[float], lens: list[int], cap: int, floor: float,
             max_rounds: int = 48) -> None:
    """Move/swap local search lowering the largest micro-batch load (in place).

    Each round takes the most loaded micro-batch ``p`` and, against the three least loaded ``q``,
    picks the move of one item or the swap of two whose transferred cost ``d`` is closest to half
    the gap (so both end below the old maximum). Stops at ``floor`` (a lower bound) or when stuck.
    """
    loads = [sum(times[i] for i in b) for b in bins]
    used = [sum(lens[i] for i in b) for b in bins]
    V = len(bins)
    for _ in range(max_rounds):
        p = max(range(V), key=loads.__getitem__)
        top = loads[p]
        if top <= floor * (1 + 1e-9):
            return
        applied = False
        for q in sorted(range(V), key=loads.__getitem__)[:3]:
            gap = top - loads[q]
            if q == p or gap <= 0:
                break
            half = gap / 2
            best = None  # (|d - half|, i, e or -1)
            if len(bins[p]) > 1:
                for i in bins[p]:
                    d = times[i]
                    if 0 < d < gap and used[q] + lens[i] <= cap:
                        score = abs(d - half)
                        if best is None or score < best[0]:
                            best = (score, i, -1)
            q_sorted = sorted(bins[q], key=times.__getitem__)
            q_times = [times[e] for e in q_sorted]
            for i in bins[p]:
                pos = bisect.bisect_left(q_times, times[i] - half)
                for r in range(max(pos - 2, 0), min(pos + 2, len(q_sorted))):
                    e = q_sorted[r]
                    d = times[i] - times[e]
                    if not 0 < d < gap:
                        continue
                    if used[q] + lens[i] - lens[e] > cap or used[p] - lens[i] + lens[e] > cap:
                        continue
                    score = abs(d - half)
                    if best is None or score < best[0]:
                        best = (score, i, e)
            if best is None:
                continue
            _, i, e = best
            bins[p].remove(i); bins[q].append(i)
            d, dl = times[i], lens[i]
            if e >= 0:
                bins[q].remove(e); bins[p].append(e)
                d, dl = d - times[e], dl - lens[e]
            loads[p] -= d; loads[q] += d
            used[p] -= dl; used[q] += dl
            applied = True
            break
        if not applied:
            return


def _result(bins: list[list[int]], times: list[float], c: float, pp: int) -> PackResult:
    mbs = [np.asarray(sorted(b), dtype=np.int64) for b in bins if b]
    mb_times = [float(sum(times[i] for i in m)) + c for m in mbs]
    latency = (pp - 1 + len(mbs)) * max(mb_times) if mbs else 0.0
    return PackResult(mbs, mb_times, latency)


def _check_fits(lengths: np.ndarray, scheme: Scheme, max_len: int) -> None:
    if lengths.size and int(lengths.max()) > max_len:
        raise HGraphError(
            f"a document of {int(lengths.max())} tokens does not fit scheme {scheme} (MaxLen {max_len})")


def pack_pipeline(lengths, scheme: Scheme, cost, *, method: str = "fast", time_limit_s: float = 10.0,
                  workers: int = 1, improve: bool = True) -> PackResult:
    """Pack documents (``lengths``) of one pipeline of ``scheme`` into micro-batches (Eq. 1).

    ``improve=False`` skips the fast method's local search (a quicker, slightly worse screening).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size == 0:
        return PackResult([], [], 0.0)
    max_len = cost.max_len(scheme)
    _check_fits(lengths, scheme, max_len)
    if method == "fast":
        return _pack_fast(lengths, scheme, cost, improve=improve)
    if method == "cpsat":
        return pack_pipeline_cpsat(lengths, scheme, cost, time_limit_s=time_limit_s, workers=workers)
    raise HGraphError(f"unknown packing method {method!r}: expected fast or cpsat")


def _pack_fast(lengths: np.ndarray, scheme: Scheme, cost, improve: bool = True) -> PackResult:
    a, b, c = cost.dispatch_coeffs(scheme)
    cap = packing_capacity(cost, scheme, int(lengths.max()))
    k = scheme.pp - 1
    tarr = a * lengths.astype(np.float64) ** 2 + b * lengths + doc_relief_ms(cost, scheme, lengths)
    times = tarr.tolist()
    lens = lengths.tolist()
    n = len(lens)
    order = sorted(range(n), key=lambda i: (-times[i], -lens[i]))
    S, tmax = float(tarr.sum()), float(tarr.max())
    vmin, vmax = microbatch_range(int(lengths.sum()), n, cap, cost.util_len(scheme))

    def bound(V: int) -> float:
        return (k + V) * (max(S / V, tmax) + c)

    best: tuple[float, list[list[int]]] | None = None
    lo, hi = vmin, vmax
    while best is None:
        for V in sorted(range(lo, hi + 1), key=bound):
            if best is not None and bound(V) >= best[0]:
                break
            bins = _lpt_with_capacity(times, lens, order, V, cap)
            if bins is None:
                continue
            val = (k + V) * (max(sum(times[i] for i in bb) for bb in bins) + c)
            if best is None or val < best[0]:
                best = (val, bins)
        if best is None:  # capacity: widen the range upwards
            lo, hi = hi + 1, min(max(2 * hi, hi + 1), n)
    val, bins = best
    V = len(bins)
    if improve and val > bound(V) * (1 + 1e-9):
        _improve(bins, times, lens, cap, floor=max(S / V, tmax))
    return _result(bins, times, c, scheme.pp)


def pack_pipeline_cpsat(lengths, scheme: Scheme, cost, *, time_limit_s: float = 10.0, workers: int = 1,
                        hint: PackResult | None = None) -> PackResult:
    """Eq. 1 by CP-SAT for every V in the pruned range, time-boxed; never worse than ``hint``/fast."""
    from ortools.sat.python import cp_model

    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size == 0:
        return PackResult([], [], 0.0)
    a, b, c = cost.dispatch_coeffs(scheme)
    _check_fits(lengths, scheme, cost.max_len(scheme))
    cap = packing_capacity(cost, scheme, int(lengths.max()))
    k = scheme.pp - 1
    tarr = a * lengths.astype(np.float64) ** 2 + b * lengths + doc_relief_ms(cost, scheme, lengths)
    times = tarr.tolist()
    units = [int(round(t * CPSAT_UNITS_PER_MS)) for t in times]
    lens = lengths.tolist()
    n = len(lens)
    best = hint if hint is not None else _pack_fast(lengths, scheme, cost)
    vmin, vmax = microbatch_range(int(lengths.sum()), n, cap, cost.util_len(scheme))
    S, tmax = float(tarr.sum()), float(tarr.max())
    vs = [V for V in range(vmin, max(vmax, best.num_microbatches) + 1)
          if (k + V) * (max(S / V, tmax) + c) < best.latency]
    order = sorted(range(n), key=lambda i: -units[i])
    for V in vs:
        remaining = time_limit_s / max(len(vs), 1)
        m = cp_model.CpModel()
        x = [[m.NewBoolVar(f"x{i}_{j}") for j in range(V)] for i in range(n)]
        for i in range(n):
            m.AddExactlyOne(x[i])
        loads = []
        for j in range(V):
            m.Add(sum(lens[i] * x[i][j] for i in range(n)) <= cap)
            loads.append(sum(units[i] * x[i][j] for i in range(n)))
        mx = m.NewIntVar(0, sum(units), "max")
        for j in range(V):
            m.Add(loads[j] <= mx)
        m.Add(x[order[0]][0] == 1)  # symmetry: the largest item opens micro-batch 0
        # Only solutions better than the incumbent are of interest.
        target = best.latency / (k + V) - c
        m.Add(mx <= int(math.floor(target * CPSAT_UNITS_PER_MS)) + len(units))
        m.Minimize(mx)
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = max(remaining, 0.05)
        solver.parameters.num_workers = workers
        status = solver.Solve(m)
        if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            bins = [[i for i in range(n) if solver.Value(x[i][j])] for j in range(V)]
            cand = _result(bins, times, c, scheme.pp)
            if cand.latency < best.latency:
                best = cand
    return best
