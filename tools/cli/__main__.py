"""``python -m hgraph.tools.cli``: the ``hgraph`` command."""
from hgraph.tools.cli import entry

raise SystemExit(entry())
