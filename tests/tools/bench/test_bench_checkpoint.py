"""The checkpoint benchmark runs in a tiny configuration and reports consistent figures."""
from __future__ import annotations

import json

from hgraph.tools.bench.checkpoint import main


def test_bench_checkpoint_tiny(capsys):
    args = ["--model-args", '{"num_layers": 1, "vocab_size": 64}', "--world-size", "2",
            "--load-world-sizes", "2,3", "--repeats", "1", "--json"]
    assert main(args) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["world_size"] == 2 and res["bytes"] > 0 and res["save_s"] > 0
    assert res["loads"]["2"]["resharded"] is False and res["loads"]["3"]["resharded"] is True
    assert all(f["verify_s"] > 0 and f["no_verify_s"] > 0 for f in res["loads"].values())
