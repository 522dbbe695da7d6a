"""``hgraph train`` under ``torchrun``: each process is one rank (init from the environment, gloo on
CPU), rank 0 reports, and the run equals the same run on the built-in spawner (same strategies, same
documents; losses within 1e-6 x loss, final parameters within 1e-6 — both launches run the same
programs, only the thread settings of the processes may differ)."""
import json
import subprocess
import sys

import torch

from hgraph.runtime.train.config import TrainConfig
from hgraph.runtime.train.trainer import run_training

LENGTHS = [13, 5, 9, 7, 11, 3, 6, 8, 10, 4, 12, 2]
SCHEDULE = "1xTP2PP1;2xTP1PP1;1xTP1PP2"


def test_torchrun_run_equals_the_spawned_run(tmp_path):
    g = torch.Generator().manual_seed(11)
    docs = [torch.randint(0, 512, (n,), generator=g).tolist() for n in LENGTHS]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"input_ids": d}) + "\n" for d in docs))
    final = tmp_path / "final.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "hgraph.tools.cli", "train", "--model", "tiny", "--data", str(data), "--world-size", "2",
           "--strategy-schedule", SCHEDULE, "--steps", "3", "--tokens-per-iter", "30",
           "--save-final", str(final), "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(reports) == 1                         # only rank 0 reports
    got = reports[0]["steps"]

    want = run_training(TrainConfig.from_values(model="tiny", world_size=2, strategy_schedule=SCHEDULE, steps=3,
                                                tokens_per_iter=30, data=str(data),
                                                save_final=str(tmp_path / "spawn.pt")))
    assert [s["strategy"] for s in got] == ["1xTP2PP1", "2xTP1PP1", "1xTP1PP2"]
    assert [s["tokens"] for s in got] == [s["tokens"] for s in want["steps"]]
    for a, b in zip(got, want["steps"]):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * b["loss"]
    state, ref = torch.load(final), torch.load(tmp_path / "spawn.pt")
    assert list(state) == list(ref)
    for k in ref:
        torch.testing.assert_close(state[k], ref[k], atol=1e-6, rtol=1e-6)
