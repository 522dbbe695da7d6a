"""The MoE router losses of a training step: the load-balancing loss and the router z-loss added to the
training loss (``[model] moe-aux-loss``, ``moe-aux-loss-coef``, ``moe-z-loss-coef``).

Each MoE op of a rank's graph hands its router logits to the micro-batch's context
(``moe.moe_layer(..., comm=...)`` -> ``CommContext.moe_router_losses`` -> ``RouterLosses.add``), which
computes this rank's share of the layer's losses and adds their gradient to the op's output's backward
(as Megatron's ``MoEAuxLossAutoScaler``): every pipeline stage backpropagates its own layers' losses, and
the cross-entropy's backward is unchanged. Both losses are sums of per-token terms divided by the
mini-batch's number of targets, the cross-entropy's normalisation (``docs/architecture.md``, loss), so any
micro-batch split adds up to the one-device value:

* load balancing, ``"per-document"``: ``E * sum_e f_de * sum_{t in d} p_te`` per document ``d``
  (``hgraph.moe.load_balancing_sum``: each document's Switch loss times its token count), with ``f_d``
  from the document's routing counts over all its tokens, which the ranks holding its pieces (CP, Ulysses,
  and the TP ranks when the op runs on a TP rank's token slice) sum by one forward-only all-reduce of a
  ``[documents, E]`` matrix per layer and micro-batch, through the rank's collective issuer. No strategy
  changes it;
* ``"hf"``: Hugging Face's ``load_balancing_loss_func`` (a product of means, its fractions summing to
  ``k``) over the tokens as this rank holds them (the micro-batch's, or a CP / Ulysses rank's piece),
  times their count: it changes with the micro-batch split and the strategy;
* ``"global-batch"`` needs every micro-batch's counts before the first backward (``hgraph.moe``'s note on
  the forms): refused when the run's config is made;
* z-loss: ``sum_t logsumexp(logits_t)^2``.

A recomputed block (``engine/recompute``) replays the op in backward, its count all-reduce included (as
the block's other collectives), so it saves what the forward saved; the replay's values are not counted.

TP ranks that run the op on the same tokens (its experts sharded) compute the same terms: each adds
``1 / TP`` of the gradient (the router's gradient is summed over the TP ranks as a partial sum, the
input's by the TP entry's backward) and of the value.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from hgraph.dims import BindingKey
from hgraph.moe import load_balancing_sum
from hgraph.runtime.data.micro_batch import is_placeholder

#: the forms of ``[model] moe-aux-loss``
AUX_LOSS_FORMS = ("none", "per-document", "hf", "global-batch")


@dataclass(frozen=True)
class RouterLossConfig:
    """What a run adds to its loss for the MoE routers: the load-balancing form and its coefficient, and
    the z-loss coefficient (0: none)."""

    aux_loss: str = "none"
    aux_coef: float = 0.0
    z_coef: float = 0.0

    @property
    def active(self) -> bool:
        return (self.aux_loss != "none" and self.aux_coef != 0.0) or self.z_coef != 0.0


class _AddLossGradient(torch.autograd.Function):
    """``y`` unchanged; its backward also backpropagates ``loss`` (a scalar of the same graph) with
    gradient one, so a loss made inside a pipeline stage reaches its parameters in that stage's backward."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(loss)
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (loss,) = ctx.saved_tensors
        return grad, torch.ones_like(loss)


class RouterLosses:
    """A rank's router losses over one step: ``add`` per MoE op and micro-batch, the step's values
    (``values``, this rank's share, summed over the world by the executor)."""

    def __init__(self, config: RouterLossConfig):
        self.config = config
        self._parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._replays = 0

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        """A recomputed block's replay in backward (``engine/recompute``): its losses (and their count
        all-reduce, which the block's TP x CP ranks replay alike) were counted by its forward."""
        self._replays += 1
        try:
            yield
        finally:
            self._replays -= 1

    def begin_step(self) -> None:
        self._parts = []

    def values(self) -> tuple[float, float]:
        """(load-balancing, z-loss) of this rank's share of the step, before their coefficients."""
        if not self._parts:
            return 0.0, 0.0
        aux = sum(float(a) for a, _ in self._parts)
        z = sum(float(b) for _, b in self._parts)
        self._parts = []
        return aux, z

    def add(self, comm: Any, y: torch.Tensor, logits: torch.Tensor, top_k: int) -> torch.Tensor:
        """``y`` with this layer's router losses' gradient attached (module docstring)."""
        cfg = self.config
        keys = comm.token_keys
        if comm.evaluating or not cfg.active or comm.num_targets < 1:
            return y
        if keys is not None and is_placeholder(keys.doc_ids):
            return y     # an EP rank without documents (so are the ranks it would sum counts with): no loss
        n = logits.shape[0]
        tp_ranks = tuple(comm.bindings.get(BindingKey.TP, (comm.rank,)))
        sliced = keys is not None and keys.documents.numel() != n     # a TP rank's token slice (SP)
        if sliced:
            keys = keys.narrow(*comm.token_slice(BindingKey.TP, keys.documents.numel()))
        share = 1.0 if sliced else 1.0 / len(tp_ranks)
        scale = share / comm.num_targets
        total = logits.new_zeros((), dtype=torch.float32)
        aux = z = total.detach()
        if cfg.aux_loss != "none" and cfg.aux_coef != 0.0:
            experts = torch.topk(torch.softmax(logits.detach(), -1, dtype=torch.float32), top_k, -1).indices
            num_experts = logits.shape[-1]
            if cfg.aux_loss == "per-document" and keys is not None:
                segment, docs = _document_segments(keys, logits.device)
            else:
                segment, docs = torch.zeros(n, dtype=torch.long, device=logits.device), 1
            index = (segment.unsqueeze(-1) * num_experts + experts).reshape(-1)
            counts = torch.bincount(index, minlength=docs * num_experts).reshape(docs, num_experts)
            if cfg.aux_loss == "per-document":
                counts = _sum_over_token_holders(comm, counts, sliced)
            aux = load_balancing_sum(logits, top_k, segment, counts)
            if cfg.aux_loss == "hf":
                aux = aux * top_k        # HF's f is each top-k slot's token fraction: its f sums to k, not 1
            total = total + cfg.aux_coef * aux
        if cfg.z_coef != 0.0:
            z = torch.logsumexp(logits.float(), dim=-1).square().sum()
            total = total + cfg.z_coef * z
        if not self._replays:
            self._parts.append(((aux.detach() * scale).double(), (z.detach() * scale).double()))
        return _AddLossGradient.apply(y, total * scale)


def _document_segments(keys: Any, device: torch.device) -> tuple[torch.Tensor, int]:
    """Each local token's document as its place in the micro-batch (``[N]``), and the number of documents."""
    ids = torch.tensor(keys.doc_ids, dtype=torch.int64)
    ordered, order = ids.sort()
    place = order[torch.searchsorted(ordered, keys.documents.to(torch.int64).cpu())]
    return place.to(device), len(keys.doc_ids)


def _sum_over_token_holders(comm: Any, counts: torch.Tensor, sliced: bool) -> torch.Tensor:
    """``counts`` summed over the ranks that hold other tokens of this micro-batch: its CP and Ulysses
    groups, and its TP group when the op runs on a TP rank's token slice (forward only: counts have no
    gradient)."""
    keys = [BindingKey.CP, BindingKey.UL] + ([BindingKey.TP] if sliced else [])
    for key in keys:
        ranks = tuple(comm.bindings.get(key, (comm.rank,)))
        if len(ranks) < 2:
            continue
        group = comm.groups.get(ranks)
        comm.issuer.run("all_reduce", group, counts,
                        lambda group=group: dist.all_reduce(counts, group=group, async_op=True),
                        f"moe counts {key.value}")
    return counts


def router_losses(config: Optional[RouterLossConfig]) -> Optional[RouterLosses]:
    """A rank's router losses for ``config``, or None when the run adds none."""
    return RouterLosses(config) if config is not None and config.active else None
