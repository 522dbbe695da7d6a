"""One run per folder: a run holds its run folder and its checkpoint folder for its whole life.

Each folder gets a lock file (``LOCK_FILE``). The holder keeps an exclusive ``fcntl.flock`` on it
(released by the kernel however the holder ends, ``kill -9`` included) and writes into it a record:
its host, PID, start time, a heartbeat timestamp that a thread refreshes every ``refresh_s``, and the
identity of its launch (``run``, ``attempt``: a launcher's restart of the same run). The record is
for the filesystems where ``flock`` is node-local (Lustre's ``localflock``) or unsupported: a run on
another node still sees a live holder there.

Who holds a folder, as a starting run sees it:

* the ``flock`` is refused: a live holder (on this node, or anywhere where ``flock`` is global);
* else the record names a holder on this host: it is gone (it would hold the ``flock``), unless
  ``flock`` is unsupported here, when its PID must be alive and its heartbeat fresh;
* else (another host) it lives while its heartbeat is younger than the heartbeat timeout (the
  starting run's ``stale_after_s`` or the holder's own, whichever is longer; compared with this
  host's clock, so the hosts' clocks must agree to well within it, as NTP keeps them);
* an earlier attempt of the same launch (a launcher's restart, which starts only after that attempt
  ended) is taken over silently; any other holder that is gone is taken over with one warning.

A live holder refuses the run with ``FolderInUse``: one line naming the folder and the holder. The
record is rewritten in place (fixed length, one ``pwrite``), never replaced, so the ``flock`` and
the record stay on one file; a finished run empties it. A holder that finds the record no longer its
own (a run on another node took a folder over after this holder stopped beating, e.g. SIGSTOP) hands
the new holder to ``on_lost``: it must stop, or two runs write the folder.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable, Optional, Sequence

from hgraph.errors import HGraphError

#: The lock file inside a held folder.
LOCK_FILE = ".hgraph.lock"
#: The record's fixed length: written with one pwrite, so a reader sees the old record or the new one.
RECORD_BYTES = 1024
#: How often the holder's heartbeat is refreshed, as a fraction of the stale age (and at most).
REFRESH_FRACTION, MAX_REFRESH_S = 0.25, 10.0


class FolderInUse(HGraphError):
    """A folder the run needs is held by another live run (the message names both)."""


@dataclass(frozen=True)
class Holder:
    """Who holds a folder, as its lock file's record says."""

    host: str
    pid: int
    started: float             # time.time() when it took the folder
    heartbeat: float           # time.time() of its last beat
    run: str = ""              # its launch (a launcher's run id), "" for a local run
    attempt: int = 0           # the launcher's restart count
    timeout: float = 0.0       # its heartbeat timeout: it beats well within it

    def text(self, now: float) -> str:
        return f"PID {self.pid} on {self.host} (heartbeat {max(0.0, now - self.heartbeat):.1f} s ago)"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:          # someone else's process: alive
        return True
    return True


class FolderLock:
    """The lock of one folder (``what``: how messages name it, e.g. "checkpoint folder")."""

    def __init__(self, folder: os.PathLike, what: str) -> None:
        self.folder, self.what = Path(folder), what
        self.path = self.folder / LOCK_FILE
        self.fd: Optional[int] = None
        self.flocked = False
        self.record: Optional[Holder] = None

    def read(self) -> Optional[Holder]:
        """The holder the record names (None: free). A record being written reads as the old one or
        the new one; anything unreadable counts as free."""
        fd = self.fd if self.fd is not None else os.open(self.path, os.O_RDONLY)
        try:
            text = os.pread(fd, RECORD_BYTES, 0).decode("utf-8", "replace").strip()
        finally:
            if fd != self.fd:
                os.close(fd)
        if not text:
            return None
        try:
            record = json.loads(text)
            return Holder(**{f.name: record[f.name] for f in fields(Holder) if f.name in record})
        except (ValueError, TypeError, AttributeError):
            return None

    def acquire(self, stale_after_s: float, run: str = "", attempt: int = 0,
                warn: Optional[Callable[[str], None]] = None) -> None:
        """Take the folder or raise ``FolderInUse`` (see the module's docstring)."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise HGraphError(f"{self.what} {str(self.folder)!r} cannot be written ({exc.strerror or exc}: "
                              f"its lock file {self.path}); give a folder this run may write") from None
        try:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self.flocked = True
            except OSError as exc:          # else no flock on this filesystem: the record alone decides
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    self._refuse(self.read(), time.time())
            holder, now = self.read(), time.time()
            me = Holder(socket.gethostname(), os.getpid(), now, now, run, attempt, stale_after_s)
            if holder is not None and (holder.host, holder.pid) != (me.host, me.pid):
                # stale past either run's timeout: the holder beats well within its own
                fresh = now - holder.heartbeat <= max(stale_after_s, holder.timeout)
                if holder.host == me.host:
                    alive = not self.flocked and _pid_alive(holder.pid) and fresh
                else:
                    alive = fresh
                earlier_attempt = bool(run) and holder.run == run and holder.attempt < attempt
                if alive and not earlier_attempt:
                    self._refuse(holder, now)
                if not earlier_attempt and warn is not None:
                    timeout = max(stale_after_s, holder.timeout)
                    why = ("which ended without releasing it" if holder.host == me.host and not alive else
                           f"whose heartbeat stopped more than {timeout:g} s ago (the heartbeat timeout)")
                    warn(f"{self.what} {self.folder}: taking it over from the run of {holder.text(now)}, {why}")
            self._write(me)
        except BaseException:
            self.release()
            raise

    def _refuse(self, holder: Optional[Holder], now: float) -> None:
        who = holder.text(now) if holder is not None else "a process that is taking it now"
        raise FolderInUse(f"{self.what} {self.folder} is in use by another run: {who}, lock file "
                          f"{self.path}; wait for that run to end or choose another folder")

    def _write(self, holder: Optional[Holder]) -> None:
        text = json.dumps(asdict(holder)) if holder is not None else ""
        data = text.encode().ljust(RECORD_BYTES)
        if len(data) > RECORD_BYTES:
            raise HGraphError(f"{self.path}: the holder's record is longer than {RECORD_BYTES} bytes")
        os.pwrite(self.fd, data, 0)
        self.record = holder

    def beat(self) -> Optional[Holder]:
        """Refresh the heartbeat; returns the run that took the folder over instead (None: still ours)."""
        if self.fd is None or self.record is None:
            return None
        now_holder = self.read()
        if now_holder is not None and (now_holder.host, now_holder.pid, now_holder.started) != \
                (self.record.host, self.record.pid, self.record.started):
            return now_holder
        self._write(Holder(**{**asdict(self.record), "heartbeat": time.time()}))
        return None

    def release(self) -> None:
        """Empty the record (if ours) and let go of the file."""
        if self.fd is None:
            return
        try:
            if self.record is not None and self.beat() is None:
                self._write(None)
        except OSError:
            pass
        finally:
            if self.flocked:
                fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd, self.flocked, self.record = None, False, None


class RunLock:
    """The folders of one run, held from ``acquire`` (or ``with``) to ``release``: their locks and
    one thread that refreshes their heartbeats."""

    def __init__(self, folders: Sequence[tuple[str, os.PathLike]], stale_after_s: float, *, run: str = "",
                 attempt: int = 0, warn: Optional[Callable[[str], None]] = None,
                 on_lost: Optional[Callable[[str], None]] = None) -> None:
        seen, self.locks = set(), []
        for what, folder in folders:
            key = os.path.realpath(folder)
            if key not in seen:           # the same folder named twice is one lock
                seen.add(key)
                self.locks.append(FolderLock(folder, what))
        self.stale_after_s, self.run, self.attempt = stale_after_s, run, attempt
        self.warn, self.on_lost = warn, on_lost
        self.refresh_s = min(MAX_REFRESH_S, REFRESH_FRACTION * stale_after_s)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def acquire(self) -> "RunLock":
        taken = []
        try:
            for lock in self.locks:
                lock.acquire(self.stale_after_s, self.run, self.attempt, self.warn)
                taken.append(lock)
        except BaseException:
            for lock in taken:
                lock.release()
            raise
        self._thread = threading.Thread(target=self._refresh, name="hgraph-run-lock", daemon=True)
        self._thread.start()
        return self

    def _refresh(self) -> None:
        while not self._stop.wait(self.refresh_s):
            for lock in self.locks:
                try:
                    other = lock.beat()
                except OSError:            # the folder went away (a network filesystem): try again later
                    continue
                if other is not None:
                    if self.on_lost is not None:
                        self.on_lost(f"{lock.what} {lock.folder} was taken over by the run of "
                                     f"{other.text(time.time())}: this run stops")
                    return

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        for lock in self.locks:
            lock.release()

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
