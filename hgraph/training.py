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

It is a thin adapter over the run object of ``hgraph.runtime.train.run`` (``prepare(config).execute()``),
as the command is: a failed run raises ``HGraphError`` (``RunFailed`` for a run that started) with the
run's own line, and rank 0's trained parameters come back in memory (from spawned ranks through
shared memory), never through a file.
"""
from __future__ import annotations

import inspect
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Union

from torch import nn

from hgraph.errors import HGraphError, RunFailed


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
    given here winning). Returns this process's ``TrainResult``; bad input raises ``HGraphError``, a run
    that fails ``RunFailed`` (an ``HGraphError``), each with the run's one line."""
    # the API module wires the runtime's run object, lazily (hgraph's IR imports none of the rooms)
    from hgraph.runtime.train.config_keys import BY_DEST
    from hgraph.runtime.train.launcher_env import read_launcher_env
    from hgraph.runtime.train.progress import PlainLines
    from hgraph.runtime.train.run import errors_named, prepare
    from hgraph.runtime.train.run_config import config_from_options

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
    env = read_launcher_env()
    with errors_named(env):
        run_config, _ = config_from_options(given, None if config is None else str(config), env=env)
        # rank 0's progress as plain lines (the planner's setup steps), as the command prints them off a terminal
        with prepare(run_config.with_values(return_final=True), progress_bars=PlainLines, env=env) as prepared:
            summary = prepared.execute()
        if summary.finished is not None:
            raise RunFailed(f"hgraph.train: {summary.finished}")
        if summary.stopped is not None:
            stopped = summary.stopped
            raise RunFailed(f"stopped by {stopped['signal']} after step {stopped['step']} of "
                            f"{run_config.data.steps}; checkpoint {stopped['checkpoint']} saved; resume=True "
                            "continues from it")
        summary.check_trained()
    return TrainResult(rank=summary.rank, steps=list(summary.steps), cache=dict(summary.cache),
                       run_dir=summary.run_dir, metrics=summary.metrics,
                       state_dict=dict(summary.final_state) if summary.final_state is not None else None)
