"""The executor's cache of per-strategy Programs and of this rank's state for each (Hydraulis §5).

Per strategy, ``ProgramCache`` holds the Program, built by ``CompiledModule.build_program`` on the
strategy's first use (a miss; its host time goes to ``compile_s``), and this rank's state for it
(the executor's ``RankState``: working tensors installed in the rank's graph, process groups, the
Pull/Push engine), built by the executor on the Program's first step. Switching back to a strategy
seen before is a dict lookup (a hit; its host time goes to ``switch_s``) and moves no optimizer
state, whose layout does not depend on the strategy. ``info()`` has the figures the metrics and the
run's summary report.

The executor owns the cache: it is the only one that looks Programs up, so it alone counts hits
and misses; others read the counts. A Program built elsewhere (e.g. by ``CompiledModule.instantiate``)
that the executor is asked to run is kept under its strategy too (``adopt``), without counting.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Generic, Optional, TypeVar

from hgraph.compiled import CompiledModule
from hgraph.program import Program
from hgraph.strategy import Cluster, Strategy


StateT = TypeVar("StateT")      # the executor's per-Program rank state (``executor.RankState``)


@dataclass
class CachedProgram(Generic[StateT]):
    """A strategy's Program and this rank's state for it (None until its first step)."""

    program: Program
    state: Optional[StateT] = None


class ProgramCache(Generic[StateT]):
    """Programs of ``compiled`` on ``cluster``, per strategy, with this rank's state."""

    def __init__(self, compiled: CompiledModule, cluster: Cluster) -> None:
        self.compiled, self.cluster = compiled, cluster
        self._hits = self._misses = 0
        self.switch_s: list[float] = []
        self.compile_s: list[float] = []
        self._entries: dict[Strategy, CachedProgram[StateT]] = {}

    @property
    def hits(self) -> int:
        return self._hits

    @property
    def misses(self) -> int:
        return self._misses

    def find(self, strategy: Strategy, *, count: bool = True) -> tuple[CachedProgram[StateT], bool]:
        """The entry of ``strategy`` (its Program built on a miss) and whether it was a hit; with
        ``count=False`` (an evaluation under a step's Program) the lookup is not counted."""
        t0 = time.perf_counter()
        entry = self._entries.get(strategy)
        hit = entry is not None
        if entry is None:
            entry = self._entries[strategy] = CachedProgram(self.compiled.build_program(strategy, self.cluster))
        if count:
            if hit:
                self._hits += 1
                self.switch_s.append(time.perf_counter() - t0)
            else:
                self._misses += 1
                self.compile_s.append(time.perf_counter() - t0)
        return entry, hit

    def adopt(self, program: Program) -> CachedProgram[StateT]:
        """The entry of ``program``, built elsewhere: kept under its strategy (replacing another
        Program of that strategy), not counted."""
        entry = self._entries.get(program.strategy)
        if entry is None or entry.program is not program:
            entry = self._entries[program.strategy] = CachedProgram(program)
        return entry

    def states(self) -> dict[Strategy, StateT]:
        """This rank's states, per strategy (those built so far)."""
        return {s: e.state for s, e in self._entries.items() if e.state is not None}

    def info(self) -> dict:
        return {"hits": self._hits, "misses": self._misses, "programs": len(self._entries),
                "max_hit_switch_ms": 1e3 * max(self.switch_s, default=0.0),
                "compile_s": sum(self.compile_s)}
