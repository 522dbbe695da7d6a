"""Planner: cost and memory models, sequence dispatch and packing, strategy selection and proposal."""
