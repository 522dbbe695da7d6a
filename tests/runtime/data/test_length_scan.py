"""Every rank scans the corpus' lengths at its start (``--long error``: the first document too long is
named). A token store's lengths are scanned in chunks in their own dtype, so the scan's memory stays a
chunk's whatever the corpus (an int64 copy of every length and a mask were 9 bytes a document: 22 GB
per rank for a 2T-token corpus)."""
import tracemalloc

import numpy as np
import pytest

from hgraph.errors import HGraphError
from hgraph.runtime.data import documents
from hgraph.runtime.data.stored import StoreDocuments, limit_long
from hgraph.runtime.data.token_store import open_store
from hgraph.tools.bench.scale_counts import write_index_only_store

DOCS, CHUNK = 200_000, 4096


@pytest.fixture()
def store(tmp_path):
    lengths = np.random.default_rng(0).integers(1, 100, size=DOCS)
    lengths[150_001] = 500                       # past several chunks, not at a chunk's start
    write_index_only_store(str(tmp_path / "c"), lengths)
    return StoreDocuments(open_store(str(tmp_path / "c")))


def test_the_scan_names_the_first_long_document_in_a_chunks_memory(store, monkeypatch):
    monkeypatch.setattr(documents, "SCAN_CHUNK", CHUNK)
    tracemalloc.start()
    with pytest.raises(HGraphError, match="document 150001 has 500 tokens, more than --tokens-per-iter 400"):
        limit_long(store, 400, None, "error")
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 8 * CHUNK + 64 * 1024, peak       # a chunk's mask, not 9 bytes for each of 200,000 documents
    assert limit_long(store, 500, None, "error")[0] is store


def test_the_longest_document_is_found_in_a_chunks_memory(store, monkeypatch):
    """What an outlier-delayed stream asks of the corpus on every rank (its queues' thresholds)."""
    monkeypatch.setattr(documents, "SCAN_CHUNK", CHUNK)
    tracemalloc.start()
    longest = documents.longest_length(store)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert longest == 500 and peak < 64 * 1024, peak
    assert documents.longest_length(list(store)[:10]) == int(store.lengths[:10].max())
