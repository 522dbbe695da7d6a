"""Communication of one rank: the context, collectives, process groups, Pull Parameter and Push Gradient."""
