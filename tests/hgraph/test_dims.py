"""The parallel-dimension registry (``hgraph/dims.py``) and what ``hgraph.strategy`` generates from it.

A scheme's text form, its rank count, the rank layout, every rank's groups and bindings come from
iterating over ``DIMENSIONS``; these tests check them against the layout written out by hand (TP
innermost, then the Ulysses and CP ranks, then the stage) and that the rank graphs name their groups by
``BindingKey`` members that still read as the group's name.
"""
import itertools
import json
import math

import pytest
import torch

import hgraph
from hgraph import Cluster, Scheme, Strategy, dims, ops
from hgraph.dims import DIMENSIONS, GROUPED, LAYOUT, SEQUENCE, BindingKey
from hgraph.frontends.zoo import llama


def test_every_dimension_is_declared_once_with_its_place():
    assert [d.letter for d in DIMENSIONS] == ["TP", "PP", "CP", "UL", "EP"]    # the text order
    assert [d.letter for d in LAYOUT] == ["TP", "UL", "CP", "EP", "PP"]        # inside out
    assert [d.letter for d in SEQUENCE] == ["UL", "CP"]
    assert [d.key for d in GROUPED] == [BindingKey.TP, BindingKey.CP, BindingKey.UL, BindingKey.EP]
    assert dims.DOCUMENTS == (dims.EP,) and dims.REPLICAS == ()
    assert dims.PP.neighbours == (BindingKey.PP_PREV, BindingKey.PP_NEXT)
    # a scheme's degrees are the registry's dimensions, in text order, each also the attribute of its name
    scheme = Scheme(2, 3, 5, 7, 11)
    assert [f for f in Scheme.__dataclass_fields__] == ["degrees"]
    assert scheme.degrees == (2, 3, 5, 7, 11) == tuple(getattr(scheme, d.name) for d in DIMENSIONS)
    assert scheme.doc_ranks == 11 and scheme.seq == 35 and Scheme(2, 3).ep == 1
    assert dims.by_key("pp_next") is dims.PP and dims.by_key(BindingKey.UL) is dims.UL
    assert dims.by_key("ep") is dims.EP
    assert dims.by_comm_point(hgraph.meta.CommPoint.CP_KV) is dims.CP
    with pytest.raises(KeyError):
        dims.by_key("dp")


DEGREES = (1, 2, 3)


@pytest.mark.parametrize("degrees", list(itertools.product(DEGREES, repeat=len(DIMENSIONS))))
def test_scheme_text_and_rank_count_follow_the_registry(degrees):
    s = Scheme(*degrees)
    text = "".join(f"{d.letter}{n}" for d, n in zip(DIMENSIONS, degrees) if d.always_written or n != 1)
    assert str(s) == text
    assert Scheme.parse(text) == s == Scheme.parse(text.lower())
    assert s.num_ranks == math.prod(degrees)
    assert s.seq == s.cp * s.ul
    strategy = Strategy.parse(f"2x{text}+TP1PP1")
    assert Strategy.parse(str(strategy)) == strategy


def _layout_by_hand(strategy: Strategy) -> list[dict]:
    """Every rank's coordinates, numbering the ranks in the documented order: pipelines in turn, in each
    the stages, in each stage the EP ranks, in each the CP shards, in each shard the Ulysses ranks, in each
    the TP ranks."""
    out = []
    for i, p in enumerate(strategy.pipelines):
        for stage, ep, cp, ul, tp in itertools.product(range(p.pp), range(p.ep), range(p.cp), range(p.ul),
                                                       range(p.tp)):
            out.append({"pipeline": i, "pp": stage, "ep": ep, "cp": cp, "ul": ul, "tp": tp})
    return out


@pytest.mark.parametrize("text", ["TP2PP2CP2UL2+TP1PP3+2xTP2PP1UL3", "TP3PP2CP3+1xTP1PP1CP2UL2",
                                  "1xTP2PP1EP2+1xTP1PP2CP2EP2", "TP2PP2CP2UL2EP3+2xTP1PP1EP4+TP1PP1"])
def test_groups_and_bindings_are_the_ranks_differing_in_one_coordinate(text):
    strategy = Strategy.parse(text)
    coords = _layout_by_hand(strategy)
    assert len(coords) == strategy.num_ranks
    for rank, c in enumerate(coords):
        got = strategy.coord(rank)
        assert (got.pipeline, got.stage, got.tp_rank, got.cp_rank, got.doc_rank) == (
            c["pipeline"], c["pp"], c["tp"], c["cp"] * strategy.pipelines[c["pipeline"]].ul + c["ul"], c["ep"])
        assert strategy.rank_of(got.pipeline, got.stage, got.tp_rank, got.cp_rank, 0, got.doc_rank) == rank
        assert {d.name: strategy.place(rank, d) for d in DIMENSIONS} == {k: v for k, v in c.items() if k != "pipeline"}
        assert strategy.rank_at(c["pipeline"], {d: c[d.name] for d in DIMENSIONS}) == rank
        bindings = strategy.bindings(rank)
        for d in GROUPED:
            same = [r for r, o in enumerate(coords)
                    if all(o[k] == c[k] for k in c if k != d.name)]
            assert bindings[d.key] == tuple(same), (rank, d.letter)
            assert type(next(k for k in bindings if k == d.key)) is BindingKey
        for key, step in ((BindingKey.PP_PREV, -1), (BindingKey.PP_NEXT, 1)):
            peer = [r for r, o in enumerate(coords) if o == {**c, "pp": c["pp"] + step}]
            assert bindings.get(key) == (tuple(peer) if peer else None), (rank, key)


def test_binding_keys_read_as_the_group_names():
    bindings = Strategy.parse("TP2PP2").bindings(0)
    assert list(bindings) == ["tp", "cp", "ul", "ep", "pp_next"]
    assert bindings["tp"] == (0, 1) and f"{BindingKey.TP}" == str(BindingKey.TP) == "tp"
    assert repr(BindingKey.UL) == "'ul'"
    assert json.loads(json.dumps({k: list(v) for k, v in bindings.items()})) == {
        "tp": [0, 1], "cp": [0], "ul": [0], "ep": [0], "pp_next": [2]}


def test_rank_graphs_name_their_groups_by_binding_key():
    torch.manual_seed(0)
    with torch.device("meta"):
        compiled = hgraph.compile(llama.build("tiny"))
    strategy = Strategy.parse("TP2PP2")
    rp = compiled.build_program(strategy, Cluster(strategy.num_ranks)).rank(0)
    keys = {a for n in rp.graph_module.graph.nodes if n.op == "call_function"
            for a in n.args if isinstance(a, str) and a in {k.value for k in BindingKey}}
    assert keys == {BindingKey.TP, BindingKey.PP_NEXT}
    assert all(type(k) is BindingKey for k in keys)
    assert "BindingKey.TP" in rp.graph_module.code and "'tp'" not in rp.graph_module.code


def test_every_op_and_comm_point_belongs_to_one_dimension():
    """A dimension's ops exist in the op vocabulary, and every Communicate Activation point is filled by
    exactly one dimension's ops (dumps find a subgraph's peers through it)."""
    for d in DIMENSIONS:
        for name in d.ops:
            assert callable(getattr(ops, name)), (d.letter, name)
    claimed = [p for d in DIMENSIONS for p in d.comm_points]
    assert sorted(claimed) == sorted(p.value for p in hgraph.meta.CommPoint)


def _old_coord(strategy: Strategy, rank: int) -> tuple[int, int, int, int]:
    """(pipeline, stage, TP rank, sequence rank) as the code before the coordinate kinds computed them."""
    i = max(k for k in range(len(strategy.pipelines)) if strategy.rank_of(k, 0) <= rank)
    p, local = strategy.pipelines[i], rank - strategy.rank_of(i, 0)
    return i, local // (p.tp * p.seq), local % p.tp, local // p.tp % p.seq


def _old_push_contribution(shard, scheme, tp_rank, info, sp_partial=False):
    if shard.tp_sharded or scheme.tp == 1 or info.tp_partial or sp_partial:
        return tuple(shard.ranges)
    (lo, hi), = shard.ranges
    a, b = lo + (hi - lo) * tp_rank // scheme.tp, lo + (hi - lo) * (tp_rank + 1) // scheme.tp
    return ((a, b),) if b > a else ()


def test_coordinates_by_kind_equal_the_formulas_they_replaced():
    """A rank's stage, TP rank and sequence rank (read per dimension by what it splits), the rank back from
    them, a stage's ranks and a rank's push share equal the old per-name formulas on every scheme of
    degrees 1-3 beside others (without EP, which those formulas did not know)."""
    from types import SimpleNamespace

    from hgraph.passes.instantiate import push_contribution
    from hgraph.program import ParamShard
    for degrees in itertools.product(DEGREES, repeat=4):
        p = Scheme(*degrees)
        strategy = Strategy((Scheme(1, 2), p, Scheme(2, 1, ul=2), p))
        for rank in range(strategy.num_ranks):
            c = strategy.coord(rank)
            assert (c.pipeline, c.stage, c.tp_rank, c.cp_rank) == _old_coord(strategy, rank), (strategy, rank)
            assert c.replica == 0 == c.doc_rank
            scheme = strategy.pipelines[c.pipeline]
            assert strategy.rank_of(c.pipeline, c.stage, c.tp_rank, c.cp_rank) == rank == (
                strategy.rank_of(c.pipeline, 0) + c.stage * scheme.tp * scheme.seq + c.cp_rank * scheme.tp + c.tp_rank)
        for stage in range(p.pp):
            assert strategy.stage_ranks(1, stage) == [strategy.rank_of(1, stage, t, c) for c in range(p.seq)
                                                      for t in range(p.tp)]
        for t in range(p.tp):
            for sharded, partial, sp in itertools.product((False, True), repeat=3):
                shard = ParamShard("w", (7, 3), 0, ((0, 7),), tp_sharded=sharded)
                info = SimpleNamespace(tp_partial=partial)
                assert push_contribution(shard, p, t, info, sp) == _old_push_contribution(shard, p, t, info, sp)


def test_a_dimension_registered_from_a_test_parses_prints_and_lays_out_ranks():
    """The test-only ``RS`` dimension (``tests/hgraph/dim_helpers.py``: ranks that hold the same weights
    and tokens, between the sequence ranks and the stages) added through the registry alone: text form,
    errors, rank count, layout, groups, bindings, coordinates, roles, push shares and the loss share."""
    from types import SimpleNamespace

    from hgraph.passes.instantiate import ParamRole, push_contribution
    from hgraph.program import ParamShard, RankRole
    from hgraph.errors import StrategyError
    from tests.hgraph.dim_helpers import RS, with_reshard

    with pytest.raises(StrategyError):
        Strategy.parse("TP1PP1RS2")
    with with_reshard():
        assert [d.letter for d in dims.DIMENSIONS] == ["TP", "PP", "CP", "UL", "EP", "RS"]
        assert [d.letter for d in dims.LAYOUT] == ["TP", "UL", "CP", "EP", "RS", "PP"]
        assert dims.REPLICAS == (RS,) and dims.by_key("rs") is RS
        s = Strategy.parse("TP2PP2CP2RS2+2xtp1pp1rs3+TP1PP1")
        assert str(s) == "1xTP2PP2CP2RS2+2xTP1PP1RS3+1xTP1PP1" and Strategy.parse(str(s)) == s
        assert [p.num_ranks for p in s.pipelines] == [16, 3, 3, 1] and s.num_ranks == 23
        assert s.pipelines[0] == Scheme(2, 2, cp=2, rs=2) and s.pipelines[0].replicas == 2
        assert str(Scheme(1, 1)) == "TP1PP1" and Scheme(1, 1).rs == 1
        with pytest.raises(StrategyError, match=r"TP<n>PP<n>\[CP<n>\]\[UL<n>\]\[EP<n>\]\[RS<n>\]"):
            Strategy.parse("TP1PP1RS")
        # the layout by hand: pipelines in turn, in each the stages, the RS replicas, the CP shards, TP
        coords = [(i, stage, rs, cp, tp) for i, p in enumerate(s.pipelines)
                  for stage, rs, cp, tp in itertools.product(range(p.pp), range(p.rs), range(p.cp), range(p.tp))]
        for rank, (i, stage, rs, cp, tp) in enumerate(coords):
            c = s.coord(rank)
            assert (c.pipeline, c.stage, c.replica, c.cp_rank, c.tp_rank) == (i, stage, rs, cp, tp)
            assert s.place(rank, RS) == rs and s.rank_of(i, stage, tp, cp, rs) == rank
            same = tuple(r for r, o in enumerate(coords) if o[:2] + o[3:] == (i, stage, cp, tp))
            assert s.bindings(rank)["rs"] == same == tuple(s.group(RS, rank))
            nxt = [r for r, o in enumerate(coords) if o == (i, stage + 1, rs, cp, tp)]
            assert s.bindings(rank).get(BindingKey.PP_NEXT) == (tuple(nxt) if nxt else None)
            assert RankRole.of(s.pipelines[i], c).replica == ParamRole.of(s.pipelines[i], c).replica == rs
        assert s.stage_ranks(0, 1) == list(range(8, 16))
        # push shares: every element of a parameter counted once per pipeline over its TP ranks and replicas
        p = s.pipelines[0]
        info = SimpleNamespace(tp_partial=False)
        for sharded in (False, True):
            shard = ParamShard("w", (11, 3), 0, ((0, 11),), tp_sharded=sharded)
            rows = sorted(x for t in range(p.tp) for r in range(p.rs)
                          for lo, hi in push_contribution(shard, p, t, info, False, r) for x in range(lo, hi))
            assert rows == sorted(list(range(11)) * (p.tp if sharded else 1))
    with pytest.raises(StrategyError):
        Strategy.parse("TP1PP1RS2")


def test_a_dumps_coordinates_are_the_registrys_places():
    """A dump's JSON names a rank's places along the sequence dimensions (``cp_shard``, ``ul_rank``, as
    before) and along a registered dimension's (``rs_rank``), from the registry."""
    from hgraph.program_text import program_json
    from tests.hgraph.dim_helpers import with_reshard

    torch.manual_seed(0)
    with torch.device("meta"):
        compiled = hgraph.compile(llama.build("tiny"))
    program = compiled.instantiate("1xTP1PP1CP2UL2+1xTP2PP1")
    ranks = program_json(program, [program.rank(r) for r in range(6)])["ranks"]
    assert [list(r)[4:9] for r in ranks] == [["tp_rank", "cp_rank", "optimizer", "cp_shard", "ul_rank"]] * 6
    assert [(r["cp_rank"], r["cp_shard"], r["ul_rank"]) for r in ranks] == [
        (0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1), (0, 0, 0), (0, 0, 0)]
    with with_reshard():
        with torch.device("meta"):
            compiled = hgraph.compile(llama.build("tiny"))
        program = compiled.instantiate("1xTP1PP2RS2")
        ranks = program_json(program, [program.rank(r) for r in range(4)])["ranks"]
        assert [(r["stage"], r["rs_rank"]) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_dimensions_and_schemes_pickle_to_what_the_receiver_has_registered():
    """A dimension pickles by name (another process finds its own registered one, hashed as itself) and a
    scheme with its degrees, so plans and strategies cross to the ranks and the planner process."""
    import copy
    import pickle

    assert pickle.loads(pickle.dumps(dims.CP)) is dims.CP and copy.deepcopy(dims.UL) is dims.UL
    s = Strategy.parse("2xTP2PP2CP2+TP1PP1UL2")
    t = pickle.loads(pickle.dumps(s))
    assert t == s and hash(t) == hash(s) and [t.coord(r) for r in range(18)] == [s.coord(r) for r in range(18)]
    assert copy.deepcopy(Scheme(2, 1, ul=2)).ul == 2
