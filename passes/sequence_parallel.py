"""Megatron sequence parallelism (SP): which values of an HGraph hold only a TP rank's slice of the tokens.

Under TP > 1 with SP, the ``tp_exit`` after a row-parallel linear or a vocabulary-parallel embedding
reduce-scatters along the token dim instead of all-reducing, and the ``tp_enter`` before a
column-parallel group all-gathers along it (its backward reduce-scatters the gradient); everything in
between (norms, residual adds, dropout, the hidden state between blocks and across pipeline stages)
holds only tokens ``[T*r//tp, T*(r+1)//tp)`` of the micro-batch on TP rank ``r`` (``T``: the micro-batch's
tokens on the rank, the CP rank's under CP; uneven when TP does not divide it).

``plan_sequence_parallel`` finds those values by a forward data flow over the strategy-agnostic HGraph
(the answer does not depend on the TP degree) and proves every op in between token-wise:

* sources: the ``tp_exit`` slots after a row-parallel linear / vocab-parallel embedding / MoE op with
  TP-sharded experts (its partial sums reduce-scattered like a row-parallel linear's), or after a sum of
  their partial sums (``passes/partial_sums``: an MoE layer's routed and shared experts, one
  reduce-scatter); a full-width partial sum's exit, OLMo-2's q/k norm, stays an all-reduce: it is
  inside a TP region, on whole tokens;
* an op with a sliced input is sliced when it is elementwise (broadcasting keeps the token dim in
  place), keyed dropout, a linear TP left whole (on the features of each token), hgraph's MoE op whose
  experts TP left whole (``moe.moe_layer``: each token routed to its experts alone), or a norm / reduction over dims after
  the token dim; a full-token input of such an op (a position table read by position,
  ``wte(ids) + pos[position_ids]``: whole on every TP rank) is *narrowed* to the rank's slice; inputs
  without a token dim (weights, scalars) broadcast as they are;
* sinks: ``tp_enter`` slots (the all-gather); the pipeline boundary passes the slice on;
* a view of a sliced value to the shape it already has (HF GPT-2's ``view(-1, T, H)`` before the head,
  its sizes read from the whole micro-batch) is that value;
* a shape read of a sliced value (``b, t, _ = x.shape`` before the q/k/v projections) reads the whole
  micro-batch's shape, which is what its users (the views of the gathered projections) need; a shape
  read that a sliced op uses is refused;
* anything else meeting a sliced value (attention, a view, the model's output) refuses SP for the
  model in one line naming the op (``SequenceParallelRefused``).

It also tells, per parameter, whose gradient becomes a per-TP-rank partial sum: a replicated
parameter whose every use reaches the loss only through sliced values (norm weights, a row-parallel
bias added after the reduce-scatter, GPT-2's position embedding). Its TP ranks' gradients must then be
summed like CP ranks' (``instantiate.push_contribution``), not split among them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

import torch.fx as fx
import torch.nn.functional as F

from hgraph.dims import BindingKey
from hgraph import moe, ops
from hgraph.errors import HGraphError
from hgraph.meta import CommPoint, OpKind, SlotKind, TPRole, get_meta
from hgraph.passes.op_kinds import ELEMENTWISE, op_name
from hgraph.passes.partial_sums import partial_producers
from hgraph.passes.stage_split import stage_of_blocks
from hgraph.passes.tp_roles import PARTIAL_SUM, is_metadata

_NORMS = {"layer_norm", "rms_norm"}
_REDUCTIONS = {"mean", "sum", "amax", "amin", "var", "norm", "softmax", "log_softmax"}
_SHAPE_READS = {"shape", "size"}


class SequenceParallelRefused(HGraphError):
    """A model whose values between TP regions cannot be proven token-wise (the message names the op)."""


@dataclass(frozen=True)
class SequenceParallelPlan:
    """What SP changes in a rank's graph, by HGraph node name (the instantiation passes keep names).

    ``token_dims``: the position of the token dim in the input of each SP exit and enter slot and of
    each shape read (by the slot's / read's name).
    """

    sliced: frozenset            # values holding the rank's slice of the tokens
    exits: frozenset             # tp_exit slots that reduce-scatter (forward) / all-gather (backward)
    enters: frozenset            # tp_enter slots that all-gather (forward) / reduce-scatter (backward)
    narrows: tuple               # (op, names of its full-token input, its token dim): narrowed to the slice
    shape_reads: frozenset       # metadata nodes reading a sliced value's shape: the whole shape instead
    same_shape_views: frozenset  # views of a sliced value to the shape it has: the value itself
    token_dims: dict             # value name -> index of its token dim
    blocks: dict                 # op / read / view name -> its block (a rank graph's new nodes may reuse
    #                              the name of an HGraph node on another stage)
    partial_grads: frozenset     # replicated parameters whose gradient each TP rank computes on its tokens


def _tdim(shapes: dict, node: fx.Node) -> Optional[int]:
    dims = shapes.get(node.name, (None,))[0]
    return dims.index("T") if dims is not None and "T" in dims else None


def _refuse(node: fx.Node, why: str) -> SequenceParallelRefused:
    return SequenceParallelRefused(f"sequence parallelism: {node.name} ({op_name(node)}) {why}; SP needs the "
                                   "ops between TP regions to be token-wise (elementwise, norms over the "
                                   "features, keyed dropout); use --no-sequence-parallel for this model")


def _sp_source(x: Any) -> bool:
    """A row-parallel linear, vocab-parallel embedding or MoE op with sharded experts, or a sum of their
    partial sums (not a full-width partial sum)."""
    if not isinstance(x, fx.Node):
        return False
    m = get_meta(x)
    if m.tp_rewrite is not None and m.tp_rewrite[0] == PARTIAL_SUM:
        return False
    return (m.op == OpKind.LINEAR and m.tp_role == TPRole.ROW) or \
        (m.op == OpKind.EMBEDDING and m.tp_role == TPRole.VOCAB) or m.tp_role == TPRole.EXPERTS \
        or bool(partial_producers(x))


def _dims_arg(n: fx.Node) -> Any:
    if "dim" in n.kwargs:
        return n.kwargs["dim"]
    return n.args[1] if len(n.args) > 1 else None


def _token_wise(n: fx.Node, shapes: dict, sliced_inputs: list[fx.Node]) -> Optional[str]:
    """None when ``n`` computes each token from that token alone; else why not."""
    out = shapes.get(n.name, (None,))[0]
    if out is None or "T" not in out:
        return "has no token dim in its output"
    t_from_end = out.index("T") - len(out)
    for a in sliced_inputs:
        dims = shapes[a.name][0]
        if dims.index("T") - len(dims) != t_from_end:
            return f"moves the token dim of {a.name}"
    name = op_name(n)
    if n.target is ops.keyed_dropout or name in ELEMENTWISE:
        return None
    if n.target is moe.moe_layer and sliced_inputs == [n.args[0]]:
        return None          # routing and experts per token (its weights whole: their gradients partial sums)
    if get_meta(n).op == OpKind.LINEAR and sliced_inputs == [n.args[0]] \
            and get_meta(n).tp_role in (None, TPRole.REPLICATED):
        return None          # a whole linear maps each token's features alone
    if name in _NORMS:
        normalized = n.args[1] if len(n.args) > 1 else n.kwargs.get("normalized_shape")
        if isinstance(normalized, (tuple, list)) and len(normalized) < -t_from_end:
            return None
        return "normalises over the token dim"
    if name in _REDUCTIONS:
        dims = _dims_arg(n)
        dims = dims if isinstance(dims, (tuple, list)) else (dims,)
        rank = len(out)
        if all(isinstance(d, int) and d % rank > rank + t_from_end for d in dims):
            return None
        return "reduces over the token dim"
    return "is not an op SP can prove token-wise"


def _is_shape_read(n: fx.Node) -> bool:
    if n.op == "call_method" and n.target == "size":
        return True
    return n.op == "call_function" and n.target is getattr and len(n.args) > 1 and n.args[1] == "shape"


def model_sequence_parallel(hg: Any, shapes: dict) -> Union[SequenceParallelPlan, SequenceParallelRefused]:
    """``plan_sequence_parallel(hg, shapes)``, or the refusal it raised: the answer depends on the model
    alone, so it is worked out once per HGraph (kept on it) for every strategy and every caller."""
    cached = getattr(hg, "_sequence_parallel_plan", None)
    if cached is None:
        try:
            cached = plan_sequence_parallel(hg, shapes)
        except SequenceParallelRefused as exc:
            cached = exc
        hg._sequence_parallel_plan = cached
    return cached


def plan_sequence_parallel(hg: Any, shapes: dict) -> SequenceParallelPlan:
    """The SP plan of HGraph ``hg``; ``SequenceParallelRefused`` names the op that
    is not token-wise."""
    gm: fx.GraphModule = hg.gm
    sliced: set[fx.Node] = set()
    exits: set[fx.Node] = set()
    enters: set[fx.Node] = set()
    narrows: list[tuple[fx.Node, fx.Node]] = []
    reads: set[fx.Node] = set()
    same_shape: set[fx.Node] = set()
    meta_nodes: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "get_attr"):
            continue
        ins = n.all_input_nodes
        if n.op == "output":
            if any(a in sliced for a in ins):
                raise _refuse(n, "returns a token-sliced value")
            continue
        if is_metadata(n, meta_nodes):
            meta_nodes.add(n)
            if any(a in sliced for a in ins):
                harmless = n.target is getattr and n.args[1] in ("dtype", "device", "ndim")
                if not _is_shape_read(n) and not harmless:
                    raise _refuse(n, "reads a token-sliced value")
                if _is_shape_read(n):
                    reads.add(n)
            continue
        m = get_meta(n)
        if m.slot in (SlotKind.PULL_PARAMETER, SlotKind.PUSH_GRADIENT):
            continue
        x = n.args[0] if n.args else None
        if m.slot == SlotKind.COMM_ACTIVATION:
            if m.comm_point == CommPoint.TP_EXIT and _sp_source(x):
                if _tdim(shapes, x) is None:
                    raise _refuse(x, "has no known token dim")
                sliced.add(n)
                exits.add(n)
            elif m.comm_point == CommPoint.TP_ENTER and x in sliced:
                enters.add(n)
            elif m.comm_point == CommPoint.PP_BOUNDARY and x in sliced:
                sliced.add(n)
            elif x in sliced:
                raise _refuse(n, f"({m.comm_point.value}) takes a token-sliced value")
            continue
        tensors = [a for a in ins if a not in meta_nodes]
        sliced_in = [a for a in tensors if a in sliced]
        if not sliced_in:
            continue
        if op_name(n) in ("view", "reshape") and len(tensors) == 1 and n.name in shapes \
                and shapes[n.name][0] == shapes[x.name][0]:
            same_shape.add(n)       # a view to the shape it has (sizes read from the whole micro-batch)
            sliced.add(n)
            continue
        why = _token_wise(n, shapes, sliced_in)
        if why is not None:
            raise _refuse(n, why)
        for a in tensors:
            if a not in sliced and _tdim(shapes, a) is not None:
                dims = shapes[a.name][0]
                if dims.index("T") - len(dims) != shapes[n.name][0].index("T") - len(shapes[n.name][0]):
                    raise _refuse(n, f"meets a whole {a.name} whose token dim is elsewhere")
                narrows.append((n, a))
        sliced.add(n)
    _check_shape_reads(reads, meta_nodes, sliced)
    token_dims = {n.name: _tdim(shapes, n.args[0]) for n in exits | enters | reads}
    located = [op for op, _ in narrows] + [*reads, *same_shape]      # found by name in the rank graphs
    return SequenceParallelPlan(frozenset(n.name for n in sliced), frozenset(n.name for n in exits),
                                frozenset(n.name for n in enters),
                                tuple((n.name, _origins(a), _tdim(shapes, a)) for n, a in narrows),
                                frozenset(n.name for n in reads), frozenset(n.name for n in same_shape),
                                token_dims, {n.name: get_meta(n).block for n in located},
                                _partial_grad_params(hg, sliced, exits))


def _origins(a: fx.Node) -> tuple[str, ...]:
    """Names a value may have in a rank graph: its own, and those before the pipeline slots it passed
    (a filled pipeline slot is its input)."""
    names = [a.name]
    while get_meta(a).comm_point == CommPoint.PP_BOUNDARY and isinstance(a.args[0], fx.Node):
        a = a.args[0]
        names.append(a.name)
    return tuple(names)


def _check_shape_reads(reads: set, meta_nodes: set, sliced: set) -> None:
    """A shape read of a sliced value gives the whole micro-batch's shape: refuse when a sliced op uses it."""
    for read in reads:
        work, seen = list(read.users), set()
        while work:
            u = work.pop()
            if u in seen:
                continue
            seen.add(u)
            if u in meta_nodes:
                work.extend(u.users)
            elif u in sliced:
                raise _refuse(u, f"uses the token count {read.name} reads, which SP would change")


def _partial_grad_params(hg: Any, sliced: set, exits: set) -> frozenset:
    """Replicated parameters every use of which reaches the loss only through sliced values."""
    row_bias_ops = {n.args[0] for n in exits if get_meta(n.args[0]).op == OpKind.LINEAR}
    reach: dict[fx.Node, frozenset] = {}      # what a value's gradient comes from: sliced or whole values
    for n in reversed(hg.gm.graph.nodes):      # users come after their inputs
        m = get_meta(n)
        if n in sliced:
            reach[n] = frozenset({"sliced"})
        elif n.op == "output" or (m.slot == SlotKind.COMM_ACTIVATION
                                  and m.comm_point != CommPoint.PP_BOUNDARY):
            reach[n] = frozenset({"whole"})
        else:
            reach[n] = frozenset().union(*(reach[u] for u in n.users))

    partial = set()
    for node in hg.gm.graph.nodes:
        m = get_meta(node)
        if m.slot != SlotKind.PULL_PARAMETER or m.param is None:
            continue
        info = hg.params[m.param]
        if info.tp_role not in (None, TPRole.REPLICATED) or info.tp_partial:
            continue
        for use in node.users:
            bias = use in row_bias_ops and (len(use.args) > 2 and use.args[2] is node
                                            or use.kwargs.get("bias") is node)
            kinds = frozenset({"sliced"}) if bias else reach[use]
            partial.add((m.param, kinds))
    out = set()
    for name in {p for p, _ in partial}:
        kinds = frozenset().union(*(k for p, k in partial if p == name))
        if kinds == {"sliced", "whole"}:
            raise SequenceParallelRefused(
                f"sequence parallelism: parameter {name} is used both on token-sliced and on whole "
                "activations, so its TP ranks' gradients are neither all partial nor all equal; use "
                "--no-sequence-parallel for this model")
        if kinds == {"sliced"}:
            out.add(name)
    return frozenset(out)


def sequence_parallel_pass(gm: fx.GraphModule, ctx: Any) -> fx.GraphModule:
    """The rank graph's side of ``ctx.sp`` besides the collectives (``fill_activation_comm``): whole
    inputs of sliced ops narrowed to the rank's tokens (``ops.sp_narrow``), shape reads of sliced values
    made whole (``ops.whole_shape``), views of a sliced value to its own shape removed, and the linears
    of an all-gathered value made ``ops.sp_linear`` (the same linear, keeping only the rank's slice for
    backward, as Megatron does; not the output head, which the chunked loss takes whole).

    Does nothing when the role does not run SP (TP1, or SP off).
    """
    sp = ctx.sp
    if sp is None:
        return gm
    g = gm.graph
    stage_of = stage_of_blocks(ctx.stage_blocks)
    by_name = {n.name: n for n in g.nodes
               if n.name not in sp.blocks or sp.blocks[n.name] is None
               or stage_of.get(sp.blocks[n.name], 0) == ctx.role.stage}
    comm = by_name["comm"]
    input_ids = next(n for n in g.nodes if n.op == "placeholder" and n.target == "input_ids")
    for op_name_, origins, dim in sp.narrows:
        op = by_name.get(op_name_)
        if op is None:              # on another stage
            continue
        names = set(origins) | {f"recv_{o}" for o in origins}
        for a in op.all_input_nodes:
            if a.name in names:
                with g.inserting_before(op):
                    narrow = g.call_function(ops.sp_narrow, (comm, a, BindingKey.TP, dim))
                narrow.name = f"sp_narrow_{a.name}"
                op.replace_input_with(a, narrow)
                break
        else:
            raise AssertionError(f"sequence parallelism: {op_name_} has no input named {sorted(names)}")
    for name in sp.shape_reads:
        read = by_name.get(name)
        if read is None:
            continue
        x = read.args[0]
        index = None
        if read.op == "call_method":         # x.size() / x.size(d)
            index = read.args[1] if len(read.args) > 1 else read.kwargs.get("dim")
        with g.inserting_before(read):
            whole = g.call_function(ops.whole_shape, (x, sp.token_dims[name], input_ids, index))
        read.replace_all_uses_with(whole)
        g.erase_node(read)
        whole.name = f"whole_shape_{x.name}"
    for name in sp.same_shape_views:
        view = by_name.get(name)
        if view is not None:
            view.replace_all_uses_with(view.args[0])
            g.erase_node(view)
    _linears_keep_the_slice(g, comm)
    return gm


def _linears_keep_the_slice(g: fx.Graph, comm: fx.Node) -> None:
    """``F.linear(gathered, w, b)`` -> ``ops.sp_linear(comm, gathered, slice, w, b, "tp", dim)`` for the
    all-gathers of SP enters; a linear whose logits are gathered or returned (the head) is left as is."""
    for wait in list(g.nodes):
        issue = wait.args[1] if wait.target is ops.comm_wait and len(wait.args) > 1 else None
        if not isinstance(issue, fx.Node) or issue.target is not ops.sp_gather_issue:
            continue
        part, dim = issue.args[1], issue.args[3]
        for lin in list(wait.users):
            if lin.target is not F.linear or lin.args[0] is not wait or set(lin.kwargs) - {"bias"}:
                continue
            if any(u.op == "output" or u.target is ops.tp_gather_issue for u in lin.users):
                continue
            bias = lin.args[2] if len(lin.args) > 2 else lin.kwargs.get("bias")
            lin.target, lin.kwargs = ops.sp_linear, {}
            lin.args = (comm, wait, part, lin.args[1], bias, BindingKey.TP, dim)
