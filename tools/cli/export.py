"""``hgraph export``: a plain ``state_dict`` from a training checkpoint, loadable by the original module.

``hgraph export CKPT -o model.pt``: CKPT is a checkpoint folder of ``hgraph train`` (the newest
complete checkpoint under it, or one ``step-N`` folder, or ``--step N``). The model is rebuilt from
the model spec and arguments the checkpoint records; the result is that module's ``state_dict()``
(buffers included) with every parameter, tied aliases too, replaced by the checkpoint's fp32 master
gathered to its full shape and cast to the module's dtype. It is written atomically with
``torch.save`` and checked before returning: read back with ``torch.load(weights_only=True)`` and
loaded into a fresh module with ``load_state_dict(strict=True)``.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from hgraph.errors import HGraphError
from hgraph.runtime.checkpoint import shards as ckpt
from hgraph.runtime.train.trainer import TrainConfig, build_model


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("export", help="a plain state_dict from a training checkpoint",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint folder (--checkpoint-dir of hgraph train) "
                   "or one of its step-N folders")
    p.add_argument("--step", type=int, default=None, metavar="N", help="the checkpoint of step N (default: newest)")
    p.add_argument("-o", "--output", required=True, metavar="OUT.pt", help="where the state_dict goes")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def export_checkpoint(path: str, output: str, step=None) -> dict:
    """Write and check the state_dict (module docstring); returns what was written."""

    root, folder = ckpt._resolve(path, step)
    folder = folder or ckpt.latest(root)
    if folder is None:
        raise HGraphError(f"no complete checkpoint in {str(root)!r}")
    if not folder.is_dir():
        steps = ", ".join(map(str, ckpt.complete_steps(root))) or "none"
        raise HGraphError(f"no checkpoint {str(folder)!r}; complete checkpoints in {str(root)!r} are of steps {steps}")
    run = ckpt.read_manifest(folder).get("run", {})
    if "model" not in run:
        raise HGraphError(f"checkpoint {str(folder)!r} does not record its model (not written by hgraph train)")

    def fresh():
        return build_model(TrainConfig.from_values(model=run["model"], model_args=run.get("model_args", {}),
                                                   seed=run.get("seed", 0)))
    state = ckpt.export_state_dict(folder, output, model=fresh())
    loaded = torch.load(output, map_location="cpu", weights_only=True)
    fresh().load_state_dict(loaded, strict=True)
    return {"output": str(output), "checkpoint": str(folder), "model": run["model"], "tensors": len(state),
            "bytes": Path(output).stat().st_size}


def run(args: argparse.Namespace) -> int:
    out = export_checkpoint(args.checkpoint, args.output, args.step)
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{out['output']}: state_dict of {out['model']} from {out['checkpoint']} ({out['tensors']} tensors, "
              f"{out['bytes'] / 1e6:.2f} MB; loads with torch.load(weights_only=True) and load_state_dict)")
    return 0
