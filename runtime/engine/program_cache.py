"""The executor's cache of per-strategy Programs and of this rank's state for each (Hydraulis §5).

Per strategy, ``ProgramCache`` holds the Program, built by ``CompiledModule.build_program``, and this
rank's state for it (the executor's ``RankState``: its graph, Pull/Push plans, and, once it runs,
working tensors and process groups). A Program is built one of two ways:

* **ahead** (``build_ahead``): the step mode knows the strategies of the next steps (the plan-ahead
  process's plans, a fixed schedule), and the executor asks for the ones not built yet; a background
  thread (``engine.build_ahead``) builds the Program and prepares this rank's state for it (host work
  only: no collective, no working tensor allocated) while earlier steps run. The step that needs it
  takes the result (waiting only if the build has not finished: that wait is part of its switch);
* **inline** on a miss: the step's strategy was not asked for ahead (the first step of a run, a
  planner lost to inline planning); the step builds it.

Every lookup of a step is timed (``switch_s``: the lookup, plus an inline build on a miss or the
wait for an unfinished ahead build); the build itself is timed apart (``CachedProgram.build``, which
``info()`` sums in ``build_s``). Switching back to a strategy seen before moves no optimizer state,
whose layout does not depend on the strategy. ``info()`` has the figures the metrics and the run's
summary report.

Nothing is evicted: a run's strategies are few (its candidates, or its schedule), and what an entry
holds while another strategy runs is host structures (the Program, this rank's graph and plans): its
working tensors are freed at the switch and allocated again when it runs (``ParamSync``), and a state
prepared ahead has none. An entry dropped with the cache frees what it held.

The executor owns the cache: it is the only one that looks Programs up, so it alone counts hits
and misses; others read the counts. A Program built elsewhere (e.g. by ``CompiledModule.instantiate``)
that the executor is asked to run is kept under its strategy too (``adopt``), without counting.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable, Generic, Optional, TypeVar

from hgraph.compiled import CompiledModule
from hgraph.program import Program
from hgraph.runtime.engine.build_ahead import AheadBuilds, BuildTiming
from hgraph.strategy import Cluster, Strategy


StateT = TypeVar("StateT")      # the executor's per-Program rank state (``executor.RankState``)


@dataclass
class CachedProgram(Generic[StateT]):
    """A strategy's Program and this rank's state for it (None until built: on its first step, or
    prepared ahead); ``build``: how its build ran (None: adopted); ``ahead``: built ahead (the Program
    with this rank's state, or, for a Program built before any step by ``Executor.prepare``, the
    state alone); ``used``: a step has looked it up."""

    program: Program
    state: Optional[StateT] = None
    build: Optional[BuildTiming] = None
    ahead: bool = False
    used: bool = False

    def prepared(self, state: StateT, build_s: float, cpu_s: float) -> None:
        """This rank's state, prepared on the Program's first step; the preparation's wall and CPU time
        count in the Program's build (if it was built here)."""
        self.state = state
        if self.build is not None:
            self.build = replace(self.build, build_s=self.build.build_s + build_s, cpu_s=self.build.cpu_s + cpu_s)


class ProgramCache(Generic[StateT]):
    """Programs of ``compiled`` on ``cluster``, per strategy, with this rank's state."""

    def __init__(self, compiled: CompiledModule, cluster: Cluster) -> None:
        self.compiled, self.cluster = compiled, cluster
        self._hits = self._misses = 0
        self.switch_s: list[float] = []       # per counted lookup of a Program built before
        self._entries: dict[Strategy, CachedProgram[StateT]] = {}
        self._ahead = AheadBuilds()

    @property
    def hits(self) -> int:
        return self._hits

    @property
    def misses(self) -> int:
        return self._misses

    def build_ahead(self, strategy: Strategy, prepare: Callable[[Program], StateT]) -> bool:
        """Build ``strategy``'s Program (unless built before, e.g. by ``prepare``) and ``prepare(program)``
        (this rank's state, host work only) on the background thread, unless its state exists or is
        being built; True if a build was started."""
        entry = self._entries.get(strategy)
        if (entry is not None and entry.state is not None) or self._ahead.pending(strategy):
            return False
        if entry is not None:
            program = entry.program
            return self._ahead.submit(strategy, lambda: (program, prepare(program)))
        compiled, cluster = self.compiled, self.cluster
        return self._ahead.submit(strategy, lambda: _built(compiled.build_program(strategy, cluster), prepare))

    def find(self, strategy: Strategy, *, count: bool = True) -> tuple[CachedProgram[StateT], bool]:
        """The entry of ``strategy`` and whether it was built before this lookup (a hit: built by an
        earlier step or ahead; a miss is built here). With ``count=False`` (an evaluation under a
        step's Program, ``prepare``) the lookup is not counted."""
        t0 = time.perf_counter()
        entry = self._entries.get(strategy)
        if self._ahead.pending(strategy):
            (program, state), timing = self._ahead.take(strategy)
            if entry is None:
                entry = self._entries[strategy] = CachedProgram(program, state, timing, ahead=True)
            else:        # its Program was built before any step (``prepare``): its state was prepared ahead
                entry.state, entry.ahead, entry.build = state, True, timing
        hit = entry is not None
        if entry is None:
            c0 = time.thread_time()
            program = self.compiled.build_program(strategy, self.cluster)
            timing = BuildTiming(time.perf_counter() - t0, time.thread_time() - c0, t0)
            entry = self._entries[strategy] = CachedProgram(program, build=timing)
        if count:
            entry.used = True
            if hit:
                self._hits += 1
                self.switch_s.append(time.perf_counter() - t0)
            else:
                self._misses += 1
        return entry, hit

    def adopt(self, program: Program) -> CachedProgram[StateT]:
        """The entry of ``program``, built elsewhere: kept under its strategy (replacing another
        Program of that strategy), not counted."""
        entry = self._entries.get(program.strategy)
        if entry is None or entry.program is not program:
            entry = self._entries[program.strategy] = CachedProgram(program)
        return entry

    def states(self) -> dict[Strategy, StateT]:
        """This rank's states, per strategy (those built so far, prepared ahead ones included)."""
        built = {s: e.state for s, e in self._entries.items() if e.state is not None}
        return {**built, **{s: state for s, (_, state) in self._ahead.finished().items() if s not in built}}

    def close(self) -> None:
        """Drop the builds not started (the run is over)."""
        self._ahead.close()

    def info(self) -> dict:
        """Hits and misses; ``ahead``: Programs built ahead; ``build_s`` / ``max_build_s``: their builds'
        seconds, all of them and the longest (ahead: on the background thread; inline: in the step)."""
        builds = [e.build.build_s for e in self._entries.values() if e.build is not None]
        return {"hits": self._hits, "misses": self._misses, "programs": len(self._entries),
                "ahead": sum(e.ahead for e in self._entries.values()),
                "max_hit_switch_ms": 1e3 * max(self.switch_s, default=0.0),
                "build_s": sum(builds), "max_build_s": max(builds, default=0.0)}


def _built(program: Program, prepare: Callable[[Program], StateT]) -> tuple[Program, StateT]:
    return program, prepare(program)
