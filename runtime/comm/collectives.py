"""The collectives behind the per-rank graphs' comm ops: each collective is an ISSUE and a WAIT.

The graphs call the op vocabulary of ``hgraph.ops``, which calls the rank's ``CommContext``
(``runtime/comm/context``), which resolves binding keys to ranks and calls the functions here. Every
function takes that context first (no globals), and issues through its ``issuer``, the rank's one
choke point (``runtime/comm/order/issue``: the record, the strict order), by way of
``runtime/comm/issuing`` (issue, wait, the work in flight). An issue op starts the collective with
``async_op=True`` (on CUDA on the context's dedicated comm stream, after that stream waited for the
compute stream) and registers the work under the tensor it returns; ``comm_wait(comm, t)`` waits for
it (making the compute stream wait for the comm stream on CUDA) and returns the finished tensor. So a
schedule is a node order: whatever sits between issue and wait overlaps with the communication.

Every group collective is one mechanism, ``exchange(comm, x, group, forward, backward)``: an autograd
Function that issues its ``forward`` ``Flow`` (the buffers, the collective, what the received buffer
means) and runs its ``backward`` flow, the reversed exchange, on the gradient. A pattern is a pair of
flows (identity / all-reduce, all-gather / slice or reduce-scatter, reduce-scatter / all-gather,
all-to-all / the reversed all-to-all), written once; the group is the dimension's, which the context
resolved from the graph's binding key (``hgraph.dims``). The context is typed by what the collectives
need of it (``Issuing``). Autograd (all ops are differentiable):

* ``tp_copy_issue``  (Megatron f): forward identity, backward all-reduce (sum) of the gradient.
* ``tp_reduce_issue`` (Megatron g): forward all-reduce (sum), backward identity.
* ``tp_gather_issue``: forward all-gather along ``dim`` (uneven ``sizes`` allowed, pieces ordered as
  ``ranks`` is), backward: this rank's slice of the gradient (the gathered tensor is replicated).
* ``sp_scatter_issue`` (sequence parallelism, the exit of a TP region): forward reduce-scatter (sum) along
  the token dim, uneven slices allowed; backward all-gather of the gradient's slices.
* ``sp_gather_issue`` (the enter of a TP region): forward all-gather of the token slices; backward
  reduce-scatter (each TP rank's column-parallel linear gives a partial gradient of every token).
* ``sp_gathered_linear``: the linear of that all-gathered input, keeping only the rank's slice for
  backward and gathering it again there for the weight's gradient (Megatron).
* ``ulysses_to_heads_issue`` / ``ulysses_to_tokens_issue`` (Ulysses sequence parallelism): all-to-all
  from this rank's tokens with all its heads to every rank's tokens with ``1/n`` of the heads, and back,
  issued on the comm stream and finished by ``comm_wait``; the backward of each is the reversed
  exchange.
* ``pp_send`` returns a scalar token; back-propagating the token receives dL/dx from ``dst``. On a
  micro-batch view with ``defer_sends`` (1F1B's steady state: a backward follows the forward) the send
  waits for that backward's gradient receive and goes with it as one batch (``flush_deferred``).
* ``pp_recv`` returns a tensor that requires grad; its backward sends the gradient back to ``src``.

Backward communication runs inside the autograd engine, so it is issued and completed there
(gradient sends are asynchronous and collected by ``CommContext.wait_all``). With one rank in
``ranks`` every TP op is the identity, so single-process graphs need no process group
(``CommContext.single()``). The executor calls ``comm.wait_all()`` at the end of a step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from hgraph import torch_compat
from hgraph.errors import HGraphError
from hgraph.runtime.comm import p2p
from hgraph.runtime.comm.issuing import (Group, Holder, Issuing, PendingWork, comm_stream_scope, comm_wait, group_of,
                                         issue, run_now)
from hgraph.shard_rule import shard_bounds, shard_sizes

# Single-tensor all-gather / reduce-scatter under this torch's names (``hgraph.torch_compat``)
all_gather_single, reduce_scatter_single = torch_compat.all_gather_single, torch_compat.reduce_scatter_single


# ---- one mechanism: an exchange and its reverse ---------------------------------------------------
@dataclass(frozen=True)
class Flow:
    """One direction of an exchange over a group: the buffers a tensor is sent from and received into
    (``buffers``: tensor -> (send, recv); the same tensor for an in-place collective), the collective
    that moves them (``start``: (send, recv, group) -> work, issued with ``async_op=True``; None: no
    communication, the direction is local), what the received buffer means (``result``), and how the
    rank's issuer records it (``kind``, ``label``)."""

    kind: str
    label: str
    buffers: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    start: Optional[Callable[[torch.Tensor, torch.Tensor, Group], dist.Work]]
    result: Callable[[torch.Tensor], torch.Tensor] = lambda t: t


#: the direction that does nothing (Megatron f's forward, g's backward)
IDENTITY = Flow("identity", "", lambda t: (t, t), None)


def _all_reduce(label: str) -> Flow:
    """An all-reduce (sum) of a copy of the tensor."""
    def buffers(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        buf = t.detach().contiguous().clone()
        return buf, buf
    return Flow("all_reduce", label, buffers, lambda send, recv, group: dist.all_reduce(
        send, group=group, async_op=True))


class _Exchange(torch.autograd.Function):
    """``forward`` flow issued (the caller registers its work; ``comm_wait`` finishes it with the flow's
    ``result``), ``backward`` flow run at once on the gradient: the reversed exchange."""

    @staticmethod
    def forward(ctx, x, comm, group, forward, backward, holder):
        ctx.comm, ctx.group, ctx.flow = comm, group, backward
        if forward.start is None:
            holder.pending = None
            return x.view_as(x)
        send, recv = forward.buffers(x)
        holder.pending = issue(comm, [send] if send is recv else [send, recv],
                               lambda: forward.start(send, recv, group), (forward.kind, group, send, forward.label),
                               forward.result)
        return recv

    @staticmethod
    def backward(ctx, grad):
        flow = ctx.flow
        if flow.start is not None:
            send, recv = flow.buffers(grad)
            run_now(ctx.comm, [send] if send is recv else [send, recv], lambda: flow.start(send, recv, ctx.group),
                    (flow.kind, ctx.group, send, f"{flow.label} backward"))
            grad = recv
        return flow.result(grad), None, None, None, None, None


def exchange(comm: Issuing, x: torch.Tensor, group: Group, forward: Flow, backward: Flow) -> torch.Tensor:
    """``forward`` of ``x`` over ``group``, issued (``comm_wait`` gives its result), whose gradient takes
    ``backward``: every collective below is one of these."""
    holder = Holder()
    out = _Exchange.apply(x, comm, group, forward, backward, holder)
    if holder.pending is not None:
        comm.register(out, holder.pending)
    return out


# ---- Megatron f / g ------------------------------------------------------------------------------
def tp_copy_issue(comm: Issuing, x: torch.Tensor, ranks: Sequence[int]) -> torch.Tensor:
    """Megatron f: identity forward; backward all-reduces (sums) dL/dx over ``ranks``."""
    key, group = group_of(comm, ranks)
    if len(key) == 1:
        return x
    return exchange(comm, x, group, IDENTITY, _all_reduce("tp_copy"))


def tp_reduce_issue(comm: Issuing, x: torch.Tensor, ranks: Sequence[int]) -> torch.Tensor:
    """Megatron g, issue half: start the all-reduce (sum) of ``x``; ``comm_wait`` finishes it."""
    key, group = group_of(comm, ranks)
    if len(key) == 1:
        return x
    return exchange(comm, x, group, _all_reduce("tp_reduce"), IDENTITY)


# ---- all-gather ----------------------------------------------------------------------------------
def _gather_flows(n: int, index: int, dim: int, size: int, padded: int, reduce_grad: bool,
                  finish: Callable[[torch.Tensor], torch.Tensor]) -> tuple[Flow, Flow]:
    """An all-gather of ``x`` padded to ``padded`` along ``dim`` into a [n, *padded shape] buffer, and its
    reverse: with ``reduce_grad`` False (TP: the gathered tensor is used identically on every rank) this
    rank's slice of the gradient; with True (CP, SP: every rank's use contributes a partial gradient to
    every piece) the reduce-scatter (sum) of the gradient, this rank's piece."""
    def gather_buffers(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pad_shape = list(x.shape)
        pad_shape[dim] = padded
        inp = x.new_zeros(pad_shape)
        inp.narrow(dim, 0, x.shape[dim]).copy_(x)
        return inp.unsqueeze(0), x.new_empty([n, *pad_shape])

    def scatter_buffers(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        full = grad.contiguous()
        return full, full.new_empty(full.shape[1:]).unsqueeze(0)

    gather = Flow("all_gather", "gather", gather_buffers, lambda send, recv, group: all_gather_single(
        recv, send, group=group, async_op=True), finish)
    if reduce_grad:
        back = Flow("reduce_scatter", "gather", scatter_buffers, lambda send, recv, group: reduce_scatter_single(
            recv, send, group=group, async_op=True), lambda mine: mine[0].narrow(dim, 0, size))
    else:
        back = Flow("slice", "gather", lambda g: (g, g), None, lambda g: g[index].narrow(dim, 0, size))
    return gather, back


def tp_gather_issue(comm: Issuing, x: torch.Tensor, ranks: Sequence[int], dim: int,
                    sizes: Optional[Sequence[int]] = None, *, reduce_grad: bool = False) -> torch.Tensor:
    """Start the all-gather of ``x`` along ``dim`` over ``ranks``; ``comm_wait`` gives the result.

    ``sizes[i]`` is the size along ``dim`` of the piece of ``ranks[i]`` (all equal to this rank's
    when omitted); the pieces are concatenated in the order of ``ranks``.
    """
    key, group = group_of(comm, ranks)
    dim = dim % x.dim()
    ranks = [int(r) for r in ranks]
    sizes = [x.shape[dim]] * len(ranks) if sizes is None else [int(s) for s in sizes]
    if len(sizes) != len(ranks) or len(set(ranks)) != len(ranks):
        raise HGraphError(f"tp_gather_issue: {len(sizes)} sizes for ranks {ranks} (one size per "
                          "distinct rank)")
    mine = ranks.index(comm.rank)
    if sizes[mine] != x.shape[dim]:
        raise HGraphError(f"tp_gather_issue: rank {comm.rank} holds {x.shape[dim]} along dim {dim} "
                          f"but sizes say {sizes[mine]}")
    if len(key) == 1:
        return x
    order = [key.index(r) for r in ranks]

    def finish(buf: torch.Tensor) -> torch.Tensor:
        return torch.cat([buf[i].narrow(dim, 0, s) for i, s in zip(order, sizes)], dim=dim)

    flows = _gather_flows(len(key), key.index(comm.rank), dim, x.shape[dim], max(sizes), reduce_grad, finish)
    return exchange(comm, x, group, *flows)


def cp_gather_issue(comm: Issuing, x: torch.Tensor, ranks: Sequence[int], dim: int,
                    sizes: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Context parallelism: start the all-gather of K or V along the sequence ``dim`` over the CP group.

    Backward reduce-scatters the gradient (each rank's queries give a partial gradient of every
    rank's keys). ``comm_wait`` gives the gathered tensor, pieces in the order of ``ranks``.
    """
    return tp_gather_issue(comm, x, ranks, dim, sizes, reduce_grad=True)


# ---- Ulysses sequence parallelism: all-to-all between token slices and head slices -------------------
def _all_to_all(send_splits: Sequence[int], recv_splits: Sequence[int], label: str,
                result: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> Flow:
    """``all_to_all_single`` along dim 0 (a flat buffer, or rows): cut into ``send_splits`` (one piece
    per rank, in group order), pieces of ``recv_splits`` received."""
    send_splits, recv_splits = list(send_splits), list(recv_splits)

    def buffers(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = t.contiguous()
        return t, t.new_empty((sum(recv_splits), *t.shape[1:]))
    return Flow("all_to_all", label, buffers, lambda send, recv, group: dist.all_to_all_single(
        recv, send, recv_splits, send_splits, group=group, async_op=True), result)


def _all_to_all_issue(comm: Issuing, send: torch.Tensor, group: Group, send_splits: Sequence[int],
                      recv_splits: Sequence[int], finish: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The all-to-all issued; its backward is the same exchange reversed, at once."""
    return exchange(comm, send, group, _all_to_all(send_splits, recv_splits, "ulysses", finish),
                    _all_to_all(recv_splits, send_splits, "ulysses"))


def _ulysses_args(comm: Issuing, x: torch.Tensor, ranks: Sequence[int], sizes: Sequence[int],
                  heads: int) -> tuple[Group, tuple[int, ...], int]:
    key, group = group_of(comm, ranks)
    if len(sizes) != len(key) or heads % len(key):
        raise HGraphError(f"Ulysses all-to-all over ranks {list(key)}: {heads} heads and token pieces "
                          f"{list(sizes)} need one piece per rank and heads divisible by {len(key)}")
    return group, tuple(int(s) for s in sizes), key.index(comm.rank)


def ulysses_to_heads_issue(comm: Issuing, x: torch.Tensor, ranks: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    """Ulysses, issue half: ``x`` [1, H, T_local, D] of this rank's tokens -> (after ``comm_wait``)
    [1, H / n, T, D], every rank's tokens (pieces of ``sizes`` in the order of ``ranks``) with this
    rank's chunk ``index`` of the heads: head chunk ``i`` of the local tokens goes to rank ``i``."""
    group, sizes, _ = _ulysses_args(comm, x, ranks, sizes, x.shape[1])    # the rank's chunk: its place in group
    if len(sizes) == 1:
        return x
    n, (_, heads, tokens, dim) = len(sizes), x.shape
    part = heads // n
    send = x[0].reshape(n, part, tokens, dim).reshape(-1)
    recv_splits = [part * s * dim for s in sizes]

    def finish(buf: torch.Tensor) -> torch.Tensor:
        pieces = buf.split(recv_splits)
        return torch.cat([p.view(part, s, dim) for p, s in zip(pieces, sizes)], dim=1).unsqueeze(0)

    return _all_to_all_issue(comm, send, group, [part * tokens * dim] * n, recv_splits, finish)


def ulysses_to_tokens_issue(comm: Issuing, y: torch.Tensor, ranks: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    """The inverse of ``ulysses_to_heads_issue``: [1, H / n, T, D] -> (after ``comm_wait``) [1, H, T_local, D]."""
    group, sizes, index = _ulysses_args(comm, y, ranks, sizes, y.shape[1] * len(sizes))
    if len(sizes) == 1:
        return y
    n, (_, part, _, dim) = len(sizes), y.shape
    tokens = sizes[index]
    send = torch.cat([p.reshape(-1) for p in y[0].split(list(sizes), dim=1)])
    return _all_to_all_issue(comm, send, group, [part * s * dim for s in sizes], [part * tokens * dim] * n,
                             lambda buf: buf.view(1, n * part, tokens, dim))


# ---- expert parallelism: token rows to their experts' EP ranks and back (``hgraph.moe_dispatch``) ------
def _check_splits(key: Sequence[int], op: str, *splits: Sequence[int]) -> None:
    if any(len(s) != len(key) for s in splits):
        raise HGraphError(f"{op} over EP ranks {list(key)}: split sizes {[list(s) for s in splits]} need "
                          "one piece per rank")


def expert_counts_exchange(comm: Issuing, counts: torch.Tensor, ranks: Sequence[int], send_splits: Sequence[int],
                           recv_splits: Sequence[int]) -> torch.Tensor:
    """The MoE dispatch's count exchange: an all-to-all over the EP group ``ranks`` of the per-expert
    counts ``counts [E]`` (``send_splits``: each rank's experts) into the counts of this rank's experts
    from every rank (``recv_splits``), waited at once: the dispatch's split sizes depend on it. Forward
    only (counts have no gradient)."""
    key, group = group_of(comm, ranks)
    _check_splits(key, "expert count exchange", send_splits, recv_splits)
    if len(key) == 1:
        return counts
    send = counts.contiguous()
    recv = send.new_empty(sum(recv_splits))
    issue(comm, [send, recv], lambda: dist.all_to_all_single(recv, send, list(recv_splits), list(send_splits),
                                                             group=group, async_op=True),
          ("all_to_all", group, send, "moe_counts")).wait(comm)
    return recv


def expert_rows_issue(comm: Issuing, rows: torch.Tensor, ranks: Sequence[int], send_splits: Sequence[int],
                      recv_splits: Sequence[int], label: str) -> torch.Tensor:
    """Start the variable-size all-to-all of ``rows`` over the EP group ``ranks``: ``send_splits[i]`` rows
    to the ``i``-th rank of the group, ``recv_splits[i]`` from it; ``comm_wait`` gives the received rows.
    Its backward is the reversed all-to-all of the gradient (the dispatch's is combine-shaped, the
    combine's dispatch-shaped)."""
    key, group = group_of(comm, ranks)
    _check_splits(key, label, send_splits, recv_splits)
    if sum(send_splits) != rows.shape[0]:
        raise HGraphError(f"{label}: {rows.shape[0]} rows but split sizes {list(send_splits)}")
    if len(key) == 1:
        return rows
    return exchange(comm, rows, group, _all_to_all(send_splits, recv_splits, label),
                    _all_to_all(recv_splits, send_splits, label))


# ---- sequence parallelism: token slices --------------------------------------------------------------
def _scatter_flows(n: int, dim: int, total: int, lo: int, hi: int) -> tuple[Flow, Flow]:
    """Reduce-scatter of ``x`` along ``dim`` into the ranks' token slices (``shard_bounds``, in group
    order): each rank's slice is placed in a [group size, padded, ...] buffer (the token dim moved first),
    so one equal-piece reduce-scatter serves uneven slices; the result is this rank's slice ``[lo, hi)``.
    Its reverse all-gathers the gradient's slices into the whole gradient."""
    bounds = [shard_bounds(total, i, n) for i in range(n)]
    padded = max(b - a for a, b in bounds)

    def scatter_buffers(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        moved = x.detach().movedim(dim, 0)
        buf = moved.new_zeros((n, padded) + tuple(moved.shape[1:]))
        for i, (a, b) in enumerate(bounds):
            buf[i, :b - a].copy_(moved[a:b])
        return buf, moved.new_empty((1, padded) + tuple(moved.shape[1:]))

    def gather_buffers(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g = grad.contiguous()                       # [1, padded, ...]: zero past this rank's slice
        return g, g.new_empty((n,) + tuple(g.shape[1:]))

    def whole(full: torch.Tensor) -> torch.Tensor:
        return torch.cat([full[i, :b - a] for i, (a, b) in enumerate(bounds)], dim=0).movedim(0, dim)

    scatter = Flow("reduce_scatter", "sp_scatter", scatter_buffers, lambda send, recv, group: reduce_scatter_single(
        recv, send, group=group, async_op=True), lambda buf: buf[0, :hi - lo].movedim(0, dim))
    gather = Flow("all_gather", "sp_scatter", gather_buffers, lambda send, recv, group: all_gather_single(
        recv, send, group=group, async_op=True), whole)
    return scatter, gather


def sp_scatter_issue(comm: Issuing, x: torch.Tensor, ranks: Sequence[int], dim: int) -> torch.Tensor:
    """Start the reduce-scatter of ``x`` over ``ranks`` along the token ``dim``: the rank at position ``i``
    of the group keeps the sum of tokens ``shard_bounds(T, i, n)``; ``comm_wait`` gives that slice."""
    key, group = group_of(comm, ranks)
    if list(ranks) != list(key):
        raise HGraphError(f"sp_scatter_issue: ranks {list(ranks)} must be in TP rank order")
    dim = dim % x.dim()
    if len(key) == 1:
        return x
    lo, hi = shard_bounds(x.shape[dim], key.index(comm.rank), len(key))
    return exchange(comm, x, group, *_scatter_flows(len(key), dim, x.shape[dim], lo, hi))


def sp_gather_issue(comm: Issuing, x: torch.Tensor, ranks: Sequence[int], dim: int, total: int) -> torch.Tensor:
    """Start the all-gather of the token slices of ``total`` tokens along ``dim`` over ``ranks``; the
    backward reduce-scatters the gradient (``tp_gather_issue`` with ``reduce_grad``)."""
    return tp_gather_issue(comm, x, ranks, dim, shard_sizes(total, len(ranks)), reduce_grad=True)


class _GatheredLinear(torch.autograd.Function):
    """``F.linear(whole, w, b)`` of an all-gathered input that keeps only this rank's token slice for
    backward (Megatron's sequence-parallel linear): the weight's gradient gathers the slices again."""

    @staticmethod
    def forward(ctx, whole, part, w, b, comm, group, ranks, dim, sizes):
        ctx.save_for_backward(part, w)
        ctx.comm, ctx.group, ctx.ranks, ctx.dim, ctx.sizes = comm, group, ranks, dim, sizes
        ctx.has_bias = b is not None
        return torch.nn.functional.linear(whole, w, b)

    @staticmethod
    def backward(ctx, grad):
        part, w = ctx.saved_tensors
        need_whole, _, need_w, need_b = ctx.needs_input_grad[:4]
        dw = db = None
        if need_w:
            issued = tp_gather_issue(ctx.comm, part.detach(), ctx.ranks, ctx.dim, ctx.sizes)
            whole = comm_wait(ctx.comm, issued)
            dw = grad.flatten(0, -2).t() @ whole.flatten(0, -2)
        if need_b and ctx.has_bias:
            db = grad.flatten(0, -2).sum(0)
        return (grad @ w if need_whole else None), None, dw, db, None, None, None, None, None


def sp_gathered_linear(comm: Issuing, whole: torch.Tensor, part: torch.Tensor, w: torch.Tensor,
                       b: Optional[torch.Tensor], ranks: Sequence[int], dim: int) -> torch.Tensor:
    """``F.linear(whole, w, b)`` where ``whole`` is the all-gather (``sp_gather_issue``) of the token slices
    ``part`` along ``dim``: only ``part`` is kept for backward, gathered again for the weight's gradient."""
    key, group = group_of(comm, ranks)
    if len(key) == 1:
        return torch.nn.functional.linear(whole, w, b)
    dim = dim % part.dim()
    sizes = shard_sizes(whole.shape[dim], len(key))
    return _GatheredLinear.apply(whole, part, w, b, comm, group, list(ranks), dim, sizes)


# ---- pipeline point-to-point ---------------------------------------------------------------------
def _check_peer(comm: Issuing, peer: int, op: str) -> None:
    if not 0 <= peer < comm.world_size or peer == comm.rank:
        raise HGraphError(f"{op}: peer rank {peer} is not another rank of this run "
                          f"(rank {comm.rank} of {comm.world_size})")


class _SendActivation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, dst, tag, holder, stage):
        buf = x.detach().contiguous()
        if comm.defer_sends:        # sent with the next backward's gradient receive (``flush_deferred``)
            comm.in_flight.deferred.append((p2p.PeerOp(True, buf, dst, tag), stage))
            holder.pending = PendingWork([], (buf,), done=True)
        else:
            holder.pending = issue(comm, [buf], lambda: p2p.isend(buf, dst, tag=tag, stage=stage),
                                   ("p2p", (dst,), (), "pp_send"))
        ctx.comm, ctx.dst, ctx.tag, ctx.holder, ctx.stage = comm, dst, tag, holder, stage
        ctx.meta = (x.shape, x.dtype, x.device)
        return torch.zeros((), dtype=x.dtype, device=x.device)

    @staticmethod
    def backward(ctx, _grad_token):
        ctx.holder.pending.wait(ctx.comm)
        shape, dtype, device = ctx.meta
        g = torch.empty(shape, dtype=dtype, device=device)
        recv = p2p.PeerOp(False, g, ctx.dst, ctx.tag)
        flush_deferred(ctx.comm, recv, ctx.stage).wait(ctx.comm)
        return g, None, None, None, None, None


def flush_deferred(comm: Issuing, recv: Optional[p2p.PeerOp] = None, stage: bool = False) -> PendingWork:
    """Issue the activation sends a micro-batch deferred (``CommContext.defer_sends``) together with
    ``recv``, the gradient receive of the backward that follows, as one point-to-point batch (Megatron's
    send-forward-receive-backward): in 1F1B's steady state a stage sends micro-batch ``i``'s activation
    while the next stage sends micro-batch ``j``'s gradient, and two blocking sends facing each other
    deadlock where a rank's operations run one at a time (NCCL's one stream; ``--collective-order
    strict``). The sends' work is kept for ``wait_all``; returns the receive's (done when none)."""
    deferred, comm.in_flight.deferred = comm.in_flight.deferred, []
    sends = [op for op, _ in deferred]
    stage = stage or any(s for _, s in deferred)
    transfers = sends + ([recv] if recv is not None else [])
    if not transfers:
        return PendingWork([], done=True)
    tensors = [t.tensor for t in transfers]
    label = "pp_send" + (" + pp_send backward" if sends and recv is not None else " backward" if recv else "")
    with comm_stream_scope(comm, tensors):
        works = comm.issuer.p2p([t.peer for t in sends], [recv.peer] if recv is not None else [],
                                lambda: p2p.batch_isend_irecv(transfers, stage=stage), label)
    if sends:
        comm.detach_work(PendingWork(list(works[:len(sends)]), tuple(t.tensor for t in sends)))
    return PendingWork(list(works[len(sends):]), tuple(tensors[len(sends):]))


class _RecvActivation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, comm, src, shape, dtype, tag, holder, stage):
        buf = torch.empty(shape, dtype=dtype, device=comm.device)
        holder.pending = issue(comm, [buf], lambda: p2p.irecv(buf, src, tag=tag, stage=stage),
                               ("p2p", (), (src,), "pp_recv"))
        ctx.comm, ctx.src, ctx.tag, ctx.stage = comm, src, tag, stage
        return buf

    @staticmethod
    def backward(ctx, grad):
        g = grad.contiguous()
        send = issue(ctx.comm, [g], lambda: p2p.isend(g, ctx.src, tag=ctx.tag, stage=ctx.stage),
                     ("p2p", (ctx.src,), (), "pp_recv backward"))
        ctx.comm.detach_work(send)
        return None, None, None, None, None, None, None, None


def pp_send(comm: Issuing, x: torch.Tensor, dst: int, *, tag: int = 0,
            stage: Optional[bool] = None) -> torch.Tensor:
    """Start sending ``x`` to ``dst``; returns a scalar token connected to ``x``.

    ``comm_wait(comm, token)`` waits for the send. Back-propagating the token (``token.backward()``)
    receives dL/dx from ``dst`` and carries it into ``x``'s graph (``x`` must require grad).
    ``stage``: through host memory both ways (``runtime.comm.p2p``; None: where the backend needs it).
    """
    _check_peer(comm, dst, "pp_send")
    holder = Holder()
    stage = p2p.host_staged(x.device) if stage is None else stage
    token = _SendActivation.apply(x, comm, dst, tag, holder, stage)
    comm.register(token, holder.pending)
    return token


def pp_recv(comm: Issuing, src: int, shape: Sequence[int], dtype: torch.dtype, *, tag: int = 0,
            async_op: bool = False, stage: Optional[bool] = None) -> torch.Tensor:
    """Receive a tensor of ``shape``/``dtype`` from ``src``; it requires grad, and its gradient is
    sent back to ``src`` in backward.

    With ``async_op=True`` the receive is only issued: ``comm_wait`` on the result completes it.
    ``stage``: through host memory both ways (``runtime.comm.p2p``; None: where the backend needs it).
    """
    _check_peer(comm, src, "pp_recv")
    holder = Holder()
    anchor = torch.empty(0, requires_grad=True)  # gives the Function an input to differentiate
    stage = p2p.host_staged(comm.device) if stage is None else stage
    out = _RecvActivation.apply(anchor, comm, src, tuple(int(s) for s in shape), dtype, tag, holder, stage)
    if async_op:
        comm.register(out, holder.pending)
    else:
        holder.pending.wait(comm)
    return out
