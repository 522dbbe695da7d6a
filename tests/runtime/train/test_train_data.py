"""Training on your own corpus, end to end on 4 ranks (one shared run): a tokenizer trained here on local
text, hgraph prepare-data for one source, the other tokenized on the fly, a 0.7/0.3 mixture, shuffled,
long documents split, a warmup + cosine schedule and validation every 3 steps under a TP2PP2 pipeline.

Checked: the loss falls; every step's lr is the schedule's formula; the mixture draws by its weights;
eval_loss equals a single-process evaluation of the saved parameters (fp32, 1e-5 relative); and a
rank's data memory does not grow with the corpus (a 60M-token store against a 1M-token one)."""
import json
import math
import random
import re
import tracemalloc

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hgraph.frontends.zoo import llama
from hgraph.runtime.data.corpus import DataOrder
from hgraph.runtime.data.documents import doc_lengths
from hgraph.runtime.data.stored import StoreDocuments
from hgraph.runtime.data.token_store import TokenStoreWriter, open_store
from hgraph.tools.cli import main

tokenizers = pytest.importorskip("tokenizers")

STEPS, EVERY, LR, MIN_LR, WARMUP = 6, 3, 3e-3, 3e-4, 2
SUBJECTS = "the cat|a dog|my friend|the old man|a small bird|the teacher".split("|")
VERBS = "sees|likes|finds|follows|watches|helps".split("|")
OBJECTS = "the ball|a red apple|the green garden|a quiet river|the big house|an open door".split("|")


def _sentences(n, seed):
    rng = random.Random(seed)
    return [" ".join(f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} ." for _ in
                     range(rng.randint(1, 12))) for _ in range(n)]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    base = tmp_path_factory.mktemp("corpus")
    sizes = (("web", 300, 0), ("books", 120, 1), ("val", 20, 2))
    texts = {name: _sentences(n, seed) for name, n, seed in sizes}
    texts["books"][3] = " ".join(texts["books"][3] for _ in range(30))          # longer than the context
    for name, docs in texts.items():
        (base / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts["web"], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    tok.save(str(base / "tokenizer.json"))
    assert main(["prepare-data", str(base / "web.jsonl"), "--tokenizer", str(base / "tokenizer.json"),
                 "-o", str(base / "web"), "--progress", "off"]) == 0
    argv = ["train", "--data", f"0.7:{base / 'web'},0.3:{base / 'books.jsonl'}",
            "--tokenizer", str(base / "tokenizer.json"), "--shuffle", "--long", "split",
            "--model-args", '{"max_seq_len": 256}', "--world-size", "4", "--strategy-schedule", "1xTP2PP2",
            "--steps", str(STEPS), "--tokens-per-iter", "1024", "--lr", str(LR), "--lr-schedule", "cosine",
            "--warmup-steps", str(WARMUP), "--min-lr", str(MIN_LR), "--eval-data", str(base / "val.jsonl"),
            "--eval-every", str(EVERY), "--eval-tokens", "600", "--save-final", str(base / "final.pt"),
            "--run-dir", str(base / "run"), "--no-plots", "--json"]
    assert main(argv) == 0
    metrics = [json.loads(line) for line in (base / "run" / "metrics.jsonl").read_text().splitlines()]
    return {"base": base, "metrics": metrics, "texts": texts, "tok": tok}


def test_the_run_trains_its_mixture_with_the_schedule_and_the_loss_falls(run):
    m = run["metrics"]
    assert len(m) == STEPS and m[-1]["loss"] < m[0]["loss"] - 0.5
    for r in m:
        s = r["step"]
        t = (s - WARMUP) / (STEPS - WARMUP)
        cosine = MIN_LR + (LR - MIN_LR) * 0.5 * (1 + math.cos(math.pi * t))
        want = LR * (s + 1) / WARMUP if s < WARMUP else cosine
        assert r["lr"] == pytest.approx(want, rel=1e-12, abs=0)
    web = open_store(run["base"] / "web")
    assert web.num_documents == 300
    docs = [i for r in m for i in r["documents"]]
    share = sum(i < 300 for i in docs) / len(docs)
    assert abs(share - 0.7) <= 1.0 / len(docs) + 1e-9 and len(set(docs)) == len(docs)   # no repeat in 1 epoch
    # the books source was tokenized into the run folder, its long document split into context-sized chunks
    books = [p for p in (run["base"] / "run" / "data").glob("books-*.idx")]
    assert len(books) == 1 and max(open_store(str(books[0])[:-4]).lengths) > 256


def test_eval_loss_equals_a_single_process_evaluation(run):
    evals = [r for r in run["metrics"] if "eval_loss" in r]
    assert [r["step"] for r in evals] == [EVERY - 1, 2 * EVERY - 1]
    model = llama.build("tiny", max_seq_len=256)
    model.load_state_dict(torch.load(run["base"] / "final.pt", weights_only=True))
    total, targets, used = 0.0, 0, 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)          # a few small forwards: threads only contend on a shared machine
    with torch.no_grad():
        for text in run["texts"]["val"]:
            ids = run["tok"].encode(text, add_special_tokens=False).ids
            if used + len(ids) > 600 and used:
                break
            used += len(ids)
            x = torch.tensor([ids])
            total += float(F.cross_entropy(model(x)[0, :-1], x[0, 1:], reduction="sum"))
            targets += len(ids) - 1
    torch.set_num_threads(threads)
    assert evals[-1]["eval_loss"] == pytest.approx(total / targets, rel=1e-5)
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]


def _store(prefix, tokens, seed):
    rng = np.random.default_rng(seed)
    w = TokenStoreWriter(prefix, 512)
    block = rng.integers(0, 512, 4096, dtype=np.uint16)
    for n in rng.integers(2, 1800, size=tokens // 900):
        w.add(block[:n] if n <= 4096 else block)
    return w.finish()


def test_a_rank_s_data_memory_does_not_grow_with_the_corpus(tmp_path):
    """What a rank holds for the data (lengths, shuffled order, the documents of a few mini-batches),
    traced with tracemalloc (numpy buffers included, memory-mapped pages not): 1M vs 60M tokens."""
    from hgraph.runtime.data.documents import mini_batches
    from hgraph.runtime.data.micro_batch import MicroBatch
    peaks = {}
    for name, tokens in (("small", 10 ** 6), ("large", 6 * 10 ** 7)):
        store = _store(tmp_path / name, tokens, 0)
        tracemalloc.start()
        docs = StoreDocuments(store)
        order = DataOrder(docs, shuffle=True, seed=0)
        lengths = doc_lengths(docs)
        for b in mini_batches(docs, 8192, 3, order=order):
            assert MicroBatch.pack([d.input_ids for d in b.docs]).input_ids.shape[1] == b.tokens
        peaks[name] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        del lengths
    assert peaks["large"] - peaks["small"] < 150 * 2 ** 20
    assert peaks["large"] < 40 * (6 * 10 ** 7 // 900)             # tens of bytes per document, not per token


@pytest.mark.parametrize("case", ["weights", "raw-without-tokenizer", "tokenizer", "checksum", "vocabulary",
                                  "empty-eval", "long"])
def test_bad_data_is_one_line_before_any_process_starts(tmp_path, capsys, case):
    w = TokenStoreWriter(tmp_path / "s", 600)
    for d in ([1, 2, 3], [4, 5, 599], list(range(2, 40))):
        w.add(d)
    w.finish()
    (tmp_path / "raw.jsonl").write_text('{"text": "hello world"}\n')
    (tmp_path / "empty.jsonl").write_text("\n")
    store = str(tmp_path / "s")
    extra, match = {
        "weights": (["--data", f"0:{store},0:{store}"], "mixture weights sum to zero"),
        "raw-without-tokenizer": (["--data", str(tmp_path / "raw.jsonl")], "raw text; give --tokenizer"),
        "tokenizer": (["--data", str(tmp_path / "raw.jsonl"), "--tokenizer", str(tmp_path / "no-tok")],
                      "no-tok: no such file or folder"),
        "checksum": (["--data", store], "checksum of s.bin does not match s.idx"),
        "vocabulary": (["--data", store, "--model-args", '{"max_seq_len": 64}'],
                       r"document 1 holds token id 599, beyond the model's vocabulary \[0, 512\)"),
        "empty-eval": (["--data", store, "--eval-data", str(tmp_path / "empty.jsonl"), "--eval-every", "1",
                        "--model-args", '{"vocab_size": 600}'], "holds no documents"),
        "long": (["--data", store, "--model-args", '{"vocab_size": 600, "max_seq_len": 16}'],
                 "document 2 has 38 tokens, longer than the 16 the model supports"),
    }[case]
    if case == "checksum":
        data = bytearray((tmp_path / "s.bin").read_bytes())
        data[0] ^= 1
        (tmp_path / "s.bin").write_bytes(bytes(data))
    code = main(["train", *extra, "--world-size", "2", "--strategy-schedule", "2xTP1PP1", "--steps", "1",
                 "--tokens-per-iter", "256", "--run-dir", str(tmp_path / "run"), "--no-plots"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and re.search(match, err[0]), err
