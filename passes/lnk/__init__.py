"""LNK planning: mutual slices, Pull Parameter / Push Gradient plans, reduce-scatter receiver choice."""
