"""The MoE planner benchmark runs end to end in its small form (16 GPUs, 16K context) on a seeded
long tail: it is a script, not a test of the figures (those are in its output)."""
import json

import numpy as np

from hgraph.tools.bench import moe_plan


def test_bench_moe_plan_quick(tmp_path, capsys):
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(6.5, 1.5, size=3000).astype(np.int64), 1, 40000)
    path = tmp_path / "lengths.txt"
    path.write_text("\n".join(map(str, lengths)) + "\n")
    assert moe_plan.main(["--lengths", str(path), "--quick", "--no-pin", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["gpus"], report["max_len"], report["iterations"]) == (16, 16384, 2)
    assert report["ep_schemes"] > 0 and report["candidates"] and len(report["chosen"]) == 2
    assert report["plan_ms"]["mean"] > 0 and report["plan_cpu_ms"]["mean"] > 0
    assert set(report["systems"]) == set(moe_plan.SYSTEMS) and not report["skipped"]
    assert "EP" in report["systems"]["homogeneous-ep"]["config"]
    assert "EP8" in report["systems"]["megatron-ep"]["config"]
    # hgraph's candidates include the best homogeneous strategy, so it is never far behind a homogeneous one
    assert report["speedup"]["homogeneous-ep"] > 0.95 and report["speedup"]["megatron-ep"] > 0.95
