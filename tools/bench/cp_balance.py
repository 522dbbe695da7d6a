"""CP attention balance: per-sequence vs per-document vs adaptive sharding on a long-tail packed workload.

Real document lengths (the Wikipedia lengths of the shared data, or the sample shipped in the
package) are packed in file order into micro-batches of ``--context`` tokens (a document longer than
the context is truncated to it, as WLB-LLM does). Every micro-batch is split over ``--cp`` ranks by
each method; per method the table gives, over the micro-batches:

- ``flops max/mean``: the mean over micro-batches of max / mean attention FLOPs across the CP ranks
  (exact causal (query, key) pairs x 4 x hidden x 3.5 for forward + backward; 1.0 = balanced);
- ``tokens max/mean``: the same for token counts (the linear layers' work and activation memory);
- ``est ms``: the sum over micro-batches of the slowest rank's attention time from the kernel model
  (128-token tiles with padding, lower throughput for short query ranges: WLB §5.2-5.3), which is
  what the adaptive method minimises per micro-batch; ``per-doc share``: how often adaptive chose
  per-document.

    python -m hgraph.tools.bench.cp_balance [--cp 4] [--context 131072] [--micro-batches 500] [--json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from hgraph.errors import HGraphError
from hgraph.runtime.data.lengths import read_lengths
from hgraph.runtime.kernels.cp_layout import (PER_DOCUMENT, PER_SEQUENCE, AttentionKernelModel,
                                              choose_sharding, per_document_plan, per_sequence_plan)

ADAPTIVE = "adaptive"


def default_lengths_path() -> Path:
    """The shared Wikipedia lengths when this checkout sits next to them, else the shipped sample."""
    shared = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "wikipedia_lengths.txt"
    if shared.exists():
        return shared
    return Path(__file__).resolve().parents[2] / "runtime" / "data" / "wikipedia_length_sample.txt"


def pack_in_order(lengths: np.ndarray, context: int, limit: int) -> list[list[int]]:
    """Micro-batches of documents in file order, closed when the next would pass ``context``."""
    out: list[list[int]] = []
    cur: list[int] = []
    tokens = 0
    for l in np.minimum(lengths, context).tolist():
        if cur and tokens + l > context:
            out.append(cur)
            if len(out) == limit:
                return out
            cur, tokens = [], 0
        cur.append(int(l))
        tokens += int(l)
    if cur and len(out) < limit:
        out.append(cur)
    return out


def _ratio(values) -> float:
    v = np.asarray(values, dtype=np.float64)
    return float(v.max() / v.mean()) if v.sum() > 0 else 1.0


def balance(microbatches: list[list[int]], cp: int, kernel: AttentionKernelModel) -> dict:
    flops_per_pair = kernel.flops_per_pair_factor * kernel.hidden
    rows = {m: {"flops": [], "tokens": [], "ms": 0.0} for m in (PER_SEQUENCE, PER_DOCUMENT, ADAPTIVE)}
    chose_doc = 0
    for mb in microbatches:
        seq, doc = per_sequence_plan(mb, cp), per_document_plan(mb, cp)
        best, _ = choose_sharding(mb, cp, kernel)
        chose_doc += best.method == PER_DOCUMENT
        for method, plan in ((PER_SEQUENCE, seq), (PER_DOCUMENT, doc), (ADAPTIVE, best)):
            r = rows[method]
            r["flops"].append(_ratio([p * flops_per_pair for p in plan.attention_pairs_per_rank()]))
            r["tokens"].append(_ratio(plan.tokens_per_rank()))
            r["ms"] += kernel.plan_ms(plan)
    return {"micro_batches": len(microbatches), "docs_per_micro_batch": float(np.mean([len(m) for m in microbatches])),
            "adaptive_per_document_share": chose_doc / max(len(microbatches), 1),
            "methods": {m: {"flops_max_over_mean": float(np.mean(r["flops"])),
                            "flops_max_over_mean_worst": float(np.max(r["flops"])),
                            "tokens_max_over_mean": float(np.mean(r["tokens"])),
                            "est_attention_ms": r["ms"]} for m, r in rows.items()}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hgraph.tools.bench.cp_balance", description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default=None, help="file of document lengths (default: Wikipedia lengths)")
    p.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--micro-batches", type=int, default=400)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    try:
        if args.context < 1 or args.micro_batches < 1 or min(args.cp) < 1 or args.hidden < 1:
            raise HGraphError("--context, --micro-batches, --cp and --hidden must be positive")
        path = Path(args.lengths) if args.lengths else default_lengths_path()
        lengths = read_lengths(path)
    except (HGraphError, OSError) as exc:
        print(f"bench_cp_balance: error: {exc}", file=sys.stderr)
        return 2
    mbs = pack_in_order(lengths, args.context, args.micro_batches)
    kernel = AttentionKernelModel(hidden=args.hidden)
    out = {"lengths": path.name, "context": args.context,
           "results": {str(cp): balance(mbs, cp, kernel) for cp in args.cp}}
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{path.name}: {len(mbs)} micro-batches of <= {args.context} tokens in file order "
          f"({out['results'][str(args.cp[0])]['docs_per_micro_batch']:.1f} documents each)")
    print(f"{'CP':>3} {'method':<13} {'flops max/mean':>15} {'worst':>7} {'tokens max/mean':>16} {'est attn ms':>12}")
    for cp, res in out["results"].items():
        for m, r in res["methods"].items():
            print(f"{cp:>3} {m:<13} {r['flops_max_over_mean']:>15.3f} {r['flops_max_over_mean_worst']:>7.2f} "
                  f"{r['tokens_max_over_mean']:>16.4f} {r['est_attention_ms']:>12.1f}")
        print(f"{'':>3} adaptive chose per-document for {100 * res['adaptive_per_document_share']:.0f}% of micro-batches")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
