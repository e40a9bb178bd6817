"""The KV cache's storage formats by name (``--kv-cache-dtype``), and what a token costs
in each, without torch (the settings are checked before anything loads).

``auto`` stores keys and values in the model's dtype, ``f16`` in two bytes a value
(llama.cpp's default ``f16``): float16 where the model runs in float32 (the CPU's, half
of ``auto``'s bytes), a 16-bit model's own dtype otherwise; ``fp8`` as float8_e4m3fn (one byte a value). ``q8_0`` and ``q4_0`` store them in llama.cpp's blocks (``block_q8_0``,
``block_q4_0``; its ``--cache-type-k``/``--cache-type-v``): each run of 32 values along
a head's dimension is one block, a float16 scale ``d`` followed by the codes. q8_0: 32
int8 codes, ``d = amax / 127``, ``q = round(x / d)``, 34 bytes. q4_0: 16 bytes of
nibbles (value ``j`` in the low nibble of byte ``j``, value ``16 + j`` in its high
nibble), ``d = m / -8`` with ``m`` the value of the largest magnitude, ``x = (q - 8) d``,
18 bytes. A head's row of ``head_dim`` values is ``head_dim / 32`` blocks, byte for
byte a row of a GGUF tensor of that type (:mod:`kernels.attention.kv_store` writes and
reads them).
"""

from __future__ import annotations

KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "f16", "fp8", "q8_0", "q4_0")
# The plain formats' bytes a value, where the name alone fixes them (``auto``: the model's dtype).
KV_ITEM_BYTES: dict[str, int] = {"f16": 2, "fp8": 1}

# Values per block, and bytes per block, of the block formats.
KV_BLOCK = 32
KV_BLOCK_BYTES: dict[str, int] = {"q8_0": 2 + KV_BLOCK, "q4_0": 2 + KV_BLOCK // 2}


def is_block_format(name: str) -> bool:
    """Whether ``--kv-cache-dtype name`` stores blocks of 32 values with a scale each."""
    return name in KV_BLOCK_BYTES


def kv_values_bytes(name: str, values: int, itemsize: int) -> int:
    """Bytes that ``values`` keys or values take in the format ``name``; ``itemsize``
    is a value's bytes where the format is ``auto`` (the model's dtype); ``f16`` and
    ``fp8`` are :data:`KV_ITEM_BYTES`' own.

    Raises:
        ValueError: a block format and ``values`` not a multiple of 32.
    """
    if not is_block_format(name):
        return values * KV_ITEM_BYTES.get(name, itemsize)
    if values % KV_BLOCK:
        raise ValueError(f"--kv-cache-dtype {name} stores blocks of {KV_BLOCK} values; {values} is not a multiple")
    return values // KV_BLOCK * KV_BLOCK_BYTES[name]


def check_head_dim(name: str, head_dim: int) -> None:
    """Refuse a block format for heads whose dimension is not whole blocks.

    Raises:
        ValueError: naming the option and the head dim.
    """
    if is_block_format(name) and head_dim % KV_BLOCK:
        raise ValueError(f"--kv-cache-dtype {name} stores each head in blocks of {KV_BLOCK} values; this model's "
                         f"head dim {head_dim} is not a multiple of {KV_BLOCK}: use --kv-cache-dtype auto or fp8")
