"""``hgraph export``: a training checkpoint as a Hugging Face model folder or a plain ``state_dict``.

``hgraph export CKPT --format hf -o DIR [--max-shard-size 5GB]``: CKPT is a checkpoint folder of
``hgraph train`` (the newest complete checkpoint under it, or one ``step-N`` folder, or ``--step N``).
DIR gets ``config.json`` and the fp32 masters as safetensors (``model.safetensors``, or shards of at
most the size given with ``model.safetensors.index.json``) that
``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` loads with no missing or unexpected
weights, for ``hf:`` models (the config the run recorded) and the zoo Llama (as ``LlamaForCausalLM``).
It streams: the model is built on the meta device, the
checkpoint's names and shapes are checked against it, and each output shard is filled one
parameter at a time, each gathered from the rows of the saved shard files,
written, and dropped; tied weights are written once.

``--format torch`` (the default) ``-o model.pt``: the model is rebuilt from the model spec and
arguments the checkpoint records; the result is that module's ``state_dict()`` (buffers included)
with every parameter, tied aliases too, replaced by the checkpoint's fp32 master gathered to its full
shape and cast to the module's dtype. It is written atomically with ``torch.save`` and checked before
returning: read back with ``torch.load(weights_only=True)`` and loaded into a fresh module with
``load_state_dict(strict=True)``.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from hgraph.errors import HGraphError
from hgraph.frontends.zoo import hf
from hgraph.runtime.checkpoint import full_state
from hgraph.runtime.checkpoint import manifest as ckpt
from hgraph.runtime.checkpoint.masters import CheckpointMasters
from hgraph.runtime.train.model_setup import build_model, record_model
from hgraph.runtime.train.config import TrainConfig
from hgraph.runtime.weights.deferred_init import record_init
from hgraph.runtime.weights.file_weights import match
from hgraph.runtime.weights.hf_form import hf_form
from hgraph.runtime.weights.safetensors_writer import nbytes, parse_size, plan_shards, write_shards
from hgraph.runtime.weights.sources import SeededInit


# bytes of checkpoint rows read through memory maps before export unmaps the shard files again (the
# pages read stay resident until then). Measured with 64 MiB on Llama models of 615 MB and 967 MB
# (the same 131 MB embedding): peak RSS 0.44 and 0.46 GB above the interpreter's 0.28 GB, whatever
# --max-shard-size; 1.8x faster than unmapping after every parameter, which saves 0.1 GB
UNMAP_AFTER = 64 * 2 ** 20


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("export", help="a Hugging Face model folder or a state_dict from a training checkpoint",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint folder (--checkpoint-dir of hgraph train) "
                   "or one of its step-N folders")
    p.add_argument("--step", type=int, default=None, metavar="N", help="the checkpoint of step N (default: newest)")
    p.add_argument("-o", "--output", required=True, metavar="OUT.pt|DIR",
                   help="where the state_dict (--format torch) or the model folder (--format hf) goes")
    p.add_argument("--format", choices=("torch", "hf"), default="torch",
                   help="torch: a state_dict file; hf: config.json + safetensors for from_pretrained (default: torch)")
    p.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                   help="--format hf: largest safetensors file (5GB, 500MB, 2GiB); above it the weights are "
                        "sharded with model.safetensors.index.json (default: 5GB)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="fp32",
                   help="--format hf: precision of the written weights, the fp32 masters rounded to nearest "
                        "(default: fp32)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _checkpoint_folder(path: str, step=None) -> Path:
    root, folder = ckpt.resolve_checkpoint(path, step)
    folder = folder or ckpt.latest(root)
    if folder is None:
        raise HGraphError(f"no complete checkpoint in {str(root)!r}")
    if not folder.is_dir():
        steps = ", ".join(map(str, ckpt.complete_steps(root))) or "none"
        raise HGraphError(f"no checkpoint {str(folder)!r}; complete checkpoints in {str(root)!r} are of steps {steps}")
    return folder


def _recorded_run(folder: Path) -> dict:
    run = ckpt.read_manifest(folder).get("run", {})
    if "model" not in run:
        raise HGraphError(f"checkpoint {str(folder)!r} does not record its model (not written by hgraph train)")
    return run


def export_hf(path: str, output: str, step=None, max_shard_size: str = "5GB", dtype: str = "fp32") -> dict:
    """Write the Hugging Face folder, streaming, the parameters in ``dtype``
    (``fp32`` or ``bf16``); returns what was written."""
    weight_dtype = DTYPES[dtype]
    max_bytes = parse_size(max_shard_size)
    masters = CheckpointMasters(_checkpoint_folder(path, step), unmap_after=UNMAP_AFTER)
    run = _recorded_run(masters.folder)
    if "hf_config" in run:      # an hf: run: its config as recorded, the folder it came from not needed
        record = record_init(lambda: hf.from_config_dict(run["hf_config"]), run.get("seed", 0))
    else:
        record = record_model(TrainConfig.from_values(model=run["model"], model_args=run.get("model_args", {}),
                                                      seed=run.get("seed", 0)))
    form = hf_form(record.model)
    param_keys, _ = match(masters, record.model)        # names and shapes, before anything is written
    buffers = dict(SeededInit(record).buffers(form.buffers)) if form.buffers else {}
    source = {key: ("param", name) for name, key in form.params.items()}
    source.update({key: ("buffer", name) for name, key in form.buffers.items()})
    specs = {key: (masters.shapes[param_keys[name]], weight_dtype) for name, key in form.params.items()}
    specs.update({key: (tuple(buffers[name].shape), buffers[name].dtype) for name, key in form.buffers.items()})

    def read(key: str) -> torch.Tensor:
        kind, name = source[key]
        return masters.read(param_keys[name]).to(weight_dtype) if kind == "param" else buffers[name]

    out = Path(output)
    plan = plan_shards([(key, nbytes(*spec)) for key, spec in specs.items()], max_bytes)
    files = write_shards(out, plan, specs, read)
    form.config.dtype = weight_dtype                   # from_pretrained's default dtype for the folder
    form.config.save_pretrained(str(out))
    return {"output": str(out), "checkpoint": str(masters.folder), "model": run["model"], "format": "hf",
            "dtype": dtype,
            "architecture": form.config.architectures[0], "tensors": len(specs),
            "files": [f.name for f in files] + ["config.json"],
            "bytes": sum(f.stat().st_size for f in files)}


def export_checkpoint(path: str, output: str, step=None) -> dict:
    """Write and check the state_dict; returns what was written."""
    folder = _checkpoint_folder(path, step)
    run = _recorded_run(folder)

    def fresh():
        return build_model(TrainConfig.from_values(model=run["model"], model_args=run.get("model_args", {}),
                                                   seed=run.get("seed", 0)))
    state = full_state.export_state_dict(folder, output, model=fresh())
    loaded = torch.load(output, map_location="cpu", weights_only=True)
    fresh().load_state_dict(loaded, strict=True)
    return {"output": str(output), "checkpoint": str(folder), "model": run["model"], "tensors": len(state),
            "bytes": Path(output).stat().st_size}


def run(args: argparse.Namespace) -> int:
    if args.format == "hf":
        out = export_hf(args.checkpoint, args.output, args.step, args.max_shard_size, args.dtype)
        if args.json:
            print(json.dumps(out))
        else:
            print(f"{out['output']}: {out['architecture']} of {out['model']} from {out['checkpoint']} "
                  f"({out['tensors']} {out['dtype']} tensors in {sum(f.endswith('.safetensors') for f in out['files'])} safetensors "
                  f"files, {out['bytes'] / 1e6:.2f} MB; loads "
                  "with transformers.AutoModelForCausalLM.from_pretrained)")
        return 0
    if args.dtype != "fp32":
        raise HGraphError(f"--dtype {args.dtype} applies to --format hf; --format torch writes the fp32 masters")
    out = export_checkpoint(args.checkpoint, args.output, args.step)
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{out['output']}: state_dict of {out['model']} from {out['checkpoint']} ({out['tensors']} tensors, "
              f"{out['bytes'] / 1e6:.2f} MB; loads with torch.load(weights_only=True) and load_state_dict)")
    return 0
