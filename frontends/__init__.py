"""Frontends: tracing an nn.Module into the canonical HGraph form; the reference model zoo."""
