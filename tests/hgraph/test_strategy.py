import pytest

from hgraph import Cluster, Scheme, Strategy, StrategyError, dims


@pytest.mark.parametrize("text, expected", [
    ("TP2PP1", (Scheme(2, 1),)),
    ("2xTP2PP1+1xTP4PP1", (Scheme(2, 1), Scheme(2, 1), Scheme(4, 1))),
    ("DP4TP2PP1", (Scheme(2, 1),) * 4),
    ("1xTP4PP2CP2+TP1PP1", (Scheme(4, 2, 2), Scheme(1, 1))),
    (" 3 x tp1pp2 + 1xTP2PP1 ", (Scheme(1, 2),) * 3 + (Scheme(2, 1),)),
    ("1xTP2PP1UL2+2xTP1PP1", (Scheme(2, 1, ul=2), Scheme(1, 1), Scheme(1, 1))),
    ("1xTP1PP2EP4+2xTP2PP1EP2", (Scheme(1, 2, ep=4), Scheme(2, 1, ep=2), Scheme(2, 1, ep=2))),
    ("TP2PP1CP2UL2EP4", (Scheme(2, 1, 2, 2, 4),)),
    ("2xtp1pp1ep1", (Scheme(1, 1),) * 2),
])
def test_parse(text, expected):
    assert Strategy.parse(text).pipelines == expected


@pytest.mark.parametrize("text", ["2xTP2PP1+1xTP4PP1", "1xTP1PP1", "1xTP4PP2CP2+2xTP1PP1", "4xTP2PP1",
                                  "1xTP1PP2UL4+1xTP2PP1", "1xTP1PP2EP4+2xTP2PP1EP2", "1xTP2PP1CP2UL2EP4"])
def test_round_trip_and_hash(text):
    s = Strategy.parse(text)
    assert str(s) == text
    assert Strategy.parse(str(s)) == s
    assert hash(Strategy.parse(text)) == hash(s)
    assert {s: 1}[Strategy.parse(text)] == 1


def test_homogeneous_forms_are_equal():
    assert Strategy.parse("DP4TP2PP1") == Strategy.parse("4xTP2PP1") == Strategy.homogeneous(4, Scheme(2, 1))
    assert Strategy.parse("2xTP1PP1+1xTP2PP1") != Strategy.parse("1xTP2PP1+2xTP1PP1")


@pytest.mark.parametrize("text, where", [
    ("2xTP2PQ1", "position 6"),
    ("TP2PP1+", "position 7"),
    ("2xTP2PP1+1yTP4PP1", "position 9"),
    ("", "empty"),
    ("0xTP1PP1", "count"),
    ("TP1PP1UL", "position 8"),
    ("TP1PP1UX2", "position 7"),
    ("TP1PP1EP", "position 8"),
    ("TP1PP1EP2CP2", "position 9"),       # EP is written after CP and UL
    ("TP1PP1EQ2", "position 7"),
])
def test_malformed_text_says_where(text, where):
    with pytest.raises(StrategyError, match=where):
        Strategy.parse(text)


def test_scheme_text():
    assert str(Scheme(4, 2, 2)) == "TP4PP2CP2"
    assert Scheme.parse("TP4PP2") == Scheme(4, 2)
    with pytest.raises(StrategyError):
        Scheme(0, 1)


def test_rank_layout_tp_innermost_then_cp_then_stage():
    s = Strategy.parse("1xTP2PP2CP2+1xTP1PP1")
    assert s.num_ranks == 9
    c = s.coord(5)  # pipeline 0: stage 1, cp 0, tp 1
    assert (c.pipeline, c.stage, c.cp_rank, c.tp_rank) == (0, 1, 0, 1)
    assert s.tp_group(0, 1, 1) == [6, 7]
    assert s.cp_group(0, 0, 1) == [1, 3]
    assert s.coord(8).pipeline == 1
    assert [s.rank_of(c.pipeline, c.stage, c.tp_rank, c.cp_rank) for c in s.coords()] == list(range(9))


def test_validate_world_size_and_node_boundary():
    s = Strategy.parse("1xTP4PP1+2xTP2PP1")
    s.validate(Cluster(8, gpus_per_node=8))
    with pytest.raises(StrategyError, match="world size is 6"):
        s.validate(Cluster(6))
    with pytest.raises(StrategyError, match="crossing a node"):
        Strategy.parse("1xTP2PP1+1xTP4PP1+1xTP2PP1").validate(Cluster(8, gpus_per_node=4))


def test_ulysses_ranks_take_the_place_of_cp_ranks():
    s = Strategy.parse("1xTP2PP2UL2")
    assert Scheme.parse("TP2PP2UL2") == s.pipelines[0] and s.pipelines[0].seq == 2
    assert s.num_ranks == 8
    assert s.seq_group(0, 1, 1) == [5, 7] and s.tp_group(0, 0, 1) == [2, 3]
    assert s.ul_group(0, 1, 1, 1) == [5, 7] and s.cp_group(0, 1, 1, 1) == [7]


def test_cp_and_ulysses_together_put_ulysses_inside_and_the_cp_ring_across():
    """TP innermost, then UL, then CP, then the stage: sequence rank s is CP shard s // UL, Ulysses
    rank s % UL; the ring joins the ranks with the same Ulysses rank (the same heads)."""
    s = Strategy.parse("1xTP2PP1CP2UL2")
    p = s.pipelines[0]
    assert str(p) == "TP2PP1CP2UL2" and p.seq == 4 and s.num_ranks == 8
    assert [p.seq_place(r) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert s.seq_group(0, 0, 1) == [1, 3, 5, 7]
    assert s.ul_group(0, 0, 1, 2) == [5, 7] and s.cp_group(0, 0, 1, 2) == [1, 5]
    assert s.ul_group(0, 0, 0, 1) == [0, 2] and s.cp_group(0, 0, 0, 1) == [2, 6]
    three = Strategy.parse("1xTP1PP2CP3UL2+1xTP1PP1UL3")
    assert three.num_ranks == 15 and three.ul_group(0, 1, 0, 5) == [10, 11] and three.cp_group(0, 1, 0, 5) == [7, 9, 11]
    assert three.ul_group(1, 0, 0, 0) == [12, 13, 14] and three.cp_group(1, 0, 0, 2) == [14]
    assert Strategy.parse(str(three)) == three


@pytest.mark.parametrize("text", ["TP1PP1SP4", "1xTP2PP1SP2+1xTP1PP1"])
def test_an_sp_degree_in_a_scheme_says_to_write_ul(text):
    with pytest.raises(StrategyError, match=r"written UL\d") as err:
        Strategy.parse(text)
    assert "\n" not in str(err.value)
    with pytest.raises(StrategyError, match="written UL"):
        Scheme.parse(text.split("+")[0].split("x")[-1])


def test_expert_parallel_ranks_sit_between_the_sequence_ranks_and_the_stage():
    """EP (``Splits.DOCUMENTS``) after the CP and Ulysses ranks, before the stage (Megatron's tp-cp-ep-pp
    order): a TPaPPbCPcULuEPn pipeline occupies a*b*c*u*n ranks, its EP group is the ranks of a stage with
    the same TP and sequence place, and each rank's ``doc_rank`` is its place in that group."""
    s = Strategy.parse("1xTP2PP1EP2+1xTP1PP2CP2EP2")
    assert [p.num_ranks for p in s.pipelines] == [4, 8] and s.num_ranks == 12
    assert str(s.pipelines[1]) == "TP1PP2CP2EP2" and s.pipelines[1].doc_ranks == 2 and s.pipelines[1].seq == 2
    assert [s.coord(r).doc_rank for r in range(12)] == [0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1]
    assert [s.coord(r).tp_rank for r in range(4)] == [0, 1, 0, 1]
    assert [(s.coord(r).stage, s.coord(r).cp_rank) for r in range(4, 12)] == [
        (0, 0), (0, 1), (0, 0), (0, 1), (1, 0), (1, 1), (1, 0), (1, 1)]
    assert [s.bindings(r)["ep"] for r in (0, 1, 2, 3)] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    assert [s.bindings(r)["ep"] for r in (4, 5, 9, 10)] == [(4, 6), (5, 7), (9, 11), (8, 10)]
    assert s.bindings(5)["cp"] == (4, 5) and s.bindings(6)["cp"] == (6, 7) and s.bindings(6)["pp_next"] == (10,)
    assert s.stage_ranks(1, 0) == [4, 5, 6, 7]
    assert [s.rank_of(c.pipeline, c.stage, c.tp_rank, c.cp_rank, c.replica, c.doc_rank) for c in s.coords()] == \
        list(range(12))
    assert s.seq_group(1, 1, doc_rank=1) == [10, 11]
    # a scheme with every dimension: TP innermost, then UL, CP, EP, the stage
    p = Scheme.parse("TP2PP2CP2UL2EP3")
    assert p.num_ranks == 48 and [p.stride(d) for d in (dims.TP, dims.UL, dims.CP, dims.EP, dims.PP)] == [1, 2, 4, 8, 24]
    assert p.coordinates(8 * 2 + 4 + 2 + 1) == (0, 1, 3, 0, 2) and p.local_rank(0, 1, 3, 0, 2) == 23

