"""The control plane: event schemas and hub, the WebSocket and control routes, the local
token, and the schema export for ``ui-bridge/``."""
