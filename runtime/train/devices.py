"""Which devices a local run trains on, as a user expects of the machine in front of them.

``--device auto`` (the default) is ``cuda`` when torch sees a GPU, else ``cpu``. On CUDA the world size
defaults to the GPUs visible (one rank per GPU over NCCL) and ``--device-memory auto`` is one GPU's
memory; on CPU it stays 4 processes over gloo. Asking for more ranks than GPUs is one line that says
how many there are and what to do instead: ``--device cpu`` (CPU processes over gloo), or
``--backend gloo`` (shared-device mode: the ranks share the GPUs round-robin and talk over gloo, which
stages point-to-point through host memory; for development and tests, not for speed).
"""
from __future__ import annotations

from typing import Optional

import torch

from hgraph.errors import HGraphError

DEVICES = ("auto", "cuda", "cpu")
CPU_WORLD_SIZE = 4          # local CPU processes of the default run


def resolve_device(choice: str) -> str:
    """``cuda`` or ``cpu`` for ``--device choice`` on this machine (``cuda`` without a GPU: one line)."""
    if choice not in DEVICES:
        raise HGraphError(f"--device {choice!r}: expected one of {', '.join(DEVICES)}")
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise HGraphError("--device cuda: torch sees no CUDA GPU here; --device cpu runs the ranks as "
                          "CPU processes")
    return choice


def default_world_size(device: str) -> int:
    """Ranks of a run that names none: one per visible GPU, or 4 CPU processes."""
    return torch.cuda.device_count() if device == "cuda" else CPU_WORLD_SIZE


def backend_for(device: str, backend: str, world_size: int) -> str:
    """The collective backend of ``world_size`` local ranks on ``device`` (``--backend backend``).

    CUDA with NCCL takes one GPU per rank; more ranks than GPUs is an error naming the ways out.
    ``gloo`` on CUDA is shared-device mode. CPU ranks use gloo."""
    if device == "cpu":
        if backend == "nccl":
            raise HGraphError("--backend nccl needs --device cuda (NCCL runs on GPUs); CPU ranks use gloo")
        return "gloo"
    if backend == "gloo":
        return "gloo"
    gpus = torch.cuda.device_count()
    if world_size > gpus:
        name = torch.cuda.get_device_name(0) if gpus else "GPU"
        raise HGraphError(f"--world-size {world_size}: this machine has {gpus} GPU{'s' if gpus != 1 else ''} "
                          f"({name}) and NCCL needs one per rank; use --world-size {gpus}, --device cpu "
                          f"({world_size} CPU processes over gloo), or --backend gloo ({world_size} ranks "
                          f"sharing the GPU{'s' if gpus != 1 else ''})")
    return "nccl"


def describe(device: str, world_size: int, backend: str) -> str:
    """Where the ranks run, for the run's first line: ``1 GPU``, ``4 ranks sharing 1 GPU (gloo)``,
    ``4 CPU processes (gloo)``."""
    if device != "cuda":
        return f"{world_size} CPU process{'es' if world_size != 1 else ''} (gloo)"
    gpus = min(world_size, torch.cuda.device_count())
    where = f"{gpus} GPU{'s' if gpus != 1 else ''}"
    return where if backend == "nccl" else f"{world_size} ranks sharing {where} (gloo)"


def ranks_per_gpu(ranks_here: int) -> int:
    """Ranks that share the busiest GPU when this node's ``ranks_here`` go round-robin over its GPUs."""
    return -(-ranks_here // max(1, torch.cuda.device_count()))


def gpu_memory_per_rank(ranks_here: int) -> float:
    """``--device-memory auto`` on CUDA: one GPU's memory, split between the ranks that share it."""
    return float(torch.cuda.get_device_properties(0).total_memory) / ranks_per_gpu(ranks_here)


def rank_device(device: str, rank: int, backend: Optional[str]) -> torch.device:
    """The device of local ``rank``: under NCCL the GPU the launcher set; on CUDA over gloo (shared
    mode) GPU ``rank % count``, made current; ``cpu`` otherwise (``auto`` follows the backend)."""
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if device == "cuda":
        index = rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")
