"""The launcher's environment (torchrun, SLURM) read into one ``LauncherEnv``, and ``hgraph train``'s
cluster options taken from it: pure parsing, no process is started."""
import re
import socket

import pytest

from hgraph.errors import HGraphError
from hgraph.runtime.train.launcher_env import (FLIGHT_RECORDER_ENTRIES, LAUNCHER_TIMEOUT_S, LOCAL_TIMEOUT_S,
                                               SLURM_PORT_BASE, LauncherEnv, default_timeout, first_host,
                                               flight_recorder_env, launcher_cluster, read_launcher_env,
                                               tasks_per_node)
from hgraph.runtime.train.rendezvous import attempt_prefix
from hgraph.tools.cli import build_parser, main
from hgraph.tools.cli.train import config_from_args

TORCHRUN = {"WORLD_SIZE": "8", "RANK": "5", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
            "MASTER_ADDR": "node01", "MASTER_PORT": "29400", "TORCHELASTIC_RESTART_COUNT": "2",
            "TORCHELASTIC_USE_AGENT_STORE": "True"}
SLURM = {"SLURM_NTASKS": "8", "SLURM_PROCID": "6", "SLURM_LOCALID": "2", "SLURM_NODEID": "1",
         "SLURM_NTASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "123456",
         "SLURMD_NODENAME": "gpu08"}
LAUNCH_VARS = sorted({*TORCHRUN, *SLURM, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
                      "SLURM_NODELIST", "SLURM_RESTART_COUNT"})


def test_no_launcher_is_none():
    assert read_launcher_env({}) is None
    assert read_launcher_env({"SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) is None   # one task: spawn locally
    assert read_launcher_env({"PATH": "/bin"}) is None
    assert read_launcher_env({"WORLD_SIZE": "1"}) is None        # one of torchrun's alone: spawn, as before


def test_torchrun_variables():
    env = read_launcher_env(TORCHRUN, host="h1")
    assert env == LauncherEnv("torchrun", 8, 5, 1, 4, 1, "node01", 29400, 2, True, "h1", env.names)
    assert env.is_restart and env.where() == "rank 5 on h1"
    assert env.source("world_size") == "WORLD_SIZE=8"
    assert env.source("local_world_size") == "LOCAL_WORLD_SIZE=4"
    assert attempt_prefix(env) == "hgraph/attempt-2"


def test_torchrun_without_the_local_variables_is_one_node():
    env = read_launcher_env({"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1",
                             "MASTER_PORT": "1234"})
    assert (env.local_world_size, env.local_rank, env.node_rank, env.restart_count) == (2, 1, 0, 0)
    assert not env.agent_store and not env.is_restart


def test_torchrun_wins_over_slurm():
    env = read_launcher_env({**SLURM, **TORCHRUN})
    assert env.launcher == "torchrun" and env.world_size == 8 and env.rank == 5


@pytest.mark.parametrize("change, message", [
    ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two': expected an integer >= 1"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0': expected an integer >= 1"),
    ({"RANK": "-1"}, "RANK='-1': expected an integer >= 0"),
    ({"RANK": "8"}, "RANK=8 is not below WORLD_SIZE=8"),
    ({"LOCAL_RANK": "4"}, "LOCAL_RANK=4 is not below LOCAL_WORLD_SIZE=4"),
    ({"LOCAL_WORLD_SIZE": "16"}, "LOCAL_WORLD_SIZE=16 ranks per node but only WORLD_SIZE=8 in all"),
    ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000: expected a port number"),
    ({"MASTER_PORT": None}, "MASTER_PORT are not set"),
])
def test_bad_torchrun_variables_are_one_line(change, message):
    environ = {k: v for k, v in {**TORCHRUN, **change}.items() if v is not None}
    with pytest.raises(HGraphError, match=message.replace("(", r"\(").replace(")", r"\)")) as info:
        read_launcher_env(environ)
    assert "\n" not in str(info.value)


def test_slurm_variables():
    env = read_launcher_env(SLURM)
    assert (env.launcher, env.world_size, env.rank, env.local_rank, env.local_world_size, env.node_rank) == \
        ("slurm", 8, 6, 2, 4, 1)
    assert env.master_addr == "gpu07"                                   # the job's first node
    assert env.master_port == SLURM_PORT_BASE + 123456 % 20000          # from the job id
    assert env.host == "gpu08" and not env.agent_store and not env.is_restart
    assert env.source("local_world_size") == "SLURM_NTASKS_PER_NODE=4"


def test_slurm_explicit_master_and_requeue_and_step_counts():
    # the step's own count wins over the job's (an srun asking for fewer tasks than the sbatch header)
    env = read_launcher_env({**SLURM, "SLURM_NTASKS": "4", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
                             "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "MASTER_ADDR": "10.0.0.1",
                             "MASTER_PORT": "29500", "SLURM_RESTART_COUNT": "1"})
    assert (env.master_addr, env.master_port, env.local_world_size, env.restart_count) == \
        ("10.0.0.1", 29500, 2, 1)
    assert env.source("local_world_size") == "SLURM_STEP_TASKS_PER_NODE=2"
    # no per-node count at all: one node
    bare = {k: v for k, v in SLURM.items() if k not in ("SLURM_NTASKS_PER_NODE",)}
    bare.update(SLURM_PROCID="6", SLURM_LOCALID="6")
    assert read_launcher_env(bare).local_world_size == 8


@pytest.mark.parametrize("change, message", [
    ({"SLURM_NTASKS_PER_NODE": "4,2"}, "the nodes run different numbers of tasks"),
    ({"SLURM_NTASKS_PER_NODE": "4(x)"}, "expected counts like 4, 4(x2)"),
    ({"SLURM_JOB_NODELIST": None}, "neither MASTER_ADDR nor SLURM_JOB_NODELIST is set"),
    ({"SLURM_JOB_NODELIST": "gpu[07-08"}, "expected host names"),
    ({"SLURM_PROCID": "9"}, "SLURM_PROCID=9 is not below SLURM_NTASKS=8"),
])
def test_bad_slurm_variables_are_one_line(change, message):
    environ = {k: v for k, v in {**SLURM, **change}.items() if v is not None}
    with pytest.raises(HGraphError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_launcher_env(environ)


@pytest.mark.parametrize("text, counts", [("4", [4]), ("4(x2)", [4, 4]), ("4(x2),2", [4, 4, 2]),
                                          ("1,3(x3)", [1, 3, 3, 3])])
def test_tasks_per_node(text, counts):
    assert tasks_per_node(text) == counts


@pytest.mark.parametrize("nodelist, host", [
    ("node01", "node01"), ("node01,node02", "node01"), ("node[01-04,07]", "node01"),
    ("node[07,01-04]", "node07"),
    ("gpu[3,5],cpu1", "gpu3"), ("rack[1-2]-n[3-4]", "rack1-n3"), ("a-b[010-012]", "a-b010"),
    (" h.example.org ", "h.example.org"),
])
def test_first_host_of_a_node_list(nodelist, host):
    assert first_host(nodelist) == host


@pytest.mark.parametrize("nodelist", ["", "node[01", "node[a-b]", "node]"])
def test_a_bad_node_list_is_one_line(nodelist):
    with pytest.raises(HGraphError, match="SLURM_JOB_NODELIST"):
        first_host(nodelist)


def test_launcher_cluster_defaults_and_mismatches():
    env = read_launcher_env(TORCHRUN)
    assert launcher_cluster(env) == (8, 4)
    assert launcher_cluster(env, 8, 4) == (8, 4)
    with pytest.raises(HGraphError, match=r"^--world-size is 4 but torchrun started 8 ranks in all "
                                          r"\(WORLD_SIZE=8\)"):
        launcher_cluster(env, 4)
    with pytest.raises(HGraphError, match=r"^\[cluster\] gpus-per-node \(r.toml\) is 8 but torchrun started "
                                          r"4 ranks per node \(LOCAL_WORLD_SIZE=4\)"):
        launcher_cluster(env, None, 8, where={"gpus_per_node": "[cluster] gpus-per-node (r.toml)"})


# ---- hgraph train's options under a launcher ------------------------------------------------------
@pytest.fixture
def launched(monkeypatch):
    """Set a launcher's variables (and nothing of another's) for one test."""
    for key in LAUNCH_VARS:
        monkeypatch.delenv(key, raising=False)

    def set_env(values):
        for key, value in values.items():
            monkeypatch.setenv(key, value)
    return set_env


def _config(argv):
    return config_from_args(build_parser().parse_args(["train", *argv]))[0]


def test_train_takes_world_size_nodes_and_timeout_from_torchrun(launched):
    cluster = _config([]).cluster
    assert (cluster.world_size, cluster.gpus_per_node, cluster.timeout) == (4, 8, None)
    assert default_timeout(read_launcher_env()) == LOCAL_TIMEOUT_S
    launched({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400"})
    config = _config(["--strategy-schedule", "2xTP1PP1;1xTP2PP1"])
    assert (config.cluster.world_size, config.cluster.gpus_per_node) == (2, 2)
    assert default_timeout(read_launcher_env()) == LAUNCHER_TIMEOUT_S   # run_training's when none is given
    assert _config(["--world-size", "2", "--timeout", "5"]).cluster.timeout == 5.0


def test_train_under_slurm_plans_for_the_step(launched, tmp_path):
    launched({**SLURM, "SLURM_NTASKS": "4", "SLURM_PROCID": "2", "SLURM_LOCALID": "0",
              "SLURM_NTASKS_PER_NODE": "2(x2)"})
    config = _config([])
    assert (config.cluster.world_size, config.cluster.gpus_per_node) == (4, 2)
    # the TP-inside-a-node rule uses the step's 2 tasks per node
    with pytest.raises(HGraphError, match="crossing a node boundary of 2 GPUs per node"):
        _config(["--strategy-schedule", "1xTP4PP1"])
    assert _config(["--strategy-schedule", "2xTP2PP1"]).planner.strategy_schedule == "2xTP2PP1"


def test_a_mismatching_world_size_is_one_line_before_any_process(launched, tmp_path, capsys):
    launched({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400"})
    toml = tmp_path / "run.toml"
    toml.write_text("[cluster]\nworld-size = 4\n")
    for argv, option in ((["--world-size", "4"], "--world-size"),
                         (["--config", str(toml)], r"\[cluster\] world-size \(run.toml\)")):
        assert main(["train", "--model", "tiny", "--run-dir", str(tmp_path / "run"), *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        assert re.search(rf"^hgraph train: error: rank 0 on {re.escape(socket.gethostname())}: {option} is 4 "
                         r"but torchrun started 2 ranks in all \(WORLD_SIZE=2\); leave .* out to use the "
                         r"launcher's$", err), err
    assert not (tmp_path / "run").exists()


def test_a_failed_launched_rank_says_its_rank_and_host_in_one_line(launched, monkeypatch, capsys):
    launched({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400"})

    def lost_peer(config, **kwargs):
        raise RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:1234\nmore detail")
    monkeypatch.setattr("hgraph.tools.cli.train.prepare", lost_peer)
    assert main(["train"]) == 1          # not bad input: exit 1, so that the launcher may restart the run
    err = capsys.readouterr().err
    assert err == (f"hgraph train: error: rank 3 on {socket.gethostname()}: RuntimeError: [gloo] Connection "
                   "closed by peer [127.0.0.1]:1234\n")


def test_each_attempt_meets_in_a_namespace_of_its_own():
    """torchrun's agent keeps one store across restarts: a restarted attempt must not see the keys
    (gloo addresses, heartbeats) of the attempt before it."""
    from datetime import timedelta

    import torch.distributed as dist

    from hgraph.runtime.train.rendezvous import attempt_store
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10), multi_tenant=True)
    env = {"WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(agent.port),
           "TORCHELASTIC_USE_AGENT_STORE": "True"}
    first = attempt_store(read_launcher_env({**env, "TORCHELASTIC_RESTART_COUNT": "0"}), 10)
    first.set("default_pg/rank_1", "the first attempt's address")
    again = attempt_store(read_launcher_env({**env, "TORCHELASTIC_RESTART_COUNT": "1"}), 10)
    assert not again.check(["default_pg/rank_1"])
    before = dist.PrefixStore("hgraph/attempt-0", agent)
    assert before.get("default_pg/rank_1") == b"the first attempt's address"


def test_flight_recorder_is_turned_on_for_nccl_unless_the_user_set_it():
    entries = str(FLIGHT_RECORDER_ENTRIES)
    on = {"TORCH_FR_BUFFER_SIZE": entries, "TORCH_NCCL_TRACE_BUFFER_SIZE": entries, "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    assert flight_recorder_env("nccl", TORCHRUN) == on
    assert flight_recorder_env("nccl", SLURM) == on
    # what the user set, under either name, stays
    assert flight_recorder_env("nccl", {**TORCHRUN, "TORCH_NCCL_TRACE_BUFFER_SIZE": "0",
                                        "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}) == {}
    assert flight_recorder_env("nccl", {"TORCH_FR_BUFFER_SIZE": "100"}) == {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    # gloo records nothing: nothing is set
    assert flight_recorder_env("gloo", TORCHRUN) == {}
