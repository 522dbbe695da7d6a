"""Ulysses sequence parallelism (``UL`` schemes) trains exactly like single-process Adam.

A ``ULn`` pipeline splits each micro-batch's tokens contiguously over n ranks; before attention an
all-to-all turns [local tokens, all heads] into [all tokens, heads / n], packed attention runs per
document on whole documents, and the inverse all-to-all brings the output back. The documents
(13, 5, 9, 7, ... tokens) are cut across ranks at arbitrary points. ``tiny`` has 4 query and 2
key/value heads: UL2 splits both, UL4 and TP2UL2 repeat each key/value head twice; ``tiny-tied`` has one
key/value head, repeated on every Ulysses rank.

The harness (documents, mini-batches, configs, reference) is the one of ``test_executor_equivalence.py``;
one spawn of 4 gloo processes runs every case.
"""

import pytest
import torch
from tests.runtime.engine.equivalence_harness import load_equivalence_harness
from tests.runtime.reference_training import assert_trained_like

import hgraph
from hgraph import ops
from hgraph.errors import HGraphError
from hgraph.frontends.zoo import llama
from hgraph.runtime.comm.process_groups import GroupCache
from hgraph.runtime.train.launch import spawn
from hgraph.runtime.train.trainer import Trainer
from hgraph.strategy import Strategy


EQ = load_equivalence_harness()

# (model, schedule: one strategy per step, cycled)
CASES = [
    ("tiny", "1xTP1PP1UL4;1xTP2PP1UL2;1xTP1PP1UL2+2xTP1PP1;1xTP1PP2UL2"),
    ("tiny-tied", "1xTP1PP1UL2+1xTP2PP1;1xTP1PP1UL4"),
]


def _worker(rank, world):
    groups = GroupCache(rank, world)
    out = []
    for model, schedule in CASES:
        trainer = Trainer(EQ._config(model, schedule, world, {}, {}), rank, world, groups)
        steps = [trainer.step(b) for b in EQ._batches()]
        final = trainer.final_state_dict()      # collective: every rank gathers
        out.append({"losses": [s.loss for s in steps], "strategies": [s.strategy for s in steps],
                    "final": final if rank == 0 else None})
    return out


@pytest.fixture(scope="module")
def results():
    return spawn(_worker, 4, timeout_s=300)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_ulysses_schedules_match_single_process_adam(results, case):
    model, schedule = CASES[case]
    result = results[0][case]
    expected = [str(Strategy.parse(s)) for s in schedule.split(";")]
    assert result["strategies"] == [expected[k % len(expected)] for k in range(EQ.STEPS)]
    reference = EQ._reference(model, {}, {})
    assert set(result["final"]) == set(reference.state)
    assert_trained_like(result["losses"], result["final"], reference)
    assert len({tuple(r[case]["losses"]) for r in results}) == 1


def test_a_ulysses_degree_that_does_not_divide_the_heads_is_one_clear_line():
    torch.manual_seed(0)
    compiled = hgraph.compile(llama.build("tiny"))
    with pytest.raises(HGraphError, match=r"4 attention heads do not divide by TP x UL = 8") as err:
        compiled.instantiate("1xTP2PP1UL4").rank(0).graph_module      # rank graphs are built when asked
    assert "\n" not in str(err.value)


def test_a_ulysses_rank_graph_runs_every_attention_between_all_to_alls():
    torch.manual_seed(0)
    gm = hgraph.compile(llama.build("tiny")).instantiate("1xTP2PP1UL2").rank(0).graph_module
    targets = [n.target for n in gm.graph.nodes]
    assert targets.count(ops.ulysses_attention) == 4          # one per layer
    assert ops.packed_attention not in targets and ops.cp_kv_gather_issue not in targets
