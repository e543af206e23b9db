"""Training on each worker: the loop, step plan and optimizer, checkpoints, the run directory, metrics."""
