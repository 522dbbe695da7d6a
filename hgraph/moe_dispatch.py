"""The expert-parallel form of hgraph's MoE op (``hgraph.moe.moe_layer`` under ``EP<n>``): each rank
routes its own tokens, sends every token-expert assignment to the EP rank holding that expert
(dispatch), runs its own experts on what it received, and takes the outputs back (combine).

The EP group of ``n`` ranks holds the ``E`` experts split evenly (``hgraph.shard_rule.shard_bounds``:
EP rank ``r`` holds ``[r·E/n, (r+1)·E/n)``, ``expert_bounds``); the router is whole on every rank. Per
MoE layer and micro-batch a rank's graph runs (``moe_layer_ep`` is the same sequence as one function):

1. ``route_tokens``: logits, top-k and the renormalisation as ``moe_layer`` does; the token-expert
   assignments sorted by expert (stable), hence by destination EP rank then expert, and the rows of
   the sorted assignments (``ExpertRouting``);
2. ``ops.moe_split_exchange`` (Communicate Activation, dispatch): an all-to-all of the per-expert
   counts, so each rank learns how many rows it receives from each rank for each of its experts, read
   back to the host (``ExpertSplits``). NCCL's ``all_to_all_single`` takes its split sizes on the host,
   so this read-back (the compute stream waits for the counts) is the one host round trip per layer and
   micro-batch of the dropless exchange; device-side split sizes (an all-to-all-v whose sizes stay on
   the GPU, e.g. over torch's symmetric memory) would remove it and are left for later;
3. ``ops.moe_dispatch_issue`` + ``ops.comm_wait`` (dispatch): the variable-size all-to-all of the rows;
4. ``local_experts``: the rank's experts on the received rows, grouped by expert (the same grouped GEMM
   or loop as ``moe_layer``, ``moe.swiglu_rows``; an expert no row reached gets an exact-zero gradient);
5. ``ops.moe_combine_issue`` + ``ops.comm_wait`` (combine): the inverse all-to-all of the outputs;
6. ``combine_tokens``: on the source rank, the outputs scaled by the routing weights and summed into
   their tokens in the order ``moe_layer`` sums them (per token, its experts in expert order), then the
   run's router losses of the logits (``CommRuntime.moe_router_losses``).

The backward of each all-to-all is the reversed exchange (the dispatch's a combine-shaped all-to-all of
the rows' gradients, the combine's a dispatch-shaped one), run by autograd inside the exchange.

Dropless, and what it costs: every token reaches its ``top_k`` experts whatever their load, so the
exchanges are variable-size and no capacity factor is offered (none drops or pads a token). Per layer
and micro-batch a rank sends ``N·k`` rows of the hidden size and receives as many rows as its experts
were chosen across the group, forward and in each backward twice (dispatch and combine): the most loaded
rank's experts set the time and the memory of the received rows and their activations, which routing
alone bounds (at worst ``n·N·k`` rows). TP inside EP: each TP rank of an EP rank routes the same tokens
and exchanges with the same TP rank of the other EP ranks (its EP group), its experts' TP slices give
partial sums, and the op's TP exit reduces them as it does without EP.

A rank's rows reach an expert in source-rank order, token order inside: with the ranks' tokens in
rank order that is the order ``moe_layer`` gives one device holding all of them, so the expert GEMMs
see the same rows and the sums of each token run in the same order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch.fx import wrap

from hgraph import moe, ops
from hgraph.errors import HGraphError
from hgraph.moe import expert_layout, route, swiglu_rows
from hgraph.ops import CommRuntime, reads_host_values
from hgraph.shard_rule import shard_bounds

@dataclass(frozen=True, eq=False)
class ExpertRouting:
    """One rank's routing of its ``N`` tokens (``route_tokens``): what the exchanges send and what the
    combine sums back on this rank."""

    #: the router's logits ``[N, E]`` (the router losses read them)
    logits: torch.Tensor
    #: the routing weights ``[N, k]`` (in the tokens' dtype)
    weights: torch.Tensor
    #: the token-expert assignments (``N·k``, row-major) sorted by expert, stable: by EP rank then expert
    order: torch.Tensor
    #: the token of each sorted assignment
    token: torch.Tensor
    #: assignments per expert ``[E]`` (int64): the count exchange's send vector
    counts: torch.Tensor
    #: the sorted assignments' token rows ``[N·k, H]``: what the dispatch sends
    rows: torch.Tensor
    #: the shape of the op's input (the output's)
    shape: torch.Size
    top_k: int

    @property
    def num_experts(self) -> int:
        return int(self.counts.numel())


@dataclass(frozen=True)
class ExpertSplits:
    """What the count exchange tells a rank, on the host: the rows it sends to and receives from each
    EP rank (group order), and of those received, how many are for each of its experts."""

    #: rows to each EP rank (the dispatch's send splits, the combine's receive splits)
    send: tuple[int, ...]
    #: rows from each EP rank
    recv: tuple[int, ...]
    #: ``[source EP rank][local expert]``: the received rows of each of this rank's experts
    received: tuple[tuple[int, ...], ...]
    #: this rank's experts ``[lo, hi)``
    experts: tuple[int, int]

    @property
    def per_expert(self) -> tuple[int, ...]:
        """Rows each local expert runs on (summed over the sources)."""
        return tuple(sum(col) for col in zip(*self.received)) if self.received else ()


def expert_bounds(num_experts: int, ep_size: int) -> list[tuple[int, int]]:
    """Each EP rank's experts ``[lo, hi)``, in group order: the even split of ``hgraph.shard_rule``."""
    if not 0 < ep_size <= num_experts:
        raise HGraphError(f"expert parallelism: {num_experts} experts cannot be split over {ep_size} EP ranks "
                          "(each EP rank holds at least one expert)")
    return [shard_bounds(num_experts, r, ep_size) for r in range(ep_size)]


def exchange_splits(sent: Sequence[int], received: Sequence[int], ep_size: int, ep_index: int) -> ExpertSplits:
    """The splits of EP rank ``ep_index`` of ``ep_size`` from its per-expert counts ``sent [E]`` and the
    counts the exchange brought, ``received`` (``[source][local expert]``, flat)."""
    bounds = expert_bounds(len(sent), ep_size)
    lo, hi = bounds[ep_index]
    local = hi - lo
    if len(received) != ep_size * local:
        raise HGraphError(f"expert counts: EP rank {ep_index} of {ep_size} with experts [{lo}, {hi}) received "
                          f"{len(received)} counts, expected {ep_size * local}")
    per_source = tuple(tuple(int(c) for c in received[s * local:(s + 1) * local]) for s in range(ep_size))
    return ExpertSplits(tuple(int(sum(sent[a:b])) for a, b in bounds), tuple(sum(r) for r in per_source),
                        per_source, (lo, hi))


@wrap
@reads_host_values            # its output is no tensor: compiled regions leave the EP form eager
def route_tokens(x: torch.Tensor, router_weight: torch.Tensor, *, top_k: int,
                 normalize_top_k: bool = False) -> ExpertRouting:
    """Route this rank's tokens ``x [..., H]`` with the whole router (``moe_layer``'s routing) and sort
    the assignments by expert (module docstring, step 1)."""
    num_experts = router_weight.shape[0]
    if not 0 < top_k <= num_experts:
        raise HGraphError(f"moe_layer: top_k must be in 1..{num_experts}, got {top_k}")
    flat = x.reshape(-1, x.shape[-1])
    logits = F.linear(flat, router_weight)
    weights, experts = route(logits, top_k, normalize_top_k)
    assigned = experts.reshape(-1)
    order = torch.argsort(assigned, stable=True)
    token = order // top_k
    counts = torch.bincount(assigned, minlength=num_experts)
    return ExpertRouting(logits, weights, order, token, counts, flat.index_select(0, token), x.shape, top_k)


@wrap
@reads_host_values            # the loop reads the experts' counts on the host
def local_experts(received: torch.Tensor, splits: ExpertSplits, *expert_weights: torch.Tensor,
                  implementation: str = "auto") -> torch.Tensor:
    """This rank's experts (``expert_weights``: theirs only, in any ``moe_layer`` layout, TP slices
    under TP) on the ``received`` rows, which come source by source, each source's rows by expert; the
    outputs in the same order (what the combine sends back)."""
    w = expert_layout(expert_weights)
    lo, hi = splits.experts
    if w.num_experts != hi - lo:
        raise HGraphError(f"moe_layer under EP: this rank holds experts [{lo}, {hi}) but {w.num_experts} "
                          "experts' weights are given")
    sources, local = len(splits.received), hi - lo
    per_expert = torch.tensor(splits.per_expert, dtype=torch.int64, device=received.device)
    if sources == 1 or local == 1:             # already grouped by expert
        return swiglu_rows(received, per_expert, w, implementation)
    flat = torch.tensor([c for row in splits.received for c in row], dtype=torch.int64, device=received.device)
    expert_of_row = torch.repeat_interleave(torch.arange(sources * local, device=received.device) % local, flat)
    by_expert = torch.argsort(expert_of_row, stable=True)    # source order kept inside an expert
    out = swiglu_rows(received.index_select(0, by_expert), per_expert, w, implementation)
    back = torch.empty_like(by_expert)
    back[by_expert] = torch.arange(by_expert.numel(), device=received.device)
    return out.index_select(0, back)


@wrap
@reads_host_values            # the router losses read the micro-batch's documents
def combine_tokens(returned: torch.Tensor, routing: ExpertRouting,
                   comm: Optional[CommRuntime] = None) -> torch.Tensor:
    """The op's output ``y`` (``routing.shape``): the experts' outputs of this rank's sorted assignments
    (``returned``, what the combine brought back) scaled by their routing weights and summed into their
    tokens as ``moe_layer`` sums them; with ``comm``, the run's router losses attached."""
    out = returned * routing.weights.reshape(-1).index_select(0, routing.order).unsqueeze(-1)
    tokens = routing.weights.shape[0]
    y = returned.new_zeros((tokens, returned.shape[-1])).index_add_(0, routing.token, out).reshape(routing.shape)
    return y if comm is None else comm.moe_router_losses(y, routing.logits, routing.top_k)


#: the calls that end an MoE op in a rank graph, where its router losses attach: ``moe_layer`` itself, or
#: under EP its EP form's weighted sum, which ``passes/moe_ep`` names as the op it replaces (the model's
#: node name) and gives the op's meta
MOE_OUTPUTS = (moe.moe_layer, combine_tokens)


def moe_layer_ep(comm: Optional[CommRuntime], x: torch.Tensor, router_weight: torch.Tensor,
                 *expert_weights: torch.Tensor, top_k: int, normalize_top_k: bool = False,
                 key: str, implementation: str = "auto") -> torch.Tensor:
    """``moe_layer`` under EP as one function: the sequence a rank's graph runs (module docstring) with
    this rank's experts' weights (``expert_weights``) over the EP group ``key``."""
    routing = route_tokens(x, router_weight, top_k=top_k, normalize_top_k=normalize_top_k)
    splits = ops.moe_split_exchange(comm, routing, key)
    received = ops.comm_wait(comm, ops.moe_dispatch_issue(comm, routing, splits, key))
    out = local_experts(received, splits, *expert_weights, implementation=implementation)
    returned = ops.comm_wait(comm, ops.moe_combine_issue(comm, out, splits, key))
    return combine_tokens(returned, routing, comm)
