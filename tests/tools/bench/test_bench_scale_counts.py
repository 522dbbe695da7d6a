"""``cluster_scale --counts`` runs small, and what it counts does not grow with the world where it must
not: with the optimizer sharded in groups of G, the checkpoint's chunks are G per parameter whatever the
world, and each rank more adds only its RNG entry to what rank 0 gathers and writes (sizes, not seconds)."""
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
    by = {(w, g): scale_counts.checkpoint_manifest(params, w, g) for w in (16, 256) for g in (8, None)}
    assert by[16, 8]["chunks"] == by[256, 8]["chunks"] < by[16, None]["chunks"] < by[256, None]["chunks"]
    extra = 256 - 16
    for key in ("gathered_bytes", "bytes"):
        per_rank = (by[256, 8][key] - by[16, 8][key]) / extra
        assert 0 < per_rank < 1024, (key, per_rank)
    # DCP's default (every rank adds the step counts and the parameter group) grows by them per rank
    every = {w: scale_counts.checkpoint_manifest(params, w, 8, shared=lambda r: True) for w in (16, 256)}
    assert (every[256]["gathered_bytes"] - every[16]["gathered_bytes"]) / extra > 20 * len(params)


def test_the_data_index_grows_with_the_corpus_and_its_scan_memory_does_not(monkeypatch):
    monkeypatch.setattr(documents, "SCAN_CHUNK", 4096)      # both measured corpora hold many chunks
    lengths = np.random.default_rng(0).integers(1, 4000, size=50_000)
    m = scale_counts.data_index(lengths, 400_000, 4096, 1 << 20)
    assert 0 < m["idx_bytes"] - 12 * 400_000 < 1024       # 12 bytes a document and the header
    rows = scale_counts.data_index_rows([1024, 12288], m, float(lengths.mean()))
    assert rows[1]["bytes"] > rows[0]["bytes"]
    assert rows[0]["scan_peak_bytes"] == rows[1]["scan_peak_bytes"] < 64 << 20
