"""A checkpoint's folder: its manifest, the files the manifest lists, and the complete step folders
under a checkpoint root.

Layout: ``ROOT/step-SSSSSSSS/``. The manifest (``manifest.json``) is written last, atomically (a
temporary name in the same folder, then ``os.replace``, then the folder synced): a step folder without a
valid manifest is a save that did not finish, and ``latest`` / ``complete_steps`` skip it. It holds the
step, the world size, the size and SHA-256 of every file, and the run's JSON state (``json_state``:
data position, outlier-delay queues, planner state, ``run``); a DCP checkpoint's (format 2,
``write_dcp_manifest``) adds each parameter's shard dimension, the optimizer's hyper-parameters and
its shard group. Format 1 (one ``rank-RRRRR-of-NNNNN.pt`` per rank, ``write_manifest``) is still read.
``check_file`` / ``verify`` check the listed files against the manifest (present, its size, SHA-256).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch

from hgraph.errors import HGraphError
from hgraph.runtime.checkpoint import dcp_format

FORMAT_VERSION = 1          # one torch.save file per rank (write_shard)
DCP_FORMAT = 2              # a torch.distributed.checkpoint folder (save)
MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"^step-(\d{8})$")

PathLike = Union[str, os.PathLike]


def step_dir(root: PathLike, step: int) -> Path:
    """The folder of the checkpoint of ``step`` under ``root``."""
    return Path(root) / f"step-{step:08d}"


def shard_file_name(rank: int, world_size: int) -> str:
    """The shard file name of ``rank`` in a checkpoint written by ``world_size`` ranks."""
    return f"rank-{rank:05d}-of-{world_size:05d}.pt"


def json_state(name: str, value: Optional[Mapping[str, Any]]) -> dict:
    """``value`` as a dict the manifest can hold (JSON); a one-line HGraphError naming ``name`` if not."""
    value = dict(value or {})
    try:
        json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise HGraphError(f"checkpoint: {name} must be JSON-serialisable (dicts, lists, numbers, "
                          f"strings): {exc}") from None
    return value


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary name beside ``path``, sync it, rename it into place."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
                "data_position": json_state("data_position", data_position),
                "delay_queues": json_state("delay_queues", delay_queues),
                "planner_state": json_state("planner_state", planner_state),
                "run": json_state("run", run)}
    atomic_write(folder / MANIFEST, json.dumps(manifest, indent=1).encode())
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
                "shards": [_file_entry(p) for p in files], "optimizer": json_state("optimizer", optimizer_layout),
                **{k: json_state(k, v) for k, v in state.items()}}
    atomic_write(folder / MANIFEST, json.dumps(manifest, indent=1).encode())
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
