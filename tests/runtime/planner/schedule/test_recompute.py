"""DCP-intra per micro-batch: the fewest recomputed layers that fit, the fit of the memory model, and
the recomputation time the planner's micro-batch estimate adds."""
import itertools

import pytest

from hgraph.errors import HGraphError
from hgraph.runtime.data.micro_batch import MicroBatch
from hgraph.runtime.engine.activation_model import ActivationModel, choose_recompute_layers, fit_activation_model
from hgraph.runtime.engine.sequence_inputs import sequence_layout
from hgraph.runtime.engine.memory import microbatch_features
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


def test_fit_recovers_the_per_key_term_and_fits_no_more_columns_than_micro_batches():
    """A CP rank's layer holds its documents' gathered key/value rows (``keys``), which do not shrink
    with its tokens: the fit recovers that term; with two distinct micro-batches only one column
    joins the tokens, the keys (two points cannot tell three columns apart)."""
    truth = ActivationModel(layer_per_token=5000.0, layer_per_entry=3.0, layer_per_key=250.0)
    shapes = [(8, 96, 22), (7, 77, 11), (6, 56, 18), (9, 113, 25)]
    fit = fit_activation_model([(f, truth.layer(f)) for f in shapes])
    assert (fit.layer_per_token, fit.layer_per_entry, fit.layer_per_key) == (
        pytest.approx(5000.0), pytest.approx(3.0), pytest.approx(250.0))
    two = fit_activation_model([(f, 5000.0 * f[0] + 250.0 * f[2]) for f in shapes[:2]])
    assert (two.layer_per_token, two.layer_per_entry, two.layer_per_key) == (
        pytest.approx(5000.0), 0.0, pytest.approx(250.0))
    # without CP a rank's keys are its tokens: no per-key term
    plain = fit_activation_model([((t, t * t, t), 5144.0 * t) for t in (2, 4, 6)])
    assert (plain.layer_per_token, plain.layer_per_key) == (pytest.approx(5144.0), 0.0)
    assert truth.layer((8, 96)) == 5000.0 * 8 + 3.0 * 96        # features without keys count none


def test_features_count_a_cp_ranks_gathered_keys_and_a_ulysses_ranks_shard_at_its_head_share():
    mb = MicroBatch((13, 5, 9, 7))
    assert microbatch_features(mb) == (34, 13 * 13 + 25 + 81 + 49, 34)
    for scheme in ("TP1PP1CP3", "TP1PP1CP2"):
        p = Scheme.parse(scheme)
        for s in range(p.seq):
            lay = sequence_layout(mb, p, s, "per-sequence")
            docs = {lay.doc_of[i] for i in lay.local_tokens}
            tokens, entries, keys = microbatch_features(mb, lay)
            assert tokens == len(lay.local_tokens) and keys == sum(mb.doc_lengths[d] for d in docs)
            assert entries == sum(mb.doc_lengths[lay.doc_of[i]] for i in lay.local_tokens)
    # UL2: every token of the micro-batch (the one CP shard) for half the heads
    ul = [microbatch_features(mb, sequence_layout(mb, Scheme.parse("TP1PP1UL2"), s)) for s in range(2)]
    assert [f[0] for f in ul] == [17, 17]
    assert all(f[1:] == ((13 * 13 + 25 + 81 + 49) / 2, 34 / 2) for f in ul)
    # CP2UL2: the CP shard's documents' gathered keys, at half the heads
    p = Scheme.parse("TP1PP1CP2UL2")
    for s in range(p.seq):
        lay = sequence_layout(mb, p, s)
        docs = {lay.doc_of[i] for i in lay.shard_tokens}
        assert microbatch_features(mb, lay)[2] == sum(mb.doc_lengths[d] for d in docs) / 2


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
