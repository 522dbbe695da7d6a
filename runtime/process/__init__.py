"""What every process of a run shares, whichever room started it: its lifetime (``lifetime``)."""
