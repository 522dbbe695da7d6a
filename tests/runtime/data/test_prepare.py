"""hgraph prepare-data: every source kind to a token store with a tokenizer trained here, bad records as
one line naming file and line, and a run's raw --data tokenized to exactly the tokens prepare-data writes."""
import json

import numpy as np
import pytest

from hgraph.errors import HGraphError
from hgraph.runtime.data.prepare import prepare, resolve_raw_sources
from hgraph.runtime.data.stored import StoreDocuments
from hgraph.runtime.data.token_store import open_store
from hgraph.tools.cli import main

tokenizers = pytest.importorskip("tokenizers")

TEXTS = ["the cat sat on the mat", "a dog ran in the park", "the quick brown fox jumps over the lazy dog",
         "hello world", "one two three four five six seven"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """A word-level tokenizer trained on TEXTS (with an end-of-document token), saved as tokenizer.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    t = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.train_from_iterator(TEXTS, trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"]))
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    t.save(str(path))
    return path


def _docs(prefix):
    return [list(d.input_ids) for d in StoreDocuments(open_store(prefix, verify=True))]


def _encode(tok, text):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(tok)).encode(text, add_special_tokens=False).ids


def test_each_source_kind_gives_the_tokenizer_s_ids(tmp_path, tok, capsys):
    expected = [_encode(tok, t) for t in TEXTS]
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(TEXTS)) + "\n")
    assert main(["prepare-data", str(jsonl), "--tokenizer", str(tok), "-o", str(tmp_path / "j"),
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["documents"] == 5 and out["tokens"] == sum(map(len, expected)) and out["tokens_per_s"] > 0
    assert _docs(tmp_path / "j") == expected
    # plain text: one document per file, or per line; --append-eos ends each with </s>
    (tmp_path / "a.txt").write_text(TEXTS[0] + "\n" + TEXTS[1] + "\n")
    (tmp_path / "b.txt").write_text("\n" + TEXTS[2] + "\n\n")
    prepare([str(tmp_path / "a.txt"), str(tmp_path / "b.txt")], str(tmp_path / "f"), tokenizer=str(tok))
    assert _docs(tmp_path / "f") == [expected[0] + expected[1], expected[2]]
    prepare([str(tmp_path / "a.txt")], str(tmp_path / "l"), tokenizer=str(tok), text_per_line=True,
            append_eos=True, workers=2)
    eos = _encode(tok, "</s>")
    assert _docs(tmp_path / "l") == [expected[0] + eos, expected[1] + eos]
    # pre-tokenized input_ids need no tokenizer
    ids = tmp_path / "ids.jsonl"
    ids.write_text('{"input_ids": [3, 1, 4]}\n{"input_ids": [1, 5]}\n')
    prepare([str(ids)], str(tmp_path / "i"))
    assert _docs(tmp_path / "i") == [[3, 1, 4], [1, 5]] and open_store(tmp_path / "i").vocab_size == 6


def test_parquet_and_datasets_folders(tmp_path, tok):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa
    expected = [_encode(tok, t) for t in TEXTS]
    pq.write_table(pa.table({"body": TEXTS}), tmp_path / "c.parquet", row_group_size=2)
    prepare([str(tmp_path / "c.parquet")], str(tmp_path / "p"), tokenizer=str(tok), text_key="body")
    assert _docs(tmp_path / "p") == expected
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": TEXTS}).save_to_disk(str(tmp_path / "ds"))
    prepare([str(tmp_path / "ds")], str(tmp_path / "d"), tokenizer=str(tok))
    assert _docs(tmp_path / "d") == expected


def test_bad_records_are_one_line_with_file_and_line(tmp_path, tok, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "the cat"}) + "\n\n" + json.dumps({"body": "x"}) + "\n")
    assert main(["prepare-data", str(bad), "--tokenizer", str(tok), "-o", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "bad.jsonl:3: the record has no 'text' text" in err
    assert not (tmp_path / "b.idx").exists() and not list(tmp_path.glob("*.tmp"))
    bad.write_text('{"text": "the cat"\n')
    with pytest.raises(HGraphError, match="bad.jsonl:1: malformed JSON"):
        prepare([str(bad)], str(tmp_path / "b"), tokenizer=str(tok))
    bad.write_text('{"text": "x"}\n')
    with pytest.raises(HGraphError, match="bad.jsonl:1: a text record needs --tokenizer"):
        prepare([str(bad)], str(tmp_path / "b"))
    with pytest.raises(HGraphError, match="--tokenizer .*nope.json: no such file or folder"):
        prepare([str(bad)], str(tmp_path / "b"), tokenizer=str(tmp_path / "nope.json"))
    ids = tmp_path / "ids.jsonl"
    ids.write_text('{"input_ids": [1, 2]}\n{"input_ids": [1, 99]}\n')
    with pytest.raises(HGraphError, match=r"ids.jsonl:2: token id 99 is outside the vocabulary \[0, 50\)"):
        prepare([str(ids)], str(tmp_path / "v"), vocab_size=50)


def test_raw_data_of_a_run_is_tokenized_exactly_as_prepare_data(tmp_path, tok):
    raw = tmp_path / "raw.jsonl"
    raw.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS * 3))
    prepare([str(raw)], str(tmp_path / "prepared"), tokenizer=str(tok))
    spec = resolve_raw_sources(f"0.5:{raw},0.5:{tmp_path / 'prepared'}", str(tok), "text", tmp_path / "cache")
    (w1, on_the_fly), (w2, prepared) = [part.split(":", 1) for part in spec.split(",")]
    assert prepared == str(tmp_path / "prepared") and on_the_fly.startswith(str(tmp_path / "cache"))
    a, b = open_store(on_the_fly), open_store(prepared)
    assert a.header["bin_sha256"] == b.header["bin_sha256"] and np.array_equal(a.lengths, b.lengths)
    # the second run reuses the store
    assert resolve_raw_sources(str(raw), str(tok), "text", tmp_path / "cache") == on_the_fly
    with pytest.raises(HGraphError, match="raw text; give --tokenizer"):
        resolve_raw_sources(str(raw), None, "text", tmp_path / "cache")


def test_a_hugging_face_tokenizer_folder_gives_the_same_ids(tmp_path, tok):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(tok)),
                                              eos_token="</s>", unk_token="[UNK]")
    hf.save_pretrained(str(tmp_path / "hf-tok"))
    (tmp_path / "c.txt").write_text("\n".join(TEXTS))
    prepare([str(tmp_path / "c.txt")], str(tmp_path / "a"), tokenizer=str(tmp_path / "hf-tok"),
            text_per_line=True, append_eos=True)
    eos = _encode(tok, "</s>")
    assert _docs(tmp_path / "a") == [_encode(tok, t) + eos for t in TEXTS]
    with pytest.raises(HGraphError, match="not a Hugging Face tokenizer folder"):
        prepare([str(tmp_path / "c.txt")], str(tmp_path / "b"), tokenizer=str(tmp_path))
