"""The planner's side of activation offload: per micro-batch, which layers leave the device and how
(recomputed or offloaded to host memory, the cheapest per layer), and the time that adds.

The same choice as the engine's (``hgraph.runtime.engine.activation_model.choose_layer_roles``) on
the memory model that ``schedule.recompute`` builds from the cost profile's App. B.1 activation term:
a layer stashes ``l * H / (TP*CP) * A`` bytes; recomputed, it keeps its input (``2 * l * H / CP``);
offloaded, it keeps nothing on the device and holds its stash in host memory. A layer's price is
its recomputation (its forward, a third of its share of ``T(l)``) or the part of its two copies over
the host link that its compute does not hide (``offload_exposed_ms``; the link's bandwidth is the
profile's ``host_link.bytes_per_s``: measured on the run's device by the profiler, else the A800
prior of ``engine.offload``, PCIe Gen4 ~25 GB/s). The first stage holds ``PP`` micro-batches under
1F1B: the others are counted without relief on the device (as ``schedule.recompute`` does:
conservative), and each gets ``1/PP`` of the rank's host budget, so together they never pass it.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import numpy as np

from hgraph.runtime.engine.activation_model import FORWARD_FRACTION, LayerRoles, choose_layer_roles, offload_exposed_ms
from hgraph.runtime.engine.offload import DEFAULT_HOST_LINK_BYTES_PER_S
from hgraph.runtime.planner.schedule.recompute import others_held, stage_activation_model

HOST_LINK_KEY = "host_link"       # the profile's entry: {"bytes_per_s": float, "source": str}


A800_HOST_LINK = {"bytes_per_s": DEFAULT_HOST_LINK_BYTES_PER_S,
                  "source": "A800 prior: PCIe Gen4 x16, ~25 GB/s each way (not measured)"}


def with_host_link(cost: Any, entry: dict) -> Any:
    """``cost`` with the host link ``entry`` (``{"bytes_per_s", "source", ...}``) in its profile."""
    return dataclasses.replace(cost, extra={**cost.extra, HOST_LINK_KEY: dict(entry)})


def host_link_bytes_per_s(cost: Any) -> float:
    """The cost profile's host link bandwidth (bytes/s), or the A800 prior when it has none."""
    entry = getattr(cost, "extra", {}).get(HOST_LINK_KEY) or {}
    return float(entry.get("bytes_per_s", DEFAULT_HOST_LINK_BYTES_PER_S))


def layer_roles(cost: Any, lengths: Sequence[int], scheme: Any, budget_bytes: float | None, *,
                offload: str, host_budget_bytes: float = math.inf) -> tuple[LayerRoles, int]:
    """Which layers of one micro-batch of ``lengths`` leave the device under ``budget_bytes`` of
    activations per rank, and the stage's layer count, as the engine chooses under ``--offload``
    ``offload``: ``off`` recomputes the fewest layers that fit; ``auto`` takes the cheapest per layer
    within ``host_budget_bytes`` per rank; ``on`` offloads before it recomputes (every layer without
    a budget). ``extra_ms`` is what the choice costs at the profile's prices."""
    model = stage_activation_model(cost, scheme)
    arr = np.asarray(lengths, dtype=np.float64)
    tokens = float(arr.sum())
    stage_layers = max(math.ceil(cost.model.layers / scheme.pp), 1)
    if model is None or tokens <= 0:
        return LayerRoles(0, 0, 0.0, 0.0, 0.0, True), stage_layers
    f = (tokens, 0.0)
    a, b, _ = cost.coeffs(scheme)
    layer_ms = float(np.sum(a * arr * arr + b * arr)) / stage_layers
    recompute_ms = FORWARD_FRACTION * layer_ms
    offload_ms = offload_exposed_ms(model.host(f, 1), host_link_bytes_per_s(cost), layer_ms)
    held = others_held(model, f, stage_layers, scheme.pp)
    host_budget = host_budget_bytes / scheme.pp
    if budget_bytes is None:
        if offload != "on":
            return LayerRoles(0, 0, model.peak(f, stage_layers, 0, held), 0.0, 0.0, True), stage_layers
        per_layer = model.host(f, 1)
        fit = stage_layers if per_layer <= 0 or math.isinf(host_budget) else int(host_budget // per_layer)
        o = min(stage_layers, fit)
        return LayerRoles(0, o, model.peak(f, stage_layers, 0, held, o), model.host(f, o), o * offload_ms,
                          True), stage_layers
    if offload == "on":               # the engine's order (offload first), priced at the profile's prices
        roles = choose_layer_roles(model, f, stage_layers, budget_bytes, held, recompute_ms=1.0,
                                   offload_ms=0.0, host_budget=host_budget)
        ms = roles.recompute * recompute_ms + roles.offload * offload_ms
        return LayerRoles(roles.recompute, roles.offload, roles.predicted_peak, roles.host_bytes, ms,
                          roles.fits), stage_layers
    roles = choose_layer_roles(model, f, stage_layers, budget_bytes, held, recompute_ms=recompute_ms,
                               offload_ms=offload_ms if offload == "auto" else None, host_budget=host_budget)
    return roles, stage_layers


def relief_extra_ms(cost: Any, lengths: Sequence[int], scheme: Any, budget_bytes: float | None,
                    offload: str = "auto", host_budget_bytes: float = math.inf) -> tuple[float, int, int]:
    """Time (ms) recomputation and offload add to one micro-batch, and the layers recomputed and
    offloaded (``layer_roles``)."""
    roles, _ = layer_roles(cost, lengths, scheme, budget_bytes, offload=offload,
                           host_budget_bytes=host_budget_bytes)
    return roles.extra_ms, roles.recompute, roles.offload


def engine_layer_ms(cost: Any) -> Callable[[Any, tuple[int, int]], float | None]:
    """One layer's forward+backward ms for a scheme and a micro-batch's features on one of its ranks
    (local tokens, attention entries), from the cost model's ``T(l) = a l^2 + b l + c``: the engine's
    prices for ``--offload auto`` (``engine.memory.OffloadPolicy``). A CP or Ulysses rank holds
    ``1/degree`` of the tokens and of the entries, so the scheme's whole-micro-batch figures are
    those times the degree."""
    def layer_ms(scheme: Any, f: tuple[int, int]) -> float | None:
        if not cost.has(scheme):
            return None             # a scheme the profile does not price: the engine offloads first
        a, b, _ = cost.coeffs(scheme)
        stage_layers = max(math.ceil(cost.model.layers / scheme.pp), 1)
        return (a * f[1] * scheme.seq + b * f[0] * scheme.seq) / stage_layers
    return layer_ms
