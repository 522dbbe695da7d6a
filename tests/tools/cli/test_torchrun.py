"""``hgraph train`` under ``torchrun``: each process is one rank, the world size and ranks per node come
from the launcher (no ``--world-size``), global rank 0 alone reports and writes, and the run equals
the same run on the built-in spawner (same strategies, same documents; losses within 1e-6 x loss,
final parameters within 1e-6: both launches run the same programs, only the thread settings of the
processes may differ).

Each launch serves several checks, as launches cost seconds: a two-rank run with a fixed schedule
whose rank 1 is SIGKILLed mid-step under ``--max-restarts 1`` resumes by itself and equals the
uninterrupted spawned run; two torchrun invocations (``--nnodes 2 --node-rank 0/1`` on loopback)
form one planner-driven four-rank run equal to the spawned one on two "nodes" of two ranks.

No hang when a launch fails (the loopback test once hung until its 300 s limit): when the master
port is taken between the probe and node 0's bind, node 0's agent fails at once (EADDRINUSE) and
node 1's waits, silently, for a store that never comes (measured: still waiting after 90 s; its
rendezvous timeout is longer than the test's). ``_finish`` therefore watches every node and ends
the others as soon as one fails; a taken port is retried on another one. The launchers' output goes
to files, read once they end (two pipes read one after the other can block a node on a full pipe).
"""
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hgraph.runtime.train.config import TrainConfig
from hgraph.runtime.train.rank_run import run_training

LENGTHS = [13, 5, 9, 7, 11, 3, 6, 8, 10, 4, 12, 2]
SCHEDULE = "1xTP2PP1;2xTP1PP1;1xTP1PP2"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
KILLER = str(Path(__file__).with_name("kill_a_rank.py"))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    g = torch.Generator().manual_seed(11)
    docs = [torch.randint(0, 512, (n,), generator=g).tolist() for n in LENGTHS]
    path = tmp_path_factory.mktemp("data") / "docs.jsonl"
    path.write_text("".join(json.dumps({"input_ids": d}) + "\n" for d in docs))
    return path


def _reference(tmp_path, **values):
    """The spawned run of ``values``: its result, per-step metrics lines and final parameters."""
    metrics, final = tmp_path / "ref_metrics.jsonl", tmp_path / "ref_final.pt"
    result = run_training(TrainConfig.from_values(model="tiny", metrics=str(metrics), save_final=str(final),
                                                  **values))
    return result, [json.loads(line) for line in metrics.read_text().splitlines()], torch.load(final)


def _same_run(records, final, ref_records, ref_final):
    assert [r["step"] for r in records] == [r["step"] for r in ref_records]
    assert [r["strategy"] for r in records] == [r["strategy"] for r in ref_records]
    assert [r["documents"] for r in records] == [r["documents"] for r in ref_records]
    for a, b in zip(records, ref_records):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * b["loss"], (a["step"], a["loss"], b["loss"])
    assert list(final) == list(ref_final)
    for k in ref_final:
        torch.testing.assert_close(final[k], ref_final[k], atol=1e-6, rtol=1e-6)


def _json_lines(stdout):
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


class Launched:
    """A launcher process whose stdout and stderr go to files (never a pipe nobody reads yet)."""

    def __init__(self, cmd, folder, cwd=None):
        folder.mkdir(parents=True, exist_ok=True)
        self.out, self.err = folder / "stdout", folder / "stderr"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=err, start_new_session=True)

    def outputs(self):
        return self.out.read_text(), self.err.read_text()


class PortTaken(AssertionError):
    """Node 0's agent could not bind the master port: another process took it after the probe."""


def _finish(launched, timeout=300):
    """Every launcher's (stdout, stderr) once all ended with code 0. One that fails ends the others at
    once (``PortTaken`` when node 0's agent found its port taken); past ``timeout`` all are ended and
    their stderr shown."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        codes = [x.proc.poll() for x in launched]
        failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
        if failed or all(c == 0 for c in codes):
            break
        time.sleep(0.2)
    else:
        failed = None
    for x in launched:
        if x.proc.poll() is None:
            os.killpg(x.proc.pid, signal.SIGKILL)    # the agent's session: its workers die with it anyway
            x.proc.wait()
    outs = [x.outputs() for x in launched]
    if failed is None:
        raise AssertionError(f"torchrun did not finish within {timeout} s: "
                             + " | ".join(err[-1500:] for _, err in outs))
    if failed:
        i = failed[0]
        err = outs[i][1]
        kind = PortTaken if i == 0 and "EADDRINUSE" in err else AssertionError
        raise kind(f"launch {i} failed with code {launched[i].proc.returncode}: {err[-3000:]}")
    return outs


def test_finish_ends_the_other_launchers_as_soon_as_one_fails(tmp_path):
    stays = Launched([sys.executable, "-c", "import time; time.sleep(600)"], tmp_path / "stays")
    fails = Launched([sys.executable, "-c", "import sys; sys.exit('EADDRINUSE: address already in use')"],
                     tmp_path / "fails")
    with pytest.raises(PortTaken, match="launch 0 failed with code 1: EADDRINUSE"):
        _finish([fails, stays])
    assert stays.proc.returncode == -signal.SIGKILL


def test_a_killed_rank_restarts_from_the_checkpoint_and_the_run_equals_the_spawned_one(data, tmp_path):
    run_dir, ckpts, final = tmp_path / "run", tmp_path / "ckpt", tmp_path / "final.pt"
    # no --world-size: torchrun's 2 ranks; rank 1 dies in step 3, after the checkpoint of step 2
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
           "--monitor-interval", "0.1", KILLER, "1", "3", "train", "--model", "tiny", "--data", str(data),
           "--strategy-schedule", SCHEDULE, "--steps", "4", "--tokens-per-iter", "30",
           "--checkpoint-dir", str(ckpts), "--checkpoint-every", "2", "--run-dir", str(run_dir), "--no-plots",
           "--save-final", str(final), "--json", "--timeout", "120"]
    launched = Launched(cmd, tmp_path / "torchrun")
    # the reference runs while torchrun starts, waits and restarts
    ref, ref_records, ref_final = _reference(tmp_path, world_size=2, strategy_schedule=SCHEDULE, steps=4,
                                             tokens_per_iter=30, data=str(data))
    (stdout, stderr), = _finish([launched])
    reports = _json_lines(stdout)
    assert len(reports) == 1, stdout            # only rank 0 reports, and only the attempt that finished
    assert reports[0]["resumed_from"]["step"] == 2 and reports[0]["resumed_from"]["next_document"] == 7
    assert "restart 1 (TORCHELASTIC_RESTART_COUNT=1): resuming by itself" in stderr
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # steps 0-1 from the first attempt, 2-3 from the restart (step 2, trained after the checkpoint by
    # the first attempt, is rewritten); every document exactly once per epoch, in file order
    trained = [d for r in records for d in r["documents"]]
    assert [r["step"] for r in records] == [0, 1, 2, 3] and len(trained) > len(LENGTHS)
    assert trained == [i % len(LENGTHS) for i in range(len(trained))]

    assert [s["strategy"] for s in ref["steps"]] == ["1xTP2PP1", "2xTP1PP1", "1xTP1PP2", "1xTP2PP1"]
    _same_run(records, torch.load(final), ref_records, ref_final)


def _free_port():
    """A free port below the ephemeral range, so that no socket of the concurrent reference run (gloo
    binds ephemeral ports) takes it before torchrun's agent binds it."""
    ranges = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low = int(ranges.read_text().split()[0]) if ranges.exists() else 32768
    for port in random.Random().sample(range(max(1024, low - 12000), low), 64):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def _start_nodes(args, tmp_path, port):
    nodes = []
    for node in (0, 1):
        cwd = tmp_path / f"node{node}"          # the default run folder is relative: see who writes one
        cwd.mkdir(exist_ok=True)
        cmd = [*TORCHRUN, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(port), *args]
        nodes.append(Launched(cmd, tmp_path / f"launch{node}-{port}", cwd=cwd))
    return nodes


def test_two_torchrun_nodes_on_loopback_form_one_run_equal_to_the_spawned_one(data, tmp_path):
    final = tmp_path / "final.pt"
    args = ["-m", "hgraph.tools.cli", "train", "--model", "tiny", "--data", str(data), "--steps", "3",
            "--tokens-per-iter", "40", "--profile", "analytic", "--plan-ahead", "0", "--no-plots",
            "--save-final", str(final), "--json", "--timeout", "120"]
    # the first launch's master port is taken on purpose, as another process may take a probed port
    # before node 0's agent binds it: the launch must fail at once, not hang, and go again elsewhere
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", _free_port()))
        taken.listen()
        nodes = _start_nodes(args, tmp_path, taken.getsockname()[1])
        ref, ref_records, ref_final = _reference(tmp_path, world_size=4, gpus_per_node=2, steps=3,
                                                 tokens_per_iter=40, data=str(data), profile="analytic",
                                                 plan_ahead=0)
        with pytest.raises(PortTaken):
            _finish(nodes)
    outs = None
    for _ in range(3):
        try:
            outs = _finish(_start_nodes(args, tmp_path, _free_port()))
            break
        except PortTaken:
            continue
    assert outs is not None, "the master port was taken three times in a row"
    assert len(_json_lines(outs[0][0])) == 1 and _json_lines(outs[1][0]) == []   # global rank 0 reports
    assert not (tmp_path / "node1" / "runs").exists()         # node 1's local rank 0 writes no run folder
    run_dirs = list((tmp_path / "node0" / "runs").iterdir())
    assert len(run_dirs) == 1
    record = json.loads((run_dirs[0] / "run.json").read_text())
    assert (record["world_size"], record["gpus_per_node"]) == (4, 2)      # from the launcher
    records = [json.loads(line) for line in (run_dirs[0] / "metrics.jsonl").read_text().splitlines()]
    assert not any("TP4" in c for c in ref["candidates"])     # a TP group stays inside a node of 2
    _same_run(records, torch.load(final), ref_records, ref_final)
