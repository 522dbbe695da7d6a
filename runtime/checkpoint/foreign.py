"""Resuming from a DCP checkpoint that another PyTorch program wrote.

E.g. a plain model trained with ``torch.optim.Adam`` (or ``AdamW``) and saved with
``dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=DIR)``, where
``model_sd, optim_sd = torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)``:
its entries are ``model.<fqn>`` and ``optim.state.<fqn>.exp_avg`` / ``.exp_avg_sq`` / ``.step`` (and
``optim.param_groups``). ``--resume --checkpoint-dir DIR`` takes such a folder (a ``.metadata``
and no hgraph manifest): the weights become the fp32 masters, the moments and step counts Adam's
state, each rank reading only its own rows (``dcp_format.load_optimizer_state``).

What such a checkpoint does not say, and what is chosen instead:

* the run's step: the largest Adam step count (the number of optimizer steps taken), so the learning
  rate schedule continues at that step and ``--steps`` stays the run's total;
* the data position: the foreign program is taken to have trained this run's first ``step``
  mini-batches (the same data and order), so the run goes on at the document after them (the
  mini-batches are formed again, not trained);
* the optimizer's settings (lr, betas, eps, weight decay) are this run's flags, as on every resume;
* RNG states and planner state: none; each rank keeps its seeded state and the planner starts anew.

The prefixes of the entries are found, not assumed: the model's weights are the entries that end in
a parameter's name (``model.`` preferred, bare names taken), the optimizer's those that end in
``state.<name>.exp_avg`` (``optim.`` preferred; ``optimizer.``, ``app.optim.`` ... taken when they are
the only ones). A needed entry that is missing is an HGraphError naming it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed.checkpoint as dcp

from hgraph.errors import HGraphError
from hgraph.runtime.checkpoint import dcp_format
from hgraph.runtime.engine.optimizer import ShardedAdam

_STEP = re.compile(r"^(.*\.)?state\.(.+)\.step$")
WHAT = "--resume: DCP checkpoint"


def is_foreign(folder: Path) -> bool:
    """A DCP checkpoint folder without hgraph's manifest (written by another program)."""
    folder = Path(folder)
    return dcp_format.is_dcp_folder(folder) and not (folder / "manifest.json").exists()


def _data_files(folder: Path) -> int:
    meta = dcp.FileSystemReader(str(folder)).read_metadata()
    return max(1, len({info.relative_path for info in (meta.storage_data or {}).values()}))


def step_counts(folder: Path) -> dict[str, float]:
    """Every Adam step count entry of the checkpoint (key -> value), read in one ``dcp.load``."""
    shapes = dcp_format.tensor_shapes(folder)
    keys = {k: s for k, s in shapes.items() if _STEP.match(k) and s in ((), (1,))}
    if not keys:
        raise HGraphError(f"{WHAT} {str(folder)!r} has no Adam step counts (entries like "
                          "'optim.state.<parameter>.step'): it holds no optimizer state to resume "
                          "(--init-from takes its weights alone)")
    flat = {k: torch.zeros(s) for k, s in keys.items()}
    dcp_format.load_flat(flat, folder)
    return {k: float(v.reshape(())) for k, v in flat.items()}


def resume_manifest(folder: Path) -> dict:
    """What ``find_resume_point`` records of a foreign checkpoint, in a manifest's form (module
    docstring: the step is the largest Adam step count; no data position, queues or run)."""
    counts = step_counts(folder)
    return {"format": "dcp", "foreign": True, "step": int(max(counts.values())),
            "world_size": _data_files(folder), "shards": [], "data_position": {}, "delay_queues": {},
            "planner_state": {}, "run": {}}


def _one(found: list, preferred: str, what: str) -> str:
    if preferred in found:
        return preferred
    if len(found) == 1:
        return found[0]
    raise HGraphError(f"{what}: found {sorted(found)}; give a checkpoint with one of them")


def entry_names(folder: Path, names: list[str]) -> dcp_format.EntryNames:
    """The prefixes under which ``folder`` keeps the parameters ``names`` (module docstring)."""
    shapes = dcp_format.tensor_shapes(folder)
    first = names[0]
    suffix = f"state.{first}.exp_avg"
    optim = [k[: -len(suffix)] for k in shapes if k.endswith(suffix) and k[: -len(suffix)][-1:] in ("", ".")]
    if not optim:
        raise HGraphError(f"{WHAT} {str(folder)!r} has no entry 'optim.state.{first}.exp_avg' (nor another "
                          f"prefix's 'state.{first}.exp_avg'): Adam's state of parameter {first!r}")
    optim_prefix = _one(optim, "optim.", f"{WHAT} {str(folder)!r}: several optimizer states of {first!r}")
    model = [k[: -len(first)] for k in shapes
             if k.endswith(first) and k[: -len(first)][-1:] in ("", ".") and not k.startswith(optim_prefix + "state.")]
    if not model:
        raise HGraphError(f"{WHAT} {str(folder)!r} has no entry 'model.{first}' (nor {first!r}): the weights "
                          f"of parameter {first!r}")
    model_prefix = _one(model, "model.", f"{WHAT} {str(folder)!r}: several weights of {first!r}")
    return dcp_format.EntryNames(model=model_prefix, optim=optim_prefix)


@dataclass(frozen=True)
class ForeignCheckpoint:
    """A foreign DCP folder being resumed: ``optimizer_state`` reads a rank's part once the
    optimizer (its parameter names and shard dimensions) exists."""

    folder: Path

    def optimizer_state(self, optimizer: ShardedAdam) -> dict:
        """Rank ``optimizer.rank``'s ``ShardedAdam.state_dict()`` (its rows only); the settings are the
        optimizer's own."""
        layouts: Mapping[str, Any] = optimizer.layouts
        names = entry_names(self.folder, list(layouts))
        shapes = dcp_format.tensor_shapes(self.folder)
        for name, lay in layouts.items():
            key = names.weights(name)
            if key in shapes and (tuple(shapes[key]) or (1,)) != (tuple(lay.full_shape) or (1,)):
                raise HGraphError(f"{WHAT} {str(self.folder)!r}: entry {key!r} has shape {list(shapes[key])}, "
                                  f"the model's parameter has {list(lay.full_shape)}")
        hyper = {"lr": optimizer.lr, "betas": optimizer.betas, "eps": optimizer.eps,
                 "weight_decay": optimizer.weight_decay, "decoupled_weight_decay": optimizer.decoupled_weight_decay,
                 "max_grad_norm": optimizer.max_grad_norm}
        group_size = getattr(optimizer, "group_size", optimizer.world_size)   # its place in its shard group
        state, _ = dcp_format.load_optimizer_state(
            self.folder, optimizer.rank % group_size, group_size, {n: lay.dim for n, lay in layouts.items()},
            hyper, names, what=WHAT)
        return {**state, "rank": optimizer.rank, "world_size": optimizer.world_size, "shard_group": group_size}
