"""DCP planning (Data-Centric Parallel, §3.3-3.4 and App. C) as pure functions.

- ``data_centric_accumulation``: given the step time ``T_i`` of every bucket batch (each run by its own group of
  ``p_i`` GPUs with its throughput-optimal batch and sequence-parallel sizes), choose gradient
  accumulation counts ``g_i`` so the groups finish together (Eq. 3). ``g_i`` is bounded as in App. C:
  the iteration may last at most ``G_max`` times the slowest batch's step, and when every ``g_i``
  is below ``G_min`` all are scaled up by ``ceil(G_min / max g)``. Eq. 3's idle time
  ``sum_i (max_j g_j T_j - g_i T_i)`` is weighted by the group's GPUs ``p_i`` and divided by the
  iteration time: the paper's "average proportion of time a GPU is idle"; minimising the raw sum
  would always pick the shortest iteration, minimising the proportion is what balances.
  Every combination is evaluated exactly: for a horizon ``H`` the best ``g_i`` is
  ``floor(H / T_i)``, so only horizons ``g T_j`` need trying.
- ``data_centric_recomputation``: Alg. 1 - for every profiled (batch size, SP size) candidate find the fewest
  recomputed layers that fit the memory budget, and keep the candidate with the best throughput
  ``b * s / (p * time)`` (Eq. 1). The paper's listing breaks at the first ``r`` that fits, which
  would pick the *most* recomputation; the text asks for the minimal recomputation that fits, which
  is what this computes (``r`` layers recomputed, ``L - r`` stash their activations).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import numpy as np

from hgraph.errors import HGraphError


@dataclass(frozen=True)
class InterPlan:
    """Gradient accumulation counts per bucket batch, the iteration time and the idle proportion."""

    accumulation: tuple[int, ...]
    iteration_ms: float
    idle_fraction: float


def idle_fraction(step_ms: Sequence[float], accumulation: Sequence[int],
                  gpus: Optional[Sequence[int]] = None) -> float:
    """Eq. 3 as a proportion: GPU-weighted idle time over (GPUs x iteration time)."""
    t = np.asarray(step_ms, dtype=np.float64) * np.asarray(accumulation, dtype=np.float64)
    w = np.ones_like(t) if gpus is None else np.asarray(gpus, dtype=np.float64)
    H = float(t.max())
    return float((w * (H - t)).sum() / (w.sum() * H)) if H > 0 else 0.0


def data_centric_accumulation(step_ms: Sequence[float], gpus: Optional[Sequence[int]] = None, *, g_min: int = 1,
              g_max: int = 4) -> InterPlan:
    """Accumulation counts balancing the bucket batches of one iteration (DCP Eq. 3, App. C)."""
    t = np.asarray(step_ms, dtype=np.float64)
    if t.size == 0 or (t <= 0).any():
        raise HGraphError(f"Data-Centric Parallel accumulation needs positive step times, got {list(step_ms)}")
    if gpus is not None and (len(gpus) != t.size or min(gpus) < 1):
        raise HGraphError("Data-Centric Parallel accumulation needs one positive GPU count per batch")
    if not (1 <= g_min and 1 <= g_max):
        raise HGraphError(f"accumulation bounds must be >= 1, got G_min={g_min}, G_max={g_max}")
    budget = g_max * float(t.max())
    # Candidate horizons: every g * T_j that fits the budget (g >= 1).
    # (the most counts that fit with the slack the counts below get: float // says 33.0477 // 11.0159
    # is 2, and the budget's own horizon, 3 x 11.0159, was never tried)
    horizons = sorted({g * tj for tj in t.tolist() for g in range(1, int(math.floor(budget / tj + 1e-9)) + 1)})
    best: Optional[tuple[float, float, np.ndarray]] = None
    for H in horizons:
        if H < t.max():
            continue  # every batch runs at least once
        g = np.maximum(np.floor(H / t + 1e-9), 1).astype(np.int64)
        idle = idle_fraction(t, g, gpus)
        it = float((g * t).max())
        if best is None or idle < best[0] - 1e-12 or (abs(idle - best[0]) <= 1e-12 and it < best[1]):
            best = (idle, it, g)
    assert best is not None
    g = best[2]
    if g.max() < g_min:
        g = g * math.ceil(g_min / g.max())
    return InterPlan(tuple(int(x) for x in g), float((g * t).max()), idle_fraction(t, g, gpus))


@dataclass(frozen=True)
class IntraCandidate:
    """Profile of one (batch size, SP size) for a bucket, measured with full recomputation.

    ``t_f``: forward time of one layer (ms); ``m``: activation bytes one layer stashes when it does
    not recompute; ``time_ms``: step time with every layer recomputed; ``mem_bytes``: peak memory
    with every layer recomputed (Eq. 6 with ``r = L``).
    """

    t_f: float
    m: float
    time_ms: float
    mem_bytes: float


@dataclass(frozen=True)
class IntraChoice:
    batch: int
    sp: int
    recompute_layers: int
    time_ms: float
    throughput: float  # tokens per GPU per ms


def data_centric_recomputation(candidates: Mapping[tuple[int, int], IntraCandidate], memory_bytes: float, layers: int,
              seq_len: int) -> IntraChoice:
    """DCP-intra (Alg. 1): fewest recomputed layers within memory, best throughput over (b, p)."""
    if layers < 1 or seq_len < 1:
        raise HGraphError(f"Data-Centric Parallel recomputation needs layers >= 1 and a positive sequence "
                          f"length, got {layers}, {seq_len}")
    best: Optional[IntraChoice] = None
    for (b, p), c in sorted(candidates.items()):
        if c.mem_bytes > memory_bytes:
            continue  # does not fit even with full recomputation
        spare = memory_bytes - c.mem_bytes
        kept = layers if c.m <= 0 else min(layers, int(spare // c.m))  # layers that stash activations
        r = layers - kept
        time_ms = c.time_ms - kept * c.t_f
        thr = b * seq_len / (p * time_ms)
        if best is None or thr > best.throughput:
            best = IntraChoice(int(b), int(p), int(r), float(time_ms), float(thr))
    if best is None:
        raise HGraphError(f"no (batch, SP) candidate fits {memory_bytes / 2**30:.1f} GiB even with full recomputation")
    return best
