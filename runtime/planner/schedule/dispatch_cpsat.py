"""The ``cpsat`` dispatch: dispatch and packing jointly in one ortools CP-SAT model (every pipeline
gets up to ``Vcap`` micro-batch slots), time-boxed and hinted with the ``fast`` dispatch; the
yardstick, and an improver for small cases. ortools is imported where the model is built.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from hgraph.runtime.planner.schedule.dispatch_fast import dispatch_fast
from hgraph.runtime.planner.schedule.dispatch_result import (DispatchResult, check_eligible, pack_dispatch,
                                                             scheme_costs)
from hgraph.runtime.planner.schedule.packing import CPSAT_UNITS_PER_MS
from hgraph.strategy import Scheme


def dispatch_cpsat(lengths: np.ndarray, pipelines: Sequence[Scheme], cost, *, time_limit_s: float = 10.0,
                   workers: int = 1, hint: DispatchResult | None = None, vcap: int | None = None) -> DispatchResult:
    """Eq. 3 with the exact packed latency (Eq. 1) of every pipeline, in one CP-SAT model.

    Pipeline ``j`` has ``Vcap`` micro-batch slots (default: twice the hint's largest micro-batch
    count plus 2, at most the number of documents); ``V_j`` = used slots obey the App. C UtilLen
    bound ``V_j * UtilLen <= max(tokens_j, UtilLen)``; latency ``(PP-1+V_j) * max slot load``. The
    result is never worse than the hint (the fast dispatch by default), which is given in full
    (every variable), so CP-SAT starts from a feasible solution even on models too large to find
    one in the time limit. ``bound`` is CP-SAT's proven lower bound (also when it found no
    solution); ``bound_restricted`` says whether ``Vcap`` was below the App. C range's largest
    ``V`` for some pipeline (then the bound holds for the restricted model only).
    """
    from ortools.sat.python import cp_model

    groups, of = scheme_costs(pipelines, cost, lengths)
    check_eligible(lengths, groups)
    if hint is None:
        hint = dispatch_fast(lengths, pipelines, cost)
    D, B = len(pipelines), len(lengths)
    if B == 0:
        return hint
    lens = lengths.tolist()
    U = CPSAT_UNITS_PER_MS
    vmax_hint = max(p.num_microbatches for p in hint.packs)
    vc = vcap if vcap is not None else min(B, 2 * vmax_hint + 2)
    # Largest V of the App. C range over the pipelines (packing.microbatch_range with every document).
    total_tokens = int(lengths.sum())
    restricted = vc < min(B, max(max(total_tokens // max(g.util, 1), -(-total_tokens // g.cap)) for g in groups))
    # The hint, in full: slots of each pipeline in decreasing load (the model's symmetry breaking).
    hint_slot: dict[int, tuple[int, int]] = {}
    hint_loads: list[list[int]] = []
    for j, pk in enumerate(hint.packs):
        order = sorted(range(pk.num_microbatches), key=lambda s: -pk.mb_times[s])
        units_j = [int(round(float(t) * CPSAT_UNITS_PER_MS)) for t in groups[of[j]].t]
        cu_j = int(round(groups[of[j]].c * CPSAT_UNITS_PER_MS))
        loads = []
        for slot, s in enumerate(order):
            docs = pk.microbatches[s].tolist()
            for i in docs:
                hint_slot[i] = (j, slot)
            loads.append(sum(units_j[i] for i in docs) + cu_j)
        hint_loads.append(loads)
    full_hint = vmax_hint <= vc and all(loads == sorted(loads, reverse=True) for loads in hint_loads)
    m = cp_model.CpModel()
    x: dict[tuple[int, int, int], cp_model.IntVar] = {}
    for i in range(B):
        opts = []
        for j in range(D):
            if lens[i] <= groups[of[j]].cap:
                for s in range(vc):
                    x[i, j, s] = m.NewBoolVar("")
                    opts.append(x[i, j, s])
        m.AddExactlyOne(opts)
    total_units = sum(int(round(float(groups[g].t.max()) * U)) for g in range(len(groups))) * B + 1
    horizon = 0
    lat_vars = []
    for j in range(D):
        g = groups[of[j]]
        units = [int(round(float(t) * U)) for t in g.t]
        cu = int(round(g.c * U))
        y = [m.NewBoolVar("") for _ in range(vc)]
        for s in range(vc - 1):
            m.AddImplication(y[s + 1], y[s])
        M = m.NewIntVar(0, total_units + cu, "")
        tokens = []
        prev_load = None
        for s in range(vc):
            items = [(i, x[i, j, s]) for i in range(B) if (i, j, s) in x]
            for _, v in items:
                m.AddImplication(v, y[s])
            m.Add(sum(lens[i] * v for i, v in items) <= g.cap)
            load = sum(units[i] * v for i, v in items) + cu * y[s]
            m.Add(load <= M)
            tokens.append(sum(lens[i] * v for i, v in items))
            if prev_load is not None:
                m.Add(prev_load >= load)  # symmetry: slots in decreasing load
            prev_load = load
        V = m.NewIntVar(0, vc, "")
        m.Add(V == sum(y))
        tok = m.NewIntVar(0, int(lengths.sum()), "")
        m.Add(tok == sum(tokens))
        cap_tok = m.NewIntVar(0, int(lengths.sum()) + g.util, "")
        m.AddMaxEquality(cap_tok, [tok, g.util])
        m.Add(V * g.util <= cap_tok)
        kv = m.NewIntVar(0, g.k + vc, "")
        m.Add(kv == V + g.k).OnlyEnforceIf(y[0])
        m.Add(kv == 0).OnlyEnforceIf(y[0].Not())
        ub = (g.k + vc) * (total_units + cu)
        horizon = max(horizon, ub)
        lat = m.NewIntVar(0, ub, "")
        m.AddMultiplicationEquality(lat, [kv, M])
        lat_vars.append(lat)
        if full_hint:
            loads = hint_loads[j]
            h_tok = int(lengths[hint.assignment[j]].sum()) if len(hint.assignment[j]) else 0
            h_M = max(loads, default=0)
            h_kv = len(loads) + g.k if loads else 0
            for s_, v in enumerate(y):
                m.AddHint(v, s_ < len(loads))
            for var, val in ((M, h_M), (V, len(loads)), (tok, h_tok), (cap_tok, max(h_tok, g.util)), (kv, h_kv),
                             (lat, h_kv * h_M)):
                m.AddHint(var, val)
    Z = m.NewIntVar(0, horizon, "")
    m.AddMaxEquality(Z, lat_vars)
    m.Minimize(Z)
    # Hint: the given dispatch, slots sorted by load (every x when the hint fits the slots).
    for (i, j, s_), v in x.items():
        if full_hint:
            m.AddHint(v, hint_slot[i] == (j, s_))
        elif hint_slot.get(i) == (j, s_):
            m.AddHint(v, 1)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = workers
    status = solver.Solve(m)
    bound = solver.BestObjectiveBound() / U if status != cp_model.MODEL_INVALID else None
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return DispatchResult(hint.assignment, hint.packs, hint.latency, bound=bound, bound_restricted=restricted)
    members: list[list[int]] = [[] for _ in range(D)]
    for (i, j, s), v in x.items():
        if solver.BooleanValue(v):
            members[j].append(i)
    # Re-pack each pipeline with the exact float costs (CP-SAT used rounded integers).
    res = pack_dispatch(lengths, pipelines, cost, members)
    chosen = res if res.latency < hint.latency else hint
    return DispatchResult(chosen.assignment, chosen.packs, chosen.latency, bound=bound, bound_restricted=restricted)
