"""headroom's service: CLI, Litestar app, OpenAI API, supervisor of the engine worker.

This package never imports torch: the worker process owns the GPU.
"""
