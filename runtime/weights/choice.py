"""Which ``WeightSource`` a run starts from, and what kind of files a path holds.

``weight_source(model, default, model_spec, init_from)`` (``model`` on the meta device, or built whole
when its construction could not be recorded; ``default`` its own initialisation):

* ``--init-from PATH`` (any model): the values in PATH (``open_weights``);
* ``--model hf:DIR`` with safetensors in DIR: those weights (the architecture came from
  ``DIR/config.json``, ``hgraph.frontends.zoo.hf``), so a pretrained model trains from its weights;
  a DIR with only ``pytorch_model*.bin`` is refused (hgraph reads safetensors; ``--init-from`` reads
  a single ``.bin`` state_dict), a DIR with no weight files at all trains from the seeded init;
* otherwise ``default``, the model's own initialisation after ``torch.manual_seed(seed)``.

``open_weights(path)`` tells the kinds apart: a folder with a ``manifest.json`` or ``step-N``
checkpoint folders is an hgraph checkpoint (``CheckpointMasters``: masters only, resharded to this
run's world size); a folder with DCP's ``.metadata`` and no manifest is a DCP checkpoint written by
another program (``DcpFiles``); any other folder holds safetensors; a file is a torch state_dict when it is a zip
(``torch.save``) or a pickle, and safetensors otherwise. Each reader checks its files before any
tensor is read (``FileWeights`` then matches them against the model).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from torch import nn

from hgraph.errors import HGraphError
from hgraph.frontends.zoo import hf
from hgraph.runtime.checkpoint import dcp_format
from hgraph.runtime.checkpoint import manifest as ckpt
from hgraph.runtime.checkpoint.masters import CheckpointMasters
from hgraph.runtime.weights.dcp_files import DcpFiles
from hgraph.runtime.weights.file_weights import FileWeights, TensorTable
from hgraph.runtime.weights.safetensors_files import INDEX, SafetensorsFiles
from hgraph.runtime.weights.sources import WeightSource
from hgraph.runtime.weights.state_dict_file import StateDictFile

_ZIP, _PICKLE = b"PK\x03\x04", b"\x80"


def weight_source(model: nn.Module, default: WeightSource, model_spec: str,
                  init_from: Optional[str] = None) -> WeightSource:
    """The run's initial weights for ``model``."""
    if init_from is not None:
        return FileWeights(open_weights(init_from), model, default)
    directory = hf.local_dir(model_spec[3:]) if model_spec.startswith("hf:") else None
    if directory is not None:
        if (directory / INDEX).is_file() or any(directory.glob("*.safetensors")):
            return FileWeights(SafetensorsFiles.open(directory), model, default)
        if any(directory.glob("pytorch_model*.bin")):
            raise HGraphError(f"{model_spec}: {str(directory)!r} holds pytorch_model*.bin weights but no "
                              "safetensors; hgraph reads safetensors from a model directory (save it with "
                              "save_pretrained(safe_serialization=True), or --init-from a single .bin state_dict)")
    return default


def open_weights(path: str) -> TensorTable:
    """The files at ``path`` as a ``TensorTable``; one-line HGraphError otherwise."""
    p = Path(path)
    if not p.exists():
        raise HGraphError(f"--init-from {str(p)!r} does not exist")
    if p.is_dir():
        if (p / ckpt.MANIFEST).is_file() or any(ckpt.STEP_DIR.match(c.name) for c in p.iterdir()):
            return CheckpointMasters(p)
        if dcp_format.is_dcp_folder(p):
            return DcpFiles(p)
        return SafetensorsFiles.open(p)
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic.startswith(_ZIP) or magic.startswith(_PICKLE):
        return StateDictFile(p)
    return SafetensorsFiles.open(p)
