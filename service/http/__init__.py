"""The HTTP server around the routes: the app, security middleware, health, the shared
services object, graceful shutdown."""
