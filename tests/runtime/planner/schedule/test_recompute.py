"""DCP-intra per micro-batch: the fewest recomputed layers that fit, the fit of the memory model, and
the recomputation time the planner's micro-batch estimate adds."""
import itertools

import pytest

from hgraph.errors import HGraphError
from hgraph.runtime.engine.activation_model import ActivationModel, choose_recompute_layers, fit_activation_model
from hgraph.runtime.planner.cost.cost_model import load_cost_model
from hgraph.runtime.planner.schedule.recompute import recompute_aware_microbatch_ms, recompute_ms
from hgraph.strategy import Scheme

MODEL = ActivationModel(layer_per_token=5000.0, layer_per_entry=12.0, checkpoint_per_token=300.0,
                        other_per_token=2800.0)


def test_peak_follows_the_stated_formula():
    f = (30, 300)
    layer = 5000 * 30 + 12 * 300
    held = 2800 * 30 + 2 * layer + 2 * 300 * 30
    assert MODEL.held(f, 4, 2) == pytest.approx(held)
    assert MODEL.peak(f, 4, 2, held_before=7) == pytest.approx(7 + max(held, 2 * 300 * 30 + layer))
    assert MODEL.peak(f, 4, 0) == pytest.approx(2800 * 30 + 4 * layer)


@pytest.mark.parametrize("layers,tokens,entries,held", list(itertools.product((1, 4, 7), (10, 300), (0, 5000), (0.0, 1e5))))
def test_the_choice_is_the_fewest_recomputed_layers_that_fit(layers, tokens, entries, held):
    f = (tokens, entries)
    peaks = [MODEL.peak(f, layers, r, held) for r in range(layers + 1)]
    for budget in sorted(set(peaks)) + [min(peaks) * 0.5, max(peaks) * 2]:
        c = choose_recompute_layers(MODEL, f, layers, budget, held)
        if min(peaks) > budget:
            assert (c.layers, c.fits) == (layers, False)
            continue
        assert c.fits and c.predicted_peak == peaks[c.layers] <= budget
        assert all(p > budget for p in peaks[:c.layers])          # nothing fewer fits


def test_no_recomputation_when_everything_fits_and_bad_budgets():
    assert choose_recompute_layers(MODEL, (10, 0), 4, 1e12).layers == 0
    with pytest.raises(HGraphError):
        choose_recompute_layers(MODEL, (10, 0), 4, 0)


def test_fit_recovers_the_coefficients_from_measurements():
    obs = [((t, e), MODEL.layer((t, e))) for t, e in [(10, 100), (30, 300), (20, 1000), (64, 64)]]
    ck = [((t, 0), 300.0 * t) for t in (10, 30)]
    other = [((t, 0), 2800.0 * t) for t in (10, 30)]
    fit = fit_activation_model(obs, ck, other)
    assert fit.layer_per_token == pytest.approx(5000.0)
    assert fit.layer_per_entry == pytest.approx(12.0)
    assert fit.checkpoint_per_token == pytest.approx(300.0) and fit.other_per_token == pytest.approx(2800.0)
    # one shape only: entries cannot be told from tokens, all goes per token
    one = fit_activation_model([((10, 100), 51200.0), ((20, 200), 102400.0)])
    assert (one.layer_per_token, one.layer_per_entry) == (pytest.approx(5120.0), 0.0)
    assert fit_activation_model([]) is None


def test_planner_estimate_adds_the_forward_of_the_recomputed_layers():
    cost = load_cost_model("llama-7b", 8)
    scheme = Scheme(2, 1, 1)
    lengths = [4096, 2048]
    base = cost.microbatch_time(lengths, scheme)
    ms, r = recompute_aware_microbatch_ms(cost, lengths, scheme, budget_bytes=float(cost.memory.gpu_memory_bytes))
    assert (ms, r) == (pytest.approx(base), 0)        # fits in the whole device without recomputation
    tight = 6e9                                       # activation bytes per rank
    ms, r = recompute_aware_microbatch_ms(cost, lengths, scheme, budget_bytes=tight)
    layer_ms = float(sum(cost.seq_time(lengths, scheme))) / cost.model.layers
    assert 0 < r <= cost.model.layers
    assert ms == pytest.approx(base + recompute_ms(layer_ms, r)) and recompute_ms(layer_ms, r) == pytest.approx(r * layer_ms / 3)
    ms2, r2 = recompute_aware_microbatch_ms(cost, lengths, scheme, budget_bytes=tight * 0.9)
    assert r2 >= r and ms2 >= ms
    # the cost model with a budget gives the planner the same figure
    cost.activation_budget_bytes = tight
    assert cost.microbatch_time(lengths, scheme) == pytest.approx(ms)
