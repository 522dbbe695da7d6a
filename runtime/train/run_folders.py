"""One run per folder: ``hgraph train`` holds its run and checkpoint folders for its whole life, and
every rank of a launched run learns whether it got them.

The locks themselves are ``hgraph.runtime.process.run_lock`` (``flock`` and a heartbeat record).
A local run: the launching process takes them before it reads a checkpoint, writes into the run folder
or starts any process, and holds them to its end; its ranks, planner and fork server die with it
(``hgraph.runtime.process.lifetime``), so its holding them is enough.

Under torchrun or SLURM every rank runs the command, and global rank 0 alone takes the locks, before
the rendezvous (the run folder is its to write; the checkpoint folder, which every rank writes, is
shared by all nodes). It publishes its verdict in this attempt's namespace of the launcher's store,
where every other rank waits for it (up to the rendezvous timeout, as it would for rank 0 anyway). A
refused run ends on every rank with the same line on stderr and exit code 2: each rank says the line,
then marks it said, and none exits before all have (torchrun's agent stops the remaining workers
the moment one exits). Rank 0 also leaves the line in the run's store outside the attempts: a restart
of the refused run (torchrun keeps its store across ``--max-restarts``) says it again at once and
exits, without trying the locks again. A restart of a run that held the folders (its earlier attempt
has ended) takes them over silently (``launch_identity``).
"""
from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch.distributed as dist

from hgraph.errors import HGraphError
from hgraph.runtime.process.run_lock import FolderInUse, RunLock
from hgraph.runtime.train.launcher_env import LauncherEnv
from hgraph.runtime.train.rendezvous import RendezvousTimeout, attempt_prefix, run_store

#: The key, outside the attempts' namespaces, where a refused run leaves its line for its restarts.
REFUSED_KEY = "hgraph/folders-refused"


class Refused(FolderInUse):
    """The run was refused its folders and this rank has said so already (exit 2, nothing more to print)."""


def launch_identity(env: Optional[LauncherEnv]) -> str:
    """The launch a rank belongs to: the same for every restart of one torchrun (its run id and store),
    different for a SLURM requeue (whose earlier instance may still run on another node); "" locally."""
    if env is None:
        return ""
    if env.launcher == "torchrun":
        return (f"torchrun:{os.environ.get('TORCHELASTIC_RUN_ID', '')}@{env.master_addr}:{env.master_port}"
                f"/requeue-{env.requeue_count}")
    return f"slurm:{os.environ.get('SLURM_JOB_ID', '')}.{os.environ.get('SLURM_STEP_ID', '')}/requeue-{env.restart_count}"


class RunFolders:
    """The folders this run holds, released on ``close`` (a context manager). ``hold`` takes more of
    them; a folder held already is not taken twice.

    ``say``: how a refused rank says the refusal (a launched run: before the others may exit);
    ``warn``: a folder taken over from a run that is gone; ``on_lost``: a folder taken over by another
    run while this one held it (this run must stop)."""

    def __init__(self, env: Optional[LauncherEnv], stale_after_s: float, timeout_s: float, *,
                 say: Callable[[str], None], warn: Callable[[str], None], on_lost: Callable[[str], None]) -> None:
        self.env, self.stale_after_s, self.timeout_s = env, stale_after_s, timeout_s
        self.say, self.warn, self.on_lost = say, warn, on_lost
        self.held: list[RunLock] = []
        self._paths: set[str] = set()
        self._stores: Optional[tuple[Any, Any]] = None

    def hold(self, folders: Sequence[tuple[str, Optional[os.PathLike]]], phase: str) -> None:
        """Take ``folders`` ((what, path); None paths skipped). Locally: here, or ``FolderInUse``.
        Launched: every rank calls this at the same point with the same ``phase``; rank 0 takes them
        and the others learn the verdict (``Refused`` on every rank of a refused run)."""
        wanted = [(what, Path(p)) for what, p in folders
                  if p is not None and os.path.realpath(p) not in self._paths]
        if self.env is None:
            self._take(wanted)
            return
        raw, store = self._launch_stores()
        said = raw.check([REFUSED_KEY]) and raw.get(REFUSED_KEY).decode()
        if said:                      # a restart of a refused run: no second try
            self._refuse(store, said, phase)
        key = f"folders/{phase}"
        if self.env.rank == 0:
            try:
                self._take(wanted)
            except HGraphError as exc:         # held by another run, or cannot be written
                raw.set(REFUSED_KEY, str(exc))
                store.set(key, "refused " + str(exc))
                self._refuse(store, str(exc), phase)
            store.set(key, "held")
            return
        try:
            store.wait([key], timedelta(seconds=self.timeout_s))
        except RuntimeError:
            raise RendezvousTimeout(f"rendezvous (folders, {phase}): {self.env.where()} waited "
                                    f"{self.timeout_s:g} s for rank 0 to take the run's folders") from None
        verdict = store.get(key).decode()
        if verdict.startswith("refused "):
            self._refuse(store, verdict.removeprefix("refused "), phase)

    def _take(self, folders: list[tuple[str, Path]]) -> None:
        if not folders:
            return
        lock = RunLock(folders, self.stale_after_s, run=launch_identity(self.env),
                       attempt=self.env.restart_count if self.env is not None else 0,
                       warn=self.warn, on_lost=self.on_lost).acquire()
        self.held.append(lock)
        self._paths.update(os.path.realpath(p) for _, p in folders)

    def _launch_stores(self) -> tuple[Any, Any]:
        if self._stores is None:
            raw = run_store(self.env, self.timeout_s)
            self._stores = raw, dist.PrefixStore(attempt_prefix(self.env), raw)
        return self._stores

    def _refuse(self, store: Any, line: str, phase: str) -> None:
        """Say ``line``, wait until every rank has said it (so none is stopped before), raise ``Refused``."""
        self.say(line)
        keys = [f"folders-said/{phase}/{r}" for r in range(self.env.world_size)]
        store.set(keys[self.env.rank], "1")
        try:
            store.wait(keys, timedelta(seconds=self.timeout_s))
        except RuntimeError:          # a rank that never came, or the store's host has gone: nothing to wait for
            pass
        raise Refused(line)

    def close(self) -> None:
        for lock in reversed(self.held):
            lock.release()
        self.held.clear()
        self._paths.clear()

    def __enter__(self) -> "RunFolders":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
