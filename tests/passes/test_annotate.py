"""annotate_pass: blocks, layers, op kinds and TP roles decided from the graph."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from hgraph.errors import TraceError
from hgraph.frontends.fx_frontend import trace
from hgraph.frontends.zoo import build
from hgraph.meta import OpKind, TPRole, get_meta
from hgraph.passes.annotate import annotate_pass
from hgraph.passes.blocks import find_blocks


def annotated(model, **kw):
    return annotate_pass(trace(model, **kw), None)


def op_roles(gm):
    """parameter FQN -> (op kind, op role, op shard_dim) for each op reading a parameter (first use)."""
    out = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr" and get_meta(n).param is not None:
            op = next(iter(n.users))
            m = get_meta(op)
            out.setdefault(get_meta(n).param, (m.op, m.tp_role, get_meta(n).shard_dim, get_meta(n).tp_role))
    return out


LLAMA_ROLES = {
    "self_attn.q_proj.weight": (OpKind.LINEAR, TPRole.COLUMN, 0),
    "self_attn.k_proj.weight": (OpKind.LINEAR, TPRole.COLUMN, 0),
    "self_attn.v_proj.weight": (OpKind.LINEAR, TPRole.COLUMN, 0),
    "self_attn.o_proj.weight": (OpKind.LINEAR, TPRole.ROW, 1),
    "mlp.gate_proj.weight": (OpKind.LINEAR, TPRole.COLUMN, 0),
    "mlp.up_proj.weight": (OpKind.LINEAR, TPRole.COLUMN, 0),
    "mlp.down_proj.weight": (OpKind.LINEAR, TPRole.ROW, 1),
    "input_layernorm.weight": (OpKind.OTHER, TPRole.REPLICATED, 0),
    "post_attention_layernorm.weight": (OpKind.OTHER, TPRole.REPLICATED, 0),
}


@pytest.mark.parametrize("name", ["tiny", "tiny-tied"])
def test_llama_tp_roles(name):
    model = build(name)
    roles = op_roles(annotated(model))
    for i in range(model.config.num_layers):
        for suffix, (kind, role, dim) in LLAMA_ROLES.items():
            assert roles[f"layers.{i}.{suffix}"][:3] == (kind, role, dim), suffix
    assert roles["embed_tokens.weight"][:3] == (OpKind.EMBEDDING, TPRole.VOCAB, 0)
    assert roles["norm.weight"][:3] == (OpKind.OTHER, TPRole.REPLICATED, 0)
    head = [n for n in annotated(model).graph.nodes if get_meta(n).op == OpKind.LINEAR and get_meta(n).block == "post"]
    assert len(head) == 1 and get_meta(head[0]).tp_role == TPRole.COLUMN
    expected_head = "embed_tokens.weight" if model.config.tie_embeddings else "lm_head.weight"
    assert get_meta(head[0]).param == expected_head


def test_llama_blocks_and_layers():
    gm = annotated(build("tiny"))
    assert find_blocks(gm) == [f"layers.{i}" for i in range(4)]
    for n in gm.graph.nodes:
        m = get_meta(n)
        if m.block is not None and m.block.startswith("layers."):
            assert m.layer == int(m.block.split(".")[1])
        stack = [p for p, _ in (n.meta.get("nn_module_stack") or {}).values()]
        if m.block is not None and stack and stack[0].startswith("layers."):
            assert m.block == stack[0]
    by_name = {n.name: get_meta(n) for n in gm.graph.nodes}
    assert by_name["embedding"].block == "pre" and by_name["embedding"].op == OpKind.EMBEDDING
    assert by_name["cos"].block is None and by_name["sin"].block is None  # rotary: positions only
    assert [get_meta(n).op for n in gm.graph.nodes].count(OpKind.ATTENTION) == 4
    attn = [n for n in gm.graph.nodes if get_meta(n).op == OpKind.ATTENTION]
    assert [get_meta(n).block for n in attn] == [f"layers.{i}" for i in range(4)]
    out = next(n for n in gm.graph.nodes if n.op == "output")
    assert get_meta(out.args[0]).block == "post"
    # nodes with no block depend on nothing that has one (every stage may recompute them)
    for n in gm.graph.nodes:
        if get_meta(n).block is None and n.op != "output":
            assert all(get_meta(a).block is None for a in n.all_input_nodes)


class GPTBlock(nn.Module):
    def __init__(self, d, heads, fused=False, fixed_heads=False):
        super().__init__()
        self.heads, self.fused, self.fixed_heads = heads, fused, fixed_heads
        self.ln_1 = nn.LayerNorm(d)
        if fused:
            self.c_attn = nn.Linear(d, 3 * d)
        else:
            self.q = nn.Linear(d, d)
            self.k = nn.Linear(d, d)
            self.v = nn.Linear(d, d)
        self.c_proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.c_fc = nn.Linear(d, 4 * d)
        self.mlp_proj = nn.Linear(4 * d, d)
        self.dropout = nn.Dropout(0.0)

    def forward(self, x):
        b, t, d = x.shape
        h = self.ln_1(x)
        if self.fused:
            q, k, v = self.c_attn(h).split(d, dim=-1)
        else:
            q, k, v = self.q(h), self.k(h), self.v(h)
        n = self.heads if self.fixed_heads else -1
        q, k, v = (z.view(b, t, n, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.dropout(self.c_proj(a.transpose(1, 2).reshape(b, t, -1)))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, vocab=97, d=32, heads=4, layers=2, **block):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(64, d)
        self.h = nn.Sequential(*[GPTBlock(d, heads, **block) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, input_ids, position_ids=None):
        x = self.wte(input_ids) + self.wpe(position_ids)
        return self.head(self.ln_f(self.h(x)))


def test_gpt_style_model_with_biases_and_layernorm():
    gm = annotated(GPT())
    assert find_blocks(gm) == ["h.0", "h.1"]
    roles = {name: r[1:] for name, r in op_roles(gm).items()}  # (op role, param shard_dim, param role)
    for i in range(2):
        p = f"h.{i}."
        for lin in ("q", "k", "v", "c_fc"):
            assert roles[p + lin + ".weight"] == (TPRole.COLUMN, 0, TPRole.COLUMN)
            assert roles[p + lin + ".bias"] == (TPRole.COLUMN, 0, TPRole.COLUMN)
        for lin in ("c_proj", "mlp_proj"):
            assert roles[p + lin + ".weight"] == (TPRole.ROW, 1, TPRole.ROW)
            assert roles[p + lin + ".bias"] == (TPRole.ROW, 0, TPRole.REPLICATED)  # added after the all-reduce
        for ln in ("ln_1", "ln_2"):
            assert roles[p + ln + ".weight"] == (TPRole.REPLICATED, 0, TPRole.REPLICATED)
            assert roles[p + ln + ".bias"] == (TPRole.REPLICATED, 0, TPRole.REPLICATED)
    assert roles["wte.weight"] == (TPRole.VOCAB, 0, TPRole.VOCAB)
    assert roles["wpe.weight"] == (TPRole.VOCAB, 0, TPRole.VOCAB)
    assert roles["head.weight"] == (TPRole.COLUMN, 0, TPRole.COLUMN)
    assert roles["ln_f.weight"][0] == TPRole.REPLICATED
    blocks = {n.name: get_meta(n).block for n in gm.graph.nodes}
    assert blocks["add"] == "pre"   # token + position embeddings


def test_unsafe_column_groups_are_replicated_not_sharded():
    # fused qkv split by a size read at run time (x.shape): the parts are unknown, attention is
    # replicated, the MLP pair (a separate group) stays column / row.
    roles = {name: r[1] for name, r in op_roles(annotated(GPT(fused=True))).items()}
    for name in ("h.0.c_attn.weight", "h.0.c_proj.weight"):
        assert roles[name] == TPRole.REPLICATED, name
    assert roles["h.0.c_fc.weight"] == TPRole.COLUMN
    assert roles["h.0.mlp_proj.weight"] == TPRole.ROW


def test_a_head_count_written_out_is_rewritten_for_the_shard():
    # view(b, t, heads, d // heads) with d read from the whole input: the head count is TP's to scale
    gm = annotated(GPT(fixed_heads=True))
    roles = {name: r[1] for name, r in op_roles(gm).items()}
    for name in ("h.0.q.weight", "h.0.k.weight", "h.0.v.weight"):
        assert roles[name] == TPRole.COLUMN, name
    assert roles["h.0.c_proj.weight"] == TPRole.ROW
    views = [n for n in gm.graph.nodes if n.target == "view" and get_meta(n).block == "h.0"]
    assert [get_meta(v).tp_rewrite for v in views] == [(2, f"h.0.{p}.weight") for p in "qkv"]


class LeakyBlock(nn.Module):
    """A column linear whose output leaves the block without a row linear."""

    def __init__(self, d):
        super().__init__()
        self.up = nn.Linear(d, d)
        self.a = nn.Linear(d, 2 * d)
        self.b = nn.Linear(2 * d, d)

    def forward(self, x):
        return self.up(x) + self.b(torch.relu(self.a(x))) * 0 + self.up(x) * 0


class MixBlock(nn.Module):
    """A column output combined with the whole residual (wrong shapes under TP)."""

    def __init__(self, d):
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)

    def forward(self, x):
        return self.b(self.a(x) + x)


class Stack(nn.Module):
    def __init__(self, block, d=8, vocab=20):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([block(d), block(d)])
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids, position_ids=None):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_column_outputs_that_escape_or_mix_are_replicated():
    roles = {name: r[1] for name, r in op_roles(annotated(Stack(LeakyBlock))).items()}
    assert roles["layers.0.up.weight"] == TPRole.REPLICATED
    assert roles["layers.0.a.weight"] == TPRole.COLUMN and roles["layers.0.b.weight"] == TPRole.ROW
    roles = {name: r[1] for name, r in op_roles(annotated(Stack(MixBlock))).items()}
    assert roles["layers.1.a.weight"] == TPRole.REPLICATED and roles["layers.1.b.weight"] == TPRole.REPLICATED
    assert roles["head.weight"] == TPRole.COLUMN and roles["head.bias"] == TPRole.COLUMN


class SharedBlock(nn.Module):
    def __init__(self, d, shared):
        super().__init__()
        self.a = nn.Linear(d, d, bias=False)
        self.b = nn.Linear(d, d, bias=False)
        self.shared = shared

    def forward(self, x):
        return x + self.b(self.a(x)) * self.shared.weight.sum()


def test_parameter_with_conflicting_uses_is_replicated():
    class Model(Stack):
        def __init__(self):
            super().__init__(lambda d: nn.Identity())
            d = 8
            # layers.0.a's weight is also read elementwise by layers.1: it cannot be split
            first = SharedBlock(d, nn.Linear(1, 1))
            first.shared = first.a
            self.layers = nn.ModuleList([first, SharedBlock(d, first.a)])

    roles = op_roles(annotated(Model()))
    assert roles["layers.0.a.weight"][1] == TPRole.REPLICATED
    assert roles["layers.0.b.weight"][1] == TPRole.REPLICATED  # its partner follows
    assert roles["layers.1.a.weight"][1] == TPRole.COLUMN and roles["layers.1.b.weight"][1] == TPRole.ROW


class NoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10)

    def forward(self, input_ids, position_ids=None):
        return self.head(self.embed(input_ids))


def test_model_without_repeated_blocks_is_rejected():
    with pytest.raises(TraceError, match="no repeated blocks"):
        annotated(NoBlocks())


class Expert(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.w = nn.Linear(d, d)

    def forward(self, x):
        return self.w(x)


class MoEBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.experts = nn.ModuleList([Expert(d) for _ in range(4)])

    def forward(self, x):
        return x + sum(e(x) for e in self.experts)


def test_outermost_repeated_container_wins_over_larger_nested_one():
    gm = annotated(Stack(MoEBlock))
    assert find_blocks(gm) == ["layers.0", "layers.1"]


class ScaledMLP(nn.Module):
    """A learned per-channel scale on the column output: split like it, [4d/TP] per rank."""

    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, 4 * d)
        self.gamma = nn.Parameter(torch.ones(4 * d))
        self.proj = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.proj(torch.relu(self.fc(x)) * self.gamma)


class HeadsLast(nn.Module):
    """Heads split with a constant head count and -1 for the head dim: wrong on a TP shard."""

    def __init__(self, d, heads=2):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (m(x).view(b, t, self.heads, -1).transpose(1, 2) for m in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(a.transpose(1, 2).reshape(b, t, -1))


def test_a_per_channel_scale_of_a_column_output_is_split_like_it():
    roles = {name: r[1:] for name, r in op_roles(annotated(Stack(ScaledMLP))).items()}
    assert roles["layers.0.fc.weight"] == (TPRole.COLUMN, 0, TPRole.COLUMN)
    assert roles["layers.0.proj.weight"] == (TPRole.ROW, 1, TPRole.ROW)
    assert roles["layers.0.gamma"] == (TPRole.COLUMN, 0, TPRole.COLUMN)


def test_fixed_head_counts_with_a_free_head_dim_are_replicated():
    roles = {name: r[1] for name, r in op_roles(annotated(Stack(HeadsLast))).items()}
    assert {roles[f"layers.1.{m}.weight"] for m in "qkvo"} == {TPRole.REPLICATED}


class FlatMLP(nn.Module):
    """Tokens flattened with the (local) width read from the sharded tensor: still a column/row pair."""

    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(3 * d, d)

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        flat = h.reshape(-1, h.size(-1))
        return x + self.proj(flat).view(x.shape)


def test_flattening_with_the_local_width_keeps_the_pair():
    roles = {name: r[1] for name, r in op_roles(annotated(Stack(FlatMLP))).items()}
    assert roles["layers.0.fc.weight"] == TPRole.COLUMN and roles["layers.0.proj.weight"] == TPRole.ROW


class FullWidthNormBlock(nn.Module):
    """Attention whose queries and keys are RMS-normalised over all heads (OLMo-2's QK norm): the
    norm reduces the whole width of a projection TP shards."""

    def __init__(self, d=16, heads=4):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.q_norm, self.k_norm = nn.Parameter(torch.rand(d) + 0.5), nn.Parameter(torch.rand(d) + 0.5)

    @staticmethod
    def _rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    def forward(self, x):
        b, t, d = x.shape
        q, k = self._rms(self.q(x), self.q_norm), self._rms(self.k(x), self.k_norm)
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2) for y in (q, k, self.v(x)))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(y.transpose(1, 2).reshape(b, t, d))


class FullWidthNormModel(nn.Module):
    def __init__(self, d=16, vocab=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(FullWidthNormBlock(d) for _ in range(2))
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, input_ids, position_ids=None):
        x = self.emb(input_ids)
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


def test_a_norm_over_the_full_sharded_width_all_reduces_its_partial_sums():
    import hgraph
    from hgraph import ops
    from hgraph.passes.tp_roles import PARTIAL_SUM

    torch.manual_seed(0)
    model = FullWidthNormModel()
    gm = annotated(model)
    roles = {name: r[1:] for name, r in op_roles(gm).items()}  # (op role, param shard_dim, param role)
    for lin in ("q", "k", "v"):
        assert roles[f"blocks.0.{lin}.weight"] == (TPRole.COLUMN, 0, TPRole.COLUMN)
    assert roles["blocks.0.o.weight"] == (TPRole.ROW, 1, TPRole.ROW)
    assert roles["blocks.0.q_norm"][1:] == (0, TPRole.COLUMN)      # split like the projection
    means = [n for n in gm.graph.nodes if n.target == "mean"]
    assert len(means) == 4 and all(get_meta(n).tp_rewrite == (PARTIAL_SUM, f"blocks.{i // 2}.{'qk'[i % 2]}.weight")
                                   for i, n in enumerate(means))
    # under TP2: each rank's mean is weighted by its half of the width, then all-reduced (forward) with
    # its gradient all-reduced too (tp_copy); under TP1 nothing changes
    compiled = hgraph.compile(model)
    g = compiled.instantiate("1xTP2PP1").rank(0).graph_module.graph
    mean = next(n for n in g.nodes if n.target == "mean")
    (share,) = mean.users
    assert share.args == (mean, 0.5)
    (reduce_issue,) = share.users
    assert reduce_issue.target is ops.tp_reduce_issue
    (wait,) = reduce_issue.users
    assert [u.target for u in wait.users] == [ops.tp_copy]
    g1 = compiled.instantiate("1xTP1PP1").rank(0).graph_module.graph
    assert not any(n.target in (ops.tp_reduce_issue, ops.tp_copy) for n in g1.nodes)
