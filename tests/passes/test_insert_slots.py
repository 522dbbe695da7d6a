"""insert_slots_pass: slot kinds, counts and placement; the slotted graph computes the same logits."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from hgraph.frontends.fx_frontend import trace
from hgraph.frontends.zoo import build
from hgraph.meta import CommPoint, OpKind, SlotKind, TPRole, get_meta, is_slot
from hgraph.passes.annotate import annotate_pass
from hgraph.passes.insert_slots import insert_slots_pass
from hgraph.slots import empty_slot


def slotted(model):
    return insert_slots_pass(annotate_pass(trace(model), None), None)


def counts(gm):
    c = Counter()
    for n in gm.graph.nodes:
        m = get_meta(n)
        if m.slot is not None:
            c[m.comm_point.value if m.comm_point else m.slot.value] += 1
    return c


def packed_positions(lengths_per_row):
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths_per_row])


@pytest.mark.parametrize("name", ["tiny", "tiny-tied"])
def test_slot_counts_follow_from_the_config(name):
    model = build(name)
    c, L = model.config, model.config.num_layers
    n_params = len(dict(model.named_parameters()))
    assert n_params == 9 * L + 2 + (0 if c.tie_embeddings else 1)
    assert counts(slotted(model)) == {
        "push_gradient": n_params,
        "pull_parameter": n_params + (1 if c.tie_embeddings else 0),  # a tied table is used twice
        "tp_enter": 2 * L + 1,          # q/k/v input and gate/up input per layer, lm head input
        "tp_exit": 2 * L + 1,           # o_proj and down_proj per layer, the vocab embedding
        "tp_gather": 1,                 # lm head
        "cp_kv": 2 * L,                 # key and value of each attention
        "pp_boundary": L + 1,           # pre -> layers.0 -> ... -> post
    }


@pytest.mark.parametrize("name", ["tiny", "tiny-tied"])
def test_parameter_slot_structure(name):
    model = build(name)
    gm = slotted(model)
    attrs = [n for n in gm.graph.nodes if n.op == "get_attr" and get_meta(n).param is not None]
    assert sorted(n.target for n in attrs) == sorted(dict(model.named_parameters()))  # one get_attr each
    for a in attrs:
        (push,) = a.users
        assert push.target is empty_slot and get_meta(push).slot == SlotKind.PUSH_GRADIENT
        assert get_meta(push).param == a.target
        pulls = list(push.users)
        assert pulls and all(get_meta(p).slot == SlotKind.PULL_PARAMETER and get_meta(p).param == a.target
                             for p in pulls)
        for p in pulls:
            (op,) = p.users
            assert not is_slot(op) and op.op == "call_function"
    embed_push = next(iter(next(a for a in attrs if a.target == "embed_tokens.weight").users))
    uses = sorted(get_meta(next(iter(p.users))).op.value for p in embed_push.users)
    assert uses == (["embedding", "linear"] if model.config.tie_embeddings else ["embedding"])


def test_activation_slot_placement():
    gm = slotted(build("tiny"))
    enters = [n for n in gm.graph.nodes if get_meta(n).comm_point == CommPoint.TP_ENTER]
    fanout = Counter(len(list(n.users)) for n in enters)
    assert fanout == {3: 4, 2: 4, 1: 1}  # q/k/v, gate/up per layer; the lm head alone
    for n in enters:
        assert all(get_meta(u).op == OpKind.LINEAR and get_meta(u).tp_role == TPRole.COLUMN for u in n.users)
        assert get_meta(n).block == get_meta(n.args[0]).block
    for n in gm.graph.nodes:
        m = get_meta(n)
        if m.comm_point == CommPoint.TP_EXIT:
            src = get_meta(n.args[0])
            assert (src.op, src.tp_role) in ((OpKind.LINEAR, TPRole.ROW), (OpKind.EMBEDDING, TPRole.VOCAB))
            assert m.block == src.block and m.layer == src.layer
        if m.comm_point == CommPoint.TP_GATHER:
            assert get_meta(n.args[0]).block == "post" and [u.op for u in n.users] == ["output"]
        if m.comm_point == CommPoint.CP_KV:
            (attn,) = n.users
            assert get_meta(attn).op == OpKind.ATTENTION and attn.args.index(n) in (1, 2)
        if m.comm_point == CommPoint.PP_BOUNDARY:
            assert m.block == get_meta(n.args[0]).block
            assert {get_meta(u).block for u in n.users} == {_next_block(m.block)}
        if m.op == OpKind.ATTENTION:
            assert [get_meta(a).comm_point for a in n.args[1:3]] == [CommPoint.CP_KV] * 2
    # no value crosses a block boundary except through a pp_boundary slot
    for n in gm.graph.nodes:
        b = get_meta(n).block
        if b is None or get_meta(n).comm_point == CommPoint.PP_BOUNDARY:
            continue
        assert all(get_meta(u).block in (b, None) for u in n.users if u.op != "output"), n.name


def _next_block(block):
    order = ["pre"] + [f"layers.{i}" for i in range(4)] + ["post"]
    return order[order.index(block) + 1]


@pytest.mark.parametrize("name", ["tiny", "tiny-tied"])
def test_slotted_graph_computes_the_model(name):
    torch.manual_seed(1)
    model = build(name)
    gm = slotted(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 11))
    pos = packed_positions([[4, 7], [2, 5, 4]])
    assert torch.equal(gm(ids, pos), model(ids, pos))
    assert torch.equal(gm(ids, packed_positions([[11], [11]])), model(ids))


def test_slotted_graph_gradients_match():
    model = build("tiny-tied")
    gm = slotted(model)
    ids = torch.randint(0, 512, (2, 6))
    pos = packed_positions([[6], [3, 3]])
    gm(ids, pos).square().mean().backward()
    g1 = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model(ids, pos).square().mean().backward()
    for n, p in model.named_parameters():
        assert torch.equal(g1[n], p.grad), n


def test_insert_slots_twice_changes_nothing():
    gm = slotted(build("tiny"))
    before = len(gm.graph.nodes)
    assert len(insert_slots_pass(gm, None).graph.nodes) == before


class GPTish(nn.Module):
    def __init__(self, vocab=61, d=16, layers=3):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(nn.ModuleDict({"ln": nn.LayerNorm(d), "fc": nn.Linear(d, 4 * d),
                                                   "proj": nn.Linear(4 * d, d)}) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids, position_ids=None):
        x = self.wte(input_ids)
        for blk in self.blocks:
            x = x + blk["proj"](F.gelu(blk["fc"](blk["ln"](x))))
        return self.head(x)


def test_non_llama_model_slots_and_equality():
    model = GPTish()
    gm = slotted(model)
    n_params = len(dict(model.named_parameters()))
    assert counts(gm) == {"push_gradient": n_params, "pull_parameter": n_params, "tp_enter": 4, "tp_exit": 4,
                          "tp_gather": 1, "pp_boundary": 4}
    ids = torch.randint(0, 61, (3, 5))
    assert torch.equal(gm(ids, packed_positions([[5]] * 3)), model(ids))


class NoNormBlock(nn.Module):
    """Column linears read the block input directly (no norm in between)."""

    def __init__(self, d=8):
        super().__init__()
        self.a = nn.Linear(d, 2 * d)
        self.b = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.b(torch.relu(self.a(x)))


class NoNorm(nn.Module):
    def __init__(self, vocab=30, d=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([NoNormBlock(d) for _ in range(2)])

    def forward(self, input_ids, position_ids=None):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return x @ self.embed.weight.t()


def test_tp_enter_on_a_value_from_the_previous_block_stays_with_its_group():
    model = NoNorm()
    gm = slotted(model)
    pps = [n for n in gm.graph.nodes if get_meta(n).comm_point == CommPoint.PP_BOUNDARY]
    assert len(pps) == 3  # one per boundary, shared by the residual and the tp_enter
    for n in gm.graph.nodes:
        if get_meta(n).comm_point == CommPoint.TP_ENTER:
            assert get_meta(n.args[0]).comm_point == CommPoint.PP_BOUNDARY or get_meta(n).block == "post"
            assert {get_meta(u).block for u in n.users} == {get_meta(n).block}
    ids = torch.randint(0, 30, (2, 4))
    assert torch.equal(gm(ids, packed_positions([[4], [4]])), model(ids))
