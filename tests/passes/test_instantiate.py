"""Instantiation of the zoo model for heterogeneous strategies: IR checks and single-rank numerics."""
import numpy as np
import pytest
import torch

import hgraph
from hgraph import Cluster, HGraphError, Strategy, StrategyError, ops
from hgraph.frontends.zoo import llama
from hgraph.meta import SlotKind, get_meta
from hgraph.passes.lnk.plans import simulate_pull, simulate_push

STRATEGIES_8 = ["1xTP4PP1+2xTP2PP1", "1xTP2PP2+1xTP1PP2+2xTP1PP1", "1xTP2PP1+1xTP1PP4+2xTP1PP1"]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return llama.build("tiny")


@pytest.fixture(scope="module")
def compiled(model):
    return hgraph.compile(model)


@pytest.fixture(scope="module")
def tied():
    torch.manual_seed(1)
    return hgraph.compile(llama.build("tiny-tied"))


def _load(rank_program, model):
    """Fill a rank's (meta) working parameters with its shards of the model's parameters."""
    rank_program.load_full(dict(model.named_parameters()))
    return rank_program.graph_module


def test_single_rank_program_matches_the_module(model, compiled):
    prog = compiled.instantiate("1xTP1PP1")
    gm = _load(prog.rank(0), model)
    ids = torch.randint(0, model.config.vocab_size, (2, 11))
    with torch.no_grad():
        pos = torch.arange(11).expand(2, 11)
        assert torch.equal(gm(ids, pos), model(ids, pos))
        assert torch.equal(compiled(ids, pos), model(ids, pos))
        # two packed documents per row: the program attends inside each document only
        pos = torch.cat([torch.arange(5), torch.arange(6)]).expand(2, 11)
        alone = torch.cat([model(ids[:, :5], pos[:, :5]), model(ids[:, 5:], pos[:, 5:])], dim=1)
        torch.testing.assert_close(gm(ids, pos), alone, rtol=0, atol=1e-6)


def test_program_cache_hit_returns_the_same_program(compiled):
    s = Strategy.parse("2xTP1PP1")
    a = compiled.instantiate(s)
    hits = compiled.cache_hits
    assert compiled.instantiate("2xTP1PP1") is a
    assert compiled.cache_hits == hits + 1


@pytest.mark.parametrize("text", STRATEGIES_8)
def test_shards_cover_every_parameter_once_per_pipeline(compiled, text):
    prog = compiled.instantiate(text)
    hg = compiled.hgraph
    strategy = prog.strategy
    for i, scheme in enumerate(strategy.pipelines):
        ranks = [prog.rank(r) for r in strategy.pipeline_ranks(i)]
        for name, info in hg.params.items():
            holders = [rp for rp in ranks if name in rp.params]
            assert holders, f"{name} not held by pipeline {i}"
            size = tuple(info.shape)[info.shard_dim]
            covered = np.zeros(size, dtype=int)
            by_stage: dict[int, list] = {}
            for rp in holders:
                by_stage.setdefault(rp.stage, []).append(rp)
            for stage_ranks in by_stage.values():
                cover = np.zeros(size, dtype=int)
                for rp in stage_ranks:
                    s = rp.params[name]
                    assert s.shard_shape[s.shard_dim] == sum(h - l for l, h in s.ranges) + s.pad
                    if s.tp_sharded:
                        for lo, hi in s.ranges:
                            cover[lo:hi] += 1
                    else:
                        cover[:] = 1
                assert cover.min() >= 1, f"{name} not fully covered in pipeline {i}"
                if info.tp_role.value in ("column", "row", "vocab") and hg.model_config.num_kv_heads >= scheme.tp:
                    assert cover.max() == 1, f"{name} held twice in one stage of pipeline {i}"
                covered = np.maximum(covered, cover)
            assert covered.min() >= 1


@pytest.mark.parametrize("text", STRATEGIES_8)
def test_slots_issue_wait_pairs_and_pp_boundaries(compiled, text):
    prog = compiled.instantiate(text)
    for rp in prog.ranks:
        g = rp.graph_module.graph
        nodes = list(g.nodes)
        pushes = [n for n in nodes if n.target is ops.push_gradient]
        assert sorted(n.args[2] for n in pushes) == sorted(rp.params), "one push per held parameter"
        issues = [n for n in nodes if n.target is ops.pull_issue]
        waits = [n for n in nodes if n.target is ops.pull_wait]
        assert sorted(n.args[1] for n in issues) == sorted(n.args[2] for n in waits)
        for w in waits:   # every wait comes after its issue
            issue = next(i for i in issues if get_meta(i).subgraph == get_meta(w).subgraph)
            assert nodes.index(issue) < nodes.index(w)
        for n in nodes:
            if n.target in (ops.tp_reduce_issue, ops.tp_gather_issue, ops.sp_scatter_issue, ops.sp_gather_issue):
                assert [u.target for u in n.users] == [ops.comm_wait]
            assert not (get_meta(n).slot is not None and n.target is hgraph.slots.empty_slot), "unfilled slot"
        # sequence parallelism (on by default under TP > 1): reduce-scatters instead of all-reduces
        tp_exits = [n for n in nodes if n.target in (ops.tp_reduce_issue, ops.sp_scatter_issue)]
        if rp.scheme.tp == 1:
            assert not tp_exits and not any(n.target in (ops.tp_copy, ops.sp_gather_issue) for n in nodes)
        else:
            # one exit per row-parallel linear (o, down) per layer + the vocab embedding
            layers = sum(1 for b in rp.role.blocks)
            assert len(tp_exits) == 2 * layers + (1 if rp.stage == 0 else 0)
        sends = [n for n in nodes if n.target is ops.pp_send]
        recvs = [n for n in nodes if n.target is ops.pp_recv]
        assert bool(recvs) == (rp.stage > 0) and bool(sends) == (rp.stage < rp.scheme.pp - 1)
        if sends:
            nxt = prog.rank(rp.bindings["pp_next"][0])
            assert nxt.role.recv_specs == rp.role.send_specs
            assert nxt.stage == rp.stage + 1 and nxt.tp_rank == rp.tp_rank


def test_every_rank_holds_only_its_stage(compiled):
    prog = compiled.instantiate("1xTP1PP4+4xTP1PP1")
    blocks = [set(prog.rank(r).role.blocks) for r in range(4)]
    assert all(blocks) and set().union(*blocks) == {f"layers.{i}" for i in range(4)}
    assert sum(len(b) for b in blocks) == 4
    first, last = prog.rank(0), prog.rank(3)
    assert "embed_tokens.weight" in first.params and "embed_tokens.weight" not in last.params
    assert "lm_head.weight" in last.params and "lm_head.weight" not in first.params
    for rp in prog.ranks[:4]:
        layer_params = {n.split(".")[1] for n in rp.params if n.startswith("layers.")}
        assert layer_params == {b.split(".")[1] for b in rp.role.blocks}


def test_param_shards_are_the_programs_without_building_it(compiled, tied):
    for comp, text in ((compiled, STRATEGIES_8[1]), (tied, "1xTP2PP2+2xTP2PP1")):
        built = {id(r) for r in comp._param_layouts()._roles.values() if r.built}   # by earlier tests
        prog = comp.build_program(text, Cluster(8))
        for rp in prog.ranks:
            assert comp.param_shards(rp.scheme)[(rp.stage, rp.tp_rank)] == rp.params
        assert not any(rp.role.built for rp in prog.ranks if id(rp.role) not in built)
    with pytest.raises(StrategyError, match="TP=3"):
        compiled.param_shards("TP3PP1")


def test_tied_embedding_one_push_two_pulls_and_split_across_stages(tied):
    hg = tied.hgraph
    name = "embed_tokens.weight"
    pulls = [n for n in hg.gm.graph.nodes if get_meta(n).slot == SlotKind.PULL_PARAMETER and get_meta(n).param == name]
    pushes = [n for n in hg.gm.graph.nodes if get_meta(n).slot == SlotKind.PUSH_GRADIENT and get_meta(n).param == name]
    assert len(pulls) == 2 and len(pushes) == 1
    prog = tied.instantiate("1xTP2PP2")
    assert name in prog.rank(0).params and name in prog.rank(2).params
    # both stages contribute gradients of the tied weight: the push plan sums them at the owners
    rng = np.random.default_rng(0)
    plan = prog.push_plans[name]
    S, H = hg.params[name].shape
    assert set(plan.contributions) == {0, 1, 2, 3}
    full = {r: rng.standard_normal((S, H)) for r in plan.contributions}   # each rank's full-size partial grad
    grads = {r: [full[r][lo:hi] for lo, hi in rngs] for r, rngs in plan.contributions.items()}
    owners = simulate_push(plan, grads)
    expected = np.zeros((S, H))
    for r, rngs in plan.contributions.items():
        for lo, hi in rngs:
            expected[lo:hi] += full[r][lo:hi]
    for owner, got in owners.items():
        lo, hi = owner * S // 4, (owner + 1) * S // 4
        np.testing.assert_allclose(got, expected[lo:hi])
    # the vocabulary rows are split over TP: every row comes from exactly one rank of each stage
    per_stage = np.zeros((2, S), dtype=int)
    for r, rngs in plan.contributions.items():
        for lo, hi in rngs:
            per_stage[prog.rank(r).stage, lo:hi] += 1
    assert (per_stage == 1).all()


@pytest.mark.parametrize("text", STRATEGIES_8)
def test_pull_plans_reassemble_every_shard(compiled, text):
    prog = compiled.instantiate(text)
    world = prog.cluster.world_size
    rng = np.random.default_rng(0)
    for name, info in compiled.hgraph.params.items():
        full = rng.standard_normal(tuple(info.shape)).astype(np.float32)
        dim = info.shard_dim
        S = full.shape[dim]
        master = {r: np.take(full, range(r * S // world, (r + 1) * S // world), axis=dim) for r in range(world)}
        got = simulate_pull(prog.pull_plans[name], master)
        for rp in prog.ranks:
            if name not in rp.params:
                continue
            shard = rp.params[name]
            pieces = got[rp.rank]
            want = [np.take(full, range(lo, hi), axis=dim) for lo, hi in shard.ranges]
            assert len(pieces) == len(want)
            for a, b in zip(pieces, want):
                np.testing.assert_array_equal(a, b)


def test_schedule_first_stage_prefetches_one_block_ahead_later_stages_group_pulls(compiled):
    prog = compiled.instantiate("1xTP1PP2")
    for rp in prog.ranks:
        nodes = list(rp.graph_module.graph.nodes)
        pos = {n: i for i, n in enumerate(nodes)}
        issues = [n for n in nodes if n.target is ops.pull_issue]
        computes = [n for n in nodes if get_meta(n).slot is None and n.op in ("call_function", "call_method")
                    and get_meta(n).block is not None]
        pushes = [n for n in nodes if n.target is ops.push_gradient]
        if rp.stage == 0:
            assert all(n.args[3] is True for n in pushes)
            first_of = {}
            for c in computes:
                first_of.setdefault(get_meta(c).block, pos[c])
            order = [b for b in compiled.hgraph.blocks if b in first_of]
            for issue in issues:
                name = issue.args[1]
                block = _user_block(rp, name)
                i = order.index(block)
                if i > 0:   # issued as the previous block starts, so it overlaps that block's compute
                    assert (first_of[order[i - 2]] if i >= 2 else 0) <= pos[issue] < first_of[order[i - 1]]
        else:
            assert all(n.args[3] is False for n in pushes)
            assert max(pos[i] for i in issues) < min(pos[c] for c in computes)


def _user_block(rp, name):
    for n in rp.graph_module.graph.nodes:
        if n.target is ops.pull_wait and n.args[2] == name:
            work = list(n.users)
            while work:
                u = work.pop()
                if get_meta(u).slot is None and get_meta(u).block is not None:
                    return get_meta(u).block
                work.extend(u.users)
    raise AssertionError(name)


@pytest.mark.parametrize("text, world, gpn, match", [
    ("1xTP1PP5", 5, 8, "PP=5 is larger than the model's 4 layers"),
    ("1xTP8PP1", 8, 8, "does not divide the model's 4 attention heads"),
    ("2xTP2PP1", 6, 8, "world size is 6"),
    ("1xTP2PP1+1xTP4PP1+1xTP2PP1", 8, 4, "crossing a node"),
])
def test_invalid_strategies_give_clear_errors(compiled, text, world, gpn, match):
    with pytest.raises(StrategyError, match=match):
        compiled.instantiate(text, Cluster(world, gpn))


def test_python_dump_of_a_single_rank_runs(model, compiled):
    src = compiled.dump("1xTP1PP1", rank=0, format="python")
    assert "# ---- pull_parameter: layers.0.self_attn.q_proj.weight" in src
    ns: dict = {}
    exec(compile(src, "<dump>", "exec"), ns)
    mod = ns["Rank0"]()
    mod.load_state_dict({k: v.detach() for k, v in model.named_parameters()}, strict=True)
    ids = torch.randint(0, model.config.vocab_size, (1, 9))
    pos = torch.arange(9)[None]
    with torch.no_grad():
        assert torch.equal(mod(ids, pos, None), model(ids, pos))


def test_a_vocabulary_parallel_embedding_keeps_padding_and_refuses_what_it_cannot_keep():
    """Every argument of the embedding survives TP sharding (padding_idx) or is refused in one line."""
    model = llama.build("tiny", pad_token_id=5)
    nodes = list(hgraph.compile(model).instantiate("1xTP2PP1").rank(0).graph_module.graph.nodes)
    (lookup,) = [n for n in nodes if n.target is ops.vocab_parallel_embedding]
    assert lookup.args[2:] == (0, model.config.vocab_size // 2, 5)
    model.embed_tokens.max_norm = 1.0
    with pytest.raises(HGraphError, match=r"embedding of embed_tokens.weight: max_norm=1\.0 cannot be kept "
                                          r"when the vocabulary is split"):
        hgraph.compile(model).instantiate("1xTP2PP1").rank(0).graph_module   # its passes run when built
    hgraph.compile(model).instantiate("2xTP1PP1").rank(0).graph_module       # unsharded: nothing to refuse
