"""``hgraph.train``: the run of ``hgraph train``, started from Python.

It takes the same options, with the same defaults, as the command (each flag's name with
underscores: ``tokens_per_iter=2048``, ``strategy_schedule="2xTP1PP1;1xTP2PP1"``), and trains as one
job: run from a plain ``python script.py`` it starts the local ranks itself; under ``torchrun`` (or a
SLURM step) every rank runs the script and each call is that rank's part of the run.

Every rank builds its own copy of the model, so the model is given by what builds it, not by an
instance: a class or a function defined at the top level of a module or of the running script
(called with ``model_args``), or a model spec string as ``--model`` takes it (``llama:tiny``,
``hf:DIR``, ``FILE.py:NAME``, ``package.module:NAME``). A script that starts local ranks is imported
again by them, so its call of ``hgraph.train`` goes under ``if __name__ == "__main__":``, as in any
program that uses multiprocessing.
"""
from __future__ import annotations

import argparse
import inspect
import os
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Union

import torch
from torch import nn

from hgraph.errors import HGraphError


@dataclass(frozen=True)
class TrainResult:
    """What one process of the run keeps: its global ``rank``, the per-step records (as ``hgraph train
    --json`` prints them), the program-cache figures, the run folder and metrics file, and on rank 0
    ``state_dict``, the trained fp32 parameters keyed like the model's own (None on other ranks)."""

    rank: int
    steps: list
    cache: dict
    run_dir: Optional[str]
    metrics: Optional[str]
    state_dict: Optional[dict]

    def load_into(self, module: nn.Module) -> nn.Module:
        """Copy the trained parameters into ``module`` (a model built by the same factory); rank 0 only."""
        if self.state_dict is None:
            raise HGraphError(f"rank {self.rank} holds no trained parameters: they are gathered on rank 0")
        module.load_state_dict(self.state_dict, strict=False)
        return module


def model_spec(model: Union[str, Callable[..., nn.Module]]) -> str:
    """The ``--model`` spec that rebuilds ``model`` in every rank."""
    if isinstance(model, str):
        return model
    if isinstance(model, nn.Module):
        raise HGraphError(f"hgraph.train: got an instance of {type(model).__name__}; pass what builds it (the "
                          "class, or a function returning the model, with model_args=...): every rank builds "
                          "its own copy")
    if not callable(model) or not hasattr(model, "__qualname__"):
        raise HGraphError(f"hgraph.train: model must be a model spec, a class or a function, got {model!r}")
    name, module = model.__qualname__, model.__module__
    if "." in name or "<" in name:
        raise HGraphError(f"hgraph.train: {name} is not defined at the top level of a module or script, so the "
                          "ranks cannot import it; move it there")
    if module in ("__main__", "__mp_main__"):
        path = getattr(sys.modules[module], "__file__", None) or inspect.getsourcefile(model)
        if path is None:
            raise HGraphError(f"hgraph.train: {name} is defined in an interactive session; define it in a file")
        return f"{os.path.abspath(path)}:{name}"
    return f"{module}:{name}"


def train(model: Union[str, Callable[..., nn.Module]], data: Optional[str] = None, *,
          model_args: Optional[Mapping[str, Any]] = None, config: Optional[str] = None,
          **options: Any) -> TrainResult:
    """Train ``model`` on ``data`` (a path as ``--data`` takes it; None: the built-in documents) with
    ``hgraph train``'s ``options`` and defaults (``config``: a TOML file as ``--config``, the options
    given here winning). Returns this process's ``TrainResult``; bad input raises ``HGraphError``."""
    from hgraph.tools.cli import train as command              # the command's resolution and run
    from hgraph.tools.cli.train_schema import BY_DEST

    unknown = sorted(set(options) - set(BY_DEST))
    if unknown:
        raise HGraphError(f"hgraph.train: unknown option(s) {', '.join(unknown)}; the options are those of "
                          "hgraph train with underscores, e.g. tokens_per_iter")
    given = {k: v for k, v in options.items() if v is not None}
    given["model"] = model_spec(model)
    if model_args is not None:
        given["model_args"] = dict(model_args)
    if data is not None:
        given["data"] = str(data)
    if config is not None:
        given["config"] = str(config)
    outcome: dict = {}
    with tempfile.TemporaryDirectory(prefix="hgraph-train-") as scratch:
        if given.get("save_final") is None:               # the trained parameters come back through a file
            given["save_final"] = os.path.join(scratch, "final.pt")
        code = command.run(argparse.Namespace(**given), outcome)
        if code != 0 or "result" not in outcome:
            raise HGraphError("hgraph.train: the run failed (its error is on stderr above)")
        result = outcome["result"]
        rank = int(result.get("rank", 0))
        state = torch.load(given["save_final"], weights_only=True) if rank == 0 else None
    return TrainResult(rank=rank, steps=result["steps"], cache=result["cache"], run_dir=outcome["run_dir"],
                       metrics=outcome["metrics"], state_dict=state)
