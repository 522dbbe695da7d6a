"""A loss that has not moved after the warmup while the learning rate is above zero gets one warning
naming the likely causes (``runtime/train/loss_health.py``): the watch as a unit, then once end to end
in one rank (``--lr 1e6`` saturates the softmax of ``llama:tiny``: the loss stays at ln(512) = 6.2383)."""
import functools
import math

import hgraph.runtime.train.trainer as trainer_module
from hgraph.runtime.data.builtin import synthetic_documents
from hgraph.runtime.train.config import TrainConfig
from hgraph.runtime.train.loss_health import FLAT_WINDOW, FlatLossWatch


def _feed(watch, losses, lrs=None, start=0):
    out = [watch.observe(start + i, loss, (lrs or [1e-3] * len(losses))[i]) for i, loss in enumerate(losses)]
    return [w for w in out if w is not None]


def test_a_flat_loss_after_the_warmup_gets_one_warning():
    warmup = 6
    losses = [6.3 - 0.01 * k for k in range(warmup)] + [6.2383 + 1e-5 * (k % 3) for k in range(FLAT_WINDOW + 20)]
    warnings = _feed(FlatLossWatch(1e-3, warmup), losses)
    assert len(warnings) == 1
    w = warnings[0]
    assert f"steps {warmup}-{warmup + FLAT_WINDOW - 1} after the warmup" in w
    for cause in ("learning rate too high", "saturate the softmax", "too low", "--flat-loss-threshold"):
        assert cause in w


def test_no_warning_when_the_loss_moves_the_window_is_short_or_the_lr_is_zero():
    moving = [6.0 * 0.999 ** k for k in range(FLAT_WINDOW + 5)]          # 5% over the window
    assert _feed(FlatLossWatch(1e-3, 0), moving) == []
    flat = [5.0] * (FLAT_WINDOW + 5)
    assert _feed(FlatLossWatch(1e-3, 0), flat[:FLAT_WINDOW]) == []      # steps 1..49 only: not complete
    assert len(_feed(FlatLossWatch(1e-3, 0), flat[:FLAT_WINDOW + 1])) == 1
    lrs = [1e-3] * (FLAT_WINDOW + 5)
    lrs[20] = 0.0
    assert _feed(FlatLossWatch(1e-3, 0), flat, lrs) == []              # a step at lr 0 does not count as stuck


def test_the_threshold_is_the_fine_tune_s_to_set_and_zero_turns_it_off():
    slow = [2.0 * (1 - 2e-5 * k) for k in range(FLAT_WINDOW + 5)]      # moves 1e-3 over the window
    assert len(_feed(FlatLossWatch(2e-3, 0), slow)) == 1
    assert _feed(FlatLossWatch(5e-4, 0), slow) == []
    assert _feed(FlatLossWatch(0.0, 0), [5.0] * (FLAT_WINDOW + 5)) == []


def test_a_diverged_loss_or_a_resume_inside_the_window_ends_the_watch():
    flat = [5.0] * (FLAT_WINDOW + 5)
    flat[10] = math.nan
    assert _feed(FlatLossWatch(1e-3, 0), flat) == []
    assert _feed(FlatLossWatch(1e-3, 0), [5.0] * FLAT_WINDOW, start=20) == []


def test_a_run_with_a_saturated_softmax_warns_once(monkeypatch, capsys):
    """The trainer's rank 0 feeds the watch every step and warns once: one in-process rank (no spawn),
    the window shortened to 3 steps so that the run stays short (``--lr 1e6`` saturates the softmax of
    ``llama:tiny`` from step 1 on: the loss stays at ln(512))."""
    monkeypatch.setattr(trainer_module, "FlatLossWatch", functools.partial(FlatLossWatch, window=3))
    docs = synthetic_documents(40, 512, 16, seed=0)
    config = TrainConfig.from_values(model="tiny", world_size=1, strategy_schedule="1xTP1PP1", steps=4,
                                     tokens_per_iter=16, docs=docs, lr=1e6, long="truncate")
    summary = trainer_module.Trainer(config, 0, 1, None).run()
    losses = [s.loss for s in summary.steps]
    assert all(abs(loss - math.log(512)) < 1e-3 for loss in losses[1:])
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warnings == [warnings[0]] and warnings[0].startswith(
        "hgraph train: warning: the loss has not moved over steps 1-3 after the warmup: 6.2383")
