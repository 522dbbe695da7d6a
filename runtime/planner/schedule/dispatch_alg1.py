"""The ``greedy`` dispatch: Hydraulis Alg. 1, randomized greedy on the lower bound of Eq. 2
(``sum T(l_i) + T(l_max) (PP-1)``) over ``trials`` random document orders; the best trial is packed.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from hgraph.errors import HGraphError
from hgraph.runtime.planner.schedule.dispatch_result import (DispatchResult, check_eligible, pack_dispatch,
                                                             scheme_costs)
from hgraph.strategy import Scheme


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
    groups, of = scheme_costs(pipelines, cost, lengths)
    check_eligible(lengths, groups)
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
    return pack_dispatch(lengths, pipelines, cost,
                         alg1_assignment(lengths, pipelines, cost, trials=trials, seed=seed))
