"""The words every subcommand that talks about a cluster shares: ``--world-size``, ``--gpus-per-node``
and ``--device-memory``.

The old spellings (``--gpus`` of ``plan``, ``propose`` and ``simulate``; ``--gpu-memory`` of
``profile``, in GiB) still work for one release: they set the same value and print one line that
names the new flag.
"""
from __future__ import annotations

import argparse
import sys

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
