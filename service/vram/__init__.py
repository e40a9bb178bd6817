"""GPU memory while the service runs: memory sources, the simulated card, the watcher,
the replan controller."""
