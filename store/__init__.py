"""Where a run's records go: files on disk and on the Hub, checkpoints, policy folders."""
