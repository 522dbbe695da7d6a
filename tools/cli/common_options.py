"""The words every subcommand that talks about a cluster shares: ``--world-size``, ``--gpus-per-node``,
``--device-memory`` and ``--shard-group``.

The old spellings (``--gpus`` of ``plan``, ``propose`` and ``simulate``; ``--gpu-memory`` of
``profile``, in GiB) still work for one release: they set the same value and print one line that
names the new flag.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

from hgraph.runtime.planner.cost.shard_group import resolve_shard_group
from hgraph.strategy import Cluster

DEVICE_MEMORY_FORMS = "bytes, with a K, M or G suffix (512M, 80G)"


class _DeprecatedSpelling(argparse.Action):
    """Stores the value under the new flag's name and says once, on stderr, which flag to use."""

    def __init__(self, option_strings, dest, new_flag: str, convert=None, **kwargs):
        self.new_flag, self.convert = new_flag, convert
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        sys.stderr.write(f"{parser.prog}: note: {option_string} is deprecated and will be removed in the next "
                         f"release; use {self.new_flag}\n")
        setattr(namespace, self.dest, self.convert(values) if self.convert else values)


def add_world_size(p: argparse.ArgumentParser, *, required: bool = False, help: str,
                   old_gpus: bool = False) -> None:
    """``--world-size N``; ``old_gpus``: ``--gpus N`` too (deprecated), which satisfies ``required``."""
    if not old_gpus:
        p.add_argument("--world-size", type=int, default=None, required=required, metavar="N", help=help)
        return
    group = p.add_mutually_exclusive_group(required=required)
    group.add_argument("--world-size", type=int, default=None, metavar="N", help=help)
    group.add_argument("--gpus", dest="world_size", type=int, action=_DeprecatedSpelling,
                       new_flag="--world-size", metavar="N", help=argparse.SUPPRESS)


def add_gpus_per_node(p: argparse.ArgumentParser, *, default: int | None = 8) -> None:
    p.add_argument("--gpus-per-node", type=int, default=default, metavar="G",
                   help="GPUs (ranks) per node; a tensor-parallel group never crosses a node"
                        + (f" (default {default})" if default is not None else ""))


def add_device_memory(p: argparse.ArgumentParser, *, help: str, default=None, old_gib_flag: bool = False) -> None:
    """``--device-memory SIZE``; ``old_gib_flag``: ``--gpu-memory GiB`` too (deprecated), converted to
    the same text form."""
    p.add_argument("--device-memory", default=default, metavar="SIZE", help=help)
    if old_gib_flag:
        p.add_argument("--gpu-memory", dest="device_memory", type=float, action=_DeprecatedSpelling,
                       new_flag="--device-memory", convert=lambda gib: f"{gib}G", metavar="GiB",
                       help=argparse.SUPPRESS)


def add_shard_group(p: argparse.ArgumentParser) -> None:
    """``--shard-group G|world|auto``, as ``hgraph train`` takes it (``planner/cost/shard_group``)."""
    p.add_argument("--shard-group", default="world", metavar="G|world|auto",
                   help="the optimizer states (fp32 masters, Adam's moments) are sharded over each group of G "
                        "consecutive ranks and replicated across the groups, as hgraph train --shard-group: an "
                        "integer dividing the world size, world (the default: over all ranks) or auto (the "
                        "smallest node multiple whose states fit half of --device-memory; a node without it)")


def shard_group_cluster(value: Any, world_size: int, gpus_per_node: int, parameters: int,
                        device_memory: Any = None) -> tuple[Cluster, str]:
    """The cluster of ``--shard-group value`` (resolved as ``hgraph train`` resolves it: ``auto`` from
    ``parameters`` elements and ``device_memory`` bytes, unknown when not a number) and, for ``auto``,
    why it chose its G. A bad value is one line naming the flag and what is allowed."""
    g, why = resolve_shard_group(value, world_size, gpus_per_node, parameters, device_memory)
    return Cluster(world_size, gpus_per_node, shard_group=g if g < world_size else None), why


def shard_group_text(cluster: Cluster, why: str = "") -> str:
    """``optimizer states: sharded over ...``, the line ``hgraph train`` prints at its end."""
    over = (f"the world ({cluster.world_size} ranks)" if cluster.shard_group is None else
            f"groups of {cluster.group_size} ranks ({cluster.world_size // cluster.group_size} copies)")
    return f"optimizer states: sharded over {over}" + (f" (--shard-group auto: {why})" if why else "")
