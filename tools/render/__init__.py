"""Renderers of compiled graphs: the neutral description, DOT, layout, SVG, HTML, the format dispatcher."""
