"""Counting what a DCP checkpoint read asks of the files: every ``RowsReader`` made is kept, and its
``reads`` list the (entry, bytes) it read."""
from hgraph.runtime.checkpoint import dcp_format


def counted_readers(monkeypatch) -> list:
    """The ``RowsReader``s made from now on (``dcp_format.RowsReader`` replaced for the test)."""
    readers = []

    class Counting(dcp_format.RowsReader):
        def __init__(self, path):
            super().__init__(path)
            readers.append(self)

    monkeypatch.setattr(dcp_format, "RowsReader", Counting)
    return readers
