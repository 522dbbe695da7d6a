"""Reference models (a Llama-style decoder with named configs)."""
