"""varlen_attention on CPU equals per-document SDPA and an explicit block-diagonal causal softmax.

fp32 throughout; both references compute the same sums in a different order, so values and
gradients agree to atol 1e-5 / rtol 1e-5.
"""
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from hgraph.errors import HGraphError
from hgraph.varlen_attention import available_backend, cu_seqlens_for, position_ids_for, varlen_attention

TOL = dict(atol=1e-5, rtol=1e-5)


def _qkv(lengths, hq, hkv, d, seed):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    return [torch.randn(1, h, t, d, generator=g, requires_grad=True) for h in (hq, hkv, hkv)]


def _per_document(q, k, v, lengths, scale, gqa):
    outs, start = [], 0
    for n in lengths:
        if n:
            s = slice(start, start + n)
            outs.append(F.scaled_dot_product_attention(q[:, :, s], k[:, :, s], v[:, :, s],
                                                       is_causal=True, scale=scale, enable_gqa=gqa))
        start += n
    return torch.cat(outs, dim=2)


def _masked_softmax(q, k, v, lengths, scale, softcap=None, window=None):
    """Attention written out: scores (capped: tanh(s / c) * c), block-diagonal causal mask (within
    ``window`` keys), softmax, weighted sum."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.arange(len(doc))
    allowed = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
    if window is not None:
        allowed &= pos[:, None] - pos[None, :] < window
    scores = (q @ k.transpose(-1, -2)) * (scale or 1 / math.sqrt(q.shape[-1]))
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v


def _grads(out, tensors, seed):
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.device)
    return torch.autograd.grad((out * w).sum(), tensors)


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(1, 9), min_size=1, max_size=6),
       heads=st.sampled_from([(2, 2), (4, 2), (4, 1)]), scale=st.sampled_from([None, 0.3]),
       seed=st.integers(0, 1000))
def test_matches_documents_run_alone_and_the_masked_softmax(lengths, heads, scale, seed):
    hq, hkv = heads
    gqa = hq != hkv
    q, k, v = _qkv(lengths, hq, hkv, 8, seed)
    cu = cu_seqlens_for(lengths)
    out = varlen_attention(q, k, v, cu, scale=scale, enable_gqa=gqa)
    alone = _per_document(q, k, v, lengths, scale, gqa)
    masked = _masked_softmax(q, k, v, lengths, scale)
    torch.testing.assert_close(out, alone, **TOL)
    torch.testing.assert_close(out, masked, **TOL)
    for got, ref in zip(_grads(out, (q, k, v), seed), _grads(masked, (q, k, v), seed)):
        torch.testing.assert_close(got, ref, **TOL)


@settings(max_examples=15, deadline=None)
@given(lengths=st.lists(st.integers(1, 9), min_size=1, max_size=5), heads=st.sampled_from([(2, 2), (4, 2)]),
       softcap=st.sampled_from([None, 2.0]), window=st.sampled_from([None, 1, 3]), seed=st.integers(0, 1000))
def test_softcap_and_sliding_window_match_the_masked_softmax(lengths, heads, softcap, window, seed):
    hq, hkv = heads
    q, k, v = _qkv(lengths, hq, hkv, 8, seed)
    out = varlen_attention(q, k, v, cu_seqlens_for(lengths), scale=0.5, enable_gqa=hq != hkv, softcap=softcap,
                           window=window)
    masked = _masked_softmax(q, k, v, lengths, 0.5, softcap, window)
    torch.testing.assert_close(out, masked, **TOL)
    for got, ref in zip(_grads(out, (q, k, v), seed), _grads(masked, (q, k, v), seed)):
        torch.testing.assert_close(got, ref, **TOL)


def test_empty_documents_and_list_boundaries():
    lengths = [3, 0, 4]
    q, k, v = _qkv(lengths, 2, 2, 4, 0)
    out = varlen_attention(q, k, v, [0, 3, 3, 7])
    torch.testing.assert_close(out, _masked_softmax(q, k, v, [3, 4], None), **TOL)


def test_position_ids_restart_in_every_document():
    assert position_ids_for([0, 3, 3, 5]).tolist() == [[0, 1, 2, 0, 1]]
    assert position_ids_for(torch.tensor([0, 1, 4], dtype=torch.int32)).tolist() == [[0, 0, 1, 2]]
    assert cu_seqlens_for([2, 0, 5]).tolist() == [0, 2, 2, 7]


def test_cpu_backend_and_clear_errors():
    q, k, v = _qkv([2, 3], 4, 2, 4, 0)
    assert available_backend(q) == "sdpa_loop"
    with pytest.raises(HGraphError, match=r"must start at 0, never decrease and end at the packed length 5"):
        varlen_attention(q, k, v, [0, 3, 4], enable_gqa=True)
    with pytest.raises(HGraphError, match="need enable_gqa=True"):
        varlen_attention(q, k, v, [0, 5])
    with pytest.raises(HGraphError, match="needs fp16/bf16 CUDA tensors"):
        varlen_attention(q, k, v, [0, 5], enable_gqa=True, backend="flash_attn")
    with pytest.raises(HGraphError, match=r"expects q, k, v as \[1, H, T, D\]"):
        varlen_attention(q[0], k, v, [0, 5])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the varlen kernels need CUDA")
def test_cuda_varlen_kernel_matches_the_sdpa_loop():
    lengths = [37, 5, 64, 1, 20]
    q, k, v = (t.detach().cuda().to(torch.bfloat16).requires_grad_()
               for t in _qkv(lengths, 4, 2, 64, 0))
    cu = cu_seqlens_for(lengths, device="cuda")
    backend = available_backend(q)
    assert backend in ("flash_attn", "torch_varlen")
    out = varlen_attention(q, k, v, cu, enable_gqa=True)
    ref = varlen_attention(q, k, v, cu, enable_gqa=True, backend="sdpa_loop")
    bf16 = dict(atol=2e-2, rtol=2e-2)  # two bf16 kernels with different blockings
    torch.testing.assert_close(out, ref, **bf16)
    for got, want in zip(_grads(out.float(), (q, k, v), 0), _grads(ref.float(), (q, k, v), 0)):
        torch.testing.assert_close(got, want, **bf16)
