"""``hgraph propose``: JSON output, human output, errors."""
import json

import numpy as np
import pytest

from hgraph.strategy import Strategy
from hgraph.tools.cli import main


@pytest.fixture()
def lengths_file(tmp_path):
    rng = np.random.default_rng(0)
    lens = np.minimum(rng.lognormal(6.5, 1.5, size=5000).astype(int) + 1, 100000)
    p = tmp_path / "lengths.txt"
    p.write_text("\n".join(map(str, lens)) + "\n")
    return p


def test_json(lengths_file, capsys):
    assert main(["propose", "--lengths", str(lengths_file), "--profile", "llama-7b", "--world-size", "16",
                 "--max-len", "32768", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["gpus"] == 16 and out["max_len"] == 32768 and out["candidates"]
    for c in out["candidates"]:
        s = Strategy.parse(c["strategy"])
        assert s.num_ranks == 16 and c["expected_ms"] > 0 and c["len_range"][1] <= 32768
    assert out["candidates"][-1]["len_range"][1] == 32768


def test_human(lengths_file, capsys):
    assert main(["propose", "--lengths", str(lengths_file), "--profile", "llama-7b", "--world-size", "8",
                 "--max-len", "16384"]) == 0
    text = capsys.readouterr().out
    assert "candidates" in text and "expected ms" in text


def test_errors(lengths_file, tmp_path, capsys):
    base = ["propose", "--lengths", str(lengths_file), "--world-size", "8"]
    assert main(base + ["--profile", "llama-99b", "--max-len", "4096"]) == 2
    assert "unknown profile" in capsys.readouterr().err
    # A context longer than any scheme holds: name the longest document and the largest MaxLen.
    assert main(base + ["--profile", "llama-7b", "--max-len", "10000000"]) == 2
    err = capsys.readouterr().err
    assert "largest MaxLen" in err and err.count("\n") == 1
    assert main(base + ["--profile", "llama-7b", "--max-len", "10000000", "--long", "truncate", "--json"]) == 0
    capsys.readouterr()
    assert main(["propose", "--lengths", str(lengths_file), "--world-size", "1", "--profile", "llama-7b",
                 "--max-len", "4096"]) == 2
    assert "no scheme" in capsys.readouterr().err
    empty = tmp_path / "e.txt"
    empty.write_text("")
    assert main(["propose", "--lengths", str(empty), "--world-size", "8", "--profile", "llama-7b", "--max-len", "4096"]) == 2


def test_cp_degrees_grow_to_hold_the_context():
    """No --max-cp: CP schemes are derived up to the degree whose MaxLen holds --max-len (2048K
    tokens of llama-32b need CP 128 without Ulysses, CP 16 with UL 13 inside each CP shard), and no
    further than the cluster allows."""
    from argparse import Namespace

    from hgraph.tools.cli.length_options import workload_cost_model

    def cost(world, max_len, **options):
        return workload_cost_model(Namespace(profile="llama-32b", world_size=world, gpus_per_node=8,
                                             device_memory=None, max_len=max_len), **options)

    long = cost(12288, 2_097_152, max_ul=1)
    assert long.max_cp == 128 and long.largest_max_len() >= 2_097_152
    two_d = cost(12288, 2_097_152)
    assert two_d.max_cp == 16 and two_d.largest_max_len() >= 2_097_152
    assert max(s.seq for s in two_d.schemes if s.cp == 16) == 16 * 13     # 52 heads / TP4
    assert cost(12288, 32768).max_cp == 8                  # the profile's default when it holds the context
    assert cost(64, 2_097_152).max_cp == 64                # as far as 64 GPUs go
