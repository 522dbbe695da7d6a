"""Shared pieces of the training tests: a data file of random documents, the single-process PyTorch
reference every compiled run is compared with (``torch.optim.Adam`` or ``AdamW`` on the unmodified
model, each document run alone, the loss of a mini-batch the sum of its next-token cross-entropies
divided by its number of targets: the loss contract of ``docs/architecture.md``), and the one
noise-aware comparison of a trained run with it.

Why noise-aware: two correct fp32 runs sum the same gradient in another order (TP partial products,
reduce-scatter, CP ranks, another SIMD width of ATen or inductor), so a gradient differs by ulps.
Adam's first step moves an element by ``lr * g / (|g| + eps)``, whose slope in ``g`` is
``lr * eps / (|g| + eps)^2``: where ``|g|`` is near Adam's eps (pure cancellation) an ulp of ``g``
becomes a visible fraction of ``lr``; where ``|g|`` is well above eps it stays an ulp. So:

* losses agree to ``LOSS_RTOL`` relative, step by step;
* every parameter element is within ``STEP_FRACTION`` of one Adam step (``lr``);
* at most ``OUTLIER_FRACTION`` of all elements exceed the tight bound ``TIGHT`` (atol + rtol);
* where the reference's first gradients are known, every element whose first gradient is
  ``>= NEGLIGIBLE_GRAD`` is held to the tight bound: the looser rules apply only where Adam can
  amplify rounding.

Tests that claim bitwise equality compare with ``torch.equal``, not with this.
"""
import json
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F

LOSS_RTOL = 1e-6
TIGHT = dict(atol=1e-5, rtol=1e-5)
STEP_FRACTION = 0.2
OUTLIER_FRACTION = 1e-3
ADAM_EPS = 1e-8
NEGLIGIBLE_GRAD = 100 * ADAM_EPS     # above it an ulp of g moves Adam's step by < 1e-4 of lr per ulp-level error


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
                    after_backward: Optional[Callable] = None,
                    after_step: Optional[Callable] = None,
                    optimizer: str = "adam", weight_decay: float = 0.0,
                    grad_clip: Optional[float] = None) -> Iterator[tuple]:
    """Train ``model`` on ``batches`` (``MiniBatch``es) one step each; yields ``(batch, loss)`` after
    every step. ``logits(model, ids)`` runs one document (``ids``: ``[1, n]`` on the model's device);
    ``after_backward(model)`` sees the gradients before clipping and the optimizer step;
    ``after_step(model, optimizer, batch)`` runs after each optimizer step (e.g. to save a checkpoint).
    ``optimizer``: ``"adam"`` or ``"adamw"`` (with ``weight_decay``); ``grad_clip``: the global-norm
    clip applied before the step, as ``torch.nn.utils.clip_grad_norm_``."""
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    else:
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
        if grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        if after_step is not None:
            after_step(model, opt, batch)
        yield batch, loss.item()


@dataclass(frozen=True)
class ReferenceRun:
    """What the single-process run left: per-step losses, the final ``state_dict`` (detached) and
    each parameter's gradient in the first step (before clipping)."""
    losses: list
    state: dict
    first_grads: dict
    lr: float


def reference_run(model, batches: Iterable, lr: float = 1e-3, **options) -> ReferenceRun:
    """``reference_steps`` to the end, keeping what ``assert_trained_like`` compares with."""
    first: dict = {}

    def keep_first(m):
        if not first:
            first.update({n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None})

    losses = [loss for _, loss in reference_steps(model, batches, lr, after_backward=keep_first, **options)]
    return ReferenceRun(losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, first, lr)


def assert_losses_like(got: Sequence[float], want: Sequence[float]) -> None:
    """Step by step, ``|got - want| <= LOSS_RTOL * |want|``."""
    assert len(got) == len(want), (len(got), len(want))
    for k, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= LOSS_RTOL * abs(b), f"step {k}: loss {a} vs {b}"


def assert_params_like(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor], *, lr: float,
                       first_grads: Optional[Mapping[str, torch.Tensor]] = None,
                       names: Optional[Iterable[str]] = None) -> None:
    """The noise-aware comparison of trained parameters (module docstring). ``names``: the entries
    compared (default: all of ``want``). With ``first_grads``, an entry it lacks (a buffer) is held
    to the tight bound everywhere."""
    names = list(want) if names is None else list(names)
    missing = [n for n in names if n not in got]
    assert not missing, f"missing from the trained state: {missing}"
    total, outliers, worst = 0, [], (0.0, None)
    for name in names:
        a, b = got[name].detach().reshape(want[name].shape).double(), want[name].detach().double()
        diff = (a - b).abs()
        largest = float(diff.max()) if diff.numel() else 0.0
        if largest > worst[0]:
            worst = (largest, name)
        assert largest <= STEP_FRACTION * lr, (
            f"{name}: max |diff| {largest:.3g} > {STEP_FRACTION} of one Adam step (lr {lr})")
        loose = diff > TIGHT["atol"] + TIGHT["rtol"] * b.abs()
        if first_grads is not None:
            grad = first_grads.get(name)
            held = torch.ones_like(loose) if grad is None else grad.reshape(b.shape).abs() >= NEGLIGIBLE_GRAD
            bad = loose & held
            assert not bad.any(), (
                f"{name}: {int(bad.sum())} element(s) with a first gradient >= {NEGLIGIBLE_GRAD:g} off by up to "
                f"{float(diff[bad].max()):.3g} (tight bound atol {TIGHT['atol']:g} rtol {TIGHT['rtol']:g}), "
                f"first at {tuple(int(i) for i in bad.nonzero()[0])}")
        total += b.numel()
        if loose.any():
            outliers += [(name, float(diff[loose].max()))] * int(loose.sum())
    assert len(outliers) <= OUTLIER_FRACTION * total, (
        f"{len(outliers)} of {total} elements beyond the tight bound (at most {OUTLIER_FRACTION:.1%}): "
        f"{sorted(set(outliers))[:5]}; worst {worst[1]}: {worst[0]:.3g}")


def assert_trained_like(losses: Sequence[float], state: Mapping[str, torch.Tensor], reference: ReferenceRun,
                        names: Optional[Iterable[str]] = None) -> None:
    """A trained run's losses and final state against ``reference`` (both rules of the module)."""
    assert_losses_like(losses, reference.losses)
    assert_params_like(state, reference.state, lr=reference.lr, first_grads=reference.first_grads, names=names)
