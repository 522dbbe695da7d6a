"""Attention kernels that need peers: context-parallel attention and the CP layouts of a micro-batch."""
