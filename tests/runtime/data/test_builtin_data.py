"""The built-in long-tail dataset: shipped sample, scaling, determinism, JSONL round trip."""
from __future__ import annotations

import tomllib
from pathlib import Path

import numpy as np
import pytest

import hgraph.runtime.data.documents
from hgraph.errors import HGraphError
from hgraph.runtime.data.builtin import (DEFAULT_SCALE, length_sample, scaled_lengths, synthetic_documents,
                                         write_jsonl)
from hgraph.runtime.data.documents import read_jsonl

REPO = Path(__file__).resolve().parents[3]
SHARED_LENGTHS = REPO.parent / "shared" / "data" / "wikipedia_lengths.txt"


def test_shipped_sample_is_real_lengths_and_small():
    sample = length_sample()
    assert len(sample) == 20_000 and sample.min() >= 1
    # the long tail of Wikipedia: median a few hundred tokens, p99 around ten thousand
    assert 250 < np.median(sample) < 450 and 7000 < np.percentile(sample, 99) < 14000
    shipped = REPO / "runtime" / "data" / "wikipedia_length_sample.txt"
    assert shipped.stat().st_size < 300_000
    # the sample is package data of the data package itself, beside its modules
    assert Path(hgraph.runtime.data.documents.__file__).parent == shipped.parent


def test_package_data_glob_ships_the_sample():
    conf = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "*.txt" in conf["tool"]["setuptools"]["package-data"]["hgraph.runtime.data"]


@pytest.mark.skipif(not SHARED_LENGTHS.exists(), reason="../shared/data is not beside the repository")
def test_sample_script_reproduces_the_shipped_file(tmp_path):
    from hgraph.tools.report.length_sample import SEED, make_sample, write_sample
    out = tmp_path / "sample.txt"
    write_sample(make_sample(SHARED_LENGTHS, 20_000, SEED), out, SHARED_LENGTHS.name, SEED)
    assert out.read_bytes() == (REPO / "runtime" / "data" / "wikipedia_length_sample.txt").read_bytes()


def test_documents_are_deterministic_per_seed_and_in_range():
    a = synthetic_documents(300, vocab_size=512, max_len=256, seed=7)
    b = synthetic_documents(300, vocab_size=512, max_len=256, seed=7)
    c = synthetic_documents(300, vocab_size=512, max_len=256, seed=8)
    assert a == b and a != c
    assert len(a) == 300
    assert all(2 <= len(d) <= 256 for d in a)
    assert all(type(t) is int and 0 <= t < 512 for d in a for t in d)
    assert [len(d) for d in a] == scaled_lengths(300, 256, 7).tolist()


def test_scaling_follows_the_sample():
    n = 20_000
    lengths = scaled_lengths(n, max_len=10**9, seed=3, scale=DEFAULT_SCALE)
    sample = length_sample()
    # median of the scaled draws sits near the scaled median of the sample (sampling noise: a few %)
    assert abs(np.median(lengths) - np.median(sample) * DEFAULT_SCALE) <= 2
    half = scaled_lengths(n, max_len=10**9, seed=3, scale=DEFAULT_SCALE / 2)
    assert abs(half.mean() * 2 - lengths.mean()) / lengths.mean() < 0.01
    capped = scaled_lengths(n, max_len=128, seed=3)
    assert capped.max() == 128 and np.array_equal(capped, np.minimum(lengths, 128))


def test_zipf_ids_are_skewed_and_uniform_are_flat():
    zipf = np.concatenate([np.array(d) for d in synthetic_documents(400, 64, 512, seed=1, scale=1.0)])
    flat = np.concatenate([np.array(d) for d in synthetic_documents(400, 64, 512, seed=1, scale=1.0,
                                                                  token_law="uniform")])
    zc, fc = np.bincount(zipf, minlength=64), np.bincount(flat, minlength=64)
    assert zc[0] > 10 * zc[63]
    assert fc.max() < 1.5 * fc.min()


def test_jsonl_round_trip(tmp_path):
    docs = synthetic_documents(50, 512, 128, seed=2)
    path = write_jsonl(tmp_path / "d.jsonl", docs)
    back = read_jsonl(path, vocab_size=512)
    assert [list(d.input_ids) for d in back] == docs


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_docs=0), "num_docs"), (dict(vocab_size=0), "vocab_size"), (dict(max_len=1), "max_len"),
    (dict(scale=0.0), "scale"), (dict(token_law="normal"), "token_law.*zipf, uniform"),
])
def test_bad_arguments_are_one_line_errors(kwargs, match):
    args = dict(num_docs=5, vocab_size=32, max_len=64, seed=0)
    args.update(kwargs)
    with pytest.raises(HGraphError, match=match):
        synthetic_documents(**args)
