"""Training: the loop, its configuration, the program cache, step modes, metrics, launch, heartbeat."""
