"""Scheduling one iteration on a strategy: dispatch, packing, WLB, DCP, recomputation choice."""
