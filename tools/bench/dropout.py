"""What strategy-invariant dropout costs: training throughput with ``--dropout apply`` against ``off``.

    python -m hgraph.tools.bench.dropout [--model hf:gpt2] [--steps 6] [--tokens 2048] [--p 0.1]

One rank in this process, the same model (GPT-2 from a small config with every dropout at ``--p``),
data and steps, the two settings interleaved step by step so a busy machine slows both alike; prints
tokens/s of each (median over steps after the first) and the ratio. The masks are hashed per
element (``runtime/kernels/dropout``), attention with dropout runs the probabilities explicitly
(softmax, drop, rescale) instead of one fused SDPA call per document: both show in the figure.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from hgraph.runtime.data.documents import Document, mini_batches
from hgraph.runtime.train.config import TrainConfig
from hgraph.runtime.train.trainer import Trainer


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="hf:gpt2")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per step")
    ap.add_argument("--p", type=float, default=0.1)
    args = ap.parse_args(argv)
    model_args = {"n_embd": 256, "n_layer": 4, "n_head": 8, "vocab_size": 8192, "n_positions": 1024,
                  "resid_pdrop": args.p, "embd_pdrop": args.p, "attn_pdrop": args.p}
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(16, 512, (args.steps * args.tokens // 128,), generator=g).tolist()
    docs = [torch.randint(0, 8192, (n,), generator=g).tolist() for n in lengths]
    batches = list(mini_batches([Document(i, tuple(d)) for i, d in enumerate(docs)], args.tokens, args.steps))
    trainers = {mode: Trainer(TrainConfig.from_values(model=args.model, model_args=model_args, world_size=1,
                                                      strategy_schedule="1xTP1PP1", steps=args.steps,
                                                      tokens_per_iter=args.tokens, docs=docs, dropout=mode), 0, 1)
                for mode in ("apply", "off")}
    rates: dict[str, list[float]] = {mode: [] for mode in trainers}
    for k, batch in enumerate(batches):
        for mode, trainer in trainers.items():
            r = trainer.step(batch)
            if k:
                rates[mode].append(r.tokens / r.time_s)
    med = {mode: statistics.median(v) for mode, v in rates.items()}
    print(f"dropout {trainers['apply'].dropout}: {med['apply']:.0f} tokens/s; off: {med['off']:.0f} tokens/s; "
          f"apply / off = {med['apply'] / med['off']:.3f} ({args.model}, {args.tokens} tokens per step, "
          f"median of {len(rates['off'])} steps)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
