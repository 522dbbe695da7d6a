"""The declaration of one training option: a dataclass field whose metadata says how it is given.

A section of ``TrainConfig`` (``runtime/train/config.py``) declares each of its options once, as
``name: type = option(default, kind=..., help=...)``: the field's default is the option's default,
and its ``Option`` (``field.metadata["option"]``) holds the rest of what a front door needs to read
the option from text: its kind, allowed values, smallest value, whether ``none`` unsets it, the
metavar and the help. The option table, the TOML file's keys and their validation
(``runtime/train/config_keys.py``) and the command line's flags (``hgraph.tools.cli.train_schema``)
are generated from these fields, so adding an option touches its section and the code that uses it,
nothing else.

``kind`` is the form the option takes in a TOML file and on the command line: int, float, str,
bool, path, table (a TOML table / JSON object) or pair (two floats). A field's runtime value may be
richer than its text (``planner.memory_budget`` is given as ``"512M"`` and held as bytes): the
front door that reads the text converts it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

KINDS = ("int", "float", "str", "bool", "path", "table", "pair")


@dataclass(frozen=True)
class Option:
    """How one option is given: ``kind`` (one of ``KINDS``), ``help``; ``choices``: the allowed
    values; ``minimum``: the smallest allowed number; ``optional``: None is a valid value;
    ``metavar``: its placeholder in ``--help``; ``integers``: a str option that also takes a TOML
    integer (kept as its text, e.g. ``shard-group = 8``)."""

    kind: str
    help: str
    choices: Optional[tuple] = None
    minimum: Optional[float] = None
    optional: bool = False
    metavar: Optional[str] = None
    integers: bool = False

    def __post_init__(self) -> None:
        # a bad declaration is a programming error, found when its section's module is imported
        if self.kind not in KINDS:
            raise ValueError(f"option kind {self.kind!r}: expected one of {', '.join(KINDS)}")
        if not self.help:
            raise ValueError("an option needs a help text")


def option(default: Any = dataclasses.MISSING, *, kind: str, help: str,
           default_factory: Callable[[], Any] = dataclasses.MISSING,  # type: ignore[assignment]
           choices: Optional[tuple] = None, minimum: Optional[float] = None, optional: bool = False,
           metavar: Optional[str] = None, integers: bool = False) -> Any:
    """A dataclass field declaring one option: its default (or ``default_factory``) and its ``Option``."""
    meta = {"option": Option(kind, help, choices, minimum, optional, metavar, integers)}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def declared_options(section: type) -> Iterator[tuple[dataclasses.Field, Option]]:
    """The fields of a section dataclass that are options, in declaration order, with their ``Option``."""
    for f in dataclasses.fields(section):
        if "option" in f.metadata:
            yield f, f.metadata["option"]


def default_of(f: dataclasses.Field) -> Any:
    """The default value a field declares (a fresh one for a ``default_factory``)."""
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default
