"""Causal attention over a packed row of several documents: no token attends across documents.

``varlen_attention(q, k, v, cu_seqlens)`` takes the SDPA layout ``[1, H, T, D]`` (one packed row;
K/V may have fewer heads with ``enable_gqa``) and document boundaries ``cu_seqlens`` (``[0, l0,
l0+l1, ..., T]``), and gives exactly what running each document alone through
``scaled_dot_product_attention(..., is_causal=True)`` gives. Backends, picked per call:

* ``flash_attn``: ``flash_attn.flash_attn_varlen_func`` (CUDA, fp16/bf16, when installed);
* ``torch_varlen``: ``torch.nn.attention.varlen.varlen_attn`` (CUDA, fp16/bf16, when this torch has it;
  called through ``hgraph.torch_compat``, since its keywords changed between releases);
* ``sdpa_loop``: one SDPA call per document (everywhere else; the fastest exact path on CPU, where
  a block-diagonal mask is several times slower and FlexAttention has no backward).

All are differentiable. ``position_ids_for(cu_seqlens)`` gives the per-document positions 0..l-1
that a packed step passes to the model. ``DocumentBounds`` holds boundaries known on the host with
their copy on the device: a varlen kernel given one reads nothing back from the GPU, where boundaries
given as a device tensor cost a synchronisation per call (the GPU then idles while Python catches up).

Two variants of the scores, as models write them: ``softcap`` (Gemma-2's logit capping,
``tanh(s / c) * c`` of the scaled scores) and ``window`` (sliding-window attention: a query sees the
``window`` keys up to and including its own position, Hugging Face's ``sliding_window``). flash-attn
has both; elsewhere ``masked_attention`` computes them per document with the math of eager attention.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F

from hgraph.errors import HGraphError
from hgraph.torch_compat import has_torch_varlen, torch_varlen_attention

CuSeqlens = Union[torch.Tensor, Sequence[int]]
BACKENDS = ("flash_attn", "torch_varlen", "sdpa_loop")


@dataclass(frozen=True, eq=False)
class DocumentBounds:
    """A packed row's document boundaries ``cu`` (host ints, no empty document) with the same as an
    int32 tensor on the row's device and the longest document's length."""

    cu: tuple[int, ...]
    device_cu: torch.Tensor
    max_len: int

    @classmethod
    def of(cls, doc_lengths: Sequence[int], device: Optional[torch.device] = None) -> "DocumentBounds":
        """The boundaries of documents packed in this order, copied to ``device`` once, without
        waiting (from pinned memory on CUDA)."""
        lengths = [int(n) for n in doc_lengths]
        if any(n < 0 for n in lengths):
            raise HGraphError(f"document lengths must be >= 0, got {lengths}")
        cu = [0]
        for n in lengths:
            if n:
                cu.append(cu[-1] + n)
        if len(cu) == 1:
            cu.append(0)
        on_device = torch.tensor(cu, dtype=torch.int32)
        if device is not None and torch.device(device).type == "cuda":
            on_device = on_device.pin_memory().to(device, non_blocking=True)
        return cls(tuple(cu), on_device, max(b - a for a, b in zip(cu, cu[1:])))


def boundaries(cu_seqlens: CuSeqlens, total: int, where: str = "cu_seqlens") -> list[int]:
    """``cu_seqlens`` as a list of ints, checked: starts at 0, never decreases, ends at ``total``."""
    cu = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else [int(c) for c in cu_seqlens]
    if (len(cu) < 2 or cu[0] != 0 or cu[-1] != total
            or any(b < a for a, b in zip(cu, cu[1:]))):
        raise HGraphError(f"{where} {cu} must start at 0, never decrease and end at the packed "
                          f"length {total}")
    return cu


def cu_seqlens_for(doc_lengths: Sequence[int], device: Optional[torch.device] = None) -> torch.Tensor:
    """Cumulative boundaries ``[0, l0, l0+l1, ...]`` (int32) of documents packed in this order."""
    lengths = [int(n) for n in doc_lengths]
    if any(n < 0 for n in lengths):          # checked on the host ints, not on a tensor
        raise HGraphError(f"document lengths must be >= 0, got {lengths}")
    return F.pad(torch.cumsum(torch.as_tensor(lengths, dtype=torch.int32), 0, dtype=torch.int32), (1, 0)).to(device)


def position_ids_for(cu_seqlens: CuSeqlens, device: Optional[torch.device] = None) -> torch.Tensor:
    """Positions restarting at 0 in every document: shape ``[1, T]``, int64."""
    cu = torch.as_tensor(cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens,
                         dtype=torch.int64)
    total = int(cu[-1]) if len(cu) else 0
    boundaries(cu, total)
    lengths = cu[1:] - cu[:-1]
    starts = torch.repeat_interleave(cu[:-1], lengths)
    return (torch.arange(total, dtype=torch.int64) - starts).unsqueeze(0).to(device)


def available_backend(q: torch.Tensor) -> str:
    """The backend ``varlen_attention`` uses for ``q``."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        if importlib.util.find_spec("flash_attn") is not None:
            return "flash_attn"
        if has_torch_varlen():
            return "torch_varlen"
    return "sdpa_loop"


def _check_layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool) -> None:
    if q.dim() != 4 or q.shape[0] != 1 or k.dim() != 4 or v.dim() != 4:
        raise HGraphError(f"varlen_attention expects q, k, v as [1, H, T, D] (one packed row), got "
                          f"{list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    if k.shape != v.shape or k.shape[2] != q.shape[2] or k.shape[3] != q.shape[3]:
        raise HGraphError(f"varlen_attention: k {list(k.shape)} and v {list(v.shape)} must match q "
                          f"{list(q.shape)} in T and D")
    hq, hkv = q.shape[1], k.shape[1]
    if hkv != hq and not (enable_gqa and hq % hkv == 0):
        raise HGraphError(f"varlen_attention: {hq} query heads and {hkv} key/value heads need "
                          "enable_gqa=True and a head count that divides evenly")


def allowed_keys(q_pos: torch.Tensor, k_pos: torch.Tensor, window: Optional[int] = None) -> torch.Tensor:
    """``[q, k]`` bool: key positions a query sees, causal and within ``window`` keys when given."""
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed = allowed & (q_pos[:, None] - k_pos[None, :] < window)
    return allowed


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                     scale: Optional[float] = None, enable_gqa: bool = False,
                     softcap: Optional[float] = None, dropout_p: float = 0.0) -> torch.Tensor:
    """``softmax(cap(q @ k^T * scale), masked by allowed) @ v`` on ``[B, H, Tq, D]`` (eager attention's
    math; without ``softcap``, SDPA with the boolean mask), the probabilities dropped with
    ``dropout_p`` as SDPA does. Every query must see at least one key."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout_p, scale=scale,
                                              enable_gqa=enable_gqa)
    if k.shape[-3] != q.shape[-3]:
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = (q @ k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    return F.dropout(torch.softmax(scores.float(), dim=-1).to(q.dtype), dropout_p) @ v


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens: Union[CuSeqlens, DocumentBounds], *,
                     scale: Optional[float] = None, enable_gqa: bool = False,
                     backend: Optional[str] = None, softcap: Optional[float] = None,
                     window: Optional[int] = None) -> torch.Tensor:
    """Causal attention inside each document of the packed row; output ``[1, H, T, D]``.

    ``backend`` forces one of ``BACKENDS`` (default: ``available_backend(q)``; PyTorch's varlen
    kernel is used for plain causal attention only). ``cu_seqlens`` as ``DocumentBounds`` spares the
    varlen kernels reading boundaries back from the device.
    """
    _check_layout(q, k, v, enable_gqa)
    total = q.shape[2]
    known = cu_seqlens if isinstance(cu_seqlens, DocumentBounds) else None
    cu = boundaries(known.cu if known is not None else cu_seqlens, total)
    backend = backend or available_backend(q)
    if backend == "torch_varlen" and (softcap is not None or window is not None):
        backend = "sdpa_loop"
    if backend == "sdpa_loop":
        if softcap is None and window is None:
            return _sdpa_loop(q, k, v, cu, scale, enable_gqa)
        return _masked_loop(q, k, v, cu, scale, enable_gqa, softcap, window)
    if backend not in BACKENDS:
        raise HGraphError(f"varlen_attention: unknown backend {backend!r}; use one of {BACKENDS}")
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        raise HGraphError(f"varlen_attention: backend {backend!r} needs fp16/bf16 CUDA tensors, "
                          f"got {q.dtype} on {q.device}")
    # [1, H, T, D] -> [T, H, D], the packed layout of the varlen kernels
    q_, k_, v_ = (t[0].transpose(0, 1).contiguous() for t in (q, k, v))
    if known is not None and known.device_cu.device == q.device:
        cu_t, max_len = known.device_cu, known.max_len
    else:
        cu_t = torch.as_tensor(cu, dtype=torch.int32, device=q.device)
        max_len = max(b - a for a, b in zip(cu, cu[1:]))
    if backend == "flash_attn":
        from flash_attn import flash_attn_varlen_func  # GQA is native: H % H_kv == 0
        out = flash_attn_varlen_func(q_, k_, v_, cu_t, cu_t, max_len, max_len, dropout_p=0.0,
                                     softmax_scale=scale, causal=True, softcap=softcap or 0.0,
                                     window_size=(-1, -1) if window is None else (window - 1, 0))
    else:
        out = torch_varlen_attention(q_, k_, v_, cu_t, max_len, scale)
    return out.transpose(0, 1).unsqueeze(0)


def _sdpa_loop(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int],
               scale: Optional[float], enable_gqa: bool) -> torch.Tensor:
    outs = [F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True,
                                           scale=scale, enable_gqa=enable_gqa)
            for a, b in zip(cu, cu[1:]) if b > a]
    if not outs:  # an empty row
        return q.new_empty(q.shape[:3] + (v.shape[3],))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def _masked_loop(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int], scale: Optional[float],
                 enable_gqa: bool, softcap: Optional[float], window: Optional[int]) -> torch.Tensor:
    outs = []
    for a, b in zip(cu, cu[1:]):
        if b > a:
            pos = torch.arange(b - a, device=q.device)
            outs.append(masked_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], allowed_keys(pos, pos, window),
                                         scale, enable_gqa, softcap))
    if not outs:
        return q.new_empty(q.shape[:3] + (v.shape[3],))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
