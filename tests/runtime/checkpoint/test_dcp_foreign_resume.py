"""``hgraph train --resume`` from a DCP checkpoint another PyTorch program wrote.

The other program: the zoo's tiny Llama trained in fp32 by ``torch.optim.Adam`` on the run's first
``K`` mini-batches, saved with ``dcp.save({"model": ..., "optim": ...})`` of
``get_state_dict(model, optimizer)`` (PyTorch's own keys). ``hgraph train --resume`` on 2 ranks then
trains steps ``K..STEPS-1`` and must equal the plain model continuing the same steps (the noise-aware
comparison of ``tests/runtime/reference_training.py``). One process launch (the resumed run); the
error cases read files only.
"""
import dataclasses
import json
import math

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from tests.runtime.checkpoint.dcp_reads import counted_readers
from tests.runtime.reference_training import assert_trained_like, reference_run, write_random_documents

from hgraph.errors import HGraphError, RunFailed
from hgraph.frontends.zoo import llama
from hgraph.runtime.checkpoint import manifest as ckpt_manifest
from hgraph.runtime.checkpoint.foreign import ForeignCheckpoint
from hgraph.runtime.data.documents import mini_batches, read_jsonl
from hgraph.runtime.engine.optimizer import ShardedAdam
from hgraph.runtime.train.run import prepare
from hgraph.runtime.train.run_config import config_from_options

LENGTHS = [13, 5, 9, 7, 11, 3, 6, 8, 10, 4, 12, 2]
TOKENS, K, STEPS, LR = 30, 2, 4, 1e-3


def _save(model, optimizer, folder):
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder), no_dist=True)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The plain run: all STEPS steps with torch Adam, its DCP checkpoint saved after step K."""
    root = tmp_path_factory.mktemp("foreign")
    data = write_random_documents(root / "docs.jsonl", LENGTHS, seed=3)

    def save_at_k(model, optimizer, batch):
        if batch.step == K - 1:
            _save(model, optimizer, root / "plain-dcp")

    torch.manual_seed(0)
    reference = reference_run(llama.build("tiny"), mini_batches(read_jsonl(data), TOKENS, STEPS), LR,
                              after_step=save_at_k)
    return {"root": root, "data": data, "ck": root / "plain-dcp", "reference": reference}


def _run(plain, ck, **extra):
    """The run resumed from ``ck`` (the run object of ``hgraph train``), rank 0's trained weights kept."""
    config, _ = config_from_options({"model": "tiny", "data": str(plain["data"]), "tokens_per_iter": TOKENS,
                                     "world_size": 2, "strategy_schedule": "1xTP2PP1;2xTP1PP1", "steps": STEPS,
                                     "lr": LR, "checkpoint_dir": str(ck), "resume": True, **extra})
    with prepare(config.with_values(return_final=True)) as run:
        return run.execute()


def test_resume_from_a_plain_adam_dcp_checkpoint_continues_like_the_plain_model(plain):
    metrics = plain["root"] / "metrics.jsonl"
    summary = _run(plain, plain["ck"], metrics=str(metrics), json=True)
    assert summary.resumed_from["step"] == K           # the Adam step count
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(K, STEPS))
    # the data goes on after the first K mini-batches, as the plain run's did
    batches = list(mini_batches(read_jsonl(plain["data"]), TOKENS, STEPS))
    assert [m["documents"] for m in lines] == [[d.index for d in b.docs] for b in batches[K:]]
    reference = dataclasses.replace(plain["reference"], losses=plain["reference"].losses[K:])
    assert_trained_like([m["loss"] for m in lines], summary.final_state, reference)
    # the run's own checkpoint went under the folder, and a later --resume takes it first
    assert ckpt_manifest.complete_steps(plain["ck"]) == [STEPS]


def test_a_rank_reads_its_rows_of_weights_moments_and_step_counts(plain, monkeypatch):
    """Rank 1 of 2: exactly torch's values, cut to its rows (bitwise), read from the plain folder
    (one chunk per tensor, written by one process): the bytes read are its rows, not the tensors."""
    readers = counted_readers(monkeypatch)
    model = llama.build("tiny")
    opt = ShardedAdam(list(model.named_parameters()), None, 1, 2)
    state = ForeignCheckpoint(plain["ck"]).optimizer_state(opt)
    read = sum(n for reader in readers for key, n in reader.reads if not key.endswith(".step"))
    assert read == sum(math.prod(lay.shard_shape) * 4 * 3 for lay in opt.layouts.values())
    dcp.load({"model": (m := {k: torch.empty_like(v) for k, v in model.state_dict().items()})},
             checkpoint_id=str(plain["ck"]), no_dist=True)
    moments = {f"optim.state.{n}.{key}": torch.empty_like(p) for n, p in model.named_parameters()
               for key in ("exp_avg", "exp_avg_sq")}
    dcp.load(moments, checkpoint_id=str(plain["ck"]), no_dist=True)
    for name, layout in opt.layouts.items():
        assert torch.equal(state["params"][name], layout.slice_of(m[name])), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[key][name], layout.slice_of(moments[f"optim.state.{name}.{key}"])), name
        assert state["steps"][name] == float(K)


def test_missing_entries_are_one_line_naming_them(plain, tmp_path, capsys):
    model = llama.build("tiny")
    # weights alone: refused before any process starts, one line, exit 2
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "weights-only"), no_dist=True)
    capsys.readouterr()                   # DCP's own warning about saving without a process group
    with pytest.raises(HGraphError) as refused:        # bad input: the command's exit 2
        _run(plain, tmp_path / "weights-only")
    err = str(refused.value).splitlines()
    assert not isinstance(refused.value, RunFailed) and not capsys.readouterr().err
    assert len(err) == 1 and "no Adam step counts" in err[0] and "--init-from" in err[0]
    # one moment missing: named
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    opt.step()
    model_sd, optim_sd = get_state_dict(model, opt)
    del optim_sd["state"]["norm.weight"]["exp_avg_sq"]
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp_path / "no-moment"), no_dist=True)
    sharded = ShardedAdam(list(model.named_parameters()), None, 0, 2)
    with pytest.raises(HGraphError, match="no entry 'optim.state.norm.weight.exp_avg_sq'"):
        ForeignCheckpoint(tmp_path / "no-moment").optimizer_state(sharded)


def test_other_prefixes_are_found(plain, tmp_path):
    """Bare parameter names for the weights and ``optimizer.`` for Adam's state read the same values."""
    model = llama.build("tiny")
    values = {n: torch.empty_like(p) for n, p in model.state_dict().items()}
    moments = {f"optim.state.{n}.{key}": torch.empty_like(p) for n, p in model.named_parameters()
               for key in ("exp_avg", "exp_avg_sq")}
    steps = {f"optim.state.{n}.step": torch.zeros(()) for n, _ in model.named_parameters()}
    dcp.load({"model": values, **moments, **steps}, checkpoint_id=str(plain["ck"]), no_dist=True)
    renamed = {**values, **{k.replace("optim.", "optimizer.", 1): v for k, v in {**moments, **steps}.items()}}
    dcp.save(renamed, checkpoint_id=str(tmp_path / "bare"), no_dist=True)
    opt = ShardedAdam(list(model.named_parameters()), None, 0, 2)
    a = ForeignCheckpoint(tmp_path / "bare").optimizer_state(opt)
    b = ForeignCheckpoint(plain["ck"]).optimizer_state(opt)
    for key in ("params", "exp_avg", "exp_avg_sq"):
        assert all(torch.equal(a[key][n], b[key][n]) for n in b[key]), key
    assert a["steps"] == b["steps"]
