"""One JSONL reader (``runtime/data/jsonl.py``) for every command: a byte that is not UTF-8 (or a binary
file named ``.jsonl``) is one line naming the file, the line and the byte offset, in the readers of
training data, raw corpora, lengths and metrics, and in ``hgraph train``, ``plan`` and ``report``
(exit code 2, before anything trains)."""
import re

import pytest

from hgraph.errors import HGraphError
from hgraph.runtime.data.documents import read_jsonl
from hgraph.runtime.data.jsonl import jsonl_values
from hgraph.runtime.data.lengths import read_lengths
from hgraph.runtime.data.sources import records
from hgraph.tools.cli import main
from hgraph.tools.report.plots import read_metrics

GOOD = b'{"input_ids": [1, 2, 3], "text": "abc", "step": 0, "strategy": "1xTP1PP1", "tokens": 3, "time_s": 0.1, "loss": 1.0}\n'


def _bad_file(tmp_path, name="docs.jsonl"):
    """Two good lines, then one with a Latin-1 byte (0xe9) at column 17 of line 3."""
    path = tmp_path / name
    path.write_bytes(GOOD + b"\n" + b'{"text": "caf\xe9"}\n')
    return path, len(GOOD) + 1 + len(b'{"text": "caf')


@pytest.mark.parametrize("reader", [
    lambda p: read_jsonl(p), lambda p: list(records(p)), lambda p: read_lengths(p), lambda p: read_metrics(p),
    lambda p: list(jsonl_values(p)),
])
def test_every_reader_names_file_line_and_byte_offset(tmp_path, reader):
    path, offset = _bad_file(tmp_path)
    with pytest.raises(HGraphError, match=rf"^docs\.jsonl:3: not UTF-8 text \(byte 0xe9 at byte offset {offset} "):
        reader(path)


def test_a_binary_file_named_jsonl_is_one_line(tmp_path):
    path = tmp_path / "model.jsonl"
    path.write_bytes(bytes(range(128, 256)) * 4)
    with pytest.raises(HGraphError, match=r"^model\.jsonl:1: not UTF-8 text \(byte 0x80 at byte offset 0 "):
        read_jsonl(path)


def test_malformed_json_names_the_byte_offset(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_bytes(GOOD + b'{"input_ids": [1, 2\n')
    with pytest.raises(HGraphError, match=rf"docs\.jsonl:2: malformed JSON \(.* byte offset {len(GOOD) + 19} "):
        read_jsonl(path)
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n \n")
    assert list(jsonl_values(blank)) == []


def test_lengths_files_take_comment_lines(tmp_path):
    path = tmp_path / "lengths.txt"
    path.write_text("# 3 lengths\n5\n# more\n7\n\n3\n")
    assert read_lengths(path).tolist() == [5, 7, 3]
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"5\n7\n1\xff2\n")
    with pytest.raises(HGraphError, match=r"^bad\.txt:3: not UTF-8 text \(byte 0xff at byte offset 5 "):
        read_lengths(bad)


@pytest.mark.parametrize("command", ["train", "plan", "report"])
def test_commands_say_one_line_and_exit_2(tmp_path, capsys, command):
    path, offset = _bad_file(tmp_path)
    if command == "train":
        path.write_bytes(b'{"input_ids": [1, 2, 3]}\n{"input_ids": [4, 5]}\n\xff\xfe\n')
        argv = ["train", "--model", "tiny", "--data", str(path), "--world-size", "1", "--strategy-schedule",
                "1xTP1PP1", "--steps", "1", "--tokens-per-iter", "30"]
        want = r"docs\.jsonl:3: not UTF-8 text \(byte 0xff at byte offset 47 of the file\)"
    elif command == "plan":
        argv = ["plan", "--lengths", str(path), "--profile", "llama-7b", "--world-size", "8", "--max-len", "4096",
                "--tokens-per-iter", "8192"]
        want = rf"docs\.jsonl:3: not UTF-8 text \(byte 0xe9 at byte offset {offset} "
    else:
        (tmp_path / "run").mkdir()
        (tmp_path / "run" / "metrics.jsonl").write_bytes(path.read_bytes())
        argv, want = ["report", str(tmp_path / "run")], r"metrics\.jsonl:3: not UTF-8 text \(byte 0xe9"
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"hgraph {command}: error: "), err
    assert re.search(want, err[0]), err[0]
