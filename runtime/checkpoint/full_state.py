"""A checkpoint's full tensors, read from its files without processes, and written out as a plain
``state_dict`` (``hgraph export``'s default format)."""
from __future__ import annotations

import io
from pathlib import Path
from typing import Optional

import torch

from hgraph.errors import HGraphError
from hgraph.runtime.checkpoint.manifest import PathLike, atomic_write
from hgraph.runtime.checkpoint.shards import MOMENT_KEYS, load


def full_tensors(path: PathLike, *, step: Optional[int] = None, fallback: bool = False) -> dict:
    """The gathered full tensors of a checkpoint, read from files (no processes).

    Returns ``{"params": {name: tensor}, "exp_avg": ..., "exp_avg_sq": ..., "steps": {name: float},
    "step": int}``.
    """
    ckpt = load(path, 0, 1, step=step, fallback=fallback)
    shapes = ckpt.full_shapes
    out = {key: {n: t.reshape(shapes[n]) for n, t in ckpt.optimizer[key].items()} for key in MOMENT_KEYS}
    out["steps"] = dict(ckpt.optimizer["steps"])
    out["step"] = ckpt.step
    return out


def export_state_dict(path: PathLike, out_path: PathLike, *, step: Optional[int] = None,
                      model: Optional[torch.nn.Module] = None) -> dict:
    """Write a plain ``state_dict`` (fp32 parameters keyed like the original module) with ``torch.save``.

    Without ``model`` the keys are the optimizer's parameter names (the module's
    ``named_parameters()``). With ``model``, the result starts from ``model.state_dict()`` (its
    buffers kept) and every parameter, tied aliases included, is replaced by the checkpoint's value,
    cast to the module's dtype; a parameter the checkpoint lacks is an error. Returns the dict.
    """
    params = full_tensors(path, step=step)["params"]
    if model is None:
        state = {n: t.contiguous() for n, t in params.items()}
    else:
        state = dict(model.state_dict())
        by_id = {}
        for name, p in model.named_parameters():
            by_id[id(p)] = name
        for name, p in model.named_parameters(remove_duplicate=False):
            canonical = by_id[id(p)]
            if canonical not in params:
                raise HGraphError(f"export: the checkpoint has no parameter {canonical!r} of the model")
            full = params[canonical]
            if tuple(full.shape) != tuple(p.shape):
                raise HGraphError(f"export: parameter {canonical!r} has shape {list(full.shape)} in the "
                                  f"checkpoint, the model's is {list(p.shape)}")
            state[name] = full.to(p.dtype).contiguous()
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save(state, buf)
    atomic_write(out_path, buf.getvalue())
    return state
