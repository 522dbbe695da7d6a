"""One cache of a run's per-strategy Programs and of this rank's state for each (Hydraulis §5).

Per strategy, ``ProgramCache`` holds the Program, built by ``CompiledModule.build_program`` on the
strategy's first use (a miss; its host time goes to ``compile_s``), and this rank's state for it
(the executor's ``RankState``: working tensors installed in the rank's graph, process groups, the
Pull/Push engine), built by the executor on the Program's first step. Switching back to a strategy
seen before is a dict lookup (a hit; its host time goes to ``switch_s``) and moves no optimizer
state, whose layout does not depend on the strategy. ``info()`` has the figures the metrics and the
run's summary report.

The training loop and the executor share one cache. A Program built elsewhere (e.g. by
``CompiledModule.instantiate``) that the executor is asked to run is kept under its strategy too,
without counting a hit or a miss.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

from hgraph.program import Program
from hgraph.strategy import Cluster, Strategy


@dataclass
class CachedProgram:
    """A strategy's Program and this rank's state for it (None until its first step)."""

    program: Program
    state: Any = None


class ProgramCache:
    """Programs of ``compiled`` on ``cluster``, per strategy, with this rank's state (module docstring)."""

    def __init__(self, compiled: Any, cluster: Cluster) -> None:
        self.compiled, self.cluster = compiled, cluster
        self.hits = self.misses = 0
        self.switch_s: list[float] = []
        self.compile_s: list[float] = []
        self._entries: dict[Strategy, CachedProgram] = {}

    def get(self, strategy: Strategy) -> Program:
        """The Program of ``strategy``, built on a miss."""
        t0 = time.perf_counter()
        entry = self._entries.get(strategy)
        if entry is None:
            self.misses += 1
            entry = self._entries[strategy] = CachedProgram(self.compiled.build_program(strategy, self.cluster))
            self.compile_s.append(time.perf_counter() - t0)
        else:
            self.hits += 1
            self.switch_s.append(time.perf_counter() - t0)
        return entry.program

    def peek(self, strategy: Strategy) -> Program:
        """The Program of ``strategy`` already built (no hit counted: an evaluation after its step)."""
        return self._entries[strategy].program

    def state(self, program: Program) -> Optional[Any]:
        """This rank's state for ``program`` (None before its first step)."""
        entry = self._entries.get(program.strategy)
        return entry.state if entry is not None and entry.program is program else None

    def keep_state(self, program: Program, state: Any) -> None:
        """Keep ``state`` for ``program`` (which replaces another Program of its strategy)."""
        entry = self._entries.get(program.strategy)
        if entry is None or entry.program is not program:
            entry = self._entries[program.strategy] = CachedProgram(program)
        entry.state = state

    def states(self) -> dict[Strategy, Any]:
        """This rank's states, per strategy (those built so far)."""
        return {s: e.state for s, e in self._entries.items() if e.state is not None}

    def info(self) -> dict:
        return {"hits": self.hits, "misses": self.misses, "programs": len(self._entries),
                "max_hit_switch_ms": 1e3 * max(self.switch_s, default=0.0),
                "compile_s": sum(self.compile_s)}
