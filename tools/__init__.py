"""The hgraph command line, dumps, visualisation, plots and benchmarks."""
