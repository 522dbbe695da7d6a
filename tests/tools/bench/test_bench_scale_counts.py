"""``cluster_scale --counts`` runs small, and what it counts does not grow with the world where it must
not: the checkpoint's coalesced chunks are as many whatever the world (with a chunk per writing rank,
G per parameter under shard groups of G), and each rank more adds only its RNG entry to what rank 0
gathers and writes (sizes, not seconds)."""
from __future__ import annotations

import json

import numpy as np

from hgraph.runtime.data import documents
from hgraph.tools.bench import scale_counts
from hgraph.tools.bench.cluster_scale import main


def test_counts_section_prints_the_three_tables(capsys):
    assert main(["--counts", "--quick", "--data-docs", "20000", "--shard-groups", "8,world", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [(r["gpus"], r["model"]) for r in result["plans"]] == [(16, "tiny"), (64, "tiny")]
    for r in result["plans"]:
        assert r["bytes"] > 0 and r["docs"] > 0 and r["pipelines"] >= 1
    assert result["data_measured"]["bytes_per_doc"] >= 12
    assert [r["gpus"] for r in result["data"]] == [16, 64]
    assert sorted((r["gpus"], str(r["shard_group"])) for r in result["manifests"]) == [
        (16, "8"), (16, "world"), (64, "8"), (64, "world")]


def test_the_manifest_at_a_shard_group_grows_by_an_rng_entry_per_rank():
    params = scale_counts.param_dims("tiny")
    by = {(w, g): scale_counts.checkpoint_manifest(params, w, g, layout=scale_counts.PER_RANK)
          for w in (16, 256) for g in (8, None)}
    assert by[16, 8]["chunks"] == by[256, 8]["chunks"] < by[16, None]["chunks"] < by[256, None]["chunks"]
    extra = 256 - 16
    for key in ("gathered_bytes", "bytes"):
        per_rank = (by[256, 8][key] - by[16, 8][key]) / extra
        assert 0 < per_rank < 1024, (key, per_rank)
    # DCP's default (every rank adds the step counts and the parameter group) grows by them per rank
    every = {w: scale_counts.checkpoint_manifest(params, w, 8, shared=lambda r: True, layout=scale_counts.PER_RANK)
             for w in (16, 256)}
    assert (every[256]["gathered_bytes"] - every[16]["gathered_bytes"]) / extra > 20 * len(params)


def test_the_coalesced_manifest_has_the_same_chunks_at_any_world():
    """The save's layout (``coalesce``): with chunks of at least 4 KiB the tiny model's entries are
    several chunks each (its embedding 32), as many at 64 ranks as at 4,096 in the world layout (their
    bounds follow the ranks' rows), never more than an entry's bytes over 4 KiB; the ``.metadata`` grows by an RNG entry per
    rank only, and a chunk per rank (what it wrote before) is many times larger."""
    params = scale_counts.param_dims("tiny")
    small = 4096
    plans = {w: scale_counts.coalesced_plans(params, w, None, lambda r: r == 0, small) for w in (64, 4096)}

    def chunks(plan_list):
        out = {}
        for plan in plan_list:
            for item in plan.items:
                if item.tensor_data is not None and item.index.fqn.split(".")[-1] != "step":
                    out.setdefault(item.index.fqn, []).append(tuple(item.tensor_data.chunk.offsets))
        return {k: sorted(v) for k, v in out.items()}

    at = {w: chunks(p) for w, p in plans.items()}
    assert {k: len(v) for k, v in at[64].items()} == {k: len(v) for k, v in at[4096].items()}
    assert len(at[64]["model.embed_tokens.weight"]) == 32
    for name, shape, dim in params:
        size = 4 * max(1, int(np.prod(shape)))
        assert 1 <= len(at[64][f"model.{name}"]) <= max(1, size // small), name
    by = {w: scale_counts.checkpoint_manifest(params, w, None, min_chunk_bytes=small) for w in (64, 4096)}
    per_rank_md = (by[4096]["bytes"] - by[64]["bytes"]) / (4096 - 64)
    assert 0 < per_rank_md < 256
    assert by[64]["chunks"] == by[4096]["chunks"] == sum(len(v) for v in at[64].values())
    old = scale_counts.checkpoint_manifest(params, 256, None, layout=scale_counts.PER_RANK)
    assert old["bytes"] > 10 * scale_counts.checkpoint_manifest(params, 256, None)["bytes"]


def test_the_data_index_grows_with_the_corpus_and_its_scan_memory_does_not(monkeypatch):
    monkeypatch.setattr(documents, "SCAN_CHUNK", 4096)      # both measured corpora hold many chunks
    lengths = np.random.default_rng(0).integers(1, 4000, size=50_000)
    m = scale_counts.data_index(lengths, 400_000, 4096, 1 << 20)
    assert 0 < m["idx_bytes"] - 12 * 400_000 < 1024       # 12 bytes a document and the header
    rows = scale_counts.data_index_rows([1024, 12288], m, float(lengths.mean()))
    assert rows[1]["bytes"] > rows[0]["bytes"]
    assert rows[0]["scan_peak_bytes"] == rows[1]["scan_peak_bytes"] < 64 << 20
