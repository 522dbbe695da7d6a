"""Training under schedules that switch strategies every step equals single-process PyTorch.

The reference is ``torch.optim.Adam`` on the unmodified zoo model, each document run alone, loss =
sum of per-target cross-entropy over the mini-batch / number of targets in the mini-batch. The
runtime trains the same model on 4 (then 8) gloo processes with the built-in dispatch rule, which
packs several documents per micro-batch, gives PP pipelines more micro-batches than PP1 pipelines
and, with 3-document mini-batches on 4 pipelines, leaves a pipeline without any document.

TP pipelines run with Megatron sequence parallelism (the default; uneven token slices where a TP2
micro-batch has an odd token count), the first case without it.

Processes are spawned once per world size; every schedule runs inside them (one process group).

Every run keeps NCCL's strictest collective order (``--collective-order strict``: each rank completes one
collective before it issues the next, so an inconsistent order hangs here as it would on NCCL) and checks
what the ranks issued after each new strategy's first step (``--verify-collectives``); the modules that
build their runs with ``_config`` (Ulysses, long context) inherit both.

fp32 tolerances: the noise-aware comparison of ``tests/runtime/reference_training.py`` (loss per step
|diff| <= 1e-6 x loss; parameters atol = rtol = 1e-5 wherever the first gradient is not negligible, and
elsewhere within a fifth of one Adam step, with at most 0.1 % of the elements past the tight bound:
TP and the reduce-scatter sum partial products in another order, and Adam divides by sqrt(v), so an
element whose gradient is near zero moves by a few ulps of lr more or less).
"""
import pytest
import torch
from tests.runtime.reference_training import assert_trained_like, reference_run

import hgraph
from hgraph.frontends.zoo import llama, resolve_model_spec
from hgraph.runtime.comm.order.derive import StepPlan, derive_steps
from hgraph.runtime.comm.process_groups import GroupCache
from hgraph.runtime.data.documents import Document, mini_batches
from hgraph.runtime.train.config import TrainConfig
from hgraph.runtime.train.launch import spawn
from hgraph.runtime.train.step_modes import dispatch_and_pack
from hgraph.runtime.train.trainer import Trainer
from hgraph.strategy import Cluster, Strategy

LENGTHS = [13, 5, 9, 7, 11, 3, 6, 8, 10, 4, 12, 2]
TOKENS_PER_ITER = 30
STEPS = 4
LR = 1e-3
PAD = 0             # a token the documents below contain (checked)

# (model, schedule, model overrides, optimizer options)
CASES_4 = [
    # TP without sequence parallelism (all-reduce exits); the other TP cases run SP, the default
    ("tiny", "4xTP1PP1;1xTP2PP1+2xTP1PP1;1xTP2PP2;1xTP1PP2+1xTP2PP1", {}, {"sequence_parallel": False}),
    ("tiny-tied", "1xTP1PP2+1xTP2PP1;4xTP1PP1;1xTP2PP2;1xTP2PP1+2xTP1PP1", {}, {}),
    # a vocabulary TP does not divide (padded shards), AdamW with weight decay and global-norm clipping
    ("tiny-tied", "2xTP2PP1;1xTP2PP2;1xTP4PP1", {"vocab_size": 509},
     {"optimizer": "adamw", "weight_decay": 0.1, "grad_clip": 0.5}),
    # plain data parallelism twice in a row: the overlapped update, the second step's pull done by
    # the first; then another strategy, after which the pull cannot be reused (3- and 2-document
    # steps leave ranks idle)
    ("tiny-tied", "4xTP1PP1;4xTP1PP1;1xTP2PP2", {}, {"optimizer": "adamw", "weight_decay": 0.1}),
    # an embedding with a padding row (pad_token_id, as Hugging Face configs set it), vocabulary-parallel:
    # the padding row must not train on the TP rank that holds it; a memory budget of one byte recomputes
    # every block in backward, sequence parallelism's collectives included
    ("tiny", "2xTP2PP1;1xTP2PP2", {"pad_token_id": PAD}, {"memory_budget": 1}),
    # torch.compile of the rank graphs' compute between their TP (sequence-parallel), PP and CP
    # collectives (engine/compiled_regions), traced and differentiated by AOTAutograd (inductor's code
    # generation: test_compiled_regions)
    ("tiny", "1xTP2PP1+2xTP1PP1;1xTP1PP2CP2", {"num_layers": 2},
     {"compile": "on", "compile_backend": "aot_eager"}),
    # hierarchical sharding: the states sharded over pairs of ranks and replicated across the two pairs
    # (pulls and pushes inside a pair, the shards summed across the pairs); global-norm clipping must
    # count each shard once, not once per pair
    ("tiny", "4xTP1PP1;1xTP2PP2;1xTP2PP1+2xTP1PP1", {}, {"shard_group": 2, "grad_clip": 0.5}),
    # the second case again without building the next strategies ahead (--plan-ahead 0): the same numbers
    ("tiny-tied", "1xTP1PP2+1xTP2PP1;4xTP1PP1;1xTP2PP2;1xTP2PP1+2xTP1PP1", {}, {"plan_ahead": 0}),
]
AHEAD, NOT_AHEAD = 1, len(CASES_4) - 1     # the CASES_4 entries above: one schedule with and without
# the MoE model with its router losses, run in the same processes after CASES_4 for what they issue (their
# numbers against PyTorch: tests/runtime/train/test_moe_train): per document with every block recomputed
# (the count all-reduces of CP and Ulysses, replayed), over the global batch (the counting pass and its
# all-reduce), and none (the world collectives a step makes without them)
MOE_SCHEDULE = "1xTP1PP1CP2UL2;1xTP2PP2;1xTP2PP1+2xTP1PP1"
ROUTER = {"moe_aux_loss_coef": 0.5, "moe_z_loss_coef": 0.01}
MOE_CASES_4 = [
    ("llama-moe:tiny", MOE_SCHEDULE, {}, {"moe_aux_loss": "per-document", "memory_budget": 1, **ROUTER}),
    ("llama-moe:tiny", MOE_SCHEDULE, {}, {"moe_aux_loss": "global-batch", **ROUTER}),
    ("llama-moe:tiny", MOE_SCHEDULE, {}, {}),
]
DP_REPEAT = 3       # the CASES_4 entry above
CASES_8 = [
    ("tiny", "1xTP2PP2+1xTP2PP1+2xTP1PP1;2xTP1PP2+1xTP4PP1;8xTP1PP1", {}, {}),
    # hierarchical sharding over two groups of 4 (a TP4 pipeline fills a group; a TP2PP2 one spans two)
    ("tiny", "1xTP2PP2+1xTP2PP1+2xTP1PP1;2xTP1PP2+1xTP4PP1;8xTP1PP1", {}, {"shard_group": 4}),
]


def _docs(vocab=512):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in LENGTHS]


def _batches(vocab=512):
    docs = [Document(i, tuple(d)) for i, d in enumerate(_docs(vocab))]
    return list(mini_batches(docs, TOKENS_PER_ITER, STEPS))


#: the collective order every multi-rank equivalence run keeps, and the check of what the ranks issued
ORDER = {"collective_order": "strict", "verify_collectives": True}


def _config(model, schedule, world, overrides, options):
    return TrainConfig.from_values(model=model, world_size=world, strategy_schedule=schedule, steps=STEPS,
                                   tokens_per_iter=TOKENS_PER_ITER, docs=_docs(overrides.get("vocab_size", 512)),
                                   lr=LR, model_args=dict(overrides), save_final="unused", **{**ORDER, **options})


def _op_ranks(op):
    return getattr(op, "group", None) or tuple(getattr(op, k) for k in ("src", "dst", "rank") if hasattr(op, k))


def _worker(rank, world, cases):
    groups = GroupCache(rank, world)
    out = []
    for model, schedule, overrides, options in cases:
        trainer = Trainer(_config(model, schedule, world, overrides, options), rank, world, groups)
        trainer.executor.issuer.record = True        # what each step issued (test_derived_order_is_recorded)

        def holding_states():
            # a state holds memory through its working tensors, or through its last step's gradients
            # (kept by the reductions) and transfer buffers; states prepared ahead are counted too
            return [any(w.untyped_storage().nbytes() for w in st.working.values())
                    or any(g is not None for g in st.sync._buckets._grads.values()) or bool(st.sync.pulls._pulls)
                    for st in trainer.executor.programs.states().values()]
        steps, held, issued = [], [], []
        for b in _batches(overrides.get("vocab_size", 512)):
            steps.append(trainer.step(b))
            held.append(sum(holding_states()))
            issued += trainer.executor.issuer.sequence
        final = trainer.final_state_dict()
        holding = holding_states()
        states = trainer.executor.programs.states().values()
        out.append({"states": len(holding), "holding": sum(holding), "held": held, "losses": [s.loss for s in steps],
                    "strategies": [s.strategy for s in steps],
                    "overlapped": [s.overlapped_update for s in steps],
                    "prefetched": [s.pull_prefetched for s in steps],
                    "recomputed": [bool(s.recompute_layers) for s in steps],
                    "replica_bytes": [s.bytes["push_replica_bytes"] for s in steps],
                    # every rank the pulls and pushes of this rank's Programs exchange with
                    "peers": sorted({r for st in states for ops in (*st.sync.pulls.ops.values(),
                                                                   *st.sync.pushes.ops.values())
                                     for op in ops for r in _op_ranks(op)} - {rank}),
                    "builds": [(s.cache_hit, s.built_ahead, s.switch_s, s.build_s, s.build_lead_s) for s in steps],
                    "final": final if rank == 0 else None, "cache": trainer.executor.programs.info(),
                    "order_checks": trainer.executor.order_verdicts, "issued": issued})
    return out


def _reference(model_name, overrides, options):
    torch.manual_seed(0)
    model = llama.build(model_name, **overrides)
    return reference_run(model, _batches(overrides.get("vocab_size", 512)), LR,
                         optimizer=options.get("optimizer", "adam"), weight_decay=options.get("weight_decay", 0.0),
                         grad_clip=options.get("grad_clip"))


@pytest.fixture(scope="module")
def results4():
    return spawn(_worker, 4, args=(CASES_4 + MOE_CASES_4,), timeout_s=300)


@pytest.fixture(scope="module")
def results8():
    return spawn(_worker, 8, args=(CASES_8,), timeout_s=300)


def _check(result, model_name, schedule, overrides, options):
    reference = _reference(model_name, overrides, options)
    expected = [str(Strategy.parse(s)) for s in schedule.split(";")]
    assert result["strategies"] == [expected[k % len(expected)] for k in range(STEPS)]
    assert set(result["final"]) == set(reference.state)
    assert_trained_like(result["losses"], result["final"], reference)


@pytest.mark.parametrize("case", range(len(CASES_4)))
def test_four_ranks_match_single_process_adam(results4, case):
    _check(results4[0][case], *CASES_4[case])
    # every rank saw the same global loss
    assert len({tuple(r[case]["losses"]) for r in results4}) == 1


def test_plain_data_parallel_steps_update_while_reducing_and_reuse_the_prefetched_pull(results4):
    """The DP_REPEAT case took the overlapped path where it applies (so its equivalence above covers
    it): steps 0, 1, 3 are 4xTP1PP1; step 1 reused the pull step 0 prefetched; step 3 follows a
    1xTP2PP2 step, whose update made the old prefetch stale, and pulled afresh."""
    for r in results4:
        case = r[DP_REPEAT]
        assert case["overlapped"] == [True, True, False, True]
        assert case["prefetched"] == [False, True, False, False]


@pytest.mark.parametrize("case", range(len(CASES_8)))
def test_eight_ranks_three_schemes_match_single_process_adam(results8, case):
    _check(results8[0][case], *CASES_8[case])
    assert results8[0][case]["cache"]["hits"] >= 1       # the schedule came back to its first strategy


def test_hierarchical_sharding_pulls_and_pushes_inside_the_group_and_sums_across_the_groups(results4, results8):
    """The shard-group cases (their equivalence is checked above): a rank's Pull and Push peers are the
    ranks of its group only, and every step sums its shards across the groups; the world layout
    exchanges with ranks of the other half and sums nothing across."""
    for results, cases in ((results4, CASES_4), (results8, CASES_8)):
        for case, (_, _, _, options) in enumerate(cases):
            size = options.get("shard_group")
            for rank, r in enumerate(results):
                if size is None:
                    assert r[case]["replica_bytes"] == [0] * STEPS
                    continue
                group = set(range(rank - rank % size, rank - rank % size + size)) - {rank}
                assert r[case]["peers"] and set(r[case]["peers"]) <= group, (case, rank, r[case]["peers"])
                assert all(b > 0 for b in r[case]["replica_bytes"])
    world_peers = set(results8[0][0]["peers"])
    assert world_peers - set(range(4)), "the world layout's rank 0 exchanges beyond its half"


def test_every_new_strategy_was_checked_deadlock_free_under_the_strict_order(results4, results8):
    """--verify-collectives checked the collectives every rank recorded in each strategy's first step
    (the equivalence above ran under --collective-order strict): every rank got the same verdict, for
    every strategy of the schedule once, and no order could deadlock NCCL."""
    for results, cases in ((results4, CASES_4), (results8, CASES_8)):
        for case, (_, schedule, _, _) in enumerate(cases):
            checks = [r[case]["order_checks"] for r in results]
            assert all(c == checks[0] for c in checks)
            assert [s for _, s, _ in checks[0]] == list(dict.fromkeys(str(Strategy.parse(x))
                                                                     for x in schedule.split(";")))
            assert all(line.startswith(f"deadlock-free: {len(results)} ranks, ") for _, _, line in checks[0]), checks[0]


def test_only_the_last_strategys_working_parameters_hold_memory(results4, results8):
    """Per strategy the cache keeps the rank's graph and plans, but a switch frees the working
    parameters and gradients of the last one (and the buffers and gradient references of its last
    step): after a schedule of several strategies exactly one state holds memory on every rank (the equivalence above ran across those switches)."""
    for results, cases in ((results4, CASES_4), (results8, CASES_8)):
        for r in results:
            for case, (_, schedule, _, _) in zip(r, cases):
                assert case["states"] == len(set(schedule.split(";")))
                assert case["holding"] == 1 and case["held"] == [1] * STEPS    # after every step too


def test_each_new_strategy_is_built_ahead_and_its_first_step_only_looks_it_up(results4):
    """A fixed schedule's next strategies are known: each one's rank state (its graph, Pull/Push plans)
    is prepared on the build-ahead thread while the steps before it run. Its first step finds it
    built: the build began before that step did (``build_lead_s``), and the step's switch is the
    lookup, not the build. Without building ahead (``plan_ahead`` 0) the first step builds it."""
    for r in results4:
        for index, case in enumerate(r):
            ahead = index != NOT_AHEAD
            seen = set()
            for k, (strategy, (hit, built_ahead, switch_s, build_s, lead_s)) in enumerate(
                    zip(case["strategies"], case["builds"])):
                assert hit           # a fixed schedule's Programs are built before its first step
                if strategy in seen:
                    assert not built_ahead and build_s is None and lead_s is None
                elif k > 0 and ahead:
                    assert built_ahead and build_s > 0 and lead_s > 0, (k, strategy)
                    assert switch_s < build_s
                else:
                    assert not built_ahead and lead_s is None
                seen.add(strategy)
        assert len(set(r[AHEAD]["strategies"])) == 4


def test_building_ahead_changes_no_number(results4):
    """The same schedule with and without building ahead: the same losses and parameters, bitwise."""
    a, b = results4[0][AHEAD], results4[0][NOT_AHEAD]
    assert a["losses"] == b["losses"]
    assert a["final"].keys() == b["final"].keys()
    assert all(torch.equal(a["final"][k], b["final"][k]) for k in a["final"])


def test_the_padding_case_trains_on_its_padding_token(results4):
    """The padding row is looked up (the token is in the data) and, as in PyTorch, never trains."""
    assert any(PAD in d for d in _docs())
    case = next(i for i, c in enumerate(CASES_4) if "pad_token_id" in c[2])
    assert not results4[0][case]["final"]["embed_tokens.weight"][PAD].any()
    assert all(all(r[case]["recomputed"]) for r in results4)      # its blocks recomputed (TP2 with SP)


def test_schedules_cover_packing_uneven_microbatches_and_an_idle_pipeline():
    """The data above really exercises the cases the acceptance test names (checked on the plans)."""
    batches = _batches()       # lengths do not depend on the vocabulary
    several_docs = uneven = idle = odd_tp2 = False
    for model, schedule, _, _ in CASES_4 + CASES_8:
        strategies = [Strategy.parse(s) for s in schedule.split(";")]
        for k, batch in enumerate(batches):
            plan = dispatch_and_pack(strategies[k % len(strategies)], batch.docs)
            several_docs |= any(len(mb) > 1 for pipe in plan for mb in pipe)
            counts = {len(pipe) for pipe in plan if pipe}
            uneven |= len(counts) > 1
            idle |= any(not pipe for pipe in plan)
            # sequence parallelism over uneven token slices: a TP2 micro-batch of an odd token count
            odd_tp2 |= any(p.tp == 2 and sum(len(d.input_ids) for d in mb) % 2
                           for p, pipe in zip(strategies[k % len(strategies)].pipelines, plan) for mb in pipe)
            assert sorted(d.index for pipe in plan for mb in pipe for d in mb) == sorted(d.index for d in batch.docs)
    assert several_docs and uneven and idle and odd_tp2


_COMPILED = {}      # (model, overrides, sequence parallelism) -> compiled model: the cases share a few


def _derived(model, schedule, world, overrides, options):
    """Every rank's collective sequence of the case's steps, derived from its Programs and each step's
    micro-batch counts (``runtime/comm/order/derive``), as the gloo runtime issues them."""
    key = (model, tuple(sorted(overrides.items())), options.get("sequence_parallel"))
    if key not in _COMPILED:
        built = resolve_model_spec(model, overrides) if ":" in model else llama.build(model, **overrides)
        _COMPILED[key] = hgraph.compile(built, **{k: options[k] for k in ("sequence_parallel",) if k in options})
    compiled = _COMPILED[key]
    strategies = [Strategy.parse(s) for s in schedule.split(";")]
    cluster = Cluster(world, shard_group=options.get("shard_group"))
    steps = []
    for k, batch in enumerate(_batches(overrides.get("vocab_size", 512))):
        strategy = strategies[k % len(strategies)]
        counts = tuple(len(pipe) for pipe in dispatch_and_pack(strategy, batch.docs))
        steps.append((compiled.instantiate(strategy, cluster),
                      StepPlan(counts, backend="gloo", recompute=options.get("memory_budget") is not None,
                               grad_clip=options.get("grad_clip") is not None, **_router_plan(options))))
    return derive_steps(steps)


def _router_plan(options):
    """The plan's MoE router losses: the load-balancing form when its coefficient is not 0, the z-loss."""
    aux = options.get("moe_aux_loss", "none") if options.get("moe_aux_loss_coef", 0.01) else "none"
    return {"moe_aux_loss": aux, "moe_z_loss": bool(options.get("moe_z_loss_coef", 0.0))}


def _same_operation(recorded, derived):
    """Kind, group, dtype and a batch's peers alike; the shape too where the derivation knows it."""
    return ((recorded.kind, recorded.group, recorded.dtype, recorded.sends, recorded.recvs)
            == (derived.kind, derived.group, derived.dtype, derived.sends, derived.recvs)
            and (derived.shape == () or recorded.shape == derived.shape))


@pytest.mark.parametrize("world", [4, 8])
def test_derived_order_is_recorded(results4, results8, world):
    """The order ``hgraph check`` derives is what every rank issued, step by step, in every case:
    switches, an idle pipeline, recomputation, compiled regions, shard groups, the overlapped update
    and its prefetch, the MoE router losses' collectives (per-document counts, replayed; the global
    batch's counting pass and all-reduce; the router values in the loss's all-reduce)."""
    results, cases = (results4, CASES_4 + MOE_CASES_4) if world == 4 else (results8, CASES_8)
    for case, (model, schedule, overrides, options) in enumerate(cases):
        derived = _derived(model, schedule, world, overrides, options)
        for rank in range(world):
            got, want = results[rank][case]["issued"], derived[rank]
            first = next((i for i, (a, b) in enumerate(zip(got, want)) if not _same_operation(a, b)),
                         None if len(got) == len(want) else min(len(got), len(want)))
            assert first is None, (f"case {case} rank {rank}: operation {first + 1} issued "
                                   f"{got[first].describe() if first < len(got) else 'nothing'}, derived "
                                   f"{want[first].describe() if first < len(want) else 'nothing'}")


def _world_collectives(issued, world):
    """Per step (each begins with its pull), the labels of the collectives over the whole world."""
    return [c.label for c in issued if c.kind != "p2p" and c.group == tuple(range(world))]


def test_router_losses_add_no_world_collective_and_the_global_batch_one_all_reduce(results4):
    """What each rank issued over the world in the MoE cases' steps (recorded by its collective issuer):
    with the per-document load balancing and the z-loss the same collectives as without router losses
    (their values ride on the loss's all-reduce), and over the global batch exactly one more per step,
    the counts' all-reduce."""
    base = len(CASES_4)
    per_document, global_batch, off = (base + k for k in range(3))
    for r in results4:
        without = _world_collectives(r[off]["issued"], 4)
        # the loss's all-reduce where the step pushes to owners (the plain data-parallel steps carry it
        # in their first reduction, with the router values when there are any)
        assert without.count("loss") == 2
        # (its memory budget adds the recomputation agreement where a stage spans the world)
        assert [c for c in _world_collectives(r[per_document]["issued"], 4)
                if not c.endswith("memory agreement")] == without
        got = _world_collectives(r[global_batch]["issued"], 4)
        assert got.count("moe counts global") == STEPS
        assert [c for c in got if c != "moe counts global"] == without
