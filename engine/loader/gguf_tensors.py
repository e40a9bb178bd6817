"""A GGUF file's tensor table without its metadata values, for loading and pricing.

``gguf.GGUFReader`` parses every key-value field into numpy objects at open: a model's
vocabulary and merges become some 100,000 small arrays, about 160 MiB of memory for the
default model's 98 MB file, held while the reader lives (the engine opened it twice at
start, to price and to load the weights, and its resident memory peaked there). The
weights need only the tensor table: this reads the header, steps over the key-value
section by its lengths (keeping its scalar and string values, not its arrays), and returns gguf's own
``ReaderTensor`` records whose ``data`` are views of one read-only memory map, shaped as
``GGUFReader`` shapes them. The metadata conversion (``gguf_convert``) still uses
``GGUFReader``. Source of the layout: the GGUF specification (ggml's docs/gguf.md).
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np

_MAGIC_BYTES = b"GGUF"  # a GGUF file's first four bytes
# Value types of the key-value section (GGUFValueType) and the bytes of the fixed-size ones.
_STRING, _ARRAY = 8, 9
_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_SIZES = {t: struct.calcsize("<" + f) for t, f in _FORMATS.items()}
_ITEM_TYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
               "I32": np.int32, "I64": np.int64}


class GGUFTensors:
    """``tensors``: the file's ``gguf.ReaderTensor`` records (``field`` is None);
    ``values``: its scalar and string key-values (arrays are stepped over).

    Raises:
        ValueError: not a GGUF this reads (magic, version, layout).
    """

    def __init__(self, path: str | Path) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.gguf_reader import ReaderTensor
        from gguf.quants import quant_shape_to_byte_shape

        self.data = np.memmap(path, mode="r")
        buf = self.data
        offs = 0

        def take(fmt: str) -> tuple:
            nonlocal offs
            _check_within(buf, offs + struct.calcsize("<" + fmt))
            values = struct.unpack_from("<" + fmt, buf, offs)
            offs += struct.calcsize("<" + fmt)
            return values

        def text(length: int, errors: str = "strict") -> str:
            nonlocal offs
            _check_within(buf, offs + length)
            offs += length
            return bytes(buf[offs - length:offs]).decode("utf-8", errors=errors)

        head = bytes(buf[:4])
        if head != _MAGIC_BYTES[:len(head)]:  # a file of another kind, however short
            raise NotGGUF(f"its first bytes are {head!r}, not {_MAGIC_BYTES!r}")
        _, version = take("II")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (big-endian or unknown) is not read here")
        tensor_count, kv_count = take("QQ")
        self.values: dict[str, Any] = {}
        for _ in range(kv_count):
            (key_len,) = take("Q")
            key = text(key_len)
            (value_type,) = take("I")
            if value_type in _FORMATS:
                (self.values[key],) = take(_FORMATS[value_type])
            elif value_type == _STRING:
                (length,) = take("Q")
                self.values[key] = text(length, errors="replace")
            else:
                offs = _skip_value(buf, offs, value_type)
        alignment = self.values.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError("Invalid alignment: must be a non-zero power of two")
        infos = []
        for _ in range(tensor_count):
            (name_len,) = take("Q")
            name = text(name_len)
            (n_dims,) = take("I")
            dims = take(f"{n_dims}Q")
            raw_type, offset = take("IQ")
            infos.append((name, dims, raw_type, offset))
        start = offs + (-offs % alignment)
        tensors, names = [], set()
        for name, dims, raw_type, offset in infos:
            if name in names:
                raise ValueError(f"Found duplicated tensor with name {name}")
            names.add(name)
            ggml_type = GGMLQuantizationType(raw_type)
            n_elems = int(np.prod(dims)) if dims else 1
            block_size, type_size = GGML_QUANT_SIZES[ggml_type]
            n_bytes = n_elems * type_size // block_size
            np_dims = tuple(reversed(dims))
            item_type = _ITEM_TYPES.get(ggml_type.name)
            if item_type is None:
                item_type, count = np.uint8, n_bytes
                np_dims = quant_shape_to_byte_shape(np_dims, ggml_type)
            else:
                count = n_elems
            at = start + offset
            if at + n_bytes > len(buf):
                raise ValueError(f"tensor {name} ends at byte {at + n_bytes:,} of a {len(buf):,}-byte file: "
                                 "it is truncated")
            data = np.ndarray((count,), dtype=item_type, buffer=buf, offset=at).reshape(np_dims)
            tensors.append(ReaderTensor(name=name, tensor_type=ggml_type, shape=np.array(dims, dtype=np.uint64),
                                        n_elements=n_elems, n_bytes=n_bytes, data_offset=at, data=data, field=None))
        self.tensors: list[Any] = tensors

    def release(self) -> None:
        """Drop the pages of the file read so far from this process's resident memory
        (``madvise(MADV_DONTNEED)`` on the read-only map: a later read maps them again from
        the page cache); nothing where the platform lacks it."""
        import mmap

        raw = getattr(self.data, "_mmap", None)
        if raw is not None and hasattr(raw, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            raw.madvise(mmap.MADV_DONTNEED)


class NotGGUF(ValueError):
    """The file does not begin with GGUF's magic: it is some other kind of file."""


def _check_within(buf: np.memmap, end: int) -> None:
    """Raise ValueError saying the file is truncated when its header needs bytes up to
    ``end`` (exclusive) past the file's ``len(buf)`` bytes."""
    if end > len(buf):
        raise ValueError(f"its header goes on past the end of the {len(buf):,}-byte file: it is truncated, "
                         "shorter than its header says")


def _skip_value(buf: np.memmap, offs: int, value_type: int) -> int:
    """The offset after one key-value value of ``value_type`` at ``offs``.

    Raises:
        ValueError: an unknown value type.
    """
    if value_type in _SIZES:
        return offs + _SIZES[value_type]
    if value_type == _STRING:
        _check_within(buf, offs + 8)
        (length,) = struct.unpack_from("<Q", buf, offs)
        return offs + 8 + length
    if value_type == _ARRAY:
        _check_within(buf, offs + 12)
        item_type, count = struct.unpack_from("<IQ", buf, offs)
        offs += 12
        if item_type in _SIZES:
            return offs + _SIZES[item_type] * count
        for _ in range(count):  # strings (or nested arrays): each carries its length
            offs = _skip_value(buf, offs, item_type)
        return offs
    raise ValueError(f"unknown GGUF value type {value_type}")


def open_tensors(gguf_path: Path) -> GGUFTensors:
    """:class:`GGUFTensors` of ``gguf_path``.

    Raises:
        ModelLoadError: the path is not a file.
        CorruptWeights: the file is not a GGUF (its first bytes say so; the message names
            what to give instead), or not one this reads (the message says to download it
            again).
    """
    from engine.common.load_errors import CorruptWeights, ModelLoadError

    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise ModelLoadError(f"{gguf_path} is not a file")
    try:
        return GGUFTensors(gguf_path)
    except NotGGUF as e:
        raise CorruptWeights(f"{gguf_path} is not a GGUF file ({e}): give a .gguf file as llama.cpp writes it, "
                             "or a Hugging Face model's folder") from e
    except (ValueError, OSError, IndexError, KeyError, TypeError, struct.error, UnicodeDecodeError) as e:
        raise CorruptWeights(f"{gguf_path} is not a readable GGUF file ({e}); download it again") from e
