"""Keeping the engine worker alive: the supervisor, one worker process, the routing of
requests in flight, and the reaping of stale workers."""
