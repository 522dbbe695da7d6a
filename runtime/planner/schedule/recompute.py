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

from hgraph.runtime.engine.activation_model import FORWARD_FRACTION, ActivationModel, choose_recompute_layers
from hgraph.runtime.planner.cost.ulysses import repeated_kv_bytes_per_token


def recompute_ms(layer_time_ms: float, r: int) -> float:
    """Time the recomputation of ``r`` layers adds: their forward, ``FORWARD_FRACTION`` of T."""
    return r * FORWARD_FRACTION * layer_time_ms


def stage_activation_model(cost: Any, scheme: Any) -> ActivationModel | None:
    """The App. B.1 memory model of one stage of ``scheme`` (None when the profile has no ``A``), per
    token as ``MemoryModel.activation_bytes_per_token`` counts it: a layer stashes ``H / (TP*seq) * A``
    bytes (and its share of the K/V heads Ulysses repeats); a recomputed layer keeps its input
    (``2 * H / seq``: 16-bit working precision); the embedding, head and loss ``other / seq``."""
    mem, shape = cost.memory, cost.model
    A = mem.activation_A(scheme.tp)
    if A is None:
        return None
    kv = repeated_kv_bytes_per_token(shape.hidden, shape.layers, shape.heads, shape.kv_heads, scheme) / shape.layers
    other = dict(mem.other_coeff).get(scheme.tp, 0.0) / scheme.seq
    return ActivationModel(shape.hidden / (scheme.tp * scheme.seq) * A + kv, 0.0, 2.0 * shape.hidden / scheme.seq,
                           other)


def others_held(model: ActivationModel, f: tuple[float, float], stage_layers: int, pp: int) -> float:
    """Bytes the first stage's other ``PP - 1`` micro-batches of the same features hold under 1F1B:
    their layers, counted without relief (conservative); the embedding, head and loss once (B.1)."""
    return (pp - 1) * stage_layers * model.layer(f)


def recompute_extra_ms(cost: Any, lengths: Sequence[int], scheme: Any, budget_bytes: float) -> tuple[float, int]:
    """Time (ms) the recomputation adds to one micro-batch of the cost model, and the layers recomputed,
    with ``budget_bytes`` of activations per rank (App. B.1 activation model).

    A layer stashes ``l * H / (TP*CP) * A`` bytes (the App. B.1 activation term per layer); a
    recomputed layer keeps its input instead (``2 * l * H / CP`` bytes, 16-bit working precision);
    a stage has ``layers / PP`` layers and its first stage holds ``PP`` micro-batches under 1F1B
    (the others counted without recomputation: conservative). The fewest layers that fit are
    recomputed, each adding a third of its share of the micro-batch's forward+backward time.
    """
    model = stage_activation_model(cost, scheme)
    if model is None:
        return 0.0, 0
    lengths = np.asarray(lengths, dtype=np.float64)
    tokens = float(lengths.sum())
    if tokens <= 0:
        return 0.0, 0
    stage_layers = max(math.ceil(cost.model.layers / scheme.pp), 1)
    held = others_held(model, (tokens, 0.0), stage_layers, scheme.pp)
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
