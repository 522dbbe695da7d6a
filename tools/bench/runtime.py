"""Runtime benchmarks: step overhead vs eager PyTorch, DP4 vs DDP, pull/push bytes vs the minimum,
and the host time of a strategy switch with a graph-cache hit.

``python -m hgraph.tools.bench.runtime [--model tiny] [--steps 20] [--block 5] [--docs 16] [--doc-len 64] [--repeats 3]``

Every comparison alternates the two sides in one process (so load drifts hit both alike), takes the
median of the per-pair ratios and its quartiles, and is launched ``--repeats`` times; the summary is
the median over launches. On a shared, loaded machine read the quartiles and the launches' spread.

1. **Single rank**: one training step of the compiled model (Executor, ``1xTP1PP1``, one packed
   micro-batch) vs the same step in eager PyTorch (each document alone, same loss, ``torch.optim.Adam``)
   in the same process.
2. **DP4 on gloo**: compiled ``4xTP1PP1`` vs ``DistributedDataParallel`` + Adam, 4 processes, each rank
   the same documents in both (its quarter of the mini-batch). What a run of training sees is the time
   of consecutive steps, so the two sides alternate in runs of ``--block`` consecutive steps, each run
   timed on rank 0 from a barrier to a barrier (the closing barrier counts: it is where the run's
   stragglers finish) and divided by its steps; the ratio is the median of the per-pair ratios.
   (Alternating single steps, as before, charges the compiled step with the skew DDP's step leaves:
   DDP ends in an optimizer step over every parameter whose length varies per rank, the compiled step
   in a collective that lines the ranks up, so the next compiled step's first collective waits for the
   slowest DDP rank while DDP's never waits for a compiled one.)
   The compiled step is the executor's overlapped update (plain data parallelism): gradients reduced
   in one all-to-all carrying the loss, shards updated, the next step's parameters gathered in one
   all-to-all before the step returns; DDP's step is one all-reduce and Adam over every parameter.
   Both use the launcher's torch threads per rank (``OMP_NUM_THREADS`` if set).
3. **Bytes and messages**: per strategy, what pull and push move (LNK transfers, all-gather and reduce-scatter
   payloads, all ranks' receipts summed) from the Programs' plans that ParamSync executes op for op,
   against the minima: pull, each rank receives exactly the rows it needs and does not own; push, the
   least a push that sums on the way can move (per row, one message per contributor other than the
   owner) and the owner-receipt figure (each owner receives each foreign row once), which is below
   anything reachable when a row has two contributors besides its owner. On gloo the reduce-scatters
   and the all-gathers run as all-to-alls (faster there, see ``runtime.grad_buckets`` and
   ``runtime.param_gather``), which move the same bytes. And the point-to-point messages of a step
   (all ranks' sends, gloo's caps) against the plans' transfers: ``runtime.comm.peer_buckets``
   coalesces the small transfers between two ranks, which were a message each.
4. **Switch**: host time of ``Executor.rank_state`` (the Program and the rank's state) when the strategy was seen
   before (every step's pull is not included).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import hgraph
from hgraph.passes.lnk.plans import min_pull_bytes, min_push_bytes, min_reduce_push_bytes
from hgraph.runtime.comm.process_groups import GroupCache
from hgraph.runtime.comm.pull import GLOO_PULL_BUCKET_BYTES, pull_messages
from hgraph.runtime.comm.push import push_messages
from hgraph.runtime.data.micro_batch import MicroBatch
from hgraph.runtime.engine.executor import Executor
from hgraph.runtime.train.launch import spawn
from hgraph.runtime.train.model_setup import build_model, make_optimizer
from hgraph.runtime.train.config import TrainConfig
from hgraph.strategy import Strategy

STRATEGIES_4 = ["4xTP1PP1", "1xTP2PP1+2xTP1PP1", "1xTP2PP2", "1xTP1PP2+1xTP2PP1"]


def _docs(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = [max(2, length // 2 + (i * 37) % length) for i in range(n)]
    return [torch.randint(0, vocab, (l,), generator=g).tolist() for l in lens]


def _eager_step(model, opt, docs) -> float:
    opt.zero_grad(set_to_none=True)
    targets = sum(len(d) - 1 for d in docs)
    total = 0.0
    for d in docs:
        ids = torch.tensor([d])
        loss = F.cross_entropy(model(ids)[0, :-1], ids[0, 1:], reduction="sum") / targets
        loss.backward()
        total += float(loss.detach())
    opt.step()
    return total


def _paired_times(fn_a, fn_b, steps: int, warmup: int = 3) -> dict:
    """Alternate ``fn_a`` and ``fn_b`` (so load drifts hit both alike); median times and the median of
    the per-pair ratios a / b (robust on a shared, loaded machine)."""
    for _ in range(warmup):
        fn_a()
        fn_b()
    ta, tb = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn_a()
        ta.append(time.perf_counter() - t0)
        t1 = time.perf_counter()
        fn_b()
        tb.append(time.perf_counter() - t1)
    ratios = sorted(a / b for a, b in zip(ta, tb))
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    return {"a_ms": 1e3 * statistics.median(ta), "b_ms": 1e3 * statistics.median(tb),
            "ratio": statistics.median(ratios), "ratio_q1": q1, "ratio_q3": q3,
            "ratio_of_minima": min(ta) / min(tb)}


def _setup(model_name: str, strategy: str, rank: int, world: int, groups=None):
    cfg = TrainConfig.from_values(model=model_name, world_size=world, strategy_schedule=strategy, steps=1,
                                  tokens_per_iter=1)
    model = build_model(cfg)
    compiled = hgraph.compile(model)
    opt = make_optimizer(cfg, compiled, rank, world)
    ex = Executor(compiled, opt, rank, world, groups or GroupCache(rank, world))
    return compiled, ex


def single_rank(model_name: str, steps: int, docs: list[list[int]]) -> dict:
    """Compiled vs eager step time in this process (a one-rank gloo group for the executor)."""
    store_dir = tempfile.mkdtemp(prefix="hgraph-bench-")
    dist.init_process_group("gloo", init_method="file://" + os.path.join(store_dir, "s"), rank=0, world_size=1)
    try:
        compiled, ex = _setup(model_name, "1xTP1PP1", 0, 1)
        prog = compiled.instantiate("1xTP1PP1")
        mb = [[MicroBatch.pack(docs)]]
        targets = sum(len(d) - 1 for d in docs)
        model = build_model(TrainConfig.from_values(model=model_name, world_size=1))
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        t = _paired_times(lambda: ex.step(prog, mb, targets), lambda: _eager_step(model, opt, docs), steps)
    finally:
        dist.destroy_process_group()
    return {"compiled_ms": t["a_ms"], "eager_ms": t["b_ms"], "ratio": t["ratio"], "ratio_q1": t["ratio_q1"],
            "ratio_q3": t["ratio_q3"], "ratio_of_minima": t["ratio_of_minima"]}


def _paired_blocks(fn_a, fn_b, blocks: int, block: int, barrier) -> dict:
    """Alternate runs of ``block`` consecutive calls of ``fn_a`` and of ``fn_b``, each run timed from
    ``barrier`` to ``barrier`` (both inside) and divided by ``block``; medians and the median of the
    per-pair ratios a / b, as ``_paired_times``."""
    def run(fn) -> float:
        barrier()
        t0 = time.perf_counter()
        for _ in range(block):
            fn()
        barrier()
        return (time.perf_counter() - t0) / block
    run(fn_a)
    run(fn_b)                    # warm-up
    ta, tb = [], []
    for _ in range(blocks):
        ta.append(run(fn_a))
        tb.append(run(fn_b))
    ratios = sorted(a / b for a, b in zip(ta, tb))
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    return {"a_ms": 1e3 * statistics.median(ta), "b_ms": 1e3 * statistics.median(tb),
            "ratio": statistics.median(ratios), "ratio_q1": q1, "ratio_q3": q3,
            "ratio_of_minima": min(ta) / min(tb)}


def _dp4_worker(rank: int, world: int, model_name: str, blocks: int, docs: list[list[int]],
                block: int = 5) -> dict:
    compiled, ex = _setup(model_name, "4xTP1PP1", rank, world)
    share = [docs[i::world] for i in range(world)]
    targets = sum(len(d) - 1 for d in docs)
    mbs = [[MicroBatch.pack(s)] for s in share]
    prog = ex.program(Strategy.parse("4xTP1PP1"))

    model = build_model(TrainConfig.from_values(model=model_name, world_size=world))
    ddp = DDP(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)

    def ddp_step():
        opt.zero_grad(set_to_none=True)
        mine = share[rank]
        with ddp.no_sync():
            for d in mine[:-1]:
                ids = torch.tensor([d])
                (F.cross_entropy(ddp(ids)[0, :-1], ids[0, 1:], reduction="sum") * world / targets).backward()
        ids = torch.tensor([mine[-1]])
        (F.cross_entropy(ddp(ids)[0, :-1], ids[0, 1:], reduction="sum") * world / targets).backward()
        opt.step()

    last = []
    t = _paired_blocks(lambda: last.append(ex.step(prog, mbs, targets)), ddp_step, blocks, block, dist.barrier)

    # switch with a cache hit: alternate two strategies already built
    other = Strategy.parse("1xTP2PP1+2xTP1PP1")
    ex.rank_state(other)
    ex.rank_state(prog)
    switches = []
    for i in range(50):
        t0 = time.perf_counter()
        ex.rank_state(other if i % 2 == 0 else Strategy.parse("4xTP1PP1"))
        switches.append(time.perf_counter() - t0)
    dist.barrier()
    return {"compiled_ms": t["a_ms"], "ddp_ms": t["b_ms"], "ratio": t["ratio"], "ratio_q1": t["ratio_q1"],
            "ratio_q3": t["ratio_q3"], "ratio_of_minima": t["ratio_of_minima"],
            "switch_hit_ms_max": 1e3 * max(switches), "switch_hit_ms_median": 1e3 * statistics.median(switches),
            "overlapped_update": last[-1].overlapped_update, "pull_prefetched": last[-1].pull_prefetched,
            "torch_threads": torch.get_num_threads()}


def bytes_table(model_name: str, strategies: list[str], world: int) -> list[dict]:
    """Pull / push bytes of each strategy's plans against the per-rank minimum."""
    compiled = hgraph.compile(build_model(TrainConfig.from_values(model=model_name, world_size=world)))
    rows = []
    for text in strategies:
        prog = compiled.instantiate(text, world_size=world)
        pull = pull_min = push = push_rs = push_min = push_reduce_min = 0
        for name in prog.pull_plans:
            pp, ph = prog.pull_plans[name], prog.push_plans[name]
            if pp.is_all_gather:      # ring all-gather: each rank receives every other segment (padded)
                width = -(-pp.param.size // world)
                pull += world * (world - 1) * pp.param.slice_bytes(0, width, pp.working_dtype_bytes)
            else:
                pull += pp.total_bytes
            pull_min += sum(min_pull_bytes(pp.param, pp.needs, world,
                                           working_dtype_bytes=pp.working_dtype_bytes).values())
            push += ph.total_bytes
            push_rs += ph.reduce_scatter_bytes
            push_min += sum(min_push_bytes(ph.param, ph.contributions, world).values())
            push_reduce_min += min_reduce_push_bytes(ph.param, ph.contributions, world)
        rows.append({"strategy": text, "pull_bytes": pull, "pull_min_bytes": pull_min,
                     "push_lnk_bytes": push, "push_reduce_scatter_bytes": push_rs, "push_min_bytes": push_min,
                     "push_reduce_min_bytes": push_reduce_min, **_messages(prog, world)})
    return rows


def _messages(prog, world: int) -> dict:
    """Point-to-point messages of one step, all ranks' sends (pull and push, gloo's bucket caps),
    against the plans' transfers (a message each before they were coalesced)."""
    transfers = messages = 0
    for rank in range(world):
        for peers in (pull_messages(prog, rank, 4, GLOO_PULL_BUCKET_BYTES), push_messages(prog, rank)):
            sends = [b for b in peers.buckets() if b.send]
            transfers += sum(len(b.rows) for b in sends)
            messages += sum(b.numel > 0 for b in sends)
    return {"p2p_transfers": transfers, "p2p_messages": messages}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument("--doc-len", type=int, default=64)
    ap.add_argument("--skip-dp4", action="store_true")
    ap.add_argument("--block", type=int, default=5,
                    help="DP4: consecutive steps per timed run (each run from a barrier to a barrier; "
                         "the sides alternate --steps runs each)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="launches of each comparison (each alternates the pair --steps times); the summary "
                         "is the median of the launches' median ratios")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of the single-rank comparison (default 1: steady on a shared machine)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    docs = _docs(args.docs, args.doc_len, 512)
    one = _docs(4, 4 * args.doc_len, 512, seed=1)
    # "one doc": one document per rank, so packing plays no part and the ratio is the runtime's
    # overhead; "packed": --docs documents, packed into one row by hgraph, one at a time in eager
    runs = range(max(1, args.repeats))
    out = {"single_rank": {"one_doc": [single_rank(args.model, args.steps, one[:1]) for _ in runs],
                           "packed": [single_rank(args.model, args.steps, docs) for _ in runs]}}
    if not args.skip_dp4:
        out["dp4"] = {kind: [spawn(_dp4_worker, 4, args=(args.model, args.steps, d, max(1, args.block)),
                                      timeout_s=600)[0] for _ in runs]
                      for kind, d in (("one_doc", one), ("packed", docs))}
    out["bytes"] = bytes_table(args.model, STRATEGIES_4, 4)
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"ratios: median of {args.steps} alternated pairs per launch [quartiles], {len(runs)} launches; "
          f"summary = median over launches; DP4 pairs are runs of {max(1, args.block)} consecutive steps "
          "(per-step time of a run, barrier to barrier)")
    for section, base, label in (("single_rank", "eager_ms", "eager"), ("dp4", "ddp_ms", "DDP")):
        for kind, launches in out.get(section, {}).items():
            name = "single rank" if section == "single_rank" else "DP4 gloo 4xTP1PP1"
            each = "  ".join(f"{d['ratio']:.3f} [{d['ratio_q1']:.3f}, {d['ratio_q3']:.3f}]" for d in launches)
            summary = statistics.median(d["ratio"] for d in launches)
            print(f"{name} ({kind}): compiled {statistics.median(d['compiled_ms'] for d in launches):.2f} ms, {label} "
                  f"{statistics.median(d[base] for d in launches):.2f} ms, ratio {summary:.3f}  (launches: {each})")
    for launches in out.get("dp4", {}).values():
        d = launches[0]
        print(f"DP4 compiled step: overlapped update {d['overlapped_update']}, pull prefetched by the step before "
              f"{d['pull_prefetched']}, torch threads per rank {d['torch_threads']}")
        worst = max(d["switch_hit_ms_max"] for d in launches)
        print(f"switch with a cache hit: median {statistics.median(d['switch_hit_ms_median'] for d in launches):.4f} ms, "
              f"max {worst:.4f} ms")
        break
    print("bytes per step, all ranks' receipts summed (pull in the working dtype, push in fp32):")
    for r in out["bytes"]:
        push = r["push_lnk_bytes"] + r["push_reduce_scatter_bytes"]
        print(f"  {r['strategy']:<22} pull {r['pull_bytes']:>9} B (min {r['pull_min_bytes']:>9})  push {push:>9} B = "
              f"LNK {r['push_lnk_bytes']:>9} + reduce-scatter {r['push_reduce_scatter_bytes']:>9} "
              f"(summing min {r['push_reduce_min_bytes']:>9}; owner-receipt {r['push_min_bytes']:>9}); "
              f"{r['p2p_messages']} point-to-point messages for {r['p2p_transfers']} transfers")
    print("  push minima: 'summing min' = per row, one message per contributor other than its owner, the least\n"
          "  any push that adds partial gradients can move; 'owner-receipt' = each owner receives each row it\n"
          "  lacks once. The second is reachable only when no row has two contributors besides its owner:\n"
          "  otherwise two partial sums must meet on some rank before the owner, and that rank receives one.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
