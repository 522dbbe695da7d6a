"""Training workers whose rank dies or is signalled mid-step, for the tests of lost ranks and of
SIGTERM (spawn targets must live in an importable module)."""
import os
import signal


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


def sigterm_worker(rank, world, config, victim, at_step):
    """Runs the trainer; rank ``victim`` alone gets SIGTERM in step ``at_step``, between posting the
    step's pulls and its forward (its peers never see the signal)."""
    from hgraph.runtime.engine.executor import Executor
    from hgraph.runtime.train.trainer import train_worker
    if rank == victim:
        original, calls = Executor._run_pipeline, []

        def run_pipeline(self, *args):
            calls.append(1)
            if len(calls) == at_step + 1:
                os.kill(os.getpid(), signal.SIGTERM)
            return original(self, *args)
        Executor._run_pipeline = run_pipeline
    return train_worker(rank, world, config)
