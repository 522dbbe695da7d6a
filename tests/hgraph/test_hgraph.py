"""HGraph: parameter table, blocks, model config, slot queries, running, build options."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from hgraph.compiled import build_hgraph
from hgraph.errors import HGraphError, TraceError
from hgraph.frontends.zoo import build
from hgraph.graph import ModelConfig, ParamInfo, infer_model_config
from hgraph.meta import CommPoint, SlotKind, TPRole, get_meta


@pytest.fixture(scope="module")
def tiny():
    model = build("tiny")
    return model, build_hgraph(model)


def test_params_table(tiny):
    model, hg = tiny
    named = dict(model.named_parameters())
    assert list(hg.params) == [n for n in hg.params]  # ordered
    assert set(hg.params) == set(named)
    for name, info in hg.params.items():
        assert isinstance(info, ParamInfo)
        assert info.shape == named[name].shape and info.dtype == named[name].dtype
        assert info.numel == named[name].numel()
    q = hg.params["layers.2.self_attn.q_proj.weight"]
    assert (q.tp_role, q.shard_dim, q.block, q.layer) == (TPRole.COLUMN, 0, "layers.2", 2)
    o = hg.params["layers.1.self_attn.o_proj.weight"]
    assert (o.tp_role, o.shard_dim) == (TPRole.ROW, 1)
    e = hg.params["embed_tokens.weight"]
    assert (e.tp_role, e.shard_dim, e.block, e.layer) == (TPRole.VOCAB, 0, "pre", None)
    head = hg.params["lm_head.weight"]
    assert (head.tp_role, head.block) == (TPRole.COLUMN, "post")
    assert hg.params["norm.weight"].tp_role == TPRole.REPLICATED
    assert sum(i.numel for i in hg.params.values()) == model.config.num_parameters()


def test_blocks_layers_and_config(tiny):
    model, hg = tiny
    assert hg.blocks == ["pre", "layers.0", "layers.1", "layers.2", "layers.3", "post"]
    assert hg.num_layers == 4
    c = model.config
    expected = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=176, num_layers=4,
                           num_heads=4, num_kv_heads=2, head_dim=16)
    assert hg.model_config == expected
    assert infer_model_config(hg) == expected  # the same, read from the graph alone
    assert (c.num_heads, c.num_kv_heads) == (expected.num_heads, expected.num_kv_heads)
    assert hg.uses_position_ids


def test_slot_queries(tiny):
    _, hg = tiny
    counts = hg.slot_counts()
    assert counts["push_gradient"] == 39 and counts["pull_parameter"] == 39
    assert counts["comm_activation"] == 9 + 9 + 1 + 8 + 5
    assert counts["tp_enter"] == 9 and counts["pp_boundary"] == 5 and counts["cp_kv"] == 8
    assert len(hg.slots()) == 39 + 39 + 32
    assert len(hg.slots(SlotKind.PUSH_GRADIENT)) == 39
    assert len(hg.slots("pull_parameter")) == 39
    pp = hg.slots(CommPoint.PP_BOUNDARY)
    assert [get_meta(n).block for n in pp] == ["pre", "layers.0", "layers.1", "layers.2", "layers.3"]
    assert "push_gradient" in repr(hg)


def test_run_matches_the_model(tiny):
    model, hg = tiny
    ids = torch.randint(0, 512, (3, 9))
    assert torch.equal(hg.run(ids), model(ids))
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4]] * 3)
    assert torch.equal(hg.run(ids, pos), model(ids, pos))


def test_tied_param_info():
    model = build("tiny-tied")
    hg = build_hgraph(model)
    e = hg.params["embed_tokens.weight"]
    assert e.use_blocks == ("pre", "post")
    assert e.use_roles == (TPRole.VOCAB, TPRole.COLUMN)
    assert e.tp_role == TPRole.VOCAB and e.shard_dim == 0
    assert "lm_head.weight" not in hg.params
    assert hg.slot_counts()["pull_parameter"] == hg.slot_counts()["push_gradient"] + 1


class Block(nn.Module):
    def __init__(self, d, heads, kv):
        super().__init__()
        self.hd = d // heads
        self.norm = nn.LayerNorm(d)
        self.wq = nn.Linear(d, d, bias=False)
        self.wkv = nn.ModuleList([nn.Linear(d, kv * self.hd, bias=False) for _ in range(2)])
        self.wo = nn.Linear(d, d, bias=False)
        self.fc1 = nn.Linear(d, 48)
        self.fc2 = nn.Linear(48, d)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.norm(x)
        q = self.wq(h).view(b, t, -1, self.hd).transpose(1, 2)
        k, v = (m(h).view(b, t, -1, self.hd).transpose(1, 2) for m in self.wkv)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.wo(a.transpose(1, 2).reshape(b, t, -1))
        return x + self.fc2(F.relu(self.fc1(self.norm(x))))


class NoConfigModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(77, 32)
        self.stack = nn.ModuleList([Block(32, 8, 2) for _ in range(3)])
        self.out = nn.Linear(32, 77, bias=False)

    def forward(self, input_ids, position_ids=None):
        x = self.tok(input_ids)
        for blk in self.stack:
            x = blk(x)
        return self.out(x)


def test_model_config_inferred_without_config():
    model = NoConfigModel()
    hg = build_hgraph(model)
    assert hg.model_config == ModelConfig(vocab_size=77, hidden_size=32, intermediate_size=48, num_layers=3,
                                          num_heads=8, num_kv_heads=2, head_dim=4)
    assert hg.blocks == ["pre", "stack.0", "stack.1", "stack.2", "post"]
    assert not hg.uses_position_ids
    ids = torch.randint(0, 77, (2, 6))
    assert torch.equal(hg.run(ids), model(ids))


def test_build_options():
    model = build("tiny", num_layers=1)
    with pytest.raises(HGraphError, match="unknown build_hgraph option"):
        build_hgraph(model, dtype="bf16")
    hg = build_hgraph(model, leaf_modules=(nn.Linear,))
    assert hg.slot_counts()["push_gradient"] == 9 + 3
    with pytest.raises(TraceError):
        build_hgraph(nn.Linear(3, 3))
