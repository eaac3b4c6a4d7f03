"""The training step as a graph: forward + backward + optimizer, autocast, activation checkpointing,
and the truncate/expand path that keeps deep models depth-free."""
