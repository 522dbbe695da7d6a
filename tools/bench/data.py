"""Data benchmark: per-rank peak memory does not grow with the corpus, and ``prepare-data`` throughput.

    python -m hgraph.tools.bench.data [--small 1e6] [--large 6e7] [--steps 3] [--world-size 4]
                                      [--prepare-tokens 2e6] [--workers 1] [--json]

1. Two token stores of random documents (lengths drawn from the shipped Wikipedia length sample,
   ids uniform over ``llama:tiny``'s 512) of ``--small`` and ``--large`` tokens; a ``--steps``-step
   run of ``llama:tiny`` on ``--world-size`` ranks (``4xTP1PP1``, 2048 tokens a step, ``--shuffle``,
   ``--long truncate``) on each; every rank's peak (``rank_peak_bytes``: peak RSS, the memory-mapped
   pages a rank touched included). Target: the two runs' per-rank peaks within 150 MB.
2. What the data costs a rank before any step, measured with ``tracemalloc`` (numpy's buffers
   included, the memory maps not): opening the large store with its shuffled order and lengths,
   per document; against ``read_jsonl`` (the JSONL path: every token a Python int in a tuple) on a
   JSONL of the small store's first documents, per token.
3. ``prepare-data`` on ``--prepare-tokens`` tokens of English-like text (words drawn from a fixed
   list) with a word-level tokenizer trained here: documents and tokens per second (``--workers``).
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

from hgraph.runtime.data.builtin import length_sample
from hgraph.runtime.data.corpus import DataOrder
from hgraph.runtime.data.documents import doc_lengths, read_jsonl
from hgraph.runtime.data.prepare import prepare
from hgraph.runtime.data.stored import StoreDocuments
from hgraph.runtime.data.token_store import TokenStoreWriter, open_store
from hgraph.runtime.train.config import TrainConfig
from hgraph.runtime.train.rank_run import run_training

WORDS = ("the of and to in is was for on that with as by at from his her an were are which this be or "
         "has had first one their its new after who they have two been other when there all during into "
         "school time may years more most only over city some world would where later up such used many "
         "can state about national out known university united then made").split()


def write_random_store(prefix: str, tokens: int, vocab: int = 512, seed: int = 0) -> int:
    """A store of about ``tokens`` random tokens in documents of sampled Wikipedia lengths; returns docs."""
    rng = np.random.default_rng(seed)
    sample = length_sample()
    w = TokenStoreWriter(prefix, vocab)
    written = 0
    while written < tokens:
        n = int(min(max(rng.choice(sample), 2), tokens - written if tokens - written >= 2 else 2))
        w.add(rng.integers(0, vocab, n, dtype=np.uint16))
        written += n
    return w.finish().num_documents


def peaks_of_run(prefix: str, steps: int, world: int, folder: Path) -> list[int]:
    """Every rank's largest measured peak over a short run on the store ``prefix``."""
    metrics = folder / f"metrics-{Path(prefix).name}.jsonl"
    config = TrainConfig.from_values(model="llama:tiny", data=prefix, world_size=world, steps=steps,
                                     tokens_per_iter=2048, strategy_schedule=f"{world}xTP1PP1", shuffle=True,
                                     long="truncate", metrics=str(metrics))
    run_training(config, timeout_s=120.0)
    rows = [json.loads(line)["rank_peak_bytes"] for line in metrics.read_text().splitlines()]
    return [max(r[k] for r in rows) for k in range(world)]


def data_bytes(fn) -> int:
    tracemalloc.start()
    keep = fn()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del keep
    return peak


def prepare_throughput(tokens: int, workers: int, folder: Path) -> dict:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    rng = np.random.default_rng(1)
    text = folder / "corpus.jsonl"
    with open(text, "w", encoding="utf-8") as f:
        written = 0
        while written < tokens:
            n = int(max(rng.choice(length_sample()), 2))
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS, n))}) + "\n")
            written += n
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS)], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    tok.save(str(folder / "tokenizer.json"))
    r = prepare([str(text)], str(folder / "prepared"), tokenizer=str(folder / "tokenizer.json"),
                workers=workers)
    return {"documents": r.documents, "tokens": r.tokens, "seconds": r.seconds,
            "docs_per_s": r.documents / r.seconds, "tokens_per_s": r.tokens_per_s, "workers": workers,
            "input_mb": text.stat().st_size / 1e6}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hgraph.tools.bench.data", description=__doc__.splitlines()[0])
    p.add_argument("--small", type=float, default=1e6)
    p.add_argument("--large", type=float, default=6e7)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--prepare-tokens", type=float, default=2e6)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="hgraph-bench-data-") as tmp:
        folder = Path(tmp)
        t0 = time.perf_counter()
        docs = {name: write_random_store(str(folder / name), int(n)) for name, n in
                (("small", args.small), ("large", args.large))}
        out["write_s"] = time.perf_counter() - t0
        peaks = {name: peaks_of_run(str(folder / name), args.steps, args.world_size, folder) for name in docs}
        out["documents"] = docs
        out["rank_peak_bytes"] = peaks
        diff = max(abs(a - b) for a, b in zip(peaks["large"], peaks["small"]))
        out["max_peak_difference_mb"] = diff / 2 ** 20

        def open_large():
            seq = StoreDocuments(open_store(folder / "large"))
            order = DataOrder(seq, shuffle=True, seed=0)
            order.at(0)
            return seq, order, doc_lengths(seq)
        large_bytes = data_bytes(open_large)
        out["store_bytes_per_document"] = large_bytes / docs["large"]
        small = StoreDocuments(open_store(folder / "small"))
        jsonl = folder / "small.jsonl"
        n_tokens = 0
        with open(jsonl, "w") as f:
            for d in small:
                if n_tokens >= 2e5:
                    break
                f.write(json.dumps({"input_ids": list(d.input_ids)}) + "\n")
                n_tokens += len(d)
        out["jsonl_bytes_per_token"] = data_bytes(lambda: read_jsonl(jsonl)) / n_tokens
        out["prepare"] = prepare_throughput(int(args.prepare_tokens), args.workers, folder)
    if args.json:
        print(json.dumps(out))
        return 0
    for name in ("small", "large"):
        print(f"{name}: {docs[name]} documents; per-rank peak "
              + ", ".join(f"{b / 2 ** 20:.1f}" for b in peaks[name]) + " MiB")
    print(f"largest per-rank peak difference: {out['max_peak_difference_mb']:.1f} MiB (target <= 150 MB)")
    print(f"data held by a rank: {out['store_bytes_per_document']:.1f} B per document (token store, "
          f"shuffled order); JSONL path: {out['jsonl_bytes_per_token']:.1f} B per token")
    pr = out["prepare"]
    print(f"prepare-data: {pr['tokens']} tokens, {pr['documents']} documents in {pr['seconds']:.2f} s: "
          f"{pr['tokens_per_s']:.0f} tokens/s, {pr['docs_per_s']:.0f} docs/s ({pr['workers']} worker(s))")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
