"""The fp32 master parameters of a checkpoint, read one parameter (or one segment) at a time.

A checkpoint (``hgraph.runtime.checkpoint.shards``) stores each parameter cut along its shard
dimension over the saving run's N ranks, one shard file per rank. Two readers need those values
without the optimizer state around them and without ever holding the whole model:

* ``--init-from CHECKPOINT``: a rank of another world size wants its own segment of every parameter
  (``read(name, dim, lo, hi)``: only the saved pieces that overlap ``[lo, hi)`` are touched);
* ``hgraph export``: one parameter's full tensor at a time (``read(name)``), written out and dropped.

Shard files are opened lazily (memory-mapped ``torch.load``, checked against the manifest's size and
SHA-256 by ``manifest.read_shard``), so a reader touches only the files, and of those only the rows,
it needs; the moments (``exp_avg``, ``exp_avg_sq``) are never read. A rank keeps its files mapped
until ``close`` (the pages it touched are about its own 1/N); export, which reads everything, gives
``unmap_after`` so the pages read do not pile up in its memory.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from hgraph.errors import HGraphError
from hgraph.runtime.checkpoint import dcp_format
from hgraph.runtime.checkpoint import manifest as ckpt
from hgraph.shard_rule import shard_bounds


class CheckpointMasters:
    """The master parameters of one checkpoint folder (a root: its newest complete checkpoint).

    ``unmap_after``: bytes of rows read through the open memory maps after which every file is
    closed (and mapped again when next needed), bounding the pages a reader keeps resident; None:
    files stay open until ``close``.
    """

    def __init__(self, path: Any, step: Optional[int] = None, *, verify: bool = True,
                 unmap_after: Optional[int] = None) -> None:
        root, folder = ckpt.resolve_checkpoint(path, step)
        folder = folder or ckpt.latest(root)
        if folder is None:
            raise HGraphError(f"no complete checkpoint in {str(root)!r}")
        self.folder: Path = folder
        self.manifest = ckpt.read_manifest(folder)
        self.saved_world_size = int(self.manifest["world_size"])
        self.entries = self.manifest["shards"]
        self.run: dict = dict(self.manifest.get("run", {}))
        model = self.run.get("model")
        self.description = f"checkpoint {str(folder)!r}" + (f" (of model {model})" if model else "")
        self._verify, self._unmap_after, self._mapped_bytes = verify, unmap_after, 0
        self._files: dict[int, dict] = {}
        self._verified: set[int] = set()
        self._dcp = ckpt.is_dcp(self.manifest)
        if self._dcp:
            for entry in self.entries if verify else ():
                ckpt.check_file(folder, entry, verify=True)
            shapes = dcp_format.tensor_shapes(folder)
            self.shapes = {k[len("model."):]: s for k, s in shapes.items() if k.startswith("model.")}
            self.dims = dict(self.manifest["optimizer"]["shard_dims"])
            return
        if len(self.entries) != self.saved_world_size:
            raise HGraphError(f"checkpoint manifest {str(folder / ckpt.MANIFEST)!r} lists {len(self.entries)} "
                              f"shard files for world size {self.saved_world_size}")
        first = self._shard(0)
        #: every parameter's full shape (the optimizer's names: tied aliases once)
        self.shapes: dict[str, tuple[int, ...]] = {n: tuple(s) for n, s in first["full_shapes"].items()}
        self.dims: dict[str, int] = dict(first["optimizer"]["shard_dims"])

    def _shard(self, rank: int) -> dict:
        """Saved rank ``rank``'s shard file (memory-mapped; size and SHA-256 checked the first time)."""
        if rank not in self._files:
            verify = self._verify and rank not in self._verified
            self._files[rank] = ckpt.read_shard(self.folder, self.entries[rank], verify)
            self._verified.add(rank)
        return self._files[rank]

    def close(self) -> None:
        """Drop the opened shard files (their memory maps); ``read`` opens them again if asked."""
        self._files.clear()
        self._mapped_bytes = 0

    def where(self, name: str) -> str:
        """The file a message about ``name`` names (the shard file of saved rank 0, or the DCP folder)."""
        return str(self.folder) if self._dcp else str(self.folder / self.entries[0]["name"])

    def read(self, name: str, dim: Optional[int] = None, lo: int = 0, hi: Optional[int] = None) -> torch.Tensor:
        """``name``'s full tensor (``dim`` None), or its rows ``[lo, hi)`` along ``dim`` (a 0-d
        parameter is handled as shape [1], as the optimizer does); a new tensor, not a file view."""
        full_shape = self.shapes[name]
        shape = full_shape or (1,)
        saved_dim = self.dims[name]
        if self._dcp:
            return dcp_format.read_rows(self.folder, f"model.{name}", full_shape, dim, lo, hi)
        if dim is None or dim != saved_dim:
            # the whole tensor, gathered from every saved piece (one parameter), then narrowed when asked
            full = self._rows(name, saved_dim, 0, shape[saved_dim], shape)
            if dim is None:
                return full.reshape(full_shape)
            return full.narrow(dim, lo, (shape[dim] if hi is None else hi) - lo).clone()
        return self._rows(name, dim, lo, shape[dim] if hi is None else hi, shape)

    def _rows(self, name: str, dim: int, lo: int, hi: int, shape: tuple[int, ...]) -> torch.Tensor:
        """Rows ``[lo, hi)`` along the saved shard dimension ``dim``, copied piece by piece from the
        saved ranks that hold them into one new tensor."""
        out_shape = list(shape)
        out_shape[dim] = hi - lo
        out = torch.empty(out_shape, dtype=torch.float32)
        for r in range(self.saved_world_size):
            rlo, rhi = shard_bounds(shape[dim], r, self.saved_world_size)
            a, b = max(lo, rlo), min(hi, rhi)
            if a >= b:
                continue
            params = self._shard(r)["optimizer"]["params"]
            if name not in params:
                raise HGraphError(f"checkpoint shard file {str(self.folder / self.entries[r]['name'])!r} has no "
                                  f"parameter {name!r} although the checkpoint's first shard does")
            piece = params[name].narrow(dim, a - rlo, b - a)
            out.narrow(dim, a - lo, b - a).copy_(piece)
            self._mapped_bytes += piece.numel() * piece.element_size()
        if self._unmap_after is not None and self._mapped_bytes >= self._unmap_after:
            self.close()
        return out
