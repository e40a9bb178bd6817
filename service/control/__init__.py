"""The control plane, above the API: the control actions carried out on the supervisor
(:mod:`.actions`), the ``/api/events`` socket (:mod:`.socket`), the ``/api/status`` and
``/api/control/*`` routes (:mod:`.routes`) and ``/api/health`` (:mod:`.health`)."""
