"""Start the processes of a distributed run and initialise ``torch.distributed`` in each.

Two entry points:

* ``spawn(fn, world_size, ...)``: N local processes, started from a clean interpreter (never a
  plain fork of the caller, so a caller holding CUDA or threads is safe), rendezvous through a file store in a fresh temporary folder (no port races), one process group per
  process (``gloo`` on CPU; ``nccl`` with one GPU per process when asked and available). Each process
  runs ``fn(rank, world_size, *args)``; the parent returns every rank's (picklable) result in rank
  order. If a rank raises, the parent raises ``SpawnError`` naming the rank and its message; the other
  ranks get a short grace period and are then terminated, so a failure never hangs the caller. A rank
  that dies without reporting (killed, segfault) is named as lost. After a success the ranks exit by
  themselves (``EXIT_GRACE_S``), so their finalizers release what they hold.
* ``init_from_env()``: for processes started by a launcher, ``torchrun`` or a SLURM step
  (``hgraph.runtime.train.launcher_env``), meeting in this attempt's namespace of the launcher's store
  (``hgraph.runtime.train.rendezvous``).

Start method: ``"forkserver"`` by default where the platform has it: one server process imports
torch once and forks each child from its clean state, so a launch after the first costs well under
a second instead of one torch import per rank (measured: 4 ranks 0.3 s vs ~6-20 s with ``"spawn"``
on a 2-core machine). The server also imports what a training rank needs (``forkserver_preload``):
4 ranks each building a ``Trainer`` took 6.4-8.8 s without, 1.1-1.6 s with (2 cores).
``start_method="spawn"`` gives the classic ``torch.multiprocessing`` spawn. Each child gets the
caller's environment variables of the moment of the launch; settings that torch reads only when it
is imported come from the first launch with ``"forkserver"``.

``fn`` must be importable by the child: a module-level function. Functions of modules that are not on
``sys.path`` (a script, a test file imported by path) are re-imported from their file in the child.

Lifetime: every rank dies with the caller (``hgraph.runtime.process.lifetime``), so ``kill -9`` of the
launcher ends the run at once (the fork server too: ``hgraph.runtime.process.fork_server``). SIGTERM to the caller (the main thread's, while ``spawn`` runs) either stops
the run at once (``Stopped``) or, with ``forward_sigterm``, is passed on to every rank, which decide
how to end (a training run saves a checkpoint and returns, ``hgraph.runtime.train.exit_signal``).
Ranks that must be ended get SIGINT first (they report and run their exit handlers), SIGKILL after
``STOP_GRACE_S``.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import pickle
import queue as queue_mod
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing import forkserver
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.hub import tqdm       # what torch.fx's Interpreter draws its (disabled) bars with

from hgraph.compiled import COMPILER_MODULES
from hgraph.errors import HGraphError
from hgraph.runtime.train.launcher_env import (LAUNCHER_TIMEOUT_S, LauncherEnv, flight_recorder_env,
                                              read_launcher_env)
from hgraph.runtime.process.lifetime import NOTE_ENV, die_with_parent, read_note, tie_to_starter
from hgraph.runtime.train.rendezvous import attempt_store, meet

#: How long the surviving ranks may take to finish on their own after one rank failed.
FAILURE_GRACE_S = 3.0
#: How long ranks that all reported a result may take to exit on their own (process-group teardown,
#: multiprocessing finalizers) before they are terminated: a rank terminated inside its finalizers
#: leaves a named semaphore behind, which Python's resource tracker reports as leaked at shutdown.
EXIT_GRACE_S = 10.0
#: How long ranks asked to stop (SIGINT) may take before they are killed.
STOP_GRACE_S = 5.0
_POLL_S = 0.05


class Stopped(BaseException):
    """The launching process got SIGTERM and stopped the run (a BaseException, as KeyboardInterrupt:
    no ``except Exception`` on the way swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


class SpawnError(RuntimeError):
    """A rank of a spawned run raised, died or timed out.

    ``rank`` is the first rank that failed (``None`` for a timeout of several ranks);
    ``detail`` holds the failing rank's traceback text when it raised.
    """

    def __init__(self, message: str, rank: Optional[int] = None, detail: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.detail = detail


# ---- initialisation shared by spawn and torchrun -----------------------------------------------
def _check_backend(backend: str, world_size: int) -> None:
    if backend not in ("gloo", "nccl"):
        raise HGraphError(f"backend {backend!r} is not supported; use 'gloo' (CPU) or 'nccl' (CUDA)")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise HGraphError(f"backend 'nccl' needs one GPU per process: {world_size} processes, "
                          f"{torch.cuda.device_count()} GPUs visible; use backend='gloo'")


def local_backend(choice: str, world_size: int) -> str:
    """``auto``: NCCL when every local process can have a GPU of its own, else gloo (CPU)."""
    if choice == "auto":
        return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"
    _check_backend(choice, world_size)
    return choice


def _init_process_group(backend: str, init_method: str, rank: int, world_size: int,
                        timeout_s: float, local_rank: int) -> None:
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))


def init_from_env(backend: Optional[str] = None, timeout_s: float = LAUNCHER_TIMEOUT_S,
                  env: Optional[LauncherEnv] = None) -> tuple[int, int]:
    """Initialise the default process group of a launched process (``torchrun``, a SLURM task:
    ``hgraph.runtime.train.launcher_env``); returns (rank, world_size).

    ``backend`` defaults to ``nccl`` when every local process (``LOCAL_WORLD_SIZE``) can have a GPU
    of its own, else ``gloo``. The ranks meet in this attempt's namespace of the launcher's store
    (``hgraph.runtime.train.rendezvous``). Does nothing but return the numbers when the group is
    already initialised. On NCCL, PyTorch's flight recorder is turned on first, with a dump per rank
    when a collective times out (``launcher_env.flight_recorder_env``: what the user set stays).
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    env = env if env is not None else read_launcher_env()
    if env is None:
        raise HGraphError("init_from_env: environment variables RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT "
                          "are not set (nor a SLURM step's); start the program with torchrun or use "
                          "hgraph.runtime.train.launch.spawn")
    if env.launcher == "torchrun":
        # torchrun's agent forks its workers from its main thread, and a SIGKILLed agent signals none
        # (srun's step daemon ends its tasks itself). An agent already gone leaves this process its
        # store to time out on.
        die_with_parent(os.getppid())
    backend = local_backend(backend or "auto", env.local_world_size)
    if backend == "nccl":
        torch.cuda.set_device(env.local_rank)
        os.environ.update(flight_recorder_env(backend))     # read when the process group is made
    store = attempt_store(env, timeout_s)
    meet(store, env, timeout_s)          # a missing peer is named here, not by gloo's connect timeout
    dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size,
                            timeout=timedelta(seconds=timeout_s))
    return env.rank, env.world_size


# ---- finding fn again in the child -------------------------------------------------------------
class _FunctionRef:
    """A module-level function named by module, file and qualified name (picklable by value)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        if "<locals>" in fn.__qualname__ or fn.__name__ == "<lambda>":
            raise HGraphError(f"spawn: {fn.__qualname__} is not a module-level function; the child "
                              "processes must be able to import it")
        self.module = fn.__module__
        self.qualname = fn.__qualname__
        module = sys.modules.get(self.module)
        self.file = getattr(module, "__file__", None)

    def resolve(self) -> Callable[..., Any]:
        module = sys.modules.get(self.module)
        if module is None:
            try:
                module = importlib.import_module(self.module)
            except ImportError:
                if not self.file:
                    raise
                spec = importlib.util.spec_from_file_location(self.module, self.file)
                module = importlib.util.module_from_spec(spec)
                sys.modules[self.module] = module
                spec.loader.exec_module(module)
        obj: Any = module
        for part in self.qualname.split("."):
            obj = getattr(obj, part)
        return obj


def _loopback_interface() -> Optional[str]:
    names = {name for _, name in socket.if_nameindex()} if hasattr(socket, "if_nameindex") else set()
    return next((n for n in ("lo", "lo0") if n in names), None)


def _worker(rank: int, world_size: int, ref: _FunctionRef, args: tuple, backend: str,
            init_method: str, timeout_s: float, results: Any, environ: dict) -> None:
    tie_to_starter()
    if hasattr(tqdm, "set_lock"):
        # tqdm's default lock is a named semaphore, reported leaked when a rank is killed: keep it in-process
        tqdm.set_lock(threading.RLock())
    # A forkserver child starts with the server's environment: take the caller's, as spawn would.
    os.environ.clear()
    os.environ.update(environ)
    # All processes are local: keep gloo on the loopback device (the host name may not resolve).
    iface = _loopback_interface()
    if iface and backend == "gloo":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", iface)
    if "OMP_NUM_THREADS" not in os.environ:
        # N processes share this machine's cores (torchrun does the same): no oversubscription
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        _init_process_group(backend, init_method, rank, world_size, timeout_s, rank)
        out = ref.resolve()(rank, world_size, *args)
        report = (rank, True, pickle.dumps(out))
    except BaseException as e:  # report everything, including KeyboardInterrupt in a child
        message = f"{type(e).__name__}: {e}"
        report = (rank, False, pickle.dumps((message, traceback.format_exc())))
    # done: a stop request (SIGINT) finds it only reporting and exiting
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        results.put(report)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# ---- spawn -------------------------------------------------------------------------------------
def process_context(start_method: Optional[str] = None) -> Any:
    """The multiprocessing context ``spawn`` starts ranks from (``"forkserver"`` where the platform has
    it, with ``forkserver_preload``), for other processes of a run to start the same way."""
    method = start_method or ("forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn")
    if method not in ("forkserver", "spawn"):
        raise HGraphError(f"spawn: start_method {method!r} is not supported; use 'forkserver' or "
                          "'spawn' (a plain fork would copy the caller's threads and CUDA state)")
    ctx = mp.get_context(method)
    if method == "forkserver":
        # takes effect when the server starts (first launch); later launches reuse the server
        ctx.set_forkserver_preload(forkserver_preload())
    return ctx


#: What every training rank imports: torch, the runtime, the compiler it reaches lazily, and torch's
#: dynamo (imported by the first ``FakeTensorMode``: the meta-device model build and the memory model).
RANK_MODULES = ("torch", "torch.distributed", "torch._dynamo", __name__, "hgraph.runtime.train.trainer",
                *COMPILER_MODULES)
#: Imported last by the fork server: the server ends at once with its launcher, skipping teardown.
FORK_SERVER_EXIT = "hgraph.runtime.process.fork_server"
#: Optional libraries a rank needs when the caller already uses them (Hugging Face models).
CALLER_LIBRARIES = {"transformers": ("transformers", "transformers.modeling_utils")}


def forkserver_preload(libraries: Sequence[str] = ()) -> list[str]:
    """The modules the forkserver imports once for all its children: ``RANK_MODULES``, and the
    ``CALLER_LIBRARIES`` the caller has imported or names in ``libraries``. A rank that imported them
    itself would spend ~1.5 s of CPU (2.5 s with transformers), with all ranks importing at once on the
    same cores."""
    extra = [m for lib, modules in CALLER_LIBRARIES.items() if lib in sys.modules or lib in libraries
             for m in modules]
    # last: its exit handler must be registered after every other module's, so that it runs first
    return list(RANK_MODULES) + extra + [FORK_SERVER_EXIT]


def start_rank_server(libraries: Sequence[str] = ()) -> None:
    """Start the ranks' forkserver now, preloading ``forkserver_preload(libraries)``, and return at once:
    its imports (~3 s of CPU) then run beside the caller's own start-up instead of in front of the
    first rank. Nothing where the platform has no forkserver, or one runs already (with the preload
    it started with)."""
    if "forkserver" in mp.get_all_start_methods():
        mp.get_context("forkserver").set_forkserver_preload(forkserver_preload(libraries))
        forkserver.ensure_running()


def spawn(fn: Callable[..., Any], world_size: int, *, backend: str = "gloo", args: Sequence[Any] = (),
          timeout_s: float = 60.0, start_method: Optional[str] = None, forward_sigterm: bool = False) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` new processes; results in rank order.

    Raises ``SpawnError`` naming the first rank that raised or died, or the ranks still running
    after ``timeout_s`` seconds (collectives inside also time out after ``timeout_s``); ``Stopped``
    on SIGTERM, unless ``forward_sigterm`` passes it on to the ranks.
    """
    if world_size < 1:
        raise HGraphError(f"spawn: world_size must be >= 1, got {world_size}")
    _check_backend(backend, world_size)
    ref = _FunctionRef(fn)
    ctx = process_context(start_method)
    store_dir = tempfile.mkdtemp(prefix="hgraph-rdzv-")
    init_method = "file://" + os.path.join(store_dir, "store")
    results = ctx.Queue()
    notes = [os.path.join(store_dir, f"exit-note-{r}") for r in range(world_size)]
    procs = [ctx.Process(target=_worker, daemon=True, name=f"hgraph-rank{r}",
                         args=(r, world_size, ref, tuple(args), backend, init_method, timeout_s, results,
                               {**os.environ, NOTE_ENV: notes[r]}))
             for r in range(world_size)]
    finished = False
    sigterm = _SigtermWatch(forward_sigterm)
    try:
        with sigterm:
            for p in procs:
                p.start()
            out = _collect(procs, results, timeout_s, notes, sigterm)
        finished = True
        return out
    finally:
        # every rank reported: let it exit by itself; else ask it to stop, then kill it
        started = [p for p in procs if p.pid is not None]
        if not finished:
            _signal_alive(started, signal.SIGINT)
            _signal_alive(started, signal.SIGCONT)     # a stopped rank (SIGSTOP) can take it only running
        deadline = time.monotonic() + (EXIT_GRACE_S if finished else STOP_GRACE_S)
        for p in started:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in started:
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
        shutil.rmtree(store_dir, ignore_errors=True)


def _signal_alive(procs: list, signum: int) -> None:
    for p in procs:
        if p.pid is not None and p.exitcode is None:
            try:
                os.kill(p.pid, signum)
            except ProcessLookupError:
                pass


class _SigtermWatch:
    """SIGTERM in the launching process while ``spawn`` runs: ``Stopped`` raised in the main thread,
    or (``forward``) remembered for ``_collect`` to pass on to the ranks. Nothing is installed off the
    main thread (Python allows signal handlers only there)."""

    def __init__(self, forward: bool) -> None:
        self.forward = forward
        self.received = 0            # signals not yet passed on
        self._previous: Any = None

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if not self.forward:
            raise Stopped(signum)
        self.received += 1

    def pass_on(self, procs: list) -> None:
        if self.received:
            self.received = 0
            _signal_alive(procs, signal.SIGTERM)

    def __enter__(self) -> "_SigtermWatch":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


def _collect(procs: list, results: Any, timeout_s: float, notes: list[str],
             sigterm: Optional[_SigtermWatch] = None) -> list[Any]:
    world_size = len(procs)
    done: dict[int, Any] = {}
    failures: list[tuple[int, str, str]] = []
    deadline = time.monotonic() + timeout_s
    while len(done) < world_size:
        if sigterm is not None:
            sigterm.pass_on(procs)
        # Until a failure that is not the echo of a lost peer arrives, a rank that died without a
        # report is the cause.
        item = _next_report(procs, results, done, not _causes(failures), notes)
        if item is None:
            if time.monotonic() < deadline:
                continue
            if failures:
                break
            waiting = [r for r in range(world_size) if r not in done]
            raise SpawnError(f"spawn: rank(s) {waiting} did not finish within {timeout_s:g} s")
        rank, ok, payload = item
        if ok:
            done[rank] = pickle.loads(payload)
            continue
        message, detail = pickle.loads(payload)
        done[rank] = None
        failures.append((rank, message, detail))
        if len(_causes(failures)) == 1 and _causes(failures)[0][0] == rank:
            # The others are probably blocked in a collective with the failed rank: short grace. It
            # starts at the cause, not at a peer's echo of it, which may come first (under load, by
            # seconds), so the cause is never cut off.
            deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
    if failures:
        lost = [r for r, p in enumerate(procs) if r not in done and not p.is_alive()]
        if lost and not _causes(failures):
            # the reports only say a peer went away (e.g. in a collective outside a training step):
            # name the rank that died without a report
            r = lost[0]
            raise SpawnError(f"spawn: rank {r} was lost (process exited with code {procs[r].exitcode} without "
                             f"a result); rank(s) {sorted(f[0] for f in failures)} stopped on losing it", rank=r)
        raise _first_cause(failures)
    return [done[r] for r in range(world_size)]


def _causes(failures: list[tuple[int, str, str]]) -> list[tuple[int, str, str]]:
    """The failures that are not only the echo of a lost peer."""
    return [f for f in failures if not any(m in f[1] for m in _PEER_LOSS_MARKERS)]


# Messages of ranks that failed only because a peer went away first.
_PEER_LOSS_MARKERS = ("Connection closed by peer", "Connection reset by peer", "remote worker crash")


def _first_cause(failures: list[tuple[int, str, str]]) -> SpawnError:
    """The failure to report: the first one that is not a consequence of losing a peer."""
    rank, message, detail = (_causes(failures) or failures)[0]
    others = sorted(r for r, _, _ in failures if r != rank)
    also = f" (rank(s) {others} failed too)" if others else ""
    return SpawnError(f"spawn: rank {rank} failed: {message}{also}", rank=rank, detail=detail)


def _next_report(procs: list, results: Any, done: dict, check_lost: bool, notes: list[str]) -> Optional[tuple]:
    """The next (rank, ok, payload) report, or None after a short poll; raises for a lost rank."""
    try:
        return results.get(timeout=_POLL_S)
    except queue_mod.Empty:
        pass
    lost = [r for r, p in enumerate(procs) if r not in done and not p.is_alive()]
    if not lost or not check_lost:
        return None
    # A process that just exited may still have its report in the pipe: give it a moment.
    try:
        return results.get(timeout=1.0)
    except queue_mod.Empty:
        pass
    for r in lost:        # a rank that ended itself said why (e.g. a peer stopped answering)
        note = read_note(notes[r])
        if note is not None:
            blame = note.get("blame")
            raise SpawnError(f"spawn: {note['message']}", rank=r if blame is None else blame)
    r = lost[0]
    raise SpawnError(f"spawn: rank {r} was lost (process exited with code {procs[r].exitcode} "
                     "without a result)", rank=r)
