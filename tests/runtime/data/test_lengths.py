"""Length files and mini-batch formation."""
import json

import numpy as np
import pytest

from hgraph.errors import HGraphError
from hgraph.runtime.data.lengths import minibatches, read_lengths


def test_plain_and_jsonl(tmp_path):
    p = tmp_path / "l.txt"
    p.write_text("5\n7\n\n3\n")
    assert read_lengths(p).tolist() == [5, 7, 3] and read_lengths(p).dtype == np.int64
    j = tmp_path / "l.jsonl"
    j.write_text("\n".join(json.dumps({"input_ids": list(range(n))}) for n in (4, 9, 1)) + "\n")
    assert read_lengths(j).tolist() == [4, 9, 1]


@pytest.mark.parametrize("text,match", [
    ("", "empty"), ("\n\n", "empty"), ("5\nabc\n", r"bad\.txt:2:"), ("5\n\n0\n", r"bad\.txt:3:"),
    ('{"input_ids": [1]}\n{"x": 1}\n', r"bad\.txt:2:.*input_ids"), ('{"input_ids": [1]}\n{oops\n', r"bad\.txt:2:.*JSON"),
])
def test_bad_files(tmp_path, text, match):
    p = tmp_path / "bad.txt"
    p.write_text(text)
    with pytest.raises(HGraphError, match=match):
        read_lengths(p)


def test_missing_file(tmp_path):
    with pytest.raises(HGraphError, match="cannot read"):
        read_lengths(tmp_path / "nope.txt")


def test_minibatches_whole_documents_in_order():
    lengths = np.array([3, 4, 2, 10, 1, 1, 5])
    mbs = minibatches(lengths, 7)
    assert [m.tolist() for m in mbs] == [[0, 1], [2], [3], [4, 5, 6]]
    assert np.concatenate(mbs).tolist() == list(range(7))
    with pytest.raises(HGraphError):
        minibatches(lengths, 0)
