"""``hgraph train`` starts its ranks' forkserver before anything else.

The server imports what a rank needs (torch, the runtime, the compiler: ~3 s of CPU, and transformers
for ``hf:`` models); started first, it does so on another core while the command imports its own
modules, reads its configuration and prepares the data, instead of after them, in front of the first
rank. Nothing starts for ``--help`` or under a launcher (torchrun, a SLURM step), whose processes are
the ranks themselves. What the run turns out to be is decided later, as before: a run that stops on
bad input leaves the server to end with the command.
"""
from __future__ import annotations

import tomllib
from typing import Optional, Sequence

from hgraph.errors import HGraphError
from hgraph.runtime.train.launch import start_rank_server
from hgraph.runtime.train.launcher_env import read_launcher_env


def _option(argv: Sequence[str], name: str) -> Optional[str]:
    """The value of the last ``name VALUE`` or ``name=VALUE`` in ``argv``."""
    value = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(name + "="):
            value = arg[len(name) + 1:]
    return value


def model_spec(argv: Sequence[str]) -> Optional[str]:
    """The ``--model`` of ``hgraph train ARGV``, from the flag or the ``--config`` file's ``[model]``."""
    model = _option(argv, "--model")
    config = _option(argv, "--config")
    if model is None and config is not None:
        try:
            with open(config, "rb") as f:
                model = tomllib.load(f).get("model", {}).get("model")
        except (OSError, tomllib.TOMLDecodeError, AttributeError):
            return None           # the command reads it again, and says what is wrong with it
    return model if isinstance(model, str) else None


def rank_libraries(argv: Sequence[str]) -> Optional[tuple[str, ...]]:
    """The optional libraries the ranks of ``hgraph train ARGV`` import (``transformers`` for an
    ``hf:`` model), or None when this process starts no ranks (help, or a launcher's rank)."""
    if any(a in ("-h", "--help") for a in argv):
        return None
    try:
        if read_launcher_env() is not None:
            return None
    except HGraphError:
        return None               # a broken launcher environment: the command says so later
    model = model_spec(argv)
    return ("transformers",) if model is not None and model.startswith("hf:") else ()


def start_early(argv: Sequence[str]) -> None:
    """Start the ranks' forkserver for ``hgraph train ARGV`` (see the module's docstring)."""
    libraries = rank_libraries(argv)
    if libraries is not None:
        start_rank_server(libraries)
