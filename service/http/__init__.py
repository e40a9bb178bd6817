"""The HTTP server, on top: the app that assembles the API, the control plane and the
dashboard (:mod:`.app`), the security middleware and log redaction (:mod:`.security`),
the dashboard's routes (:mod:`.dashboard`) and graceful shutdown (:mod:`.shutdown`)."""
