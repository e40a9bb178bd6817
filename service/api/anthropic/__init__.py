"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) beside
OpenAI's and Ollama's, on the same generation path."""
