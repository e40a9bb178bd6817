"""The OpenAI-compatible API (and Ollama's, in :mod:`.ollama`): routes, request and
response schemas, the OpenAPI document, admission (backpressure), a call's prompts and
its generation, and what the routes share (:mod:`.services`). The errors' shape is
:mod:`service.common.errors`."""
