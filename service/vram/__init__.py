"""GPU memory while the service runs: memory sources, the watcher, the replan controller."""
