"""Per micro-batch the planner takes each layer off the device the cheaper way, recomputed or
offloaded to host memory, within the device and the host budgets; the copies cost only what the
layer's compute does not hide."""
import dataclasses
import math
import random

import pytest

from hgraph.errors import HGraphError
from hgraph.runtime.engine.activation_model import ActivationModel, choose_layer_roles, offload_exposed_ms
from hgraph.runtime.planner.cost.cost_model import load_cost_model, with_activation_budget, with_offload
from hgraph.runtime.planner.schedule.offload import (HOST_LINK_KEY, host_link_bytes_per_s, layer_roles,
                                                     relief_extra_ms)
from hgraph.runtime.planner.schedule.recompute import recompute_aware_microbatch_ms
from hgraph.strategy import Scheme

MODEL = ActivationModel(layer_per_token=5000.0, checkpoint_per_token=300.0, other_per_token=2800.0,
                        kept_per_token=100.0)
F = (30, 0)


def test_an_offloaded_layer_leaves_the_device_and_waits_on_the_host():
    layer, kept = 5000 * 30, 100 * 30
    assert MODEL.held(F, 4, 1, 2) == pytest.approx(2800 * 30 + layer + 300 * 30 + 2 * kept)
    assert MODEL.host(F, 2) == pytest.approx(2 * (layer - kept))
    # backward over offloaded layers: the one brought back and the one prefetched below it
    assert MODEL.peak(F, 4, 1, 7.0, 3) == pytest.approx(7 + max(MODEL.held(F, 4, 1, 3), 300 * 30 + 2 * layer))


def test_copies_cost_only_what_the_compute_does_not_hide():
    # 1 MB at 1 GB/s: 1 ms each way; a 3 ms layer hides it under its 1 ms forward and 2 ms backward
    assert offload_exposed_ms(1e6, 1e9, 3.0) == 0.0
    assert offload_exposed_ms(1e6, 1e9, 1.5) == pytest.approx(0.5)          # 1 - 0.5 forward, 0 backward
    assert offload_exposed_ms(4e6, 1e9, 3.0) == pytest.approx(3.0 + 2.0)
    with pytest.raises(HGraphError, match="bandwidth must be positive"):
        offload_exposed_ms(1.0, 0.0, 1.0)


def test_the_cheaper_way_is_chosen_within_both_budgets():
    budget = MODEL.peak(F, 4, 0, 0.0, 2)               # two layers must leave the device
    assert MODEL.peak(F, 4, 0, 0.0, 1) > budget
    cheap = choose_layer_roles(MODEL, F, 4, budget, recompute_ms=1.0, offload_ms=0.1)
    assert (cheap.recompute, cheap.offload, cheap.fits) == (0, 2, True)
    assert cheap.extra_ms == pytest.approx(0.2) and cheap.host_bytes == pytest.approx(MODEL.host(F, 2))
    dear = choose_layer_roles(MODEL, F, 4, budget, recompute_ms=1.0, offload_ms=2.0)
    assert dear.offload == 0 and dear.recompute >= 2 and dear.fits
    # the host holds another micro-batch's layers: room for one more layer only, the rest recomputes
    full = choose_layer_roles(MODEL, F, 4, budget, recompute_ms=1.0, offload_ms=0.1,
                              host_budget=MODEL.host(F, 3), host_held=MODEL.host(F, 2))
    assert full.offload <= 1 and full.recompute >= 1 and full.fits
    assert full.host_bytes + MODEL.host(F, 2) <= MODEL.host(F, 3) + 1e-6
    # no offload allowed: the fewest recomputed layers, as choose_recompute_layers
    none = choose_layer_roles(MODEL, F, 4, budget, recompute_ms=1.0, offload_ms=None)
    assert none.offload == 0 and none.fits


def test_the_planner_offloads_when_recomputation_is_dearer_and_not_past_the_host_budget():
    cost = load_cost_model("llama-7b", 8)
    scheme, lengths, tight = Scheme(2, 1, 1), [4096, 2048], 6e9
    assert host_link_bytes_per_s(cost) == 25e9          # the A800 prior: PCIe Gen4
    recompute_ms, r = recompute_aware_microbatch_ms(cost, lengths, scheme, tight)
    assert r > 0
    # over PCIe Gen4 a 7B layer's stash (~0.5 GB) takes longer than its compute hides: recomputed
    slow, _ = layer_roles(cost, lengths, scheme, tight, offload="auto")
    assert slow.offload == 0 and slow.recompute == r
    # a link four times faster hides the copies: offloaded, at no cost
    fast = dataclasses.replace(cost, extra={**cost.extra, HOST_LINK_KEY: {"bytes_per_s": 100e9}})
    roles, _ = layer_roles(fast, lengths, scheme, tight, offload="auto")
    assert roles.offload > 0 and roles.recompute == 0 and roles.extra_ms == 0.0 and roles.fits
    assert relief_extra_ms(fast, lengths, scheme, tight) == (0.0, 0, roles.offload)
    # the micro-batch time of the cost model prices the same choice
    priced = with_offload(with_activation_budget(fast, tight), "auto", None)
    base = with_activation_budget(fast, None).microbatch_time(lengths, scheme)
    assert priced.microbatch_time(lengths, scheme) == pytest.approx(base)
    assert with_activation_budget(fast, tight).microbatch_time(lengths, scheme) == pytest.approx(recompute_ms)
    # the host budget exhausted: recomputation again, and the host never holds more than its budget
    host = roles.host_bytes * scheme.pp / 2                 # room for about half the offloaded layers
    bound, _ = layer_roles(fast, lengths, scheme, tight, offload="auto", host_budget_bytes=host)
    assert bound.offload < roles.offload and bound.recompute > 0 and bound.host_bytes <= host
    none, _ = layer_roles(fast, lengths, scheme, tight, offload="auto", host_budget_bytes=0.0)
    assert (none.offload, none.recompute) == (0, r)
    # --offload on without a budget: every layer offloads, priced by the exposed copies
    every, layers = layer_roles(cost, lengths, scheme, None, offload="on")
    assert every.offload == layers and every.extra_ms > 0
    assert with_offload(cost, "on", math.inf).microbatch_time(lengths, scheme) == pytest.approx(
        cost.microbatch_time(lengths, scheme) + every.extra_ms)


def test_bad_offload_mode_is_one_clear_line():
    with pytest.raises(HGraphError, match=r"offload 'sometimes': expected one of off, on, auto"):
        with_offload(load_cost_model("llama-7b", 8), "sometimes", None)


def test_the_search_finds_what_trying_every_pair_finds():
    """``choose_layer_roles`` looks at a few offload counts per recomputed count; trying every
    ``(r, o)`` gives the same choice (cheapest, then fewest moved, then fewest recomputed)."""
    rng = random.Random(1)
    for _ in range(400):
        model = ActivationModel(rng.uniform(100, 6000), 0.0, rng.uniform(0, 500), rng.uniform(0, 3000),
                                rng.uniform(0, 200))
        layers, f, held = rng.randint(0, 10), (rng.randint(1, 100), 0), rng.choice([0.0, rng.uniform(0, 1e6)])
        budget, rc = rng.uniform(1e3, 3e6), rng.uniform(0, 3)
        oc = rng.choice([None, 0.0, rng.uniform(0, 3)])
        host_budget, host_held = rng.choice([math.inf, rng.uniform(0, 1e6)]), rng.uniform(0, 1e5)
        fitting = [((r * rc + o * (oc or 0.0), r + o, r), (r, o))
                   for r in range(layers + 1) for o in range(layers - r + 1 if oc is not None else 1)
                   if (o == 0 or host_held + model.host(f, o) <= host_budget)
                   and model.peak(f, layers, r, held, o) <= budget]
        got = choose_layer_roles(model, f, layers, budget, held, recompute_ms=rc, offload_ms=oc,
                                 host_budget=host_budget, host_held=host_held)
        assert got.fits == bool(fitting)
        if fitting:
            assert (got.recompute, got.offload) == min(fitting)[1]
