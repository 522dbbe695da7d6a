"""The options of a training run as a table: one ``ConfigKey`` per field of the config sections
(``runtime.train.config``), their validation, the TOML reader and writer, and the resolution of a
run's values (the declared defaults < a TOML file < the values given).

Every option is declared once, as a field of a section of ``hgraph.runtime.train.config`` (its
default, kind, allowed values and help in the field's ``Option``). ``SCHEMA`` is generated from those
fields: one ``ConfigKey`` per option, with its TOML section and key and the command-line flag of the
same name (``--tokens-per-iter`` is ``tokens-per-iter`` under ``[data]``). Nothing here is about the
command line itself: ``hgraph train`` (``hgraph.tools.cli.train_schema``) declares the flags from the
same table, ``hgraph.train()`` passes its keyword arguments, and both resolve them here.

A TOML file uses the flag names as keys (``tokens_per_iter`` is accepted for ``tokens-per-iter``)
in the seven sections ``[model] [data] [cluster] [optimizer] [planner] [checkpointing] [logging]``.
Optional keys take the string ``"none"`` for "not set" (TOML has no null). Unknown sections or keys,
wrong types and disallowed values raise ``HGraphError`` naming the file, the key, the value and what
is allowed (the CLI prints it and exits with code 2). ``dump_toml`` writes resolved values back as a
file that loads to the same values.
"""
from __future__ import annotations

import argparse
import json
import math
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping, Optional, Union

from hgraph.errors import HGraphError
from hgraph.runtime.train.config import SECTIONS as CONFIG_SECTIONS
from hgraph.runtime.train.option import KINDS, Option, declared_options, default_of

# the TOML sections, in the order of the file and of --help: those of the runtime's TrainConfig
SECTIONS: tuple[str, ...] = tuple(CONFIG_SECTIONS)


@dataclass(frozen=True)
class ConfigKey(Option):
    """One option: ``[section] name`` in TOML, ``--name`` on the command line, ``dest`` in the result;
    how it is given (kind, help, choices, minimum, ...) is its field's ``Option``, taken whole."""

    section: str = ""
    name: str = ""
    default: Any = None

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")

    @property
    def flag(self) -> str:
        return f"--{self.name}"


def _keys() -> tuple[ConfigKey, ...]:
    """One key per option field of the runtime's config sections, section by section, each in the
    order its section declares it (the order of --help and of a dumped file)."""
    return tuple(ConfigKey(**{o.name: getattr(opt, o.name) for o in fields(Option)}, section=section,
                           name=f.name.replace("_", "-"), default=default_of(f))
                 for section, cls in CONFIG_SECTIONS.items() for f, opt in declared_options(cls))


# The table, generated from the declarations in hgraph.runtime.train.config.
SCHEMA: tuple[ConfigKey, ...] = _keys()

KEYS: dict[tuple[str, str], ConfigKey] = {(k.section, k.name): k for k in SCHEMA}
BY_DEST: dict[str, ConfigKey] = {k.dest: k for k in SCHEMA}


def _check_schema() -> None:
    """The table's own consistency (run at import: a bad entry is a programming error)."""
    assert len(BY_DEST) == len(SCHEMA), "two keys share a name"
    for key in SCHEMA:
        assert key.section in SECTIONS and key.kind in KINDS, key
        if key.default is not None or not key.optional:
            validate(key, key.default, "the schema")


# ---- validation ---------------------------------------------------------------------------------
def _fmt(value: Any) -> str:
    return repr(value) if not isinstance(value, str) else f'"{value}"'


def _where(key: ConfigKey, source: str) -> str:
    return f"{source}: [{key.section}] {key.name}" if source != "command line" else f"{key.flag}"


def validate(key: ConfigKey, value: Any, source: str) -> Any:
    """``value`` checked and normalised for ``key``; HGraphError names key, value and what is allowed."""
    where = _where(key, source)
    if key.optional and (value is None or (isinstance(value, str) and value.lower() == "none")):
        return None
    expected = {"int": "an integer", "float": "a number", "str": "a string", "path": "a path string",
                "bool": "true or false", "table": "a table of model settings", "pair": "two numbers"}[key.kind]
    bad = HGraphError(f"{where} = {_fmt(value)}: expected {expected}"
                      + (' or "none"' if key.optional else ""))
    if key.kind == "bool":
        if not isinstance(value, bool):
            raise bad
    elif key.kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
    elif key.kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise bad
        value = float(value)
    elif key.kind in ("str", "path"):
        if key.integers and isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str) or not value:
            raise bad
    elif key.kind == "table":
        if not isinstance(value, Mapping):
            raise bad
        value = dict(value)
    elif key.kind == "pair":
        if not (isinstance(value, (list, tuple)) and len(value) == 2 and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)):
            raise bad
        value = (float(value[0]), float(value[1]))
        if not all(0.0 <= v < 1.0 for v in value):
            raise HGraphError(f"{where} = {list(value)}: each beta must be in [0, 1)")
    if key.choices is not None and value not in key.choices:
        raise HGraphError(f"{where} = {_fmt(value)}: allowed are {', '.join(map(str, key.choices))}")
    if key.minimum is not None and value < key.minimum:
        raise HGraphError(f"{where} = {_fmt(value)}: must be >= {key.minimum:g}")
    return value


def validate_mapping(data: Mapping[str, Any], source: str) -> dict[str, Any]:
    """Sections of a parsed TOML document -> ``{dest: value}`` (checked; HGraphError on the first problem)."""
    out: dict[str, Any] = {}
    for section, table in data.items():
        if section not in SECTIONS:
            if not isinstance(table, Mapping):
                raise HGraphError(f"{source}: top-level key {section!r} is not allowed; keys go in the "
                                  f"sections [{'], ['.join(SECTIONS)}]")
            raise HGraphError(f"{source}: unknown section [{section}]; allowed sections: "
                              f"{', '.join(SECTIONS)}")
        if not isinstance(table, Mapping):
            raise HGraphError(f"{source}: {section} = {_fmt(table)}: expected a section [{section}]")
        for name, value in table.items():
            key = KEYS.get((section, name.replace("_", "-")))
            if key is None:
                allowed = ", ".join(k.name for k in SCHEMA if k.section == section)
                raise HGraphError(f"{source}: unknown key [{section}] {name}; allowed in [{section}]: {allowed}")
            if key.dest in out:
                raise HGraphError(f"{source}: [{section}] {name} is given twice (as - and _ spellings)")
            out[key.dest] = validate(key, value, source)
    return out


def load_config(path: Union[str, Path]) -> dict[str, Any]:
    """The validated values of a TOML file, ``{dest: value}`` (only the keys the file sets)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise HGraphError(f"config file {str(path)!r} cannot be read: {exc.strerror or exc}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise HGraphError(f"config file {str(path)!r} is not valid TOML: {exc}") from None
    return validate_mapping(data, path.name)


@dataclass(frozen=True)
class ResolvedConfig:
    """Every key's value (``values[dest]``) and where it came from (``sources[dest]``: default, the
    config file's name, or ``command line``). A run reads its options typed, through the sections of
    the ``TrainConfig`` made from ``values`` (``TrainConfig.from_values``); this holds only what the
    front door needs besides: where each value came from, for its one-line errors."""

    values: dict = field(default_factory=dict)
    sources: dict = field(default_factory=dict)

    def where(self, dest: str) -> str:
        """How an error names ``dest``: its flag when given on the command line or not given, else
        ``SOURCE: [section] name``."""
        key, src = BY_DEST[dest], self.sources[dest]
        return key.flag if src in ("command line", "default") else f"{src}: [{key.section}] {key.name}"

    def section(self, name: str) -> dict[str, Any]:
        """The values of one section, keyed by TOML key name."""
        return {k.name: self.values[k.dest] for k in SCHEMA if k.section == name}


def resolve(flags: Union[argparse.Namespace, Mapping[str, Any]], config: Optional[Union[str, Path]] = None
            ) -> ResolvedConfig:
    """Defaults < TOML file < flags given. ``flags``: a namespace from ``add_arguments`` (only the
    flags given are set) or a ``{dest: value}`` mapping; ``config``: the TOML path (default: the
    namespace's ``--config``). Cross-key rules are checked on the result (HGraphError)."""
    given = dict(vars(flags)) if isinstance(flags, argparse.Namespace) else dict(flags)
    config = config if config is not None else given.pop("config", None)
    given.pop("config", None)
    values = {k.dest: k.default for k in SCHEMA}
    sources = {k.dest: "default" for k in SCHEMA}
    if config is not None:
        for dest, value in load_config(config).items():
            values[dest], sources[dest] = value, Path(config).name
    for dest, value in given.items():
        key = BY_DEST.get(dest)
        if key is None:
            continue             # other options of the subcommand (e.g. a parser's own _run)
        values[dest], sources[dest] = validate(key, value, "command line"), "command line"
    _check_combination(values, sources)
    return ResolvedConfig(values, sources)


def _check_combination(values: Mapping[str, Any], sources: Mapping[str, str]) -> None:
    def where(dest: str) -> str:
        key = BY_DEST[dest]
        src = sources[dest]
        return key.flag if src == "command line" else f"[{key.section}] {key.name}" + (
            f" ({src})" if src != "default" else "")
    if values["checkpoint_every"] is not None and values["checkpoint_dir"] is None:
        raise HGraphError(f"{where('checkpoint_every')} needs checkpoint-dir (--checkpoint-dir DIR)")
    if values["resume"] and values["checkpoint_dir"] is None:
        raise HGraphError(f"{where('resume')} needs checkpoint-dir (--checkpoint-dir DIR)")
    if values["resume_fallback"] and not values["resume"]:
        raise HGraphError(f"{where('resume_fallback')} needs resume (--resume)")
    if values["eval_every"] is not None and values["eval_data"] is None:
        raise HGraphError(f"{where('eval_every')} needs eval-data (--eval-data SRC)")
    if values["eval_data"] is not None and values["eval_every"] is None:
        raise HGraphError(f"{where('eval_data')} needs eval-every (--eval-every K)")
    if values["keep_checkpoints"] is not None and values["checkpoint_dir"] is None:
        raise HGraphError(f"{where('keep_checkpoints')} needs checkpoint-dir (--checkpoint-dir DIR)")


# ---- writing a config back -------------------------------------------------------------------------
def _toml_literal(key: ConfigKey, value: Any) -> str:
    if value is None:
        return '"none"'
    if key.kind == "bool":
        return "true" if value else "false"
    if key.kind == "pair":
        return "[" + ", ".join(repr(float(v)) for v in value) + "]"
    if key.kind == "table":
        return _plain_toml(value, key.name)
    if key.kind == "float":
        return repr(float(value))
    if key.kind == "int":
        return str(int(value))
    return json.dumps(value)        # a JSON string is a valid TOML basic string


def _plain_toml(value: Any, name: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        return json.dumps(value) if not isinstance(value, float) else repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_plain_toml(v, name) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_plain_toml(v, k)}" for k, v in value.items()) + "}"
    raise HGraphError(f"{name} = {value!r}: only numbers, strings, booleans, lists and tables can be "
                      "written to TOML (TOML has no null)")


def dump_toml(config: Union[ResolvedConfig, Mapping[str, Any]]) -> str:
    """Every key's value as a TOML document (e.g. the ``run.toml`` a run folder keeps); loading it
    back with ``load_config`` gives the same values."""
    values = config.values if isinstance(config, ResolvedConfig) else config
    lines: list[str] = []
    for section in SECTIONS:
        lines.append(f"[{section}]")
        for key in (k for k in SCHEMA if k.section == section):
            lines.append(f"{key.name} = {_toml_literal(key, values.get(key.dest, key.default))}")
        lines.append("")
    return "\n".join(lines)


_check_schema()
