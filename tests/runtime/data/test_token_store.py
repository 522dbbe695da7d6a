"""The token store: format (header, dtype, offsets, lengths), lazy documents, checksum and vocabulary
checks, long documents."""
import json
import struct

import numpy as np
import pytest

from hgraph.errors import HGraphError
from hgraph.runtime.data.corpus import open_source
from hgraph.runtime.data.micro_batch import MicroBatch
from hgraph.runtime.data.stored import StoreDocuments, limit_long
from hgraph.runtime.data.token_store import MAGIC, TokenStoreWriter, open_store, token_dtype


def _write(prefix, docs, vocab):
    w = TokenStoreWriter(prefix, vocab)
    for i, d in enumerate(docs):
        w.add(d, f"doc {i}")
    return w.finish()


def test_format_header_dtype_and_lazy_documents(tmp_path):
    assert [token_dtype(v) for v in (256, 257, 65536, 65537)] == [np.uint8, np.uint16, np.uint16, np.uint32]
    docs = [[1, 2, 3], [299], [7, 8, 9, 10, 11]]
    store = _write(tmp_path / "s", docs, 300)
    raw = (tmp_path / "s.idx").read_bytes()
    assert raw[:8] == MAGIC
    (size,) = struct.unpack("<I", raw[8:12])
    header = json.loads(raw[12:12 + size])
    assert header["version"] == 1 and header["dtype"] == "uint16" and header["num_documents"] == 3
    assert header["num_tokens"] == 9 and header["max_token_id"] == 299 and header["vocab_size"] == 300
    assert (tmp_path / "s.bin").stat().st_size == 9 * 2
    assert store.lengths.tolist() == [3, 1, 5] and store.offsets.tolist() == [0, 3, 4]
    seq = StoreDocuments(store)
    assert [len(d) for d in seq] == [3, 1, 5] and [d.index for d in seq] == [0, 1, 2]
    assert [list(d.input_ids) for d in seq] == docs
    mb = MicroBatch.pack([seq[2].input_ids, seq[0].input_ids], [2, 0])
    assert mb.tokens == 8 and "input_ids" not in mb.__dict__          # nothing read before it is used
    assert mb.input_ids.tolist() == [[7, 8, 9, 10, 11, 1, 2, 3]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2]]
    # ids of an unknown vocabulary are written narrow: the largest id + 1
    assert _write(tmp_path / "n", [[0, 5], [255]], None).dtype == np.uint8


def test_checksum_mismatch_truncation_and_vocabulary_are_one_line(tmp_path):
    _write(tmp_path / "s", [[1, 2, 3], [4, 5]], 300)
    open_store(tmp_path / "s", verify=True)
    data = bytearray((tmp_path / "s.bin").read_bytes())
    data[2] ^= 1
    (tmp_path / "s.bin").write_bytes(bytes(data))
    with pytest.raises(HGraphError, match="checksum of s.bin does not match s.idx"):
        open_store(tmp_path / "s", verify=True)
    (tmp_path / "s.bin").write_bytes(bytes(data[:-2]))
    with pytest.raises(HGraphError, match="truncated|checksum cannot match"):
        open_store(tmp_path / "s")
    with pytest.raises(HGraphError, match=r"doc 1: token id 300 is outside the vocabulary \[0, 300\)"):
        _write(tmp_path / "v", [[1], [300]], 300)
    assert not (tmp_path / "v.bin").exists()
    _write(tmp_path / "m", [[1, 2], [3, 250], [4]], 256)
    with pytest.raises(HGraphError, match=r"document 1 holds token id 250, beyond the model's vocabulary "
                                           r"\[0, 200\)"):
        open_source(str(tmp_path / "m"), vocab_size=200)


def test_long_documents_truncate_split_drop(tmp_path):
    store = _write(tmp_path / "s", [list(range(10)), [1, 2], list(range(5))], 16)
    docs = StoreDocuments(store)
    with pytest.raises(HGraphError, match="document 0 has 10 tokens, longer than the 4 the model supports"):
        limit_long(docs, 100, 4, "error")
    cut, report = limit_long(docs, 100, 4, "truncate")
    assert [list(d.input_ids) for d in cut] == [[0, 1, 2, 3], [1, 2], [0, 1, 2, 3]]
    assert (report.long_documents, report.tokens_cut) == (2, 7)
    split, report = limit_long(docs, 4, 100, "split")
    assert [list(d.input_ids) for d in split] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], [1, 2], [0, 1, 2, 3],
                                                  [4]]
    assert [d.index for d in split] == list(range(6)) and report.chunks == 5
    kept, report = limit_long(docs, 4, None, "drop")
    assert [list(d.input_ids) for d in kept] == [[1, 2]] and report.tokens_cut == 15
    assert kept.fingerprint != docs.fingerprint
