"""Attention written by hand becomes packed causal attention, or is refused in one line.

Without the rewrite, a packed row would let each document attend to the ones before it (the
softmax runs over the whole row). Each model here computes ``softmax(q @ k^T * scale + mask) @ v``
in another common way, some with a sliding window or logit softcapping; the compiled graph must
hold causal attention nodes only (SDPA, or hgraph's causal attention op with the window / softcap),
and its single-rank program must compute packed documents exactly as each document alone.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hgraph
from hgraph import ops
from hgraph.errors import TraceError
from hgraph.meta import OpKind, get_meta

D, H, KV, V, T = 32, 4, 2, 64, 16


class Block(nn.Module):
    """A residual attention block whose attention is written out; ``style`` picks how."""

    def __init__(self, style, window, softcap, p, late_scale=1.0):
        super().__init__()
        self.style, self.window, self.softcap, self.p, self.late_scale = style, window, softcap, p, late_scale
        self.q, self.k, self.v = nn.Linear(D, D), nn.Linear(D, KV * D // H), nn.Linear(D, KV * D // H)
        self.o = nn.Linear(D, D)
        self.register_buffer("tril", torch.tril(torch.ones(T, T, dtype=torch.bool)))

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, H, D // H).transpose(1, 2)
        k = self.k(x).view(b, t, KV, D // H).transpose(1, 2)
        v = self.v(x).view(b, t, KV, D // H).transpose(1, 2)
        # GQA as Hugging Face's repeat_kv: expand a new dimension, then merge it into the heads
        k = k[:, :, None].expand(b, KV, H // KV, t, D // H).reshape(b, H, t, D // H)
        v = v[:, :, None].expand(b, KV, H // KV, t, D // H).reshape(b, H, t, D // H)
        s = torch.matmul(q, k.transpose(2, 3)) / (D // H) ** 0.5
        if self.softcap:
            s = torch.tanh(s / self.softcap) * self.softcap * self.late_scale
        keep = self.tril[:t, :t] if self.style != "bidirectional" else torch.ones(t, t, dtype=torch.bool)
        if self.window:
            keep = keep & ~torch.tril(torch.ones(t, t, dtype=torch.bool), diagonal=-self.window)
        if self.style == "additive":          # Hugging Face eager: scores + a 0 / -inf mask, softmax in fp32
            s = s + torch.zeros(t, t).masked_fill(~keep, torch.finfo(torch.float32).min)
            probs = F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
        elif self.style in ("masked_fill", "bidirectional"):
            probs = torch.softmax(s.masked_fill(~keep, float("-inf")), dim=-1)
        else:
            probs = torch.softmax(s, dim=-1)
        probs = F.dropout(probs, self.p, self.training)
        y = (probs @ v).transpose(1, 2).reshape(b, t, D)
        return x + self.o(y)


class Attention(nn.Module):
    def __init__(self, style, window=None, softcap=None, p=0.0, late_scale=1.0):
        super().__init__()
        self.emb, self.pos = nn.Embedding(V, D), nn.Embedding(T, D)
        self.blocks = nn.ModuleList(Block(style, window, softcap, p, late_scale) for _ in range(2))
        self.head = nn.Linear(D, V)

    def forward(self, input_ids, position_ids):
        x = self.emb(input_ids) + self.pos(position_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _attention_nodes(compiled):
    return [n for n in compiled.hgraph.gm.graph.nodes if get_meta(n).op == OpKind.ATTENTION]


@pytest.mark.parametrize("style, window, softcap", [("masked_fill", None, None), ("additive", None, None),
                                                     ("masked_fill", 4, None), ("additive", 4, 20.0)])
def test_hand_written_causal_attention_is_packed(style, window, softcap):
    # a window of 4 keys is shorter than the documents below (5 and 6 tokens): it changes the result
    torch.manual_seed(0)
    model = Attention(style, window, softcap).eval()
    compiled = hgraph.compile(model)
    att, _ = _attention_nodes(compiled)
    if window is None and softcap is None:
        assert att.target is F.scaled_dot_product_attention and att.kwargs["is_causal"]
    else:       # SDPA cannot say either: hgraph's causal attention op carries them
        assert att.target is ops.causal_attention
        assert att.kwargs["window"] == window and att.kwargs["softcap"] == softcap
    assert att.kwargs["enable_gqa"] and att.kwargs["scale"] == pytest.approx((D // H) ** -0.5)
    assert not [n for n in compiled.hgraph.gm.graph.nodes if "softmax" in str(n.target)]
    ids = torch.randint(0, V, (1, 11))
    with torch.no_grad():
        whole = model(ids, torch.arange(11)[None])
        torch.testing.assert_close(compiled(ids, torch.arange(11)[None]), whole, rtol=0, atol=1e-5)
        rank = compiled.instantiate("1xTP1PP1").rank(0)
        gm = rank.graph_module
        for name, shard in rank.params.items():
            gm.get_submodule(name.rpartition(".")[0]).register_parameter(
                name.rpartition(".")[2], nn.Parameter(shard.take(model.get_parameter(name).detach())))
        pos = torch.cat([torch.arange(5), torch.arange(6)])[None]
        alone = torch.cat([model(ids[:, :5], pos[:, :5]), model(ids[:, 5:], pos[:, 5:])], dim=1)
        torch.testing.assert_close(gm(ids, pos), alone, rtol=0, atol=1e-5)


def test_dropout_on_the_probabilities_becomes_the_attention_dropout():
    model = Attention("masked_fill", p=0.1)
    att, _ = _attention_nodes(hgraph.compile(model))
    assert att.kwargs["dropout_p"] == pytest.approx(0.1)


@pytest.mark.parametrize("kwargs, message", [
    ({"style": "none"}, "has no mask"),
    ({"style": "bidirectional"}, "neither causal nor a causal sliding window"),
    ({"style": "masked_fill", "softcap": 30.0, "late_scale": 2.0}, "a scale applied to the scores after the logit"),
])
def test_attention_that_cannot_be_packed_is_refused_in_one_line(kwargs, message):
    with pytest.raises(TraceError, match=message) as info:
        hgraph.compile(Attention(**kwargs))
    assert "\n" not in str(info.value)
