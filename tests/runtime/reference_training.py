"""Shared pieces of the training tests: a data file of random documents, and the single-process
PyTorch reference every compiled run is compared with: ``torch.optim.Adam`` on the unmodified model,
each document run alone, the loss of a mini-batch the sum of its next-token cross-entropies divided
by its number of targets (``docs/architecture.md``, loss)."""
import json
from typing import Callable, Iterable, Iterator, Optional

import torch
import torch.nn.functional as F


def write_random_documents(path, lengths: Iterable[int], seed: int, vocab: int = 512):
    """A JSONL file at ``path``: one document of random token ids per length (seeded)."""
    g = torch.Generator().manual_seed(seed)
    path.write_text("".join(json.dumps({"input_ids": torch.randint(0, vocab, (n,), generator=g).tolist()}) + "\n"
                            for n in lengths))
    return path


def _logits(model, ids):
    return model(ids)


def reference_steps(model, batches: Iterable, lr: float = 1e-3, *,
                    logits: Callable = _logits,
                    after_backward: Optional[Callable] = None) -> Iterator[tuple]:
    """Train ``model`` on ``batches`` (``MiniBatch``es) one step each; yields ``(batch, loss)`` after
    every step. ``logits(model, ids)`` runs one document (``ids``: ``[1, n]`` on the model's device);
    ``after_backward(model)`` sees the gradients before the optimizer step."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    device = next(model.parameters()).device
    for batch in batches:
        opt.zero_grad()
        total = 0
        for d in batch.docs:
            ids = torch.tensor([d.input_ids], device=device)
            total = total + F.cross_entropy(logits(model, ids)[0, :-1], ids[0, 1:], reduction="sum")
        loss = total / batch.num_targets
        loss.backward()
        if after_backward is not None:
            after_backward(model)
        opt.step()
        yield batch, loss.item()
