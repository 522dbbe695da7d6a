"""A training worker whose rank dies mid-step, for the tests of lost ranks (spawn targets must live in
an importable module)."""
import os


def dying_worker(rank, world, config, victim, die_at_step):
    """Runs the trainer; rank ``victim`` dies (no report, no cleanup) in step ``die_at_step``, between
    posting the step's pulls and its forward (every step does both)."""
    from hgraph.runtime.engine.executor import Executor
    from hgraph.runtime.train.trainer import train_worker
    if rank == victim:
        original, calls = Executor._run_pipeline, []

        def run_pipeline(self, *args):
            calls.append(1)
            if len(calls) == die_at_step + 1:
                os._exit(17)
            return original(self, *args)
        Executor._run_pipeline = run_pipeline
    return train_worker(rank, world, config)
