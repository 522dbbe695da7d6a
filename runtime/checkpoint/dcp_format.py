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
dimension (``shard_bounds``), so the rows of consecutive ranks are a rectangular chunk of the full
tensor. The first shard group's ranks gather each master and moment into chunks of at least 64 MiB,
each the rows of a block of ranks written by one of them (``coalesce``: the ``.metadata`` does not grow
with the world), the chunks of a ``ShardedTensor``. The one thing DCP does not carry is the shard
dimension itself, kept in the checkpoint's ``manifest.json`` with the hyper-parameters.

Reading a rank's rows (``read_rows``, ``load_optimizer_state``) asks DCP for those rows only, and
reads only their bytes (``rows_read``).
"""
from __future__ import annotations

import io
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.staging import AsyncStager

from hgraph.errors import HGraphError
from hgraph.runtime.checkpoint import coalesce
from hgraph.runtime.checkpoint.rows_read import Rows, RowsPlanner, RowsReader
from hgraph.runtime.engine.optimizer import ShardedAdam
from hgraph.shard_rule import shard_bounds

METADATA = ".metadata"
_MOMENTS = ("exp_avg", "exp_avg_sq")


def rank_file_name(rank: int) -> str:
    """The data file DCP's file-system writer gives ``rank`` (one file per rank)."""
    return f"__{rank}_0.distcp"


def is_dcp_folder(folder: Path) -> bool:
    """Whether ``folder`` holds a DCP checkpoint (its ``.metadata``)."""
    return (Path(folder) / METADATA).is_file()


def _distributed(group: Optional[dist.ProcessGroup]) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _chunked(local: torch.Tensor, entry: coalesce.Entry, rank: int, group: Optional[dist.ProcessGroup],
             chunks: Sequence[coalesce.Chunk] = (), mine: Optional[torch.Tensor] = None):
    """An entry as DCP writes it: a ShardedTensor whose global metadata lists the entry's chunks
    (``coalesce.chunks``, computed here, no collective) and holds the one this rank writes (``mine``,
    gathered by ``coalesce.gather_chunks``), or this rank's tensor itself on one rank."""
    if not _distributed(group):
        return local.reshape(entry.full_shape)
    metas = []
    for c in chunks:
        offsets, sizes = [0] * len(entry.shape), list(entry.shape)
        offsets[entry.dim], sizes[entry.dim] = c.lo, c.hi - c.lo
        metas.append(ShardMetadata(offsets, sizes, f"rank:{c.writer}/cpu"))
    own = [Shard(mine.reshape(m.shard_sizes), m) for m in metas if mine is not None and m.placement.rank() == rank]
    props = TensorProperties(dtype=local.dtype, layout=local.layout, requires_grad=False,
                             memory_format=torch.contiguous_format, pin_memory=False)
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        own, ShardedTensorMetadata(metas, torch.Size(entry.shape), props), process_group=group)


def save_state(optimizer: ShardedAdam, rank: int, world_size: int, rng: Mapping[str, Any], group: Optional[dist.ProcessGroup] = None,
               min_chunk_bytes: int = coalesce.MIN_CHUNK_BYTES) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)      # ShardedTensor's deprecation
        return _save_state(optimizer, rank, world_size, rng, group, min_chunk_bytes)


def _save_state(optimizer: ShardedAdam, rank: int, world_size: int, rng: Mapping[str, Any],
                group: Optional[dist.ProcessGroup], min_chunk_bytes: int) -> dict:
    """The DCP state dict of this rank: the chunks of masters and moments it writes (the first shard
    group's ranks gather them, ``coalesce``), step counts, hyper-parameters and RNG states."""
    state = optimizer.state_dict()
    shared = writes_shared(rank)
    group_size = getattr(optimizer, "group_size", world_size)
    entries, tensors = [], []
    for i, (name, layout) in enumerate(optimizer.layouts.items()):
        for k, key in enumerate(("params",) + _MOMENTS):
            t = state[key][name]
            entries.append(coalesce.Entry(3 * i + k, tuple(layout.full_shape), layout.dim, t.element_size()))
            tensors.append(t)
    distributed = _distributed(group)
    # the first shard group writes (every group holds the same states), so the checkpoint has the same
    # entries whatever G is; the other groups' ranks write none of them
    mine = (coalesce.gather_chunks(entries, tensors, rank, group_size, group, min_chunk_bytes)
            if distributed and rank < group_size else {})
    chunked = [_chunked(t, e, rank, group, coalesce.chunks(e, group_size, min_chunk_bytes) if distributed else (),
                        mine.get(e.item)) for e, t in zip(entries, tensors)]
    model, optim = {}, {}
    for i, name in enumerate(optimizer.layouts):
        model[name] = chunked[3 * i]
        optim[name] = {key: chunked[3 * i + 1 + k] for k, key in enumerate(_MOMENTS)}
        if shared:
            optim[name]["step"] = torch.tensor(float(state["steps"][name]))
    buf = io.BytesIO()
    torch.save(dict(rng), buf)              # one bytes entry: DCP would split a dict into entries
    out = {"model": model, "optim": {"state": optim}, "rng": {f"rank-{rank:05d}": buf.getvalue()}}
    if shared:
        out["optim"]["param_groups"] = [adam_group(state["hyper"], optimizer.layouts)]
    return out


def writes_shared(rank: int) -> bool:
    """Whether ``rank`` writes the entries every rank holds alike (the step counts, Adam's parameter
    group): rank 0 only. DCP's default plan has every rank add its plain entries and the coordinator
    drop the duplicates, so rank 0 would gather them from every rank at each save: with 723
    parameters, 1.4 GB of plans at 12,288 ranks (``python -m hgraph.tools.bench.cluster_scale --counts``)."""
    return rank == 0


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


def save(folder: Path, optimizer: ShardedAdam, rank: int, world_size: int, rng: Mapping[str, Any], group: Optional[dist.ProcessGroup] = None,
         *, asynchronous: bool = False, min_chunk_bytes: int = coalesce.MIN_CHUNK_BYTES):
    """Write this rank's part of the DCP checkpoint into ``folder`` (collective over ``group``; the
    chunks are gathered first, point to point inside blocks of ranks, ``coalesce``).
    ``asynchronous``: stage the tensors and write in a background thread; returns its future."""
    state = save_state(optimizer, rank, world_size, rng, group, min_chunk_bytes)
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


def read_metadata(folder: Path) -> Any:
    """The checkpoint's ``.metadata`` (DCP's ``Metadata``), read once for all a load asks: every rank
    reads it on resume (a chunk per parameter, moment and writing rank made it 319 MB for 70B at 1,024
    ranks; coalesced chunks, ``coalesce``, keep it to a few MB)."""
    try:
        return dcp.FileSystemReader(str(folder)).read_metadata()
    except Exception as exc:  # noqa: BLE001 - a missing or corrupt .metadata
        raise HGraphError(f"DCP checkpoint {str(folder)!r}: cannot read {METADATA}: {type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''}") from None


def tensor_shapes(folder: Path, metadata: Any = None) -> dict[str, tuple[int, ...]]:
    """Every tensor entry of a DCP checkpoint and its full shape (its metadata only; ``metadata``: the
    one already read)."""
    meta = metadata if metadata is not None else read_metadata(folder)
    return {k: tuple(v.size) for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def _row_shape(shape: tuple[int, ...], dim: int, lo: int, hi: int) -> list[int]:
    out = list(shape)
    out[dim] = hi - lo
    return out


def read_tensor(folder: Path, key: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The full tensor of entry ``key`` (one process, no collective)."""
    out = torch.empty(shape, dtype=dtype)
    load_flat({key: out}, folder)
    return out


def read_rows(folder: Path, key: str, shape: tuple[int, ...], dim: Optional[int] = None, lo: int = 0,
              hi: Optional[int] = None) -> torch.Tensor:
    """Entry ``key``'s full tensor (``dim`` None), or its rows ``[lo, hi)`` along ``dim`` (a 0-d
    tensor handled as shape [1], as the optimizer does), in fp32; only those rows are asked of DCP
    (``RowsPlanner``)."""
    if dim is None:
        return read_tensor(folder, key, shape)
    if not shape:           # one element: read whole, as [1]
        return read_tensor(folder, key, shape).reshape(1).narrow(0, lo, (1 if hi is None else hi) - lo).clone()
    hi = shape[dim] if hi is None else hi
    out = torch.empty(_row_shape(shape, dim, lo, hi))
    load_flat({key: out}, folder, {key: (dim, lo, hi)})
    return out


def load_flat(flat: dict, folder: Path, rows: Optional[Mapping[str, Rows]] = None, metadata: Any = None) -> None:
    reader = RowsReader(str(folder))
    reader.known_metadata = metadata
    try:
        with warnings.catch_warnings():      # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(flat, storage_reader=reader, no_dist=True, planner=RowsPlanner(rows) if rows else None)
    except Exception as exc:  # noqa: BLE001 - DCP wraps file errors in CheckpointException
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise HGraphError(f"DCP checkpoint {str(folder)!r} cannot be read: {first}") from None


def read_rng(folder: Path, rank: int, metadata: Any = None) -> Optional[dict]:
    """The RNG states saved by ``rank`` (None when the checkpoint has none for it); ``metadata``: the
    checkpoint's, read already."""
    key = f"rng.rank-{rank:05d}"
    if metadata is None:
        try:
            metadata = dcp.FileSystemReader(str(folder)).read_metadata()
        except Exception:  # noqa: BLE001
            return None
    if key not in metadata.state_dict_metadata:
        return None
    flat = {key: b""}
    load_flat(flat, folder, metadata=metadata)     # DCP puts the saved object in place of the placeholder
    return torch.load(io.BytesIO(flat[key]), weights_only=True)


@dataclass(frozen=True)
class EntryNames:
    """How a checkpoint names a parameter's entries: ``model`` + name for its weights, ``optim`` +
    ``state.<name>.exp_avg`` etc. for Adam's state (hgraph's and torchtitan's: ``model.``, ``optim.``)."""

    model: str = "model."
    optim: str = "optim."

    def weights(self, name: str) -> str:
        return f"{self.model}{name}"

    def state(self, name: str, key: str) -> str:
        return f"{self.optim}state.{name}.{key}"


def load_optimizer_state(folder: Path, rank: int, world_size: int, shard_dims: Mapping[str, int],
                         hyper: Mapping[str, Any], names: EntryNames = EntryNames(),
                         what: str = "DCP checkpoint", metadata: Any = None) -> tuple[dict, dict]:
    """This rank's ``ShardedAdam.state_dict()`` cut from the DCP checkpoint (any saved world size),
    and every parameter's full shape: one ``dcp.load`` that asks only for this rank's rows of every
    master and moment (``RowsPlanner``) and every step count. A missing entry is an HGraphError
    naming it (``what`` starts the message); ``metadata``: the checkpoint's, read already (else read
    here, once)."""
    metadata = metadata if metadata is not None else read_metadata(folder)
    shapes = tensor_shapes(folder, metadata)
    out: dict[str, Any] = {"rank": rank, "world_size": world_size, "shard_dims": dict(shard_dims),
                           "hyper": dict(hyper), "steps": {}, "params": {}, "exp_avg": {}, "exp_avg_sq": {}}
    full_shapes, flat, rows = {}, {}, {}

    def entry(key: str) -> tuple[int, ...]:
        if key not in shapes:
            raise HGraphError(f"{what} {str(folder)!r} has no entry {key!r}")
        return shapes[key]

    for name, dim in shard_dims.items():
        full_shapes[name] = shape = entry(names.weights(name))
        keys = {"params": names.weights(name), "exp_avg": names.state(name, "exp_avg"),
                "exp_avg_sq": names.state(name, "exp_avg_sq")}
        for target, key in keys.items():
            if entry(key) != shape:
                raise HGraphError(f"{what} {str(folder)!r}: entry {key!r} has shape {list(entry(key))}, "
                                  f"{names.weights(name)!r} has {list(shape)}")
            if shape:
                lo, hi = shard_bounds(shape[dim], rank, world_size)
                flat[key] = torch.empty(_row_shape(shape, dim, lo, hi))
                rows[key] = (dim, lo, hi)
            else:             # a 0-d parameter: one element, read whole (the optimizer holds it as [1])
                flat[key] = torch.empty(())
        step_key = names.state(name, "step")
        if entry(step_key) not in ((), (1,)):
            raise HGraphError(f"{what} {str(folder)!r}: entry {step_key!r} has shape {list(entry(step_key))}, "
                              "a step count is one number")
        flat[step_key] = torch.zeros(entry(step_key))
    load_flat(flat, folder, rows, metadata)
    for name, dim in shard_dims.items():
        shape = full_shapes[name]
        for target, key in (("params", names.weights(name)), ("exp_avg", names.state(name, "exp_avg")),
                            ("exp_avg_sq", names.state(name, "exp_avg_sq"))):
            if shape:
                out[target][name] = flat[key]
            else:
                lo, hi = shard_bounds(1, rank, world_size)
                out[target][name] = flat[key].reshape(1).narrow(0, lo, hi - lo).clone()
        out["steps"][name] = float(flat[names.state(name, "step")].reshape(()))
    return out, full_shapes
