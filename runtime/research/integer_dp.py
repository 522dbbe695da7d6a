"""The DP of Hydraulis Eq. 4 with integer pipeline counts, solved exactly in primal form over the
buckets and the interval cost of ``interval_cost``: the reference of the paper's formulation
(``O(N * sum_k N / N_k * B^2)``), which the relaxed DP of ``proposal`` approximates.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from hgraph.runtime.planner.interval_cost import (DEFAULT_GROWTH, DEFAULT_STEP, DEFAULT_TOKENS_PER_GPU,
                                                  LengthHistogram, SchemeTable, pipeline_latency)
from hgraph.strategy import Scheme


def integer_dp(lengths, cost, gpus: int, max_len: int, *, tokens_per_iter: Optional[int] = None,
               step: int = DEFAULT_STEP, growth: float = DEFAULT_GROWTH,
               schemes: Optional[Sequence[Scheme]] = None) -> dict[int, tuple[float, dict[Scheme, int]]]:
    """Eq. 4 with integer ``n`` and ``d`` and the interval cost (``interval_cost``): ``L -> (t[N][L], S[N][L])``.

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
