"""The reference Llama: configs, parameter counts, forward semantics, model-spec resolution."""
from __future__ import annotations

import textwrap

import pytest
import torch
import torch.nn as nn

from hgraph.errors import HGraphError
from hgraph.frontends.zoo import CONFIGS, Llama, LlamaConfig, build, resolve_model_spec, zoo_names
from hgraph.frontends.zoo.llama import make_config

# Published parameter counts of the real models with these shapes.
PUBLISHED = {"7b": 6_738_415_616, "13b": 13_015_864_320, "70b": 68_976_648_192, "32b": 32_528_943_616}


@pytest.mark.parametrize("name", ["tiny", "tiny-tied"])
def test_num_parameters_matches_the_module(name):
    model = build(name)
    assert sum(p.numel() for p in model.parameters()) == CONFIGS[name].num_parameters()


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_large_configs_have_the_published_parameter_counts(name):
    assert CONFIGS[name].num_parameters() == PUBLISHED[name]


def test_large_configs_are_consistent():
    for name in ("7b", "13b", "32b", "70b"):
        c = CONFIGS[name]
        assert c.head_dim * c.num_heads == c.hidden_size
        assert c.num_heads % c.num_kv_heads == 0
    assert CONFIGS["70b"].num_kv_heads == 8


def test_module_names_follow_hugging_face():
    model = build("tiny")
    names = {n for n, _ in model.named_parameters()}
    for expected in ("embed_tokens.weight", "layers.0.input_layernorm.weight",
                     "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight",
                     "layers.0.self_attn.v_proj.weight", "layers.0.self_attn.o_proj.weight",
                     "layers.0.post_attention_layernorm.weight", "layers.0.mlp.gate_proj.weight",
                     "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight",
                     "layers.3.mlp.down_proj.weight", "norm.weight", "lm_head.weight"):
        assert expected in names
    assert all(m.bias is None for m in model.modules() if isinstance(m, nn.Linear))
    assert isinstance(model.layers, nn.ModuleList) and len(model.layers) == 4


def test_tied_head_is_the_embedding():
    model = build("tiny-tied")
    assert model.lm_head.weight is model.embed_tokens.weight
    assert "lm_head.weight" not in dict(model.named_parameters())


def test_forward_shape_and_default_positions():
    model = build("tiny")
    ids = torch.randint(0, 512, (2, 7))
    logits = model(ids)
    assert logits.shape == (2, 7, 512)
    explicit = model(ids, torch.arange(7).expand(2, 7))
    assert torch.equal(logits, explicit)


def test_causal_prefix_is_independent_of_the_future():
    model = build("tiny")
    ids = torch.randint(0, 512, (1, 9))
    full = model(ids)
    prefix = model(ids[:, :5])
    torch.testing.assert_close(full[:, :5], prefix, rtol=1e-5, atol=1e-6)


def test_packed_documents_equal_documents_alone_for_the_first_document():
    # Without a block-diagonal mask the second document attends to the first, but the first is
    # unaffected, and positions restart: the first document's logits match running it alone.
    model = build("tiny-tied")
    a, b = torch.randint(0, 512, (1, 5)), torch.randint(0, 512, (1, 4))
    packed = torch.cat([a, b], dim=1)
    pos = torch.cat([torch.arange(5), torch.arange(4)]).unsqueeze(0)
    torch.testing.assert_close(model(packed, pos)[:, :5], model(a), rtol=1e-5, atol=1e-6)
    # Positions matter: shifting them changes the second document's logits.
    assert not torch.allclose(model(packed, pos)[:, 5:], model(packed)[:, 5:])


def test_gqa_matches_repeated_kv_heads():
    torch.manual_seed(0)
    gqa = build("tiny")  # 4 heads, 2 kv heads
    mha = build("tiny", num_kv_heads=4)
    sd = gqa.state_dict()
    rep = 2
    for i in range(4):
        for proj in ("k_proj", "v_proj"):
            w = sd[f"layers.{i}.self_attn.{proj}.weight"].view(2, 16, 64)
            sd[f"layers.{i}.self_attn.{proj}.weight"] = w.repeat_interleave(rep, dim=0).reshape(64, 64)
    mha.load_state_dict(sd)
    ids = torch.randint(0, 512, (2, 6))
    torch.testing.assert_close(gqa(ids), mha(ids), rtol=1e-5, atol=1e-6)


def test_build_overrides_and_errors():
    model = build("tiny", num_layers=2, hidden_size=32)
    assert len(model.layers) == 2 and model.config.head_dim == 8
    with pytest.raises(HGraphError, match="known configs: tiny, tiny-tied, 7b"):
        build("huge")
    with pytest.raises(HGraphError, match="unknown llama config field"):
        build("tiny", layers=3)
    with pytest.raises(HGraphError, match="multiple of num_kv_heads"):
        make_config("tiny", num_kv_heads=3)
    cfg = LlamaConfig(vocab_size=10, hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2)
    assert cfg.num_kv_heads == 2 and cfg.head_dim == 4
    assert isinstance(build(cfg), Llama)


def test_resolve_zoo_names():
    assert "llama:tiny" in zoo_names()
    model = resolve_model_spec("llama:tiny", {"num_layers": 1})
    assert isinstance(model, Llama) and len(model.layers) == 1
    with pytest.raises(HGraphError, match="known configs"):
        resolve_model_spec("llama:nope")
    with pytest.raises(HGraphError, match="FAMILY:CONFIG"):
        resolve_model_spec("llama")


def test_resolve_file_and_module_specs(tmp_path):
    f = tmp_path / "my_model.py"
    f.write_text(textwrap.dedent("""
        import torch.nn as nn
        class Net(nn.Module):
            def __init__(self, width=4):
                super().__init__()
                self.lin = nn.Linear(width, width)
        class NotAModule:
            pass
    """))
    net = resolve_model_spec(f"{f}:Net", {"width": 3})
    assert net.lin.in_features == 3
    with pytest.raises(HGraphError, match="no class 'Missing'"):
        resolve_model_spec(f"{f}:Missing")
    with pytest.raises(HGraphError, match="do not fit"):
        resolve_model_spec(f"{f}:Net", {"depth": 2})
    with pytest.raises(HGraphError, match="not an nn.Module"):
        resolve_model_spec(f"{f}:NotAModule")
    with pytest.raises(HGraphError, match="does not exist"):
        resolve_model_spec(f"{tmp_path / 'nope.py'}:Net")
    model = resolve_model_spec("hgraph.frontends.zoo.llama:Llama", {"config": CONFIGS["tiny"]})
    assert isinstance(model, Llama)
    with pytest.raises(HGraphError, match="cannot import module"):
        resolve_model_spec("no_such_package_xyz.models:Net")
