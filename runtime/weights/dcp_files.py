"""The tensors of a ``torch.distributed.checkpoint`` (DCP) folder written by another program, for
``--init-from``: e.g. ``dcp.save({"model": model.state_dict()}, checkpoint_id=DIR)`` (torchtitan's and
hgraph's own form, entries ``model.<fqn>``) or ``dcp.save(model.state_dict(), ...)`` (bare FQNs).

Names and shapes come from the folder's ``.metadata`` before anything is read; ``read`` takes one
parameter's full tensor (DCP reads it from whichever saving ranks' files hold its chunks, in fp32
whatever dtype was saved) and narrows it to the rows asked for.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from hgraph.runtime.checkpoint import dcp_format


class DcpFiles:
    """A DCP folder's model tensors by parameter name."""

    def __init__(self, folder: Any) -> None:
        self.folder = Path(folder)
        self.description = f"DCP checkpoint {str(self.folder)!r}"
        entries = dcp_format.tensor_shapes(self.folder)
        prefixed = {key[len("model."):]: key for key in entries if key.startswith("model.")}
        self._keys = prefixed or dict(zip(entries, entries))
        self.shapes = {name: entries[key] for name, key in self._keys.items()}

    def where(self, name: str) -> str:
        return str(self.folder)

    def read(self, name: str, dim: Optional[int] = None, lo: int = 0, hi: Optional[int] = None) -> torch.Tensor:
        return dcp_format.read_rows(self.folder, self._keys[name], self.shapes[name], dim, lo, hi)

    def close(self) -> None:
        pass
