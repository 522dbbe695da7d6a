"""The style sheet and the script of the HTML page (inline, so the page opens offline).

The script draws the graph from the page's data (:mod:`hgraph.tools.render.page_data`) into one
``<svg id="graph">``.  Each level (the top one, and the inside of every open box) is laid out again
from its Python layout around the sizes of its open boxes, insides first: its rows and its bands
(the column strips of the clusters) are kept; a row grows to its tallest item and pushes the rows
below it down, items in a band's row keep their order and move right only as far as the items
before them grew, and a band that grows pushes the bands to its right.  Edges keep their routes,
their bends moved along.  So opening a box costs only the room it needs, and the drawing depends
only on which boxes are open.

What the browser test and a reader rely on: collapsed boxes are ``<g class="box" data-box>``, open
ones ``<g class="frame" data-box>`` (click the header to close), nodes ``<g class="node" data-id>``,
edges ``<path class="edge data|comm">``; ``window.hgraphPage`` has ``expand``, ``collapse``,
``expandAll``, ``collapseAll`` and ``state``.
"""

STYLE = """
* { box-sizing: border-box; }
html, body { margin: 0; height: 100%; font-family: Helvetica, Arial, sans-serif; font-size: 13px; }
body { display: flex; flex-direction: column; }
header { padding: 8px 12px; border-bottom: 1px solid #ccc; background: #fafafa; }
header h1 { font-size: 16px; margin: 0 0 6px 0; }
.bar { display: flex; flex-wrap: wrap; gap: 6px 14px; align-items: center; }
.legend { display: flex; flex-wrap: wrap; gap: 4px 12px; }
.swatch { display: inline-block; width: 20px; height: 12px; border: 1px solid; border-radius: 3px;
          vertical-align: -2px; margin-right: 4px; }
.swatch.box { border-width: 2px; box-shadow: 2px 2px 0 #9aa3b5; }
.dash { display: inline-block; width: 24px; vertical-align: 3px; margin-right: 4px; border-top: 2px dashed; }
.tools button { font-size: 12px; padding: 2px 8px; }
.tools input { font-size: 12px; padding: 2px 4px; width: 14em; }
.stats { color: #666; }
#viewport { flex: 1; overflow: hidden; cursor: grab; background: #fff; touch-action: none; }
#viewport.dragging { cursor: grabbing; }
#graph { width: 100%; height: 100%; display: block; }
#graph .box, #graph .frame-head { cursor: pointer; }
#graph .box:hover > rect.face { stroke-width: 3px; }
#graph .hit > rect.face { stroke: #e0113d; stroke-width: 3px; }
"""

SCRIPT = r"""
(function () {
  'use strict';
  var D = JSON.parse(document.getElementById('graph-data').textContent);
  var PAD = 10, HEAD = 22, MARGIN = 14, EPS = 0.01, LINE = 13, FONT = 11, GAP = D.nodeGap, DUMMY = D.dummyWidth;
  var vp = document.getElementById('viewport'), svg = document.getElementById('graph');
  var expanded = new Set(D.open ? D.order : []);
  var geo = null, vb = [0, 0, 1, 1], hits = [], nextHit = 0;

  function esc(s) {
    return String(s).replace(/&/g, '&amp;').replace(/</g, '&lt;').replace(/>/g, '&gt;').replace(/"/g, '&quot;');
  }
  function f(v) { return v.toFixed(1); }
  function chain(nodeId) {  // the boxes around a node, outermost first
    var out = [];
    for (var b = D.nodes[nodeId].b; b; b = D.boxes[b].parent) out.unshift(b);
    return out;
  }
  function visibleItem(nodeId) {  // the node, or the outermost closed box holding it
    var c = chain(nodeId);
    for (var i = 0; i < c.length; i++) if (!expanded.has(c[i])) return c[i];
    return nodeId;
  }

  // ---- geometry: each level laid out again around its open boxes, insides first ----
  function anchor(r, p) { return [(p[0] - r[0]) / Math.max(r[2] - r[0], EPS), (p[1] - r[1]) / Math.max(r[3] - r[1], EPS)]; }
  function at(r, a) { return [r[0] + a[0] * (r[2] - r[0]), r[1] + a[1] * (r[3] - r[1])]; }
  function frameTitle(id) { var b = D.boxes[id]; return '\u2212 ' + b.name + ' (' + b.n + ' ops)'; }
  function layoutLevel(key) {  // bends inside a row are placed like thin items
    var L = D.levels[key], out = {items: {}, inner: {}, edges: [], clusters: []}, size = {};
    L.items.forEach(function (it) {
      var id = it[0];
      if (D.boxes[id] && expanded.has(id)) {
        var sub = layoutLevel(id);
        out.inner[id] = sub;
        size[id] = [Math.max(it[3], sub.w + 2 * PAD, frameTitle(id).length * D.charWidth + 2 * PAD),
                    Math.max(it[4], sub.h + HEAD + 2 * PAD)];
      } else {
        size[id] = [it[3], it[4]];
      }
    });
    var byY = {}, rows = [];
    L.items.forEach(function (it) {
      var k = Math.round(it[2] * 2), row = byY[k];
      if (!row) { row = byY[k] = {top: Infinity, bottom: -Infinity, items: []}; rows.push(row); }
      row.top = Math.min(row.top, it[2] - it[4] / 2); row.bottom = Math.max(row.bottom, it[2] + it[4] / 2);
      row.items.push(it);
    });
    rows.sort(function (a, b) { return a.top - b.top; });
    rows.forEach(function (row, r) {
      row.k = r;
      row.newTop = r === 0 ? row.top : rows[r - 1].newBottom + (row.top - rows[r - 1].bottom);
      var h = row.bottom - row.top;
      row.items.forEach(function (it) { h = Math.max(h, it[2] - it[4] / 2 - row.top + size[it[0]][1]); });
      row.newBottom = row.newTop + h;
    });
    function mapY(y) {  // inside a row: from its top; on or below its bottom edge: from its bottom
      var prev = null;
      for (var r = 0; r < rows.length; r++) {
        if (y < rows[r].top - EPS) break;
        if (y < rows[r].bottom - EPS) return rows[r].newTop + (y - rows[r].top);
        prev = rows[r];
      }
      return prev ? prev.newBottom + (y - prev.bottom) : y;
    }
    var bands = L.bands.map(function (b) { return {x: b[0], area: b[1], w: b[2], growth: 0, rows: {}}; });
    function bandAt(x) {
      for (var b = 0; b < bands.length; b++) if (x >= bands[b].x - EPS && x <= bands[b].x + bands[b].w + EPS) return b;
      return -1;
    }
    function cell(b, row) { return bands[b].rows[row.k] || (bands[b].rows[row.k] = []); }
    L.items.forEach(function (it) {
      var row = byY[Math.round(it[2] * 2)];
      cell(it[6], row).push({left: it[1] - it[3] / 2, w: size[it[0]][0], gap: GAP, item: it});
    });
    var edges = L.edges.map(function (e) {
      var p = e[3], mid = [];
      for (var i = 2; i < p.length - 2; i += 2) {
        var pt = {x: p[i], y: p[i + 1]}, row = byY[Math.round(p[i + 1] * 2)], b = bandAt(p[i]);
        if (row && b >= 0 && p[i] <= bands[b].x + bands[b].area + EPS) {  // a bend inside a row: a thin item
          pt.el = {left: p[i] - DUMMY / 2, w: DUMMY, gap: 2};
          cell(b, row).push(pt.el);
        }
        mid.push(pt);
      }
      return {e: e, mid: mid};
    });
    bands.forEach(function (band) {
      Object.keys(band.rows).forEach(function (k) {
        var right = -Infinity;
        band.rows[k].sort(function (a, b) { return a.left - b.left; }).forEach(function (el) {
          el.rel = Math.max(el.left - band.x, right + el.gap);
          right = el.rel + el.w;
        });
        band.growth = Math.max(band.growth, right - band.area);
      });
    });
    function mapX(x) {  // a point outside rows: moved by the growth of every band whose rows end left of it
      var dx = 0;
      bands.forEach(function (band) { if (band.x + band.area <= x + EPS) dx += band.growth; });
      return x + dx;
    }
    bands.forEach(function (band) { band.newX = mapX(band.x); });
    bands.forEach(function (band) {
      Object.keys(band.rows).forEach(function (k) {
        band.rows[k].forEach(function (el) { el.x = band.newX + el.rel; });
      });
    });
    L.items.forEach(function (it) {
      var row = byY[Math.round(it[2] * 2)], el = null, c = cell(it[6], row);
      for (var i = 0; i < c.length; i++) if (c[i].item === it) el = c[i];
      var top = row.newTop + (it[2] - it[4] / 2 - row.top), s = size[it[0]];
      out.items[it[0]] = [el.x, top, el.x + s[0], top + s[1]];
    });
    edges.forEach(function (d) {
      var e = d.e, p = e[3], n = p.length;
      var src0 = [p[0], p[1]], dst0 = [p[n - 2], p[n - 1]];
      out.edges.push({src: e[0], dst: e[1], n: e[2], a: anchor(origRect(L, e[0]), src0), b: anchor(origRect(L, e[1]), dst0),
                      mid: d.mid.map(function (pt) { return pt.el ? [pt.el.x + DUMMY / 2, mapY(pt.y)] : [mapX(pt.x), mapY(pt.y)]; })});
    });
    L.clusters.forEach(function (c) {
      out.clusters.push({path: c[0], r: [mapX(c[1]), mapY(c[2]), mapX(c[1] + c[3]), mapY(c[2] + c[4])]});
    });
    out.w = mapX(L.w); out.h = mapY(L.h);
    return out;
  }
  function origRect(L, id) {
    if (!L.index) { L.index = {}; L.items.forEach(function (it) { L.index[it[0]] = it; }); }
    var it = L.index[id];
    return [it[1] - it[3] / 2, it[2] - it[4] / 2, it[1] + it[3] / 2, it[2] + it[4] / 2];
  }
  function geometry() {  // every level placed where its box is
    var g = {rects: {}, lines: {}, frames: {}, edges: [], clusters: []};
    function emit(key, lay, ox, oy) {
      function shift(p) { return [p[0] + ox, p[1] + oy]; }
      D.levels[key].items.forEach(function (it) {
        var r = lay.items[it[0]];
        g.rects[it[0]] = [r[0] + ox, r[1] + oy, r[2] + ox, r[3] + oy];
        g.lines[it[0]] = it[5];
      });
      lay.clusters.forEach(function (c) {
        g.clusters.push({path: c.path, r: [c.r[0] + ox, c.r[1] + oy, c.r[2] + ox, c.r[3] + oy]});
      });
      lay.edges.forEach(function (e) { g.edges.push({src: e.src, dst: e.dst, n: e.n, a: e.a, b: e.b, mid: e.mid.map(shift)}); });
      Object.keys(lay.inner).forEach(function (id) {
        var r = g.rects[id], sub = lay.inner[id];
        g.frames[id] = true;
        emit(id, sub, r[0] + (r[2] - r[0] - sub.w) / 2, r[1] + HEAD + PAD);
      });
    }
    var root = layoutLevel('');
    emit('', root, 0, 0);
    g.size = [root.w, root.h];
    return g;
  }

  // ---- drawing ----
  function curve(pts) {  // cubic segments with vertical tangents, as the SVG renderer draws them
    var d = 'M' + f(pts[0][0]) + ',' + f(pts[0][1]);
    for (var i = 1; i < pts.length; i++) {
      var a = pts[i - 1], b = pts[i], dy = (b[1] - a[1]) / 2;
      d += ' C' + f(a[0]) + ',' + f(a[1] + dy) + ' ' + f(b[0]) + ',' + f(b[1] - dy) + ' ' + f(b[0]) + ',' + f(b[1]);
    }
    return d;
  }
  function commPath(a, b) {  // between two rects: down, up, or sideways when they share rows
    if (b[1] >= a[3]) return curve([[(a[0] + a[2]) / 2, a[3]], [(b[0] + b[2]) / 2, b[1]]]);
    if (a[1] >= b[3]) {  // back up (gradients): out of the right sides, bulging right, not across the boxes
      var xa = a[2], ya = (a[1] + a[3]) / 2, xb = b[2], yb = (b[1] + b[3]) / 2, out = Math.max(xa, xb) + 40;
      return 'M' + f(xa) + ',' + f(ya) + ' C' + f(out) + ',' + f(ya) + ' ' + f(out) + ',' + f(yb) + ' ' + f(xb) + ',' + f(yb);
    }
    var right = b[0] >= a[2], y0 = (a[1] + a[3]) / 2, y1 = (b[1] + b[3]) / 2;
    var x0 = right ? a[2] : a[0], x1 = right ? b[0] : b[2], k = (x1 - x0) / 2;
    return 'M' + f(x0) + ',' + f(y0) + ' C' + f(x0 + k) + ',' + f(y0) + ' ' + f(x1 - k) + ',' + f(y1) +
           ' ' + f(x1) + ',' + f(y1);
  }
  function label(r, lines, bold) {
    var cx = (r[0] + r[2]) / 2, y0 = (r[1] + r[3]) / 2 - (lines.length - 1) * LINE / 2 + FONT * 0.35;
    return '<text text-anchor="middle">' + lines.map(function (ln, k) {
      return '<tspan x="' + f(cx) + '" y="' + f(y0 + k * LINE) + '"' + (bold && k === 0 ? ' font-weight="bold"' : '') +
             '>' + esc(ln) + '</tspan>';
    }).join('') + '</text>';
  }
  function rect(r, attrs) {
    return '<rect x="' + f(r[0]) + '" y="' + f(r[1]) + '" width="' + f(r[2] - r[0]) + '" height="' + f(r[3] - r[1]) + '" ' + attrs + '/>';
  }
  function render() {
    geo = geometry();
    var out = [], hitItems = new Set(hits.map(visibleItem));
    geo.clusters.forEach(function (c) {
      var depth = Math.min(c.path.length - 1, D.clusterFills.length - 1);
      out.push('<g class="cluster" data-path="' + esc(c.path.join(' / ')) + '"><title>' + esc(c.path.join(' / ')) + '</title>' +
               rect(c.r, 'rx="6" fill="' + D.clusterFills[depth] + '" stroke="' + D.clusterStrokes[depth] + '"') +
               '<text x="' + f(c.r[0] + 9) + '" y="' + f(c.r[1] + 13) + '" font-weight="bold" fill="#444">' +
               esc(c.path[c.path.length - 1]) + '</text></g>');
    });
    D.order.forEach(function (id) {
      if (!geo.frames[id]) return;
      var b = D.boxes[id], s = D.styles[b.kind], r = geo.rects[id];
      out.push('<g class="frame" data-box="' + esc(id) + '" data-kind="' + b.kind + '"><title>' + esc(b.tip) + '</title>' +
               rect(r, 'rx="6" fill="#ffffff" fill-opacity="0.85" stroke="' + s[1] + '" stroke-width="1.5"') +
               '<g class="frame-head" data-box="' + esc(id) + '">' +
               rect([r[0], r[1], r[2], r[1] + HEAD], 'rx="6" fill="' + s[0] + '" stroke="' + s[1] + '" stroke-width="1.5"') +
               '<text x="' + f(r[0] + 8) + '" y="' + f(r[1] + 15) + '" font-weight="bold" fill="#333">' +
               esc(frameTitle(id)) + '</text></g></g>');
    });
    out.push('<g class="edges" fill="none">');
    geo.edges.forEach(function (e) {
      var pts = [at(geo.rects[e.src], e.a)].concat(e.mid, [at(geo.rects[e.dst], e.b)]);
      out.push('<path class="edge data" data-src="' + esc(e.src) + '" data-dst="' + esc(e.dst) + '" d="' + curve(pts) +
               '" stroke="' + D.edgeColors.data + '" stroke-width="' + f(Math.min(1 + Math.log2(e.n) / 2, 3)) +
               '" marker-end="url(#arrow-data)">' + (e.n > 1 ? '<title>' + e.n + ' edges</title>' : '') + '</path>');
    });
    var seen = {};
    D.comm.forEach(function (c) {
      var a = visibleItem(c[0]), b = visibleItem(c[1]), key = a + '\u0000' + b;
      if (a === b || seen[key]) return;
      seen[key] = true;
      out.push('<path class="edge comm" data-src="' + esc(a) + '" data-dst="' + esc(b) + '" d="' +
               commPath(geo.rects[a], geo.rects[b]) + '" stroke="' + D.edgeColors.comm +
               '" stroke-width="1.6" stroke-dasharray="5,3" marker-end="url(#arrow-comm)"><title>' +
               esc(c[2] || 'communication between ranks') + '</title></path>');
    });
    out.push('</g>');
    Object.keys(geo.rects).forEach(function (id) {
      if (geo.frames[id]) return;
      var r = geo.rects[id], hit = hitItems.has(id) ? ' hit' : '';
      if (D.nodes[id]) {
        var n = D.nodes[id], s = D.styles[n.k];
        out.push('<g class="node' + hit + '" data-id="' + esc(id) + '" data-kind="' + n.k + '"><title>' + esc(n.t) + '</title>' +
                 rect(r, 'class="face" rx="4" fill="' + s[0] + '" stroke="' + s[1] + '"') + label(r, geo.lines[id], false) + '</g>');
      } else {
        var b = D.boxes[id], bs = D.styles[b.kind];
        out.push('<g class="box' + hit + '" data-box="' + esc(id) + '" data-kind="' + b.kind + '"><title>' + esc(b.tip) +
                 ' (click to open)</title>' + rect([r[0] + 3, r[1] + 3, r[2] + 3, r[3] + 3], 'rx="5" fill="' + bs[1] + '" opacity="0.35"') +
                 rect(r, 'class="face" rx="5" fill="' + bs[0] + '" stroke="' + bs[1] + '" stroke-width="2"') +
                 label(r, geo.lines[id], b.kind === 'block') +
                 '<circle cx="' + f(r[2] - 1) + '" cy="' + f(r[1] + 1) + '" r="6" fill="#fff" stroke="' + bs[1] + '"/>' +
                 '<path d="M' + f(r[2] - 4) + ',' + f(r[1] + 1) + 'h6M' + f(r[2] - 1) + ',' + f(r[1] - 2) + 'v6" stroke="' +
                 bs[1] + '" stroke-width="1.5"/></g>');
      }
    });
    svg.innerHTML = D.defs + out.join('');
    document.getElementById('shown').textContent = Object.keys(geo.rects).length - Object.keys(geo.frames).length +
      ' shown, ' + expanded.size + ' of ' + D.order.length + ' boxes open';
  }

  // ---- view: viewBox = [x, y, w, h] with the viewport's aspect, so one scale for both axes ----
  function scale() { return vp.clientWidth / vb[2]; }
  function setView(x, y, s) {
    vb = [x, y, vp.clientWidth / s, vp.clientHeight / s];
    svg.setAttribute('viewBox', vb.map(f).join(' '));
  }
  function fullWidth() { return geo.size[0] + 2 * MARGIN; }
  function fullHeight() { return geo.size[1] + 2 * MARGIN; }
  function home() {  // fit the width, but never so small that labels cannot be read
    var s = Math.min(Math.max(vp.clientWidth / fullWidth(), D.minScale), D.maxScale);
    var spare = vp.clientWidth / s - fullWidth();
    setView(-MARGIN - Math.max(spare, 0) / 2, -MARGIN, s);
  }
  function fit() {
    var s = Math.min(vp.clientWidth / fullWidth(), vp.clientHeight / fullHeight());
    setView(-MARGIN - (vp.clientWidth / s - fullWidth()) / 2, -MARGIN, s);
  }
  function zoom(k, cx, cy) {
    var box = svg.getBoundingClientRect(), s = scale();
    if (cx === undefined) { cx = box.left + box.width / 2; cy = box.top + box.height / 2; }
    var px = vb[0] + (cx - box.left) / s, py = vb[1] + (cy - box.top) / s, s2 = s * k;
    setView(px - (cx - box.left) / s2, py - (cy - box.top) / s2, s2);
  }
  function centreOn(id) {
    var r = geo.rects[id], s = Math.max(scale(), 1);
    setView((r[0] + r[2]) / 2 - vp.clientWidth / s / 2, (r[1] + r[3]) / 2 - vp.clientHeight / s / 2, s);
  }

  // ---- interaction ----
  function toggle(id) { if (expanded.has(id)) expanded.delete(id); else expanded.add(id); render(); }
  var down = null, moved = false;
  vp.addEventListener('pointerdown', function (e) { down = [e.clientX, e.clientY]; moved = false; });
  vp.addEventListener('pointermove', function (e) {
    if (!down) return;
    if (!moved && Math.abs(e.clientX - down[0]) + Math.abs(e.clientY - down[1]) > 4) {
      moved = true; vp.setPointerCapture(e.pointerId); vp.classList.add('dragging');
    }
    if (!moved) return;
    var s = scale();
    setView(vb[0] - (e.clientX - down[0]) / s, vb[1] - (e.clientY - down[1]) / s, s);
    down = [e.clientX, e.clientY];
  });
  function stop() { down = null; vp.classList.remove('dragging'); }
  vp.addEventListener('pointerup', stop); vp.addEventListener('pointercancel', stop);
  svg.addEventListener('click', function (e) {  // a click, not the end of a drag, opens or closes a box
    if (moved) return;
    var el = e.target.closest('.box, .frame-head');
    if (el) toggle(el.getAttribute('data-box'));
  });
  vp.addEventListener('wheel', function (e) { e.preventDefault(); zoom(Math.exp(-e.deltaY * 0.0015), e.clientX, e.clientY); },
                      {passive: false});
  document.getElementById('zoom-in').onclick = function () { zoom(1.4); };
  document.getElementById('zoom-out').onclick = function () { zoom(1 / 1.4); };
  document.getElementById('fit').onclick = fit;
  document.getElementById('home').onclick = home;
  document.getElementById('expand-all').onclick = function () { expanded = new Set(D.order); render(); };
  document.getElementById('collapse-all').onclick = function () { expanded = new Set(); render(); home(); };
  var found = document.getElementById('found'), search = document.getElementById('search');
  search.addEventListener('input', function () {
    var q = search.value.trim().toLowerCase();
    hits = q === '' ? [] : Object.keys(D.nodes).filter(function (id) { return D.nodes[id].t.toLowerCase().indexOf(q) >= 0; });
    nextHit = 0; found.textContent = q === '' ? '' : hits.length + ' found'; render();
  });
  search.addEventListener('keydown', function (e) {  // Enter: open the boxes around the next hit and centre it
    if (e.key !== 'Enter' || !hits.length) return;
    var id = hits[nextHit % hits.length]; nextHit += 1;
    chain(id).forEach(function (b) { expanded.add(b); });
    render(); centreOn(id);
  });
  window.addEventListener('resize', function () { setView(vb[0], vb[1], scale()); });
  window.hgraphPage = {
    expand: function (id) { expanded.add(id); render(); },
    collapse: function (id) { expanded.delete(id); render(); },
    expandAll: function () { expanded = new Set(D.order); render(); },
    collapseAll: function () { expanded = new Set(); render(); },
    state: function () { return {open: Array.from(expanded), viewBox: vb.slice(), scale: scale()}; }
  };
  render(); home();
})();
"""
