"""The activation memory of a micro-batch on one stage, and which of its layers leave the device
(recomputed: dynamic recomputation, DCP-intra §3.4; or offloaded to host memory), as pure functions
of a memory model.

The device-side activation memory of one micro-batch on one pipeline stage of ``L`` blocks, ``r`` of
them recomputed and ``o`` offloaded, is (bytes)::

    held(f, r, o) = other(f) + (L - r - o) * layer(f) + r * checkpoint(f) + o * kept(f)
    peak(f, r, o) = max(held(f, r, o), r * checkpoint(f) + back(r, o) * layer(f))

from its forward to its backward. The second term is backward over the moved layers: the recomputed
layers are the stage's first ``r`` and the offloaded ones the next ``o`` (``engine.memory``), so when
backward reaches them the head (``other``) and the stashing layers above were already freed; next to
the ``r`` checkpoints sit one replayed layer's stash, or, for offloaded layers, the stash brought
back and the one prefetched below it (``back = min(o, 2)``, else ``[r > 0]``). ``kept(f)`` is what an
offloaded block still saves on the device (tensors under the offload threshold:
``engine.offload``); the rest, ``layer(f) - kept(f)``, lives in host memory until the backward
(``host(f, o) = o * (layer(f) - kept(f))``).

Here ``f = (tokens, entries, keys)`` are the micro-batch's features on this rank (its tokens, the
(query, key) entries its attention materialises, ``sum_d q_d * k_d`` over its documents, and the
key/value rows its attention holds, ``sum_d k_d``: under CP every document a rank has queries of
brings all its gathered keys, a term that does not shrink with the rank's tokens; both counted per
head share, ``engine.memory.microbatch_features``) and each term is linear in them:
``layer(f) = layer_per_token * tokens + layer_per_entry * entries + layer_per_key * keys``,
``checkpoint(f) = checkpoint_per_token * tokens``, ``other(f) = other_per_token * tokens``
(embedding, final norm, head, loss), ``kept(f) = kept_per_token * tokens``. Under 1F1B the
micro-batches forwarded but not yet backwarded (``held``) are added.

``choose_recompute_layers`` returns the fewest ``r`` whose peak fits the budget (all ``L`` when none
does, flagged). ``choose_layer_roles`` chooses ``(r, o)`` together: the cheapest in time whose peak
fits the budget and whose host bytes fit the host budget, a layer's price being its recomputation
(its forward) or the part of its two copies its compute does not hide (``offload_exposed_ms``).
``fit_activation_model`` fits the coefficients by least squares to what the engine's
``ActivationMeter`` (``hgraph.runtime.engine.memory``) measured. The planner prices the same choice
in time (``hgraph.runtime.planner.schedule.recompute`` and ``schedule.offload``).
"""
from __future__ import annotations

import math
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
    kept_per_token: float = 0.0        # what an offloaded layer still saves on the device
    layer_per_key: float = 0.0         # per key/value row the layer's attention holds

    def layer(self, f: Sequence[float]) -> float:
        keys = self.layer_per_key * f[2] if len(f) > 2 else 0.0     # features without keys: none counted
        return self.layer_per_token * f[0] + self.layer_per_entry * f[1] + keys

    def held(self, f: Sequence[float], layers: int, r: int, o: int = 0) -> float:
        """Device bytes a micro-batch holds between its forward and backward with ``r`` layers
        recomputed and ``o`` offloaded."""
        return (self.other_per_token * f[0] + (layers - r - o) * self.layer(f)
                + r * self.checkpoint_per_token * f[0] + o * self.kept_per_token * f[0])

    def host(self, f: Sequence[float], o: int) -> float:
        """Host bytes the ``o`` offloaded layers of a micro-batch hold until its backward."""
        return o * max(self.layer(f) - self.kept_per_token * f[0], 0.0)

    def peak(self, f: Sequence[float], layers: int, r: int, held_before: float = 0.0, o: int = 0) -> float:
        """Peak with ``held_before`` bytes of earlier micro-batches still held."""
        back = min(o, 2) if o > 0 else (1 if r > 0 else 0)
        replay = r * self.checkpoint_per_token * f[0] + back * self.layer(f)
        return held_before + max(self.held(f, layers, r, o), replay)


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


@dataclass(frozen=True)
class LayerRoles:
    """Which of a stage's layers leave the device for one micro-batch, and what that costs."""

    recompute: int           # the stage's first ``recompute`` layers are recomputed
    offload: int             # the next ``offload`` layers keep their stash in host memory
    predicted_peak: float    # device bytes
    host_bytes: float        # host bytes the offloaded layers hold
    extra_ms: float          # time the choice adds (recomputation, exposed copies)
    fits: bool


#: A layer's forward time over its forward + backward time (the backward is about twice the forward);
#: what recomputing a layer costs, and the compute its offload copies hide behind, in both the engine's
#: choice and the planner's.
FORWARD_FRACTION = 1.0 / 3.0


def offload_exposed_ms(nbytes: float, bytes_per_s: float, layer_ms: float) -> float:
    """The time one layer's offload adds: its stash goes to host memory during the forward and comes
    back during the backward, each copy hidden by the compute it overlaps (the layer's forward, a
    third of its forward+backward time ``layer_ms``, and its backward, two thirds); what exceeds it
    is exposed."""
    if nbytes <= 0:
        return 0.0
    if not bytes_per_s > 0:
        raise HGraphError(f"the host link bandwidth must be positive, got {bytes_per_s} bytes/s")
    copy_ms = nbytes / bytes_per_s * 1e3
    forward_ms = FORWARD_FRACTION * layer_ms
    return max(copy_ms - forward_ms, 0.0) + max(copy_ms - (layer_ms - forward_ms), 0.0)


def choose_layer_roles(model: ActivationModel, f: Sequence[float], layers: int, budget: float,
                       held_before: float = 0.0, *, recompute_ms: float, offload_ms: Optional[float],
                       host_budget: float = math.inf, host_held: float = 0.0) -> LayerRoles:
    """The ``(recomputed, offloaded)`` layer counts of one micro-batch: the cheapest in time
    (``recompute_ms`` and ``offload_ms`` per layer; ``offload_ms`` None: no offload) whose device
    peak is within ``budget`` and whose host bytes, with ``host_held`` already held, within
    ``host_budget``; ties go to fewer moved layers, then to fewer recomputed. When nothing fits:
    the least device memory within the host budget, flagged."""
    if layers < 0:
        raise HGraphError(f"a stage has a non-negative number of layers, got {layers}")
    if not budget > 0:
        raise HGraphError(f"the memory budget must be positive, got {budget}")
    if recompute_ms < 0 or (offload_ms is not None and offload_ms < 0):
        raise HGraphError(f"layer prices must be non-negative, got {recompute_ms} and {offload_ms} ms")
    best: Optional[tuple] = None
    avail = budget - held_before
    per = model.layer(f) - model.kept_per_token * f[0]        # what offloading one more layer frees
    for r in range(layers + 1):
        if best is not None and r * recompute_ms > best[0][0]:
            break                                      # more recomputed layers only cost more
        # for a given r the fewest offloaded layers that fit are the cheapest (prices are non-negative):
        # the held term falls by ``per`` a layer, so they are near ``o0``; the backward term does not
        # fall with ``o``, so if ``o0`` does not fit no larger count does (the neighbours for rounding)
        top = layers - r if offload_ms is not None else 0
        need = model.held(f, layers, r) - avail
        o0 = 0 if need <= 0 else (math.ceil(need / per) if per > 0 else top + 1)
        for o in range(max(o0 - 1, 0), min(o0 + 1, top) + 1):
            host = model.host(f, o)
            if o > 0 and host_held + host > host_budget:
                break                                  # more offloaded layers only hold more
            peak = model.peak(f, layers, r, held_before, o)
            if peak <= budget:
                ms = r * recompute_ms + o * (offload_ms or 0.0)
                key = (ms, r + o, r)
                if best is None or key < best[0]:
                    best = (key, LayerRoles(r, o, peak, host, ms, True))
                break
    if best is not None:
        return best[1]
    # nothing fits: the least device memory within the host budget
    least = min(((model.peak(f, layers, r, held_before, o), r * recompute_ms + o * (offload_ms or 0.0), r, o)
                 for r in range(layers + 1) for o in range(layers - r + 1 if offload_ms is not None else 1)
                 if o == 0 or host_held + model.host(f, o) <= host_budget))
    peak, ms, r, o = least
    return LayerRoles(r, o, peak, model.host(f, o), ms, False)


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
                         other_obs: Iterable[tuple[Sequence[float], float]] = (),
                         kept_obs: Iterable[tuple[Sequence[float], float]] = ()) -> Optional[ActivationModel]:
    """Fit the coefficients to measurements ``[(features, bytes)]``; None without a layer measurement.
    ``kept_obs``: what offloaded layers still saved on the device.

    The per-key and per-entry terms are each only fitted once the measurements hold micro-batches
    whose keys (entries) per token differ (otherwise that column cannot be told apart from the
    tokens: it goes per token; without CP a rank's keys are its tokens), and more distinct
    micro-batches than fitted columns.
    """
    layer_obs = [(tuple(map(float, f)) + (0.0,) * (3 - len(f)), float(b)) for f, b in layer_obs if f[0] > 0]
    if not layer_obs:
        return None
    X = np.array([f for f, _ in layer_obs])
    y = np.array([b for _, b in layer_obs])
    # a column joins while the distinct micro-batches outnumber the columns (two micro-batches cannot
    # tell three apart): keys first (every attention kernel holds its key/value rows; the entries
    # only where the kernel materialises its scores)
    distinct = len({tuple(round(x, 9) for x in f) for f, _ in layer_obs})
    varied = [0]
    for j in (2, 1):
        if len({round(f[j] / f[0], 9) for f, _ in layer_obs}) > 1 and distinct > len(varied):
            varied.append(j)
    coef = np.zeros(3)
    if len(varied) > 1:
        coef[varied] = _nonneg_lstsq(X[:, varied], y)
    else:
        coef[0] = float(np.sum(y) / np.sum(X[:, 0]))

    def per_token(obs: Iterable[tuple[Sequence[float], float]]) -> float:
        obs = [(float(f[0]), float(b)) for f, b in obs if f[0] > 0]
        t = sum(f for f, _ in obs)
        return max(sum(b for _, b in obs) / t, 0.0) if t else 0.0

    return ActivationModel(float(coef[0]), float(coef[1]), per_token(checkpoint_obs), per_token(other_obs),
                           per_token(kept_obs), float(coef[2]))
