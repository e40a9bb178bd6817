"""Compute kernels. Each kernel has a plain-torch reference of the same signature.

The torch references run everywhere (CPU included) and are what the engine uses when
no faster backend is available; Triton versions, when present, are tested against them.
"""
