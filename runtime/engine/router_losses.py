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
* ``"global-batch"``: ``E * sum_e f_e * sum_t p_te`` per layer over every token of the mini-batch, with
  ``f`` from the layer's routing counts over the whole mini-batch (every rank, pipeline and micro-batch of
  the step). The first backward needs every micro-batch's counts, which 1F1B does not have, so the
  executor runs a forward-only counting pass first (``counting``: the step's micro-batches, inputs and
  dropout keys, no grad; each MoE op adds its ``[E]`` counts to its row of a ``[MoE ops, E]`` matrix)
  and sums the matrix over the world in one all-reduce (``moe counts global``) before the step's
  forwards read it (``use_global_counts``). A rank's op is a row of the model's MoE ops (``MoeOps``,
  found by node name: every stage's graph keeps the model's names). No strategy changes it; it costs one
  more forward per step;
* z-loss: ``sum_t logsumexp(logits_t)^2``.

A recomputed block (``engine/recompute``) replays the op in backward, its count all-reduce included (as
the block's other collectives), so it saves what the forward saved; the replay's values are not counted.

TP ranks that run the op on the same tokens (its experts sharded) compute the same terms: each adds
``1 / TP`` of the gradient (the router's gradient is summed over the TP ranks as a partial sum, the
input's by the TP entry's backward) and of the value. In the global counts each token is counted once
(``counts_routing``): by the first of the ranks along a dimension that splits the weights (unless the op
runs on their token slices) and of the replicas; ranks that hold other tokens (sequence ranks, other
pipelines) add their own.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
import torch.fx as fx

from hgraph import moe
from hgraph.dims import BindingKey
from hgraph.errors import HGraphError
from hgraph.meta import get_meta
from hgraph.moe import load_balancing_sum
from hgraph.moe_dispatch import MOE_OUTPUTS
from hgraph.runtime.comm.moe_counts import token_holder_keys
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

    @property
    def global_batch(self) -> bool:
        """The load balancing is over the global batch: a step needs the counting pass."""
        return self.aux_loss == "global-batch" and self.aux_coef != 0.0


@dataclass(frozen=True)
class MoeOps:
    """A rank graph's MoE ops in node order (the order a forward calls them): each one's row in the
    model's ``[MoE ops, E]`` count matrix and its layer (a recomputed block's replay names its layer)."""

    rows: tuple[int, ...]
    layers: tuple[Optional[int], ...]
    num_rows: int            # the model's MoE ops
    num_experts: int         # the widest router's experts (the matrix's columns)

    def of_layer(self, layer: Optional[int]) -> tuple[int, ...]:
        return tuple(r for r, lay in zip(self.rows, self.layers) if lay == layer)


def moe_ops_of(model: fx.GraphModule, graph: fx.GraphModule) -> MoeOps:
    """``graph``'s (a rank's stage graph) MoE ops as rows of the model's (``model``: the traced whole
    model, whose node names every stage graph keeps)."""
    names, experts = [], 0
    for n in model.graph.nodes:
        if n.target is moe.moe_layer:
            names.append(n.name)
            experts = max(experts, _router_rows(model, n))
    row = {name: i for i, name in enumerate(names)}
    # under EP the op's EP form ends in its weighted sum, which keeps the op's node name (``MOE_OUTPUTS``)
    mine = [n for n in graph.graph.nodes if n.target in MOE_OUTPUTS]
    return MoeOps(tuple(row[n.name] for n in mine), tuple(get_meta(n).layer for n in mine), len(names), experts)


def _router_rows(model: fx.GraphModule, node: fx.Node) -> int:
    """The experts the router of MoE op ``node`` scores (its weight's rows), from the traced shapes."""
    w = node.args[1]
    while isinstance(w, fx.Node) and w.op != "get_attr":       # past slot nodes, to the parameter
        w = next((a for a in w.args if isinstance(a, fx.Node)), None)
    if w is None:
        raise HGraphError(f"global-batch load balancing: the router weight of MoE op {node.name} is not a "
                          "parameter of the traced model; use --moe-aux-loss per-document")
    *path, leaf = w.target.split(".")
    owner = model
    for part in path:
        owner = getattr(owner, part)
    return int(getattr(owner, leaf).shape[0])


def counts_routing(tp_rank: int, replica: int, sliced: bool) -> bool:
    """Whether a rank's routing counts of an MoE op enter the global counts, each token once: ranks
    along the dimension that splits the weights route the same tokens (unless the op runs on their
    token slices, ``sliced``), as replicas do, so the first of them counts; ranks that split tokens
    (sequence ranks), stages, or hold other documents (other pipelines) count their own
    (``hgraph.strategy.RankCoord``: a rank's places by what each dimension splits)."""
    return (sliced or tp_rank == 0) and replica == 0


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
    (``values``, this rank's share, summed over the world with the loss by the executor)."""

    def __init__(self, config: RouterLossConfig):
        self.config = config
        self._parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._replays: list[list[int]] = []     # per replay in progress: its layer's rows still to come
        # the global-batch form (``config.global_batch``): the rank's MoE ops, the counting pass's matrix
        # (None outside it), the step's global counts, and the forward in progress (its view, next op)
        self._ops: Optional[MoeOps] = None
        self._place = (0, 0)                    # this rank's (weight rank, replica): ``counts_routing``
        self._counting: Optional[torch.Tensor] = None
        self._global: Optional[torch.Tensor] = None
        self._view: Any = None
        self._next = 0

    @property
    def global_batch(self) -> bool:
        return self.config.global_batch

    @contextlib.contextmanager
    def replaying(self, layer: Optional[int] = None) -> Iterator[None]:
        """A recomputed block's replay in backward (``engine/recompute``) of ``layer``: its losses (and
        their count all-reduce, which the block's TP x CP ranks replay alike) were counted by its
        forward; under the global form its ops read their rows again."""
        self._replays.append(list(self._ops.of_layer(layer)) if self._ops is not None else [])
        try:
            yield
        finally:
            self._replays.pop()

    def begin_step(self) -> None:
        self._parts = []
        self._global = None

    @contextlib.contextmanager
    def counting(self, ops: MoeOps, tp_rank: int, replica: int, device: torch.device) -> Iterator[torch.Tensor]:
        """The global form's counting pass (run forward-only inside): each MoE op this rank runs adds
        its routing counts (``counts_routing``) to its row of the ``[MoE ops, E]`` int64 matrix yielded,
        and hands its output back alone."""
        self._ops, self._place = ops, (tp_rank, replica)
        self._counting = torch.zeros(ops.num_rows, ops.num_experts, dtype=torch.int64, device=device)
        self._view = None
        try:
            yield self._counting
        finally:
            self._counting = None
            self._view = None

    def use_global_counts(self, counts: torch.Tensor) -> None:
        """The step's routing counts of every MoE op over the mini-batch (the counting pass's matrix
        summed over the world), which the step's forwards read."""
        self._global = counts
        self._view = None

    def _row(self, comm: Any) -> int:
        """The model row of the MoE op calling now: the next of the forward in progress (a new
        micro-batch view starts a forward), or of the block a replay runs."""
        if self._replays:
            return self._replays[-1].pop(0)
        if comm is not self._view:
            self._view, self._next = comm, 0
        self._next += 1
        return self._ops.rows[self._next - 1]

    def values(self) -> tuple[float, float]:
        """(load-balancing, z-loss) of this rank's share of the step, before their coefficients."""
        if not self._parts:
            return 0.0, 0.0
        aux = sum(float(a) for a, _ in self._parts)
        z = sum(float(b) for _, b in self._parts)
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
        if self._counting is not None:
            row = self._row(comm)
            if counts_routing(*self._place, sliced):     # the step's forward routes these tokens alike
                experts = torch.topk(torch.softmax(logits, -1, dtype=torch.float32), top_k, -1).indices
                self._counting[row, :logits.shape[-1]] += torch.bincount(experts.reshape(-1),
                                                                         minlength=logits.shape[-1])
            return y
        if sliced:
            keys = keys.narrow(*comm.token_slice(BindingKey.TP, keys.documents.numel()))
        share = 1.0 if sliced else 1.0 / len(tp_ranks)
        scale = share / comm.num_targets
        total = logits.new_zeros((), dtype=torch.float32)
        aux = z = total.detach()
        if cfg.aux_loss != "none" and cfg.aux_coef != 0.0:
            num_experts = logits.shape[-1]
            if cfg.aux_loss == "per-document" and keys is not None:
                segment, docs = _document_segments(keys, logits.device)
            else:
                segment, docs = torch.zeros(n, dtype=torch.long, device=logits.device), 1
            if cfg.aux_loss == "global-batch":
                if self._global is None:
                    raise RuntimeError("router losses: the global-batch form ran a forward without the "
                                       "step's counting pass (Executor.step runs it)")
                counts = self._global[self._row(comm), :num_experts].unsqueeze(0)
            else:
                experts = torch.topk(torch.softmax(logits.detach(), -1, dtype=torch.float32), top_k, -1).indices
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
    """``counts`` summed over the ranks that hold other tokens of this micro-batch (``token_holder_keys``)
    (forward only: counts have no gradient)."""
    for key in token_holder_keys(sliced):
        ranks = tuple(comm.bindings.get(key, (comm.rank,)))
        if len(ranks) < 2:
            continue
        group = comm.groups.get(ranks)
        comm.issuer.run("all_reduce", group, counts,
                        lambda group=group: dist.all_reduce(counts, group=group, async_op=True),
                        f"moe counts {key}")
    return counts


def router_losses(config: Optional[RouterLossConfig]) -> Optional[RouterLosses]:
    """A rank's router losses for ``config``, or None when the run adds none."""
    return RouterLosses(config) if config is not None and config.active else None
