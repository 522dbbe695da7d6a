"""Checkpoints in one process: re-sharding between any world sizes (ranks' shards written one by one
with the same functions ``save`` uses), retention, re-saving a step, bad input."""
from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings, strategies as st

from hgraph.errors import HGraphError
from hgraph.runtime.checkpoint import manifest as ckpt_manifest
from hgraph.runtime.checkpoint import full_state
from hgraph.runtime.checkpoint import rng_state
from hgraph.runtime.checkpoint import shards as checkpoint
from hgraph.runtime.engine.optimizer import ShardedAdam


def _params(shapes: list[tuple[int, ...]]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {f"p{i}": torch.randn(shape, generator=gen) for i, shape in enumerate(shapes)}


def _trained(params, dims, rank, world_size, steps=2) -> ShardedAdam:
    """Rank ``rank`` of a ``world_size`` run after ``steps`` Adam steps (no collectives needed); the
    exact update, whose bits do not depend on the sharding (the fused one's do: engine/optimizer)."""
    opt = ShardedAdam(params.items(), dims, rank, world_size, lr=0.05, impl="exact")
    for k in range(steps):
        gen = torch.Generator().manual_seed(50 + k)
        full = {n: torch.randn(p.shape or (1,), generator=gen) for n, p in params.items()}
        opt.step({n: lay.slice_of(full[n]).clone() for n, lay in opt.layouts.items()})
    return opt


def _save_all_ranks(root, step, params, dims, world_size, **state):
    """What ``save`` does on ``world_size`` ranks, rank after rank in this process."""
    folder = ckpt_manifest.step_dir(root, step)
    opts = [_trained(params, dims, r, world_size) for r in range(world_size)]
    entries = [checkpoint.write_shard(folder, r, world_size, step, o, rng_state.capture_rng())
               for r, o in enumerate(opts)]
    ckpt_manifest.write_manifest(folder, step, world_size, entries, **state)
    return opts


shapes_st = st.lists(st.one_of(st.tuples(st.integers(1, 9)), st.tuples(st.integers(1, 7), st.integers(1, 7)),
                               st.just(())), min_size=1, max_size=4)


@settings(max_examples=25, deadline=None)
@given(shapes=shapes_st, saved_n=st.integers(1, 5), new_n=st.integers(1, 6), data=st.data())
def test_reshard_any_world_sizes_bitwise(tmp_path_factory, shapes, saved_n, new_n, data):
    params = _params(shapes)
    dims = {n: data.draw(st.integers(0, max(p.dim(), 1) - 1)) for n, p in params.items()}
    root = tmp_path_factory.mktemp("ck")
    _save_all_ranks(root, 3, params, dims, saved_n)
    reference = _trained(params, dims, 0, 1)              # the unsharded run of the same steps
    loaded = []
    for r in range(new_n):
        ck = checkpoint.load(root, r, new_n)
        assert ck.resharded == (saved_n != new_n) and ck.step == 3
        opt = ShardedAdam(params.items(), dims, r, new_n, lr=0.05, impl="exact")
        opt.load_state_dict(ck.optimizer)                  # shapes checked against shard_bounds
        loaded.append(opt.state_dict())
    for name, p in params.items():
        dim = reference.layouts[name].dim
        for key in ("params", "exp_avg", "exp_avg_sq"):
            full = torch.cat([s[key][name] for s in loaded], dim=dim)
            assert torch.equal(full, reference.state_dict()[key][name]), (key, name)
        assert all(s["steps"][name] == 2.0 for s in loaded)
    full = full_state.full_tensors(root)
    for name, p in params.items():
        assert full["params"][name].shape == p.shape
        assert torch.equal(full["params"][name], reference.params[name].reshape(p.shape))


def test_keep_last_and_resave_same_step(tmp_path):
    params = _params([(6, 3), (5,)])
    opt = _trained(params, {}, 0, 1)
    for step in (1, 2, 3):
        checkpoint.save(tmp_path, step, opt, data_position={"step": step})
    assert ckpt_manifest.complete_steps(tmp_path) == [1, 2, 3]
    checkpoint.save(tmp_path, 4, opt, keep_last=2)
    assert ckpt_manifest.complete_steps(tmp_path) == [3, 4]
    assert not ckpt_manifest.step_dir(tmp_path, 1).exists()
    # re-saving step 4 replaces it as a whole
    opt.params["p0"].add_(1.0)
    checkpoint.save(tmp_path, 4, opt, data_position={"step": 4, "again": True})
    ck = checkpoint.load(tmp_path)
    assert ck.data_position == {"step": 4, "again": True}
    assert torch.equal(ck.optimizer["params"]["p0"], opt.params["p0"])
    assert ckpt_manifest.latest(tmp_path) == ckpt_manifest.step_dir(tmp_path, 4)
    assert not list(tmp_path.rglob(".*.tmp-*"))          # no temp files left by a finished save
    # retention counts only the steps up to the one saved: a later step (another run's) stays,
    # and the one just written is never removed
    checkpoint.save(tmp_path, 2, opt, keep_last=2)
    assert ckpt_manifest.complete_steps(tmp_path) == [2, 3, 4]
    checkpoint.save(tmp_path, 3, opt, keep_last=2)
    assert ckpt_manifest.complete_steps(tmp_path) == [2, 3, 4]


def test_a_checkpoint_is_a_dcp_checkpoint_keyed_by_parameter_name(tmp_path):
    """``dcp.load`` fills plain tensors of the full shapes; the manifest lists every file with its
    SHA-256, each parameter's shard dimension and the hyper-parameters."""
    import torch.distributed.checkpoint as dcp
    opt = _trained(_params([(4, 2), (3,)]), {"p0": 1}, 0, 1)
    folder = checkpoint.save(tmp_path, 0, opt)
    manifest = json.loads((folder / ckpt_manifest.MANIFEST).read_text())
    assert manifest["format"] == ckpt_manifest.DCP_FORMAT and manifest["world_size"] == 1
    assert {e["name"] for e in manifest["shards"]} == {".metadata", "__0_0.distcp"}
    assert all(len(e["sha256"]) == 64 for e in manifest["shards"])
    assert manifest["optimizer"]["shard_dims"] == {"p0": 1, "p1": 0}
    plain = {"model": {"p0": torch.zeros(4, 2), "p1": torch.zeros(3)},
             "optim": {"state": {"p0": {"exp_avg": torch.zeros(4, 2), "step": torch.zeros(())}}}}
    dcp.load(plain, checkpoint_id=str(folder), no_dist=True)
    assert torch.equal(plain["model"]["p0"], opt.params["p0"]) and torch.equal(plain["model"]["p1"], opt.params["p1"])
    assert torch.equal(plain["optim"]["state"]["p0"]["exp_avg"], opt.exp_avg["p0"])
    assert float(plain["optim"]["state"]["p0"]["step"]) == opt.steps["p0"] == 2.0


def test_adam_step_counts_must_agree_to_reshard(tmp_path):
    params = _params([(4, 2)])
    folder = ckpt_manifest.step_dir(tmp_path, 1)
    opts = [_trained(params, {}, r, 2, steps=1 + r) for r in range(2)]   # rank 1 took one more step
    entries = [checkpoint.write_shard(folder, r, 2, 1, o, rng_state.capture_rng()) for r, o in enumerate(opts)]
    ckpt_manifest.write_manifest(folder, 1, 2, entries)
    with pytest.raises(HGraphError, match=r"Adam step counts of 'p0' differ between saved ranks \(\[1.0, 2.0\]\)"):
        checkpoint.load(tmp_path, 0, 3)
    assert checkpoint.load(tmp_path, 1, 2).optimizer["steps"]["p0"] == 2.0     # same size: as saved


def test_bad_input(tmp_path):
    opt = _trained(_params([(3,)]), {}, 0, 1)
    with pytest.raises(HGraphError, match="planner_state must be JSON-serialisable"):
        checkpoint.save(tmp_path, 0, opt, planner_state={"t": torch.zeros(1)})
    with pytest.raises(HGraphError, match="keep_last must be >= 2"):
        checkpoint.save(tmp_path, 0, opt, keep_last=1)
    with pytest.raises(HGraphError, match="no complete checkpoint in"):
        checkpoint.load(tmp_path / "empty")
    checkpoint.save(tmp_path, 5, opt)
    (ckpt_manifest.step_dir(tmp_path, 5) / ckpt_manifest.MANIFEST).write_text("{not json")
    assert ckpt_manifest.latest(tmp_path) is None               # a damaged manifest: not complete
    with pytest.raises(HGraphError, match=r"manifest.json' cannot be read"):
        checkpoint.load(ckpt_manifest.step_dir(tmp_path, 5))
    with pytest.raises(HGraphError, match="rank 2 is outside world size 2"):
        checkpoint.load(tmp_path, 2, 2)


def test_fallback_without_older_checkpoint_says_so(tmp_path):
    opt = _trained(_params([(3,)]), {}, 0, 1)
    folder = checkpoint.save(tmp_path, 1, opt)
    (folder / "__0_0.distcp").unlink()
    with pytest.raises(HGraphError, match=r"__0_0\.distcp' is missing; no older complete checkpoint"):
        checkpoint.load(tmp_path, fallback=True)


def test_export_with_tied_weights_fills_every_alias(tmp_path):
    from hgraph.frontends.zoo import build
    torch.manual_seed(0)
    model = build("tiny-tied")
    names = [n for n, _ in model.named_parameters()]
    all_names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    assert len(all_names) > len(names)                        # the config really ties weights
    opt = ShardedAdam(model.named_parameters(), {}, 0, 1)
    with torch.no_grad():
        for p in opt.params.values():
            p.add_(0.5)
    checkpoint.save(tmp_path, 0, opt)
    state = full_state.export_state_dict(tmp_path, tmp_path / "m.pt", model=model)
    fresh = build("tiny-tied")
    fresh.load_state_dict(torch.load(tmp_path / "m.pt", weights_only=True))
    for name, p in fresh.named_parameters(remove_duplicate=False):
        assert name in state
    for name, p in fresh.named_parameters():
        assert torch.equal(p, opt.params[name].reshape(p.shape))
