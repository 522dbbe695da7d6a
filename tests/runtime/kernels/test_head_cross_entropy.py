"""The output head's chunked cross-entropy equals F.cross_entropy of the whole logits (loss and the
gradients of hidden states, weight and bias; fp32 to the summation order, bf16 to bf16's rounding)
and never makes a tensor of more than one chunk's logits; the last stage's graph ends in the head op."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import hgraph
from hgraph import ops
from hgraph.frontends.zoo import llama
from hgraph.runtime.kernels.head_cross_entropy import chunk_tokens, head_cross_entropy_sum

TOKENS, HIDDEN, VOCAB = 29, 16, 40


def _case(dtype=torch.float32, bias=True):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(TOKENS, HIDDEN, generator=g).to(dtype).requires_grad_()
    w = torch.randn(VOCAB, HIDDEN, generator=g).to(dtype).requires_grad_()
    b = torch.randn(VOCAB, generator=g).to(dtype).requires_grad_() if bias else None
    t = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    t[[4, TOKENS - 1]] = -100
    return h, w, b, t


def _reference(h, w, b, t):
    loss = F.cross_entropy(F.linear(h, w, b).float(), t, ignore_index=-100, reduction="sum")
    return loss, torch.autograd.grad(loss, [x for x in (h, w, b) if x is not None])


@pytest.mark.parametrize("chunk", [1, 6, TOKENS])
@pytest.mark.parametrize("bias", [True, False])
def test_fp32_loss_and_gradients_equal_the_whole_logits(chunk, bias):
    h, w, b, t = _case(bias=bias)
    want, want_grads = _reference(h, w, b, t)
    got = head_cross_entropy_sum(h, w, b, t, chunk=chunk)
    grads = torch.autograd.grad(got * 0.5, [x for x in (h, w, b) if x is not None])  # the chain rule's factor
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-6)
    for g, r in zip(grads, want_grads):
        torch.testing.assert_close(g, 0.5 * r, atol=1e-6, rtol=1e-5)


def test_bf16_follows_the_bf16_head():
    h, w, b, t = _case(torch.bfloat16)
    want, want_grads = _reference(h, w, b, t)
    got = head_cross_entropy_sum(h, w, b, t, chunk=5)
    grads = torch.autograd.grad(got, (h, w, b))
    assert got.dtype == torch.float32 and all(g.dtype == torch.bfloat16 for g in grads)
    torch.testing.assert_close(got, want, atol=0, rtol=1e-5)    # the same bf16 logits, upcast
    for g, r in zip(grads, want_grads):   # one bf16 rounding apart (weight and bias summed in fp32 here)
        torch.testing.assert_close(g.float(), r.float(), atol=2e-2, rtol=2e-2)


class _LargestLogits(TorchDispatchMode):
    """The most elements of a tensor made with the vocabulary as its last dim (logits of some tokens;
    not the transposed weight, a view)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor) and o.dim() and o.shape[-1] == VOCAB and o.shape[:-1] != (HIDDEN,):
                self.largest = max(self.largest, o.numel())
        return out


def test_never_more_than_one_chunk_of_logits():
    h, w, b, t = _case()
    with _LargestLogits() as mode:
        head_cross_entropy_sum(h, w, b, t, chunk=4).backward()
    assert mode.largest == 4 * VOCAB < TOKENS * VOCAB
    assert chunk_tokens(128 * 1024, 64 * 2 ** 20) == 128 and chunk_tokens(10 ** 9, 1) == 1


def test_last_stage_ends_in_the_output_head_and_still_returns_logits():
    torch.manual_seed(0)
    model = llama.build("tiny")
    rp = hgraph.compile(model).instantiate("1xTP1PP2").rank(1)
    rp.load_full(dict(model.named_parameters()))
    gm = rp.graph_module
    (head,) = [n for n in gm.graph.nodes if n.target is ops.output_head]
    assert [n.op for n in head.users] == ["output"]
    linears = [n for n in gm.graph.nodes if n.target is torch.nn.functional.linear]
    assert not any("lm_head" in str(n.args[1]) for n in linears)
    first = hgraph.compile(model).instantiate("1xTP1PP2").rank(0)
    assert not any(n.target is ops.output_head for n in first.graph_module.graph.nodes)
