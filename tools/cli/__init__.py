"""The ``hgraph`` command line: one subcommand per module, registered below.

Every subcommand prints for people by default and one JSON object with ``--json``; bad input is one
line on stderr and exit code 2 (``docs/architecture.md``, command line).
"""
from __future__ import annotations

import argparse
import gc
import importlib
import importlib.metadata
import re
import sys
from typing import Callable, Optional, Sequence

import torch

from hgraph.errors import HGraphError, RunFailed
from hgraph.tools.cli.rank_server import start_early

# name -> module under hgraph.tools that defines ``add_parser(subparsers)`` and ``run(args) -> int``.
SUBCOMMANDS: dict[str, str] = {
    "dump": "hgraph.tools.cli.dump",
    "plan": "hgraph.tools.cli.plan",
    "pack": "hgraph.tools.cli.pack",
    "propose": "hgraph.tools.cli.propose",
    "simulate": "hgraph.tools.cli.simulate",
    "profile": "hgraph.tools.cli.profile",
    "prepare-data": "hgraph.tools.cli.prepare_data",
    "train": "hgraph.tools.cli.train",
    "report": "hgraph.tools.cli.report",
    "export": "hgraph.tools.cli.export",
    "memory": "hgraph.tools.cli.memory",
    "check": "hgraph.tools.cli.check",
}


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad usage as one line and exit code 2, and shows help as plain text: the
    subcommands' descriptions are their module docstrings, whose reST literals and roles it drops.

    A value that starts with a minus and a digit (``--device-memory -5G``, ``--lr -1e-3``) is a value,
    as in Python 3.13's argparse, so that the option's own check names what is allowed (no flag of
    hgraph looks like a negative number)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def error(self, message: str) -> None:  # noqa: D401 - argparse API
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)

    def format_help(self) -> str:
        return plain_text(super().format_help())


def plain_text(text: str) -> str:
    """reST markup out of help text: ``x`` and :role:`x` become x."""
    return re.sub(r":[a-z]+:`([^`]*)`", r"\1", text).replace("``", "")


def version_text() -> str:
    """``hgraph X.Y.Z (torch V)``: what a bug report needs first."""
    try:
        version = importlib.metadata.version("hgraph")
    except importlib.metadata.PackageNotFoundError:     # run from a checkout that was not installed
        version = "unknown (not installed)"
    return f"hgraph {version} (torch {torch.__version__})"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hgraph", description="hgraph: heterogeneous-parallel training compiler and runtime")
    parser.add_argument("--version", action="version", version=version_text())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, module_name in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue  # subcommand not built yet
        p = module.add_parser(sub)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:
        start_early(argv[1:])       # before the subcommands' imports: the ranks' server imports beside them
    parser = build_parser()
    args = parser.parse_args(argv)
    run: Optional[Callable[[argparse.Namespace], int]] = getattr(args, "_run", None)
    if run is None:
        parser.print_help()
        return 2
    try:
        return int(run(args) or 0)
    except HGraphError as exc:      # bad input: 2; a run that started and failed: 1
        sys.stderr.write(f"hgraph {args.command}: error: {exc}\n")
        return 1 if isinstance(exc, RunFailed) else 2
    except BrokenPipeError:
        return 0


def entry() -> int:
    """The ``hgraph`` program: ``main``, then the heap frozen for the interpreter's exit, whose
    collections would otherwise walk every object of torch's modules one more time (1-2 s after a
    training run on this project's 2-core machine)."""
    try:
        return main()
    finally:
        gc.freeze()
