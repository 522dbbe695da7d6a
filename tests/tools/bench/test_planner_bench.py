"""The planner benchmark runs end to end in a tiny configuration (it is a script, not a test of
the figures; the figures are in its output)."""
import json

import numpy as np

from hgraph.tools.bench import planner as bench_planner


def test_bench_planner_tiny(tmp_path, capsys):
    rng = np.random.default_rng(0)
    lengths = np.maximum(rng.lognormal(6.0, 1.4, size=1500).astype(np.int64), 1)
    path = tmp_path / "lengths.txt"
    path.write_text("\n".join(map(str, lengths)) + "\n")
    code = bench_planner.main(["--lengths", str(path), "--skip-1024", "--skip-12288", "--iters-64", "2", "--instances", "1",
                               "--small-instances", "1", "--cpsat-seconds", "0.3", "--pack-seconds", "0.1",
                               "--wlb-batches", "2", "--no-pin", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    speed = report["speed"]["64"]
    assert speed["iterations"] == 2 and speed["solve_ms"]["mean"] > 0 and speed["candidates"]
    assert speed["scale_quality"]["vs_alg1_max"] <= 1 + 1e-9   # never worse than Alg. 1 on the same strategy
    charges = speed["charges"]   # per iteration against each proposal charge alone
    assert all(len(charges[k]) == 2 for k in ("default", "vs_charged", "vs_uncharged", "charged_vs_uncharged"))
    small = report["quality"]["small"]
    for r in small + report["quality"]["64"]:
        assert r["cpsat"] <= r["fast"] <= r["alg1"]  # CP-SAT hinted with fast; fast never worse than Alg. 1
        assert r["lower_bound"] <= r["cpsat"] * (1 + 1e-9)
    assert small and report["quality"]["64"]
    assert report["packing"]["fast_over_cpsat"]["max"] >= 1 - 1e-9  # CP-SAT hinted with fast: never worse
    assert report["wlb"]["pareto"]["imbalance"] >= 1.0


def test_bench_planner_headline_prints_the_summary(tmp_path, capsys):
    rng = np.random.default_rng(1)
    lengths = np.maximum(rng.lognormal(6.0, 1.4, size=1500).astype(np.int64), 1)
    path = tmp_path / "lengths.txt"
    path.write_text("\n".join(map(str, lengths)) + "\n")
    assert bench_planner.main(["--lengths", str(path), "--headline", "--skip-1024", "--skip-12288", "--iters-64", "2",
                               "--instances", "1", "--cpsat-seconds", "0.3", "--wlb-batches", "2", "--no-pin"]) == 0
    out = capsys.readouterr().out
    block = out[out.index("[headline]"):]
    assert "64 GPUs: plan CPU ms p50" in block and "gap to the proven bound" in block
    assert all(f"WLB {name}:" in block for name in ("lengths file", "pareto", "lognormal"))
    assert "[quality, 16 GPUs" not in out and "[packing alone" not in out
