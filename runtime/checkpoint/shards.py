"""Saving and loading a rank's optimizer state in checkpoints that do not depend on the parallel
strategy (Hydraulis §5.2: the optimizer layout is the same for every strategy, so nothing here names a
strategy).

What ``save`` writes into ``ROOT/step-SSSSSSSS/`` (collective: every rank calls it):

* the DCP checkpoint (format 2, ``dcp_format``): the fp32 masters, Adam's moments and step counts keyed
  by parameter name in full-tensor shapes, the ranks' rows coalesced into chunks (``coalesce``), and
  every rank's RNG states (``rng_state``); ``dcp.load`` reads it into a plain model at any world size;
* then, once every rank's files are in place, rank 0's ``manifest.json`` (``manifest``: the files'
  sizes and SHA-256, shard dimensions and hyper-parameters, and the run's JSON state). A step folder
  without a valid manifest is incomplete and ``latest`` skips it, so a crash mid-save leaves the
  previous checkpoint usable. Several ranks must see one shared folder. ``save_async`` writes the
  tensors in a background thread.

Format 1 (one ``rank-RRRRR-of-NNNNN.pt`` per rank holding that rank's ``ShardedAdam.state_dict()`` and
RNG states) is still read, and written by ``write_shard`` (then ``manifest.write_manifest`` on rank 0)
for tools that assemble a checkpoint without processes; ``hgraph export`` and ``--init-from`` read both.

``load`` returns this rank's optimizer state in ``ShardedAdam.state_dict()`` form. When the world size
or shard group differs from the saved one it re-shards: a DCP checkpoint gives this rank's rows
(``dcp_format.load_optimizer_state``); per-rank files are read (memory-mapped) only where their ranges
overlap this rank's new range, concatenated and re-sliced with ``shard_bounds``. Adam step counts come
along (they must agree across the saved ranks of a parameter). A file that is missing, truncated or
altered gives an ``HGraphError`` naming it; ``fallback=True`` then uses the newest older complete
checkpoint instead (with a warning).
"""
from __future__ import annotations

import hashlib
import io
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist

from hgraph.errors import HGraphError
from hgraph.runtime.checkpoint import coalesce, dcp_format
from hgraph.runtime.checkpoint.manifest import (FORMAT_VERSION, MANIFEST, STEP_DIR, PathLike, atomic_write,
                                                check_file, complete_steps, is_dcp, json_state, latest,
                                                read_manifest, read_shard, resolve_checkpoint, shard_file_name,
                                                step_dir, write_dcp_manifest)
from hgraph.runtime.checkpoint.rng_state import capture_rng
from hgraph.runtime.engine.optimizer import ShardedAdam
from hgraph.shard_rule import shard_bounds

MOMENT_KEYS = ("params", "exp_avg", "exp_avg_sq")

@dataclass
class Checkpoint:
    """What ``load`` returns for one rank.

    ``optimizer``: a state for ``ShardedAdam.load_state_dict`` of (rank, world_size) of the reader;
    ``rng``: the saved RNG states of the same rank (None when that rank did not exist in the saved
    run; pass to ``restore_rng``); ``resharded``: True when the saved world size differed;
    ``full_shapes``: each parameter's full shape; ``foreign``: see the field.
    """

    path: Path
    step: int
    saved_world_size: int
    optimizer: dict
    data_position: dict = field(default_factory=dict)
    delay_queues: dict = field(default_factory=dict)
    planner_state: dict = field(default_factory=dict)
    run: dict = field(default_factory=dict)
    rng: Optional[dict] = None
    resharded: bool = False
    full_shapes: dict = field(default_factory=dict)
    # a DCP checkpoint written by another program (``foreign.ForeignCheckpoint``): ``optimizer`` is
    # then None and is read once the optimizer exists (``run.restore_state``)
    foreign: Any = None


# ---- saving ------------------------------------------------------------------------------------
def write_shard(folder: Path, rank: int, world_size: int, step: int, optimizer: ShardedAdam,
                rng: Mapping[str, Any]) -> dict:
    """Write this rank's shard file atomically; returns its manifest entry (name, bytes, sha256).

    ``save`` calls it on every rank before rank 0 writes the manifest.
    """
    if getattr(optimizer, "shard_group", None) is not None:
        raise HGraphError("checkpoint: per-rank shard files (format 1) hold the layout over the whole world; "
                          f"this optimizer shards over groups of {optimizer.shard_group} ranks: save with "
                          "save (DCP), which takes any shard group")
    buf = io.BytesIO()
    full_shapes = {n: list(lay.full_shape) for n, lay in optimizer.layouts.items()}
    torch.save({"format": FORMAT_VERSION, "step": step, "rank": rank, "world_size": world_size,
                "optimizer": optimizer.state_dict(), "full_shapes": full_shapes, "rng": dict(rng)}, buf)
    data = buf.getvalue()
    name = shard_file_name(rank, world_size)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write(folder / name, data)
    return {"name": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _barrier(world_size: int, group: Optional[dist.ProcessGroup]) -> None:
    if world_size > 1:
        dist.barrier(group=group)


def save(root: PathLike, step: int, optimizer: ShardedAdam, *, rank: int = 0, world_size: int = 1,
         data_position: Optional[Mapping[str, Any]] = None, delay_queues: Optional[Mapping[str, Any]] = None,
         planner_state: Optional[Mapping[str, Any]] = None, run: Optional[Mapping[str, Any]] = None,
         keep_last: Optional[int] = None, group: Optional[dist.ProcessGroup] = None,
         min_chunk_bytes: int = coalesce.MIN_CHUNK_BYTES) -> Path:
    """Save the checkpoint of ``step`` under ``root`` (collective: every rank calls it); returns its folder.

    ``optimizer``: this rank's ``ShardedAdam``; ``data_position`` (e.g. next document index and
    step), ``delay_queues`` and ``planner_state``: JSON-ready dicts, the same on every rank (rank 0's
    are stored). ``keep_last``: once this one is complete, delete older complete checkpoints so that
    ``keep_last`` remain up to this step (at least 2, so a fallback stays possible); later steps are
    left alone. Re-saving an existing step replaces it (it is incomplete while being rewritten).
    Returns after the manifest is in place on every rank. ``min_chunk_bytes``: the least bytes of a
    chunk the ranks' rows are coalesced into (``coalesce``: the ``.metadata`` does not grow with the world).
    """
    state = _run_state(step, keep_last, data_position, delay_queues, planner_state, run)
    return _start(root, step, optimizer, rank, world_size, keep_last, group, state,
                  min_chunk_bytes=min_chunk_bytes).wait()


def _run_state(step, keep_last, data_position, delay_queues, planner_state, run) -> dict:
    """The manifest's JSON state of a save, its arguments checked (one-line errors)."""
    if step < 0:
        raise HGraphError(f"checkpoint: step must be >= 0, got {step}")
    if keep_last is not None and keep_last < 2:
        raise HGraphError(f"checkpoint: keep_last must be >= 2 (a fallback needs the previous one), "
                          f"got {keep_last}")
    return {"data_position": json_state("data_position", data_position),
            "delay_queues": json_state("delay_queues", delay_queues),
            "planner_state": json_state("planner_state", planner_state),
            "run": json_state("run", run)}


def save_async(root: PathLike, step: int, optimizer: ShardedAdam, *, rank: int = 0, world_size: int = 1,
               data_position: Optional[Mapping[str, Any]] = None, delay_queues: Optional[Mapping[str, Any]] = None,
               planner_state: Optional[Mapping[str, Any]] = None, run: Optional[Mapping[str, Any]] = None,
               async_group: Optional[dist.ProcessGroup] = None, keep_last: Optional[int] = None, group: Optional[dist.ProcessGroup] = None,
               min_chunk_bytes: int = coalesce.MIN_CHUNK_BYTES) -> "PendingCheckpoint":
    """``save`` whose tensors are written in a background thread: returns once they are staged (copied),
    so training goes on; ``PendingCheckpoint.wait()`` (collective, every rank at the same point:
    before the next save and at the end of the run) completes it with the manifest. ``async_group``:
    a process group of all ranks that only checkpointing uses (the background thread's collectives
    must not interleave with training's on the same group)."""
    state = _run_state(step, keep_last, data_position, delay_queues, planner_state, run)
    return _start(root, step, optimizer, rank, world_size, keep_last, group, state, asynchronous=True,
                  async_group=async_group, min_chunk_bytes=min_chunk_bytes)


@dataclass
class PendingCheckpoint:
    """A save under way (``save_async``): ``wait`` finishes it, collectively, and writes the manifest."""

    folder: Path
    future: Any
    finish: Any

    def wait(self) -> Path:
        if self.future is not None:
            self.future.result()     # this rank's file written (and on rank 0, DCP's .metadata)
        self.finish()
        return self.folder


def _start(root, step, optimizer, rank, world_size, keep_last, group, state, *, asynchronous: bool = False,
           async_group: Optional[dist.ProcessGroup] = None,
           min_chunk_bytes: int = coalesce.MIN_CHUNK_BYTES) -> PendingCheckpoint:
    folder = step_dir(root, step)
    if rank == 0:
        # Re-saving a step: its old manifest and files go first, so the folder is never "complete"
        # with a mix (DCP would also read a stale rank's file back)
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True, exist_ok=True)
    _barrier(world_size, group)
    layout = {"shard_dims": {n: lay.dim for n, lay in optimizer.layouts.items()},
              "hyper": optimizer.state_dict()["hyper"],
              "shard_group": getattr(optimizer, "group_size", world_size)}
    future = dcp_format.save(folder, optimizer, rank, world_size, capture_rng(),
                             async_group if async_group is not None else group, asynchronous=asynchronous,
                             min_chunk_bytes=min_chunk_bytes)

    def finish() -> None:
        _barrier(world_size, group)          # every rank's files are in place
        if rank == 0:
            write_dcp_manifest(folder, step, world_size, layout, **state)
            if keep_last is not None:
                # only checkpoints older than this one: later steps (another run's) are never touched
                older = [s for s in complete_steps(root) if s < step]
                for old in older[: max(len(older) - (keep_last - 1), 0)]:
                    shutil.rmtree(step_dir(root, old), ignore_errors=True)
        _barrier(world_size, group)
    return PendingCheckpoint(folder, future, finish)


def load(path: PathLike, rank: int = 0, world_size: int = 1, *, step: Optional[int] = None,
         fallback: bool = False, verify: bool = True, shard_group: Optional[int] = None) -> Checkpoint:
    """Load a checkpoint for ``rank`` of ``world_size`` (re-sharding when the saved world size differs).

    ``shard_group``: the reader's optimizer shards over groups of that many ranks (``--shard-group``;
    None: the world): the rank reads the rows of its place in its group, whatever layout wrote them.

    ``path``: a checkpoint root (the newest complete checkpoint, or ``step``) or one step folder.
    ``verify``: check each shard file read against the manifest's SHA-256 (size is always checked).
    ``fallback``: when the chosen checkpoint is broken, use the newest older complete one (warning).
    Not collective: each rank reads the files it needs.
    """
    if not 0 <= rank < world_size:
        raise HGraphError(f"checkpoint: rank {rank} is outside world size {world_size}")
    if shard_group is not None and (shard_group < 1 or world_size % shard_group):
        raise HGraphError(f"checkpoint: shard group {shard_group} does not divide world size {world_size}")
    root, folder = resolve_checkpoint(path, step)
    if folder is None:
        folder = latest(root)
        if folder is None:
            raise HGraphError(f"no complete checkpoint in {str(root)!r}")
    try:
        loaded = _load_folder(folder, rank % (shard_group or world_size), shard_group or world_size, verify, rank)
    except HGraphError as exc:
        if not fallback:
            raise
        this = int(STEP_DIR.match(folder.name).group(1)) if STEP_DIR.match(folder.name) else None
        older = [s for s in complete_steps(root) if this is None or s < this]
        if not older:
            raise HGraphError(f"{exc}; no older complete checkpoint to fall back to") from None
        warnings.warn(f"{exc}; falling back to the checkpoint of step {older[-1]}", RuntimeWarning,
                      stacklevel=2)
        return load(step_dir(root, older[-1]), rank, world_size, fallback=True, verify=verify,
                    shard_group=shard_group)
    return _as_rank(loaded, folder, rank, world_size, shard_group or world_size)


def _as_rank(loaded: Checkpoint, folder: Path, rank: int, world_size: int, group_size: int) -> Checkpoint:
    """A checkpoint read at its layout's place (``rank % G`` of ``G``) as what ``rank`` of
    ``world_size`` loads: its own RNG states and the state of its optimizer."""
    if group_size == world_size:
        return loaded
    manifest = read_manifest(folder)
    saved_n = manifest["world_size"]
    saved_g = manifest.get("optimizer", {}).get("shard_group", saved_n)
    if is_dcp(manifest):
        pass                                 # the DCP read took this rank's RNG states (``_load_dcp``)
    elif rank < saved_n:
        loaded.rng = read_shard(folder, manifest["shards"][rank], False)["rng"]
    else:
        loaded.rng = None
    loaded.optimizer = {**loaded.optimizer, "rank": rank, "world_size": world_size, "shard_group": group_size}
    loaded.resharded = (saved_n, saved_g) != (world_size, group_size)
    return loaded


def _load_folder(folder: Path, rank: int, world_size: int, verify: bool, rng_rank: Optional[int] = None) -> Checkpoint:
    """The checkpoint as rank ``rank`` of ``world_size`` reads it (``rng_rank``: whose RNG states a DCP
    checkpoint gives, default ``rank``)."""
    manifest = read_manifest(folder)
    saved_n = manifest["world_size"]
    entries = manifest["shards"]
    if is_dcp(manifest):
        return _load_dcp(folder, manifest, rank, world_size, verify, rank if rng_rank is None else rng_rank)
    if len(entries) != saved_n:
        raise HGraphError(f"checkpoint manifest {str(folder / MANIFEST)!r} lists {len(entries)} shard files "
                          f"for world size {saved_n}")
    common = {"path": folder, "step": manifest["step"], "saved_world_size": saved_n,
              "data_position": manifest.get("data_position", {}),
              "delay_queues": manifest.get("delay_queues", {}),
              "planner_state": manifest.get("planner_state", {}),
              "run": manifest.get("run", {})}
    if saved_n == world_size:
        shard = read_shard(folder, entries[rank], verify)
        return Checkpoint(optimizer=_materialise(shard["optimizer"]), rng=shard["rng"], resharded=False,
                          full_shapes=_shapes(shard), **common)
    shards: dict[int, dict] = {}

    def shard_of(r: int) -> dict:
        if r not in shards:
            shards[r] = read_shard(folder, entries[r], verify)
        return shards[r]

    state = _reshard(shard_of, saved_n, rank, world_size)
    rng = shard_of(rank)["rng"] if rank < saved_n else None
    return Checkpoint(optimizer=state, rng=rng, resharded=True, full_shapes=_shapes(shard_of(0)), **common)


def _load_dcp(folder: Path, manifest: Mapping[str, Any], rank: int, world_size: int, verify: bool,
              rng_rank: int) -> Checkpoint:
    """Rank ``rank`` of ``world_size``'s rows and rank ``rng_rank``'s RNG states, the ``.metadata``
    read once for both."""
    for entry in manifest["shards"]:
        check_file(folder, entry, verify)
    layout = manifest["optimizer"]
    hyper = {**layout["hyper"], "betas": tuple(layout["hyper"]["betas"])}     # JSON keeps a tuple as a list
    metadata = dcp_format.read_metadata(folder)
    state, shapes = dcp_format.load_optimizer_state(folder, rank, world_size, layout["shard_dims"], hyper,
                                                    metadata=metadata)
    saved_n = manifest["world_size"]
    saved_g = layout.get("shard_group", saved_n)
    return Checkpoint(path=folder, step=manifest["step"], saved_world_size=saved_n, optimizer=state,
                      data_position=manifest.get("data_position", {}), delay_queues=manifest.get("delay_queues", {}),
                      planner_state=manifest.get("planner_state", {}), run=manifest.get("run", {}),
                      rng=dcp_format.read_rng(folder, rng_rank, metadata) if rng_rank < saved_n else None,
                      resharded=(saved_n, saved_g) != (world_size, world_size), full_shapes=shapes)


def _shapes(shard: Mapping[str, Any]) -> dict:
    return {n: tuple(s) for n, s in shard["full_shapes"].items()}


def _materialise(state: Mapping[str, Any]) -> dict:
    """Copy memory-mapped tensors into memory (the file may be deleted after loading)."""
    out = dict(state)
    for key in MOMENT_KEYS:
        out[key] = {n: t.clone() for n, t in state[key].items()}
    return out


def _reshard(shard_of: Any, saved_n: int, rank: int, world_size: int) -> dict:
    """Rank ``rank`` of ``world_size``'s optimizer state, cut from the saved ranks' shards."""
    first = shard_of(0)["optimizer"]
    full_shapes = shard_of(0)["full_shapes"]
    dims = dict(first["shard_dims"])
    out: dict[str, Any] = {"rank": rank, "world_size": world_size, "shard_dims": dims,
                           "hyper": first["hyper"], "steps": {}, **{k: {} for k in MOMENT_KEYS}}
    for name, dim in dims.items():
        full_shape = full_shapes[name]
        size = full_shape[dim] if full_shape else 1
        lo, hi = shard_bounds(size, rank, world_size)
        for key in MOMENT_KEYS:
            pieces = []
            for r in range(saved_n):
                rlo, rhi = shard_bounds(size, r, saved_n)
                a, b = max(lo, rlo), min(hi, rhi)
                if a < b or (r == 0 and lo == hi):   # overlap (or the empty-shard template)
                    src = shard_of(r)["optimizer"][key][name]
                    pieces.append(src.narrow(dim, a - rlo, b - a) if a < b else src.narrow(dim, 0, 0))
            out[key][name] = torch.cat(pieces, dim=dim).clone()
        out["steps"][name] = _agreed_steps(name, size, saved_n, shard_of)
    return out


def _agreed_steps(name: str, size: int, saved_n: int, shard_of: Any) -> float:
    owners = [r for r in range(saved_n) if shard_bounds(size, r, saved_n)[1] > shard_bounds(size, r, saved_n)[0]]
    values = {float(shard_of(r)["optimizer"]["steps"][name]) for r in owners}
    if len(values) > 1:
        raise HGraphError(f"checkpoint: Adam step counts of {name!r} differ between saved ranks "
                          f"({sorted(values)}); cannot re-shard one count per parameter")
    return values.pop() if values else float(shard_of(0)["optimizer"]["steps"][name])
