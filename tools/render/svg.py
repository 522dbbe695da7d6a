"""SVG for an :class:`RGraph`: Graphviz ``dot -Tsvg`` when it is installed, else our own layout.

Our drawing (:func:`svg_from_layout`) uses :mod:`hgraph.tools.render.layout` and the style table of
:mod:`hgraph.tools.render.graph`, so colours match the DOT output and the HTML page.  Structure,
relied on by the tests: ``<g class="cluster" data-path=...>`` (a rect and a label) per cluster,
``<path class="edge data|comm" data-src data-dst>`` per edge (comm dashed), ``<g class="node"
data-id data-kind>`` (a ``<title>`` tooltip, a rect, the label) per node, and ``<g class="legend">``.
"""
from __future__ import annotations

import re
import shutil
import subprocess

from hgraph.errors import HGraphError
from hgraph.tools.render.graph import (CLUSTER_FILLS, CLUSTER_STROKES, EDGE_COLORS, FONT_FAMILY, KIND_STYLES,
                                       RGraph, kinds_present, render_dot)
from hgraph.tools.render.layout import (CLUSTER_PAD, FONT_SIZE, LINE_HEIGHT, SELF_LOOP_REACH, EdgeRoute,
                                        Layout, layout_graph, text_width)

ENGINES = ("auto", "python", "graphviz")
MARGIN = 12.0
TITLE_HEIGHT = 24.0
LEGEND_HEIGHT = 26.0
GRAPHVIZ_TIMEOUT_S = 300.0

# Characters XML 1.0 cannot hold at all (C0 controls except tab, newline, carriage return; surrogates;
# U+FFFE/U+FFFF); they are shown as U+FFFD so any label still gives a well-formed document.
_XML_INVALID = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def xml_escape(text: str) -> str:
    """Text safe inside an XML element or a double-quoted attribute (whitespace other than spaces as
    character references, so attribute values keep their newlines)."""
    text = _XML_INVALID.sub("\ufffd", text)
    return (text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
            .replace('"', "&quot;").replace("'", "&#39;")
            .replace("\n", "&#10;").replace("\r", "&#13;").replace("\t", "&#9;"))


def _f(v: float) -> str:
    return f"{v:.1f}"  # a tenth of a pixel is plenty; fixed format is the fast one


def _edge_path(points: list[tuple[float, float]]) -> str:
    """A smooth path through the points: cubic segments with vertical tangents at every point."""
    (x0, y0) = points[0]
    parts = [f"M{_f(x0)},{_f(y0)}"]
    for (xa, ya), (xb, yb) in zip(points, points[1:]):
        dy = (yb - ya) / 2
        parts.append(f"C{_f(xa)},{_f(ya + dy)} {_f(xb)},{_f(yb - dy)} {_f(xb)},{_f(yb)}")
    return " ".join(parts)


def _self_loop_path(points: list[tuple[float, float]]) -> str:
    """A loop out of the node's right side and back, inside the room the layout kept for it."""
    (x0, y0), (x1, y1) = points
    return (f"M{_f(x0)},{_f(y0)} C{_f(x0 + SELF_LOOP_REACH)},{_f(y0 - 4)} "
            f"{_f(x1 + SELF_LOOP_REACH)},{_f(y1 + 4)} {_f(x1)},{_f(y1)}")


def _legend(g: RGraph, x: float, y: float) -> tuple[list[str], float]:
    """Legend items in one row (swatch + words per kind used, a dashed line for comm edges)."""
    out = ['<g class="legend">']
    cx = x
    for kind in kinds_present(g):
        style = KIND_STYLES[kind]
        out.append(f'<g class="legend-item" data-kind="{kind}">'
                   f'<rect x="{_f(cx)}" y="{_f(y)}" width="22" height="13" rx="3" fill="{style.fill}" '
                   f'stroke="{style.stroke}"/>'
                   f'<text x="{_f(cx + 27)}" y="{_f(y + 10.5)}">{xml_escape(style.legend)}</text></g>')
        cx += 27 + text_width(style.legend) + 16
    if any(e.kind == "comm" for e in g.edges):
        out.append(f'<g class="legend-item" data-kind="comm">'
                   f'<path d="M{_f(cx)},{_f(y + 6.5)} h26" stroke="{EDGE_COLORS["comm"]}" '
                   f'stroke-width="1.4" stroke-dasharray="5,3" fill="none"/>'
                   f'<text x="{_f(cx + 31)}" y="{_f(y + 10.5)}">communication between ranks</text></g>')
        cx += 31 + text_width("communication between ranks") + 16
    out.append("</g>")
    return out, cx - x


def svg_from_layout(g: RGraph, lay: Layout) -> str:
    """The SVG document for a graph and its layout."""
    dx, dy = MARGIN, MARGIN + TITLE_HEIGHT + LEGEND_HEIGHT
    legend, legend_w = _legend(g, MARGIN, MARGIN + TITLE_HEIGHT)
    width = max(lay.width, legend_w, text_width(g.title) * 1.3) + 2 * MARGIN
    height = lay.height + dy + MARGIN
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="hgraph" viewBox="0 0 {_f(width)} {_f(height)}" '
        f'width="{_f(width)}" height="{_f(height)}" font-family="{FONT_FAMILY}" font-size="{_f(FONT_SIZE)}">',
        f"<title>{xml_escape(g.title)}</title>",
        "<defs>",
    ]
    for kind, color in EDGE_COLORS.items():
        out.append(f'<marker id="arrow-{kind}" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
                   f'markerHeight="7" orient="auto-start-reverse"><path d="M0,1 L10,5 L0,9 z" '
                   f'fill="{color}"/></marker>')
    out += ["</defs>",
            f'<rect class="background" x="0" y="0" width="{_f(width)}" height="{_f(height)}" fill="#ffffff"/>',
            f'<text class="title" x="{_f(MARGIN)}" y="{_f(MARGIN + 15)}" font-size="15" '
            f'font-weight="bold">{xml_escape(g.title)}</text>']
    out += legend

    out.append('<g class="clusters">')
    for c in lay.clusters:
        depth = min(c.depth, len(CLUSTER_FILLS) - 1)
        out.append(
            f'<g class="cluster" data-path="{xml_escape(" / ".join(c.path))}" data-depth="{c.depth}">'
            f"<title>{xml_escape(' / '.join(c.path))}</title>"
            f'<rect x="{_f(c.x + dx)}" y="{_f(c.y + dy)}" width="{_f(c.w)}" height="{_f(c.h)}" rx="6" '
            f'fill="{CLUSTER_FILLS[depth]}" stroke="{CLUSTER_STROKES[depth]}"/>'
            f'<text x="{_f(c.x + dx + CLUSTER_PAD)}" y="{_f(c.y + dy + 13)}" font-weight="bold" '
            f'fill="#444444">{xml_escape(c.path[-1])}</text></g>')
    out.append("</g>")

    out.append('<g class="edges" fill="none">')
    for route in lay.edges:
        out.append(_edge_svg(route, dx, dy))
    out.append("</g>")

    out.append('<g class="nodes">')
    by_id = {n.id: n for n in g.nodes}
    for node_id, box in lay.nodes.items():
        node = by_id[node_id]
        style = KIND_STYLES[node.kind]
        x0, y0 = box.x - box.w / 2 + dx, box.y - box.h / 2 + dy
        text_y0 = box.y + dy - (len(box.lines) - 1) * LINE_HEIGHT / 2 + FONT_SIZE * 0.35
        spans = "".join(
            f'<tspan x="{_f(box.x + dx)}" y="{_f(text_y0 + k * LINE_HEIGHT)}">{xml_escape(line)}</tspan>'
            for k, line in enumerate(box.lines))
        out.append(
            f'<g class="node" data-id="{xml_escape(node.id)}" data-kind="{node.kind}">'
            f"<title>{xml_escape(node.tooltip or node.label)}</title>"
            f'<rect x="{_f(x0)}" y="{_f(y0)}" width="{_f(box.w)}" height="{_f(box.h)}" rx="4" '
            f'fill="{style.fill}" stroke="{style.stroke}"/>'
            f'<text text-anchor="middle">{spans}</text></g>')
    out.append("</g>")
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _edge_svg(route: EdgeRoute, dx: float, dy: float) -> str:
    e = route.edge
    points = [(px + dx, py + dy) for px, py in route.points]
    d = _self_loop_path(points) if e.src == e.dst else _edge_path(points)
    dash = ' stroke-dasharray="5,3"' if e.kind == "comm" else ""
    width = "1.4" if e.kind == "comm" else "1"
    path = (f'<path class="edge {e.kind}" data-src="{xml_escape(e.src)}" data-dst="{xml_escape(e.dst)}" '
            f'd="{d}" stroke="{EDGE_COLORS[e.kind]}" stroke-width="{width}"{dash} '
            f'marker-end="url(#arrow-{e.kind})"/>')
    if not e.label:
        return path
    mx, my = route.points[len(route.points) // 2] if len(route.points) > 2 else (
        (route.points[0][0] + route.points[-1][0]) / 2, (route.points[0][1] + route.points[-1][1]) / 2)
    return (path + f'<text class="edge-label" x="{_f(mx + dx + 3)}" y="{_f(my + dy)}" font-size="9" '
            f'fill="#555555" stroke="#ffffff" stroke-width="3" paint-order="stroke">'
            f"{xml_escape(e.label)}</text>")


def graphviz_svg(g: RGraph, *, dot_binary: str = "dot", timeout_s: float = GRAPHVIZ_TIMEOUT_S) -> str:
    """SVG from Graphviz ``dot -Tsvg`` run on :func:`render_dot`'s text. HGraphError if it is missing
    or fails."""
    binary = shutil.which(dot_binary)
    if binary is None:
        raise HGraphError(
            f"Graphviz '{dot_binary}' is not on PATH; install Graphviz or use engine='python' "
            "(the built-in layout)")
    try:
        done = subprocess.run([binary, "-Tsvg"], input=render_dot(g), capture_output=True, text=True,
                              timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise HGraphError(f"Graphviz took longer than {timeout_s:g} s on graph {g.title!r} "
                          f"({len(g.nodes)} nodes); use engine='python' for large graphs") from None
    if done.returncode != 0 or "<svg" not in done.stdout:
        first = (done.stderr.strip().splitlines() or ["no output"])[0]
        raise HGraphError(f"Graphviz failed on graph {g.title!r} (exit {done.returncode}): {first}")
    return done.stdout


def render_svg(g: RGraph, *, engine: str = "auto") -> str:
    """An SVG document for ``g``.

    ``engine``: ``"auto"`` uses Graphviz ``dot -Tsvg`` when the binary is on PATH, else our own
    layout; ``"python"`` always ours; ``"graphviz"`` requires Graphviz (HGraphError if absent).
    """
    if engine not in ENGINES:
        raise HGraphError(f"unknown SVG engine {engine!r}; allowed: {', '.join(ENGINES)}")
    if engine == "graphviz" or (engine == "auto" and shutil.which("dot") is not None):
        return graphviz_svg(g)
    return svg_from_layout(g, layout_graph(g))
