"""The OpenAI-compatible API: routes, request and response schemas, error mapping,
the OpenAPI document, admission (backpressure) and one call's generation."""
