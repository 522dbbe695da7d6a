"""One TP reduction for a sum of partial sums (``passes/partial_sums``), on hand-written MoE blocks.

The MoE op's partial sums added to a shared expert's (a row-parallel linear's) share one ``tp_exit``; so do
they when the shared term is scaled per token by a value every TP rank holds whole (``sigmoid(gate(x))``),
whose gate then reads the entered input and has a per-rank partial gradient. A nonlinear use of a partial
sum, a row bias, or a scale something else also reads keeps a reduction per term. (Numerics:
``test_programs_multirank``'s MoE cases.)
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hgraph
from hgraph import moe
from hgraph.meta import CommPoint, SlotKind, get_meta

H, I, E = 8, 4, 4


class Block(nn.Module):
    def __init__(self, combine, bias=False):
        super().__init__()
        self.router = nn.Parameter(torch.randn(E, H))
        self.gate, self.up = (nn.Parameter(torch.randn(E, I, H) / 3) for _ in range(2))
        self.down = nn.Parameter(torch.randn(E, H, I) / 3)
        self.shared_gate_proj = nn.Linear(H, I, bias=False)
        self.shared_up_proj = nn.Linear(H, I, bias=False)
        self.shared_down_proj = nn.Linear(I, H, bias=bias)
        self.shared_gate = nn.Linear(H, 1, bias=False)
        self.combine = combine

    def forward(self, x):
        routed = moe.moe_layer(x, self.router, self.gate, self.up, self.down, top_k=2)
        shared = self.shared_down_proj(F.silu(self.shared_gate_proj(x)) * self.shared_up_proj(x))
        if self.combine == "gated":
            return x + (routed + torch.sigmoid(self.shared_gate(x)) * shared)
        if self.combine == "nonlinear":
            return x + (routed + torch.tanh(shared))
        if self.combine == "scale-read-twice":
            scale = torch.sigmoid(self.shared_gate(x))
            return x + (routed + scale * shared) + scale
        return x + (routed + shared)


class Stack(nn.Module):
    def __init__(self, combine, bias=False, vocab=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, H)
        self.layers = nn.ModuleList([Block(combine, bias), Block(combine, bias)])
        self.head = nn.Linear(H, vocab, bias=False)

    def forward(self, input_ids, position_ids=None):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _exits_per_layer(hg):
    out = {}
    for n in hg.gm.graph.nodes:
        if get_meta(n).comm_point == CommPoint.TP_EXIT:
            out[get_meta(n).layer] = out.get(get_meta(n).layer, 0) + 1
    return out


@pytest.mark.parametrize("combine,bias,exits,gate_partial", [
    ("sum", False, 1, None),
    ("gated", False, 1, True),            # a per-token scale of a partial sum is a partial sum
    ("nonlinear", False, 2, None),        # tanh of a partial sum is not
    ("sum", True, 2, None),               # the shared down's bias is added after its own reduction
    ("scale-read-twice", False, 2, False),
])
def test_partial_sums_added_before_any_other_use_share_one_exit(combine, bias, exits, gate_partial):
    torch.manual_seed(0)
    model = Stack(combine, bias)
    hg = hgraph.compile(model).hgraph
    assert {k: v for k, v in _exits_per_layer(hg).items() if k is not None} == {0: exits, 1: exits}
    ids = torch.randint(0, 32, (1, 9), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(9)[None]
    torch.testing.assert_close(hg.gm(ids, pos), model(ids, pos), rtol=0, atol=0)     # the slots change nothing
    if gate_partial is not None:
        assert hg.params["layers.0.shared_gate.weight"].tp_partial is gate_partial
    if combine == "gated":          # the gate reads the input whole, inside the TP region
        (pull,) = [n for n in hg.gm.graph.nodes if get_meta(n).param == "layers.0.shared_gate.weight"
                   and get_meta(n).slot == SlotKind.PULL_PARAMETER]
        (gate,) = pull.users
        assert get_meta(gate.args[0]).comm_point == CommPoint.TP_ENTER
