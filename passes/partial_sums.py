"""Sums of TP partial sums that one reduction serves (an MoE layer's routed experts plus its shared experts).

A row-parallel linear without a bias and hgraph's MoE op with TP-sharded experts (role EXPERTS) each give
a TP rank's partial sum, which a ``tp_exit`` reduces. Reduction is linear: when partial sums over the one
TP group are added before anything else reads them, reducing their sum once equals reducing each and
adding, so ``insert_slots`` puts one ``tp_exit`` after the sum instead of one after each term
(``fused_partial_sums``). A term may be scaled by a value every TP rank holds whole (Qwen2-MoE's
``sigmoid(gate(x)) * shared(x)``, a per-token scale): ``s * sum_r p_r = sum_r s * p_r``, so it is still a
partial sum. The scale is then computed inside the TP region, from the ``tp_enter``'s output of the value it
reads (whole on every TP rank, the gathered tokens under sequence parallelism) and from replicated
parameters: its gradient on each rank is that rank's part, summed by the enter's backward, and those
parameters' gradients are per-rank partial sums (``NodeMeta.tp_partial``: the push sums them).

Anything else keeps a reduction per term: a nonlinear use of a partial sum, a term read twice, a row
bias (added after its own reduction), a scale that reads a sharded or partial value, a value of another
block, or one also used outside the scale.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.fx as fx

from hgraph.meta import OpKind, SlotKind, TPRole, get_meta
from hgraph.passes.op_kinds import op_name
from hgraph.passes.tp_roles import PARTIAL_SUM

_ADDS = {"add", "iadd"}
_MULS = {"mul", "imul"}


@dataclass(frozen=True)
class Scale:
    """A term's scale: the ``mul`` applying it, the nodes computing it (``cone``: ops and the Pull Parameter
    slots of the replicated parameters it reads) and the values it reads that enter the TP region (to be
    read through their ``tp_enter``)."""

    mul: fx.Node
    cone: frozenset
    entered: frozenset


@dataclass(frozen=True)
class FusedSum:
    """One reduction for ``root``, the sum of the partial sums ``producers`` (each scaled by ``scales``)."""

    root: fx.Node
    producers: tuple
    scales: tuple


def is_producer(node: fx.Node) -> bool:
    """A rank's partial sum that a ``tp_exit`` reduces and that may be added before the reduction: the MoE
    op with TP-sharded experts, a row-parallel linear without a bias (a bias is added after the reduction)."""
    m = get_meta(node)
    if m.tp_rewrite is not None and m.tp_rewrite[0] == PARTIAL_SUM:
        return False
    if m.tp_role == TPRole.EXPERTS:
        return True
    if m.op == OpKind.LINEAR and m.tp_role == TPRole.ROW:
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        return bias is None
    return False


def partial_producers(node: fx.Node) -> tuple:
    """The producers (``is_producer``) whose partial sums ``node`` adds, scaled or not (empty: ``node`` is
    not such a sum); the scales are not checked (``fused_partial_sums`` does)."""
    if is_producer(node):
        return (node,)
    name = op_name(node) if node.op in ("call_function", "call_method") else ""
    if node.kwargs or len(node.args) != 2 or name not in _ADDS | _MULS:
        return ()
    terms = [partial_producers(a) if isinstance(a, fx.Node) and list(a.users) == [node] else ()
             for a in node.args]
    if name in _ADDS:
        return terms[0] + terms[1] if terms[0] and terms[1] else ()
    return terms[0] or terms[1] if bool(terms[0]) != bool(terms[1]) else ()


def fused_partial_sums(gm: fx.GraphModule) -> list[FusedSum]:
    """The sums of two or more partial sums of one block that one ``tp_exit`` after them can reduce (module
    docstring), outermost sums only. Run on the annotated graph with its parameter slots."""
    entering = _entering_values(gm)
    out, inside = [], set()
    for node in reversed(gm.graph.nodes):
        if node in inside or node.op not in ("call_function", "call_method") or op_name(node) not in _ADDS:
            continue
        found = _sum_of(node, get_meta(node).block, entering.get(get_meta(node).block, set()))
        if found is None or len(found[0]) < 2:
            continue
        producers, scales, nodes = found
        inside |= nodes
        out.append(FusedSum(node, producers, scales))
    return out[::-1]


def _sum_of(node: fx.Node, block: Optional[str], entering: set) -> Optional[tuple[tuple, tuple, set]]:
    """(producers, scales, the term nodes) of ``node`` as a partial sum of ``block`` whose scales are whole
    on every TP rank, else None."""
    if get_meta(node).block != block:
        return None
    if is_producer(node):
        return (node,), (), {node}
    name = op_name(node) if node.op in ("call_function", "call_method") else ""
    if node.kwargs or len(node.args) != 2 or name not in _ADDS | _MULS:
        return None
    terms = [_sum_of(a, block, entering) if isinstance(a, fx.Node) and list(a.users) == [node] else None
             for a in node.args]
    if name in _ADDS:
        if terms[0] is None or terms[1] is None:
            return None
        return terms[0][0] + terms[1][0], terms[0][1] + terms[1][1], terms[0][2] | terms[1][2] | {node}
    if (terms[0] is None) == (terms[1] is None):
        return None
    term = terms[0] or terms[1]
    scale = node.args[1] if terms[0] is not None else node.args[0]
    found = _whole_scale(node, scale, block, entering)
    if found is None:
        return None
    return term[0], term[1] + (found,), term[2] | {node}


def _whole_scale(mul: fx.Node, scale: object, block: Optional[str], entering: set) -> Optional[Scale]:
    """``scale`` as a value every TP rank holds whole in the TP region, computed for ``mul`` alone (None if
    it is not: it reads a sharded, partial or outside value, or something else reads what it computes)."""
    if not isinstance(scale, fx.Node):
        return Scale(mul, frozenset(), frozenset())             # a number
    cone, entered, work = set(), set(), [scale]
    while work:
        n = work.pop()
        if n in cone or n in entered:
            continue
        m = get_meta(n)
        if n in entering:
            entered.add(n)
        elif m.slot == SlotKind.PULL_PARAMETER and m.tp_role in (None, TPRole.REPLICATED):
            cone.add(n)
        elif n.op in ("call_function", "call_method") and m.slot is None and m.block == block \
                and m.tp_role in (None, TPRole.REPLICATED) and m.op in (OpKind.LINEAR, OpKind.OTHER):
            cone.add(n)
            work.extend(n.all_input_nodes)
        else:
            return None
    for n in cone:
        users = set(n.users)
        if get_meta(n).slot == SlotKind.PULL_PARAMETER:
            # every use of the parameter must be in a scale: its gradient becomes a per-rank partial sum
            users = {u for pull in n.args[0].users for u in pull.users}
        if not users <= cone | {mul}:
            return None
    return Scale(mul, frozenset(cone), frozenset(entered))


def _entering_values(gm: fx.GraphModule) -> dict[Optional[str], set]:
    """Per block, the values that enter a TP region there (the input of a column-parallel linear or of
    the MoE op with sharded experts: ``insert_slots`` puts a ``tp_enter`` on each)."""
    out: dict[Optional[str], set] = {}
    for n in gm.graph.nodes:
        m = get_meta(n)
        if m.slot is None and n.args and isinstance(n.args[0], fx.Node) and \
                (m.tp_role == TPRole.EXPERTS or (m.op == OpKind.LINEAR and m.tp_role == TPRole.COLUMN)):
            out.setdefault(m.block, set()).add(n.args[0])
    return out
