"""Compute kernels. Each kernel has a plain-torch reference of the same signature.

The torch references (``rms_norm``, ``activation``, ``rotary``, ``sampling``) run
everywhere, CPU included, and are what the engine uses off CUDA; the Triton versions
(``triton_*`` modules) run on CUDA tensors and are tested against them.
:mod:`kernels.dispatch` picks one per call.
"""
