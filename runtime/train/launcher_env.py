"""What the launcher that started this process says about the run, read once from the environment.

A process started by ``torchrun`` (or any launcher that sets ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``) or as one task of a SLURM job step (``srun``:
``SLURM_NTASKS``, ``SLURM_PROCID``, ``SLURM_LOCALID``, the tasks per node, the job's node list) is one
rank of a run whose size, ranks and ranks per node the launcher already knows. ``read_launcher_env``
puts them into one frozen ``LauncherEnv`` (None when no launcher started this process: ``hgraph
train`` then spawns its own local processes):

* torchrun's variables win when both are set (``torchrun`` inside an ``sbatch`` script);
* SLURM counts as the launcher only for more than one task (``SLURM_NTASKS`` > 1), so a one-task
  job (``srun --pty bash``, an ``sbatch`` of one task) still spawns local processes; in a job of
  several tasks, start the ranks with ``srun`` (or one ``torchrun`` per node), not from the batch
  script's own shell, which is task 0 of them;
* the tasks per node come from ``SLURM_STEP_TASKS_PER_NODE`` (the step's), else
  ``SLURM_NTASKS_PER_NODE`` or ``SLURM_TASKS_PER_NODE``, in SLURM's compressed form (``4(x2)``,
  ``8,8``); every node must run the same number, since a TP group must not cross a node
  (``hgraph.strategy.Cluster``);
* the rendezvous host is ``MASTER_ADDR``, else the first host of ``SLURM_JOB_NODELIST``
  (``node[01-04,07]`` gives ``node01``); the port ``MASTER_PORT``, else one derived from the job id
  (two jobs sharing a node do not collide);
* ``restart_count``: ``TORCHELASTIC_RESTART_COUNT`` (torchrun ``--max-restarts``) or, for srun's
  tasks, ``SLURM_RESTART_COUNT`` (a requeued job); ``requeue_count``: ``SLURM_RESTART_COUNT`` under
  torchrun (a requeued job whose torchrun starts at attempt 0). Either > 0 means this process
  belongs to a restarted attempt (``hgraph.runtime.train.restart``).

A malformed variable is one ``HGraphError`` line naming it, its value and what is allowed.
``launcher_cluster`` gives the run's world size and ranks per node: what the launcher says, and an
option given with another value is one line naming both.

``flight_recorder_env``: what a launched NCCL rank sets before its process group exists, so that a
hang explains itself: PyTorch's flight recorder (a ring buffer of each rank's last collectives) with
room for a few steps of a large model, dumped to a file per rank when a collective times out (into
``/tmp/nccl_trace_rank_<rank>`` on its node unless ``TORCH_FR_DUMP_TEMP_FILE`` says otherwise), each
left alone when the user set it.
"""
from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from typing import Mapping, Optional

from hgraph.errors import HGraphError

#: seconds a collective may wait by default: local processes start together; under a launcher the
#: nodes start, import and compile at different times, and the first collective waits for the last.
LOCAL_TIMEOUT_S = 60.0
LAUNCHER_TIMEOUT_S = 600.0
#: MASTER_PORT of a SLURM step without one: SLURM_PORT_BASE + job id mod SLURM_PORT_SPAN.
SLURM_PORT_BASE, SLURM_PORT_SPAN = 15000, 20000
#: flight-recorder entries per rank: a step of an 80-layer model with TP has ~4 collectives per layer
#: and micro-batch (forward and backward) plus its pull and push buckets, ~5,000 at 16 micro-batches;
#: PyTorch's default of 2,000 would hold less than the step that hung (an entry is a few hundred bytes)
FLIGHT_RECORDER_ENTRIES = 20000
#: PyTorch's names (torch 2.13 reads the first, older ones the second) of the buffer's size, and the
#: dump on a watchdog timeout
FR_BUFFER_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
FR_DUMP_VAR = "TORCH_NCCL_DUMP_ON_TIMEOUT"


@dataclass(frozen=True)
class LauncherEnv:
    """One rank's view of a launched run. ``names`` maps each field to the
    environment variable it came from, for messages."""

    launcher: str                  # "torchrun" or "slurm"
    world_size: int
    rank: int
    local_rank: int
    local_world_size: int          # ranks on this node: the run's ranks per node
    node_rank: int
    master_addr: str
    master_port: int
    restart_count: int = 0
    agent_store: bool = False      # torchrun's agent hosts the key-value store (no rank does)
    host: str = ""
    names: tuple[tuple[str, str], ...] = ()
    requeue_count: int = 0         # torchrun inside a requeued SLURM job: SLURM_RESTART_COUNT

    @property
    def is_restart(self) -> bool:
        """This process belongs to an attempt after the first (the launcher restarted the job, or
        SLURM requeued it)."""
        return self.restart_count > 0 or self.requeue_count > 0

    def restart_text(self) -> str:
        """``restart 1 (TORCHELASTIC_RESTART_COUNT=1)``: which restart this attempt is, for messages."""
        if self.restart_count > 0 or self.requeue_count == 0:
            return f"restart {self.restart_count} ({self.source('restart_count')})"
        return f"requeue {self.requeue_count} (SLURM_RESTART_COUNT={self.requeue_count})"

    def source(self, field: str) -> str:
        """``WORLD_SIZE=2``: where ``field``'s value came from."""
        return f"{dict(self.names).get(field, field)}={getattr(self, field)}"

    def where(self) -> str:
        """``rank 3 on node07``: how this rank names itself in its messages."""
        return f"rank {self.rank} on {self.host}"


def read_launcher_env(environ: Optional[Mapping[str, str]] = None, host: Optional[str] = None
                      ) -> Optional[LauncherEnv]:
    """The launcher's view of this process from ``environ`` (default ``os.environ``), or None when no
    launcher started it; ``host``: this machine's name (default ``socket.gethostname()``)."""
    env = os.environ if environ is None else environ
    host = host or env.get("SLURMD_NODENAME") or socket.gethostname()
    if "RANK" in env and "WORLD_SIZE" in env:     # one of them alone is no launcher's (as before)
        return _torchrun(env, host)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and _int(env, "SLURM_NTASKS", 1) > 1:
        return _slurm(env, host)
    return None


def _int(env: Mapping[str, str], name: str, minimum: int, default: Optional[int] = None) -> int:
    text = env.get(name)
    if text is None:
        if default is None:
            raise HGraphError(f"environment variable {name} is not set")
        return default
    try:
        value = int(text.strip())
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise HGraphError(f"environment variable {name}={text!r}: expected an integer >= {minimum}")
    return value


def _check(env: LauncherEnv) -> LauncherEnv:
    def bad(field: str, bound: str) -> HGraphError:
        return HGraphError(f"{env.launcher} environment: {env.source(field)} is not below "
                           f"{env.source(bound)}")
    if env.rank >= env.world_size:
        raise bad("rank", "world_size")
    if env.local_rank >= env.local_world_size:
        raise bad("local_rank", "local_world_size")
    if env.local_world_size > env.world_size:
        raise HGraphError(f"{env.launcher} environment: {env.source('local_world_size')} ranks per node "
                          f"but only {env.source('world_size')} in all")
    if not 0 < env.master_port < 2 ** 16:
        raise HGraphError(f"{env.launcher} environment: {env.source('master_port')}: expected a port "
                          "number 1-65535")
    return env


def _torchrun(env: Mapping[str, str], host: str) -> LauncherEnv:
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in env]
    if missing:
        raise HGraphError(f"environment variables {', '.join(missing)} are not set, but RANK and WORLD_SIZE "
                          "are; start the program with torchrun, or unset RANK and WORLD_SIZE to spawn "
                          "local processes")
    world = _int(env, "WORLD_SIZE", 1)
    rank = _int(env, "RANK", 0)
    local_world = _int(env, "LOCAL_WORLD_SIZE", 1, default=world)
    local_rank = _int(env, "LOCAL_RANK", 0, default=rank % local_world)
    names = (("world_size", "WORLD_SIZE"), ("rank", "RANK"), ("local_rank", "LOCAL_RANK"),
             ("local_world_size", "LOCAL_WORLD_SIZE"), ("node_rank", "GROUP_RANK"),
             ("master_addr", "MASTER_ADDR"), ("master_port", "MASTER_PORT"),
             ("restart_count", "TORCHELASTIC_RESTART_COUNT"))
    return _check(LauncherEnv(
        "torchrun", world, rank, local_rank, local_world,
        _int(env, "GROUP_RANK", 0, default=rank // local_world), env["MASTER_ADDR"],
        _int(env, "MASTER_PORT", 0), _int(env, "TORCHELASTIC_RESTART_COUNT", 0, default=0),
        env.get("TORCHELASTIC_USE_AGENT_STORE") == "True", host, names,
        _int(env, "SLURM_RESTART_COUNT", 0, default=0)))


def _slurm(env: Mapping[str, str], host: str) -> LauncherEnv:
    world = _int(env, "SLURM_NTASKS", 1)
    node = _int(env, "SLURM_NODEID", 0, default=0)
    per_node_var = next((k for k in _PER_NODE_VARS if env.get(k)), None)
    if per_node_var is None:
        local_world = world                  # nothing says otherwise: one node
    else:
        counts = tasks_per_node(env[per_node_var], per_node_var)
        if len(set(counts)) > 1:
            raise HGraphError(f"{per_node_var}={env[per_node_var]!r}: the nodes run different numbers of "
                              "tasks; hgraph needs the same number on every node (a TP group must not "
                              "cross a node)")
        local_world = counts[0]
    if "MASTER_ADDR" in env:
        addr, addr_var = env["MASTER_ADDR"], "MASTER_ADDR"
    else:
        addr_var = next((k for k in ("SLURM_JOB_NODELIST", "SLURM_NODELIST") if env.get(k)), None)
        if addr_var is None:
            raise HGraphError("SLURM environment: neither MASTER_ADDR nor SLURM_JOB_NODELIST is set; "
                              "export MASTER_ADDR=<first node of the job>")
        addr = first_host(env[addr_var], addr_var)
    if "MASTER_PORT" in env:
        port, port_var = _int(env, "MASTER_PORT", 0), "MASTER_PORT"
    else:
        port_var = "SLURM_JOB_ID"
        port = SLURM_PORT_BASE + _int(env, "SLURM_JOB_ID", 0, default=0) % SLURM_PORT_SPAN
    names = (("world_size", "SLURM_NTASKS"), ("rank", "SLURM_PROCID"), ("local_rank", "SLURM_LOCALID"),
             ("local_world_size", per_node_var or "SLURM_NTASKS"), ("node_rank", "SLURM_NODEID"),
             ("master_addr", addr_var), ("master_port", port_var), ("restart_count", "SLURM_RESTART_COUNT"))
    return _check(LauncherEnv(
        "slurm", world, _int(env, "SLURM_PROCID", 0), _int(env, "SLURM_LOCALID", 0, default=0), local_world,
        node, addr, port, _int(env, "SLURM_RESTART_COUNT", 0, default=0), False, host, names))


# the step's own count first: an sbatch header's --ntasks-per-node stays in the environment of an srun
# step that asked for another
_PER_NODE_VARS = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
_COUNT = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def tasks_per_node(text: str, name: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """SLURM's compressed per-node counts, one entry per node: ``"4(x2),2"`` -> ``[4, 4, 2]``."""
    counts: list[int] = []
    for part in text.split(","):
        m = _COUNT.match(part.strip())
        if m is None or int(m.group(1)) < 1 or (m.group(2) is not None and int(m.group(2)) < 1):
            raise HGraphError(f"environment variable {name}={text!r}: expected counts like 4, 4(x2) or "
                              "4(x2),2")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def first_host(nodelist: str, name: str = "SLURM_JOB_NODELIST") -> str:
    """The first host of a SLURM node list: ``"node[01-04,07],gpu3"`` -> ``node01``; in a name with
    several bracket groups (``rack[1-2]-n[3-4]``) each group takes its first value (``rack1-n3``)."""
    first, depth = [], 0
    for ch in nodelist.strip():           # the first entry: up to a comma outside brackets
        if ch == "," and depth == 0:
            break
        depth += (ch == "[") - (ch == "]")
        first.append(ch)
    entry = "".join(first)

    def first_value(m: re.Match) -> str:
        value = m.group(1).split(",")[0].split("-")[0].strip()
        if not value.isdigit():
            raise HGraphError(f"environment variable {name}={nodelist!r}: cannot read the range "
                              f"[{m.group(1)}]")
        return value
    host = re.sub(r"\[([^\]]*)\]", first_value, entry)
    if not host or depth != 0 or "[" in host or "]" in host:
        raise HGraphError(f"environment variable {name}={nodelist!r}: expected host names like "
                          "node01,node02 or node[01-04]")
    return host


def launcher_cluster(env: LauncherEnv, world_size: Optional[int] = None, gpus_per_node: Optional[int] = None,
                     *, where: Mapping[str, str] = {}) -> tuple[int, int]:  # noqa: B006
    """The run's (world size, ranks per node) under ``env``: a value not given (None) is the
    launcher's; a given one must be the launcher's (HGraphError naming both). ``where`` names the
    options in the message (default ``--world-size``, ``--gpus-per-node``)."""
    for given, field, dest, what in ((world_size, "world_size", "world_size", "ranks in all"),
                                     (gpus_per_node, "local_world_size", "gpus_per_node", "ranks per node")):
        ours = getattr(env, field)
        if given is not None and given != ours:
            option = where.get(dest, "--" + dest.replace("_", "-"))
            raise HGraphError(f"{option} is {given} but {env.launcher} started {ours} {what} "
                              f"({env.source(field)}); leave {option} out to use the launcher's")
    return env.world_size, env.local_world_size


def default_timeout(env: Optional[LauncherEnv]) -> float:
    """Seconds a collective may wait when ``--timeout`` is not given (see the constants above)."""
    return LAUNCHER_TIMEOUT_S if env is not None else LOCAL_TIMEOUT_S


def flight_recorder_env(backend: str, environ: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """The variables a rank of ``backend`` sets (to add to its environment before its process group is
    created) so that PyTorch's flight recorder keeps its last ``FLIGHT_RECORDER_ENTRIES`` collectives
    and writes them out when a collective times out: to ``TORCH_FR_DUMP_TEMP_FILE`` + the rank, PyTorch's
    default ``/tmp/nccl_trace_rank_<rank>`` on the rank's node. NCCL only (gloo records nothing); a
    variable the user set, under either of its names, is left as it is."""
    env = os.environ if environ is None else environ
    if backend != "nccl":
        return {}
    out = {}
    if not any(name in env for name in FR_BUFFER_VARS):
        out.update({name: str(FLIGHT_RECORDER_ENTRIES) for name in FR_BUFFER_VARS})
    if FR_DUMP_VAR not in env:
        out[FR_DUMP_VAR] = "1"
    return out
