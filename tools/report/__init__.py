"""Reports: dumps of programs and of runs, plots, the run record."""
