"""Compiler passes: GraphModule -> GraphModule functions run in one ordered pipeline."""
