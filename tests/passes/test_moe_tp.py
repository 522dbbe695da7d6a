"""TP shards the routed experts of hgraph's MoE op inside, as a dense SwiGLU MLP (numerics: the MoE
equivalence tests, ``tests/runtime/train/test_moe_train.py``).

The op's role is EXPERTS: per expert gate / up split on their intermediate rows, down on its columns,
the router whole; the op's input enters once with the shared experts' gate / up (one all-gather under
sequence parallelism), and its partial sums, added to the shared experts' before any other use, exit
together (one reduce-scatter, or all-reduce without sequence parallelism, per MoE layer:
``passes/partial_sums``), the router's gradient a partial sum of the TP ranks'.
"""
import importlib.util

import pytest
import torch

import hgraph
from hgraph import moe
from hgraph.frontends.zoo import llama_moe, resolve_model_spec
from hgraph.meta import TPRole, get_meta

COMM = ("sp_scatter_issue", "sp_gather_issue", "tp_reduce_issue")


def _counts(gm):
    names = [getattr(n.target, "__name__", "") for n in gm.graph.nodes if n.op == "call_function"]
    return {k: names.count(k) for k in COMM}


@pytest.fixture(scope="module")
def compiled():
    torch.manual_seed(0)
    return hgraph.compile(llama_moe.build("tiny"))


def test_the_experts_are_split_like_a_dense_mlp_and_the_router_stays_whole(compiled):
    hg = compiled.hgraph
    layers = [n for n in hg.gm.graph.nodes if n.target is moe.moe_layer]
    assert layers and all(get_meta(n).tp_role == TPRole.EXPERTS for n in layers)
    prefix = "layers.1.mlp."
    assert hg.params[prefix + "gate.weight"].tp_role == TPRole.REPLICATED
    assert hg.params[prefix + "gate.weight"].tp_partial          # each TP rank's gradient: its slices' part
    for e in range(8):
        for name, role, dim in (("gate_proj", TPRole.COLUMN, 0), ("up_proj", TPRole.COLUMN, 0),
                                ("down_proj", TPRole.ROW, 1)):
            info = hg.params[f"{prefix}experts.{e}.{name}.weight"]
            assert (info.tp_role, info.shard_dim) == (role, dim)
    report = compiled.sharding_report("1xTP2PP1")
    assert report.warnings() == []           # before: the whole experts left ~55% of the MoE blocks' bytes
    (tp2,) = report.summaries
    assert tp2.fraction_sharded() > 0.95


def _reductions_per_layer(gm):
    """layer -> the TP reductions (reduce-scatters and all-reduces) of that layer in a rank graph."""
    out = {}
    for n in gm.graph.nodes:
        if getattr(n.target, "__name__", "") in ("sp_scatter_issue", "tp_reduce_issue"):
            out[get_meta(n).layer] = out.get(get_meta(n).layer, 0) + 1
    return out


def test_one_gather_and_one_reduce_scatter_per_moe_layer_and_the_ranks_hold_half_an_expert(compiled):
    prog = compiled.instantiate("1xTP2PP1")
    # the embedding, 3 o_proj, the dense layer's down, and per MoE layer the sum of the experts' and the
    # shared expert's partial sums (before: each its own, 9 in all); gathers: 3 q/k/v, the dense gate/up,
    # per MoE layer one for the experts and the shared expert together, the head
    for rank in (0, 1):
        assert _counts(prog.rank(rank).graph_module) == {"sp_scatter_issue": 7, "sp_gather_issue": 7,
                                                         "tp_reduce_issue": 0}
        params = prog.rank(rank).params
        assert params["layers.1.mlp.experts.3.gate_proj.weight"].ranges == ((16 * rank, 16 * (rank + 1)),)
        assert params["layers.1.mlp.experts.3.down_proj.weight"].shard_dim == 1
        assert params["layers.1.mlp.gate.weight"].ranges == ((0, 8),)
    off = hgraph.compile(llama_moe.build("tiny"), sequence_parallel=False).instantiate("1xTP2PP1")
    assert _counts(off.rank(0).graph_module) == {"sp_scatter_issue": 0, "sp_gather_issue": 0,
                                                 "tp_reduce_issue": 7}


@pytest.mark.parametrize("spec", ["llama-moe:tiny", pytest.param("hf:qwen2_moe", marks=pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="needs transformers"))])
def test_the_routed_and_shared_experts_partial_sums_are_reduced_once_per_moe_layer(spec):
    """Per layer: attention's o_proj and the MLP's one reduction (before: the routed experts' and the shared
    expert's each, 3 per MoE layer). Qwen2-MoE's shared expert is scaled by ``sigmoid(gate(x))``, a per-token
    scale every TP rank computes whole from the gathered input: its gate's gradient is then each rank's part.
    (Without sequence parallelism: the totals above, and ``test_programs_multirank``'s Qwen2-MoE case.)"""
    torch.manual_seed(0)
    compiled = hgraph.compile(resolve_model_spec(spec))
    gm = compiled.instantiate("1xTP2PP1").rank(1).graph_module
    moe_layers = {get_meta(n).layer for n in gm.graph.nodes if n.target is moe.moe_layer}
    per_layer = _reductions_per_layer(gm)
    assert moe_layers and all(per_layer[layer] == 2 for layer in moe_layers), per_layer
    gates = [name for name in compiled.hgraph.params if name.endswith("shared_expert_gate.weight")]
    assert all(compiled.hgraph.params[name].tp_partial for name in gates)
    assert bool(gates) == (spec == "hf:qwen2_moe")


def test_stacked_and_fused_experts_split_on_their_intermediate_dim():
    from hgraph.passes.tp_roles import expert_param_roles
    import torch.fx as fx

    class Experts(torch.nn.Module):
        def __init__(self, fused):
            super().__init__()
            self.router = torch.nn.Parameter(torch.zeros(4, 8))
            if fused:
                self.gate_up = torch.nn.Parameter(torch.zeros(4, 12, 8))
            else:
                self.gate, self.up = (torch.nn.Parameter(torch.zeros(4, 6, 8)) for _ in range(2))
            self.down = torch.nn.Parameter(torch.zeros(4, 8, 6))
            self.fused = fused

        def forward(self, x):
            weights = (self.gate_up,) if self.fused else (self.gate, self.up)
            return moe.moe_layer(x, self.router, *weights, self.down, top_k=2)

    for fused, columns in ((False, ["gate", "up"]), (True, ["gate_up"])):
        gm = fx.symbolic_trace(Experts(fused))
        node = next(n for n in gm.graph.nodes if n.target is moe.moe_layer)
        params = {name for name, _ in gm.named_parameters()}
        got = expert_param_roles(node, params, gm)
        assert got == [("router", TPRole.REPLICATED, 0)] + [(c, TPRole.COLUMN, 1) for c in columns] + \
            [("down", TPRole.ROW, 2)]
