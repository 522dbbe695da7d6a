"""``hgraph prepare-data INPUT... -o PREFIX [--tokenizer TOK]``: raw corpora to a token store.

Inputs, in order: JSONL (``{"text": ...}`` under ``--text-key``, or ``{"input_ids": [...]}``, which
needs no tokenizer), parquet (the text column), a folder saved by ``datasets`` (``load_from_disk``),
and plain text files (one document per file, or per non-blank line with ``--text-per-line``).
``--tokenizer``: a ``tokenizer.json`` or a local Hugging Face tokenizer folder (never downloaded).
Writes the token store ``PREFIX.bin`` and ``PREFIX.idx``, streaming: memory stays
bounded whatever the input's size. ``--workers N`` encodes in N processes. Prints a progress line
(documents and tokens per second) and a summary; ``--json`` one JSON object. A bad record stops with
one line naming its file and line (exit 2) and leaves no store.
"""
from __future__ import annotations

import argparse
import json
import time

from hgraph.runtime.data.prepare import prepare
from hgraph.tools.cli.progress import Progress, resolve_mode


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("prepare-data", help="tokenize raw corpora into a memory-mapped token store",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="JSONL, parquet, text files or a datasets folder")
    p.add_argument("-o", "--output", required=True, metavar="PREFIX", help="writes PREFIX.bin and PREFIX.idx")
    p.add_argument("--tokenizer", metavar="TOK",
                   help="tokenizer.json or a local Hugging Face tokenizer folder")
    p.add_argument("--text-key", default="text", metavar="KEY", help="text field of JSONL/parquet/dataset "
                   "records (default: text)")
    p.add_argument("--text-per-line", action="store_true", help="plain text: one document per non-blank line "
                   "(default: one per file)")
    p.add_argument("--append-eos", action="store_true", help="end every document with the tokenizer's "
                   "end-of-document token")
    p.add_argument("--vocab-size", type=int, metavar="V", help="pre-tokenized input_ids without a tokenizer: "
                   "the vocabulary (default: the largest id + 1)")
    p.add_argument("--workers", type=int, default=1, metavar="N", help="encoding processes (default 1)")
    p.add_argument("--progress", choices=("auto", "on", "off"), default="auto", help="progress bar (auto: on "
                   "a terminal)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def run(args: argparse.Namespace) -> int:
    bar = Progress(1000, "prepare-data", enabled=not args.json and resolve_mode(args.progress))
    t0 = time.perf_counter()

    def progress(done: int, total: int, docs: int, tokens: int) -> None:
        dt = max(time.perf_counter() - t0, 1e-9)
        step = round(1000 * done / total) if total else 0
        bar.update(step - bar.done, f"{docs} docs {docs / dt:.0f} docs/s {tokens / dt:.0f} tok/s")

    try:
        r = prepare(args.inputs, args.output, tokenizer=args.tokenizer, text_key=args.text_key,
                    text_per_line=args.text_per_line, append_eos=args.append_eos, workers=args.workers,
                    vocab_size=args.vocab_size, progress=progress)
    finally:
        bar.close()
    if args.json:
        print(json.dumps({"prefix": r.prefix, "documents": r.documents, "tokens": r.tokens,
                          "skipped_empty": r.skipped_empty, "seconds": r.seconds,
                          "tokens_per_s": r.tokens_per_s, "vocab_size": r.vocab_size, "dtype": r.dtype}))
        return 0
    print(f"wrote {r.prefix}.bin and {r.prefix}.idx: {r.documents} documents, {r.tokens} tokens ({r.dtype}, "
          f"vocabulary {r.vocab_size}) in {r.seconds:.2f} s, {r.documents / max(r.seconds, 1e-9):.0f} "
          f"docs/s, {r.tokens_per_s:.0f} tokens/s"
          + (f"; {r.skipped_empty} empty records skipped" if r.skipped_empty else ""))
    return 0
