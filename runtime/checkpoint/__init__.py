"""Checkpoints that do not depend on the strategy: shard files and the checkpoints of a run."""
