"""Reference models (a Llama-style decoder with named configs) and model-spec resolution.

A model spec names the model to compile or train:

* ``"llama:tiny"``: a zoo family and one of its named configs (``ZOO``); ``model_args`` override
  config fields (``{"num_layers": 32}``); ``"llama-moe:tiny"``: the mixture-of-experts decoder;
  ``"hf:llama"`` (``qwen2``, ``mistral``, ``gpt2``, ...): a Hugging Face model from a tiny config that
  ``model_args`` override; ``"hf:DIR"``: the architecture of a local Hugging Face model directory
  (``DIR/config.json``; everything after ``hf:`` is the path);
* ``"path/to/file.py:ClassName"``: a class defined in a Python file;
* ``"package.module:ClassName"``: a class in an importable module.

For the last two, ``model_args`` are passed to the class as keyword arguments.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import torch.nn as nn

from hgraph.errors import HGraphError
from hgraph.frontends.zoo import hf, llama, llama_moe
from hgraph.frontends.zoo.llama import CONFIGS, Llama, LlamaConfig, build

# Family name -> builder(config_name, **overrides) -> nn.Module.
ZOO: dict[str, Callable[..., nn.Module]] = {"llama": llama.build, "llama-moe": llama_moe.build, "hf": hf.build}
# Family name -> its named configs (for messages and listings).
ZOO_CONFIGS: dict[str, Mapping[str, Any]] = {"llama": llama.CONFIGS, "llama-moe": llama_moe.CONFIGS,
                                             "hf": hf.CONFIGS}

__all__ = ["CONFIGS", "Llama", "LlamaConfig", "ZOO", "ZOO_CONFIGS", "build", "resolve_model_spec",
           "zoo_names"]


def zoo_names() -> list[str]:
    """Every ``family:config`` name the zoo resolves, e.g. ``llama:tiny``."""
    return [f"{family}:{name}" for family, configs in ZOO_CONFIGS.items() for name in configs]


def resolve_model_spec(spec: str, model_args: Optional[Mapping[str, Any]] = None) -> nn.Module:
    """Instantiate the model named by ``spec``; bad specs -> HGraphError."""
    args = dict(model_args or {})
    if not isinstance(spec, str) or ":" not in spec:
        raise HGraphError(f"model spec {spec!r} must be FAMILY:CONFIG (one of {', '.join(zoo_names())}), "
                          f"FILE.py:CLASS or MODULE:CLASS")
    where, name = ("hf", spec[3:]) if spec.startswith("hf:") else spec.rsplit(":", 1)
    if where in ZOO:
        return ZOO[where](name, **args)
    if where.endswith(".py"):
        module = _load_file(where, spec)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            raise HGraphError(f"model spec {spec!r}: cannot import module {where!r} ({exc}); zoo families "
                              f"are {', '.join(ZOO)}") from None
    cls = getattr(module, name, None)
    if cls is None or not callable(cls):
        raise HGraphError(f"model spec {spec!r}: {where!r} has no class {name!r}")
    try:
        inspect.signature(cls).bind(**args)
    except TypeError as exc:
        raise HGraphError(f"model spec {spec!r}: model args {sorted(args)} do not fit {name}{_signature(cls)}: "
                          f"{exc}") from None
    try:
        model = cls(**args)
    except (TypeError, ValueError) as exc:
        raise HGraphError(f"model spec {spec!r}: {name}(**{args}) failed: {exc}") from None
    if not isinstance(model, nn.Module):
        raise HGraphError(f"model spec {spec!r}: {name} built a {type(model).__name__}, not an nn.Module")
    return model


def _signature(cls: Any) -> str:
    try:
        return str(inspect.signature(cls))
    except (TypeError, ValueError):
        return "(...)"


def _load_file(path: str, spec: str):
    file = Path(path)
    if not file.is_file():
        raise HGraphError(f"model spec {spec!r}: file {path!r} does not exist")
    module_name = f"hgraph_user_model_{abs(hash(str(file.resolve())))}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    import_spec = importlib.util.spec_from_file_location(module_name, file)
    if import_spec is None or import_spec.loader is None:
        raise HGraphError(f"model spec {spec!r}: cannot load {path!r} as a Python module")
    module = importlib.util.module_from_spec(import_spec)
    sys.modules[module_name] = module
    try:
        import_spec.loader.exec_module(module)
    except Exception as exc:  # the user's file failed to import: report it in one line
        del sys.modules[module_name]
        raise HGraphError(f"model spec {spec!r}: importing {path!r} failed: "
                          f"{type(exc).__name__}: {exc}") from None
    return module
