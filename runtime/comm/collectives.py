"""The collectives behind the per-rank graphs' comm ops: each collective is an ISSUE and a WAIT.

The graphs call the op vocabulary of ``hgraph.ops``, which calls the rank's ``CommContext``
(``runtime/comm/context``), which resolves binding keys to ranks and calls the functions here. Every
function takes that context first (no globals), and issues through its ``issuer``, the rank's one
choke point (``runtime/comm/order/issue``: the record, the strict order). An issue op starts the collective with
``async_op=True`` (on CUDA on the context's dedicated comm stream, after that stream waited for the
compute stream) and registers the work under the tensor it returns; ``comm_wait(comm, t)`` waits for
it (making the compute stream wait for the comm stream on CUDA) and returns the finished tensor. So a
schedule is a node order: whatever sits between issue and wait overlaps with the communication.

Autograd (all ops are differentiable):

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

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from hgraph import torch_compat
from hgraph.errors import HGraphError
from hgraph.runtime.comm import p2p
from hgraph.runtime.comm.process_groups import group_key
from hgraph.shard_rule import shard_bounds, shard_sizes


@dataclass
class PendingWork:
    """Work handles of one issued op, the buffers they use and how to finish the issued tensor."""

    works: list
    keep: tuple = ()
    finish: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    done: bool = False

    def wait(self, comm: Any) -> None:
        if self.done:
            return
        with torch.no_grad():   # a backend may finish a collective by copying into its output (gloo's
            for work in self.works:   # reduce-scatter): not an op of the graph for autograd to record
                work.wait()
        if comm.comm_stream is not None:
            torch.cuda.current_stream().wait_stream(comm.comm_stream)
        self.done = True
        self.keep = ()


# Single-tensor all-gather / reduce-scatter under this torch's names (``hgraph.torch_compat``)
all_gather_single, reduce_scatter_single = torch_compat.all_gather_single, torch_compat.reduce_scatter_single


# ---- issuing on the comm stream ------------------------------------------------------------------
def _comm_stream_scope(comm: Any, buffers: Sequence[torch.Tensor]) -> Any:
    if comm.comm_stream is None:
        return contextlib.nullcontext()
    comm.comm_stream.wait_stream(torch.cuda.current_stream())
    for b in buffers:  # allocated on the compute stream, used on the comm stream
        b.record_stream(comm.comm_stream)
    return torch.cuda.stream(comm.comm_stream)


def _issue(comm: Any, buffers: Sequence[torch.Tensor], start: Callable[[], Any], op: tuple,
           finish: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> PendingWork:
    """Issue through the rank's ``CollectiveIssuer`` (``comm.issuer``): ``op`` is ``(kind, group,
    tensor, label)`` of a collective or ``("p2p", sends, recvs, label)`` of a send or receive."""
    with _comm_stream_scope(comm, buffers):
        if op[0] == "p2p":
            work = comm.issuer.p2p(op[1], op[2], start, op[3])
        else:
            work = comm.issuer.issue(op[0], op[1], op[2], start, op[3])
    return PendingWork([work], tuple(buffers), finish)


def _run(comm: Any, buffers: Sequence[torch.Tensor], start: Callable[[], Any], op: tuple) -> None:
    """Issue and wait at once (communication inside backward)."""
    _issue(comm, buffers, start, op).wait(comm)


class _Holder:
    """Lets an autograd Function hand its PendingWork to the caller (Function outputs are tensors)."""

    pending: Optional[PendingWork] = None


def _tp_group(comm: Any, ranks: Sequence[int]) -> tuple[tuple[int, ...], Any]:
    key = group_key(ranks)
    if comm.rank not in key:
        raise HGraphError(f"comm op over ranks {list(ranks)} called on rank {comm.rank}, which is "
                          "not one of them")
    return key, (comm.groups.get(key) if len(key) > 1 else None)


# ---- Megatron f / g ------------------------------------------------------------------------------
class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, group):
        ctx.comm, ctx.group = comm, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        g = grad.contiguous().clone()
        _run(ctx.comm, [g], lambda: dist.all_reduce(g, group=ctx.group, async_op=True),
             ("all_reduce", ctx.group, g, "tp_copy backward"))
        return g, None, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, group, holder):
        buf = x.detach().contiguous().clone()
        holder.pending = _issue(comm, [buf], lambda: dist.all_reduce(buf, group=group, async_op=True),
                                ("all_reduce", group, buf, "tp_reduce"))
        return buf

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


def tp_copy_issue(comm: Any, x: torch.Tensor, ranks: Sequence[int]) -> torch.Tensor:
    """Megatron f: identity forward; backward all-reduces (sums) dL/dx over ``ranks``."""
    key, group = _tp_group(comm, ranks)
    if len(key) == 1:
        return x
    return _CopyToTP.apply(x, comm, group)


def tp_reduce_issue(comm: Any, x: torch.Tensor, ranks: Sequence[int]) -> torch.Tensor:
    """Megatron g, issue half: start the all-reduce (sum) of ``x``; ``comm_wait`` finishes it."""
    key, group = _tp_group(comm, ranks)
    if len(key) == 1:
        return x
    holder = _Holder()
    out = _ReduceFromTP.apply(x, comm, group, holder)
    comm.register(out, holder.pending)
    return out


# ---- all-gather ----------------------------------------------------------------------------------
class _GatherTP(torch.autograd.Function):
    """Gathers ``x`` padded to ``padded`` along ``dim`` into a [group size, *padded shape] buffer.

    Backward: with ``reduce_grad`` False (TP: the gathered tensor is used identically on every rank)
    this rank's slice of the gradient; with True (CP: every rank's use contributes a partial gradient
    to every piece) the reduce-scatter (sum) of the gradient, this rank's piece.
    """

    @staticmethod
    def forward(ctx, x, comm, group, n, index, dim, padded, holder, reduce_grad=False):
        ctx.index, ctx.dim, ctx.size = index, dim, x.shape[dim]
        ctx.comm, ctx.group, ctx.reduce_grad = comm, group, reduce_grad
        pad_shape = list(x.shape)
        pad_shape[dim] = padded
        inp = x.new_zeros(pad_shape)
        inp.narrow(dim, 0, x.shape[dim]).copy_(x)
        inp = inp.unsqueeze(0)
        out = x.new_empty([n, *pad_shape])
        holder.pending = _issue(comm, [inp, out], lambda: all_gather_single(
            out, inp, group=group, async_op=True), ("all_gather", group, inp, "gather"))
        return out

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce_grad:
            full = grad.contiguous()
            mine = full.new_empty(full.shape[1:]).unsqueeze(0)
            _run(ctx.comm, [full, mine], lambda: reduce_scatter_single(
                mine, full, group=ctx.group, async_op=True), ("reduce_scatter", ctx.group, full, "gather backward"))
            g = mine[0].narrow(ctx.dim, 0, ctx.size)
        else:
            g = grad[ctx.index].narrow(ctx.dim, 0, ctx.size)
        return g, None, None, None, None, None, None, None, None


def tp_gather_issue(comm: Any, x: torch.Tensor, ranks: Sequence[int], dim: int,
                    sizes: Optional[Sequence[int]] = None, *, reduce_grad: bool = False) -> torch.Tensor:
    """Start the all-gather of ``x`` along ``dim`` over ``ranks``; ``comm_wait`` gives the result.

    ``sizes[i]`` is the size along ``dim`` of the piece of ``ranks[i]`` (all equal to this rank's
    when omitted); the pieces are concatenated in the order of ``ranks``.
    """
    key, group = _tp_group(comm, ranks)
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
    holder = _Holder()
    out = _GatherTP.apply(x, comm, group, len(key), key.index(comm.rank), dim, max(sizes), holder, reduce_grad)
    order = [key.index(r) for r in ranks]

    def finish(buf: torch.Tensor) -> torch.Tensor:
        return torch.cat([buf[i].narrow(dim, 0, s) for i, s in zip(order, sizes)], dim=dim)

    holder.pending.finish = finish
    comm.register(out, holder.pending)
    return out


def cp_gather_issue(comm: Any, x: torch.Tensor, ranks: Sequence[int], dim: int,
                    sizes: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Context parallelism: start the all-gather of K or V along the sequence ``dim`` over the CP group.

    Backward reduce-scatters the gradient (each rank's queries give a partial gradient of every
    rank's keys). ``comm_wait`` gives the gathered tensor, pieces in the order of ``ranks``.
    """
    return tp_gather_issue(comm, x, ranks, dim, sizes, reduce_grad=True)


# ---- Ulysses sequence parallelism: all-to-all between token slices and head slices -------------------
class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of a flat buffer: ``send`` cut into ``send_splits`` (one piece per rank, in
    group order), pieces of ``recv_splits`` received. Forward is issued (the caller registers it and
    ``comm_wait`` finishes it); backward runs the same exchange reversed, at once."""

    @staticmethod
    def forward(ctx, send, comm, group, send_splits, recv_splits, holder):
        recv = send.new_empty(sum(recv_splits))
        holder.pending = _issue(comm, [send, recv], lambda: dist.all_to_all_single(
            recv, send, list(recv_splits), list(send_splits), group=group, async_op=True),
            ("all_to_all", group, send, "ulysses"))
        ctx.comm, ctx.group, ctx.splits = comm, group, (send_splits, recv_splits)
        return recv

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        g = grad.contiguous()
        out = g.new_empty(sum(send_splits))
        _run(ctx.comm, [g, out], lambda: dist.all_to_all_single(
            out, g, list(send_splits), list(recv_splits), group=ctx.group, async_op=True),
             ("all_to_all", ctx.group, g, "ulysses backward"))
        return out, None, None, None, None, None


def _all_to_all_issue(comm: Any, send: torch.Tensor, group: Any, send_splits: Sequence[int],
                      recv_splits: Sequence[int], finish: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    holder = _Holder()
    recv = _AllToAll.apply(send, comm, group, tuple(send_splits), tuple(recv_splits), holder)
    holder.pending.finish = finish
    comm.register(recv, holder.pending)
    return recv


def _ulysses_args(comm: Any, x: torch.Tensor, ranks: Sequence[int], sizes: Sequence[int],
                  heads: int) -> tuple[Any, tuple[int, ...], int]:
    key, group = _tp_group(comm, ranks)
    if len(sizes) != len(key) or heads % len(key):
        raise HGraphError(f"Ulysses all-to-all over ranks {list(key)}: {heads} heads and token pieces "
                          f"{list(sizes)} need one piece per rank and heads divisible by {len(key)}")
    return group, tuple(int(s) for s in sizes), key.index(comm.rank)


def ulysses_to_heads_issue(comm: Any, x: torch.Tensor, ranks: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
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


def ulysses_to_tokens_issue(comm: Any, y: torch.Tensor, ranks: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    """The inverse of ``ulysses_to_heads_issue``: [1, H / n, T, D] -> (after ``comm_wait``) [1, H, T_local, D]."""
    group, sizes, index = _ulysses_args(comm, y, ranks, sizes, y.shape[1] * len(sizes))
    if len(sizes) == 1:
        return y
    n, (_, part, _, dim) = len(sizes), y.shape
    tokens = sizes[index]
    send = torch.cat([p.reshape(-1) for p in y[0].split(list(sizes), dim=1)])
    return _all_to_all_issue(comm, send, group, [part * s * dim for s in sizes], [part * tokens * dim] * n,
                             lambda buf: buf.view(1, n * part, tokens, dim))


# ---- sequence parallelism: token slices --------------------------------------------------------------

class _ScatterTokens(torch.autograd.Function):
    """Reduce-scatter of ``x`` along ``dim`` into the ranks' token slices (``shard_bounds``, in group order):
    each rank's slice is placed in a [group size, padded, ...] buffer (the token dim moved first), so one
    equal-piece reduce-scatter serves uneven slices. Returns the padded piece; ``finish`` cuts it."""

    @staticmethod
    def forward(ctx, x, comm, group, n, index, dim, holder):
        total = x.shape[dim]
        bounds = [shard_bounds(total, i, n) for i in range(n)]
        padded = max(hi - lo for lo, hi in bounds)
        moved = x.detach().movedim(dim, 0)
        buf = moved.new_zeros((n, padded) + tuple(moved.shape[1:]))
        for i, (lo, hi) in enumerate(bounds):
            buf[i, :hi - lo].copy_(moved[lo:hi])
        out = moved.new_empty((1, padded) + tuple(moved.shape[1:]))
        holder.pending = _issue(comm, [buf, out],
                                lambda: reduce_scatter_single(out, buf, group=group, async_op=True),
                                ("reduce_scatter", group, buf, "sp_scatter"))
        ctx.comm, ctx.group, ctx.n, ctx.dim, ctx.bounds, ctx.padded = comm, group, n, dim, bounds, padded
        return out

    @staticmethod
    def backward(ctx, grad):
        g = grad.contiguous()                       # [1, padded, ...]: zero past this rank's slice
        full = g.new_empty((ctx.n,) + tuple(g.shape[1:]))
        _run(ctx.comm, [g, full], lambda: all_gather_single(full, g, group=ctx.group, async_op=True),
             ("all_gather", ctx.group, g, "sp_scatter backward"))
        whole = torch.cat([full[i, :hi - lo] for i, (lo, hi) in enumerate(ctx.bounds)], dim=0)
        return whole.movedim(0, ctx.dim), None, None, None, None, None, None


def sp_scatter_issue(comm: Any, x: torch.Tensor, ranks: Sequence[int], dim: int) -> torch.Tensor:
    """Start the reduce-scatter of ``x`` over ``ranks`` along the token ``dim``: the rank at position ``i``
    of the group keeps the sum of tokens ``shard_bounds(T, i, n)``; ``comm_wait`` gives that slice."""
    key, group = _tp_group(comm, ranks)
    if list(ranks) != list(key):
        raise HGraphError(f"sp_scatter_issue: ranks {list(ranks)} must be in TP rank order")
    dim = dim % x.dim()
    if len(key) == 1:
        return x
    holder = _Holder()
    index = key.index(comm.rank)
    out = _ScatterTokens.apply(x, comm, group, len(key), index, dim, holder)
    lo, hi = shard_bounds(x.shape[dim], index, len(key))
    holder.pending.finish = lambda buf: buf[0, :hi - lo].movedim(0, dim)
    comm.register(out, holder.pending)
    return out


def sp_gather_issue(comm: Any, x: torch.Tensor, ranks: Sequence[int], dim: int, total: int) -> torch.Tensor:
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
            issue = tp_gather_issue(ctx.comm, part.detach(), ctx.ranks, ctx.dim, ctx.sizes)
            whole = comm_wait(ctx.comm, issue)
            dw = grad.flatten(0, -2).t() @ whole.flatten(0, -2)
        if need_b and ctx.has_bias:
            db = grad.flatten(0, -2).sum(0)
        return (grad @ w if need_whole else None), None, dw, db, None, None, None, None, None


def sp_gathered_linear(comm: Any, whole: torch.Tensor, part: torch.Tensor, w: torch.Tensor,
                       b: Optional[torch.Tensor], ranks: Sequence[int], dim: int) -> torch.Tensor:
    """``F.linear(whole, w, b)`` where ``whole`` is the all-gather (``sp_gather_issue``) of the token slices
    ``part`` along ``dim``: only ``part`` is kept for backward, gathered again for the weight's gradient."""
    key, group = _tp_group(comm, ranks)
    if len(key) == 1:
        return torch.nn.functional.linear(whole, w, b)
    dim = dim % part.dim()
    sizes = shard_sizes(whole.shape[dim], len(key))
    return _GatheredLinear.apply(whole, part, w, b, comm, group, list(ranks), dim, sizes)


def comm_wait(comm: Any, t: torch.Tensor) -> torch.Tensor:
    """Wait for the op issued for ``t`` and return the finished tensor (``t`` itself if none)."""
    pending = comm.take(t)
    if pending is None:
        return t
    pending.wait(comm)
    return pending.finish(t) if pending.finish is not None else t


# ---- pipeline point-to-point ---------------------------------------------------------------------
def _check_peer(comm: Any, peer: int, op: str) -> None:
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
            holder.pending = _issue(comm, [buf], lambda: p2p.isend(buf, dst, tag=tag, stage=stage),
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


def flush_deferred(comm: Any, recv: Optional[p2p.PeerOp] = None, stage: bool = False) -> PendingWork:
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
    with _comm_stream_scope(comm, tensors):
        works = comm.issuer.p2p([t.peer for t in sends], [recv.peer] if recv is not None else [],
                                lambda: p2p.batch_isend_irecv(transfers, stage=stage), label)
    if sends:
        comm.detach_work(PendingWork(list(works[:len(sends)]), tuple(t.tensor for t in sends)))
    return PendingWork(list(works[len(sends):]), tuple(tensors[len(sends):]))


class _RecvActivation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, comm, src, shape, dtype, tag, holder, stage):
        buf = torch.empty(shape, dtype=dtype, device=comm.device)
        holder.pending = _issue(comm, [buf], lambda: p2p.irecv(buf, src, tag=tag, stage=stage),
                                ("p2p", (), (src,), "pp_recv"))
        ctx.comm, ctx.src, ctx.tag, ctx.stage = comm, src, tag, stage
        return buf

    @staticmethod
    def backward(ctx, grad):
        g = grad.contiguous()
        send = _issue(ctx.comm, [g], lambda: p2p.isend(g, ctx.src, tag=ctx.tag, stage=ctx.stage),
                      ("p2p", (ctx.src,), (), "pp_recv backward"))
        ctx.comm.detach_work(send)
        return None, None, None, None, None, None, None, None


def pp_send(comm: Any, x: torch.Tensor, dst: int, *, tag: int = 0,
            stage: Optional[bool] = None) -> torch.Tensor:
    """Start sending ``x`` to ``dst``; returns a scalar token connected to ``x``.

    ``comm_wait(comm, token)`` waits for the send. Back-propagating the token (``token.backward()``)
    receives dL/dx from ``dst`` and carries it into ``x``'s graph (``x`` must require grad).
    ``stage``: through host memory both ways (``runtime.comm.p2p``; None: where the backend needs it).
    """
    _check_peer(comm, dst, "pp_send")
    holder = _Holder()
    stage = p2p.host_staged(x.device) if stage is None else stage
    token = _SendActivation.apply(x, comm, dst, tag, holder, stage)
    comm.register(token, holder.pending)
    return token


def pp_recv(comm: Any, src: int, shape: Sequence[int], dtype: torch.dtype, *, tag: int = 0,
            async_op: bool = False, stage: Optional[bool] = None) -> torch.Tensor:
    """Receive a tensor of ``shape``/``dtype`` from ``src``; it requires grad, and its gradient is
    sent back to ``src`` in backward.

    With ``async_op=True`` the receive is only issued: ``comm_wait`` on the result completes it.
    ``stage``: through host memory both ways (``runtime.comm.p2p``; None: where the backend needs it).
    """
    _check_peer(comm, src, "pp_recv")
    holder = _Holder()
    anchor = torch.empty(0, requires_grad=True)  # gives the Function an input to differentiate
    stage = p2p.host_staged(comm.device) if stage is None else stage
    out = _RecvActivation.apply(anchor, comm, src, tuple(int(s) for s in shape), dtype, tag, holder, stage)
    if async_op:
        comm.register(out, holder.pending)
    else:
        holder.pending.wait(comm)
    return out
