"""Checkpoints of a training run: which one a resume uses, what the trainer stores, how it resumes.

``hgraph.runtime.checkpoint.shards`` writes and reads strategy-independent checkpoints (fp32 master shards,
Adam moments, RNG states, atomic writes, resharding). This module is the trainer's side:

* ``find_resume_point(DIR, fallback)``: the newest checkpoint under DIR whose manifest and every
  shard file check out (size, SHA-256, loadable); DIR itself when it is a DCP checkpoint of another
  program and holds none of hgraph's (``hgraph.runtime.checkpoint.foreign``). A broken one is an
  HGraphError naming the file, unless ``fallback`` (``--resume-fallback``): then the next older
  complete one is used, with a warning. A step folder without a manifest is a save that did not finish: skipped with a note.
  The launcher resolves it once, before any process starts, so every rank loads the same folder.
* ``RunCheckpoints``: when to save (every ``checkpoint_every`` steps and after the last step), and
  the run's JSON state stored with the shards: the data position (documents consumed so far, all
  epochs, and a fingerprint of the data), the outlier-delay queues, the planner state (candidate
  strategies) and what produced it (model spec and arguments, used by ``hgraph export``): the
  trainer and the planner make those dicts (``hgraph.runtime.train.resume``,
  ``hgraph.runtime.planner.service.saved_state``), this module stores and checks them.

Outlier-delay queues: with ``--outlier-queues K`` (``hgraph.runtime.data.outlier_delay``) the checkpoint
holds the stream's state after the step: documents waiting in each queue and those released but held
back (each as [position, arrival step], position = documents read from the run's start), and
whether the run's end is draining them; the data position counts documents *read*, so a document
read but not trained is in the queues, never lost. Without delay nothing is held back and the
checkpoint says so (``outlier_delay: false``, empty queues). A resume with K = 0 from a checkpoint
that holds delayed documents is refused (they would be lost).

A checkpoint named ``step-N`` holds the state after N steps (steps 0..N-1 trained); resuming it runs
steps N.. up to ``--steps`` (the run's total).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import torch.distributed as dist

from hgraph.errors import HGraphError
from hgraph.runtime.checkpoint import foreign
from hgraph.runtime.checkpoint import shards as ckpt
from hgraph.runtime.checkpoint.manifest import MANIFEST, STEP_DIR, verify
from hgraph.runtime.checkpoint.rng_state import restore_rng
from hgraph.runtime.data.documents import Document
from hgraph.runtime.data.stored import fingerprint_of
from hgraph.runtime.engine.optimizer import ShardedAdam

NO_DELAY_QUEUES = {"outlier_delay": False, "queues": [],
                   "note": "mini-batches are packed without outlier delay: no document is held back"}


def data_fingerprint(docs: Sequence[Document]) -> str:
    """SHA-256 of the documents' tokens in order, or a token store's own checksum (a resume must read
    the same data; ``hgraph.runtime.data.stored.fingerprint_of``)."""
    return fingerprint_of(docs)


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a resume uses: its folder and manifest, and warnings for the user."""

    folder: Path
    manifest: dict
    warnings: tuple[str, ...] = ()

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    @property
    def world_size(self) -> int:
        return int(self.manifest["world_size"])

    @property
    def data_position(self) -> dict:
        return dict(self.manifest.get("data_position", {}))

    @property
    def run(self) -> dict:
        return dict(self.manifest.get("run", {}))


def _step_folders(root: Path) -> list[tuple[int, Path]]:
    out = []
    for child in root.iterdir():
        m = STEP_DIR.match(child.name)
        if m is not None and child.is_dir():
            out.append((int(m.group(1)), child))
    return sorted(out, reverse=True)


def find_resume_point(root: Any, *, fallback: bool = False) -> ResumePoint:
    """The checkpoint to resume from under ``root``; HGraphError otherwise."""
    root = Path(root)
    if not root.is_dir():
        raise HGraphError(f"--resume: checkpoint folder {str(root)!r} does not exist")
    folders = _step_folders(root)
    incomplete = [(s, f) for s, f in folders if not (f / MANIFEST).exists()]
    candidates = [(s, f) for s, f in folders if (f / MANIFEST).exists()]
    if not candidates and foreign.is_foreign(root):
        # another program's DCP checkpoint (the run's own checkpoints, once saved under it, come first)
        return ResumePoint(root, foreign.resume_manifest(root))
    if not candidates:
        raise HGraphError(f"--resume: no complete checkpoint in {str(root)!r}")
    notes: list[str] = []
    for i, (step, folder) in enumerate(candidates):
        try:
            checked = verify(folder)
        except HGraphError as exc:
            older = candidates[i + 1:]
            if not older:
                raise HGraphError(f"--resume: {exc}; no older checkpoint to fall back to") from None
            if not fallback:
                raise HGraphError(f"--resume: {exc}; --resume-fallback resumes from the previous checkpoint "
                                  f"({older[0][1].name})") from None
            notes.append(f"{exc}; falling back to {older[0][1].name}")
            continue
        skipped = [f"{str(f)!r} has no manifest (a save that did not finish); skipped"
                   for s, f in incomplete if s > step]
        return ResumePoint(folder, checked, tuple(skipped + notes))
    raise AssertionError("unreachable: the oldest candidate either loads or raises")


@dataclass
class SavedCheckpoint:
    """One checkpoint written by the run: its step, folder, total bytes and the time the step waited
    for it (with asynchronous saving: the copy of its tensors; ``bytes`` is set once it completes)."""

    step: int
    path: str
    bytes: int
    save_s: float


@dataclass
class RunCheckpoints:
    """When the trainer saves, and the JSON state it stores."""

    root: Optional[Path]
    every: Optional[int]
    total_steps: int
    keep_last: Optional[int] = None
    asynchronous: bool = False                 # write in a background thread (``shards.save_async``)
    saved: list = field(default_factory=list)
    _pending: Any = None
    _async_group: Optional[dist.ProcessGroup] = None

    def due(self, steps_done: int) -> bool:
        """Save after ``steps_done`` steps? Every ``every`` steps and after the run's last step."""
        if self.root is None:
            return False
        return steps_done == self.total_steps or (self.every is not None and steps_done % self.every == 0)

    def save(self, steps_done: int, optimizer: ShardedAdam, *, rank: int, world_size: int, data_position: dict,
             planner_state: dict, run: dict, delay_queues: Optional[dict] = None) -> SavedCheckpoint:
        """Write the checkpoint of ``steps_done`` (collective: every rank calls it); ``delay_queues``:
        the outlier-delay stream's state after that step (None: a run without delay). Asynchronous: the
        previous save completes first, and this one is under way when it returns."""
        self.finish()
        t0 = time.perf_counter()
        state = dict(data_position=data_position, planner_state=planner_state, run=run, keep_last=self.keep_last,
                     delay_queues=NO_DELAY_QUEUES if delay_queues is None else delay_queues)
        if self.asynchronous:
            if self._async_group is None and world_size > 1:
                # the background thread's collectives get a group of their own (collective to create)
                self._async_group = dist.new_group(backend="gloo")
            self._pending = ckpt.save_async(self.root, steps_done, optimizer, rank=rank, world_size=world_size,
                                            async_group=self._async_group, **state)
            record = SavedCheckpoint(steps_done, str(self._pending.folder), 0, time.perf_counter() - t0)
        else:
            folder = ckpt.save(self.root, steps_done, optimizer, rank=rank, world_size=world_size, **state)
            record = SavedCheckpoint(steps_done, str(folder), _size(folder) if rank == 0 else 0,
                                     time.perf_counter() - t0)
        self.saved.append(record)
        return record

    def finish(self) -> None:
        """Complete the save under way, if any (collective; before the next save and at the run's end)."""
        if self._pending is None:
            return
        folder = self._pending.wait()
        self._pending = None
        self.saved[-1].bytes = _size(folder)


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


def data_position(steps_done: int, next_document: int, docs: Sequence[Document], tokens_per_iter: int,
                  fingerprint: str, order: Any = None) -> dict:
    """Where the next step starts: ``next_document`` documents consumed so far (all epochs), and the
    order's state there (``corpus.DataOrder.state``: file or shuffled order, seed, epoch, mixture
    counts)."""
    n = len(docs)
    out = {"next_step": steps_done, "next_document": next_document, "epoch": next_document // n,
           "index_in_epoch": next_document % n, "num_documents": n, "tokens_per_iter": tokens_per_iter,
           "documents_sha256": fingerprint}
    if order is not None:
        out.update(order.state(next_document))
    return out


def check_resume(point_step: int, folder: Path, run: dict, position: dict, *, model: str, model_args: dict,
                 fingerprint: str, total_steps: int) -> None:
    """A resume must train the same model on the same data, and have steps left (one-line errors)."""
    if run.get("model") is not None and (run["model"], run.get("model_args", {})) != (model, model_args):
        raise HGraphError(f"--resume: {str(folder)!r} was written for model {run['model']} with arguments "
                          f"{run.get('model_args', {})}, this run is {model} with {model_args}")
    saved_fp = position.get("documents_sha256")
    if saved_fp is not None and saved_fp != fingerprint:
        raise HGraphError(f"--resume: {str(folder)!r} was trained on other data ({position.get('num_documents')} "
                          "documents with another fingerprint); give the same --data (and, for the built-in "
                          "data, the same --seed)")
    if "next_document" not in position:
        raise HGraphError(f"--resume: {str(folder)!r} holds no data position; it was not written by hgraph train")
    if point_step >= total_steps:
        raise HGraphError(f"--resume: {str(folder)!r} is at step {point_step} and --steps is {total_steps}: "
                          "nothing left to train (--steps is the run's total)")


def rewrite_metrics_before(path: Path, step: int) -> None:
    """Keep only the metrics lines of steps before ``step`` (a resumed run rewrites the rest, so a
    step trained after the last checkpoint by a run that then died is not counted twice)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue                 # a line cut by the crash
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] < step:
            kept.append(line)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(k + "\n" for k in kept), encoding="utf-8")
    tmp.replace(path)


# ---- the trainer's resume --------------------------------------------------------------------------

def restore_state(loaded: Any, optimizer: ShardedAdam) -> None:
    """Masters, moments and step counts from the checkpoint; the optimizer settings stay this run's
    own (a new --lr takes effect on resume); this rank's RNG states (a rank that did not exist in
    the saved run keeps its seeded state)."""
    settings = (optimizer.lr, optimizer.betas, optimizer.eps, optimizer.weight_decay,
                optimizer.decoupled_weight_decay, optimizer.max_grad_norm)
    state = loaded.optimizer if loaded.foreign is None else loaded.foreign.optimizer_state(optimizer)
    optimizer.load_state_dict(state)
    (optimizer.lr, optimizer.betas, optimizer.eps, optimizer.weight_decay, optimizer.decoupled_weight_decay,
     optimizer.max_grad_norm) = settings
    if loaded.rng is not None:
        restore_rng(loaded.rng)
