"""The one place a rank issues the collectives and point-to-point batches of a step.

Every collective the runtime issues during a step (the pulls' all-gathers and messages, the pushes'
reductions and messages, the graphs' TP / CP / Ulysses collectives and pipeline sends, the loss and
norm reductions, the memory agreement, the vocabulary-parallel loss) goes through the rank's
``CollectiveIssuer``: ``issue(kind, group, tensor, start, label)`` calls ``start()`` (which issues the
operation with ``async_op=True``) and returns its work; ``p2p(sends, recvs, start, label)`` does the
same for a ``batch_isend_irecv`` group (one operation); ``run`` issues and waits.

What it adds to issuing:

* **The record.** It knows the ``Collective`` of what it issues (kind, sorted group ranks, this rank's
  shape and dtype, a label such as ``push bucket 2`` or ``mb 3 F tp_reduce``, the label's prefix
  set by ``scope``). With ``record`` the step's sequence is kept (``sequence``, reset by
  ``begin_step``): ``--verify-collectives`` checks every rank's after a Program's first step.
  Always kept: how many operations the step issued and the last one (``position``), so a collective
  that fails can say where this rank's sequence stopped (``stopped_line``).
* **The strict order** (``order="strict"``, ``--collective-order strict``): every operation completes
  before ``issue`` returns, so no two operations of a rank are in flight, across all its groups: the
  most conservative reading of NCCL (one stream per rank), under which an inconsistent order hangs
  on gloo too (gloo otherwise runs each group on its own threads). One waiter thread per rank waits
  for the works while the rank's thread waits for it with a timeout (a timed wait on gloo's
  point-to-point work closes its connection); the caller gets works whose ``wait`` is a no-op (a
  second wait on gloo's send or receive blocks).
* **A hang that names itself** (strict): a wait still unfinished after ``publish_s`` writes this
  rank's operation to the run's store (``hgraph/collective/RANK``, beside the heartbeat's keys), and
  one unfinished after ``hang_s`` reads the operations of the ranks it waits for, and of those they
  wait for, runs them through ``deadlock.simulate`` and raises ``CollectiveHang``: one line naming
  the ranks, their groups and each one's operation (the wait-for cycle when there is one).

Without ``record`` and in the free order the cost of a collective is one call and two assignments;
nothing grows with the world size (a group's ranks are read once per process group).
"""
from __future__ import annotations

import contextlib
import json
import queue
import threading
import time
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from hgraph.errors import RunFailed
from hgraph.runtime.comm.order.collective import Collective
from hgraph.runtime.comm.order.deadlock import simulate

FREE, STRICT = "free", "strict"
#: the values of ``--collective-order``
COLLECTIVE_ORDERS = (FREE, STRICT)

_KEY = "hgraph/collective/"           # + rank: the operation a rank waits in (strict), or where it stopped
_STOPPED = "hgraph/collective-stopped/"   # + rank: where a rank's sequence stopped when a collective failed


class CollectiveHang(RunFailed):
    """Under ``--collective-order strict`` a collective did not complete within the hang timeout: the
    message names the ranks, their groups and operations (exit 1, as a failed run)."""


def _encode(c: Optional[Collective], position: int, step: int) -> str:
    body = None if c is None else {"kind": c.kind, "group": list(c.group), "shape": list(c.shape),
                                   "dtype": c.dtype, "label": c.label, "sends": list(c.sends),
                                   "recvs": list(c.recvs)}
    return json.dumps({"step": step, "position": position, "op": body})


def _decode(text: bytes) -> tuple[Optional[Collective], int, int]:
    d = json.loads(text.decode())
    op = d["op"]
    c = None if op is None else Collective(op["kind"], tuple(op["group"]), tuple(op["shape"]), op["dtype"],
                                           op["label"], tuple(op["sends"]), tuple(op["recvs"]))
    return c, int(d["position"]), int(d["step"])


class CollectiveIssuer:
    """One rank's choke point for its step's collectives (see the module docstring).

    ``order``: ``"free"`` or ``"strict"``; ``record``: keep the step's sequence; ``hang_s``: under
    strict, how long a wait may make no progress before the hang is named; ``store``: the run's
    key-value store (default: the default process group's, when there is one).
    """

    def __init__(self, rank: Optional[int] = None, world_size: Optional[int] = None, *, order: str = FREE,
                 record: bool = False, hang_s: float = 60.0, store: Any = None,
                 device: Optional[torch.device] = None) -> None:
        if order not in COLLECTIVE_ORDERS:
            raise ValueError(f"collective order {order!r}: expected one of {', '.join(COLLECTIVE_ORDERS)}")
        initialised = dist.is_available() and dist.is_initialized()
        self.rank = rank if rank is not None else (dist.get_rank() if initialised else 0)
        self.world_size = world_size if world_size is not None else (dist.get_world_size() if initialised else 1)
        self.order, self.record, self.hang_s = order, record, float(hang_s)
        self.device = torch.device(device or "cpu")     # CUDA: the strict order waits for the device too
        self.publish_s = min(1.0, self.hang_s / 4)
        self._store = store
        self._ranks_of: dict[Any, tuple[int, ...]] = {}   # process group -> its sorted global ranks
        self._prefix = ""
        self.step = 0
        self.sequence: list[Collective] = []
        self._count = 0                    # operations issued this step
        self._last: Optional[tuple] = None   # the arguments of the last one (its record made on demand)
        self._waiter: Optional[_Waiter] = None   # the strict order's waiting thread (started on first use)

    def start_recording(self) -> None:
        """Record every collective from now on (``--verify-collectives``: the executor checks them)."""
        self.record = True

    @property
    def strict(self) -> bool:
        return self.order == STRICT

    # ---- the step --------------------------------------------------------------------------------
    def begin_step(self, step: int = 0) -> None:
        """A new step: its sequence starts empty."""
        self.step, self.sequence, self._count, self._last = step, [], 0, None

    @contextlib.contextmanager
    def scope(self, prefix: str) -> Iterator[None]:
        """Labels of the operations issued inside start with ``prefix`` (e.g. ``mb 3 F``)."""
        outer = self._prefix
        self._prefix = f"{outer} {prefix}".strip()
        try:
            yield
        finally:
            self._prefix = outer

    @property
    def position(self) -> int:
        """Operations issued this step."""
        return self._count

    def last(self) -> Optional[Collective]:
        """The record of the last operation issued this step (None before the first)."""
        return None if self._last is None else self._make(*self._last)

    # ---- issuing ---------------------------------------------------------------------------------
    def issue(self, kind: str, group: Optional[dist.ProcessGroup], tensor: Optional[torch.Tensor], start: Callable[[], Any],
              label: str = "") -> Any:
        """Issue one collective of ``kind`` over ``group`` (a process group; None: the world) on
        ``tensor`` (this rank's input, for the record): ``start()`` issues it and returns its work,
        which this returns (completed already under the strict order)."""
        args = (kind, group, tensor, label, (), ())
        self._note(args)
        work = start()
        if self.strict and work is not None:
            self._wait_strict([work], args)
            return _Waited()
        return work

    def run(self, kind: str, group: Optional[dist.ProcessGroup], tensor: Optional[torch.Tensor], start: Callable[[], Any],
            label: str = "") -> None:
        """Issue one collective and wait for it (a blocking collective)."""
        work = self.issue(kind, group, tensor, start, label)
        if work is not None:
            work.wait()

    def p2p(self, sends: Sequence[int], recvs: Sequence[int], start: Callable[[], Sequence[Any]],
            label: str = "") -> Sequence[Any]:
        """Issue one ``batch_isend_irecv`` group (or a single send or receive) with messages to ``sends``
        and from ``recvs`` (a peer once per message): ``start()`` returns its works, returned here
        (completed already under the strict order)."""
        args = ("p2p", None, None, label, tuple(sends), tuple(recvs))
        self._note(args)
        works = start()
        if self.strict:
            if not isinstance(works, (list, tuple)):
                self._wait_strict([works], args)
                return _Waited()
            self._wait_strict(list({id(w): w for w in works}.values()), args)   # a batch's one work: once
            return [_Waited() for _ in works]
        return works

    def _note(self, args: tuple) -> None:
        self._count += 1
        self._last = (*args, self._prefix)
        if self.record:
            self.sequence.append(self._make(*self._last))

    def _group_ranks(self, group: Optional[dist.ProcessGroup]) -> tuple[int, ...]:
        key = group if group is not None else dist.group.WORLD
        ranks = self._ranks_of.get(key)
        if ranks is None:
            if group is None and self.world_size >= 1 and not dist.is_initialized():
                ranks = tuple(range(self.world_size))
            else:
                ranks = tuple(sorted(dist.get_process_group_ranks(key)))
            self._ranks_of[key] = ranks
        return ranks

    def _make(self, kind: str, group: Optional[dist.ProcessGroup], tensor: Optional[torch.Tensor], label: str, sends: tuple,
              recvs: tuple, prefix: str) -> Collective:
        text = f"{prefix} {label}".strip()
        if kind == "p2p":
            return Collective.p2p(self.rank, sends, recvs, label=text)
        shape = tuple(tensor.shape) if tensor is not None else ()
        dtype = str(tensor.dtype).removeprefix("torch.") if tensor is not None else ""
        return Collective(kind, self._group_ranks(group), shape, dtype, text)

    # ---- the strict order: wait now, name a hang ---------------------------------------------------
    def _wait_strict(self, works: list, args: tuple) -> None:
        if self._waiter is None:
            self._waiter = _Waiter(self.rank, self.device)
        job = self._waiter.submit(works)
        if job.wait(self.publish_s):
            return
        self._publish(self._make(*args, self._prefix))
        if not job.wait(self.hang_s - self.publish_s):
            raise CollectiveHang(self._hang_line(self._make(*args, self._prefix)))
        self._publish(None)

    def _store_or_none(self) -> Any:
        if self._store is None and dist.is_available() and dist.is_initialized():
            try:
                self._store = dist.distributed_c10d._get_default_store()
            except (AttributeError, RuntimeError):
                self._store = None
        return self._store

    def _publish(self, op: Optional[Collective]) -> None:
        """This rank's operation it waits in (None: it waits in none) in the store, for the peers."""
        store = self._store_or_none()
        if store is not None:
            try:
                store.set(f"{_KEY}{self.rank}", _encode(op, self._count, self.step))
            except Exception:         # the store went away: the hang line names this rank only
                pass

    def _read(self, rank: int) -> Optional[tuple[Optional[Collective], int, int]]:
        store = self._store_or_none()
        try:
            if store is None or not store.check([f"{_KEY}{rank}"]):
                return None
            return _decode(store.get(f"{_KEY}{rank}"))
        except Exception:
            return None

    def _hang_line(self, mine: Collective) -> str:
        """The ranks this one waits for, transitively, with their operations (read from the store after
        the peers had time to publish), as one line; the wait-for cycle when ``simulate`` finds one."""
        time.sleep(self.publish_s + 0.5)      # a peer stuck later than this rank publishes meanwhile
        ops: dict[int, tuple[Optional[Collective], int]] = {self.rank: (mine, self._count)}
        frontier = [m for m in mine.group if m != self.rank]
        while frontier:
            r = frontier.pop()
            if r in ops:
                continue
            got = self._read(r)
            op = got[0] if got is not None else None
            ops[r] = (op, got[1] if got is not None else 0)
            if op is not None:
                frontier += [m for m in op.group if m not in ops]
        seqs = {r: ([op] if op is not None else []) for r, (op, _) in ops.items()}
        verdict = simulate(seqs)
        head = (f"collective order: rank {self.rank} made no progress for {self.hang_s:g} s at step {self.step} "
                f"under --collective-order strict")
        if verdict.waits:
            steps = "; ".join(f"rank {r} waits in {op.describe()} (its operation {ops[r][1]}) for rank {m}"
                              for r, op, m in verdict.waits)
            kind = "a cycle" if verdict.waits[-1][2] == verdict.waits[0][0] else "a chain"
            return f"{head}: {kind}: {steps}" + (
                "" if kind == "a cycle" else f"; rank {verdict.waits[-1][2]} is in no collective")
        others = "; ".join(f"rank {r} " + (f"waits in {op.describe()} (its operation {pos})" if op is not None
                                          else "is in no collective")
                           for r, (op, pos) in sorted(ops.items()))
        return f"{head}: {others}"

    # ---- a failed collective (any order, any backend) -------------------------------------------------
    def stopped_line(self, peers: Optional[Sequence[int]] = None, grace_s: float = 2.0) -> str:
        """Where each rank's sequence of this step stopped, as one line: this rank writes its own
        position to the store, waits ``grace_s`` for the others (each rank whose collective failed
        does the same), and reads ``peers`` (default: every rank; only on failure)."""
        store = self._store_or_none()
        mine = self.last()
        if store is None:
            return f"rank {self.rank}: {self._stop_text(mine, self._count)}"
        try:
            store.set(f"{_STOPPED}{self.rank}", _encode(mine, self._count, self.step))
        except Exception:
            return f"rank {self.rank}: {self._stop_text(mine, self._count)}"
        time.sleep(grace_s)
        parts = []
        for r in (range(self.world_size) if peers is None else peers):
            try:
                got = _decode(store.get(f"{_STOPPED}{r}")) if store.check([f"{_STOPPED}{r}"]) else None
            except Exception:
                got = None
            if got is None or got[2] != self.step:
                parts.append(f"rank {r}: no report")
            else:
                parts.append(f"rank {r}: {self._stop_text(got[0], got[1])}")
        return "; ".join(parts)

    @staticmethod
    def _stop_text(op: Optional[Collective], count: int) -> str:
        if op is None:
            return "issued nothing this step"
        return f"stopped after {count} operations, the last {op.describe()}"


class _Waited:
    """What the strict order returns for a work it waited for: waiting again is a no-op (a second wait
    on gloo's point-to-point work blocks for a message that never comes)."""

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _Job:
    """Works the waiter thread waits for; ``wait(timeout_s)``: whether they completed (their error raised)."""

    def __init__(self, works: list) -> None:
        self.works, self.done, self.error = works, threading.Event(), None

    def wait(self, timeout_s: float) -> bool:
        if not self.done.wait(max(timeout_s, 0.0)):
            return False
        if self.error is not None:
            raise self.error
        return True


class _Waiter:
    """One thread that waits for the strict order's works, so the rank's own thread can wait with a
    timeout: a timed wait on gloo's point-to-point work closes its connection (measured on torch 2.13),
    and NCCL's ``wait`` only orders the waiting thread's stream after the operation (that stream is
    then synchronised: the operation has completed on the device)."""

    def __init__(self, rank: int, device: torch.device) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.device = device
        threading.Thread(target=self._run, name=f"hgraph-collective-waiter-{rank}", daemon=True).start()

    def submit(self, works: list) -> _Job:
        job = _Job(works)
        self._jobs.put(job)
        return job

    def _run(self) -> None:
        torch.set_grad_enabled(False)     # a backend's finishing copy is not an op of any graph
        while True:
            job = self._jobs.get()
            try:
                for work in job.works:
                    work.wait()
                if self.device.type == "cuda":
                    torch.cuda.current_stream(self.device).synchronize()
            except BaseException as exc:     # handed to the rank's thread, which raises it
                job.error = exc
            job.done.set()
