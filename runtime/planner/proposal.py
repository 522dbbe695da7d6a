"""Data-distribution-aware strategy proposal (Hydraulis §7, Eq. 4): the candidate strategies of a
dataset's lengths on ``N`` GPUs.

Lengths are bucketed and an interval of lengths on ``d`` pipelines of one scheme is charged the
packing bound of its share (``interval_cost``: the buckets, ``pipeline_latency`` and its inverse
``pipeline_capacity``, the per-scheme ``SchemeTable`` and the scores ``pooled_cost`` and
``balanced_cost``).

**Relaxed DP (what ``propose`` runs).** With non-integer ``n`` and ``d`` the DP is solved in its
dual form: ``t[N][L] <= M`` iff the fewest GPUs ``G_M[L]`` that finish every interval of
``(0, L]`` within ``M`` is at most ``N``, where ``G_M[l] = min_{j<l, k} G_M[j] + N_k * d_k(j, l)``
and ``d_k(j, l) = W_k(j, l] / h_k^-1(M)`` (continuous; ``pipeline_capacity``). One pass over buckets
gives ``G_M[l]`` for every ``l``; a geometric sweep of ``M`` refined by bisection (to ``1 + m_tol``)
gives ``t[N][L]`` for every ``L`` and, by backtracking, the optimal intervals with fractional
pipeline counts. Schemes dominated by another on every ingredient are dropped first.

**Rounding.** For every ``L`` the fractional count of each scheme is rounded down and up (all
combinations of the ``MAX_FREE_ROUNDINGS`` counts whose fraction is nearest 1/2; the others to the
nearest integer), at least one pipeline must hold ``L`` tokens, GPUs left over are filled with more
pipelines of the scheme that needs them most, and a strategy must use exactly ``N`` GPUs. Each
combination is scored by the interval cost with pooled pipelines (all intervals of a scheme share
its pipelines; a scheme rounded to zero hands its intervals to the present scheme that finishes
them soonest); the best ``per_len`` (2) per ``L`` are kept.

**Which L.** The paper collects ``S[N][L]`` for every ``L``; only the ``L`` an iteration's longest
document can plausibly have matter (``P(max <= L) = F(L)^n >= min_prob``, ``n`` the expected
documents per iteration), at most ``max_targets`` of them spread evenly in that probability, plus
the full context.

**Homogeneous.** The best homogeneous strategy for the full context (by the same pooled score) is
added: rounding adds one long pipeline at a time and can miss "every pipeline of the long scheme".

**Variants.** Iterations also differ in how many long documents they hold: the full-context
candidate's neighbours (one pipeline more or fewer of each scheme it uses, budget refitted) are
added as variants (weight 0; under the candidate cap they go first).

**Candidates.** Distinct strategies (pipelines by descending MaxLen) with the ``L`` range they were
proposed for and their expected latency per iteration at its top (``expected_ms``, ``balanced_cost``:
the integer strategy with bucket work rebalanced among all pipelines that hold it). A candidate is
dropped when one proposed for longer documents is no slower. When there are more than
``max_candidates``, the kept ones are those most likely to be needed, weighted by the probability
that an iteration's longest document falls in their range (``F(L)^n``, ``n`` the expected documents
per iteration); the candidate for the full context is always kept.

The exact integer DP over the same buckets and interval cost is ``integer_dp`` (the reference).
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from hgraph.errors import HGraphError
from hgraph.runtime.planner.interval_cost import (DEFAULT_GROWTH, DEFAULT_STEP, DEFAULT_TOKENS_PER_GPU,
                                                  LengthHistogram, SchemeTable, balanced_cost,
                                                  pipeline_capacity, pooled_cost)
from hgraph.strategy import Cluster, Scheme, Strategy

# Rounding tries floor and ceil of at most this many fractional pipeline counts (2^5 combinations).
MAX_FREE_ROUNDINGS = 5


@dataclass
class Candidate:
    """A proposed strategy, the context lengths it was proposed for and its expected cost.

    The top of ``len_range`` bounds the iterations the candidate serves: its largest MaxLen holds
    documents up to ``len_range[1]`` (a candidate for short-document iterations may not hold the
    full context), and ``selection.plan_iteration`` skips a candidate for an iteration whose
    longest document it cannot hold. The last candidate of a proposal covers the full context.
    """

    strategy: Strategy
    len_range: tuple[int, int]  # (lo, hi]: proposed for iterations whose longest document is in here
    expected_ms: float  # pooled interval cost of this strategy at L = hi (ms per iteration)
    relaxed_ms: float  # the relaxed DP optimum t[N][hi] (a bound for the model)
    fractional: dict[str, float] = field(default_factory=dict)  # relaxed pipelines per scheme at hi
    weight: float = 0.0  # probability that an iteration's longest document falls in len_range
    variant: bool = False  # a neighbour of the full-context candidate

    def to_json(self) -> dict:
        return {"strategy": str(self.strategy), "len_range": list(self.len_range),
                "expected_ms": self.expected_ms, "relaxed_ms": self.relaxed_ms,
                "fractional": self.fractional, "weight": self.weight, "variant": self.variant}


@dataclass
class Proposal:
    candidates: list[Candidate]
    gpus: int
    max_len: int
    tokens_per_iter: int
    solve_ms: float
    dropped: int = 0  # distinct strategies beyond max_candidates

    @property
    def strategies(self) -> list[Strategy]:
        return [c.strategy for c in self.candidates]

    def to_json(self) -> dict:
        return {"gpus": self.gpus, "max_len": self.max_len, "tokens_per_iter": self.tokens_per_iter,
                "solve_ms": self.solve_ms, "dropped": self.dropped,
                "candidates": [c.to_json() for c in self.candidates]}


# ---- the relaxed DP in dual form ------------------------------------------------------------
def _min_gpus(table: SchemeTable, prefix: np.ndarray, M: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``G_M[l]`` for l = 0..B and the argmin (boundary j, scheme k) of each ``l``."""
    K, B = table.work.shape
    cap = pipeline_capacity(M, table.bubble[:, None], table.overhead[:, None], table.longest)  # (K, B)
    ok = table.feasible & (cap > 0)
    inv = np.where(ok, table.gpus[:, None] / np.where(ok, cap, 1.0), np.inf)  # GPUs per unit work
    G = np.full(B + 1, np.inf)
    G[0] = 0.0
    arg_j = np.zeros(B + 1, dtype=np.int64)
    arg_k = np.full(B + 1, -1, dtype=np.int64)
    for l in range(1, B + 1):
        # interval (j, l] on scheme k: G[j] + inv[k, l-1] * (P_k[l] - P_k[j])
        with np.errstate(invalid="ignore"):
            seg = (prefix[:, l][:, None] - prefix[:, :l]) * inv[:, l - 1][:, None]  # (K, l)
            tot = G[None, :l] + np.where(np.isfinite(inv[:, l - 1])[:, None], seg, np.inf)
        flat = int(np.argmin(tot))
        k, j = divmod(flat, l)
        G[l] = tot[k, j]
        arg_j[l], arg_k[l] = j, k
    return G, arg_j, arg_k


def _intervals(arg_j: np.ndarray, arg_k: np.ndarray, L: int) -> list[tuple[int, int, int]]:
    """Backtrack ``(j, l, k)`` intervals (buckets j..l-1 on scheme k) covering buckets ``0..L-1``."""
    out: list[tuple[int, int, int]] = []
    l = L
    while l > 0:
        j, k = int(arg_j[l]), int(arg_k[l])
        if out and out[-1][2] == k and out[-1][0] == l:
            out[-1] = (j, out[-1][1], k)  # same scheme on both sides: one pooled interval
        else:
            out.append((j, l, k))
        l = j
    return out


# ---- rounding a relaxed solution to integer strategies ----------------------------------------
def fit_budget(counts: np.ndarray, need: np.ndarray, table: SchemeTable, gpus: int,
               keep: np.ndarray) -> Optional[np.ndarray]:
    """Adjust pipeline counts to use exactly ``gpus`` GPUs; None when that cannot be done.

    Over budget: drop a pipeline of the scheme whose per-pipeline work grows least (never below
    ``keep``; a scheme's last pipeline goes only when nothing else can). Under budget: add a
    pipeline of the in-use scheme (``need > 0``) with the most work per pipeline that still fits,
    or else the smallest scheme that fits. Plain Python: K is small and this runs per combination.
    """
    counts = np.asarray(counts, dtype=np.int64)
    c = counts.tolist()
    size = np.asarray(table.gpus, dtype=np.int64).tolist()
    nd = np.asarray(need, dtype=np.float64).tolist()
    kp = np.asarray(keep, dtype=np.int64).tolist()
    K = len(c)
    used = int(np.dot(counts, np.asarray(table.gpus, dtype=np.int64)))
    active = np.nonzero(counts > np.asarray(keep))[0].tolist()
    while used > gpus:
        best, score = -1, math.inf
        for k in active:
            if c[k] <= kp[k]:
                continue
            sc = 0.0 if nd[k] <= 0 else (nd[k] / (c[k] - 1) if c[k] > 1 else 1e30 + nd[k])
            if sc < score:
                best, score = k, sc
        if best < 0:
            return None
        c[best] -= 1
        used -= size[best]
    left = gpus - used
    wanted = np.nonzero(np.asarray(need) > 0)[0].tolist()
    while left > 0:
        best, score = -1, -math.inf
        for k in wanted:
            if size[k] <= left and nd[k] / (c[k] + 1) > score:
                best, score = k, nd[k] / (c[k] + 1)
        if best < 0:
            fits = [k for k in range(K) if size[k] <= left]
            if not fits:
                return None
            best = min(fits, key=lambda k: size[k])
        c[best] += 1
        left -= size[best]
    return np.asarray(c, dtype=np.int64)


def order_pipelines(counts: np.ndarray, table: SchemeTable, cluster: Cluster) -> Optional[Strategy]:
    """Pipelines by descending MaxLen (ties: larger TP first); None if a TP group would cross a node."""
    keys = sorted((k for k in range(len(counts)) if counts[k] > 0),
                  key=lambda k: (-int(table.max_len[k]), -table.schemes[k].tp, -table.schemes[k].pp, k))
    pipes = [table.schemes[k] for k in keys for _ in range(int(counts[k]))]
    for order in (pipes, sorted(pipes, key=lambda s: (-s.tp, -s.num_ranks))):
        s = Strategy(tuple(order))
        try:
            s.validate(cluster)
            return s
        except HGraphError:
            continue
    return None


def _round(d: np.ndarray, intervals, table: SchemeTable, prefix: np.ndarray, gpus: int,
           longest: int, holder_options: int = 3, top_n: int = 2) -> list[tuple[float, np.ndarray]]:
    """Best integer rounding of fractional pipeline counts ``d``."""
    K = len(d)
    used = np.nonzero(d > 1e-9)[0]
    # Both roundings for the ``MAX_FREE_ROUNDINGS`` counts whose fraction is nearest 1/2, the
    # nearest integer for the others: 2^used combinations grow too fast with derived CP schemes.
    frac = d[used] - np.floor(d[used])
    free = set(used[np.argsort(np.abs(frac - 0.5), kind="stable")[:MAX_FREE_ROUNDINGS]].tolist())
    options = [sorted({math.floor(d[k]), math.ceil(d[k])}) if k in free else [int(math.floor(d[k] + 0.5))]
               for k in used]
    ranked: dict[tuple, tuple[float, np.ndarray]] = {}
    need = np.zeros(K)
    for j, l, k in intervals:
        need[k] += prefix[k, l] - prefix[k, j]
    holds = table.max_len >= longest
    # The relaxation may put the longest interval on a fraction of a very large scheme; rounding
    # that up can take most of the cluster, so every one of the few cheapest schemes that hold the
    # longest length is also tried as the single long pipeline (its intervals are re-homed).
    last = max(intervals, key=lambda x: x[1])
    holder_cost = np.where(holds, table.work[:, last[1] - 1] * table.gpus + table.beta[:, last[1] - 1], np.inf)
    holders = [int(h) for h in np.argsort(holder_cost)[:holder_options] if np.isfinite(holder_cost[h])]
    seen: set[tuple] = set()  # (counts, kept scheme) already fitted: the fit is deterministic
    for combo, h in itertools.product(itertools.product(*options), [None] + holders):
        counts = np.zeros(K, dtype=np.int64)
        counts[used] = combo
        if h is not None:
            if counts[h] > 0:
                continue  # same as the plain combination
            counts[h] = 1
        if not (counts[holds] > 0).any():
            continue
        # Keep one pipeline that holds the longest length while trimming.
        kept = h if h is not None else int(np.argmax(np.where(holds & (counts > 0), need, -1.0)))
        fit_key = (tuple(counts.tolist()), kept)
        if fit_key in seen:
            continue
        seen.add(fit_key)
        keep = np.zeros(K, dtype=np.int64)
        keep[kept] = 1
        filled = fit_budget(counts, need, table, gpus, keep)
        if filled is None:
            continue
        key = tuple(filled.tolist())
        if key in ranked:
            continue  # same integer strategy, same intervals: same cost
        c = pooled_cost(filled, intervals, table, prefix)
        if math.isfinite(c):
            ranked[key] = (c, filled)
    return sorted(ranked.values(), key=lambda x: x[0])[:top_n]


# ---- the proposal ---------------------------------------------------------------------------
def propose(lengths, cost, gpus: int, max_len: int, *, gpus_per_node: Optional[int] = None,
            tokens_per_iter: Optional[int] = None, step: int = DEFAULT_STEP, growth: float = DEFAULT_GROWTH,
            m_tol: float = 0.01, max_candidates: int = 8, min_prob: float = 1e-3, max_targets: int = 24,
            per_len: int = 2, schemes: Optional[Sequence[Scheme]] = None,
            microbatch_charge: bool = True) -> Proposal:
    """Candidate strategies for a dataset's lengths, ``gpus`` GPUs and context ``max_len`` (§7).

    ``microbatch_charge``: charge each token of work its share ``c / MaxLen`` of the micro-batch
    overhead (``SchemeTable.build``); False charges a pipeline one ``c``, as the paper does."""
    t0 = time.perf_counter()
    if not isinstance(gpus, (int, np.integer)) or gpus < 1:
        raise HGraphError(f"GPU count must be a positive integer, got {gpus!r}")
    if not isinstance(max_len, (int, np.integer)) or max_len < 1:
        raise HGraphError(f"max length must be a positive integer, got {max_len!r}")
    tokens_per_iter = int(tokens_per_iter or DEFAULT_TOKENS_PER_GPU * gpus)
    cluster = Cluster(int(gpus), int(gpus_per_node or getattr(cost, "gpus_per_node", 8)))
    hist = LengthHistogram.from_lengths(lengths, max_len, step, growth)
    scale = tokens_per_iter / float(hist.sum1.sum())
    table = SchemeTable.build(cost, hist, gpus, scale, schemes, microbatch_charge)
    if table.max_len.max() < max_len:
        raise HGraphError(
            f"no scheme of profile {cost.name!r} on {gpus} GPUs holds {max_len} tokens: the largest MaxLen is "
            f"{int(table.max_len.max())}; lower --max-len or add GPUs")
    table = table.without_dominated()
    prefix = table.prefix()
    B = hist.num_buckets
    # The L worth solving: the longest length of a bucket that an iteration's longest document can
    # plausibly have (P(max <= L) >= min_prob, from F(L)^n), at most max_targets of them, and the
    # full context.
    cum_docs = np.cumsum(hist.count)
    n_iter = tokens_per_iter * cum_docs[-1] / hist.sum1.sum()
    F_max = (cum_docs / cum_docs[-1]) ** n_iter
    present = np.nonzero(hist.count > 0)[0]
    targets = sorted(set((present[F_max[present] >= min_prob] + 1).tolist()) | {B})
    if len(targets) > max_targets:
        # Evenly spaced in probability: where an iteration's longest document most often falls.
        picks_at = np.searchsorted(F_max[np.asarray(targets) - 1], np.linspace(0, 1, max_targets), side="left")
        targets = sorted({targets[min(int(i), len(targets) - 1)] for i in picks_at} | {B})

    # Sweep M geometrically (ratio 1.1) from a lower bound until every target L is reachable with
    # N GPUs, then bisect each bracket down to a ratio of 1 + m_tol.
    first = targets[0]
    gt = np.where(table.feasible, table.work * table.gpus[:, None], np.inf)[:, :first]
    M = max(float(gt.min(axis=0).sum()) / gpus, float(table.beta[:, :first].min()), 1e-6)
    solved: dict[int, tuple[float, list]] = {}
    brackets: dict[int, float] = {}  # target -> M known infeasible below the solution
    lo = 0.0
    while len(solved) < len(targets):
        G, arg_j, arg_k = _min_gpus(table, prefix, M)
        for L in targets:
            if L not in solved and G[L] <= gpus * (1 + 1e-9):
                solved[L] = (M, _intervals(arg_j, arg_k, L))
                brackets[L] = lo
        lo = M
        M *= 1.1
        if M > 1e12:
            raise HGraphError(f"strategy proposal did not converge for {gpus} GPUs and max length {max_len}")
    groups: dict[tuple[float, float], list[int]] = {}
    for L in targets:
        groups.setdefault((brackets[L], solved[L][0]), []).append(L)
    for (lo, hi), Ls in groups.items():
        lo = max(lo, hi / 1.1)
        while hi / lo > 1 + m_tol:
            mid = math.sqrt(lo * hi)
            G, arg_j, arg_k = _min_gpus(table, prefix, mid)
            ok = [L for L in Ls if G[L] <= gpus * (1 + 1e-9)]
            for L in ok:
                solved[L] = (mid, _intervals(arg_j, arg_k, L))
            if len(ok) == len(Ls):
                hi = mid
            else:
                # Targets not yet feasible keep bisecting above ``mid``; solved ones are fixed.
                Ls = [L for L in Ls if L not in ok]
                lo = mid

    picks: dict[tuple, dict] = {}
    pick_at: dict[int, tuple] = {}
    for L in targets:
        Mstar, ivs = solved[L]
        d = np.zeros(len(table.schemes))
        for j, l, k in ivs:
            cap = float(pipeline_capacity(Mstar, table.bubble[k], table.overhead[k], table.longest[k, l - 1]))
            d[k] += (prefix[k, l] - prefix[k, j]) / max(cap, 1e-12)
        for rank, (c, counts) in enumerate(_round(d, ivs, table, prefix, gpus, int(hist.upper[L - 1]),
                                                  top_n=per_len)):
            key = tuple(counts.tolist())
            if rank == 0:
                pick_at[L] = key
            e = picks.setdefault(key, {"Ls": [], "M": Mstar, "d": d})
            e["Ls"].append(L)
            e.update(M=Mstar, d=d)  # keep the values at the largest L
    # The best homogeneous strategy for the full context competes too: rounding a relaxed solution
    # adds one long pipeline at a time and can miss "all pipelines of the long scheme".
    full_ivs = solved[B][1]
    homo_best, homo_cost = None, math.inf
    for k in np.nonzero(table.max_len >= hist.upper[B - 1])[0]:
        if gpus % int(table.gpus[k]):
            continue
        counts = np.zeros(len(table.schemes), dtype=np.int64)
        counts[k] = gpus // int(table.gpus[k])
        c = pooled_cost(counts, full_ivs, table, prefix)
        if c < homo_cost:
            homo_best, homo_cost = counts, c
    if homo_best is not None:
        key = tuple(homo_best.tolist())
        if key not in picks:
            picks[key] = {"Ls": [B], "M": solved[B][0], "d": np.zeros(len(table.schemes))}
    if not picks:
        raise HGraphError(f"no strategy of exactly {gpus} GPUs can be formed from the schemes of profile "
                          f"{cost.name!r} (scheme sizes {sorted(set(table.gpus.tolist()))}) that holds {max_len} tokens")
    p_max = np.diff(np.concatenate([[0.0], F_max]))  # P(an iteration's longest document is in bucket b)
    owner = {}
    for b in range(B):  # bucket -> the pick that serves iterations whose longest document is in it
        L = next((L for L in targets if L >= b + 1 and L in pick_at), None)
        owner[b] = pick_at.get(L)
    cands = []
    keys: dict[str, np.ndarray] = {}
    for key, e in picks.items():
        strat = order_pipelines(np.asarray(key), table, cluster)
        if strat is None:
            continue
        keys[str(strat)] = np.asarray(key, dtype=np.int64)
        hi = max(e["Ls"])
        lo = min(e["Ls"])
        prev = [L for L in targets if L < lo]
        cands.append(Candidate(
            strategy=strat,
            len_range=(int(hist.upper[prev[-1] - 1]) if prev else 0, int(hist.upper[hi - 1])),
            expected_ms=balanced_cost(np.asarray(key), table, hi), relaxed_ms=float(e["M"]),
            fractional={str(table.schemes[k]): float(e["d"][k]) for k in np.nonzero(e["d"] > 1e-9)[0]},
            weight=float(sum(p_max[b] for b in range(B) if owner[b] == key))))
    if not cands:
        raise HGraphError(f"every proposed strategy of {gpus} GPUs puts a TP group across a node boundary "
                          f"({cluster.gpus_per_node} GPUs per node)")
    cands.sort(key=lambda c: (c.len_range[1], -c.expected_ms))
    # A candidate is useless when one that holds longer documents is no slower (rounding misses).
    kept = []
    for i, c in enumerate(cands):
        better = next((o for o in cands[i + 1:] if o.expected_ms <= c.expected_ms), None)
        if better is None:
            kept.append(c)
        else:
            better.weight += c.weight  # its iterations are served by the replacement
            better.len_range = (min(better.len_range[0], c.len_range[0]), better.len_range[1])
    cands = kept
    # Iterations differ in how many long documents they hold, not only in the longest one: the
    # full-context candidate's neighbours (one pipeline more or fewer of each scheme it uses, the
    # budget refitted) join as variants.
    full = cands[-1]
    full_key = keys[str(full.strategy)]
    need = np.zeros(len(table.schemes))
    for j, l, k in solved[B][1]:
        need[k] += prefix[k, l] - prefix[k, j]
    seen = {str(c.strategy) for c in cands}
    for k in np.nonzero(full_key > 0)[0]:
        for step in (1, -1):
            c = full_key.copy()
            c[k] += step
            if c[k] < 0 or not (table.max_len[c > 0] >= hist.upper[B - 1]).any():
                continue
            keep = np.zeros_like(c)
            keep[k] = c[k]
            fitted = fit_budget(c, need + (c > 0) * 1e-9, table, gpus, keep)
            if fitted is None or not (table.max_len[fitted > 0] >= hist.upper[B - 1]).any():
                continue
            strat = order_pipelines(fitted, table, cluster)
            if strat is None or str(strat) in seen:
                continue
            seen.add(str(strat))
            cands.append(Candidate(strat, full.len_range, balanced_cost(fitted, table, B), full.relaxed_ms,
                                   {}, 0.0, variant=True))
    cands.sort(key=lambda c: (c.len_range[1], -c.expected_ms))
    cands.remove(full)
    cands.append(full)  # the full-context candidate stays last
    dropped = 0
    if len(cands) > max_candidates:
        full = cands[-1]
        rest = sorted(cands[:-1], key=lambda c: (c.variant, -c.weight))[:max(max_candidates - 1, 0)]
        dropped = len(cands) - len(rest) - 1
        cands = sorted(rest, key=lambda c: c.len_range[1]) + [full]
    return Proposal(cands, int(gpus), int(max_len), tokens_per_iter, (time.perf_counter() - t0) * 1e3, dropped)
