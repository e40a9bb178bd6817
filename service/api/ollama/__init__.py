"""Ollama's native API (``/api/chat``, ``/api/generate``, ``/api/tags``, ``/api/show``,
``/api/ps``, ``/api/version``) beside OpenAI's, on the same generation path."""
