"""The parallel-dimension registry (``hgraph/dims.py``) and what ``hgraph.strategy`` generates from it.

A scheme's text form, its rank count, the rank layout, every rank's groups and bindings come from
iterating over ``DIMENSIONS``; these tests check them against the layout written out by hand (TP
innermost, then the Ulysses and CP ranks, then the stage) and that the rank graphs name their groups by
``BindingKey`` members that still read as the group's name.
"""
import itertools
import json

import pytest
import torch

import hgraph
from hgraph import Cluster, Scheme, Strategy, dims, ops
from hgraph.dims import DIMENSIONS, GROUPED, LAYOUT, SEQUENCE, BindingKey
from hgraph.frontends.zoo import llama


def test_every_dimension_is_declared_once_with_its_place():
    assert [d.letter for d in DIMENSIONS] == ["TP", "PP", "CP", "UL"]          # the text order
    assert [d.letter for d in LAYOUT] == ["TP", "UL", "CP", "PP"]              # inside out
    assert [d.letter for d in SEQUENCE] == ["UL", "CP"]
    assert [d.key for d in GROUPED] == [BindingKey.TP, BindingKey.CP, BindingKey.UL]
    assert dims.PP.neighbours == (BindingKey.PP_PREV, BindingKey.PP_NEXT)
    assert [f for f in Scheme.__dataclass_fields__] == [d.name for d in DIMENSIONS]
    assert dims.by_key("pp_next") is dims.PP and dims.by_key(BindingKey.UL) is dims.UL
    assert dims.by_comm_point(hgraph.meta.CommPoint.CP_KV) is dims.CP
    with pytest.raises(KeyError):
        dims.by_key("ep")


DEGREES = (1, 2, 3)


@pytest.mark.parametrize("degrees", list(itertools.product(DEGREES, repeat=len(DIMENSIONS))))
def test_scheme_text_and_rank_count_follow_the_registry(degrees):
    s = Scheme(*degrees)
    text = "".join(f"{d.letter}{n}" for d, n in zip(DIMENSIONS, degrees) if d.always_written or n != 1)
    assert str(s) == text
    assert Scheme.parse(text) == s == Scheme.parse(text.lower())
    assert s.num_ranks == degrees[0] * degrees[1] * degrees[2] * degrees[3]
    assert s.seq == s.cp * s.ul
    strategy = Strategy.parse(f"2x{text}+TP1PP1")
    assert Strategy.parse(str(strategy)) == strategy


def _layout_by_hand(strategy: Strategy) -> list[dict]:
    """Every rank's coordinates, numbering the ranks in the documented order: pipelines in turn, in each
    the stages, in each stage the CP shards, in each shard the Ulysses ranks, in each the TP ranks."""
    out = []
    for i, p in enumerate(strategy.pipelines):
        for stage, cp, ul, tp in itertools.product(range(p.pp), range(p.cp), range(p.ul), range(p.tp)):
            out.append({"pipeline": i, "pp": stage, "cp": cp, "ul": ul, "tp": tp})
    return out


@pytest.mark.parametrize("text", ["TP2PP2CP2UL2+TP1PP3+2xTP2PP1UL3", "TP3PP2CP3+1xTP1PP1CP2UL2"])
def test_groups_and_bindings_are_the_ranks_differing_in_one_coordinate(text):
    strategy = Strategy.parse(text)
    coords = _layout_by_hand(strategy)
    assert len(coords) == strategy.num_ranks
    for rank, c in enumerate(coords):
        got = strategy.coord(rank)
        assert (got.pipeline, got.stage, got.tp_rank, got.cp_rank) == (
            c["pipeline"], c["pp"], c["tp"], c["cp"] * strategy.pipelines[c["pipeline"]].ul + c["ul"])
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
    assert list(bindings) == ["tp", "cp", "ul", "pp_next"]
    assert bindings["tp"] == (0, 1) and f"{BindingKey.TP}" == str(BindingKey.TP) == "tp"
    assert repr(BindingKey.UL) == "'ul'"
    assert json.loads(json.dumps({k: list(v) for k, v in bindings.items()})) == {
        "tp": [0, 1], "cp": [0], "ul": [0], "pp_next": [2]}


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
