"""Pick a renderer by format name or file suffix: ``dot``, ``svg`` or ``html``."""
from __future__ import annotations

from pathlib import Path

from hgraph.errors import HGraphError
from hgraph.tools.render.graph import RGraph, render_dot
from hgraph.tools.render.html import render_html
from hgraph.tools.render.svg import render_svg

FORMATS: tuple[str, ...] = ("dot", "svg", "html")
_SUFFIXES = {".dot": "dot", ".gv": "dot", ".svg": "svg", ".html": "html", ".htm": "html"}


def render_as(g: RGraph, fmt: str, *, engine: str = "auto") -> str:
    """``g`` as text in format ``fmt`` (``engine`` is the SVG engine; the HTML page draws itself)."""
    if fmt == "dot":
        return render_dot(g)
    if fmt == "svg":
        return render_svg(g, engine=engine)
    if fmt == "html":
        return render_html(g)
    raise HGraphError(f"unknown graph format {fmt!r}; allowed: {', '.join(FORMATS)}")


def format_for_path(path: "str | Path") -> str:
    """The format a file name asks for by its suffix (``.dot``/``.gv``, ``.svg``, ``.html``/``.htm``)."""
    suffix = Path(path).suffix.lower()
    if suffix not in _SUFFIXES:
        raise HGraphError(f"cannot tell the graph format of {str(path)!r} from its suffix; "
                          f"use one of {', '.join(sorted(_SUFFIXES))}")
    return _SUFFIXES[suffix]


def write_graph(g: RGraph, path: "str | Path", *, fmt: "str | None" = None, engine: str = "auto") -> Path:
    """Write ``g`` to ``path`` in ``fmt`` (default: from the suffix); returns the path."""
    out = Path(path)
    text = render_as(g, fmt or format_for_path(out), engine=engine)
    try:
        out.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise HGraphError(f"cannot write graph to {str(out)!r}: {exc.strerror}") from None
    return out
