"""A launched run's ranks agree on its folders (``runtime.train.run_folders``): rank 0 takes them and
every other rank learns its verdict through the launcher's store; a refused run ends on every rank
with the same line, said before any rank may exit, and without waiting out the rendezvous timeout; a
restart of a refused run (torchrun keeps its store) refuses at once without trying the lock again.
The ranks are threads of this process on a real TCP store on loopback, as torchrun's agent hosts it;
the first run's hold is a lock taken in this process (a flock is per open file: it refuses rank 0 as
another process's would). Last, the command itself as one rank of a refused torchrun run."""
import socket
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from hgraph.runtime.process.run_lock import LOCK_FILE, RunLock
from hgraph.runtime.train.launcher_env import LauncherEnv
from hgraph.runtime.train.run_folders import Refused, RunFolders
from hgraph.tools.cli import main

WORLD = 3
#: The rendezvous timeout: a refused run must end long before it.
TIMEOUT_S = 60.0


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(port, folder, restart=0, agent_store=True):
    """Every rank of one attempt calls ``hold`` on ``folder``; returns per rank (outcome, lines said,
    the lock it holds) and the seconds it took."""
    said, out = [[] for _ in range(WORLD)], [None] * WORLD

    def rank(r):
        env = LauncherEnv("torchrun" if agent_store else "slurm", WORLD, r, r, WORLD, 0, "127.0.0.1", port,
                          restart_count=restart, agent_store=agent_store, host="nodeA")
        folders = RunFolders(env, 60.0, TIMEOUT_S, say=said[r].append, warn=said[r].append, on_lost=said[r].append)
        try:
            folders.hold([("checkpoint folder", folder), ("run folder", None)], "start")
            out[r] = "held" if folders.held else "told"
        except Refused as exc:
            out[r] = f"refused: {exc}"
        finally:
            folders.close()

    start = time.monotonic()
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=2 * TIMEOUT_S)
    return out, said, time.monotonic() - start


@pytest.fixture()
def agent_store():
    port = _free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=TIMEOUT_S))       # torchrun's agent's, kept across restarts
    yield port, store


def test_rank_0_takes_the_folders_and_the_others_are_told(tmp_path, agent_store):
    port, _ = agent_store
    out, said, _ = _launch(port, tmp_path / "ck")
    assert out == ["held", "told", "told"] and said == [[], [], []]
    assert (tmp_path / "ck" / LOCK_FILE).read_text().strip() == ""      # released at the end


def test_under_srun_rank_0_hosts_the_store_and_a_refusal_still_reaches_every_rank(tmp_path):
    folder = tmp_path / "ck"
    with RunLock([("checkpoint folder", folder)], 60.0):
        out, said, took = _launch(_free_port(), folder, agent_store=False)
    line = out[0].removeprefix("refused: ")
    assert line.startswith(f"checkpoint folder {folder} is in use by another run: PID ")
    assert out == [f"refused: {line}"] * WORLD and said == [[line]] * WORLD and took < TIMEOUT_S / 4


def test_a_refused_run_ends_on_every_rank_with_the_same_line_and_its_restart_does_not_try_again(tmp_path,
                                                                                                 agent_store):
    port, store = agent_store
    folder = tmp_path / "ck"
    first = RunLock([("checkpoint folder", folder)], 60.0).acquire()        # the first run, alive
    try:
        out, said, took = _launch(port, folder)
        line = out[0].removeprefix("refused: ")
        assert line.startswith(f"checkpoint folder {folder} is in use by another run: PID ")
        assert out == [f"refused: {line}"] * WORLD and said == [[line]] * WORLD
        assert took < TIMEOUT_S / 4
        record = (folder / LOCK_FILE).read_text()
        first.release()                 # the folder is free now: a restart that tried again would take it
        out, said, _ = _launch(port, folder, restart=1)
        assert out == [f"refused: {line}"] * WORLD and said == [[line]] * WORLD
        assert (folder / LOCK_FILE).read_text().strip() == "" != record.strip()    # nobody took it
    finally:
        first.release()


def test_the_command_on_a_rank_of_a_refused_launched_run_says_the_line_alone_and_exits_2(tmp_path, agent_store,
                                                                                          monkeypatch, capsys):
    """``hgraph train`` as rank 1 of a torchrun run whose rank 0 was refused: rank 0's line, without
    the rank prefix other errors get (every rank says the same), exit code 2."""
    port, store = agent_store
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                        "TORCHELASTIC_USE_AGENT_STORE": "True"}.items():
        monkeypatch.setenv(name, value)
    line = f"checkpoint folder {tmp_path / 'ck'} is in use by another run: PID 4242 on node-b (heartbeat 1.0 s ago)"
    store.set("hgraph/attempt-0/folders/start", "refused " + line)      # what rank 0 published, and said
    store.set("hgraph/attempt-0/folders-said/start/0", "1")
    argv = ["train", "--model", "tiny", "--steps", "2", "--tokens-per-iter", "64", "--strategy-schedule", "2xTP1PP1",
            "--checkpoint-dir", str(tmp_path / "ck"), "--progress", "off"]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"hgraph train: error: {line}"]
    assert not (tmp_path / "ck").exists()           # rank 1 takes nothing and writes nothing
