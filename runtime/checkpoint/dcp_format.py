"""The tensors of a checkpoint in ``torch.distributed.checkpoint`` (DCP) form.

A checkpoint folder is a DCP checkpoint (``.metadata`` and one ``__R_0.distcp`` file per saving
rank) whose entries are keyed by the model's parameter names (FQNs) in full-tensor shapes, as
torchtitan and ``torch.distributed.checkpoint.state_dict`` key them:

* ``model.<fqn>``: the fp32 master parameters;
* ``optim.state.<fqn>.exp_avg`` / ``.exp_avg_sq`` / ``.step`` and ``optim.param_groups``: Adam's
  state as ``get_optimizer_state_dict`` gives it (one group holding every parameter);
* ``rng.rank-RRRRR``: each saving rank's RNG states (a bytes entry).

So ``dcp.load({"model": model.state_dict()}, checkpoint_id=DIR)`` fills a plain single-process
model, at any world size, and Adam's state loads the same way.

How the optimizer's layout maps onto DCP: hgraph shards every parameter evenly along one shard
dimension over all N ranks (``shard_bounds``), so a rank's piece is a rectangular chunk of the full
tensor (offset ``lo`` along that dimension) and is written as one chunk of a ``ShardedTensor``; a
rank whose range is empty (fewer rows than ranks) writes no chunk. The one thing DCP does not carry
is the shard dimension itself, which only matters for reading a rank's range back: it is kept in the
checkpoint's ``manifest.json`` with the hyper-parameters. Reading (``read_tensor``) takes one
parameter's full tensor at a time and narrows it to the range asked for.
"""
from __future__ import annotations

import io
import warnings
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.staging import AsyncStager

from hgraph.errors import HGraphError
from hgraph.shard_rule import shard_bounds

METADATA = ".metadata"
_MOMENTS = ("exp_avg", "exp_avg_sq")


def rank_file_name(rank: int) -> str:
    """The data file DCP's file-system writer gives ``rank`` (one file per rank)."""
    return f"__{rank}_0.distcp"


def is_dcp_folder(folder: Path) -> bool:
    """Whether ``folder`` holds a DCP checkpoint (its ``.metadata``)."""
    return (Path(folder) / METADATA).is_file()


def _distributed(group: Any) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _chunked(local: torch.Tensor, full_shape: tuple, dim: int, rank: int, world_size: int, group: Any):
    """This rank's piece as a chunk of the full tensor: a ShardedTensor whose global metadata lists
    every rank's rows (computed here, no collective), or the tensor itself on one rank."""
    if not _distributed(group):
        return local.reshape(full_shape)
    shape = tuple(full_shape) or (1,)
    metas = []
    for r in range(world_size):
        lo, hi = shard_bounds(shape[dim], r, world_size)
        if hi > lo:
            offsets, sizes = [0] * len(shape), list(shape)
            offsets[dim], sizes[dim] = lo, hi - lo
            metas.append(ShardMetadata(offsets, sizes, f"rank:{r}/cpu"))
    mine = [Shard(local.reshape(m.shard_sizes), m) for m in metas if m.placement.rank() == rank]
    props = TensorProperties(dtype=local.dtype, layout=local.layout, requires_grad=False,
                             memory_format=torch.contiguous_format, pin_memory=False)
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        mine, ShardedTensorMetadata(metas, torch.Size(shape), props), process_group=group)


def save_state(optimizer: Any, rank: int, world_size: int, rng: Mapping[str, Any], group: Any = None) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)      # ShardedTensor's deprecation
        return _save_state(optimizer, rank, world_size, rng, group)


def _save_state(optimizer: Any, rank: int, world_size: int, rng: Mapping[str, Any], group: Any = None) -> dict:
    """The DCP state dict of this rank: its master and moment chunks, step counts, hyper-parameters
    and RNG states."""
    state = optimizer.state_dict()
    model, optim = {}, {}
    for name, layout in optimizer.layouts.items():
        def chunk(t):
            return _chunked(t, layout.full_shape, layout.dim, rank, world_size, group)
        model[name] = chunk(state["params"][name])
        optim[name] = {key: chunk(state[key][name]) for key in _MOMENTS}
        optim[name]["step"] = torch.tensor(float(state["steps"][name]))
    buf = io.BytesIO()
    torch.save(dict(rng), buf)              # one bytes entry: DCP would split a dict into entries
    return {"model": model, "optim": {"state": optim, "param_groups": [adam_group(state["hyper"], optimizer.layouts)]},
            "rng": {f"rank-{rank:05d}": buf.getvalue()}}


def adam_group(hyper: Mapping[str, Any], names) -> dict:
    """The one parameter group, with every key the installed ``torch.optim.Adam`` has, so that
    ``get_optimizer_state_dict``'s form of a plain Adam (or AdamW) loads from it."""
    group = dict(torch.optim.Adam([torch.zeros(1)]).defaults)
    group.update(lr=hyper["lr"], betas=tuple(hyper["betas"]), eps=hyper["eps"], weight_decay=hyper["weight_decay"])
    if "decoupled_weight_decay" in group:
        group["decoupled_weight_decay"] = bool(hyper.get("decoupled_weight_decay", False))
    group["params"] = list(names)
    return group


class _AlreadyStaged(AsyncStager):
    """``save_state`` builds its tensors from ``ShardedAdam.state_dict()``, which copies them: what
    async_save writes is already safe from the next steps, so staging passes it on as it is (the
    default stager would copy it again, and cannot copy a ShardedTensor)."""

    _synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def save(folder: Path, optimizer: Any, rank: int, world_size: int, rng: Mapping[str, Any], group: Any = None,
         *, asynchronous: bool = False):
    """Write this rank's part of the DCP checkpoint into ``folder`` (collective over ``group``).
    ``asynchronous``: stage the tensors and write in a background thread; returns its future."""
    state = save_state(optimizer, rank, world_size, rng, group)
    no_dist = not _distributed(group)
    with warnings.catch_warnings():
        # one process saving alone is what no_dist says; ShardedTensor is what DCP writes uneven chunks from
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", FutureWarning)
        if asynchronous:
            return dcp.async_save(state, checkpoint_id=str(folder), process_group=group, no_dist=no_dist,
                                  async_stager=_AlreadyStaged())
        dcp.save(state, checkpoint_id=str(folder), process_group=group, no_dist=no_dist)
    return None


def tensor_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor entry of a DCP checkpoint and its full shape (its metadata only)."""
    try:
        meta = dcp.FileSystemReader(str(folder)).read_metadata()
    except Exception as exc:  # noqa: BLE001 - a missing or corrupt .metadata
        raise HGraphError(f"DCP checkpoint {str(folder)!r}: cannot read {METADATA}: {type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
    return {k: tuple(v.size) for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def read_tensor(folder: Path, key: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The full tensor of entry ``key`` (one process, no collective)."""
    out = torch.empty(shape, dtype=dtype)
    _load({key: out}, folder)
    return out


def read_rows(folder: Path, key: str, shape: tuple[int, ...], dim: Optional[int] = None, lo: int = 0,
              hi: Optional[int] = None) -> torch.Tensor:
    """Entry ``key``'s full tensor (``dim`` None), or its rows ``[lo, hi)`` along ``dim`` (a 0-d
    tensor handled as shape [1], as the optimizer does); read whole, then narrowed into a copy."""
    full = read_tensor(folder, key, shape)
    if dim is None:
        return full
    rows = full.reshape(shape or (1,))
    return rows.narrow(dim, lo, (rows.shape[dim] if hi is None else hi) - lo).clone()


def _load(flat: dict, folder: Path) -> None:
    try:
        with warnings.catch_warnings():      # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(flat, checkpoint_id=str(folder), no_dist=True)
    except Exception as exc:  # noqa: BLE001 - DCP wraps file errors in CheckpointException
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise HGraphError(f"DCP checkpoint {str(folder)!r} cannot be read: {first}") from None


def read_rng(folder: Path, rank: int) -> Optional[dict]:
    """The RNG states saved by ``rank`` (None when the checkpoint has none for it)."""
    key = f"rng.rank-{rank:05d}"
    try:
        meta = dcp.FileSystemReader(str(folder)).read_metadata()
    except Exception:  # noqa: BLE001
        return None
    if key not in meta.state_dict_metadata:
        return None
    flat = {key: b""}
    _load(flat, folder)                      # DCP puts the saved object in place of the placeholder
    return torch.load(io.BytesIO(flat[key]), weights_only=True)


def load_optimizer_state(folder: Path, rank: int, world_size: int, shard_dims: Mapping[str, int],
                         hyper: Mapping[str, Any]) -> tuple[dict, dict]:
    """This rank's ``ShardedAdam.state_dict()`` cut from the DCP checkpoint (any saved world size),
    and every parameter's full shape."""
    shapes = tensor_shapes(folder)
    out: dict[str, Any] = {"rank": rank, "world_size": world_size, "shard_dims": dict(shard_dims),
                           "hyper": dict(hyper), "steps": {}, "params": {}, "exp_avg": {}, "exp_avg_sq": {}}
    full_shapes = {}
    for name, dim in shard_dims.items():
        key = f"model.{name}"
        if key not in shapes:
            raise HGraphError(f"DCP checkpoint {str(folder)!r} has no entry {key!r}")
        full_shapes[name] = shape = shapes[key]
        rows = (shape or (1,))
        lo, hi = shard_bounds(rows[dim], rank, world_size)
        # one DCP read per parameter: its master, both moments and its step count
        entries = {"params": key, "exp_avg": f"optim.state.{name}.exp_avg",
                   "exp_avg_sq": f"optim.state.{name}.exp_avg_sq"}
        flat = {entry: torch.empty(shape) for entry in entries.values()}
        step_key = f"optim.state.{name}.step"
        flat[step_key] = torch.zeros(())
        _load(flat, folder)
        for target, entry in entries.items():
            out[target][name] = flat[entry].reshape(rows).narrow(dim, lo, hi - lo).clone()
        out["steps"][name] = float(flat[step_key])
    return out, full_shapes
