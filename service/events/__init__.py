"""The events the UI reads, and their hub: the event types (:mod:`.schemas`), the control
API's bodies (:mod:`.control_schemas`), the hub and its subscriptions (:mod:`.hub`,
:mod:`.subscription`), and the JSON Schema export for ``ui-bridge/``
(:mod:`.export_schema`). What publishes to the hub sits above: the supervisor, the VRAM
watcher, :mod:`service.supervision.engine_events_to_ui`; the socket and the control
routes are :mod:`service.control`."""
