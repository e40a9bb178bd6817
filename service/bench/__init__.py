"""Benchmarks against the service: ``bench serve``, the event fan-out, ``bench chaos``."""
