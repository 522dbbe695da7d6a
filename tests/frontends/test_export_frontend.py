"""The torch.export frontend: canonical form, frontend choice in hgraph.compile, one-line errors."""
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hgraph
from hgraph import ops
from hgraph.errors import HGraphError, TraceError
from hgraph.frontends.export_frontend import export_trace
from hgraph.frontends.zoo import hf, llama, resolve_model_spec
from hgraph.linear_ops import in_out_linear


class Block(nn.Module):
    def __init__(self, d, heads, causal=True):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.qkv = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(3))
        self.out = nn.Parameter(torch.randn(d, d) / d ** 0.5)   # used as x @ out.t()

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (lin(x).view(b, t, -1, d // self.heads).transpose(1, 2) for lin in self.qkv)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return x + a.transpose(1, 2).reshape(b, t, -1) @ self.out.t()


class ShapeBranching(nn.Module):
    """fx cannot trace ``if`` on a traced size; torch.export can (the size is symbolic)."""

    def __init__(self, vocab=50, d=16, heads=2, layers=2, causal=True):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d, heads, causal) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids, position_ids=None):
        x = self.embed(input_ids)
        if input_ids.shape[1] > 1:
            for layer in self.layers:
                x = layer(x)
        return self.head(x)


class ValueBranching(ShapeBranching):
    """Control flow on tensor values: neither fx nor export can capture it."""

    def forward(self, input_ids, position_ids=None):
        x = self.embed(input_ids)
        if (input_ids > 3).any():
            x = x * 2
        return self.head(x)


def test_auto_falls_back_to_export_and_matches_the_model():
    torch.manual_seed(0)
    model = ShapeBranching()
    compiled = hgraph.compile(model)
    assert compiled.frontend == "export"
    ids = torch.randint(0, 50, (3, 7))
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids), model(ids), rtol=0, atol=1e-6)
    gm = compiled.hgraph.gm
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(F.linear) == 2 * 4 + 1             # matmul with a transposed weight is a linear
    assert targets.count(F.scaled_dot_product_attention) == 2
    assert not any(isinstance(t, torch._ops.OpOverload) and t.overloadpacket in
                   (torch.ops.aten.linear, torch.ops.aten.matmul, torch.ops.aten.scaled_dot_product_attention)
                   for t in targets)
    assert [n.target for n in gm.graph.nodes if n.op == "placeholder"] == ["input_ids", "position_ids"]
    assert compiled.hgraph.params["layers.1.out"].shard_dim == 1     # ROW: x @ out.t() splits out's dim 1


def test_zoo_model_through_either_frontend_is_the_same_computation():
    torch.manual_seed(0)
    model = llama.build("tiny")
    via_fx = hgraph.compile(model)
    via_export = hgraph.compile(model, frontend="export")
    assert (via_fx.frontend, via_export.frontend) == ("fx", "export")
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(via_export(ids), via_fx(ids), rtol=0, atol=1e-6)
    assert set(via_export.hgraph.params) == set(via_fx.hgraph.params)
    for name, info in via_fx.hgraph.params.items():
        other = via_export.hgraph.params[name]
        assert (other.tp_role, other.shard_dim, other.block) == (info.tp_role, info.shard_dim, info.block), name
    assert via_export.hgraph.slot_counts() == via_fx.hgraph.slot_counts()


def test_forcing_fx_on_a_model_it_cannot_trace_names_the_line():
    with pytest.raises(TraceError, match=r"torch.fx cannot trace ShapeBranching .*test_export_frontend.py"):
        hgraph.compile(ShapeBranching(), frontend="fx")


def test_unknown_frontend_is_rejected():
    with pytest.raises(HGraphError, match="unknown frontend 'jit'; allowed: auto, fx, export"):
        hgraph.compile(ShapeBranching(), frontend="jit")


def test_a_model_neither_frontend_handles_gets_one_line_naming_the_construct():
    with pytest.raises(TraceError) as info:
        hgraph.compile(ValueBranching())
    text = str(info.value)
    assert "\n" not in text
    assert text.startswith("neither frontend handles ValueBranching: torch.export cannot export ValueBranching")
    assert "`if (input_ids > 3).any():`" in text and "torch.fx" in text


def test_non_causal_attention_is_rejected():
    with pytest.raises(TraceError, match="not causal"):
        export_trace(ShapeBranching(causal=False))


def test_in_out_linear_is_conv1d():
    x, w, b = torch.randn(2, 3, 4), torch.randn(4, 5), torch.randn(5)
    torch.testing.assert_close(in_out_linear(x, w, b), x @ w + b)


def test_missing_transformers_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(HGraphError, match=r"pip install -e '\.\[hf\]'"):
        hf.build("llama")


def test_unknown_hf_family_and_bad_config():
    pytest.importorskip("transformers")
    with pytest.raises(HGraphError, match="unknown Hugging Face model 'bert'; allowed: hf:llama"):
        resolve_model_spec("hf:bert")
    with pytest.raises(HGraphError, match="hf:llama: config"):
        resolve_model_spec("hf:llama", {"hidden_size": 30, "num_attention_heads": 4, "head_dim": "x"})


def test_sliding_window_attention_keeps_its_window():
    # Mistral's SDPA path passes a banded mask: read from the mask evaluated past the window
    pytest.importorskip("transformers")
    model = resolve_model_spec("hf:mistral", {"sliding_window": 4, "num_hidden_layers": 1})
    (att,) = [n for n in export_trace(model).graph.nodes if n.target is ops.causal_attention]
    assert att.kwargs["window"] == 4 and att.kwargs["softcap"] is None and att.kwargs["enable_gqa"]


def test_hgraph_dump_of_an_hf_model(capsys):
    pytest.importorskip("transformers")
    from hgraph.tools.cli import main
    code = main(["dump", "hf:gpt2", "--model-args", '{"n_embd": 32, "n_head": 4, "vocab_size": 64}',
                 "--strategy", "1xTP2PP1", "--rank", "0"])
    out = capsys.readouterr().out
    assert code in (0, None)
    assert "transformer.h.0.mlp.c_fc.weight" in out and "split on dim 1" in out


class _Config:
    def __init__(self, layers):
        self.num_hidden_layers = layers


class ScaledBlock(Block):
    def __init__(self, d, heads, scale):
        super().__init__(d, heads)
        self.scale = scale

    def forward(self, x):
        return super().forward(x) * self.scale


class DistinctLayers(ShapeBranching):
    """Same layer type, but layer i multiplies by i + 1 (a constant): the layers are not copies."""

    def __init__(self, layers=3):
        super().__init__(layers=layers)
        self.layers = nn.ModuleList(ScaledBlock(16, 2, i + 1.0) for i in range(layers))
        self.config = _Config(layers)


def test_layers_that_are_not_copies_are_exported_whole():
    torch.manual_seed(0)
    model = DistinctLayers()
    gm = export_trace(model)
    assert model.config.num_hidden_layers == 3 and len(model.layers) == 3     # restored after the 2-layer export
    ids = torch.randint(0, 50, (2, 6))
    with torch.no_grad():
        torch.testing.assert_close(gm(ids, torch.arange(6).expand(2, 6)), model(ids), rtol=0, atol=1e-6)
    assert {n.target for n in gm.graph.nodes if n.op == "get_attr"} >= {"layers.2.out", "layers.1.out"}


@pytest.mark.parametrize("spec,args", [("hf:llama", {"num_hidden_layers": 4}), ("hf:gpt2", {"n_layer": 3})])
def test_replicated_layers_equal_the_whole_export(spec, args):
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = resolve_model_spec(spec, dict(args, vocab_size=64))
    fast = hgraph.compile(model)
    whole = export_trace(model, replicate_layers=False)
    assert len(fast.hgraph.gm.graph.nodes) > 0 and fast.hgraph.num_layers == model.config.num_hidden_layers
    from hgraph.graph import HGraph
    from hgraph.passes.annotate import annotate_pass
    from hgraph.passes.insert_slots import insert_slots_pass
    reference = HGraph(insert_slots_pass(annotate_pass(whole)), model)
    assert len(fast.hgraph.gm.graph.nodes) == len(reference.gm.graph.nodes)
    assert fast.hgraph.params == reference.params
    assert fast.hgraph.slot_counts() == reference.slot_counts()
    ids = torch.randint(0, 64, (2, 10))
    with torch.no_grad():
        assert torch.equal(fast(ids), reference(ids))
        assert torch.equal(fast(ids), model(ids, use_cache=False).logits)
