"""The expert-parallel pass (``passes/moe_ep``): under ``EP<n>`` each MoE op of ``llama-moe:tiny`` becomes
its EP form, the count exchange and dispatch all-to-all one Communicate Activation subgraph and the combine
all-to-all another, over the EP binding, with the rank's own experts only; nothing changes at EP1. (The
EP form's numbers: ``tests/runtime/comm/test_expert_exchange.py``, which also runs this pass's graphs.)
"""
import pytest
import torch

import hgraph
from hgraph import moe, moe_dispatch, ops
from hgraph.dims import BindingKey
from hgraph.frontends.zoo import llama_moe
from hgraph.meta import CommPoint, SlotKind, TPRole, get_meta
from hgraph.passes import instantiate

MOE_LAYERS = (1, 2)         # tiny: 3 layers, the first dense
EXPERTS = 8


@pytest.fixture(scope="module")
def compiled():
    torch.manual_seed(0)
    return hgraph.compile(llama_moe.build("tiny"))


@pytest.fixture(scope="module")
def ep_programs(compiled):
    return {s: compiled.instantiate(s) for s in ("1xTP1PP1EP2", "1xTP2PP1EP2")}


def _calls(gm, fn):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is fn]


def _expert_params(gm):
    return {n.target for n in gm.graph.nodes if n.op == "get_attr" and ".experts." in n.target}


def test_one_dispatch_and_one_combine_per_moe_layer_over_the_ep_binding(compiled, ep_programs):
    hgraph_gm = compiled.hgraph.gm
    for strategy, prog in ep_programs.items():
        for rank in range(prog.strategy.num_ranks):
            rp = prog.rank(rank)
            gm = rp.graph_module
            assert not _calls(gm, moe.moe_layer), strategy
            ep = rp.doc_rank
            assert len(rp.bindings[BindingKey.EP]) == 2 and rank in rp.bindings[BindingKey.EP]
            for fn, point in ((ops.moe_split_exchange, CommPoint.EP_DISPATCH),
                              (ops.moe_dispatch_issue, CommPoint.EP_DISPATCH),
                              (ops.moe_combine_issue, CommPoint.EP_COMBINE)):
                nodes = _calls(gm, fn)
                assert sorted(get_meta(n).layer for n in nodes) == list(MOE_LAYERS), (strategy, rank, fn)
                for n in nodes:
                    m = get_meta(n)
                    assert (m.slot, m.comm_point) == (SlotKind.COMM_ACTIVATION, point)
                    assert n.args[-1] is BindingKey.EP
            # each exchange waited in its own subgraph, the routing and the weighted sum outside them
            for layer in MOE_LAYERS:
                tags = {get_meta(n).subgraph for n in gm.graph.nodes
                        if get_meta(n).layer == layer and get_meta(n).comm_point in (CommPoint.EP_DISPATCH,
                                                                                     CommPoint.EP_COMBINE)}
                assert len(tags) == 2
            assert all(get_meta(n).slot is None for fn in (moe_dispatch.route_tokens, moe_dispatch.local_experts,
                                                           moe_dispatch.combine_tokens) for n in _calls(gm, fn))
            # the op's output keeps the model's node name and the op's meta (its TP role)
            outputs = _calls(gm, moe_dispatch.combine_tokens)
            assert sorted(n.name for n in outputs) == sorted(n.name for n in _calls(hgraph_gm, moe.moe_layer)
                                                             if get_meta(n).layer in MOE_LAYERS)
            assert all(get_meta(n).tp_role == TPRole.EXPERTS for n in outputs)
            # the rank's own experts, and no slot of another EP rank's
            mine = {f"layers.{layer}.mlp.experts.{e}.{w}_proj.weight" for layer in MOE_LAYERS
                    for e in range(4 * ep, 4 * ep + 4) for w in ("gate", "up", "down")}
            assert _expert_params(gm) == mine
            info = [sg for sg in rp.subgraphs if sg.comm_point in ("ep_dispatch", "ep_combine")]
            assert len(info) == 2 * len(MOE_LAYERS)
            assert all(sg.peers == tuple(r for r in rp.bindings[BindingKey.EP] if r != rank) for sg in info)


def test_the_text_dump_shows_the_exchanges(compiled):
    text = compiled.dump("1xTP2PP1EP2", rank=3)
    assert "ep=[1, 3]" in text
    for line in ("[comm_activation] expert_counts_moe_layer = call_function:moe_split_exchange(route_moe_layer, 'ep')",
                 "[comm_activation] dispatch_moe_layer = call_function:moe_dispatch_issue(",
                 "[comm_activation] combine_moe_layer = call_function:moe_combine_issue(local_experts_moe_layer"):
        assert line in text, line
    python = compiled.dump("1xTP2PP1EP2", rank=3, format="python")
    assert python.count("# ---- comm_activation: ep_dispatch") == len(MOE_LAYERS)
    assert python.count("# ---- comm_activation: ep_combine") == len(MOE_LAYERS)


def test_nothing_changes_without_expert_parallelism():
    torch.manual_seed(0)
    model = llama_moe.build("tiny")
    on, off = hgraph.compile(model), hgraph.compile(model, disable_passes=("moe_ep",))
    for strategy in ("1xTP1PP1", "1xTP2PP2"):
        a, b = on.instantiate(strategy), off.instantiate(strategy)
        for rank in range(a.strategy.num_ranks):
            assert a.rank(rank).graph_module.code == b.rank(rank).graph_module.code


def test_a_role_holding_only_its_own_experts_builds_under_tp(ep_programs):
    """EP's pull gives a rank its EP rank's experts only; the pass runs before TP sharding, which reads
    the shard of every parameter the graph still names."""
    prog = ep_programs["1xTP2PP1EP2"]
    plan = prog.planner
    rp = prog.rank(3)                                  # EP rank 1, TP rank 1: experts 4..7
    mine = [f".experts.{e}." for e in range(4, 8)]
    params = plan.layouts.params(rp.scheme, rp.stage, rp.tp_rank, rp.doc_rank)     # its own experts only
    assert all(any(m in name for m in mine) for name in params if ".experts." in name)
    gm, _ = instantiate.build_role_module(plan.hg, rp.role.role, plan.layouts.stage_blocks(rp.scheme.pp),
                                          plan.shapes, plan.options, params, plan.sp)
    assert _expert_params(gm) == _expert_params(rp.graph_module)
    assert all(any(m in name for m in mine) for name in _expert_params(gm))
