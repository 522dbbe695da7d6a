"""The planner's side of dynamic recomputation (DCP-intra, §3.4): the time recomputation adds to a
micro-batch of the cost model.

The activation memory model and the choice of how many layers recompute
(``hgraph.runtime.engine.activation_model``) are the engine's: it fits the model to what it measured
and chooses per micro-batch. Here the same model, built from the cost profile's App. B.1 activation
term, gives the planner the recomputed layers of a micro-batch under a budget; ``recompute_ms`` is
the time they add (the forward of the recomputed layers, a third of their forward+backward time
``T(l)``), which ``recompute_aware_microbatch_ms`` adds to the cost model's micro-batch time.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from hgraph.runtime.engine.activation_model import ActivationModel, choose_recompute_layers

FORWARD_FRACTION = 1.0 / 3.0     # forward time over forward+backward time of a layer


def recompute_ms(layer_time_ms: float, r: int) -> float:
    """Time the recomputation of ``r`` layers adds: their forward, ``FORWARD_FRACTION`` of T."""
    return r * FORWARD_FRACTION * layer_time_ms


def recompute_extra_ms(cost: Any, lengths: Sequence[int], scheme: Any, budget_bytes: float) -> tuple[float, int]:
    """Time (ms) the recomputation adds to one micro-batch of the cost model, and the layers recomputed,
    with ``budget_bytes`` of activations per rank (App. B.1 activation model).

    A layer stashes ``l * H / (TP*CP) * A`` bytes (the App. B.1 activation term per layer); a
    recomputed layer keeps its input instead (``2 * l * H / CP`` bytes, 16-bit working precision);
    a stage has ``layers / PP`` layers and its first stage holds ``PP`` micro-batches under 1F1B
    (the others counted without recomputation: conservative). The fewest layers that fit are
    recomputed, each adding a third of its share of the micro-batch's forward+backward time.
    """
    mem, shape = cost.memory, cost.model
    A = mem.activation_A(scheme.tp)
    if A is None:
        return 0.0, 0
    lengths = np.asarray(lengths, dtype=np.float64)
    tokens = float(lengths.sum())
    if tokens <= 0:
        return 0.0, 0
    stage_layers = max(math.ceil(shape.layers / scheme.pp), 1)
    model = ActivationModel(shape.hidden / (scheme.tp * scheme.seq) * A, 0.0, 2.0 * shape.hidden / scheme.seq)
    held = (scheme.pp - 1) * model.held((tokens, 0.0), stage_layers, 0)
    choice = choose_recompute_layers(model, (tokens, 0.0), stage_layers, budget_bytes, held)
    a, b, _ = cost.coeffs(scheme)
    layer_ms = float(np.sum(a * lengths * lengths + b * lengths)) / stage_layers
    return recompute_ms(layer_ms, choice.layers), choice.layers


def recompute_aware_microbatch_ms(cost: Any, lengths: Sequence[int], scheme: Any, budget_bytes: float,
                                  ) -> tuple[float, int]:
    """The cost model's micro-batch time (without its own budget) plus the recomputation under
    ``budget_bytes`` of activations per rank; returns ``(ms, recomputed layers)``."""
    a, b, c = cost.coeffs(scheme)
    arr = np.asarray(lengths, dtype=np.float64)
    extra, r = recompute_extra_ms(cost, arr, scheme, budget_bytes)
    return float(np.sum(a * arr * arr + b * arr)) + c + extra, r
