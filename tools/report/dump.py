"""Dumps of instantiated programs: text, runnable Python, JSON (the IR's own text forms,
``hgraph.program_text``) and graphs (DOT / SVG / HTML, drawn here).

``render_program(program, fmt, rank=None)`` is the one entry point (and the renderer that
``CompiledModule.dump(..., renderer=render_program)`` takes for the graph formats); ``rank=None`` means every rank
(for ``python`` and ``text`` the ranks are concatenated; graphs show each rank as a cluster inside
its pipeline and stage).
"""
from __future__ import annotations

from collections import Counter
from typing import Optional

import torch.fx as fx

from hgraph.dims import BindingKey
from hgraph.errors import HGraphError
from hgraph.meta import get_meta
from hgraph.program import Program, RankProgram
from hgraph.program_text import TEXT_FORMATS, is_comm, render_text, selected_ranks
from hgraph.tools.render.graph import REdge, RGraph, RNode, render_dot
from hgraph.tools.render.html import render_html
from hgraph.tools.render.svg import render_svg

FORMATS = ("text", "python", "dot", "svg", "html", "json")


def render_program(program: Program, fmt: str = "text", rank: Optional[int] = None, model: str = "") -> str:
    """``program`` (every rank, or ``rank``) in ``fmt``; ``model`` names the model in graph titles. The
    text forms are the IR's own (``hgraph.program_text``); this draws the graphs."""
    if fmt not in FORMATS:
        raise HGraphError(f"unknown dump format {fmt!r}; allowed: {', '.join(FORMATS)}")
    if fmt in TEXT_FORMATS:
        return render_text(program, fmt, rank, model)
    graph = program_rgraph(program, selected_ranks(program, rank), model)
    if fmt == "dot":
        return render_dot(graph)
    if fmt == "svg":
        return render_svg(graph)
    return render_html(graph)


# ---- graphs ---------------------------------------------------------------------------------------
def _kind(n: fx.Node) -> str:
    m = get_meta(n)
    if m.slot is not None:
        return m.slot.value
    if n.op == "placeholder":
        return "input"
    if n.op == "output":
        return "output"
    if n.op == "get_attr":
        return "param"
    return "compute"


OUTSIDE_BLOCKS = "outside blocks"


def _blocks(nodes: list[fx.Node]) -> dict[str, Optional[str]]:
    """Each node's layer block (a box of the HTML page): its ``NodeMeta.block`` if the rank computes
    that block; for a filled slot subgraph the block its parameter lives in (``layers.3.mlp...``) or
    else the one its neighbours outside it are in (a stage's receive of ``layers.1``'s output goes
    with the ``layers.2`` that reads it); a parameter node or compute outside every block goes with
    its users when they are all in one block, else (rotary tables every block reads) into one
    ``outside blocks`` box."""
    known = {get_meta(n).block for n in nodes if get_meta(n).slot is None} - {None}
    block: dict[str, Optional[str]] = {}
    for n in nodes:
        m = get_meta(n)
        owner = [b for b in known if m.param and m.param.startswith(b + ".")]
        block[n.name] = m.block if m.block in known else max(owner, key=len, default=None)
    members: dict[str, list[fx.Node]] = {}
    for n in nodes:
        if get_meta(n).subgraph:
            members.setdefault(get_meta(n).subgraph, []).append(n)
    for group in members.values():
        inside = {n.name for n in group}
        found = [block[n.name] for n in group if block[n.name]] or [
            block[o.name] for n in group for o in (*n.all_input_nodes, *n.users)
            if o.name not in inside and block.get(o.name)]
        for n in group:
            block[n.name] = Counter(found).most_common(1)[0][0] if found else None  # ties: first seen
    for n in reversed(nodes):  # users first, so chains of such nodes follow their consumers
        users = {block.get(u.name) for u in n.users}
        if block[n.name] is None and n.op in ("get_attr", "call_function", "call_method"):
            block[n.name] = users.pop() if len(users) == 1 and None not in users else (
                None if n.op == "get_attr" else OUTSIDE_BLOCKS)
    return block


_SLOT_WORDS = {"pull_parameter": "pull", "push_gradient": "push", "comm_activation": "comm"}


def _box(n: fx.Node, block: Optional[str]) -> tuple[str, ...]:
    """The page's boxes around ``n``: its block, and its slot subgraph named by what it moves."""
    m = get_meta(n)
    outer = (block,) if block else ()
    if not m.subgraph or m.slot is None:
        return outer
    point, _, tail = m.subgraph.partition(":")
    what = m.param or (tail if tail.startswith(point) else f"{point} {tail}".strip())
    if block and what.startswith(block + "."):
        what = what[len(block) + 1:]
    return outer + (f"{_SLOT_WORDS[m.slot.value]} {what}",)


def graph_title(program: Program, ranks: list[RankProgram], model: str = "") -> str:
    """What a drawing shows: the model, the strategy and which ranks."""
    world = program.cluster.world_size
    shown = (f"all {world} ranks" if len(ranks) == world else
             f"rank {ranks[0].rank} of {world}" if len(ranks) == 1 else
             f"ranks {', '.join(str(rp.rank) for rp in ranks)} of {world}")
    return f"{model} under {program.strategy}: {shown}" if model else f"{program.strategy}: {shown}"


def program_rgraph(program: Program, ranks: list[RankProgram], model: str = ""):
    """The renderer-neutral graph of ``ranks``: one cluster per pipeline / stage / rank, and in each
    rank one box per layer block and per filled slot subgraph."""
    nodes, edges = [], []
    for rp in ranks:
        cluster = (f"pipeline {rp.pipeline}: {rp.scheme}", f"stage {rp.stage}", f"rank {rp.rank}")
        graph_nodes = [n for n in rp.graph_module.graph.nodes if not is_comm(n)]
        blocks = _blocks(graph_nodes)
        for n in graph_nodes:
            target = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
            m = get_meta(n)
            nodes.append(RNode(f"r{rp.rank}.{n.name}", target if n.op != "placeholder" else n.name, _kind(n),
                               cluster, f"{n.name}: {n.op} {target}" + (f" ({m.param})" if m.param else ""),
                               _box(n, blocks[n.name])))
            for a in n.all_input_nodes:
                if not is_comm(a):
                    edges.append(REdge(f"r{rp.rank}.{a.name}", f"r{rp.rank}.{n.name}"))
    # cross-rank activation edges: each send to the matching receive of the next stage
    shown = {rp.rank: rp for rp in ranks}
    for rp in ranks:
        nxt = rp.bindings.get(BindingKey.PP_NEXT)
        if not nxt or nxt[0] not in shown:
            continue
        sends = [n for n in rp.graph_module.graph.nodes if (get_meta(n).subgraph or "").startswith("pp_send")]
        recvs = [n for n in shown[nxt[0]].graph_module.graph.nodes if (get_meta(n).subgraph or "").startswith("pp_recv")]
        for s, r in zip(sends, recvs):
            edges.append(REdge(f"r{rp.rank}.{s.name}", f"r{nxt[0]}.{r.name}", "activation", "comm"))
    return RGraph(graph_title(program, ranks, model), nodes, edges)
