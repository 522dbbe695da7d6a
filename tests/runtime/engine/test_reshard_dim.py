"""A dimension added through the registry alone trains exactly like single-process Adam.

``RS<n>`` (``tests/hgraph/dim_helpers.py``, registered by ``hgraph.dims.registered`` in this test and in
every spawned rank, never in the production tables) makes its n ranks hold the same weights and tokens
and reshard the activations between the blocks of each stage (a share of the tokens each, all-gathered
back). Everything a rank does with it comes from the registry: the scheme's text and rank layout, its
group (the ``"rs"`` binding, created with the rank's other groups), its coordinates and role (one graph
per replica), its pass, the push shares of its replicas and the loss counted once. The schedule mixes
RS pipelines with TP and PP ones and switches every step; the harness (documents, mini-batches,
configs, reference) is the one of ``test_executor_equivalence.py``.
"""

import pytest
from tests.hgraph.dim_helpers import with_reshard
from tests.runtime.engine.equivalence_harness import load_equivalence_harness
from tests.runtime.reference_training import assert_trained_like

from hgraph.runtime.comm.process_groups import GroupCache
from hgraph.runtime.train.launch import spawn
from hgraph.runtime.train.trainer import Trainer
from hgraph.strategy import Strategy

EQ = load_equivalence_harness()
SCHEDULE = "1xTP1PP1RS2+1xTP2PP1;1xTP1PP2RS2;2xTP1PP1RS2;1xTP2PP1RS2"


def _worker(rank, world):
    with with_reshard():
        trainer = Trainer(EQ._config("tiny", SCHEDULE, world, {}, {}), rank, world, GroupCache(rank, world))
        steps = [trainer.step(b) for b in EQ._batches()]
        final = trainer.final_state_dict()      # collective: every rank gathers
        reshards = sum(n.op == "call_function" and n.target.__name__ == "rs_reshard"
                       for n in trainer.executor.rank_state(steps[-1].strategy).rank_program.graph_module.graph.nodes)
        return {"losses": [s.loss for s in steps], "strategies": [s.strategy for s in steps],
                "final": final if rank == 0 else None, "reshards": reshards}


@pytest.fixture(scope="module")
def results():
    return spawn(_worker, 4, timeout_s=300)


def test_a_registered_resharding_dimension_trains_like_single_process_adam(results):
    with with_reshard():
        expected = [str(Strategy.parse(s)) for s in SCHEDULE.split(";")]
    got = results[0]
    assert got["strategies"] == [expected[k % len(expected)] for k in range(EQ.STEPS)]
    assert all(r["reshards"] > 0 for r in results)       # the last strategy, TP2PP1RS2, reshards on every rank
    reference = EQ._reference("tiny", {}, {})
    assert set(got["final"]) == set(reference.state)
    assert_trained_like(got["losses"], got["final"], reference)
    assert len({tuple(r["losses"]) for r in results}) == 1
