"""Raw corpora and tokenizers: the records of JSONL, plain text, parquet and ``datasets`` folders, and
the tokenizer that turns their text into ids. ``hgraph.runtime.data.prepare`` writes them to a token
store; nothing here holds more than one batch of records.

A record is ``(where, text, ids)``: ``where`` names it in errors (``file:line``, ``file:row N``),
exactly one of ``text`` / ``ids`` is set.

* ``.jsonl`` / ``.json``: one object per line with the text under ``text_key`` (default ``text``) or
  pre-tokenized ``input_ids`` (no tokenizer needed); blank lines are skipped.
* ``.parquet`` (``pyarrow``): the ``text_key`` column (or ``input_ids``), read batch by batch.
* a folder written by ``datasets.Dataset.save_to_disk`` (``load_from_disk``; a ``DatasetDict`` needs
  its ``train`` split): the ``text_key`` column (or ``input_ids``).
* any other file: plain text, one document per file, or one per non-blank line (``text_per_line``).

``load_tokenizer(PATH)``: a ``tokenizer.json`` (``tokenizers.Tokenizer``) or a local Hugging Face
tokenizer folder (``transformers.AutoTokenizer``, ``local_files_only``: never downloaded). Text is
encoded without special tokens; ``append_eos`` adds the tokenizer's end-of-document token.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from hgraph.errors import HGraphError
from hgraph.runtime.data.jsonl import jsonl_values

BATCH_ROWS = 1024
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[EOS]", "<|eot_id|>")
Record = tuple[str, Optional[str], Optional[list]]


def input_kind(path: Path) -> str:
    """``jsonl``, ``parquet``, ``dataset`` or ``text`` (HGraphError for a path that does not exist)."""
    if path.is_dir():
        if (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists() \
                or (path / "state.json").exists():
            return "dataset"
        raise HGraphError(f"{path}: a folder that is not a saved Hugging Face dataset (no dataset_info.json "
                          "or dataset_dict.json); give files, or a folder written by save_to_disk")
    if not path.is_file():
        raise HGraphError(f"{path}: no such file or folder")
    name = path.name.lower()
    if name.endswith((".jsonl", ".json", ".ndjson")):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    return "text"


def input_size(path: Path) -> int:
    """What progress counts for an input: bytes of a file, rows of a dataset."""
    if path.is_dir():
        return 0
    return path.stat().st_size


def _record_from(obj: Any, where: str, text_key: str) -> Record:
    if isinstance(obj, dict):
        text = obj.get(text_key)
        if isinstance(text, str):
            return where, text, None
        ids = obj.get("input_ids")
        if isinstance(ids, list):
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise HGraphError(f"{where}: 'input_ids' must be a list of ints")
            return where, None, ids
        if text_key in obj:
            raise HGraphError(f"{where}: {text_key!r} is {type(text).__name__}, expected a string")
        keys = ", ".join(sorted(map(str, obj))[:6]) or "none"
        raise HGraphError(f"{where}: the record has no {text_key!r} text and no 'input_ids' (its keys: "
                          f"{keys}); --text-key names the text field")
    raise HGraphError(f"{where}: expected a JSON object with {text_key!r} or 'input_ids'")


def _jsonl(path: Path, text_key: str, progress: Any) -> Iterator[Record]:
    expect = f"each line must be an object with {text_key!r} or 'input_ids'"
    for where, obj in jsonl_values(path, expect=expect, progress=progress):
        yield _record_from(obj, where, text_key)


def _column_records(rows: Any, columns: list[str], name: str, text_key: str,
                    first_row: int) -> Iterator[Record]:
    col = text_key if text_key in columns else "input_ids" if "input_ids" in columns else None
    if col is None:
        raise HGraphError(f"{name}: no {text_key!r} column and no 'input_ids' (columns: "
                          f"{', '.join(columns)}); --text-key names the text column")
    for i, value in enumerate(rows[col]):
        where = f"{name}:row {first_row + i}"
        if col == text_key:
            if not isinstance(value, str):
                raise HGraphError(f"{where}: {text_key!r} is {type(value).__name__}, expected a string")
            yield where, value, None
        else:
            yield _record_from({"input_ids": list(value) if value is not None else None}, where, text_key)


def _parquet(path: Path, text_key: str, progress: Any) -> Iterator[Record]:
    import pyarrow.parquet as pq
    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:   # noqa: BLE001 - pyarrow raises several kinds
        raise HGraphError(f"{path.name}: not a readable parquet file ({exc})") from None
    columns = pf.schema_arrow.names
    col = text_key if text_key in columns else "input_ids" if "input_ids" in columns else None
    first = 0
    per_row = path.stat().st_size / max(pf.metadata.num_rows, 1)
    for batch in pf.iter_batches(batch_size=BATCH_ROWS, columns=[col] if col else None):
        rows = batch.to_pydict()
        yield from _column_records(rows, columns, path.name, text_key, first)
        first += batch.num_rows
        if progress is not None:
            progress(int(per_row * batch.num_rows))


def _dataset(path: Path, text_key: str, progress: Any) -> Iterator[Record]:
    import datasets
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as exc:   # noqa: BLE001
        raise HGraphError(f"{path}: not a dataset saved with save_to_disk ({exc})") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise HGraphError(f"{path}: a DatasetDict without a 'train' split (splits: {', '.join(ds)}); "
                              "give the split's folder")
        ds = ds["train"]
    columns = list(ds.column_names)
    for start in range(0, len(ds), BATCH_ROWS):
        rows = ds[start:start + BATCH_ROWS]
        yield from _column_records(rows, columns, path.name, text_key, start)


def _text(path: Path, per_line: bool, progress: Any) -> Iterator[Record]:
    try:
        if not per_line:
            data = path.read_bytes()
            if progress is not None:
                progress(len(data))
            text = _decode(data, path.name)
            if text.strip():
                yield path.name, text, None
            return
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, start=1):
                if progress is not None:
                    progress(len(raw))
                text = _decode(raw, f"{path.name}:{lineno}").rstrip("\r\n")
                if text.strip():
                    yield f"{path.name}:{lineno}", text, None
    except OSError as exc:
        raise HGraphError(f"{path}: cannot be read ({exc.strerror or exc})") from None


def _decode(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise HGraphError(f"{where}: not UTF-8 text (byte {exc.start})") from None


def records(path: Path, *, text_key: str = "text", text_per_line: bool = False,
            progress: Any = None) -> Iterator[Record]:
    """The records of one input; ``progress(n)``: ``n`` more bytes read."""
    kind = input_kind(path)
    if kind == "jsonl":
        return _jsonl(path, text_key, progress)
    if kind == "parquet":
        return _parquet(path, text_key, progress)
    if kind == "dataset":
        return _dataset(path, text_key, progress)
    return _text(path, text_per_line, progress)


# ---- tokenizers -------------------------------------------------------------------------------------
@dataclass
class TextTokenizer:
    """A loaded tokenizer: ``encode(texts) -> [[ids]]``, its vocabulary size and end-of-document id."""

    path: str
    backend: Any
    kind: str                 # "tokenizers" | "transformers"
    vocab_size: int
    eos_id: Optional[int]

    def encode(self, texts: list[str]) -> list[list[int]]:
        if self.kind == "tokenizers":
            return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]
        return self.backend(texts, add_special_tokens=False)["input_ids"]


def load_tokenizer(path: str) -> TextTokenizer:
    """``tokenizer.json`` or a local Hugging Face tokenizer folder (never downloaded; HGraphError)."""
    p = Path(path)
    if p.is_file():
        try:
            from tokenizers import Tokenizer
            tok = Tokenizer.from_file(str(p))
        except ImportError:
            raise HGraphError("--tokenizer: reading tokenizer.json needs the 'tokenizers' package "
                              "(pip install -e '.[data]' in the hgraph checkout, or pip install tokenizers)") from None
        except Exception as exc:   # noqa: BLE001 - tokenizers raises plain Exceptions
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise HGraphError(f"--tokenizer {path}: not a tokenizers JSON file ({first})") from None
        eos = next((tok.token_to_id(t) for t in EOS_CANDIDATES if tok.token_to_id(t) is not None), None)
        return TextTokenizer(str(p), tok, "tokenizers", tok.get_vocab_size(with_added_tokens=True), eos)
    if p.is_dir():
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        try:
            from transformers import AutoTokenizer
            tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
        except ImportError:
            raise HGraphError("--tokenizer: a tokenizer folder needs 'transformers' (pip install "
                              "-e '.[hf]' in the hgraph checkout)") from None
        except Exception as exc:   # noqa: BLE001
            raise HGraphError(f"--tokenizer {path}: not a Hugging Face tokenizer folder "
                              f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
        return TextTokenizer(str(p), tok, "transformers", len(tok), tok.eos_token_id)
    raise HGraphError(f"--tokenizer {path}: no such file or folder (a tokenizer.json or a local Hugging Face "
                      "tokenizer folder; nothing is downloaded)")
