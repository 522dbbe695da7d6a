"""The order of a step's collectives: what one rank issues (``collective``), and whether the ranks'
sequences can run under NCCL's rule without hanging (``deadlock``)."""
