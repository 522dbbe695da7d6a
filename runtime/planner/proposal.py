"""Data-distribution-aware strategy proposal (Hydraulis §7, Eq. 4).

**Buckets.** Document lengths (truncated to the context length) are bucketed on a grid of ``step``
tokens (128 in the paper) that widens geometrically (``growth``, 5%) once a step is less than that
fraction of the length, so a 32K context has ~80 buckets instead of 256 with the same relative
resolution where it matters. Every quantity is per iteration: the expected documents of a mini-batch
of ``tokens_per_iter`` tokens. As in the paper's DP, the sub-dataset ``D_(0, L]`` is not renormalised:
an iteration whose longest document is ``L`` holds the usual mix of shorter ones.

**Interval cost.** Eq. 4 puts an interval ``(l-l', l]`` of lengths on ``d`` pipelines of one scheme
``P_k`` (``MaxLen(P_k) >= l``). The paper charges ``sum T(x, P_k) / d``; a pipeline's real latency
also holds its 1F1B bubble and per-micro-batch overhead ``c``, which dominate for PP > 1 at ~100K
tokens per iteration, so each of the ``d`` pipelines is charged the packing bound of its share
``S = W / d`` (``W = sum a x^2 + b x``): ``h(S) = min_V (PP - 1 + V) * (max(S / V, T(l)) + c)``
(``pipeline_latency``; Eq. 1 with perfectly balanced micro-batches, and never below Eq. 2).

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

``integer_dp`` is the DP with integer ``n`` and ``d`` in primal form over the same buckets and
interval cost (the exact reference of the paper's formulation, ``O(N * sum_k N / N_k * B^2)``).
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from hgraph.errors import HGraphError
from hgraph.strategy import Cluster, Scheme, Strategy

DEFAULT_STEP = 128
DEFAULT_GROWTH = 0.05
# Hydraulis §8 / App. E: 200K tokens per iteration on 64 GPUs, 3.2M on 1024: 3125 per GPU.
DEFAULT_TOKENS_PER_GPU = 3125
# Rounding tries floor and ceil of at most this many fractional pipeline counts (2^5 combinations).
MAX_FREE_ROUNDINGS = 5


def bucket_edges(max_len: int, step: int = DEFAULT_STEP, growth: float = DEFAULT_GROWTH) -> np.ndarray:
    """Upper edges of the length buckets: ``step`` apart, then ``growth`` relative, ending at max_len."""
    if step < 1 or growth < 0:
        raise HGraphError(f"bucket step must be >= 1 and growth >= 0, got {step}, {growth}")
    edges = []
    e = 0
    while e < max_len:
        width = step if growth == 0 else max(step, int(growth * e) // step * step)
        e = min(e + width, max_len)
        edges.append(e)
    return np.asarray(edges, dtype=np.int64)


@dataclass(frozen=True)
class LengthHistogram:
    """Per length bucket ``(upper[b-1], upper[b]]``: document count, sum of lengths, sum of squares."""

    upper: np.ndarray
    count: np.ndarray
    sum1: np.ndarray
    sum2: np.ndarray

    @classmethod
    def from_lengths(cls, lengths, max_len: int, step: int = DEFAULT_STEP,
                     growth: float = DEFAULT_GROWTH) -> "LengthHistogram":
        lens = np.minimum(np.asarray(lengths, dtype=np.int64).reshape(-1), max_len)
        if lens.size == 0 or lens.min() < 1:
            raise HGraphError("strategy proposal needs a non-empty list of positive lengths")
        upper = bucket_edges(int(max_len), step, growth)
        b = np.searchsorted(upper, lens, side="left")
        lf = lens.astype(np.float64)
        B = upper.size
        return cls(upper, np.bincount(b, minlength=B).astype(np.float64),
                   np.bincount(b, weights=lf, minlength=B), np.bincount(b, weights=lf * lf, minlength=B))

    @property
    def num_buckets(self) -> int:
        return int(self.upper.size)


def pipeline_latency(S, k, c, t):
    """Packed 1F1B latency bound of a pipeline with per-sequence work ``S`` and longest document ``t``.

    ``min_{V >= 1} (k + V) * (max(S / V, t) + c)`` with ``k = PP - 1``: unconstrained at
    ``V0 = sqrt(k S / c)`` (``(sqrt S + sqrt(k c))^2``) unless that would make micro-batches shorter
    than the longest document (then ``V = S / t``) or fewer than one. Vectorised.
    """
    S, k, c, t = np.broadcast_arrays(*(np.asarray(x, dtype=np.float64) for x in (S, k, c, t)))
    with np.errstate(divide="ignore", invalid="ignore"):
        v0 = np.where(c > 0, np.sqrt(k * S / np.where(c > 0, c, 1.0)), np.inf)
        vt = np.where(t > 0, S / np.where(t > 0, t, 1.0), np.inf)  # most micro-batches without splitting t
        v = np.maximum(np.minimum(v0, vt), 1.0)
        out = (k + v) * (np.maximum(S / v, t) + c)
    return np.where(S > 0, out, np.where(t > 0, (k + 1) * (t + c), 0.0))


def _latency(S: float, k: float, c: float, t: float) -> float:
    """Scalar ``pipeline_latency`` (the same formula without numpy overhead)."""
    if S <= 0:
        return (k + 1) * (t + c) if t > 0 else 0.0
    v0 = math.sqrt(k * S / c) if c > 0 else math.inf
    vt = S / t if t > 0 else math.inf
    v = max(min(v0, vt), 1.0)
    return (k + v) * (max(S / v, t) + c)


def _capacity(M: float, k: float, c: float, t: float) -> float:
    """Scalar ``pipeline_capacity``."""
    if M < (k + 1) * (t + c):
        return 0.0
    best = 0.0
    cands = [t * (M / (t + c) - k) if t + c > 0 else 0.0, max(math.sqrt(M) - math.sqrt(k * c), 0.0) ** 2,
             M / (k + 1) - c]
    for S in cands:
        if S > best and _latency(S, k, c, t) <= M * (1 + 1e-9):
            best = S
    return best


def pipeline_capacity(M, k, c, t):
    """Largest ``S`` with ``pipeline_latency(S, k, c, t) <= M`` (0 when even ``S -> 0`` exceeds M). Vectorised."""
    M, k, c, t = np.broadcast_arrays(*(np.asarray(x, dtype=np.float64) for x in (M, k, c, t)))
    base = (k + 1) * (t + c)  # one micro-batch holding the longest document
    # Case V = S / t (micro-batches as long as the longest document): (k + S/t)(t + c) <= M.
    with np.errstate(divide="ignore", invalid="ignore"):
        s_t = t * (M / (t + c) - k)
        # Case V0 = sqrt(kS/c) between 1 and S/t: (sqrt S + sqrt(k c))^2 <= M.
        s_0 = np.square(np.maximum(np.sqrt(M) - np.sqrt(k * c), 0.0))
        # Case V = 1: (k + 1)(S + c) <= M.
        s_1 = M / (k + 1) - c
    cand = np.stack([s_t, s_0, s_1])
    cand = np.where(np.isfinite(cand) & (cand > 0), cand, 0.0)
    # The true capacity is the largest candidate whose latency is within M (each is exact in its case).
    lat = pipeline_latency(cand, k[None], c[None], t[None])
    ok = lat <= M[None] * (1 + 1e-9)
    best = np.where(ok, cand, 0.0).max(axis=0)
    return np.where(M >= base, best, 0.0)


@dataclass
class SchemeTable:
    """Per scheme and bucket: the interval-cost ingredients, scaled to one iteration."""

    schemes: list[Scheme]
    gpus: np.ndarray  # N(P_k)
    max_len: np.ndarray
    work: np.ndarray  # (K, B) per iteration: sum (a x^2 + b x) over the bucket's documents
    longest: np.ndarray  # (K, B) a u^2 + b u for the bucket's upper length u
    bubble: np.ndarray  # (K,) PP - 1
    overhead: np.ndarray  # (K,) c
    feasible: np.ndarray  # (K, B) MaxLen_k >= upper_b

    @classmethod
    def build(cls, cost, hist: LengthHistogram, gpus: int, scale: float,
              schemes: Optional[Sequence[Scheme]] = None) -> "SchemeTable":
        pool = [s for s in (schemes if schemes is not None else cost.schemes) if s.num_ranks <= gpus]
        if not pool:
            raise HGraphError(f"no scheme of profile {cost.name!r} fits {gpus} GPUs")
        co = np.asarray([cost.coeffs(s) for s in pool], dtype=np.float64)
        a, b = co[:, :1], co[:, 1:2]
        ml = np.asarray([cost.max_len(s) for s in pool], dtype=np.int64)
        u = hist.upper.astype(np.float64)[None, :]
        return cls(pool, np.asarray([s.num_ranks for s in pool], dtype=np.int64), ml,
                   (a * hist.sum2[None, :] + b * hist.sum1[None, :]) * scale, a * u * u + b * u,
                   np.asarray([s.pp - 1 for s in pool], dtype=np.float64), co[:, 2].copy(),
                   ml[:, None] >= hist.upper[None, :])

    @property
    def beta(self) -> np.ndarray:
        """(K, B) the least latency of a pipeline whose longest document ends bucket b (S -> 0)."""
        return pipeline_latency(np.zeros_like(self.longest), self.bubble[:, None], self.overhead[:, None],
                                self.longest)

    def without_dominated(self) -> "SchemeTable":
        """Drop schemes another scheme beats everywhere: no more GPUs, no shorter MaxLen, no more
        GPU-time, no longer longest-document time, no deeper pipeline and no larger overhead (such a
        scheme never lowers the GPUs an interval needs)."""
        K = len(self.schemes)
        gt = self.work * self.gpus[:, None]
        keep = []
        for k in range(K):
            dom = ((self.gpus <= self.gpus[k]) & (self.max_len >= self.max_len[k])
                   & (gt <= gt[k] + 1e-12).all(axis=1) & (self.longest <= self.longest[k] + 1e-12).all(axis=1)
                   & (self.bubble <= self.bubble[k]) & (self.overhead <= self.overhead[k] + 1e-12))
            dom[k] = False
            # Of identical schemes keep the first.
            equal = dom & (self.gpus == self.gpus[k]) & (self.max_len == self.max_len[k]) \
                & np.isclose(gt, gt[k]).all(axis=1) & np.isclose(self.longest, self.longest[k]).all(axis=1) \
                & (self.bubble == self.bubble[k]) & np.isclose(self.overhead, self.overhead[k])
            dom &= ~equal | (np.arange(K) < k)
            if not dom.any():
                keep.append(k)
        idx = np.asarray(keep)
        return SchemeTable([self.schemes[k] for k in keep], self.gpus[idx], self.max_len[idx], self.work[idx],
                           self.longest[idx], self.bubble[idx], self.overhead[idx], self.feasible[idx])

    def prefix(self) -> np.ndarray:
        return np.concatenate([np.zeros((self.work.shape[0], 1)), np.cumsum(self.work, axis=1)], axis=1)


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
    variant: bool = False  # a neighbour of the full-context candidate (module docstring)

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


def pooled_cost(counts: np.ndarray, intervals: list[tuple[int, int, int]], table: SchemeTable,
                prefix: np.ndarray) -> float:
    """Latency estimate of integer pipeline ``counts`` when each scheme's pipelines share its intervals.

    Per scheme: ``h(sum W / d)`` with the longest document of its intervals; intervals of a scheme with no pipeline
    go to the present scheme that holds them and ends soonest after taking them.
    """
    K = len(table.schemes)
    W = np.zeros(K)
    top = np.full(K, -1, dtype=np.int64)
    homeless = []
    for j, l, k in intervals:
        if counts[k] > 0:
            W[k] += prefix[k, l] - prefix[k, j]
            top[k] = max(top[k], l - 1)
        else:
            homeless.append((j, l))
    present = np.nonzero(counts > 0)[0]

    def finish(k: int, w: float, t: int) -> float:
        return _latency(w / counts[k], float(table.bubble[k]), float(table.overhead[k]), float(table.longest[k, t]))

    for j, l in sorted(homeless, key=lambda x: -x[1]):
        best_k, best_t = -1, math.inf
        for k in present:
            if not table.feasible[k, l - 1]:
                continue
            t = finish(k, W[k] + prefix[k, l] - prefix[k, j], max(top[k], l - 1))
            if t < best_t:
                best_k, best_t = int(k), t
        if best_k < 0:
            return math.inf
        W[best_k] += prefix[best_k, l] - prefix[best_k, j]
        top[best_k] = max(top[best_k], l - 1)
    return max((finish(int(k), W[k], int(top[k])) for k in present if top[k] >= 0), default=0.0)


def balanced_cost(counts: np.ndarray, table: SchemeTable, upto: int, rel_tol: float = 1e-3) -> float:
    """Latency estimate of integer pipeline ``counts`` on buckets ``0..upto-1`` with work rebalanced.

    Buckets may be split among any present schemes that hold them. For a makespan ``M`` each
    scheme offers ``d_k * h_k^-1(M)`` of work (its longest document taken as the longest bucket it
    holds); buckets, longest first, fill the schemes that hold them in increasing MaxLen (keeping
    long-capable pipelines for long documents). The smallest feasible ``M`` is found by bisection.
    """
    ks = sorted((int(k) for k in np.nonzero(counts > 0)[0]), key=lambda k: (int(table.max_len[k]), k))
    busy = [b for b in range(upto) if table.work[:, b].max() > 0]
    if not busy:
        return 0.0
    if any(not any(table.feasible[k, b] for k in ks) for b in busy):
        return math.inf
    top = {k: max((b for b in busy if table.feasible[k, b]), default=-1) for k in ks}
    work = {k: table.work[k].tolist() for k in ks}
    bub = {k: float(table.bubble[k]) for k in ks}
    ovh = {k: float(table.overhead[k]) for k in ks}

    def feasible(M: float) -> bool:
        cap = {}
        for k in ks:
            t = float(table.longest[k, top[k]]) if top[k] >= 0 else 0.0
            cap[k] = float(counts[k]) * _capacity(M, bub[k], ovh[k], t)
        for b in reversed(busy):
            f = 1.0
            for k in ks:
                if f <= 1e-12:
                    break
                if not table.feasible[k, b] or cap[k] <= 0:
                    continue
                w = work[k][b]
                take = min(f, cap[k] / w) if w > 0 else f
                cap[k] -= take * w
                f -= take
            if f > 1e-9:
                return False
        return True

    hi = max(pooled_cost_upper(counts, table, upto, ks, top), 1e-6)
    if not feasible(hi):
        return math.inf
    lo = 0.0
    while hi - lo > rel_tol * hi:
        mid = (lo + hi) / 2
        if feasible(mid):
            hi = mid
        else:
            lo = mid
    return hi


def pooled_cost_upper(counts: np.ndarray, table: SchemeTable, upto: int, ks: list[int], top: dict) -> float:
    """A makespan at which everything fits: each bucket's whole work on every present scheme at once."""
    worst = 0.0
    total = {k: float(table.work[k, :upto].sum()) for k in ks}
    for k in ks:
        t = float(table.longest[k, top[k]]) if top[k] >= 0 else 0.0
        worst = max(worst, _latency(total[k] / counts[k], float(table.bubble[k]), float(table.overhead[k]), t))
    return worst


def _fit_budget(counts: np.ndarray, need: np.ndarray, table: SchemeTable, gpus: int,
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


def _order_pipelines(counts: np.ndarray, table: SchemeTable, cluster: Cluster) -> Optional[Strategy]:
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
    """Best integer rounding of fractional pipeline counts ``d`` (module docstring)."""
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
        filled = _fit_budget(counts, need, table, gpus, keep)
        if filled is None:
            continue
        key = tuple(filled.tolist())
        if key in ranked:
            continue  # same integer strategy, same intervals: same cost
        c = pooled_cost(filled, intervals, table, prefix)
        if math.isfinite(c):
            ranked[key] = (c, filled)
    return sorted(ranked.values(), key=lambda x: x[0])[:top_n]


def propose(lengths, cost, gpus: int, max_len: int, *, gpus_per_node: Optional[int] = None,
            tokens_per_iter: Optional[int] = None, step: int = DEFAULT_STEP, growth: float = DEFAULT_GROWTH,
            m_tol: float = 0.01, max_candidates: int = 8, min_prob: float = 1e-3, max_targets: int = 24,
            per_len: int = 2, schemes: Optional[Sequence[Scheme]] = None) -> Proposal:
    """Candidate strategies for a dataset's lengths, ``gpus`` GPUs and context ``max_len`` (§7)."""
    t0 = time.perf_counter()
    if not isinstance(gpus, (int, np.integer)) or gpus < 1:
        raise HGraphError(f"GPU count must be a positive integer, got {gpus!r}")
    if not isinstance(max_len, (int, np.integer)) or max_len < 1:
        raise HGraphError(f"max length must be a positive integer, got {max_len!r}")
    tokens_per_iter = int(tokens_per_iter or DEFAULT_TOKENS_PER_GPU * gpus)
    cluster = Cluster(int(gpus), int(gpus_per_node or getattr(cost, "gpus_per_node", 8)))
    hist = LengthHistogram.from_lengths(lengths, max_len, step, growth)
    scale = tokens_per_iter / float(hist.sum1.sum())
    table = SchemeTable.build(cost, hist, gpus, scale, schemes)
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
        strat = _order_pipelines(np.asarray(key), table, cluster)
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
            fitted = _fit_budget(c, need + (c > 0) * 1e-9, table, gpus, keep)
            if fitted is None or not (table.max_len[fitted > 0] >= hist.upper[B - 1]).any():
                continue
            strat = _order_pipelines(fitted, table, cluster)
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


def propose_strategies(lengths, cost, gpus: int, max_len: int, **opts) -> list[Strategy]:
    """The candidate strategies of ``propose`` (what ``hgraph plan --strategies auto`` uses)."""
    return propose(lengths, cost, gpus, max_len, **opts).strategies


# ---- the integer DP (reference) -------------------------------------------------------------
def integer_dp(lengths, cost, gpus: int, max_len: int, *, tokens_per_iter: Optional[int] = None,
               step: int = DEFAULT_STEP, growth: float = DEFAULT_GROWTH,
               schemes: Optional[Sequence[Scheme]] = None) -> dict[int, tuple[float, dict[Scheme, int]]]:
    """Eq. 4 with integer ``n`` and ``d`` and the interval cost above: ``L -> (t[N][L], S[N][L])``.

    ``t[n][l] = min(t[n-1][l], min_{k,d,j} max(t[n - d N_k][j], h_k(W_k(j, l] / d, l)))``.
    """
    tokens_per_iter = int(tokens_per_iter or DEFAULT_TOKENS_PER_GPU * gpus)
    hist = LengthHistogram.from_lengths(lengths, max_len, step, growth)
    table = SchemeTable.build(cost, hist, gpus, tokens_per_iter / float(hist.sum1.sum()), schemes)
    prefix = table.prefix()
    K, B = table.work.shape
    t = np.full((gpus + 1, B + 1), math.inf)
    t[:, 0] = 0.0
    choice: list[list[Optional[tuple[int, int, int]]]] = [[None] * (B + 1) for _ in range(gpus + 1)]
    ls = np.arange(1, B + 1)
    js = np.arange(B + 1)
    lower = js[None, :] < ls[:, None]
    rows = np.arange(B)
    for n in range(1, gpus + 1):
        t[n] = t[n - 1]
        for k in range(K):
            Nk = int(table.gpus[k])
            seg0 = prefix[k, ls][:, None] - prefix[k, js][None, :]  # (l, j)
            for d in range(1, n // Nk + 1):
                prev = t[n - d * Nk]
                lat = pipeline_latency(seg0 / d, table.bubble[k], table.overhead[k], table.longest[k][:, None])
                val = np.where(lower, np.maximum(prev[None, :], lat), math.inf)
                jb = np.argmin(val, axis=1)
                vb = val[rows, jb]
                better = table.feasible[k] & (vb < t[n, 1:] - 1e-12)
                for l in np.nonzero(better)[0].tolist():
                    t[n, l + 1] = vb[l]
                    choice[n][l + 1] = (k, d, int(jb[l]))
    out: dict[int, tuple[float, dict[Scheme, int]]] = {}
    for L in range(1, B + 1):
        if not math.isfinite(t[gpus, L]):
            continue
        counts: dict[Scheme, int] = {}
        n, l = gpus, L
        while l > 0:
            while choice[n][l] is None:
                n -= 1
            k, d, j = choice[n][l]
            counts[table.schemes[k]] = counts.get(table.schemes[k], 0) + d
            n, l = n - d * int(table.gpus[k]), j
        out[int(hist.upper[L - 1])] = (float(t[gpus, L]), counts)
    return out
