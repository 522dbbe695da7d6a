"""A run's ``TrainConfig`` from the options given (``hgraph train``'s flags, ``hgraph.train()``'s keyword
arguments), resolved and checked here, before any process starts.

``config_from_options(given, config_file)`` resolves the values (``config_keys.resolve``: defaults < the
TOML file < ``given``), takes the launcher's world size and ranks per node under torchrun or SLURM
(``launcher_env``; another given value is one line naming both), resolves ``device`` on this machine,
checks what would otherwise fail only after the launch (the strategy schedule on the world, the
candidate list, ``shard_group``, a ``device_memory`` too small for the model states) and converts the
byte sizes given as text (``512M``). Every problem is one ``HGraphError`` line naming the option as it
was given (its flag, or ``FILE: [section] name``).
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Union

from hgraph.errors import HGraphError
from hgraph.runtime.planner.cost.runtime_memory import bytes_text, least_state_bytes
from hgraph.runtime.planner.cost.shard_group import parse_shard_group
from hgraph.runtime.planner.service.iteration import parse_candidates
from hgraph.runtime.train.config import TrainConfig
from hgraph.runtime.train.config_keys import BY_DEST, ResolvedConfig, resolve
from hgraph.runtime.train.devices import backend_for, default_world_size, gpu_memory_per_rank, resolve_device
from hgraph.runtime.train.launcher_env import LauncherEnv, launcher_cluster, read_launcher_env
from hgraph.runtime.train.model_setup import record_model
from hgraph.runtime.train.step_modes import parse_schedule
from hgraph.strategy import Cluster


def config_from_options(given: Mapping[str, Any], config_file: Optional[str] = None,
                        env: Union[LauncherEnv, None, str] = "read") -> tuple[TrainConfig, ResolvedConfig]:
    """The run's ``TrainConfig`` (every key resolved, byte sizes parsed) and the resolved values with
    their sources, from ``given`` (``{dest: value}``; a ``config`` key is the TOML file, as
    ``config_file``); ``env``: the launcher's environment (default: this process's). Bad values:
    one-line HGraphError."""
    env = read_launcher_env() if env == "read" else env
    cfg = on_devices(launched(resolve(given, config_file), env), env)
    config = TrainConfig.from_values(cfg.values)        # read typed, through its sections, from here on
    plan, cluster, world = config.planner, config.cluster, config.cluster.world_size
    schedule, strategies = plan.strategy_schedule, plan.strategies
    if schedule is not None and cfg.sources["strategies"] != "default":
        raise HGraphError("--strategies and --strategy-schedule exclude each other: the planner chooses, "
                          "or the schedule does")
    if schedule is not None:                          # fails here, before any process starts
        for strategy in parse_schedule(schedule, world):
            strategy.validate(Cluster(world, cluster.gpus_per_node))     # TP groups inside a node
    if plan.max_candidates is not None and (schedule is not None or strategies.strip() != "auto"):
        key, src = BY_DEST["max_candidates"], cfg.sources["max_candidates"]
        where = key.flag if src == "command line" else f"{src}: [{key.section}] {key.name}"
        raise HGraphError(f"{where} = {plan.max_candidates}: applies to the proposed candidates of "
                          "--strategies auto only, not to a given strategy list or schedule")
    if schedule is None and strategies.strip() != "auto":
        parse_candidates(strategies, world)
    parse_shard_group(config.optimizer.shard_group, world, cfg.where("shard_group"))   # before any process starts
    # the ranks that share this node's GPUs: the local processes, or the launcher's ranks per node
    ranks_here = world if env is None else cluster.gpus_per_node
    device_memory = device_memory_option(cluster.device_memory, config.data.data, cluster.device, ranks_here)
    if isinstance(device_memory, float):        # before any process starts, not after the planner's setup
        check_device_memory(device_memory, config.model.model, config.model.model_args, world, config.model.dtype)
    return config.with_values(memory_budget=parse_bytes(plan.memory_budget, "--memory-budget"),
                              host_memory_budget=parse_bytes(plan.host_memory_budget, "--host-memory-budget"),
                              device_memory=device_memory), cfg


def launched(cfg: ResolvedConfig, env: Optional[LauncherEnv]) -> ResolvedConfig:
    """``cfg`` with the launcher's world size and ranks per node (a value given otherwise: one line
    naming both, ``launcher_env.launcher_cluster``)."""
    values, sources = dict(cfg.values), dict(cfg.sources)
    if env is not None:
        def given(dest: str) -> Optional[int]:
            return values[dest] if sources[dest] != "default" else None

        def where(dest: str) -> str:
            key, src = BY_DEST[dest], sources[dest]
            return key.flag if src == "command line" else f"[{key.section}] {key.name} ({src})"
        values["world_size"], values["gpus_per_node"] = launcher_cluster(
            env, given("world_size"), given("gpus_per_node"),
            where={d: where(d) for d in ("world_size", "gpus_per_node")})
        sources["world_size"] = sources["gpus_per_node"] = env.launcher
    return ResolvedConfig(values, sources)


def on_devices(cfg: ResolvedConfig, env: Optional[LauncherEnv]) -> ResolvedConfig:
    """``cfg`` with ``device`` resolved on this machine and, for local processes, the world size
    defaulting to the GPUs visible on CUDA (``runtime.train.devices``); more ranks than GPUs is one
    line before any process starts."""
    values = dict(cfg.values)
    values["device"] = resolve_device(values["device"])
    if env is None:
        if cfg.sources["world_size"] == "default":
            values["world_size"] = default_world_size(values["device"])
        backend_for(values["device"], values["backend"], values["world_size"])
    return ResolvedConfig(values, dict(cfg.sources))


def device_memory_option(text, data, device: str = "cpu", ranks_here: int = 1):
    """``device_memory``: bytes, None (``none``), or ``auto``: on CUDA one GPU's memory (split
    between the ranks sharing it); on CPU sized on the ranks from the model (``"auto"``) with the
    built-in data, no limit with ``data``."""
    t = str(text).strip().lower()
    if t == "none":
        return None
    if t == "auto":
        if device == "cuda":
            return gpu_memory_per_rank(ranks_here)
        return "auto" if data is None else None
    return parse_bytes(text, "--device-memory")


def check_device_memory(limit: float, model: str, model_args: dict, world_size: int, dtype: str) -> None:
    """``device_memory`` smaller than the model states any rank must hold is one line, printed in the
    unit given (the model built on the meta device: nothing allocated)."""
    built = record_model(TrainConfig.from_values(model=model, model_args=model_args)).model
    parameters = sum(p.numel() for p in built.parameters())
    least = least_state_bytes(parameters, world_size, 2 if dtype == "bf16" else 4)
    if limit < least:
        raise HGraphError(f"--device-memory {bytes_text(limit)}: too small for any strategy; every rank of "
                          f"{world_size} holds at least {bytes_text(least)} of model states ({parameters:,} "
                          f"parameters: its share of the fp32 masters, Adam moments, {dtype} weights and "
                          f"gradients); give at least that plus the activations, or none for no limit")


def parse_bytes(text, option: str):
    """``123``, ``1.5e6``, ``512K``, ``64M``, ``2G`` (powers of 1024) -> bytes; None stays None."""
    if text is None:
        return None
    units = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}
    t = str(text).strip().upper().removesuffix("B")
    scale = units.get(t[-1:], 1)
    try:
        value = float(t[:-1] if t[-1:] in units else t) * scale
    except ValueError:
        value = -1.0
    if not value > 0 or not math.isfinite(value):
        raise HGraphError(f"{option} {text!r}: expected a positive number of bytes, e.g. 512M")
    return value
