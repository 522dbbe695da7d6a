"""The costs of a run that grow with the cluster, counted in one process: the planner's plan broadcast,
the data loader's per-rank index and the checkpoint manifest (DCP's ``.metadata``).

    python -m hgraph.tools.bench.cluster_scale --counts [--models 70b] [--worlds 1024,12288]

* **Plan broadcast** (``planner/service/iteration.py``: rank 0 pickles its plan and every rank unpickles
  it, ``dist.broadcast_object_list``; the plan-ahead process hands rank 0 the same object through a
  queue): a real plan (``plan_iteration`` over the ``auto`` candidates of the analytic cost model of the
  zoo model at that world size) of one global batch of the shipped Wikipedia lengths (cut at the model's
  context), ``tokens`` per iteration (``TOKENS_PER_ITER``: a published batch for that many GPUs); its
  pickled bytes and the CPU time of pickling and unpickling it.
* **Data index** (``runtime/data/token_store.py``): every rank maps the corpus' ``.idx``, 12 bytes a
  document, and at its start scans the lengths (``--long``'s check: its peak memory, traced, is the
  lengths as int64 and a mask). Measured on a store of ``docs``
  documents (a sparse ``.bin``: no token is read), reported per million documents and for the corpus
  of a run that size (``CORPUS_TOKENS``, the shipped mean length): it grows with the corpus, not the world.
* **Checkpoint manifest** (``runtime/checkpoint/dcp_format.py``): the ``SavePlan`` of every rank as
  ``dcp.save`` makes it (the first shard group's ranks write each master and moment as the chunks
  ``runtime/checkpoint/coalesce.py`` cuts: blocks of ranks' rows of at least 64 MiB, one writer each;
  every rank its RNG bytes; the step counts and the parameter group where the rank writes them,
  ``dcp_format.writes_shared``), what rank 0 gathers (their pickled bytes), the global plan and
  ``.metadata`` it builds (DCP's own ``create_default_global_save_plan``, the file-system writer's
  storage entries), its bytes, and the CPU time of building and of reading it (every rank unpickles it
  on resume). Beside it the same with a chunk per parameter, moment and writing rank (G chunks, the
  layout before coalescing): there parameters of one shape are built and timed once and counted as many
  times as the model has them (two of a shape are pickled to count what a further one adds; four are
  timed), so 70B at 12,288 ranks and G = world (17 million chunks) is sized without holding it; the
  coalesced layout's chunks are few and its ``.metadata`` is built whole. CPU times are taken with
  the garbage collector off (the bench's own heap made them vary ninefold).
"""
from __future__ import annotations

import gc
import json
import math
import os
import pickle
import sys
import tempfile
import time
import tracemalloc
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   TensorProperties)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import _create_write_items

import hgraph
from hgraph.frontends.zoo import llama
from hgraph.runtime.checkpoint import coalesce, dcp_format
from hgraph.runtime.data.builtin import length_sample
from hgraph.runtime.data.lengths import read_lengths
from hgraph.runtime.data.stored import StoreDocuments, limit_long
from hgraph.runtime.data.token_store import VERSION, _header_bytes, open_store, store_paths
from hgraph.runtime.planner import selection
from hgraph.runtime.planner.auto_candidates import auto_candidates
from hgraph.runtime.planner.service.iteration import model_cost_model
from hgraph.shard_rule import shard_bounds

#: tokens of one iteration for a world size: Llama 2 70B's 4M-token batch (about 1,000 GPUs), Llama 3
#: 405B's 16M-token batch (16,384 GPUs); other sizes scale 4M by the GPUs over 1,024, at most 16M
TOKENS_PER_ITER = {1024: 4 << 20, 12288: 16 << 20}
#: tokens of the corpus trained on that many GPUs: Llama 2's 2T, Llama 3's 15T
CORPUS_TOKENS = {1024: 2 * 10**12, 12288: 15 * 10**12}


def tokens_per_iter(world: int) -> int:
    return TOKENS_PER_ITER.get(world, min(16 << 20, max(1, (4 << 20) * world // 1024)))


def corpus_tokens(world: int) -> int:
    return CORPUS_TOKENS.get(world, 2 * 10**12 * world // 1024)


def shipped_lengths(data: Optional[str] = None) -> np.ndarray:
    """The shipped Wikipedia document lengths (``data``, else ``../shared/data`` beside the checkout's
    1,000,000, else the package's sample of 20,000)."""
    path = Path(data) if data else Path(__file__).resolve().parents[3] / "shared" / "data" / "wikipedia_lengths.txt"
    return read_lengths(path) if data or path.is_file() else length_sample()


# ---- the plan broadcast ----------------------------------------------------------------------------
def plan_broadcast(model: str, world: int, lengths: np.ndarray, tokens: Optional[int] = None,
                   gpus_per_node: int = 8, max_candidates: int = 4) -> dict:
    """The pickled bytes and pickle / unpickle CPU seconds of one real plan for ``world`` GPUs."""
    with torch.device("meta"):
        m = llama.build(model)
    context = int(m.config.max_seq_len)
    cost = model_cost_model("analytic", m, world, gpus_per_node)
    lengths = np.minimum(lengths, context)
    tokens = tokens or tokens_per_iter(world)
    n = max(1, int(np.searchsorted(np.cumsum(lengths), tokens, side="right")))
    sample = lengths[: min(lengths.size, 100_000)].tolist()
    candidates, _ = auto_candidates(sample, cost, world, context, tokens, max_candidates=max_candidates)
    plan = selection.plan_iteration(lengths[:n].tolist(), candidates, cost)
    box = (plan, "ahead", float(plan.est_latency_ms), 0.0, [plan.strategy])   # what _on_rank0 broadcasts
    t0 = time.process_time()
    data = pickle.dumps(box, protocol=pickle.HIGHEST_PROTOCOL)
    t1 = time.process_time()
    pickle.loads(data)
    t2 = time.process_time()
    return {"model": model, "gpus": world, "what": "plan broadcast", "tokens": tokens, "docs": n,
            "strategy": str(plan.strategy), "pipelines": len(plan.pipelines), "bytes": len(data),
            "build_s": t1 - t0, "read_s": t2 - t1}


# ---- the data index --------------------------------------------------------------------------------
def write_index_only_store(prefix: str, lengths: np.ndarray) -> None:
    """A token store whose ``.idx`` is real and whose ``.bin`` is a sparse file of the right size."""
    lengths = np.asarray(lengths, dtype=np.uint32)
    offsets = np.zeros(lengths.size, dtype=np.uint64)
    np.cumsum(lengths[:-1], dtype=np.uint64, out=offsets[1:])
    tokens = int(lengths.sum(dtype=np.uint64))
    header = {"version": VERSION, "dtype": "uint16", "vocab_size": 65536, "num_documents": int(lengths.size),
              "num_tokens": tokens, "max_token_id": 65535, "bin_sha256": "0" * 64}
    bin_path, idx_path = store_paths(prefix)
    with open(idx_path, "wb") as f:
        f.write(_header_bytes(header))
        f.write(offsets.astype("<u8").tobytes())
        f.write(lengths.astype("<u4").tobytes())
    with open(bin_path, "wb") as f:
        f.truncate(2 * tokens)


#: bytes a document under which the scan's peak memory is taken not to grow with the corpus
FLAT = 0.01


def data_index(lengths: np.ndarray, docs: int, context: int, tokens: int) -> dict:
    """``_data_index`` at ``docs`` and ``docs / 2`` documents: the costs per document, and the scan's peak
    memory as a line through both (flat when the scan's memory does not grow with the corpus)."""
    full, half = _data_index(lengths, docs, context, tokens), _data_index(lengths, docs // 2, context, tokens)
    slope = (full["scan_peak"] - half["scan_peak"]) / (docs - docs // 2)
    # under FLAT bytes a document the difference is the tracer's own noise (a few hundred bytes), which
    # the line would multiply by the corpus: the scan's memory is taken as flat
    return {**full, "scan_peak_slope": slope if slope >= FLAT else 0.0}


def _data_index(lengths: np.ndarray, docs: int, context: int, tokens: int) -> dict:
    """What one rank pays for the corpus' index at its start, on a store of ``docs`` documents drawn
    from ``lengths``: the ``.idx`` bytes it maps, the CPU seconds of opening the store and of the
    ``--long`` scan of every length, per million documents."""
    reps = -(-docs // lengths.size)
    sample = np.tile(lengths, reps)[:docs]
    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "corpus")
        write_index_only_store(prefix, sample)
        idx_bytes = store_paths(prefix)[1].stat().st_size
        tracemalloc.start()
        t0 = time.process_time()
        store = open_store(prefix)
        docs_seq = StoreDocuments(store)
        t1 = time.process_time()
        limit_long(docs_seq, tokens, context, "error")
        t2 = time.process_time()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        del docs_seq, store
    return {"docs": docs, "idx_bytes": idx_bytes, "open_s": t1 - t0, "scan_s": t2 - t1,
            "bytes_per_doc": idx_bytes / docs, "s_per_mdoc": (t2 - t0) / docs * 1e6,
            "scan_peak": peak}


def data_index_rows(worlds: list[int], measured: dict, mean_length: float) -> list[dict]:
    """The measured per-document cost, for the corpus of a run on each world size."""
    out = []
    for w in worlds:
        n = int(corpus_tokens(w) / mean_length)
        out.append({"gpus": w, "what": "data index", "corpus_tokens": corpus_tokens(w), "docs": n,
                    "bytes": int(n * measured["bytes_per_doc"]), "read_s": n * measured["s_per_mdoc"] / 1e6,
                    "scan_peak_bytes": int(measured["scan_peak"] + (n - measured["docs"]) * measured["scan_peak_slope"])})
    return out


# ---- the checkpoint manifest -----------------------------------------------------------------------
_FLOAT = TensorProperties(dtype=torch.float32)


def _shard_item(fqn: str, shape: tuple[int, ...], dim: int, lo: int, hi: int) -> WriteItem:
    """The ``WriteItem`` DCP makes of one chunk of a ShardedTensor (``_create_write_item_for_shard``)."""
    offsets, sizes = [0] * len(shape), list(shape)
    offsets[dim], sizes[dim] = lo, hi - lo
    return WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                     tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
                                                 properties=_FLOAT, size=torch.Size(shape)))


def _param_items(name: str, shape: tuple[int, ...], dim: int, writer: int, writers: int) -> list[WriteItem]:
    """Writer ``writer`` of ``writers``' chunks of one parameter: master and both moments."""
    shape = shape or (1,)
    lo, hi = shard_bounds(shape[dim], writer, writers)
    if hi <= lo:
        return []
    keys = [f"model.{name}"] + [f"optim.state.{name}.{m}" for m in ("exp_avg", "exp_avg_sq")]
    return [_shard_item(k, shape, dim, lo, hi) for k in keys]


def _shared_items(names: list[str]) -> list[WriteItem]:
    """What every rank that writes the shared entries adds: a step count per parameter and the group."""
    items = []
    for n in names:
        items += _create_write_items(f"optim.state.{n}.step", torch.tensor(1.0))
    items += _create_write_items("optim.param_groups", [{"params": list(names), "lr": 1e-4}])
    return items


def _rng_items(rank: int) -> list[WriteItem]:
    return _create_write_items(f"rng.rank-{rank:05d}", b"")


class _NoCollector:
    """The garbage collector off while a CPU time is taken: its passes cost with whatever else this
    process holds (a bench, not a rank), which made the same read 1 s in one row and 9 s in another."""

    def __enter__(self) -> None:
        self.was = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc: Any) -> None:
        if self.was:
            gc.enable()


def _metadata(plans: list[SavePlan]) -> tuple[Metadata, float]:
    with _NoCollector():
        return _build_metadata(plans)


def _build_metadata(plans: list[SavePlan]) -> tuple[Metadata, float]:
    """The ``.metadata`` rank 0 builds from the gathered plans (DCP's global plan, then the storage
    entries the file-system writer adds, one file per rank) and its CPU seconds."""
    t0 = time.process_time()
    global_plans, md = create_default_global_save_plan(plans, rewrite_index_hints=True)
    storage = {}
    for r, plan in enumerate(global_plans):
        path, at = dcp_format.rank_file_name(r), 0
        for item in plan.items:     # a tensor's fp32 elements (DCP adds a small archive around them)
            length = 4 * math.prod(item.tensor_data.chunk.sizes) if item.tensor_data is not None else 1024
            storage[item.index] = _StorageInfo(path, at, length)
            at += length
    md.storage_data = storage
    return md, time.process_time() - t0


def _pickled(md: Metadata) -> tuple[int, float]:
    data = pickle.dumps(md)
    with _NoCollector():
        t0 = time.process_time()
        pickle.loads(data)
        return len(data), time.process_time() - t0


def param_dims(model: str) -> list[tuple[str, tuple[int, ...], int]]:
    """Every parameter of the zoo model: name, shape and the optimizer's shard dimension."""
    with torch.device("meta"):
        compiled = hgraph.compile(llama.build(model))
    return [(n, tuple(int(d) for d in p.shape), p.shard_dim if p.shape else 0)
            for n, p in compiled.hgraph.params.items()]


#: parameters of one shape built and timed together (the time of the rest is scaled from theirs)
TIMED_COPIES = 4


def rank_classes(world: int, writers: int, shared: Callable[[int], bool]) -> list[tuple[int, int, bool, bool]]:
    """The ranks of a save by what their local plan holds: ``(a rank, how many, writes chunks, writes the
    shared entries)``; ``shared(rank)``: whether the rank adds the step counts and the parameter group
    (``dcp_format.writes_shared``; DCP's default plan would have every rank add them)."""
    classes: dict[tuple[bool, bool], list[int]] = {}
    for r in range(world):
        entry = classes.setdefault((r < writers, bool(shared(r))), [r, 0])
        entry[1] += 1
    return [(r, n, chunks, sh) for (chunks, sh), (r, n) in classes.items()]


#: the chunk layouts a manifest is counted for: what ``dcp_format.save`` writes (each entry's rows
#: coalesced into chunks of at least ``coalesce.MIN_CHUNK_BYTES``), and a chunk per writing rank (what
#: it wrote before)
COALESCED, PER_RANK = "coalesced", "per rank"


def checkpoint_manifest(params: list[tuple[str, tuple[int, ...], int]], world: int, group: Optional[int],
                        shared: Optional[Callable[[int], bool]] = None, layout: str = COALESCED,
                        min_chunk_bytes: int = coalesce.MIN_CHUNK_BYTES) -> dict:
    """Rank 0's side of saving (and every rank's of resuming) a DCP checkpoint of ``params`` at ``world``
    ranks with the optimizer sharded over groups of ``group`` (None: the world); ``shared``: which ranks
    write the shared entries (default: as ``dcp_format.save`` does); ``layout``: ``COALESCED`` (the
    save's chunks, ``coalesce.chunks``) or ``PER_RANK``."""
    shared = shared or dcp_format.writes_shared
    if layout == COALESCED:
        return _coalesced_manifest(params, world, group, shared, min_chunk_bytes)
    writers = group or world
    names = [n for n, _, _ in params]
    gathered = 0                  # what rank 0 gathers: every rank's local plan, pickled
    for r, count, chunks_, shared_ in rank_classes(world, writers, shared):
        items = [i for n, s, d in params for i in _param_items(n, s, d, r, writers)] if chunks_ else []
        items += (_shared_items(names) if shared_ else []) + _rng_items(r)
        gathered += count * len(pickle.dumps(SavePlan(items)))
    # the .metadata (the same whoever adds the shared entries: the coordinator keeps one of each): the
    # RNG and shared entries, then one parameter of each shape built, pickled and read alone and with a
    # second of its shape (what each further one adds)
    base_md, build_s = _metadata([SavePlan(_rng_items(r) + (_shared_items(names) if r == 0 else []))
                                  for r in range(world)])
    total_bytes, read_s = _pickled(base_md)
    chunks = 0
    for (shape, dim), count in Counter((s, d) for _, s, d in params).items():
        k = min(count, TIMED_COPIES)
        one, two, timed = [_shape_metadata(shape, dim, c, writers) for c in (1, 2, k)]
        total_bytes += one[0] - _empty_bytes() + (count - 1) * (two[0] - one[0])
        build_s += timed[1] * count / k
        read_s += timed[2] * count / k
        chunks += count * 3 * min(writers, (shape or (1,))[dim])
    return {"gpus": world, "what": "checkpoint manifest", "layout": PER_RANK, "shard_group": group or "world",
            "params": len(params), "chunks": chunks, "gathered_bytes": gathered, "bytes": total_bytes,
            "build_s": build_s, "read_s": read_s, "gather_sources": 1, "gather_rounds": 0}


def coalesced_plans(params: list[tuple[str, tuple[int, ...], int]], world: int, group: Optional[int],
                    shared: Callable[[int], bool], min_chunk_bytes: int = coalesce.MIN_CHUNK_BYTES) -> list[SavePlan]:
    """Every rank's local ``SavePlan`` as ``dcp_format.save`` makes it: the chunks it writes
    (``coalesce.chunks``, entries numbered as the save numbers them), the shared entries where it writes
    them, its RNG bytes."""
    writers = group or world
    names = [n for n, _, _ in params]
    items: dict[int, list[WriteItem]] = {}
    for i, (name, shape, dim) in enumerate(params):
        keys = [f"model.{name}"] + [f"optim.state.{name}.{m}" for m in ("exp_avg", "exp_avg_sq")]
        for k, key in enumerate(keys):
            entry = coalesce.Entry(3 * i + k, shape, dim)
            for c in coalesce.chunks(entry, writers, min_chunk_bytes):
                items.setdefault(c.writer, []).append(_shard_item(key, entry.shape, dim, c.lo, c.hi))
    return [SavePlan(items.get(r, []) + (_shared_items(names) if shared(r) else []) + _rng_items(r))
            for r in range(world)]


def _coalesced_manifest(params, world, group, shared, min_chunk_bytes) -> dict:
    """The coalesced layout's chunks are bounded (not one per rank): its ``.metadata`` is built whole."""
    plans = coalesced_plans(params, world, group, shared, min_chunk_bytes)
    gathered = sum(len(pickle.dumps(p)) for p in plans)
    md, build_s = _metadata(plans)
    size, read_s = _pickled(md)
    chunks = sum(1 for p in plans for item in p.items if item.type == WriteItemType.SHARD)
    # the most ranks one writer gathers rows from at a save, and the rounds of its gather tree
    blocks = [c for i, (_, shape, dim) in enumerate(params)
              for c in coalesce.chunks(coalesce.Entry(3 * i, shape, dim), group or world, min_chunk_bytes)]
    fan_in = max(c.sources for c in blocks)
    rounds = max(coalesce.gather_rounds(c.stop - c.first) for c in blocks)
    return {"gpus": world, "what": "checkpoint manifest", "layout": COALESCED, "shard_group": group or "world",
            "params": len(params), "chunks": chunks, "gathered_bytes": gathered, "bytes": size,
            "build_s": build_s, "read_s": read_s, "gather_sources": fan_in, "gather_rounds": rounds}


def _empty_bytes() -> int:
    return len(pickle.dumps(Metadata({}, storage_data={})))


def _shape_metadata(shape: tuple[int, ...], dim: int, copies: int, writers: int) -> tuple[int, float, float]:
    """Bytes, build and read CPU seconds of the ``.metadata`` of ``copies`` parameters of one shape."""
    plans = []
    for r in range(writers):
        items = []
        for k in range(copies):
            items += _param_items(f"layers.{k}.w", shape, dim, r, writers)
        plans.append(SavePlan(items))
    md, build = _metadata(plans)
    size, read = _pickled(md)
    return size, build, read


# ---- the report ------------------------------------------------------------------------------------
def counts(models: list[str], worlds: list[int], shard_groups: tuple[Optional[int], ...], gpus_per_node: int = 8,
           data_docs: int = 10_000_000, lengths: Optional[np.ndarray] = None, progress: Any = None) -> dict:
    """Every row of the three sections for ``models`` at ``worlds`` (the manifest at each shard group
    that divides a world and is smaller, None: the world; ``manifests`` in the layout the save writes,
    ``manifests_per_rank`` with a chunk per writing rank, the layout before coalescing)."""
    lengths = shipped_lengths() if lengths is None else lengths
    say = progress or (lambda text: None)
    plans, manifests, per_rank = [], [], []
    for model in models:
        params = param_dims(model)
        for w in worlds:
            plans.append(plan_broadcast(model, w, lengths, gpus_per_node=gpus_per_node))
            say(f"{model} {w:>6} GPUs: plan of {plans[-1]['docs']:,} documents, {plans[-1]['bytes']:,} bytes")
            for g in shard_groups:
                if g is not None and (g >= w or w % g):
                    continue
                manifests.append({"model": model, **checkpoint_manifest(params, w, g)})
                per_rank.append({"model": model, **checkpoint_manifest(params, w, g, layout=PER_RANK)})
                say(f"{model} {w:>6} GPUs G {g or 'world'}: manifest {manifests[-1]['bytes'] / 2**20:,.1f} MB "
                    f"({per_rank[-1]['bytes'] / 2**20:,.1f} MB with a chunk per rank)")
    with torch.device("meta"):
        context = int(llama.build(models[0]).config.max_seq_len)
    cut = np.minimum(lengths, context)
    measured = data_index(cut, data_docs, context, tokens_per_iter(max(worlds)))
    return {"plans": plans, "manifests": manifests, "manifests_per_rank": per_rank, "data_measured": measured,
            "data": data_index_rows(worlds, measured, float(cut.mean())), "context": context}


def _table(rows: list[dict], columns: list[tuple[str, str, Any]]) -> str:
    lines = ["| " + " | ".join(h for _, h, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(f(r[k]) for k, _, f in columns) + " |" for r in rows]
    return "\n".join(lines)


def _mb(n: float) -> str:
    return f"{n / 2**20:,.2f}" if n < 2**20 * 100 else f"{n / 2**20:,.0f}"


def counts_tables(result: dict) -> str:
    """The three sections as Markdown tables, with a line on what each grows with."""
    m = result["data_measured"]
    out = ["Plan broadcast (rank 0 pickles, every rank unpickles; per step)",
           _table(result["plans"], [("model", "model", str), ("gpus", "GPUs", "{:,}".format),
                                    ("tokens", "tokens/iter", "{:,}".format), ("docs", "documents", "{:,}".format),
                                    ("pipelines", "pipelines", "{:,}".format), ("bytes", "MB", _mb),
                                    ("build_s", "pickle s", "{:.3f}".format), ("read_s", "unpickle s", "{:.3f}".format)]),
           "",
           f"Data index per rank (12 bytes a document, memory mapped; open and --long scan measured on "
           f"{m['docs']:,} and half as many documents: {m['s_per_mdoc']:.4f} s per million), for the corpus of a run that size: it grows "
           "with the corpus, not the world",
           _table(result["data"], [("gpus", "GPUs", "{:,}".format), ("corpus_tokens", "corpus tokens", "{:,}".format),
                                   ("docs", "documents", "{:,}".format), ("bytes", "index MB", _mb),
                                   ("read_s", "open + scan s", "{:.1f}".format),
                                   ("scan_peak_bytes", "scan peak MB", _mb)]),
           "",
           "Checkpoint manifest (DCP .metadata; rank 0 gathers every rank's plan and builds it on save, every rank "
           f"reads it on resume): the save's chunks (coalesced, at least {coalesce.MIN_CHUNK_BYTES >> 20} MiB "
           "each) beside a chunk per writing rank; writer's sources: the most ranks whose rows one chunk's writer "
           f"gathers at a save, point to point up a tree (a rank receives from at most {coalesce.FAN_IN - 1} a round)",
           _table([r for pair in zip(result["manifests_per_rank"], result["manifests"]) for r in pair],
                  [("model", "model", str), ("gpus", "GPUs", "{:,}".format),
                                        ("shard_group", "G", str), ("layout", "chunks of", str),
                                        ("chunks", "chunks", "{:,}".format),
                                        ("gathered_bytes", "gathered MB", _mb), ("bytes", ".metadata MB", _mb),
                                        ("build_s", "build s", "{:.2f}".format), ("read_s", "read s", "{:.2f}".format),
                                        ("gather_sources", "writer's sources", "{:,}".format),
                                        ("gather_rounds", "gather rounds", str)])]
    return "\n".join(out)


def report(models: list[str], worlds: list[int], shard_groups: tuple[Optional[int], ...], gpus_per_node: int,
           data_docs: int, as_json: bool) -> int:
    """``cluster_scale --counts``: the tables (or one JSON object) on stdout, progress on stderr."""
    result = counts(models, worlds, shard_groups, gpus_per_node, data_docs,
                    progress=None if as_json else (lambda text: print(text, file=sys.stderr, flush=True)))
    print(json.dumps(result) if as_json else counts_tables(result))
    return 0
