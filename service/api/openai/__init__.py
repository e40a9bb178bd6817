"""OpenAI's API under ``/v1``: its bodies, its requests, its answers and its routes."""
