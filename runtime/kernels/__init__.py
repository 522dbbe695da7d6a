"""Attention kernels of the runtime: varlen (packed) attention, context-parallel attention, CP layouts."""
