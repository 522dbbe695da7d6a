"""The zoo's MoE decoder (``llama-moe``): parameter counts (tiny, and the DeepSeek-MoE 16B shape with its
published 16.4B total and 2.8B activated parameters), its names, and its resolution as a model spec."""
import pytest
import torch

from hgraph.errors import HGraphError
from hgraph.frontends.zoo import llama_moe, resolve_model_spec, zoo_names


def test_tiny_counts_its_parameters_and_has_dense_leading_layers_and_shared_experts():
    model = llama_moe.build("tiny")
    c = llama_moe.CONFIGS["tiny"]
    assert sum(p.numel() for p in model.parameters()) == c.num_parameters()
    names = dict(model.named_parameters())
    assert "layers.0.mlp.gate_proj.weight" in names                     # first_dense_layers = 1
    assert names["layers.1.mlp.gate.weight"].shape == (c.num_experts, c.hidden_size)
    assert names["layers.2.mlp.experts.7.down_proj.weight"].shape == (c.hidden_size, c.moe_intermediate_size)
    assert "layers.1.mlp.shared_experts.up_proj.weight" in names


def test_the_16b_config_has_deepseek_moe_16b_counts():
    c = llama_moe.CONFIGS["16b"]
    assert round(c.num_parameters() / 1e9, 1) == 16.4 and round(c.activated_parameters() / 1e9, 1) == 2.8
    with torch.device("meta"):
        model = llama_moe.build("16b")
    assert sum(p.numel() for p in model.parameters()) == c.num_parameters()


def test_model_specs_and_bad_configs():
    assert "llama-moe:tiny" in zoo_names() and "llama-moe:16b" in zoo_names()
    model = resolve_model_spec("llama-moe:tiny", {"num_experts": 4, "top_k": 1})
    assert len(model.layers[1].mlp.experts) == 4
    with pytest.raises(HGraphError, match="top_k 5 exceeds num_experts 4"):
        llama_moe.build("tiny", num_experts=4, top_k=5)
    with pytest.raises(HGraphError, match="unknown llama-moe config 'huge'; known configs: tiny, 16b"):
        llama_moe.build("huge")
    with pytest.raises(HGraphError, match="unknown llama-moe config field"):
        llama_moe.build("tiny", experts=3)


def test_dense_routing_equals_the_experts_loop_when_every_expert_is_chosen():
    """top_k = num_experts with renormalised weights: every token runs every expert, summed by softmax."""
    torch.manual_seed(0)
    model = llama_moe.build("tiny", num_experts=3, top_k=3, normalize_top_k=True, num_shared_experts=0)
    block = model.layers[1].mlp
    x = torch.randn(1, 5, 64)
    probs = torch.softmax(block.gate(x), -1)
    want = sum(probs[..., e:e + 1] * block.experts[e](x) for e in range(3))
    torch.testing.assert_close(block(x), want, rtol=1e-5, atol=1e-6)


def test_the_16b_blocks_are_recognised_on_the_meta_device():
    """On meta (how a run builds a model) the blocks are read by fake runs: no weights, no memory."""
    from hgraph.frontends.moe_blocks import swapped_moe_blocks
    with torch.device("meta"):
        model = llama_moe.build("16b")
    with swapped_moe_blocks(model) as forms:
        assert len(forms) == 27 and {f.top_k for f in forms} == {6}
        assert all(len(f.experts) == 3 * 64 and len(f.shared) == 1 for f in forms)
        assert forms[0].path == "layers.1.mlp"
        assert forms[0].experts[64] is model.layers[1].mlp.experts[0].up_proj.weight
