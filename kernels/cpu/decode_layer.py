"""One decoder layer of a CPU decode step in one C call (``decode_layer.c``), and its two
halves around the attention (``layer_rows.c``) for a prefill or extend chunk, whose
attention is torch's.

Its reference is the torch layer it stands for, ``DecoderLayer.forward`` of
:mod:`engine.models.decoder` over the torch attention backend, with the same C block
GEMV for the projections (:mod:`kernels.cpu.block_gemv`);
``tests/test_cpu_kernels.py`` compares the two. The structs mirror ``hr_layer`` and
``hr_step`` of the C file field for field.
"""

from __future__ import annotations

import ctypes

import torch

from kernels.attention.kv_store import BLOCK_KV_DTYPES, kv_row_width
from kernels.cpu.block_gemv import GEMV_TYPE_IDS, KQUANT_NAMES, ROWS16_IDS, TYPE_IDS, gemv_path

_F = ctypes.POINTER(ctypes.c_float)
# The projections' block types the C layer reads.
TYPES = frozenset(TYPE_IDS) | frozenset(ROWS16_IDS) | frozenset(KQUANT_NAMES)
PROJ_PARTS = 3  # HR_PROJ_PARTS: runs of rows of one type a projection may have
# The KV pools the C layer reads, by storage dtype (layer.h's kv_type: 0 float32, KV_F16,
# or the blocks' ggml type ids).
KV_TYPE_IDS = {torch.float32: 0, torch.float16: 1,
               **{dtype: TYPE_IDS[fmt.upper()] for fmt, dtype in BLOCK_KV_DTYPES.items()}}


class Proj(ctypes.Structure):
    """``hr_proj``: one projection's blocks, up to :data:`PROJ_PARTS` runs of rows of one
    type each, stacked along the output."""

    _fields_ = [("blocks", ctypes.c_void_p * PROJ_PARTS), ("type", ctypes.c_int32 * PROJ_PARTS),
                ("parts", ctypes.c_int32), ("rows", ctypes.c_int64 * PROJ_PARTS)]


class Layer(ctypes.Structure):
    """``hr_layer``: a layer's shapes and weight pointers (the tensors must outlive it)."""

    _fields_ = [("hidden", ctypes.c_int64), ("num_heads", ctypes.c_int64), ("num_kv_heads", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("intermediate", ctypes.c_int64),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
                ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p), ("qkv_bias", ctypes.c_void_p),
                ("qkv", Proj), ("o", Proj), ("gate_up", Proj), ("down", Proj),
                ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
                ("kv_type", ctypes.c_int32), ("pad", ctypes.c_int32)]


class Step(ctypes.Structure):
    """``hr_step``: the decode step's rows (one new token each)."""

    _fields_ = [("rows", ctypes.c_int64), ("page_size", ctypes.c_int64), ("max_pages", ctypes.c_int64),
                ("positions", ctypes.c_void_p), ("out_slots", ctypes.c_void_p), ("seq_lens", ctypes.c_void_p),
                ("page_table", ctypes.c_void_p), ("cos_sin", ctypes.c_void_p),
                ("threads", ctypes.c_int32), ("first", ctypes.c_int32), ("path", ctypes.c_int32),
                ("pad", ctypes.c_int32)]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def proj(parts: list[tuple[torch.Tensor, str]]) -> Proj:
    """The ``hr_proj`` of up to :data:`PROJ_PARTS` runs ``(blocks, type_name)``, uint8
    ``blocks`` ``[N_i, K / block_elements * block_bytes]`` of a type of :data:`TYPES`,
    stacked in this order along the output.

    Raises:
        ValueError: no part, more than :data:`PROJ_PARTS`, or a type the layer does not read.
    """
    if not 1 <= len(parts) <= PROJ_PARTS or any(t not in TYPES for _, t in parts):
        raise ValueError(f"a C decode projection takes 1 to {PROJ_PARTS} runs of {sorted(TYPES)}; got "
                         f"{[t for _, t in parts]}")
    p = Proj()
    p.parts = len(parts)
    for i, (blocks, type_name) in enumerate(parts):
        p.blocks[i], p.type[i], p.rows[i] = blocks.data_ptr(), (GEMV_TYPE_IDS | ROWS16_IDS)[type_name], blocks.shape[0]
    return p


def layer(*, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, intermediate: int, eps: float,
          scale: float, input_norm: torch.Tensor, post_norm: torch.Tensor, q_norm: torch.Tensor | None,
          k_norm: torch.Tensor | None, qkv_bias: torch.Tensor | None, qkv: Proj, o: Proj, gate_up: Proj | None,
          down: Proj | None) -> Layer:
    """An ``hr_layer``; the norms and bias float32 and contiguous (the caller keeps them
    alive); the KV buffers are set per step (:func:`run`), as a replan may move them.
    ``gate_up`` and ``down`` None: a layer without an MLP (a mixture-of-experts layer's
    attention half; :func:`run` hands back the post-attention norm's rows)."""
    gate_up, down = (Proj(), Proj()) if gate_up is None or down is None else (gate_up, down)
    return Layer(hidden, num_heads, num_kv_heads, head_dim, intermediate, eps, scale, _ptr(input_norm),
                 _ptr(post_norm), _ptr(q_norm), _ptr(k_norm), _ptr(qkv_bias), qkv, o, gate_up, down, None, None)


def step(*, positions: torch.Tensor, out_slots: torch.Tensor, seq_lens: torch.Tensor, page_table: torch.Tensor,
         page_size: int, cos_sin: torch.Tensor, threads: int) -> Step:
    """An ``hr_step``: int64 ``[B]`` ``positions``, ``out_slots``, ``seq_lens`` and
    ``[B, max_pages]`` ``page_table`` (contiguous, CPU), float32 ``cos_sin``
    ``[max_pos, D]``."""
    return Step(positions.shape[0], page_size, page_table.shape[1], positions.data_ptr(), out_slots.data_ptr(),
                seq_lens.data_ptr(), page_table.data_ptr(), cos_sin.data_ptr(), threads, 0)


def quantize_kv(lib: ctypes.CDLL, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The layer's KV store alone: float32 ``x [rows, n]`` in a pool of storage ``dtype``
    (a key of :data:`KV_TYPE_IDS`; ``n % 32 == 0`` for blocks), ``[rows,
    kv_row_width(dtype, n)]``; :func:`kernels.attention.kv_store.to_kv_dtype` is its
    reference (llama.cpp's quantizer for blocks, torch's cast for float16)."""
    x = x.float().contiguous()
    out = torch.empty(x.shape[0], kv_row_width(dtype, x.shape[1]), dtype=dtype)
    lib.hr_quantize_kv(KV_TYPE_IDS[dtype], x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
    return out


def scratch_bytes(lib: ctypes.CDLL, spec: Layer, rows: int, max_len: int) -> int:
    """Bytes of scratch :func:`run` needs for ``rows`` rows over ``max_len`` tokens."""
    return lib.hr_decode_scratch_bytes(ctypes.byref(spec), rows, max_len)


def run(lib: ctypes.CDLL, spec: Layer, st: Step, h: torch.Tensor, residual: torch.Tensor, k_cache: torch.Tensor,
        v_cache: torch.Tensor, scratch: torch.Tensor, max_len: int, first: bool) -> None:
    """One layer: ``h`` (float32 ``[B, hidden]``, the previous layer's MLP output) becomes
    this layer's MLP output (a layer without one: its MLP's input, the post-attention
    norm of the residual stream) and ``residual`` (same shape; written from ``h`` when
    ``first``) is updated, both in place; the new keys and values go to ``k_cache`` /
    ``v_cache`` (float32 or float16 ``[slots, Hk, D]``, or a q8_0/q4_0 pool's bytes ``[slots, Hk,
    D / 32 * 34 (18)]``, :mod:`kernels.attention.kv_store`) at the step's slots.

    Raises:
        RuntimeError: the kernel refused a projection's block type, or a block pool of
            heads that are not whole blocks.
    """
    _point(spec, st, k_cache, v_cache, first)
    if lib.hr_decode_layer(ctypes.byref(spec), ctypes.byref(st), h.data_ptr(), residual.data_ptr(),
                           scratch.data_ptr(), max_len) != 0:
        raise RuntimeError("the CPU decode layer refused a projection's block type or the KV pool's head dim")


def _point(spec: Layer, st: Step, k_cache: torch.Tensor, v_cache: torch.Tensor, first: bool) -> None:
    """The layer's pool and KV format, and the step's first-layer flag and GEMV path."""
    spec.k_cache, spec.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
    spec.kv_type = KV_TYPE_IDS[k_cache.dtype]
    st.first = int(first)
    st.path = gemv_path()


def run_in(lib: ctypes.CDLL, spec: Layer, st: Step, h: torch.Tensor, residual: torch.Tensor, k_cache: torch.Tensor,
           v_cache: torch.Tensor, scratch: torch.Tensor, first: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layer up to its attention (``hr_layer_in``) for a step whose rows are any
    tokens (a prefill or extend chunk's): ``residual`` updated from ``h`` as :func:`run`
    does, the new keys and values written to the pool at the step's slots. ``scratch``:
    at least :func:`scratch_bytes` for the rows and ``max_len`` 0.

    Returns:
        ``(q, k, v)``: views of the scratch, float32 ``[B, Hq, D]``, ``[B, Hk, D]``,
        ``[B, Hk, D]``, q and k normed (per head, where the layer has it) and rotated;
        valid until the scratch is next written.

    Raises:
        RuntimeError: the kernel refused a projection's block type.
    """
    _point(spec, st, k_cache, v_cache, first)
    if lib.hr_layer_in(ctypes.byref(spec), ctypes.byref(st), h.data_ptr(), residual.data_ptr(), scratch.data_ptr()):
        raise RuntimeError("the CPU layer refused a projection's block type")
    rows, hidden, d = st.rows, spec.hidden, spec.head_dim
    q_size, kv_size = spec.num_heads * d, spec.num_kv_heads * d
    qkv = scratch[: 4 * rows * (hidden + q_size + 2 * kv_size)].view(torch.float32)[rows * hidden:].view(rows, -1)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=1)
    return q.view(rows, -1, d), k.view(rows, -1, d), v.view(rows, -1, d)


def run_out(lib: ctypes.CDLL, spec: Layer, st: Step, attn: torch.Tensor, h: torch.Tensor, residual: torch.Tensor,
            scratch: torch.Tensor) -> None:
    """The layer after its attention (``hr_layer_out``): ``attn`` (float32 ``[B, Hq D]``,
    contiguous) the attention's rows; ``h`` becomes the layer's MLP output (its MLP's
    input where it has none) and ``residual`` is updated, in place, as :func:`run` does.

    Raises:
        RuntimeError: the kernel refused a projection's block type.
    """
    if lib.hr_layer_out(ctypes.byref(spec), ctypes.byref(st), attn.data_ptr(), h.data_ptr(), residual.data_ptr(),
                        scratch.data_ptr()):
        raise RuntimeError("the CPU layer refused a projection's block type")
