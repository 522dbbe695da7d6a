"""Runtime: executor, process groups, sharded optimizer, graph cache, trainer."""
