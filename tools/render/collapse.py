"""The collapsed views of an :class:`RGraph`: every box (``RNode.box``) drawn as one node.

A box is a layer block or a slot subgraph of one rank (its cluster).  Each *level*, the whole graph
or the inside of one box, is laid out on its own: its items are the nodes placed directly in it and
its child boxes, each drawn as one node, and an edge between nodes in different items becomes one
edge between those items (parallel edges merged, with a count).  Every edge belongs to exactly one
level, the innermost box holding both its ends, so a ``comm`` edge between ranks always belongs to
the whole graph and stays visible however much is collapsed.  The HTML page shows the top level and
swaps a box for its own laid-out inside when it is expanded.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator, Optional

from hgraph.tools.render.graph import SLOT_KINDS, REdge, RGraph, RNode, validate_graph
from hgraph.tools.render.layout import Layout, layout_graph

BLOCK_KIND = "block"


@dataclass
class Box:
    """One collapsible box: where it is, what it holds directly, and its sub-boxes (first-seen order)."""

    id: str
    cluster: tuple[str, ...]
    path: tuple[str, ...]
    parent: Optional["Box"]
    members: list[RNode] = field(default_factory=list)
    children: dict[str, "Box"] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.path[-1]

    def walk(self) -> Iterator["Box"]:
        """This box and every box inside it, parents first."""
        yield self
        for child in self.children.values():
            yield from child.walk()

    def nodes(self) -> Iterator[RNode]:
        """Every node inside, at any depth."""
        for box in self.walk():
            yield from box.members

    @property
    def kind(self) -> str:
        """The slot kind when every node inside is of that kind (a slot subgraph), else ``block``."""
        kinds = {n.kind for n in self.nodes()}
        return kinds.pop() if len(kinds) == 1 and next(iter(kinds)) in SLOT_KINDS else BLOCK_KIND


@dataclass
class Level:
    """The whole graph (``owner`` None) or one box's inside, as a graph of items and its layout.

    ``graph`` holds one RNode per item (a child box's RNode has the box id, a ``block`` or slot
    kind and a label naming it and counting its ops); ``edge_counts`` says how many edges of the
    original graph each merged edge stands for.
    """

    owner: Optional[Box]
    graph: RGraph
    edge_counts: dict[tuple[str, str, str], int]
    layout: Layout


@dataclass
class CollapsedGraph:
    """The levels of a graph: ``boxes`` by id in drawing order (parents first), ``box_of`` each node's
    innermost box (None at the top level), and ``levels`` keyed by box id (None: the top level)."""

    graph: RGraph
    boxes: dict[str, Box]
    box_of: dict[str, Optional[Box]]
    levels: dict[Optional[str], Level]


def box_label(box: Box) -> str:
    """What a collapsed box shows: its name, and for a block how many ops it holds."""
    count = sum(1 for _ in box.nodes())
    if box.kind == BLOCK_KIND:
        return f"{box.name}\n{count} ops"
    return f"{box.name} ({count})"


def _box_ids(g: RGraph) -> str:
    """A prefix for box ids that no node id starts with, so items of a level never collide."""
    prefix = "box:"
    while any(n.id.startswith(prefix) for n in g.nodes):
        prefix = "_" + prefix
    return prefix


def build_boxes(g: RGraph) -> tuple[dict[str, Box], dict[str, Optional[Box]]]:
    """The boxes of ``g`` (keyed by cluster and box path, so boxes never span ranks) in first-seen
    order, parents first, and each node's innermost box."""
    prefix = _box_ids(g)
    roots: dict[tuple[str, ...], dict[str, Box]] = {}
    ordered: list[Box] = []
    box_of: dict[str, Optional[Box]] = {}
    for node in g.nodes:
        siblings = roots.setdefault(node.cluster, {})
        here: Optional[Box] = None
        for depth, name in enumerate(node.box):
            box = siblings.get(name)
            if box is None:
                box = siblings[name] = Box(f"{prefix}{len(ordered)}", node.cluster, node.box[: depth + 1], here)
                ordered.append(box)
            here, siblings = box, box.children
        if here is not None:
            here.members.append(node)
        box_of[node.id] = here
    # Parents first, in first-seen order: a child is seen after its parent, but a parent's later
    # children may come after other boxes, so order by walking the trees.
    tops = [b for b in ordered if b.parent is None]
    boxes = {box.id: box for top in tops for box in top.walk()}
    return boxes, box_of


def _chain(box: Optional[Box]) -> list[Box]:
    """The boxes from the outermost down to ``box``."""
    out = []
    while box is not None:
        out.append(box)
        box = box.parent
    return out[::-1]


def collapse(g: RGraph) -> CollapsedGraph:
    """Every level of ``g`` with its merged edges, laid out.  Raises HGraphError for an invalid graph."""
    validate_graph(g)
    boxes, box_of = build_boxes(g)
    items: dict[Optional[str], list[RNode]] = {None: []}
    for box in boxes.values():
        items[box.id] = []
    listed: set[str] = set()
    for node in g.nodes:  # a level's items in first-seen order: member nodes and child boxes
        chain = _chain(box_of[node.id])
        for depth in range(len(chain) + 1):
            owner = chain[depth - 1].id if depth else None
            if depth < len(chain):
                child = chain[depth]
                if child.id not in listed:
                    listed.add(child.id)
                    items[owner].append(RNode(child.id, box_label(child), child.kind, child.cluster,
                                              " / ".join(child.cluster + child.path)))
            else:
                items[owner].append(node)
    edges: dict[Optional[str], Counter] = {owner: Counter() for owner in items}
    chains = {node_id: _chain(box) for node_id, box in box_of.items()}
    for e in g.edges:
        cu, cv = chains[e.src], chains[e.dst]
        k = 0
        while k < len(cu) and k < len(cv) and cu[k] is cv[k]:
            k += 1
        owner = cu[k - 1].id if k else None
        src = cu[k].id if k < len(cu) else e.src
        dst = cv[k].id if k < len(cv) else e.dst
        if src == dst and e.src != e.dst:
            continue  # both ends inside one child box: drawn inside it
        edges[owner][(src, dst, e.kind)] += 1
    levels: dict[Optional[str], Level] = {}
    for owner, level_items in items.items():
        level_edges = [REdge(src, dst, kind=kind) for (src, dst, kind) in edges[owner]]
        title = g.title if owner is None else " / ".join(boxes[owner].cluster + boxes[owner].path)
        # Inside a box everything is in the box's cluster already: no cluster frames there.
        shown = level_items if owner is None else [
            RNode(n.id, n.label, n.kind, (), n.tooltip) for n in level_items]
        level_graph = RGraph(title, shown, level_edges)
        placed = RGraph(title, shown, layering_edges(shown, level_edges))
        levels[owner] = Level(boxes.get(owner) if owner else None, level_graph, dict(edges[owner]),
                              layout_graph(placed))
    return CollapsedGraph(g, boxes, box_of, levels)


def layering_edges(items: list[RNode], edges: list[REdge]) -> list[REdge]:
    """The edges that place a level's items: every data edge, and the ``comm`` edges that carry work
    forward between non-sibling clusters (e.g. stage to stage), in the direction first seen for each
    pair of clusters.  Comm edges between siblings (the TP ranks of one stage) and the way back
    (gradients to the previous stage) would stack peers below each other or close cycles; the page
    draws every comm edge anyway, between whatever shows its ends.
    """
    cluster = {n.id: n.cluster for n in items}
    direction: dict[frozenset, tuple[tuple[str, ...], tuple[str, ...]]] = {}
    kept = []
    for e in edges:
        if e.kind != "comm":
            kept.append(e)
            continue
        a, b = cluster[e.src], cluster[e.dst]
        if a == b or a[:-1] == b[:-1]:
            continue
        if direction.setdefault(frozenset((a, b)), (a, b)) == (a, b):
            kept.append(e)
    return kept
