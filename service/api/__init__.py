"""The OpenAI-compatible API: routes, request and response schemas, error mapping,
the OpenAPI document, admission (backpressure), a call's prompts and its generation."""
