"""Strategy-independent checkpoints on 4 gloo ranks (one spawn for the module).

Rank programs: build the zoo's tiny Llama, a ShardedAdam over 4 ranks (some parameters sharded along
dim 1), take Adam steps with full gradients drawn from a shared seed, save at steps 2 and 4; then a
save of step 6 that stops after the shard files (what a crash before the manifest leaves); then
loads at world sizes 4, 2 and 3 (sub-groups of the 4 processes), the 2- and 3-rank loads gathered
with the collective ``full_state_dict``.
"""
from __future__ import annotations

import random
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
from tests.runtime.checkpoint.dcp_reads import counted_readers

from hgraph.errors import HGraphError
from hgraph.frontends.zoo import build
from hgraph.runtime.checkpoint import coalesce, dcp_format
from hgraph.runtime.checkpoint import manifest as ckpt_manifest
from hgraph.runtime.checkpoint import full_state
from hgraph.runtime.checkpoint import rng_state
from hgraph.runtime.checkpoint import shards as checkpoint
from hgraph.runtime.engine.optimizer import ShardedAdam
from hgraph.runtime.train.launch import spawn
from hgraph.shard_rule import shard_bounds

WORLD = 4
BLOCK_BYTES = 8192      # the tiny model's embedding (128 KiB) is 4 chunks, its q_proj (16 KiB) 2
# Non-default shard dims: a 2-d weight along its columns; sizes that 3 ranks do not divide evenly.
SHARD_DIMS = {"layers.0.self_attn.q_proj.weight": 1, "layers.1.mlp.down_proj.weight": 1}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build("tiny")


def _optimizer(model, rank, world_size, group=None, shard_group=None) -> ShardedAdam:
    return ShardedAdam(model.named_parameters(), SHARD_DIMS, rank, world_size, lr=1e-2, weight_decay=0.01,
                       group=group, shard_group=shard_group)


def _adam_steps(opt: ShardedAdam, first: int, count: int) -> None:
    for k in range(first, first + count):
        gen = torch.Generator().manual_seed(1000 + k)   # the same full gradients on every rank
        grads = {n: lay.slice_of(torch.randn(lay.full_shape or (1,), generator=gen)).clone()
                 for n, lay in opt.layouts.items()}
        opt.step(grads)


def _state(opt: ShardedAdam) -> dict:
    return opt.state_dict()


def _worker(rank: int, world_size: int, root: str) -> dict:
    model = _model()
    opt = _optimizer(model, rank, world_size)
    out: dict = {}
    torch.manual_seed(100 + rank)
    np.random.seed(200 + rank)
    random.seed(300 + rank)
    _adam_steps(opt, 0, 2)
    checkpoint.save(root, 2, opt, rank=rank, world_size=world_size,
                    data_position={"next_doc": 17, "step": 2}, delay_queues={"held": [[3, 1]]},
                    planner_state={"seed": 5})
    _adam_steps(opt, 2, 2)
    out["rng_at_save"] = (torch.rand(3), np.random.rand(3).tolist(), random.random())
    # The RNG states saved now are restored after loading: the next draws must repeat rng_after. Its
    # chunks (one per entry, of all 4 ranks' rows) are gathered up trees of two levels (2 ranks a round).
    coalesce.FAN_IN, fan_in = 2, coalesce.FAN_IN
    checkpoint.save(root, 4, opt, rank=rank, world_size=world_size,
                    data_position={"next_doc": 40, "step": 4}, delay_queues={"held": []},
                    planner_state={"seed": 5, "cache": ["4xTP1PP1"]})
    coalesce.FAN_IN = fan_in
    out["state4"] = _state(opt)
    # The same state in chunks of at least BLOCK_BYTES: entries of several chunks, each gathered from a
    # block of ranks by one of them (the default's 64 MiB makes every entry of the tiny model one chunk)
    checkpoint.save(f"{root}-blocks", 4, opt, rank=rank, world_size=world_size, min_chunk_bytes=BLOCK_BYTES)
    out["rng_after"] = (torch.rand(3), np.random.rand(3).tolist(), random.random())
    # The same state saved asynchronously: training goes on while it is written (the steps below
    # change the optimizer), and it completes later with the same tensors.
    pending = checkpoint.save_async(f"{root}-async", 4, opt, rank=rank, world_size=world_size,
                                    async_group=dist.new_group(backend="gloo"), data_position={"next_doc": 40})

    # A crash mid-save of step 6: the shard files (and a stray temp file) are there, no manifest.
    _adam_steps(opt, 4, 2)
    folder = ckpt_manifest.step_dir(root, 6)
    checkpoint.write_shard(folder, rank, world_size, 6, opt, rng_state.capture_rng())
    (folder / f".manifest.json.tmp-{rank}").write_text("{\"format\": 1, \"st")
    dist.barrier()
    out["latest_after_crash"] = str(ckpt_manifest.latest(root))

    pending.wait()
    out["async4"] = checkpoint.load(f"{root}-async", rank, world_size).optimizer
    ck = checkpoint.load(root, rank, world_size)
    fresh = _optimizer(_model(), rank, world_size)
    fresh.load_state_dict(ck.optimizer)
    out["loaded4"] = _state(fresh)
    out["loaded4_meta"] = (ck.step, ck.resharded, ck.data_position, ck.delay_queues, ck.planner_state)
    rng_state.restore_rng(ck.rng)
    out["rng_restored"] = (torch.rand(3), np.random.rand(3).tolist(), random.random())
    # Training on from the loaded state matches training on from the original one.
    _adam_steps(fresh, 4, 2)
    out["continued"] = _state(fresh)
    out["original_continued"] = _state(opt)

    for n in (2, 3):
        group = dist.new_group(list(range(n)))         # every rank takes part in new_group
        if rank < n:
            ck_n = checkpoint.load(root, rank, n, step=4)
            opt_n = _optimizer(_model(), rank, n, group=group)
            opt_n.load_state_dict(ck_n.optimizer)
            out[f"loaded{n}"] = _state(opt_n)
            out[f"full{n}"] = opt_n.full_state_dict()
            out[f"resharded{n}"] = ck_n.resharded
        dist.barrier()

    # Hierarchical sharding: the states over pairs of ranks, replicated across the two pairs. The
    # checkpoint of the world layout (step 4) loads into pairs, and one written by pairs loads into
    # the world layout: the same DCP entries whatever the shard group.
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]       # every rank takes part in new_group
    ck_g = checkpoint.load(root, rank, world_size, step=4, shard_group=2)
    opt_g = _optimizer(_model(), rank, world_size, group=pairs[rank // 2], shard_group=2)
    opt_g.load_state_dict(ck_g.optimizer)
    out["loaded_g2"], out["resharded_g2"] = _state(opt_g), ck_g.resharded
    _adam_steps(opt_g, 4, 2)
    out["continued_g2"] = _state(opt_g)
    checkpoint.save(f"{root}-g2", 6, opt_g, rank=rank, world_size=world_size, data_position={"next_doc": 50})
    ck_w = checkpoint.load(f"{root}-g2", rank, world_size)
    opt_w = _optimizer(_model(), rank, world_size)
    opt_w.load_state_dict(ck_w.optimizer)
    out["loaded_from_g2"], out["resharded_from_g2"] = _state(opt_w), ck_w.resharded
    out["full_g2"] = opt_g.full_state_dict()
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    results = spawn(_worker, WORLD, args=(str(root),), timeout_s=120)
    return root, results


def _full(states: list[dict], key: str, name: str) -> torch.Tensor:
    dim = states[0]["shard_dims"][name]
    return torch.cat([s[key][name] for s in states], dim=dim)


def _assert_same_state(a: dict, b: dict) -> None:
    assert a["steps"] == b["steps"] and a["hyper"] == b["hyper"] and a["shard_dims"] == b["shard_dims"]
    for key in ("params", "exp_avg", "exp_avg_sq"):
        assert a[key].keys() == b[key].keys()
        for name in a[key]:
            assert torch.equal(a[key][name], b[key][name]), (key, name)


def test_load_same_world_size_is_bitwise_equal(run):
    _, results = run
    for r in results:
        _assert_same_state(r["loaded4"], r["state4"])
        step, resharded, pos, queues, planner = r["loaded4_meta"]
        assert (step, resharded) == (4, False)
        assert pos == {"next_doc": 40, "step": 4} and queues == {"held": []}
        assert planner == {"seed": 5, "cache": ["4xTP1PP1"]}


def test_training_continues_identically_after_load(run):
    _, results = run
    for r in results:
        _assert_same_state(r["continued"], r["original_continued"])


def test_rng_states_restored(run):
    _, results = run
    for r in results:
        a, b = r["rng_after"], r["rng_restored"]
        assert torch.equal(a[0], b[0]) and a[1] == b[1] and a[2] == b[2]
        assert not torch.equal(r["rng_at_save"][0], a[0])   # the draws do move the generator


def test_crash_mid_save_keeps_previous_checkpoint(run):
    root, results = run
    assert all(r["latest_after_crash"] == str(ckpt_manifest.step_dir(root, 4)) for r in results)
    assert ckpt_manifest.complete_steps(root) == [2, 4]
    with pytest.raises(HGraphError, match="incomplete"):
        checkpoint.load(root, 0, 4, step=6)


@pytest.mark.parametrize("n", [2, 3])
def test_resharded_load_gives_bitwise_equal_full_tensors(run, n):
    _, results = run
    saved = [r["state4"] for r in results]
    loaded = [results[r][f"loaded{n}"] for r in range(n)]
    assert all(results[r][f"resharded{n}"] for r in range(n))
    for name, dim in saved[0]["shard_dims"].items():
        for key in ("params", "exp_avg", "exp_avg_sq"):
            assert torch.equal(_full(loaded, key, name), _full(saved, key, name)), (n, key, name)
        size = _full(saved, "params", name).shape[dim]
        for r in range(n):           # each new rank holds exactly its shard_bounds range
            lo, hi = shard_bounds(size, r, n)
            assert loaded[r]["params"][name].shape[dim] == hi - lo
            assert loaded[r]["steps"][name] == saved[0]["steps"][name] == 4.0
    gathered = results[0][f"full{n}"]
    for name in saved[0]["shard_dims"]:
        assert torch.equal(gathered[name], _full(saved, "params", name))


def test_a_checkpoint_written_at_one_shard_group_resumes_at_another(run):
    """World layout -> pairs (G = 2) and pairs -> world layout: every pair holds the whole state
    bitwise, training on in pairs equals training on in the world layout, and the pairs' checkpoint
    reads back into the world layout bitwise."""
    _, results = run
    saved = [r["state4"] for r in results]
    for pair in ((0, 1), (2, 3)):
        loaded = [results[r]["loaded_g2"] for r in pair]
        continued = [results[r]["continued_g2"] for r in pair]
        for name in saved[0]["shard_dims"]:
            for key in ("params", "exp_avg", "exp_avg_sq"):
                assert torch.equal(_full(loaded, key, name), _full(saved, key, name)), (pair, key, name)
                assert torch.equal(_full(continued, key, name),
                                   _full([r["original_continued"] for r in results], key, name)), (pair, key, name)
    assert all(r["resharded_g2"] and r["resharded_from_g2"] for r in results)
    back = [r["loaded_from_g2"] for r in results]
    for name in saved[0]["shard_dims"]:
        for key in ("params", "exp_avg", "exp_avg_sq"):
            assert torch.equal(_full(back, key, name), _full([results[0]["continued_g2"], results[1]["continued_g2"]],
                                                             key, name)), (key, name)
        assert torch.equal(results[2]["full_g2"][name], _full(back, "params", name))
        assert back[0]["steps"][name] == 6.0


def test_an_asynchronous_save_holds_the_state_of_its_step(run):
    """Saved with save_async while the optimizer stepped on: loaded, bitwise the state it was given."""
    _, results = run
    for r in results:
        _assert_same_state(r["async4"], r["state4"])


def test_a_plain_model_and_adam_load_the_checkpoint_of_4_ranks_with_dcp(run):
    """``dcp.load`` in one process, into a plain model's ``state_dict`` and ``get_optimizer_state_dict``'s
    form of ``torch.optim.Adam``: the gathered masters, moments and step counts of the 4 ranks."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    root, results = run
    saved = [r["state4"] for r in results]
    model = _model()
    adam = torch.optim.Adam(model.parameters(), lr=0.5)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    adam.step()                                        # Adam's state exists, to be overwritten
    state = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, adam)}
    dcp.load(state, checkpoint_id=str(ckpt_manifest.step_dir(root, 4)), no_dist=True)
    model.load_state_dict(state["model"])
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), _full(saved, "params", name).reshape(p.shape)), name
        entry = state["optim"]["state"][name]
        assert torch.equal(entry["exp_avg_sq"], _full(saved, "exp_avg_sq", name).reshape(p.shape)), name
        assert float(entry["step"]) == saved[0]["steps"][name] == 4.0
    assert state["optim"]["param_groups"][0]["lr"] == 1e-2 and state["optim"]["param_groups"][0]["weight_decay"] == 0.01


def test_full_tensors_and_export_load_into_zoo_model(run, tmp_path):
    root, results = run
    saved = [r["state4"] for r in results]
    full = full_state.full_tensors(root)
    assert full["step"] == 4
    out = tmp_path / "model.pt"
    full_state.export_state_dict(root, out)
    state = torch.load(out, weights_only=True)
    model = _model()
    model.load_state_dict(state)            # strict: every key of the module, nothing more
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), _full(saved, "params", name))
        assert torch.equal(full["exp_avg"][name], _full(saved, "exp_avg", name))
    # Older step on request; with the model given, its keys (buffers included) are kept.
    state2 = full_state.export_state_dict(root, tmp_path / "m2.pt", step=2, model=_model())
    assert state2.keys() == _model().state_dict().keys()
    assert not torch.equal(state2["layers.0.self_attn.q_proj.weight"], state["layers.0.self_attn.q_proj.weight"])


def test_truncated_shard_names_file_and_fallback_works(run, tmp_path):
    import shutil
    root, results = run
    copy = tmp_path / "ckpt"
    shutil.copytree(root, copy)
    victim = ckpt_manifest.step_dir(copy, 4) / dcp_format.rank_file_name(1)
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    with pytest.raises(HGraphError, match=r"__1_0\.distcp.*truncated"):
        checkpoint.load(copy, 1, 4)
    with pytest.raises(HGraphError, match=r"__1_0\.distcp"):
        checkpoint.load(copy, 0, 2)          # re-sharding reads rank 1's file too
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ck = checkpoint.load(copy, 1, 4, fallback=True)
    assert ck.step == 2 and ck.data_position == {"next_doc": 17, "step": 2}
    assert any("falling back to the checkpoint of step 2" in str(w.message) for w in caught)


def test_same_size_corruption_is_caught_by_checksum(run, tmp_path):
    import shutil
    root, _ = run
    copy = tmp_path / "ckpt"
    shutil.copytree(root, copy)
    victim = ckpt_manifest.step_dir(copy, 4) / dcp_format.rank_file_name(2)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(HGraphError, match=r"__2_0\.distcp.*SHA-256"):
        checkpoint.load(copy, 2, 4)
    with pytest.raises(HGraphError, match=r"__2_0\.distcp.*SHA-256"):
        checkpoint.load(copy, 3, 4)      # a rank reads whole tensors from DCP: every file is checked


def test_a_rank_reads_only_its_rows_of_the_dcp_checkpoint(run, monkeypatch):
    """Rank r of 3 reading the 4 ranks' checkpoint from files: its rows of every master and moment,
    bitwise, and the bytes read of those entries are exactly those rows (columns for the parameters
    sharded along dim 1); only the step counts (one number each) are read whole."""
    root, results = run
    saved = [r["state4"] for r in results]
    readers = counted_readers(monkeypatch)
    folder = ckpt_manifest.step_dir(root, 4)
    layout = ckpt_manifest.read_manifest(folder)["optimizer"]
    for r in range(3):
        readers.clear()
        state, shapes = dcp_format.load_optimizer_state(folder, r, 3, layout["shard_dims"], layout["hyper"])
        rows_bytes = 0
        for name, dim in layout["shard_dims"].items():
            lo, hi = shard_bounds(shapes[name][dim], r, 3)
            for key in ("params", "exp_avg", "exp_avg_sq"):
                assert torch.equal(state[key][name], _full(saved, key, name).narrow(dim, lo, hi - lo)), (key, name)
                rows_bytes += state[key][name].numel() * 4
        reads = [read for reader in readers for read in reader.reads]
        assert sum(n for key, n in reads if not key.endswith(".step")) == rows_bytes
        assert sorted(key for key, _ in reads if key.endswith(".step")) == sorted(
            f"optim.state.{name}.step" for name in layout["shard_dims"])
    whole = sum(_full(saved, "params", name).numel() * 4 * 3 for name in layout["shard_dims"])
    assert rows_bytes < whole / 2.5          # a third of the model's states, not all of it


def _entries(saved: list[dict]) -> list[tuple[str, coalesce.Entry]]:
    """Every entry of the ranks' state (its DCP key) as the save numbers them."""
    out = []
    for i, (name, dim) in enumerate(saved[0]["shard_dims"].items()):
        shape = tuple(_full(saved, "params", name).shape)
        for k, key in enumerate((f"model.{name}", f"optim.state.{name}.exp_avg", f"optim.state.{name}.exp_avg_sq")):
            out.append((key, coalesce.Entry(3 * i + k, shape, dim)))
    return out


@pytest.mark.parametrize("suffix,min_bytes", [("", coalesce.MIN_CHUNK_BYTES), ("-blocks", BLOCK_BYTES)])
def test_each_entry_is_written_as_the_coalesced_chunks_of_blocks_of_ranks(run, suffix, min_bytes):
    """The ``.metadata`` of the 4 ranks' checkpoint lists, per master and moment, the chunks
    ``coalesce.chunks`` says (not one per rank), each in the file of the rank that writes it."""
    root, results = run
    saved = [r["state4"] for r in results]
    folder = ckpt_manifest.step_dir(f"{root}{suffix}", 4)
    md = dcp_format.read_metadata(folder)
    files = {index: info.relative_path for index, info in md.storage_data.items()}
    counts = set()
    for key, entry in _entries(saved):
        want = coalesce.chunks(entry, WORLD, min_bytes)
        got = sorted(md.state_dict_metadata[key].chunks, key=lambda c: c.offsets[entry.dim])
        assert [(c.offsets[entry.dim], c.sizes[entry.dim]) for c in got] == [(w.lo, w.hi - w.lo) for w in want], key
        for c, w in zip(got, want):
            index = next(i for i in files if i.fqn == key and list(i.offset) == list(c.offsets))
            assert files[index] == dcp_format.rank_file_name(w.writer), key
        counts.add(len(want))
    assert counts == ({1} if not suffix else {1, 2, 4})
    writers = {w.writer for _, e in _entries(saved) for w in coalesce.chunks(e, WORLD, min_bytes)}
    assert writers == set(range(WORLD))          # the entries spread over every rank of the block


@pytest.mark.parametrize("n", [4, 3, 1])
def test_a_checkpoint_of_coalesced_chunks_resumes_bitwise_at_any_world_size(run, n):
    """Read back at 4, 3 and 1 ranks (``load``, from the files), every rank's rows of every master and
    moment are bitwise the 4 ranks' states, and the step counts are theirs."""
    root, results = run
    saved = [r["state4"] for r in results]
    loaded = [checkpoint.load(f"{root}-blocks", r, n).optimizer for r in range(n)]
    for name in saved[0]["shard_dims"]:
        for key in ("params", "exp_avg", "exp_avg_sq"):
            assert torch.equal(_full(loaded, key, name), _full(saved, key, name)), (n, key, name)
        assert all(s["steps"][name] == 4.0 for s in loaded)


@pytest.mark.parametrize("suffix,step", [("-blocks", 4), ("-g2", 6)])
def test_a_plain_model_loads_the_coalesced_checkpoint_with_dcp(run, suffix, step):
    """``dcp.load({"model": model.state_dict()})`` in one process: the masters of the 4 ranks (chunks
    of blocks of ranks), and of the two pairs of the shard group of 2 (written by the first pair)."""
    import torch.distributed.checkpoint as dcp
    root, results = run
    saved = ([r["state4"] for r in results] if suffix == "-blocks"
             else [results[0]["continued_g2"], results[1]["continued_g2"]])
    model = _model()
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(ckpt_manifest.step_dir(f"{root}{suffix}", step)), no_dist=True)
    model.load_state_dict(state["model"])
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), _full(saved, "params", name).reshape(p.shape)), name
