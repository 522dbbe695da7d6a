"""Megatron sequence parallelism in the rank graphs, without processes (numerics: the equivalence tests).

Under TP2 the exits after row-parallel linears / the vocab-parallel embedding reduce-scatter along the
tokens and the enters before column-parallel groups all-gather; TP1 graphs and ``sequence_parallel=False``
graphs are the ones before SP; a whole value meeting a sliced one is narrowed; pipeline receives carry
the rank's slice; replicated parameters used on sliced tokens sum their TP ranks' gradients.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hgraph
from hgraph import ops
from hgraph.frontends.zoo import llama
from hgraph.passes.sequence_parallel import SequenceParallelRefused

COMM = ("sp_scatter_issue", "sp_gather_issue", "tp_reduce_issue", "tp_copy", "sp_narrow", "whole_shape")


class Block(nn.Module):
    def __init__(self, d, mix_tokens=False):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d, bias=False), nn.Linear(d, d)
        self.o = nn.Linear(d, d)
        self.fc, self.proj = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.heads, self.mix_tokens = 2, mix_tokens

    def forward(self, x):
        b, t, d = x.shape
        h = self.ln1(x)
        q, k, v = (f(h).view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for f in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        if self.mix_tokens:          # a running sum over the tokens: not token-wise
            x = x + x.cumsum(1)
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class PositionTableGPT(nn.Module):
    """GPT-style, its position embedding a plain parameter table read by position: a whole
    ``[T, d]`` value added to the reduce-scattered token embedding."""

    def __init__(self, vocab=32, d=16, layers=2, mix_tokens=False):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(64, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, mix_tokens and i == 1) for i in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, input_ids, position_ids):
        x = self.wte(input_ids) + self.pos[position_ids]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def _counts(gm):
    names = [getattr(n.target, "__name__", "") for n in gm.graph.nodes if n.op == "call_function"]
    return {k: names.count(k) for k in COMM}


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return llama.build(llama.LlamaConfig(vocab_size=64, hidden_size=16, num_layers=2, num_heads=2,
                                         num_kv_heads=2, intermediate_size=32))


def test_tp2_exits_reduce_scatter_and_enters_all_gather(tiny):
    prog = hgraph.compile(tiny).instantiate("1xTP2PP1")
    assert prog.sequence_parallel and not prog.sequence_parallel_note
    got = _counts(prog.rank(0).graph_module)
    # embedding + 2 x (o_proj, down_proj) exits; 2 x (qkv, gate/up) + head enters; the block's
    # ``b, t, _ = x.shape`` read before q/k/v is the whole micro-batch's
    assert got == {"sp_scatter_issue": 5, "sp_gather_issue": 5, "tp_reduce_issue": 0, "tp_copy": 0,
                   "sp_narrow": 0, "whole_shape": 2}


def test_tp1_and_sequence_parallel_off_keep_the_graphs_before_sp(tiny):
    on, off = hgraph.compile(tiny), hgraph.compile(tiny, sequence_parallel=False)
    tp1 = on.instantiate("2xTP1PP1")
    assert not tp1.sequence_parallel
    assert set(_counts(tp1.rank(0).graph_module).values()) == {0}
    assert str(tp1.rank(0).graph_module.graph) == str(off.instantiate("2xTP1PP1").rank(0).graph_module.graph)
    tp2 = off.instantiate("1xTP2PP1")
    assert not tp2.sequence_parallel
    assert _counts(tp2.rank(0).graph_module) == {"sp_scatter_issue": 0, "sp_gather_issue": 0,
                                                 "tp_reduce_issue": 5, "tp_copy": 5, "sp_narrow": 0,
                                                 "whole_shape": 0}


def test_pipeline_receives_carry_the_token_slice_and_norm_gradients_are_summed_over_tp(tiny):
    prog = hgraph.compile(tiny).instantiate("1xTP2PP2")
    recv = [n for n in prog.rank(2).graph_module.graph.nodes if n.target is ops.pp_recv]
    assert [n.args[3] for n in recv] == [("B", ops.SP_TOKENS, 16)]
    assert prog.rank(2).role.recv_specs[0][0] == ("B", ops.SP_TOKENS, 16)
    # each TP rank's norm-weight gradient covers its tokens: both push the whole range, summed
    assert prog.push_plans["norm.weight"].contributions == {2: ((0, 16),), 3: ((0, 16),)}
    off = hgraph.compile(tiny, sequence_parallel=False).instantiate("1xTP2PP2")
    assert off.push_plans["norm.weight"].contributions == {2: ((0, 8),), 3: ((8, 16),)}
    recv = [n.args[3] for n in off.rank(2).graph_module.graph.nodes if n.target is ops.pp_recv]
    assert recv == [("B", "T", 16)]


def test_a_whole_position_table_meeting_sliced_tokens_is_narrowed_and_its_gradient_summed():
    torch.manual_seed(0)
    prog = hgraph.compile(PositionTableGPT()).instantiate("1xTP2PP1")
    gm = prog.rank(1).graph_module
    (narrow,) = [n for n in gm.graph.nodes if n.target is ops.sp_narrow]
    assert narrow.args[1].name == "getitem" and narrow.args[2:] == ("tp", 1)
    assert prog.push_plans["pos"].contributions == {0: ((0, 64),), 1: ((0, 64),)}
    # the row-parallel biases are added after the reduce-scatter: their gradients are partial too
    assert prog.push_plans["blocks.0.o.bias"].contributions == {0: ((0, 16),), 1: ((0, 16),)}


def test_token_wise_ops_and_the_ops_that_refuse_sp():
    torch.manual_seed(0)
    model = PositionTableGPT(mix_tokens=True)
    with pytest.raises(SequenceParallelRefused, match=r"cumsum \(cumsum\) is not an op SP can prove"):
        hgraph.compile(model, sequence_parallel=True).instantiate("1xTP2PP1")
    prog = hgraph.compile(model).instantiate("1xTP2PP1")      # SP only the default: TP without it
    assert not prog.sequence_parallel and "cumsum" in prog.sequence_parallel_note
    assert _counts(prog.rank(0).graph_module)["sp_scatter_issue"] == 0


def test_whole_shape_and_narrow_without_a_runtime_are_the_plain_ops():
    x, ids = torch.zeros(1, 3, 4), torch.zeros(1, 7, dtype=torch.long)
    assert ops.whole_shape(x, 1, ids) == torch.Size([1, 7, 4])
    assert ops.whole_shape(x, 1, ids, 1) == 7
    assert ops.sp_narrow(None, x, "tp", 1) is x


def test_column_linears_of_a_gathered_input_keep_the_slice_but_the_head_does_not(tiny):
    """Megatron: q/k/v and gate/up keep this rank's slice for backward (``sp_linear``, gathering it again
    for the weight's gradient); the output head stays the chunked loss's (its input kept whole)."""
    gm = hgraph.compile(tiny).instantiate("1xTP2PP1").rank(0).graph_module
    linears = [n for n in gm.graph.nodes if n.target is ops.sp_linear]
    assert len(linears) == 2 * 5
    for n in linears:
        whole, part = n.args[1], n.args[2]
        assert whole.args[1].target is ops.sp_gather_issue and whole.args[1].args[1] is part
    assert sum(n.target is ops.output_head for n in gm.graph.nodes) == 1
