"""Waits on peers in a launched run's rendezvous end at the timeout with an error naming the peer and
the phase: the store that cannot be reached (its address and who hosts it), the ranks that never
arrived at the process group (and their nodes). One process, a real TCP store on loopback."""
import socket
from datetime import timedelta

import pytest
import torch.distributed as dist

from hgraph.runtime.train.launcher_env import LauncherEnv
from hgraph.runtime.train.rendezvous import RendezvousTimeout, attempt_store, meet


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(rank, world_size, port, agent_store=True):
    return LauncherEnv("torchrun", world_size, rank, rank % 2, 2, rank // 2, "127.0.0.1", port,
                       agent_store=agent_store, host="nodeA")


def test_ranks_that_never_arrive_are_named_with_their_nodes():
    port = _free_port()
    host = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=10))          # torchrun's agent's store
    env = _env(1, 4, port)
    store = attempt_store(env, timeout_s=10)
    with pytest.raises(RendezvousTimeout, match=r"^rendezvous \(process group\): rank 1 on nodeA waited 0\.5 s "
                                                r"for rank\(s\) \[0, 2, 3\] \(node\(s\) \[0, 1\]\), which never "
                                                r"arrived$"):
        meet(store, env, timeout_s=0.5)
    # the ranks that arrive are not named; each attempt meets in its own namespace
    for rank in (0, 2):
        meet_env = _env(rank, 4, port)
        attempt_store(meet_env, timeout_s=10).set(f"arrived/process group/{rank}", "nodeA")
    with pytest.raises(RendezvousTimeout, match=r"for rank\(s\) \[3\] \(node\(s\) \[1\]\)"):
        meet(store, env, timeout_s=0.5)
    del host


def test_a_store_that_cannot_be_reached_is_named_with_its_host():
    port = _free_port()                  # nothing listens there
    with pytest.raises(RendezvousTimeout, match=rf"^rendezvous \(store\): rank 3 on nodeA could not reach the "
                                                rf"run's store on 127\.0\.0\.1:{port}, hosted by torchrun's agent "
                                                r"on node 0, within 0\.5 s"):
        attempt_store(_env(3, 4, port), timeout_s=0.5)
