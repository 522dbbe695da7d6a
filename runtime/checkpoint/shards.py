"""Checkpoints that do not depend on the parallel strategy: a ``torch.distributed.checkpoint`` (DCP)
checkpoint plus a manifest.

What a checkpoint holds (Hydraulis §5.2: the optimizer layout is the same for every strategy, so
nothing here names a strategy):

* the DCP checkpoint (format 2, written by ``save``; ``dcp_format``): the fp32 masters, Adam's moments
  and step counts keyed by parameter name in full-tensor shapes, each rank writing its own rows, and
  every rank's RNG states (torch, CUDA when present, numpy, python ``random``); ``dcp.load`` reads it
  into a plain model at any world size;
* ``manifest.json`` (rank 0, written last): step, world size, size and SHA-256 of every file, each
  parameter's shard dimension and the optimizer's hyper-parameters, and the run's JSON state: data
  position, outlier-delay queues, planner state, and ``run`` (what produced it: model spec and
  arguments, data fingerprint; used to resume and to export).

Format 1 (one ``rank-RRRRR-of-NNNNN.pt`` per rank holding that rank's ``ShardedAdam.state_dict()`` and
RNG states) is still read, and written by ``write_shard`` for tools that assemble a checkpoint
without processes; ``hgraph export`` and ``--init-from`` read both.

Layout: ``DIR/step-SSSSSSSS/``. Writes are atomic: every file goes to a temporary name in the same
folder and is then renamed (``os.replace``); the manifest is renamed into place only after every rank
has renamed its shard. A step folder without a valid manifest is incomplete and ``latest`` skips it,
so a crash mid-save leaves the previous checkpoint usable. Several ranks must see one shared folder.
``save`` is the collective front; its two phases are public (``write_shard`` on every rank, then
``write_manifest`` on rank 0) for tools that assemble a checkpoint without a process group.

``load`` returns this rank's optimizer state in ``ShardedAdam.state_dict()`` form. When the world size
differs from the saved one it re-shards: it reads (memory-mapped) only the saved shard files whose
ranges overlap this rank's new range, concatenates the pieces and re-slices with ``shard_bounds``;
Adam step counts come along (they must agree across the saved ranks of a parameter). A shard file that
is missing, truncated or altered gives an ``HGraphError`` naming it; ``fallback=True`` then uses the
newest older complete checkpoint instead (with a warning).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import random
import re
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import numpy as np
import torch
import torch.distributed as dist

from hgraph.errors import HGraphError
from hgraph.runtime.checkpoint import coalesce, dcp_format
from hgraph.runtime.engine.optimizer import ShardedAdam
from hgraph.shard_rule import shard_bounds

FORMAT_VERSION = 1          # one torch.save file per rank (write_shard)
DCP_FORMAT = 2              # a torch.distributed.checkpoint folder (save)
MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"^step-(\d{8})$")
_MOMENT_KEYS = ("params", "exp_avg", "exp_avg_sq")

PathLike = Union[str, os.PathLike]


def step_dir(root: PathLike, step: int) -> Path:
    """The folder of the checkpoint of ``step`` under ``root``."""
    return Path(root) / f"step-{step:08d}"


def shard_file_name(rank: int, world_size: int) -> str:
    """The shard file name of ``rank`` in a checkpoint written by ``world_size`` ranks."""
    return f"rank-{rank:05d}-of-{world_size:05d}.pt"


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


# ---- RNG states as tensors and plain containers ------------------------------------------------
def capture_rng() -> dict:
    """torch (and CUDA), numpy and python ``random`` states in a ``weights_only``-loadable form."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, py_state, py_gauss = random.getstate()
    out = {"torch": torch.get_rng_state(),
           "numpy": {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                     "pos": int(pos), "has_gauss": int(has_gauss), "gauss": float(gauss)},
           "python": {"version": int(version), "state": torch.tensor(py_state, dtype=torch.int64),
                      "gauss": py_gauss}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def restore_rng(state: Mapping[str, Any]) -> None:
    """Put back the RNG states captured by ``capture_rng``."""
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["gauss"]))
    p = state["python"]
    random.setstate((p["version"], tuple(int(x) for x in p["state"].tolist()), p["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---- saving ------------------------------------------------------------------------------------
def _json_state(name: str, value: Optional[Mapping[str, Any]]) -> dict:
    value = dict(value or {})
    try:
        json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise HGraphError(f"checkpoint: {name} must be JSON-serialisable (dicts, lists, numbers, "
                          f"strings): {exc}") from None
    return value


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
    _atomic_write(folder / name, data)
    return {"name": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def write_manifest(folder: Path, step: int, world_size: int, entries: list,
                   data_position: Optional[Mapping[str, Any]] = None,
                   delay_queues: Optional[Mapping[str, Any]] = None,
                   planner_state: Optional[Mapping[str, Any]] = None,
                   run: Optional[Mapping[str, Any]] = None) -> None:
    """Complete a checkpoint: write its manifest atomically, after every shard file is in place.

    ``entries``: the ``write_shard`` results of ranks 0..world_size-1, in rank order.
    """
    if len(entries) != world_size or any(e["name"] != shard_file_name(r, world_size)
                                         for r, e in enumerate(entries)):
        raise HGraphError(f"checkpoint: the manifest needs the shard entries of ranks 0..{world_size - 1} "
                          "in rank order")
    manifest = {"format": FORMAT_VERSION, "step": step, "world_size": world_size, "shards": list(entries),
                "data_position": _json_state("data_position", data_position),
                "delay_queues": _json_state("delay_queues", delay_queues),
                "planner_state": _json_state("planner_state", planner_state),
                "run": _json_state("run", run)}
    _atomic_write(folder / MANIFEST, json.dumps(manifest, indent=1).encode())
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    """Make the renames in ``folder`` durable (POSIX; a no-op where directories cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


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
    return {"data_position": _json_state("data_position", data_position),
            "delay_queues": _json_state("delay_queues", delay_queues),
            "planner_state": _json_state("planner_state", planner_state),
            "run": _json_state("run", run)}


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


def _file_entry(path: Path) -> dict:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return {"name": path.name, "bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def write_dcp_manifest(folder: Path, step: int, world_size: int, optimizer_layout: Mapping[str, Any],
                       **state: Any) -> None:
    """Complete a DCP checkpoint (every rank's files and DCP's ``.metadata`` in place): its manifest
    lists every file with its size and SHA-256, the shard dimensions and hyper-parameters."""
    files = sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith((".", MANIFEST))
                   or p.name == dcp_format.METADATA)
    manifest = {"format": DCP_FORMAT, "step": step, "world_size": world_size,
                "shards": [_file_entry(p) for p in files], "optimizer": _json_state("optimizer", optimizer_layout),
                **{k: _json_state(k, v) for k, v in state.items()}}
    _atomic_write(folder / MANIFEST, json.dumps(manifest, indent=1).encode())
    _fsync_dir(folder)


# ---- finding and reading -----------------------------------------------------------------------
def read_manifest(folder: PathLike) -> dict:
    """The manifest of one checkpoint folder; HGraphError when it is missing or not valid."""
    path = Path(folder) / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise HGraphError(f"checkpoint {str(folder)!r} is incomplete: no {MANIFEST} (a save that did "
                          "not finish)") from None
    except (OSError, ValueError) as exc:
        raise HGraphError(f"checkpoint manifest {str(path)!r} cannot be read: {exc}") from None
    keys = ("format", "step", "world_size", "shards")
    if not isinstance(manifest, dict) or any(k not in manifest for k in keys):
        raise HGraphError(f"checkpoint manifest {str(path)!r} lacks one of {', '.join(keys)}")
    if manifest["format"] not in (FORMAT_VERSION, DCP_FORMAT):
        raise HGraphError(f"checkpoint manifest {str(path)!r} has format {manifest['format']}, this "
                          f"hgraph reads formats {FORMAT_VERSION} and {DCP_FORMAT}")
    return manifest


def is_dcp(manifest: Mapping[str, Any]) -> bool:
    """Whether a manifest's checkpoint is a DCP folder (format 2) rather than per-rank files."""
    return manifest["format"] == DCP_FORMAT


def complete_steps(root: PathLike) -> list[int]:
    """Steps of the checkpoints under ``root`` that have a valid manifest, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    steps = []
    for child in root.iterdir():
        m = STEP_DIR.match(child.name)
        if m is None or not child.is_dir():
            continue
        try:
            read_manifest(child)
        except HGraphError:
            continue
        steps.append(int(m.group(1)))
    return sorted(steps)


def latest(root: PathLike) -> Optional[Path]:
    """The folder of the newest complete checkpoint under ``root``, or None."""
    steps = complete_steps(root)
    return step_dir(root, steps[-1]) if steps else None


def read_shard(folder: Path, entry: Mapping[str, Any], verify: bool) -> dict:
    """The rows of a manifest entry's file (``check_file``d first), memory-mapped."""
    path = check_file(folder, entry, verify)
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure is a corrupt file
        raise HGraphError(f"checkpoint shard file {str(path)!r} cannot be loaded: "
                          f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None


def check_file(folder: Path, entry: Mapping[str, Any], verify: bool) -> Path:
    """The file of a manifest entry, checked: present, of the manifest's size and (``verify``) SHA-256."""
    path = folder / entry["name"]
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise HGraphError(f"checkpoint shard file {str(path)!r} is missing") from None
    if size != entry["bytes"]:
        raise HGraphError(f"checkpoint shard file {str(path)!r} is truncated or corrupt: {size} bytes, "
                          f"the manifest says {entry['bytes']}")
    if verify:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        if digest.hexdigest() != entry["sha256"]:
            raise HGraphError(f"checkpoint shard file {str(path)!r} is corrupt: its SHA-256 differs from "
                              "the manifest's")
    return path


def verify(folder: PathLike) -> dict:
    """Check one checkpoint folder completely: its manifest, then every shard file (present, the
    manifest's size and SHA-256, loadable). Returns the manifest; HGraphError names the first bad file."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    if is_dcp(manifest):
        for entry in manifest["shards"]:
            check_file(folder, entry, verify=True)
        return manifest
    if len(manifest["shards"]) != manifest["world_size"]:
        raise HGraphError(f"checkpoint manifest {str(folder / MANIFEST)!r} lists {len(manifest['shards'])} "
                          f"shard files for world size {manifest['world_size']}")
    for entry in manifest["shards"]:
        read_shard(folder, entry, verify=True)
    return manifest


def resolve_checkpoint(path: PathLike, step: Optional[int]) -> tuple[Path, Optional[Path]]:
    """(checkpoint root, requested step folder or None for the newest)."""
    path = Path(path)
    if STEP_DIR.match(path.name) and step is None:
        return path.parent, path
    if step is not None:
        return path, step_dir(path, step)
    return path, None


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
    for key in _MOMENT_KEYS:
        out[key] = {n: t.clone() for n, t in state[key].items()}
    return out


def _reshard(shard_of: Any, saved_n: int, rank: int, world_size: int) -> dict:
    """Rank ``rank`` of ``world_size``'s optimizer state, cut from the saved ranks' shards."""
    first = shard_of(0)["optimizer"]
    full_shapes = shard_of(0)["full_shapes"]
    dims = dict(first["shard_dims"])
    out: dict[str, Any] = {"rank": rank, "world_size": world_size, "shard_dims": dims,
                           "hyper": first["hyper"], "steps": {}, **{k: {} for k in _MOMENT_KEYS}}
    for name, dim in dims.items():
        full_shape = full_shapes[name]
        size = full_shape[dim] if full_shape else 1
        lo, hi = shard_bounds(size, rank, world_size)
        for key in _MOMENT_KEYS:
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


# ---- full tensors and export -------------------------------------------------------------------
def full_tensors(path: PathLike, *, step: Optional[int] = None, fallback: bool = False) -> dict:
    """The gathered full tensors of a checkpoint, read from files (no processes).

    Returns ``{"params": {name: tensor}, "exp_avg": ..., "exp_avg_sq": ..., "steps": {name: float},
    "step": int}``.
    """
    ckpt = load(path, 0, 1, step=step, fallback=fallback)
    shapes = ckpt.full_shapes
    out = {key: {n: t.reshape(shapes[n]) for n, t in ckpt.optimizer[key].items()} for key in _MOMENT_KEYS}
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
    _atomic_write(out_path, buf.getvalue())
    return state
