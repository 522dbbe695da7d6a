"""The MoE GPU bench's plain baseline (``tools/bench/gpu_moe``) is the same model as hgraph's: its MoE
block (stacked experts, sorted rows, grouped GEMMs) equals hgraph's MoE op on the same weights, forward
and backward, and compiles as one graph; its activated FLOPs count what a token multiplies; its smoke
form (CPU, eager) trains both sides to the same losses.

Near-ties: a token whose router probabilities at ranks k and k+1 differ by less than ``TIE_TOLERANCE``
may choose the other expert under another summation order; such tokens are left out of the
comparison (their output gradient is zero, so no weight's gradient depends on their choice), and the
test fails when there are more than ``MAX_NEAR_TIES`` (as ``tests/runtime/train/test_moe_train.py``)."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

from hgraph.frontends.zoo import llama_moe
from hgraph.moe import moe_layer
from hgraph.tools.bench import gpu_moe

TIE_TOLERANCE = 1e-4
MAX_NEAR_TIES = 4
needs_grouped_mm = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")


def _block(normalize_top_k: bool) -> llama_moe.MoeBlock:
    torch.manual_seed(0)
    config = llama_moe.CONFIGS["tiny"]
    block = llama_moe.MoeBlock(llama_moe.LlamaMoeConfig(**{**config.__dict__, "normalize_top_k": normalize_top_k}))
    with torch.no_grad():       # the last expert scores -100 on every token (``_tokens``' first feature is 1)
        block.gate.weight[-1] = 0.0
        block.gate.weight[-1, 0] = -100.0
    return block


def _tokens(n: int, hidden: int, dtype=torch.float32) -> torch.Tensor:
    x = torch.randn(1, n, hidden, dtype=dtype)
    x[..., 0] = 1.0
    return x


def _hgraph_op(block: llama_moe.MoeBlock, x: torch.Tensor) -> torch.Tensor:
    """hgraph's MoE op on the block's weights (3 x E matrices), the loop path, plus the shared experts."""
    weights = [getattr(e, name).weight for name in ("gate_proj", "up_proj", "down_proj") for e in block.experts]
    y = moe_layer(x, block.gate.weight, *weights, top_k=block.top_k, normalize_top_k=block.normalize_top_k,
                  implementation="loop")
    return y + block.shared_experts(x)


def _near_ties(block: llama_moe.MoeBlock, x: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(block.gate(x.reshape(-1, x.shape[-1])).float(), -1)
    top = torch.topk(probs, block.top_k + 1, -1).values
    return top[:, block.top_k - 1] - top[:, block.top_k] < TIE_TOLERANCE


@pytest.mark.parametrize("normalize_top_k", [False, True])
@pytest.mark.parametrize("grouped", [False, pytest.param(True, marks=needs_grouped_mm)])
def test_the_plain_moe_equals_hgraphs_moe_op_on_the_same_weights(normalize_top_k, grouped, one_thread):
    block = _block(normalize_top_k)
    plain = gpu_moe.GroupedMoe(block, grouped=grouped, compute_dtype=torch.float32)
    x = _tokens(96, block.gate.in_features)
    near = _near_ties(block, x)
    assert int(near.sum()) <= MAX_NEAR_TIES, f"{int(near.sum())} near-tie tokens"
    upstream = torch.randn_like(x)
    upstream[0, near] = 0.0             # a near-tie token's choice reaches no gradient
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours, theirs = _hgraph_op(block, xa), plain(xb)
    torch.testing.assert_close(theirs[0, ~near], ours[0, ~near])
    ours.backward(upstream)
    theirs.backward(upstream)
    torch.testing.assert_close(xb.grad, xa.grad)
    for name in ("gate_proj", "up_proj", "down_proj"):
        stacked = torch.stack([getattr(e, name).weight.grad for e in block.experts])
        torch.testing.assert_close(getattr(plain, name).grad, stacked)
    assert not plain.down_proj.grad[-1].any()           # the expert no token chose: an exact zero
    assert plain.gate is block.gate and plain.shared_experts is block.shared_experts


@needs_grouped_mm
def test_the_plain_moe_compiles_as_one_graph():
    """The grouped path has no shape that depends on the data (the counts by a scatter, not bincount,
    nothing read on the host): dynamo captures the block whole (bf16: the grouped GEMM's meta kernel)."""
    block = _block(False).to(torch.bfloat16)
    plain = gpu_moe.GroupedMoe(block, grouped=True, compute_dtype=torch.bfloat16)
    explained = torch._dynamo.explain(plain)(_tokens(40, block.gate.in_features, torch.bfloat16))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def test_the_activated_flops_count_what_a_token_multiplies():
    config = gpu_moe.model_config(json.dumps(gpu_moe.MOE_MODEL_ARGS))
    model = llama_moe.build("tiny")          # the module walk against the config's arithmetic
    c = model.config
    linears = 0.0
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            linears += module.weight.numel() * (c.top_k / c.num_experts if ".experts." in name else 1)
    assert gpu_moe.activated_flops(c).matmul_params == linears
    assert gpu_moe.activated_flops(c).attention_width == c.num_layers * c.num_heads * c.head_dim
    # the bench's model: ~1B parameters, fine-grained experts, a fifth of them activated
    assert 0.9e9 < config.num_parameters() < 1.1e9 and (config.num_experts, config.top_k) == (64, 6)
    assert gpu_moe.activated_flops(config).matmul_params < 0.2 * config.num_parameters()


@pytest.mark.parametrize("args, says", [
    (["--model-args", "{oops"], "--model-args is not JSON"),
    (["--model-args", '{"top_k": 99}'], "top_k 99 exceeds num_experts 8"),
    (["--model-args", "[1]"], "must be a JSON object"),
    (["--tokens", "0"], "--tokens and --steps must be positive"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, args, says):
    assert gpu_moe.main(["--device", "cpu", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("bench gpu_moe: error: ") and says in err and "\n" not in err


def test_the_smoke_run_fails_when_the_two_models_differ(monkeypatch, capsys, one_thread):
    """The fp32 loss check can fail: a plain model that renormalises the top-k weights where the model
    does not exits 1 and says so (the passing run is ``test_gpu_checks``' smoke test)."""
    build = gpu_moe.plain_moe_model

    def renormalising(model, grouped, compute_dtype):
        plain = build(model, grouped, compute_dtype)
        for block in plain.modules():
            if isinstance(block, gpu_moe.GroupedMoe):
                block.normalize_top_k = not block.normalize_top_k
        return plain

    monkeypatch.setattr(gpu_moe, "plain_moe_model", renormalising)
    rc = gpu_moe.main(["--device", "cpu", "--model-args", '{"num_layers": 2}', "--tokens", "512", "--steps", "1"])
    out = capsys.readouterr().out
    assert rc == 1 and "DIFFER" in out, out
