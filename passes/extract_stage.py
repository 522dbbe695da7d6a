"""Rank extraction by stage: keep only the operators of one pipeline stage, with PP send / recv.

The result is a *new* GraphModule (the HGraph is never mutated) whose placeholders are
``input_ids``, ``position_ids`` and ``comm``. Nodes that depend only on graph inputs and
parameters (rotary tables, parameter slots) are copied into every stage that uses them.
Activations crossing a stage boundary are found from the graph, not assumed: every value produced
at or before boundary ``b`` and used after it is sent over that boundary (relayed through
intermediate stages when it skips one). They become Communicate Activation subgraphs: ``pp_recv``
at the start of the receiving stage, ``pp_send`` at the end of the sending one (a TP rank's token slice
under sequence parallelism); a non-last stage
returns the send tokens (their backward receives the gradients), the last stage returns the output.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from hgraph.dims import BindingKey
from hgraph import ops
from hgraph.meta import CommPoint, NodeMeta, SlotKind, get_meta, set_meta
from hgraph.passes.context import PassContext
from hgraph.passes.stage_split import stage_of_blocks

FREE = -1  # a node that only depends on graph inputs and parameters


def node_stages(gm: fx.GraphModule, stage_of: dict[str, int]) -> dict[fx.Node, int]:
    """Stage of every node; FREE for input-only nodes; placeholders FREE; the output is last."""
    last = max(stage_of.values())
    out: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        if node.op == "output":
            out[node] = last
            continue
        block = get_meta(node).block
        out[node] = FREE if block is None else stage_of[block]
    return out


def crossing_values(gm: fx.GraphModule, stages: dict[fx.Node, int], boundary: int) -> list[fx.Node]:
    """Values produced in stages <= boundary and used in stages > boundary, in graph order."""
    return [n for n in gm.graph.nodes
            if stages[n] != FREE and stages[n] <= boundary and n.op != "output"
            and any(stages[u] > boundary for u in n.users)]


def extract_stage_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Copy the nodes of ``ctx.role.stage`` into a new graph, with PP recv / send at its boundaries.

    With PP=1 this still returns a copy (adding the ``comm`` placeholder) and inserts no PP ops.
    """
    stage, pp = ctx.role.stage, ctx.role.scheme.pp
    stages = node_stages(gm, stage_of_blocks(ctx.stage_blocks))
    recv_vals = crossing_values(gm, stages, stage - 1) if stage > 0 else []
    send_vals = crossing_values(gm, stages, stage) if stage < pp - 1 else []
    recv_set = set(recv_vals)

    # the nodes this stage computes, plus the input-only nodes they need
    keep: set[fx.Node] = {n for n, s in stages.items() if s == stage and n.op != "output"}
    if stage == pp - 1:
        keep.add(next(n for n in gm.graph.nodes if n.op == "output"))
    work = list(keep)
    while work:
        n = work.pop()
        for a in n.all_input_nodes:
            if a in keep or a in recv_set:
                continue
            if stages[a] == FREE:
                keep.add(a)
                work.append(a)
            elif stages[a] != stage:
                raise AssertionError(f"node {n.name} in stage {stage} uses {a.name} of stage {stages[a]} "
                                     "which is not sent across the boundary")

    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    placeholders = {n.target: n for n in gm.graph.nodes if n.op == "placeholder"}
    for name in ("input_ids", "position_ids"):
        if name not in placeholders:
            raise AssertionError(f"HGraph lacks the {name!r} placeholder")
        env[placeholders[name]] = g.placeholder(name)
        set_meta(env[placeholders[name]], get_meta(placeholders[name]))
    comm = g.placeholder("comm", default_value=None)
    input_ids = env[placeholders["input_ids"]]

    dtype = ctx.options.working_dtype
    ctx.recv_specs = []
    for i, v in enumerate(recv_vals):
        dims, vdtype = _crossing_dims(ctx, v)
        spec = (tuple(dims), dtype if vdtype.is_floating_point else vdtype)
        ctx.recv_specs.append(spec)
        r = g.call_function(ops.pp_recv, (comm, BindingKey.PP_PREV, i, spec[0], spec[1], input_ids))
        r.name = f"recv_{v.name}"
        set_meta(r, NodeMeta(block=get_meta(v).block, layer=get_meta(v).layer,
                             slot=SlotKind.COMM_ACTIVATION, comm_point=CommPoint.PP_BOUNDARY,
                             subgraph=f"pp_recv:{i}"))
        env[v] = r

    for n in gm.graph.nodes:
        if n not in keep or n.op == "placeholder" or n in env:
            continue
        if n.op == "output":
            env[n] = g.output(fx.map_arg(n.args[0], lambda a: env[a]))
            continue
        env[n] = g.node_copy(n, lambda a: env[a])

    ctx.send_specs = []
    if send_vals:
        tokens = []
        for i, v in enumerate(send_vals):
            dims, vdtype = _crossing_dims(ctx, v)
            ctx.send_specs.append((tuple(dims), dtype if vdtype.is_floating_point else vdtype))
            t = g.call_function(ops.pp_send, (comm, env[v], BindingKey.PP_NEXT, i))
            t.name = f"send_{v.name}"
            set_meta(t, NodeMeta(block=get_meta(v).block, layer=get_meta(v).layer,
                                 slot=SlotKind.COMM_ACTIVATION, comm_point=CommPoint.PP_BOUNDARY,
                                 subgraph=f"pp_send:{i}"))
            tokens.append(t)
        g.output(tuple(tokens))
    return graph_only_module(gm, g)


def _crossing_dims(ctx: PassContext, v: fx.Node) -> tuple[tuple[Any, ...], torch.dtype]:
    """Dims of a value sent between stages; under sequence parallelism a token-sliced value holds the
    rank's slice of ``T`` (``ops.SP_TOKENS``, resolved at run time: uneven slices too)."""
    dims, vdtype = ctx.shapes[v.name]
    if ctx.sp is not None and v.name in ctx.sp.sliced:
        dims = tuple(ops.SP_TOKENS if d == "T" else d for d in dims)
    return tuple(dims), vdtype


def graph_only_module(root: torch.nn.Module, graph: fx.Graph) -> fx.GraphModule:
    """A GraphModule holding ``graph`` without generating its Python code yet.

    The instantiation passes only edit the graph; code is generated once, when the final rank
    module is built (code generation dominates instantiation time otherwise).
    """
    gm = fx.GraphModule(root, fx.Graph())
    gm._graph = graph   # noqa: SLF001 - the graph setter would generate code
    graph.owning_module = root   # lint resolves get_attr targets against the module holding them
    return gm


class _MetaShapes(fx.Interpreter):
    """Runs a graph on the meta device (parameters replaced by meta tensors) and records shapes."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}

    def get_attr(self, target, args, kwargs):
        value = super().get_attr(target, args, kwargs)
        return value.to("meta") if isinstance(value, torch.Tensor) else value

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if isinstance(out, torch.Tensor):
            self.shapes[n.name] = (tuple(out.shape), out.dtype)
        return out


def symbolic_shapes(gm: fx.GraphModule, probes=((2, 5), (3, 7))) -> dict[str, tuple[tuple[Any, ...], torch.dtype]]:
    """Shape of every tensor node with batch / sequence dims written ``"B"`` / ``"T"``.

    Found by running the graph twice on the meta device (no memory, no compute) with inputs of
    different (B, T): a dim that equals B (resp. T) in both probes is symbolic, any other dim must
    agree and is a constant.
    """
    runs = []
    for b, t in probes:
        prop = _MetaShapes(gm)
        ids = torch.zeros(b, t, dtype=torch.long, device="meta")
        pos = torch.arange(t, device="meta").expand(b, t)
        prop.run(ids, pos)
        runs.append(prop.shapes)
    out: dict[str, tuple[tuple[Any, ...], torch.dtype]] = {}
    (b0, t0), (b1, t1) = probes
    for name, (shape0, dtype) in runs[0].items():
        shape1 = runs[1].get(name, (None,))[0]
        if shape1 is None or len(shape0) != len(shape1):
            continue
        dims: list[Any] = []
        for d0, d1 in zip(shape0, shape1):
            if d0 == t0 and d1 == t1:
                dims.append("T")
            elif d0 == b0 and d1 == b1:
                dims.append("B")
            elif d0 == d1:
                dims.append(int(d0))
            else:
                dims = None  # a shape that is no simple function of (B, T)
                break
        if dims is not None:
            out[name] = (tuple(dims), dtype)
    return out
