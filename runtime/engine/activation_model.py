"""The activation memory of a micro-batch on one stage, and how many of its layers to recompute
(dynamic recomputation, DCP-intra §3.4), as pure functions of a memory model.

The activation memory of one micro-batch on one pipeline stage of ``L`` blocks, ``r`` of them
recomputed, is (bytes)::

    held(f, r) = other(f) + (L - r) * layer(f) + r * checkpoint(f)   from its forward to its backward
    peak(f, r) = max(held(f, r), r * checkpoint(f) + [r > 0] * layer(f))

The second term is the replay: the recomputed layers are the stage's first ``r``, so when backward
reaches them the head (``other``) and the stashing layers above were already freed, and one replayed
layer's stash sits next to the ``r`` checkpoints.
with ``f = (tokens, entries)`` the micro-batch's features on this rank (its tokens, and the (query,
key) entries its attention materialises: ``sum_d q_d * k_d`` over its documents) and each term linear
in them: ``layer(f) = layer_per_token * tokens + layer_per_entry * entries``, ``checkpoint(f) =
checkpoint_per_token * tokens``, ``other(f) = other_per_token * tokens`` (embedding, final norm,
head, loss). Under 1F1B the micro-batches forwarded but not yet backwarded (``held``) are added.

``choose_recompute_layers`` returns the fewest ``r`` whose peak fits the budget (all ``L`` when none
does, flagged). ``fit_activation_model`` fits the coefficients by least squares to what the
engine's ``ActivationMeter`` (``hgraph.runtime.engine.memory``) measured. The planner prices the
same choice in time (``hgraph.runtime.planner.schedule.recompute``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import numpy as np

from hgraph.errors import HGraphError


@dataclass(frozen=True)
class ActivationModel:
    """Coefficients (bytes) of the activation memory of one stage."""

    layer_per_token: float
    layer_per_entry: float = 0.0
    checkpoint_per_token: float = 0.0
    other_per_token: float = 0.0

    def layer(self, f: Sequence[float]) -> float:
        return self.layer_per_token * f[0] + self.layer_per_entry * f[1]

    def held(self, f: Sequence[float], layers: int, r: int) -> float:
        """Bytes a micro-batch holds between its forward and backward with ``r`` layers recomputed."""
        return (self.other_per_token * f[0] + (layers - r) * self.layer(f)
                + r * self.checkpoint_per_token * f[0])

    def peak(self, f: Sequence[float], layers: int, r: int, held_before: float = 0.0) -> float:
        """Peak with ``held_before`` bytes of earlier micro-batches still held."""
        replay = r * self.checkpoint_per_token * f[0] + (self.layer(f) if r > 0 else 0.0)
        return held_before + max(self.held(f, layers, r), replay)


@dataclass(frozen=True)
class RecomputeChoice:
    layers: int              # recomputed layers
    predicted_peak: float    # bytes
    fits: bool


def choose_recompute_layers(model: ActivationModel, f: Sequence[float], layers: int, budget: float,
                            held_before: float = 0.0) -> RecomputeChoice:
    """The fewest recomputed layers whose predicted peak is within ``budget`` (DCP-intra)."""
    if layers < 0:
        raise HGraphError(f"a stage has a non-negative number of layers, got {layers}")
    if not budget > 0:
        raise HGraphError(f"the memory budget must be positive, got {budget}")
    for r in range(layers + 1):
        p = model.peak(f, layers, r, held_before)
        if p <= budget:
            return RecomputeChoice(r, p, True)
    return RecomputeChoice(layers, model.peak(f, layers, layers, held_before), False)


def _nonneg_lstsq(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with the columns whose coefficient would be negative dropped (to zero)."""
    active = [j for j in range(X.shape[1]) if np.any(X[:, j])]
    coef = np.zeros(X.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(X[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return coef


def fit_activation_model(layer_obs: Iterable[tuple[Sequence[float], float]],
                         checkpoint_obs: Iterable[tuple[Sequence[float], float]] = (),
                         other_obs: Iterable[tuple[Sequence[float], float]] = ()) -> Optional[ActivationModel]:
    """Fit the coefficients to measurements ``[(features, bytes)]``; None without a layer measurement.

    The per-entry term is only fitted once the measurements hold two micro-batches whose
    entries-per-token differ (otherwise the two columns cannot be told apart: all goes per token).
    """
    layer_obs = [(tuple(map(float, f)), float(b)) for f, b in layer_obs if f[0] > 0]
    if not layer_obs:
        return None
    X = np.array([f for f, _ in layer_obs])
    y = np.array([b for _, b in layer_obs])
    ratios = {round(f[1] / f[0], 9) for f, _ in layer_obs}
    coef = _nonneg_lstsq(X, y) if len(ratios) > 1 else np.array([float(np.sum(y) / np.sum(X[:, 0])), 0.0])

    def per_token(obs: Iterable[tuple[Sequence[float], float]]) -> float:
        obs = [(float(f[0]), float(b)) for f, b in obs if f[0] > 0]
        t = sum(f for f, _ in obs)
        return max(sum(b for _, b in obs) / t, 0.0) if t else 0.0

    return ActivationModel(float(coef[0]), float(coef[1]), per_token(checkpoint_obs), per_token(other_obs))
