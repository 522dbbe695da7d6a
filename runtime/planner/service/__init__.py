"""The planner in a training run: per-iteration planning, setup, the process that plans ahead."""
