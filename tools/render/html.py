"""A self-contained HTML page for an :class:`RGraph`: one legend, a title, pan and zoom, search, node
tooltips, and boxes (layer blocks, slot subgraphs; ``RNode.box``) that open and close on click.

The page holds the laid-out levels of :func:`hgraph.tools.render.collapse.collapse` as JSON and a
small script (:mod:`hgraph.tools.render.page_script`) draws them; a large graph opens with every box
closed, fitted to the width of that view.  No external URL is loaded: styles, data and script are
inline, so the file opens offline from anywhere.
"""
from __future__ import annotations

import json

from hgraph.tools.render.collapse import BLOCK_KIND, collapse
from hgraph.tools.render.graph import CLUSTER_FILLS, CLUSTER_STROKES, EDGE_COLORS, FONT_FAMILY, KIND_STYLES, RGraph
from hgraph.tools.render.layout import CHAR_WIDTH, DUMMY_WIDTH, FONT_SIZE, NODE_GAP
from hgraph.tools.render.page_data import page_data
from hgraph.tools.render.page_script import SCRIPT, STYLE
from hgraph.tools.render.svg import xml_escape

OPEN_UP_TO_NODES = 200  # graphs this small open with every box expanded
MIN_SCALE = 0.6  # the first view fits the width, but never below this (11px labels stay readable)
MAX_SCALE = 1.3

_DEFS = "<defs>" + "".join(
    f'<marker id="arrow-{kind}" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
    f'orient="auto-start-reverse"><path d="M0,1 L10,5 L0,9 z" fill="{color}"/></marker>'
    for kind, color in EDGE_COLORS.items()) + "</defs>"


def _script_json(value: object) -> str:
    """JSON that cannot end its <script> element or open a comment inside it."""
    return (json.dumps(value, separators=(",", ":"), ensure_ascii=False)
            .replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026"))


def _legend_html(kinds: list[str], box_kinds: set[str], has_comm: bool) -> str:
    """One legend: a swatch per node kind shown (boxed when that kind also appears as a box)."""
    items = []
    for kind in kinds:
        style = KIND_STYLES[kind]
        words = style.legend + (" (box: click to open)" if kind == BLOCK_KIND else "")
        boxed = " box" if kind in box_kinds else ""
        items.append(f'<span class="legend-item" data-kind="{kind}"><span class="swatch{boxed}" '
                     f'style="background:{style.fill};border-color:{style.stroke}"></span>'
                     f"{xml_escape(words)}</span>")
    if has_comm:
        items.append(f'<span class="legend-item" data-kind="comm"><span class="dash" '
                     f'style="border-color:{EDGE_COLORS["comm"]}"></span>communication between ranks</span>')
    return '<div class="legend">' + "".join(items) + "</div>"


def render_html(g: RGraph) -> str:
    """A self-contained HTML page showing ``g``.  Raises HGraphError for an invalid graph."""
    collapsed = collapse(g)
    data = page_data(collapsed)
    box_kinds = {box.kind for box in collapsed.boxes.values()}
    kinds = [k for k in KIND_STYLES if k in {n.kind for n in g.nodes} | box_kinds]
    data.update(
        open=len(g.nodes) <= OPEN_UP_TO_NODES, minScale=MIN_SCALE, maxScale=MAX_SCALE, defs=_DEFS,
        nodeGap=NODE_GAP, dummyWidth=DUMMY_WIDTH, charWidth=CHAR_WIDTH * 1.1,  # frame titles are bold
        styles={kind: [s.fill, s.stroke] for kind, s in KIND_STYLES.items()}, edgeColors=EDGE_COLORS,
        clusterFills=list(CLUSTER_FILLS), clusterStrokes=list(CLUSTER_STROKES))
    title = xml_escape(g.title)
    n_boxes = len(collapsed.boxes)
    boxes_note = (f" in {n_boxes} boxes (layer blocks and slot subgraphs): click a box to open it, its "
                  "header to close it;" if n_boxes else ";")
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>{STYLE}</style>
</head>
<body>
<header>
<h1>{title}</h1>
<div class="bar">
{_legend_html(kinds, box_kinds, bool(data["comm"]))}
<span class="tools"><button id="home" type="button" title="fit the width, from the top">fit width</button>
<button id="fit" type="button" title="whole graph">fit all</button>
<button id="zoom-in" type="button" title="zoom in">+</button>
<button id="zoom-out" type="button" title="zoom out">&#8722;</button>
<button id="expand-all" type="button" title="open every box">open all</button>
<button id="collapse-all" type="button" title="close every box">close all</button>
<input id="search" type="search" placeholder="find node (Enter: next)" aria-label="find node">
<span id="found" class="stats"></span></span>
<span class="stats">{len(g.nodes)} nodes{boxes_note} <span id="shown"></span>; drag to pan, wheel to zoom,
hover for details</span>
</div>
</header>
<div id="viewport">
<svg id="graph" xmlns="http://www.w3.org/2000/svg" preserveAspectRatio="xMinYMin meet" font-family="{FONT_FAMILY}"
font-size="{FONT_SIZE:g}" role="img" aria-label="{title}"></svg>
</div>
<script type="application/json" id="graph-data">{_script_json(data)}</script>
<script>{SCRIPT}</script>
</body>
</html>
"""
