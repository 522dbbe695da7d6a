"""MoE blocks as people write them are recognised by their structure and traced as hgraph's MoE op
(``hgraph.frontends.moe_blocks``): the per-expert loop with a data-dependent skip (the zoo's), routing by
``torch.where`` / ``index_select`` / ``index_add_``, and Hugging Face 5.x's blocks (fused experts, a router
module, Qwen2-MoE's gated shared expert). A block that looks like MoE but is not one gets one line."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from hgraph import moe
from hgraph.errors import TraceError
from hgraph.frontends.fx_frontend import trace
from hgraph.frontends.moe_blocks import swapped_moe_blocks
from hgraph.frontends.tracer import trace_graph
from hgraph.frontends.zoo import llama_moe

H = 16


class Expert(nn.Module):
    def __init__(self, act=F.silu):
        super().__init__()
        self.w1, self.w3 = nn.Linear(H, 8, bias=False), nn.Linear(H, 8, bias=False)
        self.w2 = nn.Linear(8, H, bias=False)
        self.act = act

    def forward(self, x):
        return self.w2(self.act(self.w1(x)) * self.w3(x))    # Mixtral's names: w1 gate, w3 up, w2 down


class WhereRoutedMoE(nn.Module):
    """Routing by torch.where / index_select / index_add_, no skip; renormalised top-3 of 5."""

    def __init__(self, act=F.silu, weighted=True, router="softmax"):
        super().__init__()
        self.router = nn.Linear(H, 5, bias=False)
        self.experts = nn.ModuleList(Expert(act) for _ in range(5))
        self.weighted, self.kind = weighted, router

    def forward(self, hidden):
        x = hidden.view(-1, H)
        logits = self.router(x)
        probs = torch.sigmoid(logits) if self.kind == "sigmoid" else logits.softmax(-1)
        top, idx = probs.topk(3, dim=-1)
        top = top / top.sum(-1, keepdim=True)
        out = x.new_zeros(x.shape)
        for e in range(len(self.experts)):
            rows, slots = torch.where(idx == e)
            y = self.experts[e](x.index_select(0, rows))
            if self.weighted:
                y = y * top[rows, slots].unsqueeze(-1)
            out = out.index_add(0, rows, y)
        return out.view_as(hidden)


class Holder(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.embed = nn.Embedding(32, H)
        self.block = block

    def forward(self, input_ids):
        h = self.embed(input_ids)
        return h + self.block(h)


def _randomised(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return module


def _traced_equals_eager(model):
    ids = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(1))
    gm = trace(model)
    assert sum(n.target is moe.moe_layer for n in gm.graph.nodes) >= 1
    torch.testing.assert_close(gm(ids, torch.arange(9).expand(2, 9)), model(ids), rtol=1e-5, atol=1e-6)
    return gm


def test_the_zoo_block_stops_the_tracer_unless_recognised_and_then_computes_the_same():
    model = llama_moe.build("tiny")
    with pytest.raises(Exception, match="numel"):
        trace_graph(model)                       # the data-dependent skip: torch.fx alone stops there
    gm = _traced_equals_eager(model)
    moe_nodes = [n for n in gm.graph.nodes if n.target is moe.moe_layer]
    assert len(moe_nodes) == 2                   # layer 0 is dense
    assert moe_nodes[0].kwargs == {"top_k": 2, "normalize_top_k": False}
    assert [a.target for a in moe_nodes[0].args[1:3]] == ["layers.1.mlp.gate.weight",
                                                          "layers.1.mlp.experts.0.gate_proj.weight"]
    assert "forward" not in model.layers[1].mlp.__dict__      # the swap is undone after tracing


def test_where_index_select_index_add_routing_is_recognised_with_renormalised_top_k():
    model = _randomised(Holder(WhereRoutedMoE()))
    gm = _traced_equals_eager(model)
    node = next(n for n in gm.graph.nodes if n.target is moe.moe_layer)
    assert node.kwargs == {"top_k": 3, "normalize_top_k": True}
    gate_of_expert_1 = node.args[2 + 1]
    assert gate_of_expert_1.target == "block.experts.1.w1.weight"     # read from which Linear feeds the SiLU


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_hugging_face_blocks_with_fused_experts_and_a_gated_shared_expert(family):
    transformers = pytest.importorskip("transformers")
    if family == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block
        config = transformers.Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=8, num_experts=6,
                                             num_experts_per_tok=2, norm_topk_prob=True)
    else:
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock as Block
        config = transformers.Qwen2MoeConfig(hidden_size=H, moe_intermediate_size=8, num_experts=6,
                                             num_experts_per_tok=3, norm_topk_prob=False,
                                             shared_expert_intermediate_size=12)
    block = _randomised(Block(config))
    with swapped_moe_blocks(Holder(block)) as forms:
        (form,) = forms
    assert form.path == "block" and form.top_k == config.num_experts_per_tok
    assert form.normalize_top_k == config.norm_topk_prob
    assert len(form.experts) == 2 and form.experts[0] is block.experts.gate_up_proj
    assert (form.shared_gate is not None) == (family == "qwen2_moe")
    _traced_equals_eager(Holder(block))


def test_a_block_that_looks_like_moe_but_is_not_gets_one_line():
    def error(block):
        with pytest.raises(TraceError) as info:
            trace(_randomised(Holder(block)))
        assert "\n" not in str(info.value)
        return str(info.value)

    assert error(WhereRoutedMoE(act=F.gelu)) == (
        "module 'block' (WhereRoutedMoE) looks like a mixture of experts (5 experts in 'experts') but expert 0 is "
        "not a SwiGLU MLP (three Linears without bias, down(silu(gate(x)) * up(x))); hgraph's MoE op runs SwiGLU "
        "experts")
    assert "the router's logits do not go to a softmax (a sigmoid router" in error(WhereRoutedMoE(router="sigmoid"))
    assert "does not reproduce its output" in error(WhereRoutedMoE(weighted=False))
