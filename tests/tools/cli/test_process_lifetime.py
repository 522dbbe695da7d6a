"""Every process a run starts dies with it: ``hgraph train``'s launcher alone (as ``kill PID`` or a
scheduler does) sent SIGINT, SIGTERM or SIGKILL, mid-run or while its ranks start, leaves no rank,
planner, fork server or resource tracker behind (after SIGKILL within a second, with no step finished
and no checkpoint begun after the one in flight); SIGINT and SIGTERM end it with one line and exit
code 128 + the signal, and without a leaked-semaphore warning; with a checkpoint folder SIGTERM
first saves a checkpoint, and says where. A rank that stops answering (SIGSTOP) is named by rank and
host within the heartbeat timeout, and the run ends. A stopped run's log holds the step lines of the
steps it finished; while a run lives, a second run on its folders is refused (one run per folder).

Each test starts a small run (two ranks; planner-driven, with a planner process, or on a fixed
schedule) as a subprocess, records
the launcher's descendants from ``/proc`` (pid and start time, so a reused pid is not mistaken for a
survivor) before the signal, and waits for every one of them to be gone.
"""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.runtime.fault_injection import sigstop_worker
from tests.runtime.reference_training import write_random_documents

from hgraph.runtime.checkpoint.manifest import complete_steps
from hgraph.runtime.process.run_lock import RunLock
from hgraph.runtime.train.config import TrainConfig
from hgraph.runtime.train.launch import SpawnError, spawn
from hgraph.tools import cli
from hgraph.tools.cli import main

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process tree in /proc")

#: A run of many steps, so that it is still training when the signal comes.
TRAIN = [sys.executable, "-m", "hgraph.tools.cli", "train", "--model", "tiny", "--world-size", "2", "--steps",
         "500", "--tokens-per-iter", "64", "--strategies", "2xTP1PP1;1xTP2PP1", "--profile", "analytic",
         "--plan-ahead", "1", "--progress", "off", "--no-plots", "--timeout", "60"]
#: The same run on a fixed schedule: no planner, and its step lines printed by the ranks' code as well.
FIXED = [*TRAIN[:TRAIN.index("--strategies")], "--strategy-schedule", "2xTP1PP1;1xTP2PP1",
         *TRAIN[TRAIN.index("--progress"):]]
#: The launcher's descendants: the fork server, the resource tracker, two ranks and the planner.
DESCENDANTS = 5
#: Bound on waiting for a run to reach a point, or for its processes to end (a hang fails, not waits).
PATIENCE_S = 120
#: "Within a few seconds": the processes of a run killed by a signal end within this.
GONE_WITHIN_S = 20
#: After SIGKILL of its launcher (or torchrun's agent) every process of a run is gone within this:
#: nothing there runs any code of its own, the kernel's parent-death signals end them.
KILLED_GONE_WITHIN_S = 1.0


def _stat(pid):
    """(parent pid, state, start time) of ``pid``, or None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return int(fields[1]), fields[0], int(fields[19])


def _descendants(root):
    """{pid: start time} of every live descendant of ``root``."""
    children = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = _stat(int(name))
            if stat is not None and stat[1] != "Z":
                children.setdefault(stat[0], []).append((int(name), stat[2]))
    found, todo = {}, [root]
    while todo:
        for pid, start in children.get(todo.pop(), []):
            found[pid] = start
            todo.append(pid)
    return found


def _alive(procs):
    """The processes of ``procs`` ({pid: start time}) still running (a zombie has ended)."""
    out = []
    for pid, start in procs.items():
        stat = _stat(pid)
        if stat is not None and stat[2] == start and stat[1] != "Z":
            out.append(pid)
    return out


def _command_line(pid):
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:160]
    except OSError:
        return "?"


class Run:
    """``hgraph train`` in a subprocess of its own session, its output in files."""

    def __init__(self, tmp_path, *extra, command=TRAIN):
        self.out, self.err = tmp_path / "stdout", tmp_path / "stderr"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.run_dir = tmp_path / "run"
            self.proc = subprocess.Popen([*command, "--run-dir", str(self.run_dir), *extra], stdout=out,
                                         stderr=err, start_new_session=True)
        self.seen = {}

    def wait_for(self, ready):
        """Polls until ``ready(stdout text, descendants)``, recording every descendant seen."""
        deadline = time.monotonic() + PATIENCE_S
        while time.monotonic() < deadline:
            self.seen.update(_descendants(self.proc.pid))
            if ready(self.out.read_text(), self.seen):
                return
            assert self.proc.poll() is None, f"the run ended early: {self.err.read_text()[-2000:]}"
            time.sleep(0.05)
        raise AssertionError(f"the run did not get there in {PATIENCE_S} s: {self.out.read_text()[-2000:]}")

    def kill(self, signum, within=GONE_WITHIN_S):
        """Sends ``signum`` to the launcher alone (as `kill PID`); every process seen must be gone
        ``within`` seconds of it. Returns the launcher's exit code and stderr."""
        self.seen.update(_descendants(self.proc.pid))
        os.kill(self.proc.pid, signum)
        deadline = time.monotonic() + within
        rc = self.proc.wait(timeout=PATIENCE_S)
        while _alive(self.seen) and time.monotonic() < deadline:
            time.sleep(0.02)
        left = _alive(self.seen)
        for pid in left:                        # never leave them to the next test
            os.kill(pid, signal.SIGKILL)
        assert not left, f"alive {within:g} s after {signal.Signals(signum).name}: " + \
            "; ".join(f"{pid} {_command_line(pid)}" for pid in left)
        return rc, self.err.read_text()


def _training(out, seen):
    return "step    1" in out and len(seen) >= DESCENDANTS


def _last_step(out):
    """The last step line's step (-1: none yet)."""
    return max((int(m) for m in re.findall(r"^step +(\d+) ", out, re.M)), default=-1)


def _saved_steps(folder):
    """The steps of every checkpoint folder begun under ``folder``, complete or not."""
    return sorted(int(p.name.split("-")[1]) for p in folder.glob("step-*")) if folder.is_dir() else []


def _assert_stopped_at(run, k, ck):
    """Nothing of the run went on after the kill at step line ``k``: at most the step then in flight
    (k + 1) finished, and no checkpoint after it was begun."""
    out = run.out.read_text()
    assert _last_step(out) <= k + 1, f"killed after step {k}, trained on: {out[-800:]}"
    assert all(s <= k + 2 for s in _saved_steps(ck)), f"killed after step {k}: checkpoints {_saved_steps(ck)}"


def _metrics_steps(run):
    path = run.run_dir / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize("signum, command, processes", [(signal.SIGINT, TRAIN, DESCENDANTS),
                                                        (signal.SIGTERM, FIXED, DESCENDANTS - 1)],
                         ids=["SIGINT-planner", "SIGTERM-schedule"])
def test_sigint_or_sigterm_of_the_launcher_ends_every_process_with_one_line_after_its_step_lines(
        tmp_path, signum, command, processes):
    """Also: the step lines, stdout a file, were written as the steps finished, so the stopped run's
    log holds every step of its metrics (the last may have been cut between the two), with a fixed
    schedule too (whose lines used to be printed only at the end of the run, so none were)."""
    run = Run(tmp_path, command=command)
    run.wait_for(lambda out, seen: len(_metrics_steps(run)) >= 3 and len(seen) >= processes)
    rc, err = run.kill(signum)
    name = signal.Signals(signum).name
    assert rc == 128 + signum, err
    assert err.strip().splitlines()[-1] == f"hgraph train: stopped by {name}", err
    assert "leaked" not in err and "Traceback" not in err, err
    done = _metrics_steps(run)
    printed = [int(k) for k in re.findall(r"^step +(\d+) ", run.out.read_text(), re.M)]
    assert printed == list(range(len(printed))) and len(printed) >= max(3, len(done) - 1), (printed, done)


def test_sigterm_of_the_launcher_with_a_checkpoint_folder_saves_says_where_and_ends_every_process(tmp_path, capsys,
                                                                                                    monkeypatch):
    """Also one run per folder: while it trains, a second run on its checkpoint folder, and one on its
    run folder, are each refused with one line naming it (exit 2), before starting any process, and
    it goes on untouched; once it has ended, its folders are free again."""
    # the refused runs run here; their ranks' fork server, started first by design, is not what is tested
    monkeypatch.setattr(cli, "start_early", lambda argv: None)
    ck = tmp_path / "ck"
    run = Run(tmp_path, "--checkpoint-dir", str(ck))      # saves only at the end, or on SIGTERM
    run.wait_for(_training)
    for where, folders in [("checkpoint folder", ["--run-dir", str(tmp_path / "other-run"), "--checkpoint-dir", str(ck)]),
                           ("run folder", ["--run-dir", str(run.run_dir)])]:
        before = set(_descendants(os.getpid()))      # a fork server an earlier test left is not this one's
        assert main([*TRAIN[3:], *folders, "--steps", "2"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"hgraph train: error: {where} ") and \
            f"is in use by another run: PID {run.proc.pid} on {socket.gethostname()} (heartbeat " in err[0], err
        started = set(_descendants(os.getpid())) - before - set(_descendants(run.proc.pid)) - {run.proc.pid}
        assert not started, [_command_line(p) for p in started]        # no rank, no planner
    assert not (tmp_path / "other-run").exists()               # refused before it wrote anything
    last = _last_step(run.out.read_text())
    run.wait_for(lambda out, seen: _last_step(out) > last)      # the first run trains on
    rc, err = run.kill(signal.SIGTERM)                    # passed on to the ranks, which agree on a step
    assert rc == 143, err
    said = re.fullmatch(r"hgraph train: stopped by SIGTERM after step (\d+) of 500; checkpoint (\S+) saved; "
                        r"--resume continues from it", err.strip().splitlines()[-1])
    assert said, err
    assert complete_steps(ck) == [int(said[1])] and Path(said[2]) == ck / f"step-{int(said[1]):08d}"
    assert "leaked" not in err and "Traceback" not in err, err
    assert [json.loads(line)["step"] for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()] == \
        list(range(int(said[1])))
    warned = []                                                # released: the next run takes them silently
    RunLock([("checkpoint folder", ck), ("run folder", run.run_dir)], 60, warn=warned.append).acquire().release()
    assert warned == []


def test_sigkill_of_the_launcher_while_its_ranks_start_leaves_no_process(tmp_path):
    run = Run(tmp_path)
    # as soon as the ranks and the planner exist (still starting: the race a parent-death signal
    # armed late would lose); mid-run the same ties hold, and SIGINT and SIGTERM above are mid-run
    run.wait_for(lambda out, seen: len(seen) >= DESCENDANTS)
    rc, _ = run.kill(signal.SIGKILL)
    assert rc == -signal.SIGKILL



def test_sigkill_of_the_launcher_mid_run_stops_training_and_saving_at_once(tmp_path):
    """Killed at step k with a checkpoint after every step: no step after k + 1, no checkpoint begun
    after it, and every process of the run gone within a second (the fork server used to run its
    interpreter's teardown first, for seconds, while the ranks it takes along trained and saved on)."""
    ck = tmp_path / "ck"
    run = Run(tmp_path, "--checkpoint-dir", str(ck), "--checkpoint-every", "1")
    run.wait_for(lambda out, seen: _last_step(out) >= 2 and len(seen) >= DESCENDANTS)
    k = _last_step(run.out.read_text())
    rc, _ = run.kill(signal.SIGKILL, within=KILLED_GONE_WITHIN_S)
    assert rc == -signal.SIGKILL
    _assert_stopped_at(run, k, ck)


def test_a_rank_that_stops_answering_mid_step_is_named_by_rank_and_host_and_the_run_ends(tmp_path):
    """Rank 1 is SIGSTOPped in step 2 (alive, its sockets open: rank 0's collective would wait for it
    until the collective timeout): rank 0's heartbeat names it within the heartbeat timeout, and the
    run ends with that message instead of the timeout's."""
    data = write_random_documents(tmp_path / "docs.jsonl", [9, 7, 11, 5, 8, 6, 10, 4] * 3, seed=3)
    config = TrainConfig.from_values(model="tiny", world_size=2, strategy_schedule="2xTP1PP1", steps=6,
                                     tokens_per_iter=30, data=str(data), heartbeat_timeout=3.0, timeout=300)
    with pytest.raises(SpawnError) as info:
        spawn(sigstop_worker, 2, args=(config, 1, 2), timeout_s=300)
    assert info.value.rank == 1
    assert re.fullmatch(rf"spawn: rank 1 on {re.escape(socket.gethostname())} \(no heartbeat for [\d.]+ s\) "
                        r"stopped answering \(heartbeat timeout 3 s: stopped or frozen, e.g. SIGSTOP\); "
                        r"rank 0 ends the run", str(info.value)), str(info.value)


def test_sigkill_of_a_torchrun_agent_leaves_no_worker_or_planner(tmp_path):
    """torchrun's workers run in sessions of their own and a SIGKILLed agent signals none of them: each
    dies with its agent, and rank 0's planner process with rank 0."""
    world = TRAIN.index("--world-size")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "--monitor-interval", "0.1", "-m", "hgraph.tools.cli", *TRAIN[3:world], *TRAIN[world + 2:]]
    ck = tmp_path / "ck"
    run = Run(tmp_path, "--checkpoint-dir", str(ck), "--checkpoint-every", "1", command=command)
    # the 2 workers and rank 0's planner have started, and train
    run.wait_for(lambda out, seen: _last_step(out) >= 1 and len(seen) >= 3)
    k = _last_step(run.out.read_text())
    rc, _ = run.kill(signal.SIGKILL, within=KILLED_GONE_WITHIN_S)
    assert rc == -signal.SIGKILL
    _assert_stopped_at(run, k, ck)
