"""The fx frontend: canonical form of traced models, rewrites, and trace failures."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from hgraph.errors import TraceError
from hgraph.frontends.fx_frontend import trace
from hgraph.frontends.zoo import build


def _call_targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _ids(b=2, t=7, vocab=512):
    return torch.randint(0, vocab, (b, t))


def _positions(b, t):
    return torch.arange(t).expand(b, t)


@pytest.mark.parametrize("name", ["tiny", "tiny-tied"])
def test_llama_canonical_form(name):
    model = build(name)
    gm = trace(model)
    nodes = list(gm.graph.nodes)
    assert [n.target for n in nodes if n.op == "placeholder"] == ["input_ids", "position_ids"]
    assert not [n for n in nodes if n.op == "call_module"]
    params = dict(model.named_parameters())
    attrs = [n for n in nodes if n.op == "get_attr" and n.target in params]
    # every parameter use has its own get_attr, named by the canonical FQN
    assert all(len(n.users) == 1 for n in attrs)
    uses = [n.target for n in attrs]
    assert set(uses) == set(params)
    if model.config.tie_embeddings:
        assert uses.count("embed_tokens.weight") == 2
        assert "lm_head.weight" not in uses
    assert len(uses) == len(params) + (1 if model.config.tie_embeddings else 0)
    linears = [n for n in nodes if n.target is F.linear]
    assert len(linears) == 7 * model.config.num_layers + 1
    assert all(n.args[1].op == "get_attr" for n in linears)
    attention = [n for n in nodes if n.target is F.scaled_dot_product_attention]
    assert len(attention) == model.config.num_layers
    assert all(n.kwargs.get("is_causal") is True for n in attention)
    assert [n.target for n in nodes if n.op == "call_function"].count(F.embedding) == 1
    output = nodes[-1]
    assert output.op == "output" and isinstance(output.args[0], torch.fx.Node)


def test_trace_computes_the_model_and_shares_parameters():
    model = build("tiny-tied")
    gm = trace(model)
    ids = _ids()
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 4, 0, 1]])
    assert torch.equal(gm(ids, pos), model(ids, pos))
    assert torch.equal(gm(ids, _positions(2, 7)), model(ids))
    assert gm.get_parameter("embed_tokens.weight") is model.embed_tokens.weight
    assert gm.get_parameter("layers.1.mlp.up_proj.weight") is model.layers[1].mlp.up_proj.weight


def test_nodes_carry_the_module_stack():
    gm = trace(build("tiny"))
    q = next(n for n in gm.graph.nodes if n.op == "get_attr" and n.target == "layers.2.self_attn.q_proj.weight")
    linear = next(iter(q.users))
    paths = [path for path, _ in linear.meta["nn_module_stack"].values()]
    assert paths[0] == "layers.2" and "layers.2.self_attn.q_proj" in paths


class LeafNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 8, padding_idx=0)
        self.norm = nn.LayerNorm(8)
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 50, bias=False)

    def forward(self, input_ids, position_ids=None):
        return self.head(self.proj(self.norm(self.embed(input_ids))))


def test_leaf_linear_embedding_layernorm_become_functional():
    model = LeafNet()
    gm = trace(model, leaf_modules=(nn.Linear, nn.Embedding, nn.LayerNorm))
    assert not [n for n in gm.graph.nodes if n.op == "call_module"]
    targets = _call_targets(gm)
    assert targets.count(F.linear) == 2 and F.embedding in targets and F.layer_norm in targets
    emb = next(n for n in gm.graph.nodes if n.target is F.embedding)
    assert emb.kwargs["padding_idx"] == 0
    ids = torch.randint(0, 50, (2, 5))
    assert torch.equal(gm(ids, _positions(2, 5)), model(ids))


class Custom(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return x * self.scale


class WithCustom(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.custom = Custom()
        self.act = nn.GELU()

    def forward(self, input_ids):
        return self.act(self.custom(self.embed(input_ids)))


def test_leaf_with_parameters_is_rejected_and_parameter_free_leaf_kept():
    with pytest.raises(TraceError, match=r"leaf module 'custom' \(Custom\) holds parameters"):
        trace(WithCustom(), leaf_modules=(Custom,))
    gm = trace(WithCustom(), leaf_modules=("act",))
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["act"]


class MatmulNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.w1 = nn.Parameter(torch.randn(8, 8))
        self.w2 = nn.Parameter(torch.randn(6, 8))
        self.b2 = nn.Parameter(torch.randn(6))
        self.w3 = nn.Parameter(torch.randn(5, 6))
        self.w4 = nn.Parameter(torch.randn(5, 5))

    def forward(self, input_ids):
        x = self.embed(input_ids)
        x = x @ self.w1.t()
        b, t, d = x.shape
        x = torch.addmm(self.b2, x.reshape(b * t, d), self.w2.transpose(0, 1)).reshape(b, t, -1)
        x = torch.matmul(x, self.w3.T)
        return x @ self.w4  # not transposed: not a linear, stays a matmul


def test_matmuls_with_transposed_parameters_become_linear():
    model = MatmulNet()
    gm = trace(model)
    targets = _call_targets(gm)
    assert targets.count(F.linear) == 3
    addmm_linear = [n for n in gm.graph.nodes if n.target is F.linear and len(n.args) == 3]
    assert len(addmm_linear) == 1 and addmm_linear[0].args[2].target == "b2"
    assert not [n for n in gm.graph.nodes if n.op == "call_method" and n.target in ("t", "transpose")]
    ids = torch.randint(0, 50, (2, 5))
    torch.testing.assert_close(gm(ids, _positions(2, 5)), model(ids), rtol=1e-6, atol=1e-6)


class Branchy(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x
        return -x


class Untraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.layers = nn.ModuleList([Branchy()])

    def forward(self, input_ids, position_ids=None):
        return self.layers[0](self.embed(input_ids))


def test_untraceable_model_names_module_line_and_alternative():
    with pytest.raises(TraceError) as info:
        trace(Untraceable())
    msg = str(info.value)
    assert "\n" not in msg
    assert "module 'layers.0' (Branchy)" in msg
    assert "test_fx_frontend.py:" in msg and "if x.sum() > 0:" in msg
    assert "torch.export" in msg


class NoPositions(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.head = nn.Linear(8, 50)

    def forward(self, tokens, scale: float = 2.0):
        return (self.head(self.embed(tokens)) * scale,)


def test_inputs_are_renamed_completed_and_output_unwrapped():
    model = NoPositions()
    gm = trace(model)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert [n.target for n in placeholders] == ["input_ids", "position_ids"]
    assert not placeholders[1].users
    ids = torch.randint(0, 50, (1, 4))
    assert torch.equal(gm(ids, _positions(1, 4)), model(ids)[0])


class TwoOutputs(NoPositions):
    def forward(self, input_ids):
        h = self.embed(input_ids)
        return self.head(h), h


class NeedsMask(NoPositions):
    def forward(self, input_ids, mask):
        return self.head(self.embed(input_ids)) * mask


def test_bad_signatures_and_outputs():
    with pytest.raises(TraceError, match="single logits tensor"):
        trace(TwoOutputs())
    with pytest.raises(TraceError, match="requires argument 'mask'"):
        trace(NeedsMask())
    with pytest.raises(TraceError, match="nn.Module instances"):
        trace(lambda x: x)
    with pytest.raises(TraceError, match="leaf_modules must be"):
        trace(NoPositions(), leaf_modules=(int,))


class Bidirectional(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.layers = nn.ModuleList([nn.Linear(8, 8)])

    def forward(self, input_ids, position_ids=None):
        x = self.layers[0](self.embed(input_ids)).unsqueeze(1)
        return F.scaled_dot_product_attention(x, x, x).squeeze(1)


def test_non_causal_attention_is_rejected():
    with pytest.raises(TraceError, match="is_causal=False; hgraph trains causal language models"):
        trace(Bidirectional())


class _WithDropouts(nn.Module):
    """A tiny LM with the dropouts people write: nn.Dropout, F.dropout(training=self.training), one
    that never trains, and p = 0."""

    def __init__(self, kind=None):
        super().__init__()
        self.emb = nn.Embedding(32, 8)
        self.drop = nn.Dropout(0.1)
        self.zero = nn.Dropout(0.0)
        self.head = nn.Linear(8, 32)
        self.kind = kind

    def forward(self, input_ids, position_ids=None):
        h = self.zero(self.drop(self.emb(input_ids)))
        h = F.dropout(h, 0.2, training=self.training)
        h = F.dropout(h, 0.3, training=False)
        if self.kind is not None:
            h = self.kind(h, 0.1, training=self.training)
        return self.head(h)


def test_training_dropouts_become_keyed_dropout_in_train_mode_even_after_eval():
    from hgraph import ops
    model = _WithDropouts().eval()           # traced as it trains, whatever mode it is left in
    gm = trace(model)
    kept = [n.args[1] for n in gm.graph.nodes if n.target is ops.keyed_dropout]
    assert kept == [0.1, 0.2]
    assert not any(n.target in (F.dropout, torch.dropout) for n in gm.graph.nodes)
    assert not model.training                # the caller's mode is restored
    ids = _ids(1, 5, 32)
    torch.testing.assert_close(gm(ids, _positions(1, 5)), model(ids))   # identity without a runtime


@pytest.mark.parametrize("kind", [F.dropout1d, F.alpha_dropout])
def test_other_dropout_kinds_that_train_are_refused(kind):
    with pytest.raises(TraceError, match=f"{kind.__name__} .*trains"):
        trace(_WithDropouts(kind))
