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

An EP pipeline (``_pack_ep``) packs at most one micro-batch per ``n`` documents (its EP degree: every EP
rank gets one), deals the documents onto ``V x n`` replica slots and prices each candidate micro-batch as
the runtime runs it, its slowest replica under ``split_documents`` plus the busiest expert rank
(``CostModel.split_microbatch_time``); ``cpsat``, whose sums cannot model that maximum, returns it.
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
# An EP pipeline's local search reprices at most this many candidate moves, and fewer for many documents
# (each exact price splits a micro-batch's documents): EP_IMPROVE_DOCUMENTS / documents of the pipeline.
EP_IMPROVE_PRICES = 12
EP_IMPROVE_DOCUMENTS = 20_000
# The even split's bound prunes an EP pipeline's micro-batch counts weakly (the exact price sits above it):
# the counts are tried in the bound's order until this many in a row priced no better than the best.
EP_STALE_COUNTS = 2


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
                       cap: int, slots_per_bin: int = 1) -> list[list[int]] | None:
    """Largest first onto the least-loaded micro-batch with room; None when some item fits nowhere.

    With ``slots_per_bin = n`` (an EP pipeline: ``_pack_ep``) the ``V`` micro-batches are ``V x n`` replica
    slots (slot ``s`` in micro-batch ``s mod V``), each item going onto the least loaded slot whose
    micro-batch has room: the first ``V x n`` items open every slot, so with that many each micro-batch
    holds ``n`` and ``split_documents`` leaves no EP rank without one; the slots (what the replicas run)
    are balanced."""
    heap = [(0.0, s) for s in range(V * slots_per_bin)]
    room = [cap] * V
    bins: list[list[int]] = [[] for _ in range(V)]
    for i in order:
        li = lens[i]
        skipped = []
        while heap:
            load, s = heapq.heappop(heap)
            if room[s % V] >= li:
                break
            skipped.append((load, s))
        else:
            return None
        bins[s % V].append(i)
        room[s % V] -= li
        heapq.heappush(heap, (load + times[i], s))
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
    if _prices_replicas(cost, scheme):
        return _pack_ep(lengths, scheme, cost, improve=improve)
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
    """Eq. 1 by CP-SAT for every V in the pruned range, time-boxed; never worse than ``hint``/fast. An EP
    pipeline's micro-batch costs its slowest replica, which Eq. 1's sums do not model: the fast packing."""
    from ortools.sat.python import cp_model

    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size == 0:
        return PackResult([], [], 0.0)
    if _prices_replicas(cost, scheme):
        return hint if hint is not None else _pack_fast(lengths, scheme, cost)
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


# ---- EP pipelines ---------------------------------------------------------------------------------
def _prices_replicas(cost, scheme: Scheme) -> bool:
    prices = getattr(cost, "prices_replicas", None)
    return prices is not None and prices(scheme)


def _pack_ep(lengths: np.ndarray, scheme: Scheme, cost, improve: bool = True) -> PackResult:
    """Eq. 1 for an EP pipeline, each candidate micro-batch priced as the runtime runs it: its slowest
    replica under ``split_documents`` plus the busiest expert rank (``CostModel.split_microbatch_time``) and
    its documents' relief. ``V`` is at most one micro-batch per ``n`` documents (the EP degree), so none
    leaves an EP rank on a placeholder, unless capacity needs more; documents go onto replica slots
    (``_lpt_with_capacity`` with ``n`` slots a micro-batch, by the balancing costs); a move/swap local search
    lowers the dearest exact price.
    The range is pruned by the even split's bound (``coeffs``: never above the exact price)."""
    n = scheme.ep
    a, b, c = cost.dispatch_coeffs(scheme)
    sa, sb, _ = cost.coeffs(scheme)
    cap = packing_capacity(cost, scheme, int(lengths.max()))
    k = scheme.pp - 1
    relief = doc_relief_ms(cost, scheme, lengths)
    lf = lengths.astype(np.float64)
    times = (a * lf ** 2 + b * lf + relief).tolist()
    even = sa * lf ** 2 + sb * lf + relief                 # a lower bound of each document's share
    lens = lengths.tolist()
    m = len(lens)
    order = sorted(range(m), key=lambda i: (-times[i], -lens[i]))
    S, tmax = float(even.sum()), max(times)        # the micro-batch of the dearest document costs its whole
    vmin, vmax = microbatch_range(int(lengths.sum()), m, cap, cost.util_len(scheme))
    vmax = max(vmin, min(vmax, max(m // n, 1)))

    def price(mb: list[int]) -> float:
        return cost.split_microbatch_time(lf[mb], scheme) + float(relief[mb].sum())

    def bound(V: int) -> float:
        return (k + V) * (max(S / V, tmax) + c)

    best: tuple[float, list[list[int]], list[float]] | None = None
    lo, hi = vmin, vmax
    while best is None:
        stale = 0
        for V in sorted(range(lo, hi + 1), key=bound):
            if best is not None and (bound(V) >= best[0] or stale >= EP_STALE_COUNTS):
                break
            bins = _lpt_with_capacity(times, lens, order, V, cap, n)
            if bins is None:
                continue
            prices = [price(bb) for bb in bins]
            val = (k + V) * max(prices)
            if best is None or val < best[0]:
                best, stale = (val, bins, prices), 0
            else:
                stale += 1
        if best is None:  # capacity: widen the range upwards
            lo, hi = hi + 1, min(max(2 * hi, hi + 1), m)
    _, bins, prices = best
    if improve:
        _improve_ep(bins, prices, times, lens, cap, price, n, budget=min(EP_IMPROVE_PRICES, EP_IMPROVE_DOCUMENTS // m))
    kept = [j for j in range(len(bins)) if bins[j]]
    mbs = [np.asarray(sorted(bins[j]), dtype=np.int64) for j in kept]
    mb_times = [prices[j] for j in kept]
    return PackResult(mbs, mb_times, (scheme.pp - 1 + len(mbs)) * max(mb_times))


def _improve_ep(bins: list[list[int]], prices: list[float], times: list[float], lens: list[int], cap: int,
                price, n: int, budget: int) -> None:
    """Local search on the exact prices (in place): a move of one document out of the dearest micro-batch
    ``p`` into the cheapest ``q``, or a swap of one of each, kept where both then price below ``p``'s old
    price. The candidates are tried in order of how close their transferred balancing cost comes to half
    the gap (as ``_improve``); a move keeps ``p`` at ``n`` documents. At most ``budget`` candidates are
    repriced (an exact price runs ``split_documents``): the search stays cheap for long micro-batches."""
    V = len(bins)
    used = [sum(lens[i] for i in bb) for bb in bins]
    while V > 1 and budget > 0:
        p = max(range(V), key=prices.__getitem__)
        q = min(range(V), key=prices.__getitem__)
        top = prices[p]
        if prices[q] >= top:
            return
        half = (top - prices[q]) / 2
        q_sorted = sorted(bins[q], key=times.__getitem__)
        q_times = [times[e] for e in q_sorted]
        cands = []         # (distance from half, i, e or -1)
        for i in bins[p]:
            if len(bins[p]) > n and used[q] + lens[i] <= cap:
                cands.append((abs(times[i] - half), i, -1))
            pos = bisect.bisect_left(q_times, times[i] - half)
            for r in range(max(pos - 1, 0), min(pos + 1, len(q_sorted))):
                e = q_sorted[r]
                dl = lens[i] - lens[e]
                if 0 < times[i] - times[e] and used[q] + dl <= cap and used[p] - dl <= cap:
                    cands.append((abs(times[i] - times[e] - half), i, e))
        found = None
        for _, i, e in sorted(cands)[:budget]:
            budget -= 1
            new_p = [x for x in bins[p] if x != i] + ([e] if e >= 0 else [])
            new_q = [x for x in bins[q] if x != e] + [i]
            tp, tq = price(new_p), price(new_q)
            if max(tp, tq) < top * (1 - 1e-12):
                found = (new_p, new_q, tp, tq, lens[i] - (lens[e] if e >= 0 else 0))
                break
        if found is None:
            return
        bins[p], bins[q], prices[p], prices[q], dl = found
        used[p] -= dl
        used[q] += dl
