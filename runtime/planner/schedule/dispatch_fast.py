"""The ``fast`` dispatch (the default): longest document first onto the pipeline whose packed-latency
surrogate after taking it is smallest, then move/swap local search on the real packing between the
most and least loaded pipelines.

Identical pipelines share a heap, so a greedy step costs one heap operation per distinct scheme. The
surrogate (``SchemeCosts.estimate``) is the packing bound ``min_V (PP-1+V) * (max(S/V, t_max) + c)``
over the App. C range of ``V``: a lower bound of the real packing that is tight when documents are
small. Mini-batches of up to ``SMALL_RESTART_DOCS`` documents also try random-order passes, and of up
to ``ALG1_SEED_MAX_DOCS`` Alg. 1's best trial (``dispatch_alg1``) as one more start, which keeps the
result never worse than Alg. 1's. Strategies of many pipelines deal each scheme's documents straight
into all of that scheme's micro-batches (``deal_dispatch``) instead of packing pipeline by pipeline.
"""
from __future__ import annotations

import bisect
import heapq
import math
from typing import Sequence

import numpy as np

from hgraph.runtime.planner.schedule.dispatch_alg1 import alg1_assignment
from hgraph.runtime.planner.schedule.dispatch_result import (DispatchResult, SchemeCosts, check_eligible,
                                                             estimate_many, pack_dispatch, scheme_costs)
from hgraph.runtime.planner.schedule.packing import PackResult, pack_pipeline
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
# Strategies of more than this many pipelines (1024 GPUs and up) take documents in chunks
# (``_greedy_members_chunked``, numpy over pipelines) and are screened on the surrogate alone.
CHUNKED_PIPELINES = 64
# ... a chunk holds one document per pipeline for this fraction of the pipelines (the least loaded).
CHUNK_FRACTION = 8
CHUNK_CAP_SLACK = 0.03
# ... and their dispatch local search stops after this many rounds (measured at 12,288 GPUs on 384
# pipelines: the full 2D+8 rounds gained 0.01% for ~0.3 s).
CHUNKED_IMPROVE_ROUNDS = 16
# ... and so does a dispatch of more than this many documents (measured at 1024 GPUs, ~3,000
# documents on 32xTP4PP1CP8: the full 72 rounds gained <= 0.01% over 16 for 15-50 ms an iteration,
# what made the slow iterations slow).
MANY_DOCS = 1000


def dispatch_fast(lengths: np.ndarray, pipelines: Sequence[Scheme], cost, *,
                  improve_rounds: int | None = None, polish: bool = True, restarts: int | None = None,
                  seed: int = 0, alg1_seed: bool = True, greedy_starts: list | None = None,
                  stop_above: float = math.inf) -> DispatchResult:
    """Longest-first greedy on the packing surrogate, then local search on the real packing.

    Small cases (at most ``SMALL_RESTART_DOCS`` documents) also try ``restarts`` (default
    ``SMALL_RESTARTS``) greedy passes in random document orders and keep the best packed one:
    near-balanced partitions of few documents depend on the order more than on the moves.
    Heterogeneous strategies also get a second pass with the MaxLen-aware ``fill`` rule.
    With at most ``ALG1_SEED_MAX_DOCS`` documents, Alg. 1's best trial (``ALG1_TRIALS`` trials,
    ``seed``) is one more start: the local search never makes a start worse and the result is the
    best start after it, so the result is never worse than ``dispatch_randomized_greedy(...,
    trials=ALG1_TRIALS, seed=seed)`` (whose packing is the same ``pack_dispatch``).
    ``polish=False`` (screening many candidates): the longest-first passes only, no restarts, no
    Alg. 1 start, no packing or dispatch local search. ``alg1_seed=False`` leaves out the Alg. 1
    start (selection adds it to the winning candidate only, with ``improve_with_alg1``).
    ``greedy_starts``: the ``greedy_starts`` of an earlier result on the same input (the
    longest-first passes are deterministic, so they are not recomputed).
    With more than ``CHUNKED_PIPELINES`` pipelines the longest-first pass goes in chunks
    (``_greedy_members_chunked``) and ``polish=False`` returns the surrogate's latency unpacked
    (no ``packs``), or an infinite latency as soon as it passes ``stop_above`` (screening: the
    candidate cannot win).
    """
    groups, of = scheme_costs(pipelines, cost, lengths)
    check_eligible(lengths, groups)
    chunked = len(pipelines) > CHUNKED_PIPELINES
    if greedy_starts is None and chunked:
        chunked_pass = _greedy_members_chunked(lengths, groups, of, stop_above=math.inf if polish else stop_above)
        if chunked_pass is None:
            return DispatchResult([], [], math.inf, polished=False)
        members, surrogate = chunked_pass
        greedy_starts = [members]
        if not polish:  # screening: the surrogate (a lower bound of the packing) stands for it
            res = DispatchResult([np.asarray(sorted(m), dtype=np.int64) for m in members], [], surrogate,
                                 polished=False)
            res.greedy_starts = greedy_starts
            return res
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
    if chunked and polish:
        result = min((deal_dispatch(lengths, pipelines, cost, m, groups, of) for m in greedy_starts),
                     key=lambda r: r.latency)
    else:
        result = min((pack_dispatch(lengths, pipelines, cost, m, polish=polish) for m in greedy_starts),
                     key=lambda r: r.latency)
    if (chunked or len(lengths) > MANY_DOCS) and improve_rounds is None:
        improve_rounds = CHUNKED_IMPROVE_ROUNDS
    if restarts is None:
        restarts = SMALL_RESTARTS if len(lengths) <= SMALL_RESTART_DOCS and len(pipelines) > 1 else 0
    starts = [result]
    if polish and restarts > 0:
        rng = np.random.default_rng(seed)
        for _ in range(restarts):
            members = _greedy_members(lengths, pipelines, groups, of, rng.permutation(len(lengths)).tolist())
            starts.append(pack_dispatch(lengths, pipelines, cost, members, polish=polish))
        starts.sort(key=lambda r: r.latency)
        starts = starts[:SMALL_RESTARTS_IMPROVED]
    if polish and (improve_rounds is None or improve_rounds > 0):
        starts = [improve_dispatch(lengths, pipelines, cost, r, rounds=improve_rounds) for r in starts]
    best = min(starts, key=lambda r: r.latency)
    if polish and alg1_seed:
        best = improve_with_alg1(lengths, pipelines, cost, best, seed=seed, improve_rounds=improve_rounds)
    best.greedy_starts = greedy_starts
    return best


def _scheme_arrays(groups: list[SchemeCosts], of: list[int]) -> tuple[np.ndarray, ...]:
    """Per pipeline: ``k, c, cap, util, pack_cap`` of its scheme (for ``estimate_many``)."""
    of_arr = np.asarray(of, dtype=np.int64)
    return tuple(np.array([getattr(g, name) for g in groups])[of_arr]
                 for name in ("k", "c", "cap", "util", "pack_cap"))


def _greedy_members_chunked(lengths: np.ndarray, groups: list[SchemeCosts], of: list[int], *,
                            stop_above: float = math.inf) -> tuple[list[list[int]], float] | None:
    """Longest first in chunks: the next ``ceil(D / CHUNK_FRACTION)`` documents go, longest to
    least, to the pipelines whose surrogate after taking the chunk's longest document is smallest
    (among those whose MaxLen holds it), one document each. With many pipelines a chunk's documents
    barely move the order of the loads, so this is close to the one-by-one pass at a fraction of
    its Python cost (numpy over pipelines, per chunk). The surrogate's token limit is taken
    ``CHUNK_CAP_SLACK`` below MaxLen: filling pipelines to whole multiples of MaxLen leaves
    micro-batches that do not pack (measured: +23% after packing at 68 pipelines without it, +0.1%
    with 3%). Returns the members and the largest surrogate, or None once the largest surrogate
    passes ``stop_above``."""
    D = len(of)
    of_arr = np.asarray(of, dtype=np.int64)
    k, c, caps, util, pcaps = _scheme_arrays(groups, of)
    vcaps = np.maximum((pcaps * (1 - CHUNK_CAP_SLACK)).astype(np.int64), 1)
    tt = np.stack([g.t for g in groups])          # (schemes, docs)
    order = np.argsort(-lengths, kind="stable")
    S = np.zeros(D); L = np.zeros(D, dtype=np.int64); tmax = np.zeros(D); n = np.zeros(D, dtype=np.int64)
    owner = np.empty(lengths.size, dtype=np.int64)
    m = max(1, -(-D // CHUNK_FRACTION))
    pos = 0
    while pos < order.size:
        first = int(order[pos])
        l1 = int(lengths[first])
        t1 = tt[of_arr, first]
        after = estimate_many(S + t1, L + l1, np.maximum(tmax, t1), n + 1, k, c, vcaps, util)
        after[caps < l1] = np.inf
        eligible = int(np.count_nonzero(caps >= l1))
        take = min(m, eligible, order.size - pos)
        chunk = order[pos:pos + take]
        picked = np.argpartition(after, take - 1)[:take] if take < D else np.arange(D)
        picked = picked[np.argsort(after[picked], kind="stable")][:take]
        t = tt[of_arr[picked], chunk]
        S[picked] += t
        L[picked] += lengths[chunk]
        tmax[picked] = np.maximum(tmax[picked], t)
        n[picked] += 1
        owner[chunk] = picked
        pos += take
        # ``after`` took the chunk's longest document on every picked pipeline (and the surrogate's
        # smaller token limit), so the exact surrogate is computed only when ``after`` passes.
        if stop_above < math.inf and float(after[picked].max()) > stop_above:
            now = estimate_many(S[picked], L[picked], tmax[picked], n[picked], k[picked], c[picked], pcaps[picked],
                                util[picked])
            if float(now.max()) > stop_above:
                return None
    surrogate = float(estimate_many(S, L, tmax, n, k, c, pcaps, util).max(initial=0.0))
    members: list[list[int]] = [[] for _ in range(D)]
    for i, j in zip(order.tolist(), owner[order].tolist()):   # longest first, as the one-by-one pass
        members[j].append(i)
    return members, surrogate


def deal_dispatch(lengths: np.ndarray, pipelines: Sequence[Scheme], cost, members: list[list[int]],
                  groups: list[SchemeCosts], of: list[int]) -> DispatchResult:
    """The dispatch ``members`` packed by dealing each scheme's documents straight into all of its
    pipelines' micro-batches (instead of packing each pipeline's own documents).

    Per pipeline, the number of micro-batches its surrogate is for (``estimate_many(counts=True)``);
    per scheme, its documents longest first into the micro-batch where ``(PP - 1 + V_j) * (load +
    t + c)`` stays smallest within MaxLen (one heap per count ``V_j``). Why: a pipeline of a few
    long documents (CP pipelines holding what no other scheme can) splits them unevenly into its own
    ``V`` micro-batches, and the surrogate (an even split) read 5-9% low at 12,288 GPUs; pooled over
    the scheme, micro-batches balance across pipelines. It also costs less than packing every
    pipeline (12,288 GPUs: ~0.1 s against ~0.16 s). A scheme whose documents do not all fit its
    micro-batches this way has its pipelines packed one by one (``pack_pipeline``)."""
    k, c, _, util, pcaps = _scheme_arrays(groups, of)
    D = len(of)
    S = np.zeros(D); L = np.zeros(D, dtype=np.int64); tmax = np.zeros(D); n = np.zeros(D, dtype=np.int64)
    of_arr = np.asarray(of, dtype=np.int64)
    for j, m in enumerate(members):
        if m:
            t = groups[of[j]].t[m]
            S[j], L[j], tmax[j], n[j] = float(t.sum()), int(lengths[m].sum()), float(t.max()), len(m)
    _, V = estimate_many(S, L, tmax, n, k, c, pcaps, util, counts=True)
    packs: list[PackResult | None] = [None] * D
    for gi, g in enumerate(groups):
        js = np.nonzero((of_arr == gi) & (V > 0))[0].tolist()
        docs = [i for j in js for i in members[j]]
        dealt = _deal_into_microbatches(lengths, g, js, [int(V[j]) for j in js], docs) if docs else None
        if dealt is not None:
            for j, pk in zip(js, dealt):
                packs[j] = pk
            continue
        for j in js:    # one by one, as pack_dispatch does
            a = np.asarray(sorted(members[j]), dtype=np.int64)
            pk = pack_pipeline(lengths[a], pipelines[j], cost)
            packs[j] = PackResult([a[mb] for mb in pk.microbatches], pk.mb_times, pk.latency)
    packs = [pk if pk is not None else PackResult([], [], 0.0) for pk in packs]
    assignment = [np.asarray(sorted(int(i) for mb in pk.microbatches for i in mb), dtype=np.int64) for pk in packs]
    return DispatchResult(assignment, packs, max((pk.latency for pk in packs), default=0.0))


def _deal_into_microbatches(lengths: np.ndarray, g: SchemeCosts, js: list[int], counts: list[int],
                            docs: list[int]) -> list[PackResult] | None:
    """``deal_dispatch``'s dealing of ``docs`` into ``counts[r]`` micro-batches of each pipeline
    ``js[r]`` of one scheme (PackResults in the order of ``js``); None when a document fits no
    micro-batch."""
    t = g.t
    darr = np.asarray(docs, dtype=np.int64)
    order = darr[np.argsort(-t[darr], kind="stable")].tolist()
    bins: list[list[int]] = []
    owner: list[int] = []
    room: list[int] = []
    load: list[float] = []
    heaps: dict[int, list[tuple[float, int]]] = {}
    for r, V in enumerate(counts):
        for _ in range(V):
            heaps.setdefault(V, []).append((0.0, len(bins)))
            # packing capacity: a document that needs relief (past it) fits no micro-batch here, and
            # its scheme's pipelines are packed one by one (pack_pipeline prices the relief)
            bins.append([]); owner.append(r); room.append(g.pack_cap); load.append(0.0)
    lens = lengths.tolist()
    times = t.tolist()
    k, c = g.k, g.c
    # Micro-batches without room for the current document wait in ``parked`` (most room first) and
    # return to their heap once documents are short enough (they come longest first).
    parked: list[tuple[int, int, int]] = []        # (-room, bin, V)
    for i in order:
        li, ti = lens[i], times[i]
        while parked and -parked[0][0] >= li:
            _, b, V = heapq.heappop(parked)
            heapq.heappush(heaps[V], (load[b], b))
        best_val, best_V = math.inf, -1
        for V, h in heaps.items():
            while h and room[h[0][1]] < li:
                _, b = heapq.heappop(h)
                heapq.heappush(parked, (-room[b], b, V))
            if h:
                val = (k + V) * (h[0][0] + ti + c)
                if val < best_val:
                    best_val, best_V = val, V
        if best_V < 0:
            return None
        h = heaps[best_V]
        _, b = heapq.heappop(h)
        bins[b].append(i); room[b] -= li; load[b] += ti
        heapq.heappush(h, (load[b], b))
    by_pipe: list[list[list[int]]] = [[] for _ in counts]
    for b, mb in enumerate(bins):
        if mb:
            by_pipe[owner[b]].append(sorted(mb))
    out = []
    for mbs in by_pipe:
        mb_times = [float(sum(times[i] for i in mb)) + c for mb in mbs]
        out.append(PackResult([np.asarray(mb, dtype=np.int64) for mb in mbs], mb_times,
                              (k + len(mbs)) * max(mb_times) if mbs else 0.0))
    return out


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
    start = pack_dispatch(lengths, pipelines, cost,
                          alg1_assignment(lengths, pipelines, cost, trials=ALG1_TRIALS, seed=seed))
    if start.latency >= result.latency:
        return result
    if improve_rounds is None or improve_rounds > 0:
        start = improve_dispatch(lengths, pipelines, cost, start, rounds=improve_rounds)
    return start


def _greedy_members(lengths: np.ndarray, pipelines: Sequence[Scheme], groups: list[SchemeCosts], of: list[int],
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
        result = pack_dispatch(lengths, pipelines, cost, [a.tolist() for a in result.assignment])
    D = len(pipelines)
    if D <= 1:
        return result
    groups, of = scheme_costs(pipelines, cost, lengths)
    return _local_search(lengths, pipelines, cost, result, groups, of, rounds if rounds is not None else 2 * D + 8)


def _local_search(lengths: np.ndarray, pipelines: Sequence[Scheme], cost, result: DispatchResult,
                  groups: list[SchemeCosts], of: list[int], rounds: int,
                  max_repacks_per_round: int = 12) -> DispatchResult:
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
