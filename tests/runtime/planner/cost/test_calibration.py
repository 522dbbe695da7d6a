"""``--profile measure``: the cost model built from timings on this machine, on 2 ranks (compute,
TP all-reduce, PP send/recv) and the online correction of the estimates."""
import math

import pytest
import torch

import hgraph.runtime.planner.cost.calibration as calibration
from hgraph.frontends.zoo import llama
from hgraph.runtime.planner.cost.calibration import (COMM_LENGTHS, PUSH_BYTES, StepCorrection,
                                                    interleaved_layer_timings, scaled_plan)
from hgraph.runtime.planner.cost import moe_cost
from hgraph.runtime.planner.cost.fit import fit_coefficients
from hgraph.runtime.planner.cost.ulysses import ulysses_coeffs
from hgraph.runtime.planner.selection import plan_iteration
from hgraph.runtime.planner.service.iteration import measured_cost_model, model_cost_model
from hgraph.runtime.train.launch import spawn
from hgraph.strategy import Scheme, Strategy


def test_a_tp_shard_divides_heads_mlp_and_vocabulary_and_keeps_the_head_size():
    from hgraph.frontends.zoo.llama import tp_shard_config
    cfg = llama.make_config("tiny")
    shard = tp_shard_config(cfg, 2, 2)
    assert (shard.num_layers, shard.num_heads, shard.num_kv_heads, shard.head_dim) == (2, 2, 1, cfg.head_dim)
    assert (shard.intermediate_size, shard.vocab_size, shard.hidden_size) == (88, 256, 64)
    assert tp_shard_config(cfg, 1, 1) == llama.make_config("tiny", num_layers=1)


def _calibrate(rank, world_size):
    import torch

    import hgraph
    from hgraph.runtime.comm.process_groups import GroupCache
    model = llama.build("tiny")
    slots = hgraph.compile(model).hgraph.slot_counts()
    torch.manual_seed(1)
    expected = torch.rand(3)
    torch.manual_seed(1)
    groups = GroupCache(rank, world_size)
    cost = measured_cost_model(model, rank, world_size, groups, 8,
                               slots["tp_enter"] + slots["tp_exit"], ulysses=True)
    assert torch.equal(torch.rand(3), expected), "calibration must not move the run's RNG stream"
    # the EP all-to-all of 2 copies a token's rows, on the same two ranks (what a MoE prior's calibration times)
    ep = calibration.measure_expert_all_to_all((2,), 2, rank, world_size, 64, groups,
                                               torch.float32, 3, torch.device("cpu"), lambda _text: None)
    return cost, ep


@pytest.fixture(scope="module")
def spawned():
    return spawn(_calibrate, 2, timeout_s=300)


@pytest.fixture(scope="module")
def measured(spawned):
    return [cost for cost, _ in spawned]


def test_the_ep_all_to_all_is_timed_on_two_ranks_and_prices_the_ep_schemes(spawned):
    (_, (raw, comm)), (_, (raw1, comm1)) = spawned
    assert comm == comm1 and set(raw) == {2} and len(raw[2]) == 2 and all(t > 0 for t in raw[2])
    rows = [calibration.ep_rows(l, 2, 2) for l in COMM_LENGTHS]        # 2 copies of each token's row
    assert rows == [2 * l for l in COMM_LENGTHS]
    beta = max((raw[2][1] - raw[2][0]) / (rows[1] - rows[0]), 0.0)
    if beta > 0:    # a row of 64 fp32 values sends half its bytes to the other rank
        assert comm.intra_node_bytes_per_s == pytest.approx(64 * 4 / 2 / (beta / 1e3))
    assert "EP2" in comm.source
    # a MoE model's EP schemes take their all-to-all term from it
    from dataclasses import replace
    from hgraph.frontends.zoo import llama_moe
    prior = model_cost_model("analytic", llama_moe.build("tiny"), 2)
    cost = replace(prior, ep_all_to_all=comm)
    ep2, base = Scheme(1, 1, ep=2), Scheme(1, 1)
    a, b, c = cost.coeffs(base)
    share = moe_cost.routed_share(64, 3, prior.model.experts)
    comm_b = 2 * moe_cost.all_to_all_bytes_per_token(64, prior.model.experts, tp=1, seq=1, ep=2,
                                                     bytes_per_element=4) / comm.intra_node_bytes_per_s * 1e3
    assert cost.coeffs(ep2) == pytest.approx((a / 2, (b + comm_b) / 2, c + 2 * 4 * comm.latency_ms))
    assert share > 0


def test_two_ranks_build_the_same_measured_model_with_tp_and_pp_comm(measured):
    a, b = measured
    assert a.profiled == b.profiled and a.name == "measured"
    raw = a.extra["calibration"]
    # TP up to the KV heads' gcd and PP dividing the layers, on 2 ranks; CP is not timed, so not offered;
    # Ulysses (asked for here, on CPU) from the all-to-all timed on the two ranks
    assert set(a.schemes) == {Scheme(1, 1), Scheme(1, 2), Scheme(2, 1), Scheme(1, 1, ul=2)}
    assert a.all_to_all == b.all_to_all and len(raw["ul_comm_ms"][2]) == 2 and all(t > 0 for t in raw["ul_comm_ms"][2])
    u0, u1 = raw["ul_comm_ms"][2]
    ub = max((u1 - u0) / (COMM_LENGTHS[1] - COMM_LENGTHS[0]), 0.0)
    assert a.all_to_all.latency_ms == pytest.approx(max((u0 - ub * COMM_LENGTHS[0] + u1 - ub * COMM_LENGTHS[1]) / 2, 0.0))
    if ub > 0:     # a row of 64 fp32 values sends half its bytes
        assert a.all_to_all.intra_node_bytes_per_s == pytest.approx(64 * 4 / 2 / (ub / 1e3))
    assert a.coeffs(Scheme(1, 1, ul=2)) == pytest.approx(ulysses_coeffs(
        a.coeffs(Scheme(1, 1)), Scheme(1, 1, ul=2), hidden=64, heads=4, kv_heads=2, stage_layers=4,
        comm=a.all_to_all, gpus_per_node=8))
    assert set(raw["tp_comm_ms"]) == {2} and len(raw["pp_comm_ms"]) == 2
    # the push: the reduction over both ranks at two sizes, fitted to a latency and a bandwidth
    assert a.push == b.push and len(raw["push_comm_ms"]) == 2 and all(t > 0 for t in raw["push_comm_ms"])
    (s0, s1), (q0, q1) = PUSH_BYTES, raw["push_comm_ms"]
    qb = max((q1 - q0) / (s1 - s0), 0.0)
    assert a.push.latency_ms == pytest.approx(max((q0 - qb * s0 + q1 - qb * s1) / 2, 0.0))
    if qb > 0:
        assert a.push.bandwidth == pytest.approx(1e3 / qb)
    assert all(t > 0 for t in raw["tp_comm_ms"][2] + raw["pp_comm_ms"])
    # each scheme is assembled from the fitted layer, rest and communication lines (exactly)
    layer = {tp: fit_coefficients(list(zip(raw["lengths"], raw["layer_ms"][tp]))) for tp in (1, 2)}
    rest = {tp: fit_coefficients(list(zip(raw["lengths"], raw["rest_ms"][tp]))) for tp in (1, 2)}
    (l0, l1), tp, pp = COMM_LENGTHS, raw["tp_comm_ms"][2], raw["pp_comm_ms"]
    tb = max((tp[1] - tp[0]) / (l1 - l0), 0.0)
    ta = max((tp[0] - tb * l0 + tp[1] - tb * l1) / 2, 0.0)
    pb = max((pp[1] - pp[0]) / (l1 - l0), 0.0)
    pa = max((pp[0] - pb * l0 + pp[1] - pb * l1) / 2, 0.0)
    slots_per_layer = 18 / 4
    assert a.coeffs(Scheme(1, 1)) == pytest.approx([4 * x + y for x, y in zip(layer[1], rest[1])])
    assert a.coeffs(Scheme(2, 1)) == pytest.approx([4 * layer[2][0] + rest[2][0],
                                                    4 * layer[2][1] + rest[2][1] + 4 * slots_per_layer * tb,
                                                    4 * layer[2][2] + rest[2][2] + 4 * slots_per_layer * ta])
    assert a.coeffs(Scheme(1, 2)) == pytest.approx([2 * layer[1][0] + rest[1][0], 2 * layer[1][1] + rest[1][1] + 2 * pb,
                                                    2 * layer[1][2] + rest[1][2] + 2 * pa])


def test_measured_estimates_are_not_gpu_class_figures(measured):
    cost = measured[0]
    prior = model_cost_model("analytic", llama.build("tiny"), 2)
    lengths = [300, 120, 60, 60, 40, 30, 20, 10]
    plan = plan_iteration(lengths, [Strategy.parse("2xTP1PP1")], cost)
    prior_plan = plan_iteration(lengths, [Strategy.parse("2xTP1PP1")], prior)
    # CPU milliseconds, not A800 microseconds: 18-22x the A800 prior on a 2-core machine (idle or not);
    # an order of magnitude tells them apart on a faster CPU too
    assert plan.est_latency_ms > 10 * prior_plan.est_latency_ms


def test_step_correction_is_the_median_ratio_of_recent_steps_and_scales_every_estimate():
    c = StepCorrection(window=3)
    assert c.factor == 1.0
    for est, measured in ((100, 200), (100, 300), (100, 1000), (100, 250)):
        c.observe(est, measured)
    assert c.factor == 3.0            # median of the last three ratios 3, 10, 2.5
    c.observe(0.0, 5.0)
    c.observe(10.0, math.nan)
    assert c.factor == 3.0            # unusable pairs are ignored
    cost = model_cost_model("analytic", llama.build("tiny"), 4)
    plan = plan_iteration([50, 40, 30, 20], [Strategy.parse("2xTP1PP1+1xTP2PP1")], cost)
    scaled = scaled_plan(plan, 2.0)
    assert scaled.est_latency_ms == pytest.approx(2 * plan.est_latency_ms)
    assert [p.est_latency_ms for p in scaled.pipelines] == pytest.approx([2 * p.est_latency_ms for p in plan.pipelines])
    assert [p.microbatches for p in scaled.pipelines] == [p.microbatches for p in plan.pipelines]


class _Recorder(torch.nn.Module):
    """A stand-in model that records every call's length and its parameters' dtype."""

    def __init__(self, layers: int, vocab: int = 16) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, 8)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(layers))
        self.head = torch.nn.Linear(8, vocab)
        self.calls: list[tuple[int, torch.dtype]] = []

    def forward(self, ids):
        self.calls.append((ids.shape[1], self.head.weight.dtype))
        x = self.embed(ids)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def test_measure_times_warm_calls_only_on_the_runs_dtype(monkeypatch):
    """``--profile measure`` never times a first call (a compile, a first launch): every model runs an
    untimed round at each length first; and it times the model in the run's working dtype. The clock
    is a stand-in that reads 1000 ms for a model's first call at a length and ``1 + 2 x layers`` ms
    after it, so a timed first call would show, whatever the machine's load."""
    real, seen = calibration.fwd_bwd_ms, set()

    def clock(model, ids):
        real(model, ids)                                 # the model runs (its calls are recorded)
        first = (id(model), ids.shape[1]) not in seen
        seen.add((id(model), ids.shape[1]))
        return 1000.0 if first else 1.0 + 2.0 * len(model.layers)

    monkeypatch.setattr(calibration, "fwd_bwd_ms", clock)
    built = []

    def build(n, tp):
        built.append(_Recorder(n))
        return built[-1]

    lengths = [8, 16, 32]
    # one timed run per length: a median over several would hide a slow first one
    timed = interleaved_layer_timings(build, [1], lengths, 16, repeats=1, dtype=torch.bfloat16)
    assert timed[1] == ([2.0] * 3, [1.0] * 3)            # a layer 2 ms, the rest 1 ms: no first call timed
    for model in built:
        assert [n for n, _ in model.calls] == [n for n in lengths for _ in range(2)]    # warm-up, timed
        assert {d for _, d in model.calls} == {torch.bfloat16}


def test_a_gpu_is_timed_at_the_lengths_its_micro_batches_have():
    from hgraph.runtime.planner.cost.calibration import DEFAULT_LENGTHS, calibration_lengths
    assert calibration_lengths(torch.device("cpu"), 8192) == DEFAULT_LENGTHS
    assert calibration_lengths(torch.device("cuda", 0), 8192) == (1024, 2048, 4096, 8192)
    assert calibration_lengths("cuda", 1 << 20) == (2048, 4096, 8192, 16384)
    assert len(calibration_lengths("cuda", 16)) >= 3          # calibration needs three lengths
