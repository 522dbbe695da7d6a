"""One training step on one rank: executor (1F1B), memory accounting and recomputation, optimizer, loss."""
