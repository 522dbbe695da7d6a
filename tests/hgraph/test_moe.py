"""hgraph's MoE op (``hgraph.moe``): the same numbers as a plain PyTorch MoE, forward and backward, in
every weight layout; the loop and ``torch._grouped_mm`` agree; the selection runs the loop on CPU; an
expert no token reached gets an exact zero gradient; the auxiliary losses equal hand computations."""
import pytest
import torch
import torch.nn.functional as F

from hgraph import moe
from hgraph.errors import HGraphError

H, I, E, N = 16, 8, 6, 11


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    router = torch.randn(E, H, generator=g)
    gate, up = torch.randn(E, I, H, generator=g), torch.randn(E, I, H, generator=g)
    down = torch.randn(E, H, I, generator=g)
    return router, gate, up, down


def _reference(x, router, gate, up, down, k, normalize):
    """An MoE forward as a plain PyTorch model writes it: softmax, top-k, a loop over the experts."""
    logits = x @ router.t()
    probs = torch.softmax(logits.float(), -1)
    w, sel = torch.topk(probs, k, -1)
    if normalize:
        w = w / w.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for e in range(E):
        tok, slot = torch.where(sel == e)
        if tok.numel() == 0:
            continue
        h = x[tok]
        y = (F.silu(h @ gate[e].t()) * (h @ up[e].t())) @ down[e].t()
        out.index_add_(0, tok, y * w[tok, slot, None])
    return out, logits


def _layouts(gate, up, down):
    return {"list": (*gate.unbind(0), *up.unbind(0), *down.unbind(0)),
            "stacked": (gate, up, down),
            "fused": (torch.cat([gate, up], dim=1), down)}


@pytest.mark.parametrize("layout", ["list", "stacked", "fused"])
@pytest.mark.parametrize("k,normalize", [(2, False), (3, True)])
def test_moe_layer_equals_a_plain_pytorch_moe_forward_and_backward(layout, k, normalize):
    router, gate, up, down = _weights()
    x = torch.randn(1, N, H, generator=torch.Generator().manual_seed(1))
    leaves = [t.clone().requires_grad_() for t in (x, router, gate, up, down)]
    want, want_logits = _reference(leaves[0][0], *leaves[1:], k, normalize)
    (want.square().sum() + want_logits.sum()).backward()
    mine = [t.clone().requires_grad_() for t in (x, router, gate, up, down)]
    got, logits = moe.moe_layer_with_logits(mine[0], mine[1], *_layouts(*mine[2:])[layout], top_k=k,
                                            normalize_top_k=normalize)
    (got[0].square().sum() + logits.sum()).backward()
    assert got.shape == x.shape
    torch.testing.assert_close(got[0], want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=0)
    for a, b in zip(mine, leaves):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5)


def test_grouped_mm_and_the_loop_give_the_same_numbers():
    router, gate, up, down = _weights()
    x = torch.randn(N, H, generator=torch.Generator().manual_seed(2))
    w = moe.expert_layout((gate, up, down))
    weights, experts = moe.route(x @ router.t(), 2, False)
    loop = moe.experts_forward(x, weights, experts, w, "loop")
    try:
        grouped = moe.experts_forward(x, weights, experts, w, "grouped_mm")
    except (RuntimeError, NotImplementedError) as exc:       # a torch without a CPU grouped GEMM kernel
        pytest.skip(f"torch._grouped_mm does not run on this CPU: {exc}")
    torch.testing.assert_close(grouped, loop, rtol=1e-5, atol=1e-5)


def test_the_selection_runs_the_loop_on_cpu_and_grouped_mm_only_for_bf16_on_cuda():
    assert moe.expert_implementation("auto", torch.zeros(2, 4)) == "loop"
    assert moe.expert_implementation("auto", torch.zeros(2, 4, dtype=torch.bfloat16)) == "loop"
    assert not moe.grouped_gemm_supported(torch.device("cpu"), torch.bfloat16)
    assert moe.expert_implementation("grouped_mm", torch.zeros(2, 4)) == "grouped_mm"
    with pytest.raises(HGraphError, match="unknown implementation 'fast'; allowed: auto, grouped_mm, loop"):
        moe.expert_implementation("fast", torch.zeros(2, 4))


def test_an_expert_no_token_reached_gets_an_exact_zero_gradient_and_every_token_its_top_k():
    router, gate, up, down = _weights()
    router = router.clone()
    router[E - 1] = -100.0                                 # expert E-1 loses every (positive) token
    gate = gate.clone().requires_grad_()
    x = torch.randn(1, N, H, generator=torch.Generator().manual_seed(3)).abs()
    y, logits = moe.moe_layer_with_logits(x, router, gate, up, down, top_k=2)
    y.sum().backward()
    assert torch.equal(gate.grad[E - 1], torch.zeros(I, H))
    assert gate.grad[:E - 1].abs().sum() > 0
    counts = moe.expert_counts(torch.topk(logits, 2).indices, E)
    assert counts.sum() == 2 * N                           # dropless: no capacity, no token lost


def test_bad_expert_weights_and_top_k_are_one_line_errors():
    router, gate, up, down = _weights()
    x = torch.randn(3, H)
    with pytest.raises(HGraphError, match="expert weights must be 3 x E matrices"):
        moe.moe_layer(x, router, gate, top_k=2)
    with pytest.raises(HGraphError, match="top_k must be in 1..6, got 7"):
        moe.moe_layer(x, router, gate, up, down, top_k=7)
    with pytest.raises(HGraphError, match="the router scores 5 experts but 6 are given"):
        moe.moe_layer(x, router[:5], gate, up, down, top_k=2)


def test_the_op_runs_on_the_meta_device_for_shapes():
    router, gate, up, down = (t.to("meta") for t in _weights())
    y, logits = moe.moe_layer_with_logits(torch.empty(2, 5, H, device="meta"), router, gate, up, down, top_k=2)
    assert y.shape == (2, 5, H) and logits.shape == (10, E)
    assert moe.moe_layer(torch.empty(2, 5, H, device="meta"), router, gate, up, down, top_k=2).shape == (2, 5, H)


# ---- auxiliary losses against hand computations -------------------------------------------------------
# four tokens over three experts, logits = log(probabilities) so the softmax gives these rows exactly
PROBS = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.25, 0.15, 0.6], [0.7, 0.2, 0.1]], dtype=torch.float64)
LOGITS = PROBS.log()


def test_global_batch_load_balancing_by_hand():
    # top-1 experts 0, 1, 2, 0: f = (2/4, 1/4, 1/4); P = column means (0.3875, 0.3125, 0.3)
    want = 3 * (0.5 * 0.3875 + 0.25 * 0.3125 + 0.25 * 0.3)
    assert moe.load_balancing_loss(LOGITS, 1, "global").item() == pytest.approx(want, rel=1e-6)
    # top-2: assignments {0,1} {1,2} {2,0} {0,1}; f over the 8 assignments
    experts = torch.topk(PROBS, 2).indices
    f = torch.bincount(experts.reshape(-1), minlength=3).double() / 8
    assert moe.load_balancing_loss(LOGITS, 2, "global").item() == pytest.approx(
        3 * float((f * PROBS.mean(0)).sum()), rel=1e-6)


def test_per_document_load_balancing_by_hand_and_split_invariance():
    # document A = tokens 0, 1 (experts 0, 1): f = (.5, .5, 0), P = (.3, .45, .25) -> 3 * (.15 + .225)
    # document B = tokens 2, 3 (experts 2, 0): f = (.5, 0, .5), P = (.475, .175, .35) -> 3 * (.2375 + .175)
    want = 3 * (0.15 + 0.225) + 3 * (0.2375 + 0.175)
    assert moe.load_balancing_loss(LOGITS, 1, "document", documents=[2, 2]).item() == pytest.approx(want, rel=1e-6)
    # the same documents held in pieces by two ranks (CP, UL): each piece with its document's summed counts
    counts = moe.expert_counts(torch.topk(PROBS, 1).indices, 3, [2, 2])
    first = moe.load_balancing_loss(LOGITS[[0, 2]], 1, "document", documents=[1, 1], counts=counts)
    second = moe.load_balancing_loss(LOGITS[[1, 3]], 1, "document", documents=[1, 1], counts=counts)
    assert (first + second).item() == pytest.approx(want, rel=1e-6)


def test_hugging_face_form_is_its_product_of_batch_means_and_depends_on_the_grouping():
    transformers = pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    logits = torch.randn(9, 5, generator=torch.Generator().manual_seed(4))
    hf = load_balancing_loss_func((logits,), 5, 2)
    torch.testing.assert_close(moe.load_balancing_loss(logits, 2, "hf"), hf.float(), rtol=1e-6, atol=0)
    halves = moe.load_balancing_loss(logits[:4], 2, "hf") + moe.load_balancing_loss(logits[4:], 2, "hf")
    assert not torch.allclose(halves, 2 * hf)          # another grouping of the same tokens, another value
    assert transformers is not None


def test_router_z_loss_by_hand_per_document_and_global():
    logits = torch.tensor([[0.0, 0.0, 0.0], [torch.tensor(2.0).log().item(), 0.0, 0.0]])
    z0, z1 = torch.tensor(3.0).log().item() ** 2, torch.tensor(4.0).log().item() ** 2   # logsumexp: ln 3, ln 4
    assert moe.router_z_loss(logits).item() == pytest.approx((z0 + z1) / 2, rel=1e-6)
    assert moe.router_z_loss(logits, documents=[1, 1]).item() == pytest.approx(z0 + z1, rel=1e-6)
    # one document of two tokens held in two pieces: each piece divided by the document's whole size
    pieces = [moe.router_z_loss(logits[i:i + 1], documents=[1], tokens=torch.tensor([2])) for i in range(2)]
    assert sum(pieces).item() == pytest.approx((z0 + z1) / 2, rel=1e-6)


def test_bf16_working_precision_stays_close_to_fp32():
    router, gate, up, down = _weights()
    x = torch.randn(1, N, H, generator=torch.Generator().manual_seed(18))
    logits = torch.sort(x[0] @ router.t(), -1, descending=True).values
    assert float((logits[:, 1] - logits[:, 2]).min()) > 0.5     # no near-tie that bf16 rounding could flip
    want = moe.moe_layer(x, router, gate, up, down, top_k=2)
    got = moe.moe_layer(*(t.bfloat16() for t in (x, router, gate, up, down)), top_k=2)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=3e-2 * float(want.abs().max()))
