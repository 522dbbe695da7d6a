"""The MoE terms of the cost model (``planner/cost/moe_cost``) against hand arithmetic, and the way each
moves an estimate: more EP holds less expert memory and sends more, a node crossed is slower, an
uneven router is slower."""
import math

import numpy as np
import pytest

from hgraph.errors import HGraphError
from hgraph.runtime.data.document_split import split_documents
from hgraph.frontends.zoo import llama_moe
from hgraph.runtime.planner.cost import moe_cost
from hgraph.runtime.planner.cost.moe_cost import EpTerms, ExpertShape, expert_shape_of
from hgraph.runtime.planner.cost.ulysses import AllToAll

DS16 = ExpertShape(num_experts=64, top_k=6, expert_ffn=1408, shared_experts=2, dense_layers=1, dense_ffn=10944)
COMM = AllToAll(0.03, 150e9, 10e9, 2)


def test_the_shape_is_read_from_the_model_config_not_from_a_name():
    assert expert_shape_of(llama_moe.CONFIGS["16b"]) == DS16
    tiny = expert_shape_of(llama_moe.CONFIGS["tiny"])
    assert (tiny.num_experts, tiny.top_k, tiny.expert_ffn, tiny.shared_experts, tiny.dense_layers) == (8, 2, 32, 1, 1)
    renamed = llama_moe.LlamaMoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_heads=4, num_experts=12,
                                       top_k=3, moe_intermediate_size=40, num_layers=4)
    assert expert_shape_of(renamed).num_experts == 12 and expert_shape_of(renamed).top_k == 3
    from hgraph.frontends.zoo.llama import CONFIGS
    assert expert_shape_of(CONFIGS["tiny"]) is None             # a dense model has no experts
    assert ExpertShape.from_dict(DS16.to_dict(), "p") == DS16
    with pytest.raises(HGraphError, match="top_k 9 exceeds num_experts 8"):
        ExpertShape(8, 9, 16)
    with pytest.raises(HGraphError, match="imbalance must be >= 1"):
        ExpertShape(8, 2, 16, imbalance=0.5)
    assert DS16.ep_degrees(16) == [2, 4, 8, 16] and DS16.moe_layers(28) == 27


def test_expert_flops_are_k_routed_copies_plus_shared_and_router():
    assert moe_cost.routed_flops_per_token(2048, DS16) == 2 * 3 * 2048 * 1408 * 6 == 103_809_024
    assert moe_cost.moe_mlp_flops_per_token(2048, DS16) == 2 * 2048 * 64 + 103_809_024 + 2 * 3 * 2048 * 1408 * 2
    # the routed share of a 28-layer stage's per-token FLOPs: 27 MoE layers' routed FLOPs over all
    proj = 2 * 2048 * 4 * 2048
    total = 28 * proj + 27 * moe_cost.moe_mlp_flops_per_token(2048, DS16) + 1 * 2 * 3 * 2048 * 10944
    assert moe_cost.routed_share(2048, 28, DS16) == pytest.approx(27 * 103_809_024 / total)


def test_all_to_all_volume_is_hidden_bytes_k_tokens_times_the_share_that_leaves():
    # 4 exchanges (dispatch, combine; forward, backward) x H x 2 bytes x k x (n-1)/n per token
    assert moe_cost.all_to_all_bytes_per_token(2048, DS16, tp=1, seq=1, ep=8, bytes_per_element=2) == \
        4 * 2048 * 2 * 6 * 7 / 8 == 86016
    # a TP rank sends its sequence-parallel slice, a CP x UL rank its tokens' share
    assert moe_cost.all_to_all_bytes_per_token(2048, DS16, tp=2, seq=4, ep=8, bytes_per_element=2) == 86016 / 8
    assert moe_cost.all_to_all_bytes_per_token(2048, DS16, tp=1, seq=1, ep=1, bytes_per_element=2) == 0.0


def test_routing_imbalance_is_the_expected_max_of_random_loads_or_the_measured_factor():
    mean = 1000 * 6 / 8
    var = 1000 * 6 * (1 / 8) * (7 / 8) * (58 / 63)
    assert moe_cost.routing_imbalance(1000, DS16, 8) == pytest.approx(1 + math.sqrt(var) * math.sqrt(2 * math.log(8)) / mean)
    assert moe_cost.routing_imbalance(1000, DS16, 8) == pytest.approx(1.0668, abs=1e-4)
    # more tokens even out, one rank has nothing to balance, a measured factor replaces the default
    assert moe_cost.routing_imbalance(100_000, DS16, 8) < moe_cost.routing_imbalance(1000, DS16, 8)
    assert moe_cost.routing_imbalance(1000, DS16, 1) == 1.0
    assert moe_cost.routing_imbalance(1000, ExpertShape(8, 8, 16), 4) == 1.0     # every expert is chosen
    assert moe_cost.routing_imbalance(1000, ExpertShape(64, 6, 1408, imbalance=1.3), 8) == 1.3


def test_expert_memory_per_ep_rank_is_its_share_of_the_experts():
    per_layer = 3 * 2048 * 1408 * 64
    assert moe_cost.expert_params_per_layer(2048, DS16) == per_layer
    assert moe_cost.expert_state_bytes(2048, DS16, stage_moe_layers=27, tp=1, ep=8, bytes_per_param=4) == \
        27 * per_layer / 8 * 4
    more = [moe_cost.expert_state_bytes(2048, DS16, stage_moe_layers=27, tp=2, ep=n, bytes_per_param=4)
            for n in (1, 2, 4, 8, 16)]
    assert more == sorted(more, reverse=True) and more[0] == 16 * more[-1]
    # the routed copies' activations: k x (H + 4F) plus the shared experts, the router's input and output
    assert moe_cost.moe_activation_bytes_per_token(2048, DS16) == \
        (6 * (2048 + 4 * 1408) + (2048 + 4 * 1408 * 2) + 2048 + 64) * 2


def test_ep_terms_split_b_into_routed_and_rest_and_price_the_all_to_all_by_where_the_group_sits():
    base = (1e-6, 0.5, 3.0)
    share = moe_cost.routed_share(2048, 28, DS16)
    t = moe_cost.ep_terms(base, hidden=2048, layers=28, shape=DS16, pp=2, tp=1, seq=1, ep=8, intra_node=True, comm=COMM)
    assert t.routed_b == pytest.approx(0.5 * share) and t.rest_b + t.routed_b == pytest.approx(0.5)
    assert t.comm_b == pytest.approx(14 * 86016 / 150e9 * 1e3)                    # ceil(27 / 2) MoE layers
    assert t.c == pytest.approx(3.0 + 14 * 4 * 0.03)
    across = moe_cost.ep_terms(base, hidden=2048, layers=28, shape=DS16, pp=2, tp=1, seq=1, ep=8, intra_node=False,
                               comm=COMM)
    assert across.comm_b == pytest.approx(t.comm_b * 15)                          # 150 GB/s -> 10 GB/s
    sends = [moe_cost.ep_terms(base, hidden=2048, layers=28, shape=DS16, pp=1, tp=1, seq=1, ep=n, intra_node=True,
                               comm=COMM).comm_b for n in (1, 2, 4, 8)]
    assert sends[0] == 0.0 and sends == sorted(sends)                            # more EP, more leaves the rank


def test_an_ep_microbatch_costs_its_slowest_replica_plus_the_busiest_ranks_experts():
    terms = EpTerms(ep=2, a=1e-6, rest_b=0.01, routed_b=0.02, comm_b=0.005, c=1.0)
    shape = ExpertShape(8, 2, 16, imbalance=1.25)

    def split(lengths, n):
        assert (lengths, n) == ([100, 60, 50], 2)
        return ((0,), (1, 2))
    slowest = max(1e-6 * 100 ** 2 + 0.015 * 100, 1e-6 * (60 ** 2 + 50 ** 2) + 0.015 * 110)
    assert moe_cost.ep_microbatch_ms(np.array([100, 60, 50]), terms, shape, split) == \
        pytest.approx(slowest + 1.25 * 0.02 * 210 / 2 + 1.0)
    # the even split is a lower bound of every split and imbalance (what dispatch and bounds read)
    a, b, c = terms.surrogate
    lengths = np.array([900, 30, 20, 10])
    even = float(np.sum(a * lengths ** 2.0 + b * lengths)) + c
    assert even <= moe_cost.ep_microbatch_ms(lengths, terms, ExpertShape(8, 2, 16), split_documents)
