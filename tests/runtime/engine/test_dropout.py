"""Dropout whose masks do not depend on the strategy (issue: dropout that trains the same anywhere).

A GPT-2 with every dropout at 0.1 (embedding, attention probabilities through SDPA's dropout_p,
residual, MLP) trains 3 steps on one rank and on 4 ranks under a schedule switching TP, PP and CP
pipelines: the losses and final parameters agree under the noise-aware comparison of the equivalence
tests (``tests/runtime/reference_training.py``); the same run with ``--dropout off`` differs (dropout was applied);
and the kernel drops a fraction p of the elements, each a function of what it is.
"""
import pytest
import torch
from tests.runtime.reference_training import assert_losses_like, assert_params_like

from hgraph.runtime.comm.process_groups import GroupCache
from hgraph.runtime.data.documents import Document, mini_batches
from hgraph.runtime.kernels.dropout import TokenKeys, attention_keep, dropout
from hgraph.runtime.train.config import TrainConfig
from hgraph.runtime.train.launch import spawn
from hgraph.runtime.train.trainer import Trainer

pytest.importorskip("transformers")

LENGTHS = [13, 5, 9, 7, 11, 3, 6, 8, 10, 4, 12, 2]
TOKENS_PER_ITER, STEPS = 30, 3
GPT2 = {"resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1}
SCHEDULE = "1xTP2PP1+2xTP1PP1;1xTP1PP2+1xTP2PP1;1xTP1PP1CP2+2xTP1PP1"


def _docs():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in LENGTHS]


def _run(rank, world, schedule, dropout="apply", **options):
    config = TrainConfig.from_values(model="hf:gpt2", model_args=GPT2, world_size=world, strategy_schedule=schedule,
                                     steps=STEPS, tokens_per_iter=TOKENS_PER_ITER, docs=_docs(), dropout=dropout,
                                     save_final="unused", **options)
    trainer = Trainer(config, rank, world, GroupCache(rank, world))
    batches = list(mini_batches([Document(i, tuple(d)) for i, d in enumerate(_docs())], TOKENS_PER_ITER, STEPS))
    steps = [trainer.step(b) for b in batches]
    final = trainer.final_state_dict()           # collective: every rank gathers
    return {"losses": [s.loss for s in steps], "final": final if rank == 0 else None, "dropout": trainer.dropout,
            "lr": config.optimizer.lr,
            "recomputed": [s.recompute_layers for s in steps]}


def _worker(rank, world):
    # second run: pipelines of 2 stages (1F1B runs a later micro-batch's forward before an earlier
    # one's backward) with every block recomputed in backward
    return _run(rank, world, SCHEDULE), _run(rank, world, "2xTP1PP2", memory_budget=1)


@pytest.fixture(scope="module")
def four_ranks():
    return spawn(_worker, 4, timeout_s=300)


@pytest.fixture(scope="module")
def one_rank():
    return _run(0, 1, "1xTP1PP1")


def test_switching_strategies_train_as_one_rank_with_dropout(four_ranks, one_rank):
    assert one_rank["dropout"] == "applied (7 sites, p 0.1)"
    for got in four_ranks[0]:
        assert_losses_like(got["losses"], one_rank["losses"])
        assert_params_like(got["final"], one_rank["final"], lr=one_rank["lr"])
    assert all(layers for step in four_ranks[0][1]["recomputed"] for layers in step)


def test_recomputed_blocks_draw_the_same_masks(one_rank):
    """A memory budget of one byte makes every block recompute in backward: the same training."""
    again = _run(0, 1, "1xTP1PP1", memory_budget=1)
    assert all(layers for step in again["recomputed"] for layers in step)
    assert again["losses"] == one_rank["losses"]
    for name, want in one_rank["final"].items():
        assert torch.equal(again["final"][name], want), name


def test_dropout_off_trains_differently(one_rank):
    off = _run(0, 1, "1xTP1PP1", dropout="off")
    assert off["dropout"].startswith("off (7 sites")
    assert all(abs(a - b) > 1e-4 for a, b in zip(off["losses"], one_rank["losses"]))


def test_the_kernel_drops_p_of_the_elements_as_a_function_of_what_they_are():
    keys = TokenKeys(seed=1, step=2, documents=torch.arange(512) // 64, positions=torch.arange(512) % 64)
    x = torch.ones(1, 512, 96)
    y = dropout(x, 0.1, site=5, keys=keys)
    dropped = float((y == 0).float().mean())
    assert abs(dropped - 0.1) < 4 * (0.1 * 0.9 / y.numel()) ** 0.5      # within 4 sigma
    assert torch.allclose(y[y != 0], torch.full_like(y[y != 0], 1 / 0.9))
    # the same tokens in another order (another packing) get the same masks; another step does not
    perm = torch.randperm(512, generator=torch.Generator().manual_seed(0))
    shuffled = TokenKeys(1, 2, keys.documents[perm], keys.positions[perm])
    assert torch.equal(dropout(x, 0.1, 5, shuffled), y[:, perm])
    assert not torch.equal(dropout(x, 0.1, 5, TokenKeys(1, 3, keys.documents, keys.positions)), y)
    assert not torch.equal(dropout(x, 0.1, 6, keys), y)
    # attention: [heads, q, k] masks of a TP rank's heads are the whole model's heads' slice
    rows = torch.arange(64)
    whole = attention_keep(0.1, 7, keys, rows, keys.documents[:64], keys.positions[:64], heads=4, head_offset=0)
    half = attention_keep(0.1, 7, keys, rows, keys.documents[:64], keys.positions[:64], heads=2, head_offset=2)
    assert torch.equal(whole[2:], half)
    assert abs(1 - float(whole.float().mean()) - 0.1) < 0.01


def test_bf16_draws_the_fp32_masks_and_trains_with_them():
    keys = TokenKeys(seed=1, step=0, documents=torch.arange(256) // 32, positions=torch.arange(256) % 32)
    x = torch.randn(1, 256, 64)
    y32, y16 = dropout(x, 0.1, 3, keys), dropout(x.bfloat16(), 0.1, 3, keys)
    assert y16.dtype == torch.bfloat16
    assert torch.equal(y16 == 0, y32 == 0)                      # the same elements dropped
    assert torch.equal(y16, (x.bfloat16() * (y32 != 0).bfloat16()) * (1 / 0.9))
    on, off = _run(0, 1, "1xTP1PP1", dtype="bf16"), _run(0, 1, "1xTP1PP1", dtype="bf16", dropout="off")
    assert on["dropout"].startswith("applied (7 sites")
    assert all(torch.isfinite(torch.tensor(v)) for v in on["losses"])
    assert all(abs(a - b) > 1e-3 for a, b in zip(on["losses"], off["losses"]))


def test_a_tp_ranks_token_slice_draws_the_masks_of_its_tokens():
    """Sequence parallelism: a dropout on TP rank r's slice of the tokens (``TokenKeys.narrow``) drops
    what the whole micro-batch's dropout drops there (the runs above use it: SP is on under TP2)."""
    keys = TokenKeys(seed=1, step=0, documents=torch.arange(13) // 5, positions=torch.arange(13) % 5)
    x = torch.randn(1, 13, 8)
    whole = dropout(x, 0.3, 4, keys)
    for lo, hi in ((0, 6), (6, 13)):                     # TP2 over 13 tokens: uneven slices
        assert torch.equal(dropout(x[:, lo:hi], 0.3, 4, keys.narrow(lo, hi)), whole[:, lo:hi])
