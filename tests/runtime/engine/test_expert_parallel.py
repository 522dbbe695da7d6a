"""Expert parallelism (``EP<n>``) on a dense model trains exactly like single-process Adam.

An EP pipeline's n ranks of a stage hold the same weights and run different whole documents of each
micro-batch (``runtime/data/document_split``): each counts its own loss and pushes its own gradient,
the loss divided by the step's whole number of targets. The schedule mixes EP with TP, PP and CP and
switches every step; the harness (documents, mini-batches, configs, reference) is the one of
``test_executor_equivalence.py``. Its mini-batches hold 3, 4, 3 and 3 documents, all in one micro-batch
of a PP1 pipeline, so the EP4 step leaves an EP rank without a document (it runs a placeholder of
one-token documents, which have no target), and the CP2EP2 step splits each EP rank's documents over
its CP pair.
"""
import pytest
from tests.runtime.engine.equivalence_harness import load_equivalence_harness
from tests.runtime.reference_training import assert_trained_like

from hgraph.runtime.comm.process_groups import GroupCache
from hgraph.runtime.data.document_split import split_documents
from hgraph.runtime.data.micro_batch import MicroBatch, is_placeholder
from hgraph.runtime.engine.loss import IGNORE_INDEX, packed_targets
from hgraph.runtime.engine.sequence_inputs import CP_SHARDINGS, microbatch_inputs, own_documents, placeholder_documents
from hgraph.runtime.train.launch import spawn
from hgraph.runtime.train.trainer import Trainer
from hgraph.strategy import Scheme, Strategy
from hgraph.varlen_attention import cu_seqlens_for

EQ = load_equivalence_harness()
#: llama:tiny (dense) on 4 ranks
DENSE_SCHEDULE = "1xTP1PP1EP4;1xTP2PP1EP2;1xTP1PP2EP2;1xTP1PP1CP2EP2"


def _worker(rank, world):
    groups = GroupCache(rank, world)
    trainer = Trainer(EQ._config("tiny", DENSE_SCHEDULE, world, {}, {}), rank, world, groups)
    steps = [trainer.step(b) for b in EQ._batches()]
    final = trainer.final_state_dict()      # collective: every rank gathers
    return {"losses": [s.loss for s in steps], "strategies": [s.strategy for s in steps],
            "final": final if rank == 0 else None,
            "order_checks": len(trainer.executor.order_verdicts)}


def test_an_ep_rank_runs_its_own_documents_with_their_corpus_indices_or_a_placeholder():
    """Without processes: each EP rank's part of a micro-batch keeps its documents' corpus indices (their
    dropout keys and positions are one device's); a rank without a document runs tp x seq one-token
    documents (2 x tp x seq: a token on every TP and sequence rank under any CP sharding), whose targets are
    all ignored (no loss, no gradient) and whose indices mark them."""
    mb = MicroBatch.pack([[1] * 13, [2] * 5, [3] * 9], [40, 41, 42])
    scheme = Scheme.parse("TP2PP1CP2EP4")
    parts = [own_documents(mb, scheme, r) for r in range(4)]
    assert [p.doc_indices for p in parts[:3]] == [(40,), (42,), (41,)]
    assert parts[1].input_ids.tolist() == [[3] * 9] and parts[1].position_ids.tolist() == [list(range(9))]
    placeholder = parts[3]
    assert placeholder.doc_lengths == (1,) * 8 and is_placeholder(placeholder.doc_indices)
    for text in ("TP1PP1CP2EP2", "TP2PP1CP2UL2EP2", "TP1PP1CP4EP2", "TP1PP1UL4EP2"):     # a token on every rank
        s = Scheme.parse(text)
        for sharding in CP_SHARDINGS:
            assert all(microbatch_inputs(placeholder_documents(s), s, r, sharding, 0, 0)[0].shape[1] > 0
                       for r in range(s.seq)), (text, sharding)
    assert not any(is_placeholder(p.doc_indices) for p in parts[:3])
    assert (packed_targets(placeholder.input_ids, cu_seqlens_for(placeholder.doc_lengths)) == IGNORE_INDEX).all()
    assert own_documents(mb, Scheme.parse("TP2PP1CP2"), 0) is mb


@pytest.fixture(scope="module")
def results():
    return spawn(_worker, 4, timeout_s=300)


def test_the_schedule_has_an_expert_parallel_rank_without_documents():
    """The EP4 step's one micro-batch of 3 documents leaves its fourth EP rank without one (it runs a
    placeholder: ``sequence_inputs.own_documents``), and the CP2EP2 step's 13-token document runs alone on one
    EP rank, its 12 and 2 on the other."""
    batches = EQ._batches()
    first, last = [tuple(len(d) for d in b.docs) for b in (batches[0], batches[-1])]
    assert split_documents(first, 4)[3] == () and len(first) == 3
    assert split_documents(last, 2) == ((2,), (0, 1)) and last == (12, 2, 13)


def test_expert_parallel_ranks_of_a_dense_model_train_like_single_process_adam(results):
    expected = [str(Strategy.parse(s)) for s in DENSE_SCHEDULE.split(";")]
    got = results[0]
    assert got["strategies"] == [expected[k % len(expected)] for k in range(EQ.STEPS)]
    reference = EQ._reference("tiny", {}, {})
    assert set(got["final"]) == set(reference.state)
    assert_trained_like(got["losses"], got["final"], reference)
    assert len({tuple(r["losses"]) for r in results}) == 1
    assert all(r["order_checks"] == len(expected) for r in results)   # --verify-collectives: each new strategy
