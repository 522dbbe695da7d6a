"""The key-value store through which a launched run's ranks find each other, one namespace per attempt.

Under ``torchrun`` the store is a TCP store hosted by the launcher's agent on ``MASTER_ADDR:MASTER_PORT``
(``TORCHELASTIC_USE_AGENT_STORE``); the agent keeps the same store across the restarts of
``--max-restarts``. Every key the ranks write (gloo's addresses for ``connectFullMesh``, the
subgroups' keys, the heartbeats) is then still there when the restarted workers arrive, and a restarted
worker could read a dead worker's address and time out connecting to it. ``attempt_store`` prefixes
every key with the attempt (``hgraph/attempt-<restart count>/``), so each attempt starts from an empty
namespace. Without an agent (``srun``, a launcher that only sets the variables) rank 0 hosts the
store, as ``env://`` would.

Every wait on a peer has a timeout whose error names the peer and the phase (``RendezvousTimeout``):
reaching the store names its address and who hosts it; ``meet`` (every rank announces itself, then
waits for all, before the process group's full-mesh connect) names the ranks that never arrived and
their nodes.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

from hgraph.runtime.train.launcher_env import LauncherEnv


class RendezvousTimeout(RuntimeError):
    """A rank waited past the timeout for the run's store or for its peers (the message says which)."""


def attempt_prefix(env: LauncherEnv) -> str:
    """The namespace of this attempt's keys."""
    return f"hgraph/attempt-{env.restart_count}"        # PrefixStore adds the "/" before each key


def attempt_store(env: LauncherEnv, timeout_s: float) -> Any:
    """This attempt's view of the run's store; connecting waits up to ``timeout_s``."""
    return dist.PrefixStore(attempt_prefix(env), run_store(env, timeout_s))


def run_store(env: LauncherEnv, timeout_s: float) -> Any:
    """The run's store itself, shared by every attempt (what an attempt leaves for the next one)."""
    try:
        tcp = dist.TCPStore(env.master_addr, env.master_port, env.world_size,
                            is_master=not env.agent_store and env.rank == 0, timeout=timedelta(seconds=timeout_s),
                            multi_tenant=True)
    except RuntimeError as exc:         # DistNetworkError, DistStoreError: a connect or accept timed out
        host = "torchrun's agent on node 0" if env.agent_store else "rank 0"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RendezvousTimeout(f"rendezvous (store): {env.where()} could not reach the run's store on "
                                f"{env.master_addr}:{env.master_port}, hosted by {host}, within {timeout_s:g} s "
                                f"({first})") from exc
    return tcp


def meet(store: Any, env: LauncherEnv, timeout_s: float, phase: str = "process group") -> None:
    """Every rank announces its arrival at ``phase`` in ``store`` and waits up to ``timeout_s`` for all
    the others; a timeout names the ranks that never arrived and their nodes."""
    keys = [f"arrived/{phase}/{r}" for r in range(env.world_size)]
    store.set(keys[env.rank], env.host)
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except RuntimeError:
        missing = [r for r in range(env.world_size) if not store.check([keys[r]])]
        nodes = sorted({r // env.local_world_size for r in missing})
        raise RendezvousTimeout(f"rendezvous ({phase}): {env.where()} waited {timeout_s:g} s for rank(s) "
                                f"{missing} (node(s) {nodes}), which never arrived") from None
