"""Dispatching a mini-batch's documents across the pipelines of one strategy (Hydraulis Eq. 3).

The load of a pipeline is its packed latency (``packing.pack_pipeline``). Three methods:

- ``fast`` (default): longest document first onto the pipeline whose *packed-latency surrogate*
  after taking it is smallest (identical pipelines share a heap, so a step costs one heap operation
  per distinct scheme), then move/swap local search between the most and least loaded pipelines on
  the real packing. The surrogate is the packing bound ``min_V (PP-1+V) * (max(S/V, t_max) + c)`` over
  the App. C range of ``V``: a lower bound of the real packing that is tight when documents are small.
- ``greedy``: the paper's randomized greedy (Alg. 1) with the lower bound of Eq. 2 and ``trials``
  random orders; the best trial's dispatch is packed.
- ``cpsat``: dispatch and packing jointly in ortools CP-SAT (every pipeline gets up to ``Vcap``
  micro-batch slots), time-boxed and hinted with the fast solution; the yardstick, and an improver
  for small cases.

A document only goes to pipelines whose MaxLen holds it.
"""
from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from hgraph.errors import HGraphError
from hgraph.runtime.planner.schedule.packing import CPSAT_UNITS_PER_MS, PackResult, pack_pipeline
from hgraph.strategy import Scheme


# Mini-batches of at most this many documents also try SMALL_RESTARTS random-order greedy passes.
SMALL_RESTART_DOCS = 64
SMALL_RESTARTS = 16
SMALL_RESTARTS_IMPROVED = 4  # the best passes that get the local search
# Pipelines with at most this many documents also try 2-for-0/1/2 and 1-for-2 exchanges.
SMALL_EXCHANGE_DOCS = 40
# Mini-batches of at most this many documents also start the local search from Alg. 1's best of
# ALG1_TRIALS trials, which makes the fast result never worse than Alg. 1's (same trials and seed).
# Alg. 1 costs ~50-70 us per document (its trials run side by side), so larger mini-batches (1024
# GPUs) skip it; 64 GPUs at 200K tokens have ~220 documents.
ALG1_SEED_MAX_DOCS = 400
ALG1_TRIALS = 100


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


class _Scheme:
    """Per distinct scheme: coefficients, limits and every document's cost."""

    def __init__(self, scheme: Scheme, cost, lengths: np.ndarray):
        self.scheme = scheme
        self.a, self.b, self.c = cost.coeffs(scheme)
        self.k = scheme.pp - 1
        self.cap = cost.max_len(scheme)
        self.util = cost.util_len(scheme)
        self.t = self.a * lengths.astype(np.float64) ** 2 + self.b * lengths

    def estimate(self, S: float, L: int, tmax: float, n: int) -> float:
        """Packed-latency surrogate of a pipeline holding ``n`` docs, cost ``S``, ``L`` tokens."""
        if n == 0:
            return 0.0
        k, c = self.k, self.c
        # App. C range of V (as packing.microbatch_range), inlined: this runs per candidate move.
        vmin = -(-L // self.cap) or 1
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


def _check_eligible(lengths: np.ndarray, groups: list[_Scheme]) -> None:
    if lengths.size == 0:
        return
    cap = max(g.cap for g in groups)
    if int(lengths.max()) > cap:
        raise HGraphError(
            f"a document of {int(lengths.max())} tokens is longer than the largest MaxLen {cap} of the pipelines "
            f"({', '.join(sorted({str(g.scheme) for g in groups}))})")


def _groups(pipelines: Sequence[Scheme], cost, lengths: np.ndarray) -> tuple[list[_Scheme], list[int]]:
    groups: list[_Scheme] = []
    index: dict[Scheme, int] = {}
    of: list[int] = []
    for p in pipelines:
        if p not in index:
            index[p] = len(groups)
            groups.append(_Scheme(p, cost, lengths))
        of.append(index[p])
    return groups, of


def _finish(lengths: np.ndarray, pipelines: Sequence[Scheme], cost, members: list[list[int]],
            polish: bool = True) -> DispatchResult:
    assignment = [np.asarray(sorted(m), dtype=np.int64) for m in members]
    packs = [pack_pipeline(lengths[a], p, cost, improve=polish) for a, p in zip(assignment, pipelines)]
    packs = [PackResult([a[mb] for mb in pk.microbatches], pk.mb_times, pk.latency) for a, pk in zip(assignment, packs)]
    return DispatchResult(assignment, packs, max((p.latency for p in packs), default=0.0), polished=polish)


def dispatch_sequences(lengths, pipelines: Sequence[Scheme], cost, *, method: str = "fast", trials: int = 100,
                       seed: int = 0, time_limit_s: float = 10.0, workers: int = 1,
                       improve_rounds: int | None = None) -> DispatchResult:
    """Assign every document (``lengths``) to one pipeline and pack each pipeline (Eq. 3 + Eq. 1)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if not pipelines:
        raise HGraphError("dispatch needs at least one pipeline")
    if method == "fast":
        return dispatch_fast(lengths, pipelines, cost, improve_rounds=improve_rounds, seed=seed)
    if method == "greedy":
        return dispatch_randomized_greedy(lengths, pipelines, cost, trials=trials, seed=seed)
    if method == "cpsat":
        return dispatch_cpsat(lengths, pipelines, cost, time_limit_s=time_limit_s, workers=workers)
    raise HGraphError(f"unknown dispatch method {method!r}: expected fast, greedy or cpsat")


# ---- fast: surrogate greedy + real-packing local search ------------------------------------------
def dispatch_fast(lengths: np.ndarray, pipelines: Sequence[Scheme], cost, *,
                  improve_rounds: int | None = None, polish: bool = True, restarts: int | None = None,
                  seed: int = 0, alg1_seed: bool = True, greedy_starts: list | None = None) -> DispatchResult:
    """Longest-first greedy on the packing surrogate, then local search on the real packing.

    Small cases (at most ``SMALL_RESTART_DOCS`` documents) also try ``restarts`` (default
    ``SMALL_RESTARTS``) greedy passes in random document orders and keep the best packed one:
    near-balanced partitions of few documents depend on the order more than on the moves.
    Heterogeneous strategies also get a second pass with the MaxLen-aware ``fill`` rule.
    With at most ``ALG1_SEED_MAX_DOCS`` documents, Alg. 1's best trial (``ALG1_TRIALS`` trials,
    ``seed``) is one more start: the local search never makes a start worse and the result is the
    best start after it, so the result is never worse than ``dispatch_randomized_greedy(...,
    trials=ALG1_TRIALS, seed=seed)`` (whose packing is the same ``_finish``).
    ``polish=False`` (screening many candidates): the longest-first passes only, no restarts, no
    Alg. 1 start, no packing or dispatch local search. ``alg1_seed=False`` leaves out the Alg. 1
    start (selection adds it to the winning candidate only, with ``improve_with_alg1``).
    ``greedy_starts``: the ``greedy_starts`` of an earlier result on the same input (the
    longest-first passes are deterministic, so they are not recomputed).
    """
    groups, of = _groups(pipelines, cost, lengths)
    _check_eligible(lengths, groups)
    if greedy_starts is None:
        order = sorted(range(len(lengths)), key=lambda i: -int(lengths[i]))
        greedy_starts = [_greedy_members(lengths, pipelines, groups, of, order)]
        if len(groups) > 1:  # heterogeneous: the MaxLen-aware rule may avoid high floors
            # Fill towards the work bound (rank-ms of every document at its cheapest / all ranks).
            ranks = sum(p.num_ranks for p in pipelines)
            work = np.min(np.stack([np.where(lengths <= g.cap, g.t * g.scheme.num_ranks, np.inf) for g in groups]),
                          axis=0)
            greedy_starts.append(_greedy_members(lengths, pipelines, groups, of, order, rule="fill",
                                                 target=float(work.sum()) / ranks))
    result = min((_finish(lengths, pipelines, cost, m, polish=polish) for m in greedy_starts),
                 key=lambda r: r.latency)
    if restarts is None:
        restarts = SMALL_RESTARTS if len(lengths) <= SMALL_RESTART_DOCS and len(pipelines) > 1 else 0
    starts = [result]
    if polish and restarts > 0:
        rng = np.random.default_rng(seed)
        for _ in range(restarts):
            members = _greedy_members(lengths, pipelines, groups, of, rng.permutation(len(lengths)).tolist())
            starts.append(_finish(lengths, pipelines, cost, members, polish=polish))
        starts.sort(key=lambda r: r.latency)
        starts = starts[:SMALL_RESTARTS_IMPROVED]
    if polish and (improve_rounds is None or improve_rounds > 0):
        starts = [improve_dispatch(lengths, pipelines, cost, r, rounds=improve_rounds) for r in starts]
    best = min(starts, key=lambda r: r.latency)
    if polish and alg1_seed:
        best = improve_with_alg1(lengths, pipelines, cost, best, seed=seed, improve_rounds=improve_rounds)
    best.greedy_starts = greedy_starts
    return best


def improve_with_alg1(lengths: np.ndarray, pipelines: Sequence[Scheme], cost, result: DispatchResult, *,
                      seed: int = 0, improve_rounds: int | None = None) -> DispatchResult:
    """``result`` or, if better, Alg. 1's best trial (``ALG1_TRIALS``, ``seed``) after the local search.

    Done for 2..``ALG1_SEED_MAX_DOCS`` documents on more than one pipeline; then the returned
    latency is at most ``dispatch_randomized_greedy(lengths, pipelines, cost, trials=ALG1_TRIALS,
    seed=seed).latency`` (same packing, and the local search never makes a start worse). The
    local search runs on Alg. 1's dispatch only when its packing already beats ``result`` (rare),
    which keeps the guarantee at the cost of one Alg. 1 pass and one packing.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(pipelines) <= 1 or not 1 < len(lengths) <= ALG1_SEED_MAX_DOCS:
        return result
    start = _finish(lengths, pipelines, cost, alg1_assignment(lengths, pipelines, cost, trials=ALG1_TRIALS, seed=seed))
    if start.latency >= result.latency:
        return result
    if improve_rounds is None or improve_rounds > 0:
        start = improve_dispatch(lengths, pipelines, cost, start, rounds=improve_rounds)
    return start


def _greedy_members(lengths: np.ndarray, pipelines: Sequence[Scheme], groups: list[_Scheme], of: list[int],
                    order: list[int], rule: str = "lpt", target: float = 0.0) -> list[list[int]]:
    """One greedy pass in ``order``: per pipeline, its documents. Each document goes, per scheme, to the pipeline
    with the smallest surrogate (one heap per distinct scheme); across schemes ``rule`` decides:
    ``lpt``: the smallest surrogate after taking it; ``fill``: the scheme with the largest MaxLen
    whose surrogate stays within ``max(target, current maximum)`` (as Alg. 1 does), else the
    smallest. ``fill``
    keeps long documents off small pipelines, where they would set a high floor early."""
    D = len(pipelines)
    fill = rule == "fill"
    group_order = sorted(range(len(groups)), key=lambda gi: -groups[gi].cap) if fill else range(len(groups))
    cur_max = target
    S = [0.0] * D
    L = [0] * D
    tmax = [0.0] * D
    n = [0] * D
    est = [0.0] * D
    members: list[list[int]] = [[] for _ in range(D)]
    heaps: list[list[tuple[float, int]]] = [[] for _ in groups]
    for j, g in enumerate(of):
        heaps[g].append((0.0, j))
    for h in heaps:
        heapq.heapify(h)
    lens = lengths.tolist()
    caps = [g.cap for g in groups]
    costs = [g.t.tolist() for g in groups]
    for i in order:
        li = lens[i]
        best_val, best_j = math.inf, -1
        for gi in group_order:
            if li > caps[gi]:
                continue
            h = heaps[gi]
            while h[0][0] != est[h[0][1]]:  # drop stale entries
                heapq.heappop(h)
            j = h[0][1]
            t = costs[gi][i]
            val = groups[gi].estimate(S[j] + t, L[j] + li, max(tmax[j], t), n[j] + 1)
            if fill and val <= cur_max:
                best_val, best_j = val, j
                break
            if val < best_val:
                best_val, best_j = val, j
        j = best_j
        if best_val > cur_max:
            cur_max = best_val
        g = of[j]
        t = costs[g][i]
        S[j] += t; L[j] += li; n[j] += 1
        tmax[j] = max(tmax[j], t)
        est[j] = best_val
        members[j].append(i)
        heapq.heappush(heaps[g], (best_val, j))
    return members


def improve_dispatch(lengths, pipelines: Sequence[Scheme], cost, result: DispatchResult, *,
                     rounds: int | None = None) -> DispatchResult:
    """Local search on the real packing (moves/swaps off the slowest pipeline); never worse.

    ``rounds`` defaults to ``2 * pipelines + 8``.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if not result.polished:
        result = _finish(lengths, pipelines, cost, [a.tolist() for a in result.assignment])
    D = len(pipelines)
    if D <= 1:
        return result
    groups, of = _groups(pipelines, cost, lengths)
    return _local_search(lengths, pipelines, cost, result, groups, of, rounds if rounds is not None else 2 * D + 8)


def _local_search(lengths: np.ndarray, pipelines: Sequence[Scheme], cost, result: DispatchResult,
                  groups: list[_Scheme], of: list[int], rounds: int, max_repacks_per_round: int = 12) -> DispatchResult:
    """Move or swap one document between the slowest pipeline and a faster one, repacking both.

    A candidate is first checked on the surrogate (a lower bound of the packing): only moves whose
    surrogate stays below the current maximum are repacked.
    """
    members = [list(a.tolist()) for a in result.assignment]
    packs = list(result.packs)
    lat = [p.latency for p in packs]
    lens = lengths.tolist()
    caps = [g.cap for g in groups]
    costs = [g.t.tolist() for g in groups]
    D = len(pipelines)

    def stats(j: int, docs: list[int]) -> tuple[float, int, float, int]:
        cj = costs[of[j]]
        ts = [cj[d] for d in docs]
        return sum(ts), sum(lens[d] for d in docs), max(ts, default=0.0), len(docs)

    def repack(j: int, docs: list[int]) -> PackResult:
        arr = np.asarray(sorted(docs), dtype=np.int64)
        pk = pack_pipeline(lengths[arr], pipelines[j], cost)
        return PackResult([arr[mb] for mb in pk.microbatches], pk.mb_times, pk.latency)

    for _ in range(rounds):
        p = max(range(D), key=lat.__getitem__)
        top = lat[p]
        if top <= 0 or len(members[p]) <= 1:
            break
        gp = of[p]
        Sp, Lp, _, np_ = stats(p, members[p])
        docs_p = sorted(members[p], key=lambda i: -costs[gp][i])
        tmax_p_without_first = costs[gp][docs_p[1]]
        budget = max_repacks_per_round
        done = False
        for q in sorted(range(D), key=lat.__getitem__)[:4]:
            if q == p or lat[q] >= top or budget <= 0:
                continue
            gq = of[q]
            Sq, Lq, tq, nq = stats(q, members[q])
            # Move: the costliest document of p that q can take below the maximum.
            for r, i in enumerate(docs_p):
                if lens[i] > caps[gq] or budget <= 0:
                    continue
                ti = costs[gq][i]
                if groups[gq].estimate(Sq + ti, Lq + lens[i], max(tq, ti), nq + 1) >= top:
                    continue
                tp_rest = tmax_p_without_first if r == 0 else costs[gp][docs_p[0]]
                if groups[gp].estimate(Sp - costs[gp][i], Lp - lens[i], tp_rest, np_ - 1) >= top:
                    continue
                budget -= 1
                new_q = repack(q, members[q] + [i])
                if new_q.latency >= top:
                    continue
                new_p = repack(p, [d for d in members[p] if d != i])
                if new_p.latency < top:
                    members[q].append(i); members[p].remove(i)
                    packs[p], packs[q] = new_p, new_q
                    lat[p], lat[q] = new_p.latency, new_q.latency
                    done = True
                    break
            if done:
                break
            # Swap: a document of p with a cheaper one of q; the transfers closest to half the gap first.
            # Transfer d (in p's costs) that meets in the middle: p drops by about rate_p * d, q rises
            # by rate_q * rho * d, with rate = (PP-1+V)/V for balanced micro-batches and rho the
            # ratio of the schemes' per-token costs.
            rate_p = (pipelines[p].pp - 1 + max(packs[p].num_microbatches, 1)) / max(packs[p].num_microbatches, 1)
            rate_q = (pipelines[q].pp - 1 + max(packs[q].num_microbatches, 1)) / max(packs[q].num_microbatches, 1)
            rho = groups[gq].b / groups[gp].b if groups[gp].b > 0 else 1.0
            want = (top - lat[q]) / (rate_p + rate_q * rho)
            pairs = []
            for i in docs_p[:24]:
                if lens[i] > caps[gq]:
                    continue
                for e in members[q]:
                    if lens[e] > caps[gp]:
                        continue
                    d = costs[gp][i] - costs[gp][e]
                    if 0 < d < 2 * want:
                        pairs.append((abs(d - want), i, e))
            # Small pipelines: also exchanges of up to two documents each way (finer transfers).
            if len(members[p]) <= SMALL_EXCHANGE_DOCS and len(members[q]) <= SMALL_EXCHANGE_DOCS:
                pairs.extend(_exchanges(members[p], members[q], costs[gp], lens, caps[gq], caps[gp], want))
            pairs.sort(key=lambda x: x[0])
            for _, i, e in pairs[:3]:
                if budget <= 0:
                    break
                budget -= 2
                out_p = set(i) if isinstance(i, tuple) else {i}
                out_q = set(e) if isinstance(e, tuple) else {e}
                mp = [x for x in members[p] if x not in out_p] + sorted(out_q)
                mq = [x for x in members[q] if x not in out_q] + sorted(out_p)
                new_p, new_q = repack(p, mp), repack(q, mq)
                if max(new_p.latency, new_q.latency) < top:
                    members[p], members[q] = mp, mq
                    packs[p], packs[q] = new_p, new_q
                    lat[p], lat[q] = new_p.latency, new_q.latency
                    done = True
                    break
            if done:
                break
        if not done:
            break
    assignment = [np.asarray(sorted(m), dtype=np.int64) for m in members]
    return DispatchResult(assignment, packs, max(lat))


def _exchanges(src: list[int], dst: list[int], cost: list[float], lens: list[int], cap_dst: int, cap_src: int,
               want: float, limit: int = 3) -> list[tuple[float, tuple[int, ...], tuple[int, ...]]]:
    """Exchanges of one or two documents of ``src`` for up to two of ``dst`` whose cost transfer
    ``d`` (on the ``src`` pipeline's costs) lies in ``(0, 2 want)``; the ``limit`` closest to
    ``want``, as ``(|d - want|, out of src, out of dst)``. Subset sums of ``dst`` are sorted and
    bisected, so this is O(U^2 log U) for pipelines of U documents."""
    movable = [i for i in src if lens[i] <= cap_dst]
    back = [e for e in dst if lens[e] <= cap_src]
    outs = [((i,), cost[i]) for i in movable]
    outs += [((movable[a], i2), cost[movable[a]] + cost[i2]) for a in range(len(movable)) for i2 in movable[a + 1:]]
    ins = [((), 0.0)] + [((e,), cost[e]) for e in back]
    ins += [((back[a], e2), cost[back[a]] + cost[e2]) for a in range(len(back)) for e2 in back[a + 1:]]
    ins.sort(key=lambda x: x[1])
    in_cost = [c for _, c in ins]
    found = []
    for out, c_out in outs:
        pos = bisect.bisect_left(in_cost, c_out - want)
        for r in range(max(pos - 1, 0), min(pos + 1, len(ins))):
            d = c_out - in_cost[r]
            if 0 < d < 2 * want and (len(out) > 1 or len(ins[r][0]) > 1):  # 1-for-0/1 are tried already
                found.append((abs(d - want), out, ins[r][0]))
    found.sort(key=lambda x: x[0])
    return found[:limit]


# ---- Alg. 1: randomized greedy on the Eq. 2 lower bound ----------------------------------------
def alg1_assignment(lengths: np.ndarray, pipelines: Sequence[Scheme], cost, *, trials: int = 100,
                    seed: int = 0) -> list[list[int]]:
    """The best trial of Hydraulis Alg. 1 as per-pipeline document lists (not yet packed).

    ``trials`` random orders (``rng.permutation`` drawn one after another from ``seed``), each
    dispatched greedily to the pipeline that minimises the largest Eq. 2 bound (``sum T(l_i) +
    T(l_max) (PP-1)``, with ``c`` charged once per micro-batch as in the authors' dispatcher); the
    trial with the smallest largest bound wins (the first among equals). The trials run side by
    side as rows of numpy arrays (one step per document position), so the cost is ``B`` vector
    steps of ``trials x D`` instead of ``trials * B`` scalar ones; every row does exactly the
    arithmetic of one sequential trial.
    """
    if trials < 1:
        raise HGraphError(f"trials must be >= 1, got {trials}")
    groups, of = _groups(pipelines, cost, lengths)
    _check_eligible(lengths, groups)
    D, B = len(pipelines), len(lengths)
    if B == 0:
        return [[] for _ in range(D)]
    a = np.array([groups[g].a for g in of]); b = np.array([groups[g].b for g in of])
    c = np.array([groups[g].c for g in of]); k = np.array([groups[g].k for g in of], dtype=np.float64)
    cap = np.array([groups[g].cap for g in of])
    lf = lengths.astype(np.float64)
    t_all = a[None, :] * lf[:, None] ** 2 + b[None, :] * lf[:, None]  # B x D
    # The (PP-1) T(l_max) term: T is non-decreasing in l (a, b, c >= 0), so T(max) = max(T).
    e_all = (t_all + c) * k
    inelig = lengths[:, None] > cap[None, :]
    rng = np.random.default_rng(seed)
    perms = np.stack([rng.permutation(B) for _ in range(trials)])  # trials x B
    rows = np.arange(trials)
    cols = np.arange(D)[None, :]
    any_inelig = bool(inelig.any())
    C = np.zeros((trials, D))
    emax = np.zeros((trials, D))
    # Per trial: the largest bound, its pipeline, and the largest bound of the other pipelines
    # (bounds only grow, so both are kept up to date from the one changed entry per step).
    top1 = np.zeros(trials)
    top2 = np.zeros(trials)
    top_at = np.zeros(trials, dtype=np.int64)
    assign = np.empty((trials, B), dtype=np.int64)
    for step in range(B):
        i = perms[:, step]
        newC = C + t_all[i]
        ne = np.maximum(emax, e_all[i])
        new_total = newC + c + ne
        # The largest bound of the *other* pipelines: the top one's, except at the top itself.
        others = np.where(cols == top_at[:, None], top2[:, None], top1[:, None])
        obj = np.maximum(new_total, others)
        if any_inelig:
            obj[inelig[i]] = np.inf
        j = np.argmin(obj, axis=1)
        C[rows, j] = newC[rows, j]; emax[rows, j] = ne[rows, j]
        v = new_total[rows, j]
        at_top = j == top_at
        above = ~at_top & (v > top1)
        top2 = np.where(above, top1, np.where(at_top, top2, np.maximum(top2, v)))
        top1 = np.where(at_top | above, v, top1)
        top_at = np.where(above, j, top_at)
        assign[rows, i] = j
    best = int(np.argmin(top1))
    return [np.flatnonzero(assign[best] == j).tolist() for j in range(D)]


def dispatch_randomized_greedy(lengths: np.ndarray, pipelines: Sequence[Scheme], cost, *, trials: int = 100,
                               seed: int = 0) -> DispatchResult:
    """Hydraulis Alg. 1 (``alg1_assignment``: ``trials`` random orders on the Eq. 2 bound); the best
    trial is packed."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return _finish(lengths, pipelines, cost, alg1_assignment(lengths, pipelines, cost, trials=trials, seed=seed))


# ---- CP-SAT: joint dispatch + packing ---------------------------------------------------------
def dispatch_cpsat(lengths: np.ndarray, pipelines: Sequence[Scheme], cost, *, time_limit_s: float = 10.0,
                   workers: int = 1, hint: DispatchResult | None = None, vcap: int | None = None) -> DispatchResult:
    """Eq. 3 with the exact packed latency (Eq. 1) of every pipeline, in one CP-SAT model.

    Pipeline ``j`` has ``Vcap`` micro-batch slots (default: twice the hint's largest micro-batch
    count plus 2, at most the number of documents); ``V_j`` = used slots obey the App. C UtilLen
    bound ``V_j * UtilLen <= max(tokens_j, UtilLen)``; latency ``(PP-1+V_j) * max slot load``. The
    result is never worse than the hint (the fast dispatch by default), which is given in full
    (every variable), so CP-SAT starts from a feasible solution even on models too large to find
    one in the time limit. ``bound`` is CP-SAT's proven lower bound (also when it found no
    solution); ``bound_restricted`` says whether ``Vcap`` was below the App. C range's largest
    ``V`` for some pipeline (then the bound holds for the restricted model only).
    """
    from ortools.sat.python import cp_model

    groups, of = _groups(pipelines, cost, lengths)
    _check_eligible(lengths, groups)
    if hint is None:
        hint = dispatch_fast(lengths, pipelines, cost)
    D, B = len(pipelines), len(lengths)
    if B == 0:
        return hint
    lens = lengths.tolist()
    U = CPSAT_UNITS_PER_MS
    vmax_hint = max(p.num_microbatches for p in hint.packs)
    vc = vcap if vcap is not None else min(B, 2 * vmax_hint + 2)
    # Largest V of the App. C range over the pipelines (packing.microbatch_range with every document).
    total_tokens = int(lengths.sum())
    restricted = vc < min(B, max(max(total_tokens // max(g.util, 1), -(-total_tokens // g.cap)) for g in groups))
    # The hint, in full: slots of each pipeline in decreasing load (the model's symmetry breaking).
    hint_slot: dict[int, tuple[int, int]] = {}
    hint_loads: list[list[int]] = []
    for j, pk in enumerate(hint.packs):
        order = sorted(range(pk.num_microbatches), key=lambda s: -pk.mb_times[s])
        units_j = [int(round(float(t) * CPSAT_UNITS_PER_MS)) for t in groups[of[j]].t]
        cu_j = int(round(groups[of[j]].c * CPSAT_UNITS_PER_MS))
        loads = []
        for slot, s in enumerate(order):
            docs = pk.microbatches[s].tolist()
            for i in docs:
                hint_slot[i] = (j, slot)
            loads.append(sum(units_j[i] for i in docs) + cu_j)
        hint_loads.append(loads)
    full_hint = vmax_hint <= vc and all(loads == sorted(loads, reverse=True) for loads in hint_loads)
    m = cp_model.CpModel()
    x: dict[tuple[int, int, int], cp_model.IntVar] = {}
    for i in range(B):
        opts = []
        for j in range(D):
            if lens[i] <= groups[of[j]].cap:
                for s in range(vc):
                    x[i, j, s] = m.NewBoolVar("")
                    opts.append(x[i, j, s])
        m.AddExactlyOne(opts)
    total_units = sum(int(round(float(groups[g].t.max()) * U)) for g in range(len(groups))) * B + 1
    horizon = 0
    lat_vars = []
    for j in range(D):
        g = groups[of[j]]
        units = [int(round(float(t) * U)) for t in g.t]
        cu = int(round(g.c * U))
        y = [m.NewBoolVar("") for _ in range(vc)]
        for s in range(vc - 1):
            m.AddImplication(y[s + 1], y[s])
        M = m.NewIntVar(0, total_units + cu, "")
        tokens = []
        prev_load = None
        for s in range(vc):
            items = [(i, x[i, j, s]) for i in range(B) if (i, j, s) in x]
            for _, v in items:
                m.AddImplication(v, y[s])
            m.Add(sum(lens[i] * v for i, v in items) <= g.cap)
            load = sum(units[i] * v for i, v in items) + cu * y[s]
            m.Add(load <= M)
            tokens.append(sum(lens[i] * v for i, v in items))
            if prev_load is not None:
                m.Add(prev_load >= load)  # symmetry: slots in decreasing load
            prev_load = load
        V = m.NewIntVar(0, vc, "")
        m.Add(V == sum(y))
        tok = m.NewIntVar(0, int(lengths.sum()), "")
        m.Add(tok == sum(tokens))
        cap_tok = m.NewIntVar(0, int(lengths.sum()) + g.util, "")
        m.AddMaxEquality(cap_tok, [tok, g.util])
        m.Add(V * g.util <= cap_tok)
        kv = m.NewIntVar(0, g.k + vc, "")
        m.Add(kv == V + g.k).OnlyEnforceIf(y[0])
        m.Add(kv == 0).OnlyEnforceIf(y[0].Not())
        ub = (g.k + vc) * (total_units + cu)
        horizon = max(horizon, ub)
        lat = m.NewIntVar(0, ub, "")
        m.AddMultiplicationEquality(lat, [kv, M])
        lat_vars.append(lat)
        if full_hint:
            loads = hint_loads[j]
            h_tok = int(lengths[hint.assignment[j]].sum()) if len(hint.assignment[j]) else 0
            h_M = max(loads, default=0)
            h_kv = len(loads) + g.k if loads else 0
            for s_, v in enumerate(y):
                m.AddHint(v, s_ < len(loads))
            for var, val in ((M, h_M), (V, len(loads)), (tok, h_tok), (cap_tok, max(h_tok, g.util)), (kv, h_kv),
                             (lat, h_kv * h_M)):
                m.AddHint(var, val)
    Z = m.NewIntVar(0, horizon, "")
    m.AddMaxEquality(Z, lat_vars)
    m.Minimize(Z)
    # Hint: the given dispatch, slots sorted by load (every x when the hint fits the slots).
    for (i, j, s_), v in x.items():
        if full_hint:
            m.AddHint(v, hint_slot[i] == (j, s_))
        elif hint_slot.get(i) == (j, s_):
            m.AddHint(v, 1)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = workers
    status = solver.Solve(m)
    bound = solver.BestObjectiveBound() / U if status != cp_model.MODEL_INVALID else None
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return DispatchResult(hint.assignment, hint.packs, hint.latency, bound=bound, bound_restricted=restricted)
    members: list[list[int]] = [[] for _ in range(D)]
    for (i, j, s), v in x.items():
        if solver.BooleanValue(v):
            members[j].append(i)
    # Re-pack each pipeline with the exact float costs (CP-SAT used rounded integers).
    res = _finish(lengths, pipelines, cost, members)
    chosen = res if res.latency < hint.latency else hint
    return DispatchResult(chosen.assignment, chosen.packs, chosen.latency, bound=bound, bound_restricted=restricted)
