"""Simulated training iterations of a length distribution under the cost model: hgraph vs baselines.

Every system sees the same mini-batches: the dataset's documents in a seeded random order, cut into
mini-batches of ``tokens_per_iter`` tokens in that order (``data.lengths.minibatches``); documents
longer than the context ``max_len`` are truncated to it (the papers' practice) or dropped. A system's
iteration latency is the propagation latency of the cost model (``T(l, P) = a l^2 + b l + c`` per
micro-batch and pipeline stage; a 1F1B pipeline takes ``sum + (PP - 1) * max`` of its micro-batch
times, WLB-LLM §3.1's critical path, for every system alike (hgraph's plans, chosen with the
planner's ``(PP - 1 + V) * max`` estimate, are re-estimated this way); slowest pipeline wins);
optimizer steps and parameter pulls are the same for all systems and are not modelled, except
HotSPa's strategy switches; a profile with a ``push`` model prices the gradient push that the last
backward does not hide in every 1F1B pipeline's time (``pipeline_ms``: hgraph, flexsp, megatron,
megatron-cp, deepspeed, wlb; hotspa's strategies each as such a step, dcp's groups after their last
accumulation step). The
per-rank spread is ``1 - min/max`` of the pipelines' (or groups') busy times in an iteration
(Hydraulis Fig. 12b: 0 = every rank finishes together).

Systems (Hydraulis §8.1 / App. F baselines, each tuned over its own strategy space on the simulated
iterations themselves, i.e. the best static configuration in hindsight):

- ``hgraph``: the candidates of ``auto_candidates.auto_candidates`` (what ``hgraph plan --strategies auto``
  uses: the strategy proposer's set on the whole dataset, checked on sampled mini-batches of the
  dataset, not on the simulated ones, plus the best homogeneous strategy), and per iteration
  ``plan_iteration`` (dispatch across pipelines + packing within them) picks the best candidate.
- ``megatron``: one homogeneous ``DP x <TP, PP, CP>`` for all iterations (any scheme of the cost
  model without Ulysses whose MaxLen holds the context); fixed-length packing (documents in order, a
  micro-batch is closed when the next document would pass ``max_len`` tokens) and even dispatch
  (micro-batches round-robin over the DP replicas).
- ``megatron-cp``: Megatron-LM with context parallelism, as ``megatron`` over the schemes with
  ``CP > 1`` only: the best homogeneous scheme with CP (skipped when the cost model derives no CP).
- ``deepspeed``: DeepSpeed-Ulysses: homogeneous ``DP x <TP, UL>`` (``PP = 1``, no CP) over the cost
  model's Ulysses schemes; where it has none (no heads known, or ``max_cp`` 1), SP degree ``s`` is
  modelled by its ``PP = 1`` schemes with ``TP * CP = s`` as before Ulysses was priced; packing and
  dispatch as ``megatron``.
- ``flexsp``: FlexSP (ASPLOS'25): heterogeneous Ulysses groups formed per step, no CP and no PP: the
  hgraph planner (proposal, then per iteration dispatch + packing) over the ``PP = 1, CP = 1``
  schemes, i.e. ``<TP, UL>`` groups of any degree side by side (TP stands in for FlexSP's ZeRO-3
  where a profile has no TP1 scheme that fits; skipped when no such scheme holds the context).
- ``hotspa``: 2 or 3 homogeneous strategies per iteration for length ranges (App. F: below 4K,
  4K-16K, above 16K, capped at the context), run one after another on all GPUs, each packing its
  documents to its range's upper length with even dispatch; each switch costs moving the model's
  bf16 parameters and fp32 gradients (6 bytes per parameter) over all GPUs at
  ``switch_gb_per_s`` GB/s per GPU (default 10, which gives ~0.5 s per switch for 7B on 8 GPUs,
  in line with Hydraulis §8.2's ~2 s of switching in a 6.7 s iteration). Ranges and per-range
  schemes are tuned.
- ``wlb``: WLB-LLM var-length packing with outlier delay (``wlb_packing.WLBPacker``, 2 queues) on a
  homogeneous 4D strategy: per iteration ``max(DP, ceil(tokens / max_len))`` micro-batches rounded
  up to a multiple of DP, each up to the scheme's MaxLen, dealt to replicas heaviest first onto the
  least loaded (same count each); delayed documents are trained in later iterations and the final
  flush adds iterations. CP is modelled as balanced by the cost model for every system (WLB's
  per-document sharding achieves that; the CP imbalance it removes is not charged to anyone).
- ``dcp``: DCP bucket parallel: every document goes to the smallest-GPU ``PP = 1`` scheme that
  holds it (its SP size); GPUs are split into groups of each scheme (one group per used scheme,
  then more to the scheme with the most GPU-time per GPU); documents go longest first to the least
  loaded group of their scheme, and each group runs its documents as gradient-accumulation steps of
  micro-batches up to MaxLen tokens, paying ``c`` per step (DCP-inter balances by accumulation
  counts, Eq. 3; the idle fraction of Eq. 3 is reported); with too few GPUs for one group of each
  used scheme, schemes run one after another on all GPUs.

For a mixture-of-experts model two more, ``MOE_SYSTEMS`` (``research/moe_baselines``): the best
homogeneous EP strategy planned per iteration and a Megatron-style static EP8 baseline.
"""
from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from hgraph.errors import HGraphError
from hgraph.runtime.data.lengths import minibatches
from hgraph.runtime.data.wlb_packing import DocLatency, WLBPacker
from hgraph.runtime.planner.schedule.data_centric import idle_fraction
from hgraph.runtime.planner.auto_candidates import auto_candidates
from hgraph.runtime.research.moe_baselines import MOE_SYSTEMS, simulate_moe_system
from hgraph.runtime.research.system_results import (IterationResult, Simulation, SystemResult, fixed_length_pack,
                                                    homogeneous_space, microbatch_times, pipeline_ms, planned,
                                                    spread, tune)
from hgraph.strategy import Scheme, Strategy

SYSTEMS = ("hgraph", "megatron", "megatron-cp", "deepspeed", "flexsp", "hotspa", "wlb", "dcp")
BASELINES = tuple(s for s in SYSTEMS if s != "hgraph")


# ---- shared pieces ----------------------------------------------------------------------------
def sample_minibatches(lengths, tokens_per_iter: int, iters: int, max_len: int, *, seed: int = 0,
                       long: str = "truncate") -> list[np.ndarray]:
    """``iters`` mini-batches (arrays of lengths) from a seeded shuffle of the dataset."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if long == "truncate":
        lengths = np.minimum(lengths, max_len)
    elif long == "drop":
        lengths = lengths[lengths <= max_len]
    else:
        raise HGraphError(f"long documents must be 'truncate' or 'drop', got {long!r}")
    if lengths.size == 0:
        raise HGraphError(f"no document of at most {max_len} tokens")
    order = np.random.default_rng(seed).permutation(lengths.size)
    shuffled = lengths[order]
    need = tokens_per_iter * (iters + 1)
    upto = int(np.searchsorted(np.cumsum(shuffled), need)) + 1
    batches = [shuffled[idx] for idx in minibatches(shuffled[:upto], tokens_per_iter)]
    if len(batches) < iters:
        raise HGraphError(f"the dataset holds only {len(batches)} mini-batches of {tokens_per_iter} tokens, "
                          f"fewer than the {iters} iterations asked for")
    return batches[:iters]


def _even_dispatch_latency(cost, scheme: Scheme, dp: int, mbs: list[list[int]]) -> tuple[float, float]:
    """Round-robin micro-batches over ``dp`` replicas: (iteration latency, spread)."""
    if not mbs:
        return 0.0, 0.0
    t = microbatch_times(cost, scheme, mbs)
    lat = []
    for r in range(dp):
        mine = t[r::dp]
        lat.append(pipeline_ms(mine, scheme, cost))
    return max(lat), spread(lat)


def deepspeed_space(cost, gpus: int, longest: int) -> list[Scheme]:
    """DeepSpeed-Ulysses' homogeneous schemes: ``<TP, UL>`` at ``PP = 1`` where the cost model has
    Ulysses schemes, else the ``PP = 1`` schemes with CP standing in for the SP degree."""
    if any(s.ul > 1 for s in cost.schemes):
        return homogeneous_space(cost, gpus, longest, pp1_only=True, keep=lambda s: s.cp == 1)
    return homogeneous_space(cost, gpus, longest, pp1_only=True)


def without_ulysses(cost):
    """``cost`` without its Ulysses schemes: the space of the baselines that have none."""
    return cost.restricted(lambda s: s.ul == 1) if any(s.ul > 1 for s in cost.schemes) else cost


def iteration_lower_bound(lengths, cost, gpus: int) -> float:
    """A latency no system can beat on these documents with the cost model's schemes (ms).

    The larger of (1) the longest document alone on the scheme that runs it fastest:
    ``min_P PP * (T(l, P) + c)`` over the schemes whose MaxLen holds it (1F1B with one micro-batch);
    (2) the work: every document at its cheapest rank-ms ``r_P (t_P(l) + c_P l / MaxLen_P)`` (a
    pipeline runs at least ``tokens / MaxLen`` micro-batches, each paying ``c``) spread over all
    ``gpus`` GPUs. Holds for every system here (same cost model, every rank busy at most the
    iteration), except WLB-LLM, which moves documents between iterations.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size == 0:
        return 0.0
    lf = lengths.astype(np.float64)
    alone = np.full(lengths.size, np.inf)
    work = np.full(lengths.size, np.inf)
    for s in cost.schemes:
        if s.num_ranks > gpus:
            continue
        a, b, c = cost.coeffs(s)
        cap = cost.max_len(s)
        t = a * lf * lf + b * lf
        ok = lengths <= cap
        alone = np.where(ok, np.minimum(alone, s.pp * (t + c)), alone)
        work = np.where(ok, np.minimum(work, s.num_ranks * (t + c * lf / cap)), work)
    return float(max(alone.max(), work.sum() / gpus))


# ---- systems ------------------------------------------------------------------------------------
def simulate_hgraph(batches, cost, gpus: int, max_len: int, dataset, tokens_per_iter: int,
                    name: str = "hgraph") -> SystemResult:
    t0 = time.perf_counter()
    candidates, source = auto_candidates(dataset, cost, gpus, max_len, tokens_per_iter)
    return planned(name, batches, cost, candidates, f"{len(candidates)} candidates ({source})",
                    (time.perf_counter() - t0) * 1e3)


def simulate_homogeneous(name: str, batches, cost, gpus: int, max_len: int, space: Sequence[Scheme]) -> SystemResult:
    def run(s: Scheme) -> SystemResult:
        dp = gpus // s.num_ranks
        its = []
        for b in batches:
            lat, uneven = _even_dispatch_latency(cost, s, dp, fixed_length_pack(b, max_len))
            its.append(IterationResult(lat, int(b.sum()), uneven))
        return SystemResult(name, str(Strategy.homogeneous(dp, s)), its)
    return tune(space, run, name)


def simulate_hotspa(batches, cost, gpus: int, max_len: int, switch_gb_per_s: float = 10.0) -> SystemResult:
    m = cost.model
    params = 12 * m.layers * m.hidden ** 2 + 2 * m.vocab * m.hidden
    switch_ms = params * 6 / (gpus * switch_gb_per_s * 1e9) * 1e3
    range_sets = sorted({tuple(sorted({min(x, max_len) for x in r})) for r in
                         ([max_len], [4096, max_len], [4096, 16384, max_len])})
    best = None
    for bounds in range_sets:
        lo = 0
        per_range = []
        for hi in bounds:
            space = homogeneous_space(cost, gpus, hi)
            sub = [b[(b > lo) & (b <= hi)] for b in batches]
            if not space:
                per_range = None
                break
            r = simulate_homogeneous("hotspa", sub, cost, gpus, hi, space)
            per_range.append((hi, r))
            lo = hi
        if per_range is None:
            continue
        its = []
        for i, b in enumerate(batches):
            parts = [r.iterations[i] for _, r in per_range if r.iterations[i].tokens > 0]
            lat = sum(p.latency_ms for p in parts) + switch_ms * max(len(parts) - 1, 0)
            # Ranks idle inside each phase: weight each phase's spread by its duration.
            idle = sum(p.spread * p.latency_ms for p in parts) / lat if lat > 0 else 0.0
            its.append(IterationResult(lat, int(b.sum()), idle))
        cfg = ", ".join(f"<={hi}: {r.config}" for hi, r in per_range)
        res = SystemResult("hotspa", cfg, its, notes={"switch_ms": switch_ms})
        if best is None or res.total_ms < best.total_ms:
            best = res
    if best is None:
        raise HGraphError("no HotSPa configuration holds the context length")
    return best


def simulate_wlb(batches, cost, gpus: int, max_len: int, space: Sequence[Scheme]) -> SystemResult:
    def run(s: Scheme) -> SystemResult:
        dp = gpus // s.num_ranks
        lat = DocLatency.from_cost_model(cost, s)
        cap = cost.max_len(s)
        tokens = max(int(max(b.sum() for b in batches)), 1)
        n_mb = max(dp, -(-tokens // max_len))
        n_mb = -(-n_mb // dp) * dp
        packer = WLBPacker(lat, n_mb, max_len, capacity=cap)
        its = []
        start = 0
        emitted = []
        for b in batches:
            emitted.append(packer.push(b, np.arange(start, start + b.size)))
            start += b.size
        emitted += packer.flush()
        all_lengths = np.concatenate(batches)
        for pb in emitted:
            mbs = [[int(all_lengths[i]) for i in mb] for mb in pb.microbatches if mb]
            t = microbatch_times(cost, s, mbs)
            order = np.argsort(-t)
            load = [[] for _ in range(dp)]
            for j, k in enumerate(order.tolist()):  # heaviest first, least loaded replica, equal counts
                r = min((r for r in range(dp) if len(load[r]) < -(-len(mbs) // dp)),
                        key=lambda r: sum(load[r]))
                load[r].append(float(t[k]))
            busy = [pipeline_ms(x, s, cost) for x in load]
            its.append(IterationResult(max(busy), int(sum(sum(m) for m in mbs)), spread(busy)))
        return SystemResult("wlb", str(Strategy.homogeneous(dp, s)), its,
                            notes={"mean_delay_iters": packer.stats.mean_delay(),
                                   "extra_flush_iterations": len(emitted) - len(batches)})
    return tune(space, run, "WLB-LLM")


def simulate_dcp(batches, cost, gpus: int, max_len: int) -> SystemResult:
    pp1 = sorted((s for s in cost.schemes if s.pp == 1 and gpus % s.num_ranks == 0),
                 key=lambda s: (s.num_ranks, -cost.max_len(s)))
    # The SP size of a length: the smallest PP=1 scheme that holds it, best GPU-time among equals.
    holders = []
    for s in pp1:
        if any(h.num_ranks == s.num_ranks for h in holders):
            continue
        same = [x for x in pp1 if x.num_ranks == s.num_ranks]
        holders.append(min(same, key=lambda x: (-cost.max_len(x), cost.coeffs(x)[1])))
    holders = [h for h in holders if cost.max_len(h) > 0]
    if not holders or max(cost.max_len(h) for h in holders) < max_len:
        raise HGraphError("no PP=1 scheme holds the context length (the Data-Centric Parallel baseline needs "
                          "sequence-parallel schemes)")
    its = []
    idle = []
    for b in batches:
        by_scheme: dict[Scheme, list[int]] = {}
        for l in sorted(b.tolist(), reverse=True):
            s = next(h for h in holders if cost.max_len(h) >= l)
            by_scheme.setdefault(s, []).append(l)
        work = {s: float(cost.seq_time(np.asarray(ls), s).sum()) * s.num_ranks for s, ls in by_scheme.items()}
        need = sum(s.num_ranks for s in by_scheme)
        if need <= gpus:
            # GPUs split in proportion to each SP size's GPU-time, at least one group each.
            groups = {s: 1 for s in by_scheme}
            left = gpus - need
            while True:
                fits = [s for s in by_scheme if s.num_ranks <= left and groups[s] < len(by_scheme[s])]
                if not fits:
                    break
                s = max(fits, key=lambda s: work[s] / (groups[s] * s.num_ranks))
                groups[s] += 1
                left -= s.num_ranks
            phases = [(by_scheme, groups)]
        else:  # one SP size after another, each on all GPUs
            phases = [({s: ls}, {s: min(gpus // s.num_ranks, len(ls))}) for s, ls in by_scheme.items()]
        lat, busy_all, steps, per_gpu, weighted = 0.0, [], [], [], 0.0
        for members, groups in phases:
            busy = []
            for s, ls in members.items():
                busy_s, cnt = _accumulate(cost, s, ls, groups[s])
                busy += busy_s
                steps += cnt
                per_gpu += [s.num_ranks] * len(busy_s)
            lat += max(busy)
            weighted += spread(busy) * max(busy)
            busy_all += busy
        idle.append(idle_fraction([bz / max(c, 1) for bz, c in zip(busy_all, steps)], steps, per_gpu))
        its.append(IterationResult(lat, int(b.sum()), weighted / lat if lat else 0.0))
    return SystemResult("dcp", "SP per length: " + ", ".join(f"{h}<={cost.max_len(h)}" for h in holders), its,
                        notes={"mean_idle_fraction": float(np.mean(idle)) if idle else None})


def _accumulate(cost, scheme: Scheme, lengths: list[int], groups: int) -> tuple[list[float], list[int]]:
    """Documents longest first onto the least loaded of ``groups`` SP groups; each group runs its
    documents as gradient-accumulation steps of micro-batches up to MaxLen tokens (DCP-inter's
    balancing by accumulation counts). Returns per-group busy time (ms, with the exposed push of a
    cost model that prices it) and step counts."""
    a, b, c = cost.coeffs(scheme)
    cap = cost.max_len(scheme)
    load = [0.0] * groups
    toks = [0] * groups
    for l in sorted(lengths, reverse=True):
        j = min(range(groups), key=lambda g: load[g] + c * (-(-(toks[g] + l) // cap)))
        load[j] += a * l * l + b * l
        toks[j] += l
    steps = [-(-t // cap) for t in toks]
    busy = [ld + c * st for ld, st in zip(load, steps)]
    # a group's push after its last accumulation step, which hides part of it (its mean step as that)
    return [bz + (cost.exposed_push_ms(scheme, [bz / st]) if st else 0.0) for bz, st in zip(busy, steps)], steps


def simulate(lengths, cost, gpus: int, max_len: int, tokens_per_iter: int, iters: int, *,
             systems: Sequence[str] = SYSTEMS, seed: int = 0, gpus_per_node: int = 8,
             long: str = "truncate", switch_gb_per_s: float = 10.0) -> Simulation:
    """Run ``iters`` iterations of every system in ``systems``."""
    bad = [s for s in systems if s not in SYSTEMS + MOE_SYSTEMS]
    if bad:
        raise HGraphError(f"unknown system(s) {', '.join(bad)}; choose from {', '.join(SYSTEMS + MOE_SYSTEMS)}")
    if gpus_per_node != cost.gpus_per_node:  # the candidates' node layout comes from the cost model
        raise HGraphError(f"{gpus_per_node} GPUs per node differs from the cost model's {cost.gpus_per_node}")
    if iters < 1 or tokens_per_iter < 1:
        raise HGraphError(f"iterations and tokens per iteration must be positive, got {iters}, {tokens_per_iter}")
    if cost.largest_max_len() < max_len:
        raise HGraphError(f"the context length {max_len} is longer than every scheme's MaxLen on {gpus} GPUs "
                          f"(largest {cost.largest_max_len()})")
    dataset = np.minimum(np.asarray(lengths, dtype=np.int64), max_len) if long == "truncate" else \
        np.asarray(lengths, dtype=np.int64)[np.asarray(lengths) <= max_len]
    batches = sample_minibatches(lengths, tokens_per_iter, iters, max_len, seed=seed, long=long)
    results: dict[str, SystemResult] = {}
    skipped: dict[str, str] = {}
    classic = without_ulysses(cost)        # the baselines that have no Ulysses
    for name in systems:
        if name == "hgraph":
            results[name] = simulate_hgraph(batches, cost, gpus, max_len, dataset, tokens_per_iter)
        elif name == "megatron":
            results[name] = simulate_homogeneous("megatron", batches, cost, gpus, max_len,
                                                 homogeneous_space(cost, gpus, max_len))
        elif name == "megatron-cp":
            space = homogeneous_space(cost, gpus, max_len, keep=lambda s: s.cp > 1 and s.ul == 1)
            if space:
                results[name] = simulate_homogeneous(name, batches, cost, gpus, max_len, space)
            else:
                skipped[name] = f"no homogeneous CP scheme of {gpus} GPUs holds {max_len} tokens"
        elif name == "deepspeed":
            space = deepspeed_space(cost, gpus, max_len)
            if space:
                results[name] = simulate_homogeneous(name, batches, cost, gpus, max_len, space)
            else:
                skipped[name] = f"no homogeneous <TP, UL> scheme (PP 1) of {gpus} GPUs holds {max_len} tokens"
        elif name == "flexsp":
            groups = cost.restricted(lambda s: s.pp == 1 and s.cp == 1)
            if not any(s.ul > 1 for s in groups.schemes):
                skipped[name] = "the cost model has no Ulysses scheme (heads unknown, or a UL limit of 1)"
            elif groups.largest_max_len() < max_len:
                skipped[name] = f"no <TP, UL> scheme (PP 1, no CP) holds {max_len} tokens"
            else:
                results[name] = simulate_hgraph(batches, groups, gpus, max_len, dataset, tokens_per_iter, name)
        elif name == "hotspa":
            results[name] = simulate_hotspa(batches, classic, gpus, max_len, switch_gb_per_s)
        elif name == "wlb":
            results[name] = simulate_wlb(batches, cost, gpus, max_len, homogeneous_space(cost, gpus, max_len))
        elif name == "dcp":
            results[name] = simulate_dcp(batches, classic, gpus, max_len)
        else:
            outcome = simulate_moe_system(name, batches, cost, gpus, max_len, dataset, tokens_per_iter)
            if isinstance(outcome, str):
                skipped[name] = outcome
            else:
                results[name] = outcome
    return Simulation(results, iters, int(tokens_per_iter), int(gpus), int(max_len), skipped)
