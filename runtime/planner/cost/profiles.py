"""Cost profiles: built-in (shipped in ``data/``) or read from a file in the same JSON format.

A profile file maps model names to entries ``{"model": {...}, "schemes": [{tp, pp, a, b, c}],
"util_len_tokens": {"tp<n>": int}, "memory": {...}, "cluster": {...}}``; keys starting with ``_``
are comments. A reference is a built-in name (``llama-7b``), a path (the file must hold exactly one
model) or ``PATH:NAME``.
"""
from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from hgraph.errors import HGraphError

BUILTIN_PROFILE_FILE = "a800_cost_profiles.json"

_REQUIRED_MEMORY_KEYS = (
    "activation_bytes_per_token_per_layer_coeff_A", "model_state_coeff_B", "alpha_sharded_fraction",
    "framework_gap_bytes", "safety_margin_bytes", "gpu_memory_bytes")


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise HGraphError(f"cannot read {what} {str(path)!r}: {exc.strerror or exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise HGraphError(f"{what} {str(path)!r} is not valid JSON: line {exc.lineno}: {exc.msg}") from None
    if not isinstance(data, dict):
        raise HGraphError(f"{what} {str(path)!r} must hold a JSON object of model name -> profile")
    return data


def builtin_profiles() -> dict[str, Any]:
    """All profiles shipped with hgraph, by model name."""
    text = resources.files("hgraph.runtime.planner").joinpath("data", BUILTIN_PROFILE_FILE).read_text()
    return {k: v for k, v in json.loads(text).items() if not k.startswith("_")}


def builtin_profile_names() -> list[str]:
    return sorted(builtin_profiles())


def _models_in(data: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in data.items() if not k.startswith("_") and isinstance(v, dict)}


def validate_profile(name: str, entry: Any, where: str) -> dict[str, Any]:
    """Check the keys a cost model needs; raise HGraphError naming the missing one."""
    if not isinstance(entry, dict):
        raise HGraphError(f"profile {name!r} in {where} must be a JSON object")
    for key in ("model", "schemes", "util_len_tokens", "memory"):
        if key not in entry:
            raise HGraphError(f"profile {name!r} in {where} lacks the key {key!r}")
    for key in ("hidden", "layers", "vocab"):
        if key not in entry["model"]:
            raise HGraphError(f"profile {name!r} in {where}: model lacks {key!r}")
    for key in _REQUIRED_MEMORY_KEYS:
        if key not in entry["memory"]:
            raise HGraphError(f"profile {name!r} in {where}: memory lacks {key!r}")
    if not entry["schemes"]:
        raise HGraphError(f"profile {name!r} in {where} has no schemes")
    for i, s in enumerate(entry["schemes"]):
        for key in ("tp", "pp", "a", "b", "c"):
            if key not in s:
                raise HGraphError(f"profile {name!r} in {where}: scheme #{i} lacks {key!r}")
    return entry


def resolve_profile(ref: str) -> tuple[str, dict[str, Any]]:
    """Return (model name, profile entry) for a built-in name, a PATH or ``PATH:NAME``."""
    if not isinstance(ref, str) or not ref.strip():
        raise HGraphError(f"empty profile reference; built-in profiles: {', '.join(builtin_profile_names())}")
    ref = ref.strip()
    builtins = builtin_profiles()
    if ref in builtins:
        return ref, validate_profile(ref, builtins[ref], "the built-in profiles")
    path_text, name = ref, None
    if not Path(ref).exists():
        # PATH:NAME; the name may itself hold ':' (e.g. llama:tiny), so take the first prefix that is a file.
        for pos in (i for i, ch in enumerate(ref) if ch == ":"):
            if Path(ref[:pos]).is_file():
                path_text, name = ref[:pos], ref[pos + 1:]
                break
    path = Path(path_text)
    if not path.exists():
        raise HGraphError(
            f"unknown profile {ref!r}: not a built-in profile ({', '.join(sorted(builtins))}) nor an existing file "
            "(a file with several models takes PATH:NAME)")
    models = _models_in(_read_json(path, "profile file"))
    if not models:
        raise HGraphError(f"profile file {str(path)!r} holds no model profile")
    if name is None:
        if len(models) != 1:
            raise HGraphError(
                f"profile file {str(path)!r} holds several models ({', '.join(sorted(models))}); choose one with PATH:NAME")
        name = next(iter(models))
    if name not in models:
        raise HGraphError(f"profile file {str(path)!r} has no model {name!r}; it holds {', '.join(sorted(models))}")
    return name, validate_profile(name, models[name], repr(str(path)))
