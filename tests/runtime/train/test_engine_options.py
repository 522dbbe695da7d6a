"""The engine's communication options (``[cluster] push-bucket-bytes``, ``pull-bucket-bytes``,
``overlap-push``) reach every Program's ``ParamSync`` and the planner's setup from the run's
config, and change how the step communicates, not what it computes.

One rank in bf16 (its working parameters are not its fp32 masters, so the pull all-gathers them and
the push reduces their gradients), one step of the equivalence harness's first mini-batch, in
process.
"""
import pytest
from tests.runtime.engine.equivalence_harness import load_equivalence_harness

from hgraph.runtime.comm.grad_buckets import DEFAULT_BUCKET_BYTES
from hgraph.runtime.train.trainer import Trainer
from hgraph.runtime.train.model_setup import planner_setup_of

EQ = load_equivalence_harness()
KNOBS = {"push_bucket_bytes": 4096, "pull_bucket_bytes": 1, "overlap_push": False}


def _one_step(options):
    config = EQ._config("tiny", "1xTP1PP1", 1, {}, {"dtype": "bf16", **options})
    trainer = Trainer(config, 0, 1, None)
    result = trainer.step(EQ._batches()[0])
    (state,) = trainer.executor.programs.states().values()
    return result, state.sync, planner_setup_of(config, trainer.compiled, trainer.device)


@pytest.fixture(scope="module")
def runs():
    return {"default": _one_step({}), "knobs": _one_step(KNOBS)}


def test_the_defaults_are_the_engines_own(runs):
    _, sync, setup = runs["default"]
    assert (setup.push_bucket_bytes, setup.overlap_push) == (DEFAULT_BUCKET_BYTES, True)
    assert sync.pushes.bucket_bytes == DEFAULT_BUCKET_BYTES and sync.pushes.in_backward
    assert len(sync.pulls.gathers) < len(sync.params.order)       # parameters gathered together


def test_the_configured_knobs_reach_the_param_sync(runs):
    _, sync, setup = runs["knobs"]
    # ... and the planner's setup, whose push model prices the push as the run issues it
    assert (setup.push_bucket_bytes, setup.overlap_push) == (4096, False)
    assert sync.pushes.bucket_bytes == KNOBS["push_bucket_bytes"]
    assert not sync.pushes.in_backward                            # --no-overlap-push
    # a 1-byte pull bucket holds one parameter: one all-gather per gathered parameter
    gathered = sum(len(g.names) for g in sync.pulls.gathers)
    assert gathered > 1 and len(sync.pulls.gathers) == gathered


def test_the_knobs_change_the_communication_not_the_step(runs):
    assert runs["knobs"][0].loss == runs["default"][0].loss
