"""``hgraph train``'s flags and ``--help`` table, generated from the option table of
``hgraph.runtime.train.config_keys`` (itself generated from the config sections of
``hgraph.runtime.train.config``).

``add_arguments(parser)`` declares every key as a flag with an absent default, so ``resolve`` can tell
the flags that were given from those that were not; ``help_text()`` renders the table for ``--help``.
The table, the TOML reader and writer and the resolution itself are the runtime's (``config_keys``):
``hgraph.train()`` resolves its keyword arguments there too.
"""
from __future__ import annotations

import argparse
import json
import textwrap
from typing import Any, Callable

from hgraph.errors import HGraphError
from hgraph.runtime.train.config_keys import SCHEMA, SECTIONS, ConfigKey, validate

# ---- command line -------------------------------------------------------------------------------
def _flag_type(key: ConfigKey) -> Callable[[str], Any]:
    """argparse ``type=`` for ``key``: text -> value, or ArgumentTypeError (argparse: exit 2)."""
    def convert(text: str) -> Any:
        try:
            if key.optional and text.lower() == "none":
                return None
            if key.kind == "int":
                value: Any = int(text)
            elif key.kind == "float":
                value = float(text)
            elif key.kind == "pair":
                value = tuple(float(v) for v in text.split(","))
            elif key.kind == "table":
                value = json.loads(text)
            else:
                value = text
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected {key.kind}"
                                             + (" B1,B2" if key.kind == "pair" else "")) from None
        try:
            return validate(key, value, "command line")
        except HGraphError as exc:
            # "--steps = 0: must be >= 1" -> argparse's "argument --steps: 0: must be >= 1"
            raise argparse.ArgumentTypeError(str(exc).split(" = ", 1)[-1]) from None
    convert.__name__ = key.kind      # argparse names the type in its messages
    return convert


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare every key as a flag (grouped by section) with an absent default, plus ``--config``.

    Bool keys get ``--name`` / ``--no-name``. Use ``resolve`` on the parsed namespace.
    """
    parser.add_argument("--config", default=argparse.SUPPRESS, metavar="RUN.toml",
                        help="TOML file with the keys below; flags given on the command line win")
    groups = {s: parser.add_argument_group(f"[{s}]") for s in SECTIONS}
    for key in SCHEMA:
        g = groups[key.section]
        # a help text that already explains its default keeps it; the others get the table's
        text = key.help if "default" in key.help else f"{key.help} (default: {_default_text(key)})"
        text = text.replace("%", "%%")        # argparse %-formats help texts ("8%" would break --help)
        if key.kind == "bool":
            g.add_argument(key.flag, dest=key.dest, action=argparse.BooleanOptionalAction,
                           default=argparse.SUPPRESS, help=text)
        else:
            g.add_argument(key.flag, dest=key.dest, type=_flag_type(key), default=argparse.SUPPRESS,
                           choices=None, metavar=key.metavar or (
                               "{" + ",".join(key.choices) + "}" if key.choices else key.kind.upper()),
                           help=text)


# ---- help ---------------------------------------------------------------------------------------
def _default_text(key: ConfigKey) -> str:
    if key.default is None:
        return "none"
    if key.kind == "bool":
        return "true" if key.default else "false"
    if key.kind == "pair":
        return ",".join(f"{v:g}" for v in key.default)
    if key.kind == "table":
        return "{}"
    if key.kind == "float":
        return f"{key.default:g}"
    return str(key.default)


def _toml_value(key: ConfigKey) -> str:
    if key.default is None:
        return '"none"'
    if key.kind == "bool":
        return "true" if key.default else "false"
    if key.kind == "pair":
        return "[" + ", ".join(f"{v:g}" for v in key.default) + "]"
    if key.kind == "table":
        return "{}"
    if key.kind in ("str", "path"):
        return f'"{key.default}"'
    return _default_text(key)


def help_text(width: int = 100) -> str:
    """The table as text for ``hgraph train --help``: per section, each key with its type, default,
    allowed values, flag and help."""
    lines = ["Configuration file (--config RUN.toml): the sections and keys below; each key is also the",
             "flag of the same name, and a flag given on the command line overrides the file.", ""]
    for section in SECTIONS:
        lines.append(f"[{section}]")
        for key in (k for k in SCHEMA if k.section == section):
            allowed = f"; one of {', '.join(key.choices)}" if key.choices else ""
            head = f"  {key.name} = {_toml_value(key)}"
            desc = f"{key.kind}{allowed}; {key.flag}. {key.help}"
            lines.append(head)
            lines.extend(textwrap.wrap(desc, width=width, initial_indent="      ",
                                       subsequent_indent="      "))
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"

