"""``hgraph pack``: JSON contract, conservation after flush, errors."""
import json

import pytest

from hgraph.tools.cli import main


@pytest.fixture()
def lengths_file(tmp_path):
    import numpy as np
    rng = np.random.default_rng(0)
    lens = np.minimum(rng.lognormal(6.5, 1.5, size=600).astype(int) + 1, 16384)
    p = tmp_path / "lengths.txt"
    p.write_text("\n".join(map(str, lens)) + "\n")
    return p, lens


@pytest.mark.parametrize("method", ["wlb", "fixed-greedy", "fixed-solver"])
def test_json_contract_and_conservation(lengths_file, method, capsys):
    path, lens = lengths_file
    rc = main(["pack", "--lengths", str(path), "--method", method, "--max-len", "16384", "--micro-batches", "4",
               "--solver-time-limit", "0.05", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"batches", "mean_delay_iters"}
    idx = sorted(i for b in out["batches"] for mb in b["microbatches"] for i in mb)
    assert idx == list(range(len(lens)))
    assert [b["index"] for b in out["batches"]] == list(range(len(out["batches"])))
    for b in out["batches"]:
        assert set(b) == {"index", "microbatches", "imbalance", "pack_ms"}
        assert len(b["microbatches"]) == 4 and b["imbalance"] >= 1.0
        for mb in b["microbatches"]:
            assert sum(int(lens[i]) for i in mb) <= 16384
    if method != "wlb":
        assert out["mean_delay_iters"] < 0.5


def test_global_batches_follow_file_order(tmp_path, capsys):
    p = tmp_path / "l.txt"
    p.write_text("\n".join(["100"] * 10) + "\n")
    assert main(["pack", "--lengths", str(p), "--method", "wlb", "--max-len", "200", "--micro-batches", "2",
                 "--coeffs", "1e-3,1", "--queues", "0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    first = sorted(i for mb in out["batches"][0]["microbatches"] for i in mb)
    assert first == [0, 1, 2, 3]  # 2 micro-batches x 200 tokens = 4 documents of 100


def test_pp_imbalance_per_pipeline(lengths_file, capsys):
    path, _ = lengths_file
    assert main(["pack", "--lengths", str(path), "--method", "fixed-greedy", "--max-len", "16384",
                 "--micro-batches", "4", "--pp", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert all(b["imbalance"] >= 1.0 for b in out["batches"])


def test_errors(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    bad = tmp_path / "bad.txt"
    bad.write_text("10\nabc\n")
    long = tmp_path / "long.txt"
    long.write_text("10\n99999\n")
    args = ["--method", "wlb", "--max-len", "1000", "--micro-batches", "2"]
    assert main(["pack", "--lengths", str(empty)] + args) == 2
    assert "empty" in capsys.readouterr().err
    assert main(["pack", "--lengths", str(bad)] + args) == 2
    assert "bad.txt:2: " in capsys.readouterr().err
    assert main(["pack", "--lengths", str(long)] + args) == 2
    err = capsys.readouterr().err
    assert "99999" in err and "1000" in err and err.count("\n") == 1
    assert main(["pack", "--lengths", str(long), "--long", "drop", "--json"] + args) == 0
    out = json.loads(capsys.readouterr().out)
    assert sorted(i for b in out["batches"] for mb in b["microbatches"] for i in mb) == [0]
    assert main(["pack", "--lengths", str(long), "--profile", "nope"] + args) == 2
    assert "unknown profile" in capsys.readouterr().err
    assert main(["pack", "--lengths", str(long), "--pp", "3"] + args) == 2
