"""Offline studies of the planner, apart from what a training run imports: the simulator of whole
systems on a length distribution, the papers' baselines (fixed-length packing, homogeneous, HotSPa,
WLB-LLM and DCP systems), and the exact references the fast planner is measured against."""
