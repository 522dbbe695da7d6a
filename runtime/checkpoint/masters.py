"""The fp32 master parameters of a checkpoint, read one parameter (or one segment) at a time.

A checkpoint (``hgraph.runtime.checkpoint.shards``) stores each parameter cut along its shard
dimension over the saving run's N ranks, one shard file per rank. Two readers need those values
without the optimizer state around them and without ever holding the whole model:

* ``--init-from CHECKPOINT``: a rank of another world size wants its own segment of every parameter
  (``read(name, dim, lo, hi)``: only the saved pieces that overlap ``[lo, hi)`` are touched);
* ``hgraph export``: one parameter's full tensor at a time (``read(name)``), written out and dropped.

Shard files are opened lazily (memory-mapped ``torch.load``, checked against the manifest's size and
SHA-256 by ``shards._read_shard``), so a reader touches only the files, and of those only the rows,
it needs; the moments (``exp_avg``, ``exp_avg_sq``) are never read.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from hgraph.errors import HGraphError
from hgraph.runtime.checkpoint import shards as ckpt
from hgraph.runtime.engine.optimizer import shard_bounds


class CheckpointMasters:
    """The master parameters of one checkpoint folder (a root: its newest complete checkpoint)."""

    def __init__(self, path: Any, step: Optional[int] = None, *, verify: bool = True) -> None:
        root, folder = ckpt._resolve(path, step)
        folder = folder or ckpt.latest(root)
        if folder is None:
            raise HGraphError(f"no complete checkpoint in {str(root)!r}")
        self.folder: Path = folder
        self.manifest = ckpt.read_manifest(folder)
        self.saved_world_size = int(self.manifest["world_size"])
        self.entries = self.manifest["shards"]
        if len(self.entries) != self.saved_world_size:
            raise HGraphError(f"checkpoint manifest {str(folder / ckpt.MANIFEST)!r} lists {len(self.entries)} "
                              f"shard files for world size {self.saved_world_size}")
        self.run: dict = dict(self.manifest.get("run", {}))
        self._verify = verify
        self._files: dict[int, dict] = {}
        first = self._shard(0)
        #: every parameter's full shape (the optimizer's names: tied aliases once)
        self.shapes: dict[str, tuple[int, ...]] = {n: tuple(s) for n, s in first["full_shapes"].items()}
        self.dims: dict[str, int] = dict(first["optimizer"]["shard_dims"])
        model = self.run.get("model")
        self.description = f"checkpoint {str(folder)!r}" + (f" (of model {model})" if model else "")

    def _shard(self, rank: int) -> dict:
        if rank not in self._files:
            self._files[rank] = ckpt._read_shard(self.folder, self.entries[rank], self._verify)
        return self._files[rank]

    def close(self) -> None:
        """Drop the opened shard files (their memory maps); ``read`` opens them again if asked."""
        self._files.clear()

    def where(self, name: str) -> str:
        """The file a message about ``name`` names (the shard file of saved rank 0)."""
        return str(self.folder / self.entries[0]["name"])

    def read(self, name: str, dim: Optional[int] = None, lo: int = 0, hi: Optional[int] = None) -> torch.Tensor:
        """``name``'s full tensor (``dim`` None), or its rows ``[lo, hi)`` along ``dim`` (a 0-d
        parameter is handled as shape [1], as the optimizer does); a new tensor, not a file view."""
        full_shape = self.shapes[name]
        shape = full_shape or (1,)
        saved_dim = self.dims[name]
        size = shape[saved_dim]
        if dim is None or dim != saved_dim:
            # the whole tensor from every saved piece (one parameter), then narrowed when asked
            pieces = [self._piece(name, r, saved_dim, *shard_bounds(size, r, self.saved_world_size))
                      for r in range(self.saved_world_size)]
            full = torch.cat(pieces, dim=saved_dim).reshape(full_shape)
            if dim is None:
                return full
            return full.reshape(shape).narrow(dim, lo, (shape[dim] if hi is None else hi) - lo).clone()
        hi = size if hi is None else hi
        pieces = []
        for r in range(self.saved_world_size):
            rlo, rhi = shard_bounds(size, r, self.saved_world_size)
            a, b = max(lo, rlo), min(hi, rhi)
            if a < b:
                pieces.append(self._piece(name, r, saved_dim, a, b))
        if not pieces:       # an empty segment (a rank of a larger world owns nothing of a small dim)
            empty = list(shape)
            empty[dim] = 0
            return torch.empty(empty, dtype=torch.float32)
        return torch.cat(pieces, dim=dim) if len(pieces) > 1 else pieces[0]

    def _piece(self, name: str, rank: int, dim: int, lo: int, hi: int) -> torch.Tensor:
        """Rows ``[lo, hi)`` (global indices) of ``name`` from saved rank ``rank``'s shard, copied."""
        rlo, _ = shard_bounds((self.shapes[name] or (1,))[dim], rank, self.saved_world_size)
        params = self._shard(rank)["optimizer"]["params"]
        if name not in params:
            raise HGraphError(f"checkpoint shard file {str(self.folder / self.entries[rank]['name'])!r} has no "
                              f"parameter {name!r} although the checkpoint's first shard does")
        return params[name].narrow(dim, lo - rlo, hi - lo).clone()
