"""The HTML page: self-contained, one legend in the shared colours, the graph's levels as inline data."""
from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

import pytest

from hgraph.errors import HGraphError
from hgraph.tools.render.formats import format_for_path, render_as, write_graph
from hgraph.tools.render.graph import EDGE_COLORS, KIND_STYLES, REdge, RGraph, RNode
from hgraph.tools.render.html import OPEN_UP_TO_NODES, render_html
from hgraph.tools.render.sample import synthetic_graph

# Namespace names are identifiers, never fetched.
_NAMESPACES = ("http://www.w3.org/2000/svg", "http://www.w3.org/1999/xlink")


class _Tags(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.data: dict[str, str] = {}
        self._in: "str | None" = None

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        self._in = dict(attrs).get("id")

    def handle_data(self, data):
        if self._in:
            self.data[self._in] = self.data.get(self._in, "") + data


def _page_data(page: str) -> dict:
    parser = _Tags()
    parser.feed(page)
    return json.loads(parser.data["graph-data"])


def test_page_is_self_contained_with_inline_data_script_and_style():
    g = synthetic_graph("1xTP1PP2+1xTP1PP1", layers=1)
    page = render_html(g)
    assert page.startswith("<!DOCTYPE html>")
    text = page
    for ns in _NAMESPACES:
        text = text.replace(ns, "")
    assert not re.search(r"(https?:)?//[\w.-]+\.\w", text), "no external URL"
    parser = _Tags()
    parser.feed(page)
    tags = [t for t, _ in parser.tags]
    assert "link" not in tags and "img" not in tags and "iframe" not in tags
    assert all("src" not in attrs for tag, attrs in parser.tags if tag == "script")
    assert tags.count("script") == 2 and tags.count("style") == 1 and tags.count("svg") == 1
    data = _page_data(page)
    assert set(data["nodes"]) == {n.id for n in g.nodes}
    assert data["open"] is (len(g.nodes) <= OPEN_UP_TO_NODES)
    assert "" in data["levels"] and set(data["levels"]) - {""} == set(data["boxes"]) == set(data["order"])
    for needed in ("wheel", "pointerdown", "viewBox", 'id="search"', 'id="fit"', 'id="expand-all"'):
        assert needed in page


def test_large_graph_opens_with_its_boxes_closed():
    g = synthetic_graph("1xTP2PP2+2xTP1PP1", layers=4)
    assert len(g.nodes) > OPEN_UP_TO_NODES
    data = _page_data(render_html(g))
    assert data["open"] is False
    top = {item[0] for item in data["levels"][""]["items"]}
    assert len(top) < len(g.nodes) / 10 and top & set(data["boxes"])


def test_one_legend_in_the_shared_colours_for_the_kinds_present():
    g = RGraph("g", [RNode("a", "a", "pull_parameter"), RNode("b", "b", "compute")], [REdge("a", "b", kind="comm")])
    page = render_html(g)
    assert page.count('class="legend"') == 1
    legend = page[page.index('<div class="legend">'):page.index("</div>", page.index('<div class="legend">'))]
    kinds = re.findall(r'data-kind="(\w+)"', legend)
    assert kinds == ["compute", "pull_parameter", "comm"]
    for kind in ("compute", "pull_parameter"):
        assert f"background:{KIND_STYLES[kind].fill};border-color:{KIND_STYLES[kind].stroke}" in legend
        assert KIND_STYLES[kind].legend in legend
    assert f"border-color:{EDGE_COLORS['comm']}" in legend
    assert KIND_STYLES["push_gradient"].legend not in legend


def test_legend_names_layer_blocks_when_there_are_boxes():
    g = RGraph("g", [RNode("a", "a", "compute", box=("layers.0",)), RNode("b", "b", "compute")], [REdge("a", "b")])
    legend = render_html(g).split('<div class="legend">')[1].split("</div>")[0]
    assert re.findall(r'data-kind="(\w+)"', legend) == ["compute", "block"]


def test_title_and_labels_are_escaped():
    g = RGraph("<script>alert(1)</script> & co", [RNode("a", "</script><b>", "compute", tooltip="<b>")], [])
    page = render_html(g)
    assert "<script>alert" not in page and "</script><b>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt; &amp; co" in page
    data = _page_data(page)
    assert data["nodes"]["a"]["t"] == "<b>"
    assert data["levels"][""]["items"][0][5] == ["</script><b>"]


def test_formats_by_name_and_suffix(tmp_path):
    g = RGraph("g", [RNode("a", "a", "compute"), RNode("b", "b", "output")], [REdge("a", "b")])
    assert render_as(g, "dot").startswith("digraph")
    assert ET.fromstring(render_as(g, "svg", engine="python")).tag == "{http://www.w3.org/2000/svg}svg"
    assert render_as(g, "html", engine="python").startswith("<!DOCTYPE html>")
    assert [format_for_path(p) for p in ("x.DOT", "x.gv", "a/b.svg", "c.htm")] == ["dot", "dot", "svg", "html"]
    written = write_graph(g, tmp_path / "g.html", engine="python")
    assert 'id="graph-data"' in written.read_text()
    with pytest.raises(HGraphError, match="unknown graph format"):
        render_as(g, "png")
    with pytest.raises(HGraphError, match="suffix"):
        write_graph(g, tmp_path / "g.png")
    with pytest.raises(HGraphError, match="cannot write"):
        write_graph(g, tmp_path / "missing" / "g.svg", engine="python")
