"""Benchmarks: each module prints its figures (``python -m hgraph.tools.bench.NAME``)."""
