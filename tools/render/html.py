"""A self-contained HTML page for an :class:`RGraph`: the SVG inline, a legend, pan and zoom, search,
and node tooltips (the SVG's ``<title>`` elements).  No external URL is loaded: styles and the small
script are inline, so the file opens offline from anywhere.
"""
from __future__ import annotations

from hgraph.tools.render.graph import EDGE_COLORS, KIND_STYLES, RGraph, kinds_present
from hgraph.tools.render.svg import render_svg, strip_xml_prolog, xml_escape

_STYLE = """
* { box-sizing: border-box; }
html, body { margin: 0; height: 100%; font-family: Helvetica, Arial, sans-serif; font-size: 13px; }
body { display: flex; flex-direction: column; }
header { padding: 8px 12px; border-bottom: 1px solid #ccc; background: #fafafa; }
header h1 { font-size: 16px; margin: 0 0 6px 0; }
.bar { display: flex; flex-wrap: wrap; gap: 6px 14px; align-items: center; }
.legend { display: flex; flex-wrap: wrap; gap: 4px 12px; }
.swatch { display: inline-block; width: 20px; height: 12px; border: 1px solid; border-radius: 3px;
          vertical-align: -2px; margin-right: 4px; }
.dash { display: inline-block; width: 24px; vertical-align: 3px; margin-right: 4px;
        border-top: 2px dashed; }
.tools button { font-size: 12px; padding: 2px 8px; }
.tools input { font-size: 12px; padding: 2px 4px; width: 14em; }
.stats { color: #666; }
#viewport { flex: 1; overflow: hidden; cursor: grab; background: #fff; touch-action: none; }
#viewport.dragging { cursor: grabbing; }
#viewport svg { width: 100%; height: 100%; display: block; }
#viewport g.node.hit > rect, #viewport g.node.hit polygon, #viewport g.node.hit path {
  stroke: #e0113d; stroke-width: 3px; }
"""

# Pan by dragging, zoom with the wheel (around the pointer) or the buttons, search highlights nodes
# whose label or tooltip contains the text and Enter centres the next hit.  Works on our SVG and on
# Graphviz's (both put nodes in <g class="node">).
_SCRIPT = """
(function () {
  var vp = document.getElementById('viewport');
  var svg = vp.querySelector('svg');
  if (!svg) return;
  var b = svg.viewBox.baseVal;
  var home = (b && b.width) ? [b.x, b.y, b.width, b.height]
                            : [0, 0, svg.getBBox().width, svg.getBBox().height];
  svg.removeAttribute('width'); svg.removeAttribute('height');
  svg.setAttribute('preserveAspectRatio', 'xMidYMin meet');  // graphs read top down
  var vb = home.slice();
  function apply() { svg.setAttribute('viewBox', vb.join(' ')); }
  function scale() { var r = svg.getBoundingClientRect(); return Math.max(vb[2] / r.width, vb[3] / r.height); }
  function toSvg(cx, cy) {
    var r = svg.getBoundingClientRect(), s = scale();
    return [vb[0] - (r.width * s - vb[2]) / 2 + (cx - r.left) * s,
            vb[1] + (cy - r.top) * s];
  }
  function zoom(f, cx, cy) {
    var p = (cx === undefined) ? [vb[0] + vb[2] / 2, vb[1] + vb[3] / 2] : toSvg(cx, cy);
    vb = [p[0] - (p[0] - vb[0]) * f, p[1] - (p[1] - vb[1]) * f, vb[2] * f, vb[3] * f]; apply();
  }
  function fitWidth() {
    var r = svg.getBoundingClientRect();
    vb = [home[0], home[1], home[2], Math.min(home[3], home[2] * r.height / r.width)]; apply();
  }
  function centre(el) {  // screen box -> viewBox units, so transforms inside the SVG do not matter
    var r = el.getBoundingClientRect(), c = toSvg(r.left + r.width / 2, r.top + r.height / 2);
    var w = Math.max(r.width * scale() * 6, 400), h = w * vb[3] / vb[2];
    vb = [c[0] - w / 2, c[1] - h / 2, w, h]; apply();
  }
  vp.addEventListener('wheel', function (e) {
    e.preventDefault(); zoom(Math.exp(e.deltaY * 0.0015), e.clientX, e.clientY);
  }, {passive: false});
  var drag = null;
  vp.addEventListener('pointerdown', function (e) {
    drag = [e.clientX, e.clientY]; vp.setPointerCapture(e.pointerId); vp.classList.add('dragging');
  });
  vp.addEventListener('pointermove', function (e) {
    if (!drag) return;
    var s = scale();
    vb[0] -= (e.clientX - drag[0]) * s; vb[1] -= (e.clientY - drag[1]) * s;
    drag = [e.clientX, e.clientY]; apply();
  });
  function stop() { drag = null; vp.classList.remove('dragging'); }
  vp.addEventListener('pointerup', stop); vp.addEventListener('pointercancel', stop);
  document.getElementById('zoom-in').onclick = function () { zoom(1 / 1.4); };
  document.getElementById('zoom-out').onclick = function () { zoom(1.4); };
  document.getElementById('fit').onclick = function () { vb = home.slice(); apply(); };
  document.getElementById('fit-width').onclick = fitWidth;
  var nodes = Array.prototype.slice.call(svg.querySelectorAll('g.node'));
  var hits = [], next = 0, found = document.getElementById('found');
  document.getElementById('search').addEventListener('input', function (e) {
    var q = e.target.value.trim().toLowerCase();
    hits = []; next = 0;
    nodes.forEach(function (n) {
      var hit = q !== '' && n.textContent.toLowerCase().indexOf(q) >= 0;
      n.classList.toggle('hit', hit); if (hit) hits.push(n);
    });
    found.textContent = q === '' ? '' : hits.length + ' found';
  });
  document.getElementById('search').addEventListener('keydown', function (e) {
    if (e.key === 'Enter' && hits.length) { centre(hits[next % hits.length]); next += 1; }
  });
  if (home[3] > 2 * home[2]) fitWidth();
})();
"""


def _legend_html(g: RGraph) -> str:
    items = []
    for kind in kinds_present(g):
        style = KIND_STYLES[kind]
        items.append(f'<span class="legend-item" data-kind="{kind}"><span class="swatch" '
                     f'style="background:{style.fill};border-color:{style.stroke}"></span>'
                     f"{xml_escape(style.legend)}</span>")
    if any(e.kind == "comm" for e in g.edges):
        items.append(f'<span class="legend-item" data-kind="comm"><span class="dash" '
                     f'style="border-color:{EDGE_COLORS["comm"]}"></span>communication between ranks</span>')
    return '<div class="legend">' + "".join(items) + "</div>"


def render_html(g: RGraph, *, engine: str = "auto") -> str:
    """A self-contained HTML page showing ``g`` (SVG from :func:`render_svg` with ``engine``)."""
    svg = strip_xml_prolog(render_svg(g, engine=engine))
    title = xml_escape(g.title)
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>{_STYLE}</style>
</head>
<body>
<header>
<h1>{title}</h1>
<div class="bar">
{_legend_html(g)}
<span class="tools"><button id="fit" type="button" title="whole graph">fit</button>
<button id="fit-width" type="button" title="fit the width, from the top">fit width</button>
<button id="zoom-in" type="button" title="zoom in">+</button>
<button id="zoom-out" type="button" title="zoom out">&#8722;</button>
<input id="search" type="search" placeholder="find node (Enter: next)" aria-label="find node">
<span id="found" class="stats"></span></span>
<span class="stats">{len(g.nodes)} nodes, {len(g.edges)} edges; drag to pan, wheel to zoom,
hover a node for details</span>
</div>
</header>
<div id="viewport">
{svg}</div>
<script>{_SCRIPT}</script>
</body>
</html>
"""
