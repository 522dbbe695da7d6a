"""Activation offload on one rank: an offloaded run is bitwise the run without it, its device-side
saved bytes fall by what the activation model says, and the host budget is never passed.

Five runs of the equivalence harness's mini-batches on ``1xTP1PP1`` (one micro-batch a step), in
one process: blocks outlined without offload (a budget no micro-batch reaches: the first step
recomputes every block, nothing being measured yet, the others none), every block offloaded, every
block offloaded under a host budget smaller than one micro-batch's stash, and ``--offload auto`` and
``on`` under one memory budget.
"""
import pytest
import torch
from tests.runtime.engine.equivalence_harness import load_equivalence_harness

from hgraph.runtime.data.micro_batch import MicroBatch
from hgraph.runtime.engine.activation_model import fit_activation_model
from hgraph.runtime.engine.memory import microbatch_features
from hgraph.runtime.train.trainer import Trainer

EQ = load_equivalence_harness()
LAYERS = 4                       # tiny's
HOST_BUDGET = 100_000            # bytes: less than one micro-batch's stash (~550 KB)
BUDGET = 180_000                 # device bytes: some of a micro-batch's 4 layers (~145 KB each) must leave
RUNS = {"plain": {"memory_budget": 1e12}, "offload": {"offload": "on"},
        "host_bound": {"offload": "on", "host_memory_budget": HOST_BUDGET},
        # one budget, two policies: layers priced (auto) or offloaded first (on)
        "auto": {"offload": "auto", "memory_budget": BUDGET}, "on_budget": {"offload": "on", "memory_budget": BUDGET}}


@pytest.fixture(scope="module")
def runs():
    out = {}
    for name, options in RUNS.items():
        trainer = Trainer(EQ._config("tiny", "1xTP1PP1", 1, {}, options), 0, 1, None)
        steps = [trainer.step(b) for b in EQ._batches()]
        memory = next(iter(trainer.executor.programs.states().values())).memory
        out[name] = {"steps": steps, "final": trainer.final_state_dict(), "observations": memory.meter.observations}
    return out


def test_an_offloaded_run_is_bitwise_the_run_without(runs):
    plain = runs["plain"]
    for name in ("offload", "host_bound", "auto", "on_budget"):
        run = runs[name]
        assert [s.loss for s in run["steps"]] == [s.loss for s in plain["steps"]], name
        for key, value in plain["final"].items():
            assert torch.equal(run["final"][key], value), (name, key)


def test_device_side_saved_bytes_fall_by_what_the_model_says(runs):
    """Per micro-batch, the activation model fitted to what its blocks stashed (the run without
    offload) and still kept on the device (the offloaded run) says the device-side saved bytes
    fall by ``held(f, L, 0) - held(f, L, 0, L)``; the meter's peaks of the two runs differ by that."""
    plain, off = runs["plain"], runs["offload"]
    assert all(s.offload_layers == [LAYERS] for s in off["steps"])             # every block offloaded
    assert all(s.recompute_layers == [0] for s in plain["steps"][1:])          # nothing left the device
    layer_obs, kept_obs = plain["observations"]["layer"], off["observations"]["kept"]
    for k, batch in enumerate(EQ._batches()[1:], start=1):
        f = microbatch_features(MicroBatch.pack([d.input_ids for d in batch.docs]))
        blocks = slice(LAYERS * k, LAYERS * (k + 1))      # the step's blocks (step 0 observed replays)
        assert {o[0] for o in layer_obs[blocks]} == {o[0] for o in kept_obs[blocks]} == {f}
        model = fit_activation_model(layer_obs[blocks], kept_obs=kept_obs[blocks])
        predicted = model.held(f, LAYERS, 0) - model.held(f, LAYERS, 0, LAYERS)
        measured = plain["steps"][k].peak_mem_bytes - off["steps"][k].peak_mem_bytes
        assert measured == pytest.approx(predicted, abs=1.0), (k, measured, predicted)
        # the host holds exactly what left the device (each storage once)
        assert off["steps"][k].host_peak_bytes == measured
        assert model.host(f, LAYERS) == pytest.approx(measured, abs=1.0)


def test_auto_takes_the_cheaper_way_where_on_offloads_first(runs):
    """tiny's copies take longer than its compute hides (its analytic prior at 25 GB/s): under the
    same budget ``auto`` recomputes, ``on`` offloads before it recomputes; both fit the budget (in
    the model's prediction) once the model is fitted."""
    auto, on = runs["auto"]["steps"], runs["on_budget"]["steps"]
    assert all(s.offload_layers == [0] for s in auto) and any(s.recompute_layers[0] > 0 for s in auto[1:])
    assert any(s.offload_layers[0] > 0 for s in on[1:])
    for s in auto[1:] + on[1:]:
        assert s.predicted_mem_bytes <= BUDGET
        assert s.recompute_layers[0] + s.offload_layers[0] <= LAYERS


def test_the_host_budget_is_never_passed(runs):
    bound, free = runs["host_bound"]["steps"], runs["offload"]["steps"]
    for b, f in zip(bound, free):
        assert 0 < b.host_peak_bytes <= HOST_BUDGET < f.host_peak_bytes
        assert b.peak_mem_bytes > f.peak_mem_bytes        # what did not fit stayed on the device

