"""JSONL documents and mini-batches: file order, whole documents, wrap-around, one-line errors."""
import json

import pytest

from hgraph.errors import HGraphError
from hgraph.runtime.data.documents import Document, check_lengths, mini_batches, read_jsonl


def _write(tmp_path, lines, name="d.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n")
    return p


def _docs(*lengths):
    return [Document(i, tuple(range(1, n + 1))) for i, n in enumerate(lengths)]


def test_reads_documents_in_file_order_and_skips_blank_lines(tmp_path):
    p = _write(tmp_path, [json.dumps({"input_ids": [1, 2, 3]}), "", json.dumps({"input_ids": [4], "x": 1})])
    docs = read_jsonl(p)
    assert [d.index for d in docs] == [0, 1]
    assert [d.input_ids for d in docs] == [(1, 2, 3), (4,)]


@pytest.mark.parametrize("bad, match", [
    ('{"input_ids": [1, 2', r"d\.jsonl:2: malformed JSON"),
    ('[1, 2, 3]', r"d\.jsonl:2: expected an object with 'input_ids'"),
    ('{"tokens": [1]}', r"d\.jsonl:2: expected an object with 'input_ids'"),
    ('{"input_ids": [1, "a"]}', r"d\.jsonl:2: expected an object"),
    ('{"input_ids": []}', r"d\.jsonl:2: 'input_ids' is empty"),
    ('{"input_ids": [1, -3]}', r"d\.jsonl:2: token id -3 is outside"),
    ('{"input_ids": [1, 600]}', r"d\.jsonl:2: token id 600 is outside the vocabulary \[0, 512\)"),
])
def test_malformed_line_names_its_line(tmp_path, bad, match):
    p = _write(tmp_path, [json.dumps({"input_ids": [1, 2]}), bad])
    with pytest.raises(HGraphError, match=match) as info:
        read_jsonl(p, vocab_size=512)
    assert "\n" not in str(info.value)


def test_missing_or_empty_file_is_a_clear_error(tmp_path):
    with pytest.raises(HGraphError, match="cannot be read"):
        read_jsonl(tmp_path / "none.jsonl")
    with pytest.raises(HGraphError, match="holds no documents"):
        read_jsonl(_write(tmp_path, [""]))


def test_mini_batches_take_whole_documents_up_to_the_budget():
    batches = list(mini_batches(_docs(4, 5, 3, 6, 2), tokens_per_iter=10, steps=3))
    assert [[d.index for d in b.docs] for b in batches] == [[0, 1], [2, 3], [4, 0]]   # wraps around
    assert [b.tokens for b in batches] == [9, 9, 6]
    assert [b.num_targets for b in batches] == [7, 7, 4]
    assert [b.step for b in batches] == [0, 1, 2]


def test_a_mini_batch_never_repeats_a_document():
    batches = list(mini_batches(_docs(2, 3), tokens_per_iter=100, steps=2))
    assert [[d.index for d in b.docs] for b in batches] == [[0, 1], [0, 1]]


def test_mini_batch_without_targets_is_an_error_naming_the_step():
    with pytest.raises(HGraphError, match=r"step 1: the mini-batch \(documents \[2, 3\]\) is empty of targets"):
        list(mini_batches(_docs(3, 2, 1, 1, 4), tokens_per_iter=5, steps=2))


def test_lengths_are_checked_against_the_budget_and_the_model():
    check_lengths(_docs(3, 8), tokens_per_iter=8, max_len=8)
    with pytest.raises(HGraphError, match="document 1 has 9 tokens, longer than the 8 the model supports"):
        check_lengths(_docs(3, 9), tokens_per_iter=100, max_len=8)
    with pytest.raises(HGraphError, match="document 1 has 9 tokens, more than --tokens-per-iter 5"):
        check_lengths(_docs(3, 9), tokens_per_iter=5, max_len=None)
    with pytest.raises(HGraphError, match="--tokens-per-iter must be >= 1"):
        check_lengths(_docs(3), tokens_per_iter=0, max_len=None)
