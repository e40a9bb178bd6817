"""Keeping the engine worker alive: the supervisor (lifecycle, readiness, waits and
unloads, draining), one worker process, the routing of requests in flight, the reaping
of stale workers, and the one place the engine's events become the UI's
(:mod:`.engine_events_to_ui`)."""
