"""One run per folder (``runtime.process.run_lock``): a held folder refuses another holder with one line
naming it; a holder that is gone (its flock released on this host, or its heartbeat older than the
timeout on another) is taken over with one warning; a released folder is free again; the heartbeat is
refreshed while held, and a holder whose folder was taken over is told. Another holder is another
process here (a flock is per open file, so a second open in this process is refused just the same), or
a record written as another node's run would write it (flock there being node-local)."""
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from hgraph.errors import HGraphError
from hgraph.runtime.process.run_lock import LOCK_FILE, RECORD_BYTES, FolderInUse, FolderLock, RunLock

STALE_S = 60.0


def _record(folder, **fields):
    """Writes a holder's record as a run elsewhere would (no flock: another node's is not seen here)."""
    holder = {"host": "node-b", "pid": 4242, "started": time.time() - 5, "heartbeat": time.time(), "run": "",
              "attempt": 0, **fields}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / LOCK_FILE).write_text(json.dumps(holder).ljust(RECORD_BYTES))


def test_a_held_folder_refuses_a_second_holder_with_one_line_and_is_free_once_released(tmp_path):
    folder = tmp_path / "ck"
    first = RunLock([("checkpoint folder", folder), ("run folder", tmp_path / "run")], STALE_S).acquire()
    record = json.loads((folder / LOCK_FILE).read_text())
    assert (record["host"], record["pid"]) == (socket.gethostname(), os.getpid())
    with pytest.raises(FolderInUse) as info:
        RunLock([("checkpoint folder", folder)], STALE_S).acquire()
    line = str(info.value)
    assert "\n" not in line
    assert line.startswith(f"checkpoint folder {folder} is in use by another run: PID {os.getpid()} on "
                           f"{socket.gethostname()} (heartbeat ")
    # the refused one took nothing: the run folder, which it did not ask for, is still the first's
    with pytest.raises(FolderInUse, match="run folder"):
        RunLock([("run folder", tmp_path / "run")], STALE_S).acquire()
    first.release()
    assert (folder / LOCK_FILE).read_text().strip() == ""
    warned = []
    with RunLock([("checkpoint folder", folder)], STALE_S, warn=warned.append):
        pass
    assert warned == []                    # released cleanly: the next run takes it without a word


def test_a_live_holder_in_another_process_refuses_and_its_death_frees_the_folder(tmp_path):
    folder = tmp_path / "run"
    code = ("import sys, time; from hgraph.runtime.process.run_lock import RunLock; "
            f"RunLock([('run folder', {str(folder)!r})], 60).acquire(); print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(FolderInUse, match=rf"PID {holder.pid} on "):
            FolderLock(folder, "run folder").acquire(STALE_S)
    finally:
        holder.kill()
        holder.wait()
    # killed: the kernel released its flock; its record names a dead process of this host
    warned = []
    lock = RunLock([("run folder", folder)], STALE_S, warn=warned.append).acquire()
    lock.release()
    assert len(warned) == 1 and f"the run of PID {holder.pid} on" in warned[0] and "ended without releasing" in \
        warned[0]


def test_a_fresh_heartbeat_of_another_node_refuses_even_when_flock_is_free(tmp_path):
    folder = tmp_path / "ck"
    _record(folder, heartbeat=time.time() - 10)
    with pytest.raises(FolderInUse, match=r"in use by another run: PID 4242 on node-b \(heartbeat 1\d\.\d s ago\)"):
        RunLock([("checkpoint folder", folder)], STALE_S).acquire()


def test_a_stale_heartbeat_is_taken_over_with_one_warning(tmp_path):
    folder = tmp_path / "ck"
    _record(folder, heartbeat=time.time() - 2 * STALE_S)
    warned = []
    with RunLock([("checkpoint folder", folder)], STALE_S, warn=warned.append):
        assert json.loads((folder / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert len(warned) == 1, warned
    assert warned[0].startswith(f"checkpoint folder {folder}: taking it over from the run of PID 4242 on node-b")
    assert f"heartbeat stopped more than {STALE_S:g} s ago" in warned[0]


def test_the_holders_own_longer_timeout_keeps_it_fresh_and_a_folder_that_cannot_be_written_is_one_line(tmp_path):
    folder = tmp_path / "ck"
    _record(folder, heartbeat=time.time() - 2 * STALE_S, timeout=4 * STALE_S)   # beats every STALE_S
    with pytest.raises(FolderInUse, match="PID 4242 on node-b"):
        RunLock([("checkpoint folder", folder)], STALE_S).acquire()
    (tmp_path / "a-file").write_text("")
    with pytest.raises(HGraphError, match=r"^run folder '\S+a-file/run' cannot be written \(.+: its lock file \S+\); "
                                          r"give a folder this run may write$"):
        RunLock([("run folder", tmp_path / "a-file" / "run")], STALE_S).acquire()


def test_an_earlier_attempt_of_the_same_launch_is_taken_over_silently(tmp_path):
    folder = tmp_path / "ck"
    _record(folder, run="torchrun:abc", attempt=0)            # fresh, on another node
    warned = []
    with RunLock([("checkpoint folder", folder)], STALE_S, run="torchrun:abc", attempt=1, warn=warned.append):
        pass
    assert warned == []
    _record(folder, run="torchrun:abc", attempt=1)            # not an earlier attempt: refused
    with pytest.raises(FolderInUse):
        RunLock([("checkpoint folder", folder)], STALE_S, run="torchrun:abc", attempt=1).acquire()


def test_the_heartbeat_is_refreshed_and_a_holder_taken_over_is_told(tmp_path):
    folder = tmp_path / "run"
    lost = []
    lock = RunLock([("run folder", folder)], stale_after_s=0.4, on_lost=lost.append).acquire()
    try:
        first = json.loads((folder / LOCK_FILE).read_text())["heartbeat"]
        time.sleep(0.5)
        assert json.loads((folder / LOCK_FILE).read_text())["heartbeat"] > first
        _record(folder)                 # a run on another node took it over (this one seemed silent)
        deadline = time.monotonic() + 5
        while not lost and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lost == [f"run folder {folder} was taken over by the run of PID 4242 on node-b (heartbeat "
                        + lost[0].split("(heartbeat ")[1]] and lost[0].endswith(": this run stops")
    finally:
        lock.release()
    assert json.loads((folder / LOCK_FILE).read_text())["pid"] == 4242      # the new holder's record stays
