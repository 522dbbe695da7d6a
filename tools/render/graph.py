"""A renderer-neutral description of a compiled graph, the shared style table, and the DOT renderer.

The integrator turns compiled per-rank programs into an :class:`RGraph` (nodes with a kind and a
nested cluster path such as ``("pipeline 0: TP2PP2", "stage 1", "rank 5")``, edges that are either
data edges inside a rank or ``comm`` edges between ranks); :func:`render_dot`, ``render_svg`` and
``render_html`` draw it.  The colours live here so all three renderers agree (the legend reads the
same table), following Fig. 2c of the Hydraulis paper: Pull Parameter, Push Gradient and Communicate
Activation subgraphs each in their own colour, computational operators in another.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator

from hgraph.errors import HGraphError

# Node kinds in legend order.
NODE_KINDS: tuple[str, ...] = (
    "compute", "pull_parameter", "push_gradient", "comm_activation", "input", "output", "param", "block")
SLOT_KINDS: tuple[str, ...] = ("pull_parameter", "push_gradient", "comm_activation")
EDGE_KINDS: tuple[str, ...] = ("data", "comm")


@dataclass(frozen=True)
class KindStyle:
    """How one node kind is drawn: fill and border colour, and the legend's words for it."""

    fill: str
    stroke: str
    legend: str


KIND_STYLES: dict[str, KindStyle] = {
    "compute": KindStyle("#dbe8f6", "#3d6fa8", "computational op"),
    "pull_parameter": KindStyle("#d3eecb", "#3a8a2c", "Pull Parameter"),
    "push_gradient": KindStyle("#fde0bf", "#c8711b", "Push Gradient"),
    "comm_activation": KindStyle("#eadcf5", "#7a4aa3", "Communicate Activation"),
    "input": KindStyle("#eeeeee", "#6b6b6b", "input"),
    "output": KindStyle("#f8d8d6", "#b2403a", "output"),
    "param": KindStyle("#fff2bf", "#a68a1c", "parameter"),
    "block": KindStyle("#e6e9f2", "#4b5a7a", "layer block"),  # a collapsed box of the HTML page
}
EDGE_COLORS: dict[str, str] = {"data": "#5c5c5c", "comm": "#7a4aa3"}
# Cluster boxes by nesting depth (pipeline, stage, rank, deeper...): light fills, darker borders.
CLUSTER_FILLS: tuple[str, ...] = ("#f6f6f4", "#ececea", "#ffffff", "#f6f6f4")
CLUSTER_STROKES: tuple[str, ...] = ("#8a8a86", "#a3a39f", "#b5b5b1", "#c4c4c0")
FONT_FAMILY = "Helvetica,Arial,sans-serif"


@dataclass(frozen=True)
class RNode:
    """One operator. ``cluster`` is its nested cluster path, outermost first (may be empty).

    ``box`` is the nesting of collapsible boxes inside its cluster, outermost first: e.g.
    ``("layers.3", "pull mlp.up_proj.weight")`` for a node of a Pull Parameter subgraph in a layer
    block.  The HTML page draws each box as one node that expands on click; DOT and SVG ignore it.
    """

    id: str
    label: str
    kind: str
    cluster: tuple[str, ...] = ()
    tooltip: str = ""
    box: tuple[str, ...] = ()


@dataclass(frozen=True)
class REdge:
    """A dependency ``src -> dst``; ``kind`` is ``"data"`` (inside a rank) or ``"comm"`` (between ranks)."""

    src: str
    dst: str
    label: str = ""
    kind: str = "data"


@dataclass
class RGraph:
    """A graph to draw: a title, nodes and edges."""

    title: str
    nodes: list[RNode]
    edges: list[REdge]


@dataclass
class ClusterTree:
    """One cluster of the nesting: its path, the nodes placed directly in it, and its sub-clusters.

    The root has the empty path and stands for the whole graph.  Children keep first-seen order, so
    the drawing follows the order in which the integrator listed nodes (pipelines, stages, ranks).
    """

    path: tuple[str, ...]
    members: list[RNode] = field(default_factory=list)
    children: dict[str, "ClusterTree"] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.path[-1] if self.path else ""

    def walk(self) -> Iterator["ClusterTree"]:
        """This cluster and every descendant, parents before children."""
        yield self
        for child in self.children.values():
            yield from child.walk()


def cluster_tree(nodes: Iterable[RNode]) -> ClusterTree:
    """Group nodes into the nested cluster tree given by their cluster paths."""
    root = ClusterTree(())
    for node in nodes:
        here = root
        for depth, name in enumerate(node.cluster):
            child = here.children.get(name)
            if child is None:
                child = here.children[name] = ClusterTree(node.cluster[: depth + 1])
            here = child
        here.members.append(node)
    return root


def validate_graph(g: RGraph) -> None:
    """Raise HGraphError (one line) for duplicate node ids, unknown kinds or dangling edges."""
    seen: set[str] = set()
    for node in g.nodes:
        if not isinstance(node, RNode):
            raise HGraphError(f"graph {g.title!r}: nodes must be RNode objects, got {type(node).__name__}")
        if node.id in seen:
            raise HGraphError(f"graph {g.title!r}: duplicate node id {node.id!r}; node ids must be unique")
        seen.add(node.id)
        if node.kind not in KIND_STYLES:
            raise HGraphError(
                f"graph {g.title!r}: node {node.id!r} has unknown kind {node.kind!r}; "
                f"allowed: {', '.join(NODE_KINDS)}")
        if not isinstance(node.cluster, tuple) or not all(isinstance(c, str) and c for c in node.cluster):
            raise HGraphError(
                f"graph {g.title!r}: node {node.id!r} has cluster {node.cluster!r}; "
                "expected a tuple of non-empty strings, outermost first")
        if not isinstance(node.box, tuple) or not all(isinstance(b, str) and b for b in node.box):
            raise HGraphError(
                f"graph {g.title!r}: node {node.id!r} has box {node.box!r}; "
                "expected a tuple of non-empty strings, outermost first")
    for edge in g.edges:
        if edge.kind not in EDGE_KINDS:
            raise HGraphError(
                f"graph {g.title!r}: edge {edge.src!r} -> {edge.dst!r} has unknown kind {edge.kind!r}; "
                f"allowed: {', '.join(EDGE_KINDS)}")
        for end in (edge.src, edge.dst):
            if end not in seen:
                raise HGraphError(
                    f"graph {g.title!r}: edge {edge.src!r} -> {edge.dst!r} names node {end!r}, "
                    "which is not in the graph")


def kinds_present(g: RGraph) -> list[str]:
    """The node kinds used in ``g``, in legend order."""
    used = {n.kind for n in g.nodes}
    return [k for k in NODE_KINDS if k in used]


# ---- DOT ------------------------------------------------------------------------------------------

def dot_quote(text: str) -> str:
    """A DOT quoted string for any text.

    Backslashes are doubled (so Graphviz's label escapes such as ``\\N`` never fire and a trailing
    backslash cannot swallow the closing quote), quotes are escaped and newlines become ``\\n``.
    """
    escaped = (text.replace("\\", "\\\\").replace('"', '\\"')
               .replace("\r\n", "\n").replace("\r", "\n").replace("\n", "\\n"))
    return f'"{escaped}"'


def _attrs(pairs: dict[str, str]) -> str:
    return ", ".join(f"{key}={dot_quote(value)}" for key, value in pairs.items())


def _dot_cluster(tree: ClusterTree, counter: list[int], indent: str, out: list[str]) -> None:
    depth = len(tree.path) - 1
    counter[0] += 1
    out.append(f"{indent}subgraph {dot_quote(f'cluster_{counter[0]}')} {{")
    inner = indent + "  "
    out.append(inner + "graph [" + _attrs({
        "label": tree.label, "style": "rounded,filled",
        "fillcolor": CLUSTER_FILLS[min(depth, len(CLUSTER_FILLS) - 1)],
        "color": CLUSTER_STROKES[min(depth, len(CLUSTER_STROKES) - 1)],
        "tooltip": " / ".join(tree.path)}) + "];")
    _dot_members(tree, counter, inner, out)
    out.append(f"{indent}}}")


def _dot_members(tree: ClusterTree, counter: list[int], indent: str, out: list[str]) -> None:
    for node in tree.members:
        style = KIND_STYLES[node.kind]
        out.append(f"{indent}{dot_quote(node.id)} [" + _attrs({
            "label": node.label, "fillcolor": style.fill, "color": style.stroke,
            "tooltip": node.tooltip or node.label, "class": node.kind}) + "];")
    for child in tree.children.values():
        _dot_cluster(child, counter, indent, out)


def _dot_legend(g: RGraph, out: list[str]) -> None:
    """A legend cluster: one swatch per node kind used, and a dashed edge for comm if any."""
    kinds = kinds_present(g)
    has_comm = any(e.kind == "comm" for e in g.edges)
    if not kinds:
        return
    # A prefix no node id starts with, so legend swatches never collide with graph nodes.
    prefix = "__legend_"
    while any(n.id.startswith(prefix) for n in g.nodes):
        prefix = "_" + prefix
    out.append(f"  subgraph {dot_quote('cluster_legend')} {{")
    out.append("    graph [" + _attrs({"label": "legend", "style": "rounded", "color": "#b5b5b1"}) + "];")
    names = []
    for kind in kinds:
        style = KIND_STYLES[kind]
        name = prefix + kind
        names.append(name)
        out.append(f"    {dot_quote(name)} [" + _attrs({
            "label": style.legend, "fillcolor": style.fill, "color": style.stroke}) + "];")
    # Invisible edges keep the swatches in one column instead of one wide row.
    for a, b in zip(names, names[1:]):
        out.append(f"    {dot_quote(a)} -> {dot_quote(b)} [style=invis];")
    if has_comm:
        a, b = dot_quote(prefix + "comm_a"), dot_quote(prefix + "comm_b")
        out.append(f"    {a} [shape=point, width=0.05];")
        out.append(f"    {b} [shape=point, width=0.05];")
        out.append(f"    {a} -> {b} [" + _attrs({
            "label": "between ranks", "style": "dashed", "color": EDGE_COLORS["comm"]}) + "];")
    out.append("  }")


def render_dot(g: RGraph, *, legend: bool = True) -> str:
    """Graphviz DOT text for ``g``: one nested ``subgraph cluster_*`` per cluster path, node fill by
    kind (same colours as the SVG and HTML renderers), ``comm`` edges dashed, and a legend cluster.

    Every id and label is quoted, so any text is safe.  Raises HGraphError for an invalid graph.
    """
    validate_graph(g)
    out = [f"digraph {dot_quote(g.title or 'hgraph')} {{"]
    out.append("  graph [" + _attrs({
        "label": g.title, "labelloc": "t", "fontname": FONT_FAMILY, "rankdir": "TB",
        "newrank": "true", "nodesep": "0.25", "ranksep": "0.35"}) + "];")
    out.append("  node [" + _attrs({
        "shape": "box", "style": "rounded,filled", "fontname": FONT_FAMILY, "fontsize": "10",
        "height": "0.3", "margin": "0.08,0.03"}) + "];")
    out.append("  edge [" + _attrs({"color": EDGE_COLORS["data"], "arrowsize": "0.6", "fontname": FONT_FAMILY,
                                  "fontsize": "9", "fontcolor": "#555555"}) + "];")
    _dot_members(cluster_tree(g.nodes), [0], "  ", out)
    for edge in g.edges:
        attrs: dict[str, str] = {}
        if edge.label:
            attrs["label"] = edge.label
        if edge.kind == "comm":
            attrs.update(style="dashed", color=EDGE_COLORS["comm"])
        tail = f" [{_attrs(attrs)}]" if attrs else ""
        out.append(f"  {dot_quote(edge.src)} -> {dot_quote(edge.dst)}{tail};")
    if legend:
        _dot_legend(g, out)
    out.append("}")
    return "\n".join(out) + "\n"
