"""The key-value store through which a launched run's ranks find each other, one namespace per attempt.

Under ``torchrun`` the store is a TCP store hosted by the launcher's agent on ``MASTER_ADDR:MASTER_PORT``
(``TORCHELASTIC_USE_AGENT_STORE``); the agent keeps the same store across the restarts of
``--max-restarts``. Every key the ranks write (gloo's addresses for ``connectFullMesh``, the
subgroups' keys, the heartbeats) is then still there when the restarted workers arrive, and a restarted
worker could read a dead worker's address and time out connecting to it. ``attempt_store`` prefixes
every key with the attempt (``hgraph/attempt-<restart count>/``), so each attempt starts from an empty
namespace. Without an agent (``srun``, a launcher that only sets the variables) rank 0 hosts the
store, as ``env://`` would.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

from hgraph.runtime.train.launcher_env import LauncherEnv


def attempt_prefix(env: LauncherEnv) -> str:
    """The namespace of this attempt's keys."""
    return f"hgraph/attempt-{env.restart_count}"        # PrefixStore adds the "/" before each key


def attempt_store(env: LauncherEnv, timeout_s: float) -> Any:
    """This attempt's view of the run's store (module docstring); connecting waits up to ``timeout_s``."""
    tcp = dist.TCPStore(env.master_addr, env.master_port, env.world_size,
                        is_master=not env.agent_store and env.rank == 0, timeout=timedelta(seconds=timeout_s),
                        multi_tenant=True)
    return dist.PrefixStore(attempt_prefix(env), tcp)
