"""spawn / init_from_env: results in rank order, failures named by rank, no hangs (gloo, CPU)."""
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from hgraph.errors import HGraphError
from hgraph.runtime.train.launch import FAILURE_GRACE_S, SpawnError, init_from_env, spawn


def _sum_of_ranks(rank, world_size, scale):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return {"rank": rank, "world": dist.get_world_size(), "backend": dist.get_backend(),
            "sum": t.item() * scale, "tensor": torch.full((2,), float(rank)),
            "env": os.environ.get("HGRAPH_TEST_MARK")}


def _rank1_raises(rank, world_size):
    if rank == 2:  # looks like the echo of a lost peer: must not be reported as the cause
        raise RuntimeError("Connection closed by peer [127.0.0.1]:1")
    if rank == 1:
        # later than the echo's grace period: as under load, when the echo arrives seconds first
        time.sleep(FAILURE_GRACE_S + 0.5)
        raise ValueError("bad shard on purpose")
    t = torch.ones(1)
    dist.all_reduce(t)  # blocks: rank 1 never joins, so the parent must end this rank
    return t.item()


def _rank1_killed(rank, world_size):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)
    return rank


def _slow_exit_handler(rank, world_size, folder):
    import multiprocessing.util

    def finish():      # like a multiprocessing lock's finalizer (unlink + unregister), only slower
        time.sleep(0.5)
        open(os.path.join(folder, f"exited-{rank}"), "w").close()
    multiprocessing.util.Finalize(None, finish, exitpriority=0)
    return rank


@pytest.mark.parametrize("start_method, n", [("spawn", 2), ("forkserver", 3)])
def test_results_come_back_in_rank_order(start_method, n, monkeypatch):
    monkeypatch.setenv("HGRAPH_TEST_MARK", start_method)  # children see the caller's environment
    out = spawn(_sum_of_ranks, n, args=(10.0,), start_method=start_method)
    assert [o["env"] for o in out] == [start_method] * n
    assert [o["rank"] for o in out] == list(range(n))
    assert all(o["world"] == n and o["backend"] == "gloo" for o in out)
    assert [o["sum"] for o in out] == [10.0 * n * (n - 1) / 2] * n
    assert torch.equal(out[-1]["tensor"], torch.full((2,), float(n - 1)))


def test_ranks_that_reported_run_their_exit_handlers(tmp_path):
    # terminating a rank inside its finalizers leaves named semaphores behind (the resource
    # tracker's "leaked semaphore" warning at the end of a run)
    assert spawn(_slow_exit_handler, 2, args=(str(tmp_path),)) == [0, 1]
    assert sorted(os.listdir(tmp_path)) == ["exited-0", "exited-1"]


def test_a_raising_rank_is_named_and_others_are_ended():
    # rank 0 blocks in a collective: "failed too" says it was ended, not waited on until the timeout
    with pytest.raises(SpawnError, match=r"rank 1 failed: ValueError: bad shard on purpose") as info:
        spawn(_rank1_raises, 3, timeout_s=300)
    assert "rank(s) [0, 2] failed too" in str(info.value) or "rank(s) [2] failed too" in str(info.value)
    assert info.value.rank == 1 and "Traceback" in info.value.detail


def test_a_killed_rank_is_reported_as_lost():
    # rank 0 sleeps for 600 s: waited on, it would end in spawn's timeout error, which names no rank
    with pytest.raises(SpawnError, match=r"rank 1 was lost") as info:
        spawn(_rank1_killed, 2, timeout_s=300)
    assert info.value.rank == 1


def test_bad_arguments_are_one_line_errors():
    with pytest.raises(HGraphError, match="module-level"):
        spawn(lambda r, w: r, 2)
    with pytest.raises(HGraphError, match="backend"):
        spawn(_sum_of_ranks, 2, backend="mpi")
    with pytest.raises(HGraphError, match="world_size"):
        spawn(_sum_of_ranks, 0)


def test_local_backend_takes_nccl_only_with_a_gpu_per_process(monkeypatch):
    from hgraph.runtime.train.launch import local_backend
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert local_backend("auto", 2) == "nccl"
    assert local_backend("auto", 4) == "gloo"          # not enough GPUs: CPU processes
    assert local_backend("gloo", 2) == "gloo"
    with pytest.raises(HGraphError, match="needs one GPU per process: 4 processes, 2 GPUs"):
        local_backend("nccl", 4)


def test_init_from_env_names_missing_variables(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(HGraphError, match="RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT"):
        init_from_env()


def test_init_from_env_initialises_a_torchrun_style_process(monkeypatch):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert not dist.is_initialized()
    try:
        assert init_from_env(backend="gloo") == (0, 1)
        t = torch.tensor([3.0])
        dist.all_reduce(t)
        assert t.item() == 3.0 and dist.get_backend() == "gloo"
        assert init_from_env() == (0, 1)  # already initialised: no second group
    finally:
        dist.destroy_process_group()


def _rank1_exits_during_a_collective(rank, world_size):
    if rank == 1:
        time.sleep(0.5)
        os._exit(17)              # no report: rank 0's all_reduce fails with "Connection closed by peer"
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def test_a_rank_that_dies_is_named_even_when_a_peer_reports_losing_it_first():
    with pytest.raises(SpawnError, match=r"rank 1 was lost") as info:
        spawn(_rank1_exits_during_a_collective, 2, timeout_s=300)
    assert info.value.rank == 1
