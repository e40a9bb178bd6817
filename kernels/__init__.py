"""Compute kernels, one folder per operation, each with its plain-torch reference.

Folders: ``attention`` (paged decode and extend, the KV store), ``norm`` (RMSNorm,
residual add + RMSNorm), ``rotary`` (RoPE with the KV-cache store), ``activation``
(SiLU-and-mul), ``gemv`` (decode projections of dense weights), ``moe`` (fused mixture of
experts, dense and over GGUF blocks), ``quant`` (GGUF block formats: the dequantizing
GEMV/GEMM, the int8-activation GEMV), ``sampling``, and ``cpu`` (C kernels built at first
use).

The rule a new kernel follows: in its operation's folder (a new folder for a new
operation), ``reference.py`` holds the plain-torch version, which runs everywhere (CPU
included) and is what the tests compare against; ``triton_kernel.py`` holds the Triton
version of the same signature, for CUDA tensors (a folder split by concern adds
``triton_*.py`` beside it, each with its own docstring). :mod:`kernels.dispatch` picks
one per call; a kernel choice worth a switch is a field of
:class:`kernels.switches.KernelSwitches`, read at call time, which the engine turns into
an option (``--NAME``, ``HEADROOM_NAME``, config key). Nothing here reads the
environment for a switch, nor imports :mod:`engine`: only torch, triton and the standard
library.
"""
