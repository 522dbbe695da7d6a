"""The interval cost of the strategy proposal (Hydraulis §7, Eq. 4): length buckets, the packed
latency bound of a pipeline, the per-scheme ingredients (``SchemeTable``) and the scores of an
integer strategy. The relaxed DP of ``proposal`` and the exact DP of ``integer_dp`` both work on them.

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

**Scores of an integer strategy.** ``pooled_cost``: all intervals of a scheme share its pipelines
(a scheme with no pipeline hands its intervals to the present scheme that finishes them soonest);
it ranks the roundings of a relaxed solution. ``balanced_cost``: the bucket work rebalanced among
all pipelines that hold it; a candidate's expected latency.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from hgraph.errors import HGraphError
from hgraph.strategy import Scheme

DEFAULT_STEP = 128
DEFAULT_GROWTH = 0.05
# Hydraulis §8 / App. E: 200K tokens per iteration on 64 GPUs, 3.2M on 1024: 3125 per GPU.
DEFAULT_TOKENS_PER_GPU = 3125


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
              schemes: Optional[Sequence[Scheme]] = None, microbatch_charge: bool = True) -> "SchemeTable":
        pool = [s for s in (schemes if schemes is not None else cost.schemes) if s.num_ranks <= gpus]
        if not pool:
            raise HGraphError(f"no scheme of profile {cost.name!r} fits {gpus} GPUs")
        co = np.asarray([cost.dispatch_coeffs(s) for s in pool], dtype=np.float64)
        a, b = co[:, :1], co[:, 1:2]
        ml = np.asarray([cost.max_len(s) for s in pool], dtype=np.int64)
        u = hist.upper.astype(np.float64)[None, :]
        # A micro-batch holds at most MaxLen tokens, so a pipeline runs at least tokens / MaxLen of
        # them, each paying c: charged as c / MaxLen per token of work (without it a PP = 1 scheme
        # was charged one c for any share, and schemes of a few hundred tokens' MaxLen looked cheap).
        # ``microbatch_charge=False`` leaves it out (the charge before it; ``auto_candidates`` draws
        # from both, since each misses mixes the other proposes).
        b_work = b + co[:, 2:3] / np.maximum(ml[:, None], 1) if microbatch_charge else b
        return cls(pool, np.asarray([s.num_ranks for s in pool], dtype=np.int64), ml,
                   (a * hist.sum2[None, :] + b_work * hist.sum1[None, :]) * scale, a * u * u + b * u,
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


# ---- scores of an integer strategy ----------------------------------------------------------
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

