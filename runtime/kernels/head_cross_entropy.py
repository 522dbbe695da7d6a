"""Cross-entropy straight from the output head's inputs: the ``[tokens, vocab]`` logits are never whole.

``head_cross_entropy_sum(hidden, weight, bias, targets, ...)`` equals
``F.cross_entropy(F.linear(hidden, weight, bias).float(), targets, reduction="sum")`` (targets
``ignore_index`` excluded) but makes the logits ``chunk`` tokens at a time and makes them again chunk
by chunk in backward to form the gradients of the hidden states, the weight and the bias. A whole
vocabulary goes through torch's own ``log_softmax`` and its backward's arithmetic (one chunk: the plain
loss's value to the bit, fp32 gradients within an ulp, bf16 gradients to the bit, measured). Peak
memory: a few ``[chunk, vocab]`` fp32 buffers instead of several ``[tokens, vocab]`` ones (logits,
their fp32 copy, the saved log-softmax, its gradient).

Vocabulary-parallel (Megatron's ``vocab_parallel_cross_entropy``, ``VocabSplit.parallel``): the
weight holds the rows ``[vocab_start, vocab_start + rows)`` of a vocabulary split over the TP group
(``vocab_local`` of them real, the rest padding); every rank computes its part of each token's max,
sum of exponentials and target log-probability, and three all-reduces (max, sum, sum) over the group
give the full values; each token's log-normaliser is kept for backward, so backward communicates
nothing. The gradient of the hidden states is then this rank's partial sum over its vocabulary rows;
the graph's Megatron f before the head (``tp_copy``) all-reduces it in backward, exactly as for the
logits of a column-parallel head. Without ``parallel`` each chunk's logits are all-gathered instead (the
communication of the plain gathered head, still one chunk of memory) for torch's ``log_softmax``.

Precision: the logits are made in the weight's dtype and upcast to fp32 as the plain loss does. Every
matmul takes the working dtype's inputs (a bf16 GEMM accumulates in fp32; an fp32 one on bf16 data
would run without tensor cores, ~10x slower on a GPU): each chunk's weight gradient is a bf16 GEMM, and
the chunks' parts are summed in fp32 (one rounding to the working dtype at the end); the bias's
gradient is summed in fp32.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

#: fp32 logits per chunk, in bytes: big enough that each chunk's matmul runs at full speed
CHUNK_BYTES = 64 * 2 ** 20


def chunk_tokens(vocab_rows: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Tokens per chunk: as many as keep one chunk's fp32 logits within ``chunk_bytes``."""
    return max(1, chunk_bytes // (4 * max(vocab_rows, 1)))


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  vocab_local: int) -> torch.Tensor:
    """fp32 logits of one chunk, padding rows of the vocabulary at -inf (they take no probability)."""
    logits = F.linear(h, weight, bias).float()
    if vocab_local < weight.shape[0]:
        logits[:, vocab_local:] = float("-inf")
    return logits


def _local_target(targets: torch.Tensor, vocab_start: int, vocab_local: int,
                  ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each target's row in this rank's vocabulary slice (0 where not held) and whether it is held."""
    local = targets - vocab_start
    held = (targets != ignore_index) & (local >= 0) & (local < vocab_local)
    return torch.where(held, local, torch.zeros_like(local)), held


@dataclass(frozen=True)
class VocabSplit:
    """A vocabulary split over a TP group in equal pieces of rows (the last padded).

    ``group``: the process group; ``order[i]``: the piece (in vocabulary order) group member ``i``
    holds; ``vocab``: the whole vocabulary; ``parallel``: Megatron's vocabulary-parallel loss (three
    all-reduces of one value per token) rather than gathering each chunk's logits and taking torch's
    ``log_softmax`` of them (the single-device loss's arithmetic to the bit, at the logits' all-gather
    cost; memory stays one chunk either way). ``issuer``: the rank's ``CollectiveIssuer``
    (``runtime/comm/order``), which issues these collectives (None: issued directly).
    """

    group: Any
    order: tuple[int, ...]
    vocab: int
    parallel: bool = True
    issuer: Any = None


def _run(split: VocabSplit, kind: str, tensor: torch.Tensor, start: Any, label: str) -> None:
    """Issue ``start()`` (an ``async_op`` collective over the split's group) and wait for it, through
    the rank's issuer when there is one."""
    if split.issuer is not None:
        split.issuer.run(kind, split.group, tensor, start, label)
    else:
        start().wait()


def _all_reduce(t: torch.Tensor, split: VocabSplit, label: str, op: Any = dist.ReduceOp.SUM) -> None:
    _run(split, "all_reduce", t, lambda: dist.all_reduce(t, op=op, group=split.group, async_op=True), label)


def _gather_chunk(logits: torch.Tensor, split: VocabSplit) -> torch.Tensor:
    """The whole vocabulary's logits of a chunk: every rank's piece, in vocabulary order, cut to ``vocab``."""
    pieces = [torch.empty_like(logits) for _ in split.order]
    mine = logits.contiguous()
    _run(split, "all_gather", mine, lambda: dist.all_gather(pieces, mine, group=split.group, async_op=True),
         "loss logits")
    ordered = [p for _, p in sorted(zip(split.order, pieces), key=lambda x: x[0])]
    return torch.cat(ordered, dim=-1).narrow(-1, 0, split.vocab)


def _log_softmax(logits: torch.Tensor,
                 split: Optional[VocabSplit]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(log_softmax of a chunk's logits, its per-token log-normaliser or None)``. A whole (or
    gathered) vocabulary takes torch's kernel (the plain loss's values); a vocabulary-parallel one is
    ``(x - max) - log sum exp(x - max)`` with the max and the sum all-reduced, in place of ``logits``."""
    if split is None:
        return torch.log_softmax(logits, dim=-1), None
    if not split.parallel:
        return torch.log_softmax(_gather_chunk(logits, split), dim=-1), None
    m = logits.max(dim=-1).values
    _all_reduce(m, split, "loss max", dist.ReduceOp.MAX)
    logits.sub_(m[:, None])
    sum_exp = logits.exp().sum(dim=-1)
    _all_reduce(sum_exp, split, "loss sum exp")
    log_sum = sum_exp.log_()
    return logits.sub_(log_sum[:, None]), m.add_(log_sum)


class _HeadCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                targets: torch.Tensor, ignore_index: int, vocab_start: int, vocab_local: int,
                split: Optional[VocabSplit], chunk: int) -> torch.Tensor:
        tokens = hidden.shape[0]
        parallel = split is not None and split.parallel
        # the log-probabilities' rows: this rank's vocabulary slice, or the whole vocabulary
        rows_start, rows = (vocab_start, vocab_local) if parallel or split is None else (0, split.vocab)
        lse = torch.empty(tokens if parallel else 0, dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for s in range(0, tokens, chunk):
            e = min(s + chunk, tokens)
            logp, norm = _log_softmax(_chunk_logits(hidden[s:e], weight, bias, vocab_local), split)
            if norm is not None:
                lse[s:e] = norm
            local, held = _local_target(targets[s:e], rows_start, rows, ignore_index)
            picked = logp.gather(1, local[:, None])[:, 0]
            target_logp = torch.where(held, picked, torch.zeros_like(picked))
            del logp
            if parallel:          # the rank holding a token's target has its value
                _all_reduce(target_logp, split, "loss target")
            total -= target_logp.sum()
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.meta = (ignore_index, vocab_start, vocab_local, split, chunk, rows_start, rows)
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        ignore_index, vocab_start, vocab_local, split, chunk, rows_start, rows = ctx.meta
        parallel = split is not None and split.parallel
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = grad_b = None
        tokens = hidden.shape[0]
        for s in range(0, tokens, chunk):
            e = min(s + chunk, tokens)
            h, t = hidden[s:e], targets[s:e]
            logits = _chunk_logits(h, weight, bias, vocab_local)
            # the forward's log-probabilities again (a vocabulary-parallel normaliser was kept)
            logp = logits.sub_(lse[s:e, None]) if parallel else _log_softmax(logits, split)[0]
            del logits
            # log_softmax's backward as torch computes it: softmax * g, then -g at the target
            # (g = grad_total for a token with a target, 0 for an ignored one)
            g_rows = (t != ignore_index).to(torch.float32) * grad_total
            probs = logp.exp_().mul_(g_rows[:, None])
            local, held = _local_target(t, rows_start, rows, ignore_index)
            # -g at each held target (a row without one adds -0 to column 0: unchanged); a scatter,
            # not indexing by held.nonzero(), which would wait for the GPU once per chunk
            probs.scatter_add_(1, local[:, None], torch.where(held, -g_rows, 0.0)[:, None])
            if split is not None and not split.parallel:     # this rank's columns (padding: no gradient)
                probs = F.pad(probs, (0, max(0, vocab_start + weight.shape[0] - split.vocab)))
                probs = probs.narrow(-1, vocab_start, weight.shape[0])
            g = probs.to(hidden.dtype)
            del probs, logp
            if grad_h is not None:
                grad_h[s:e] = g @ weight
            if need_w:     # a GEMM in the working dtype (bf16: fp32 accumulation inside, tensor cores)
                if grad_w is None:
                    grad_w = g.t() @ h               # one chunk: exactly the linear's backward
                elif h.dtype == torch.float32:
                    grad_w.addmm_(g.t(), h)
                else:                                # chunks summed in fp32
                    grad_w = grad_w.float().add_(g.t() @ h)
            if need_b and bias is not None:
                part = g.float().sum(dim=0)
                grad_b = part if grad_b is None else grad_b.add_(part)
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype), None, None, None, None, None, None)


def head_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                           targets: torch.Tensor, *, ignore_index: int = -100, vocab_start: int = 0,
                           vocab_local: Optional[int] = None, split: Optional[VocabSplit] = None,
                           chunk: Optional[int] = None) -> torch.Tensor:
    """Summed cross-entropy of ``F.linear(hidden, weight, bias)`` against ``targets``.

    ``hidden``: ``[tokens, H]``; ``weight``: ``[rows, H]`` (this rank's vocabulary rows, from
    ``vocab_start``; the first ``vocab_local`` real, all of them by default); ``targets``: ``[tokens]``
    in the whole vocabulary; ``split``: how the vocabulary is split over a TP group (None: whole).
    """
    rows = int(weight.shape[0])
    vocab_local = rows if vocab_local is None else int(vocab_local)
    chunk = chunk or chunk_tokens(rows)
    return _HeadCrossEntropy.apply(hidden, weight, bias, targets, ignore_index, int(vocab_start),
                                   vocab_local, split, int(chunk))
