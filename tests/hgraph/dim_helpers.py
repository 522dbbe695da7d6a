"""A test-only parallel dimension, registered through ``hgraph.dims.registered`` (never in the
production tables): ``RS<n>``, whose ranks hold the same weights and tokens (``Splits.REPLICAS``) and
reshard the activations between the blocks of a stage: each takes its share of the micro-batch's tokens
and the group all-gathers them back (numerically the identity, forward and backward). It sits between
the sequence ranks and the stages in the rank layout.

What the registry generates for it (text form, errors, rank layout, groups, bindings, coordinates,
roles, push shares, the loss share) is checked by ``tests/hgraph/test_dims.py``; training under it by
``tests/runtime/engine/test_reshard_dim.py``.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from hgraph import dims
from hgraph.dims import Dim, Splits
from hgraph.meta import CommPoint, NodeMeta, SlotKind, get_meta, set_meta
from hgraph.slots import empty_slot
from hgraph.torch_compat import all_gather_single

KEY = "rs"


def _share_gather(n: int, index: int, dim: int, sizes: list[int]):
    """The flows of the runtime's exchange (``runtime/comm/collectives.Flow``): forward, this rank's share
    of a tensor along ``dim`` all-gathered over the group into a [n, padded share] buffer (every rank
    holds the whole tensor again); backward, the gradient of this rank's own share of that buffer
    all-gathered the same way (the ranks' gradients are equal, so each gets the whole of it)."""
    from hgraph.runtime.comm.collectives import Flow

    padded, lo = max(sizes), sum(sizes[:index])

    def gather(send: torch.Tensor, recv: torch.Tensor, group) -> object:
        return all_gather_single(recv, send, group=group, async_op=True)

    def share(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = list(t.shape)
        shape[dim] = padded
        send = t.new_zeros(shape)
        send.narrow(dim, 0, sizes[index]).copy_(t.detach().narrow(dim, lo, sizes[index]))
        return send.unsqueeze(0), t.new_empty([n, *shape])

    def own_slot(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad[index].contiguous().unsqueeze(0), grad.new_empty(grad.shape)

    def whole(buf: torch.Tensor) -> torch.Tensor:
        return torch.cat([buf[i].narrow(dim, 0, s) for i, s in enumerate(sizes)], dim=dim)

    return (Flow("all_gather", "rs_reshard", share, gather, whole),
            Flow("all_gather", "rs_reshard", own_slot, gather, whole))


def rs_reshard(comm, x: torch.Tensor, key: str) -> torch.Tensor:
    """The RS group's shares of ``x``'s tokens (dim 1) gathered back: the identity, by an exchange whose
    backward is the same exchange of the gradient (the group's ranks hold the same values)."""
    if comm is None or len(comm.ranks(key)) == 1:
        return x
    from hgraph.runtime.comm.collectives import exchange
    from hgraph.runtime.comm.issuing import group_of

    ranks, group = group_of(comm, comm.ranks(key))
    dim = 1 if x.dim() > 1 else 0
    n, total = len(ranks), x.shape[dim]
    sizes = [total * (i + 1) // n - total * i // n for i in range(n)]
    forward, backward = _share_gather(n, ranks.index(comm.rank), dim, sizes)
    return comm.wait(exchange(comm, x, group, forward, backward))


def rs_reshard_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Before every value that leaves a block for a later block of the stage (its empty ``pp_boundary``
    slot), the RS group's reshard; nothing where the role's RS degree is 1."""
    if RS.degree(ctx.role.scheme) == 1:
        return gm
    comm = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.target == "comm")
    for slot in list(gm.graph.nodes):
        m = get_meta(slot)
        if slot.target is empty_slot and m.slot == SlotKind.COMM_ACTIVATION and m.comm_point == CommPoint.PP_BOUNDARY:
            with gm.graph.inserting_before(slot):
                node = gm.graph.call_function(rs_reshard, (comm, slot.args[0], KEY))
            set_meta(node, NodeMeta(block=m.block, layer=m.layer))
            slot.replace_input_with(slot.args[0], node)
    gm.recompile()
    return gm


#: the test dimension: written ``RS<n>`` after EP, between EP (layout 2.5) and PP (layout 3)
RS = Dim("rs", "RS", 2.75, "reshard", Splits.REPLICAS, key=KEY, ops=("rs_reshard",), passes=(rs_reshard_pass,))


def with_reshard():
    """The registry with ``RS`` added while the block runs."""
    return dims.registered(RS)
