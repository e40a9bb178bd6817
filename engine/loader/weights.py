"""Iterate the tensors of a Hugging Face folder's safetensors files.

Either one ``model.safetensors`` or shards listed by ``model.safetensors.index.json``.
Files are memory-mapped by ``safetensors.safe_open``, so one tensor at a time is read.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from engine.common.load_errors import CorruptWeights, ModelNotFound

if TYPE_CHECKING:  # torch-free at import: serve's check before loading reads weight_files
    import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of ``model_dir``, in index order.

    Raises:
        ModelNotFound: neither ``model.safetensors`` nor an index is there.
        CorruptWeights: the index is unreadable or names a shard that does not exist.
    """
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = list(dict.fromkeys(weight_map.values()))  # dedupe, keep order
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CorruptWeights(
                f"{index} is not a valid safetensors index ({e}); re-download the model"
            ) from e
        files = [model_dir / name for name in names]
        for f in files:
            if not f.is_file():
                raise CorruptWeights(
                    f"{index} lists {f.name}, which is missing; re-download the model"
                )
        return files
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return [single]
    hint = (
        " (only PyTorch .bin weights found: convert them to safetensors)"
        if any(model_dir.glob("*.bin"))
        else ""
    )
    raise ModelNotFound(f"{model_dir} holds no {SINGLE_FILE} or {INDEX_FILE}{hint}")


def iter_weights(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of every file, CPU tensors in their
    stored dtype.

    Raises:
        ModelNotFound, CorruptWeights: as :func:`weight_files`.
        CorruptWeights: a file is truncated, has a garbage header or cannot be read;
            the message names the file.
    """
    for path in weight_files(model_dir):
        yield from _iter_file(path)


def _iter_file(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                yield name, f.get_tensor(name)
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CorruptWeights(
            f"{path} is corrupt or truncated ({e}); delete it and download or convert the model again"
        ) from e


def check_safetensors_length(path: str | Path) -> None:
    """Refuse a safetensors file shorter than its own header says, reading the header
    only (an 8-byte little-endian length, then that many bytes of JSON): the file must
    reach the largest ``data_offsets`` end of its tensors, counted after the header.

    Raises:
        CorruptWeights: the file is shorter than 8 bytes or than its header, the header
            is not JSON with tensors' ``data_offsets``, or the data ends past the file's
            end; the message names the file, its size and says to download it again.
    """
    path = Path(path)
    fix = "delete it and download or convert the model again"
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CorruptWeights(f"{path} is truncated: {size:,} bytes, shorter than a safetensors header; {fix}")
            length = int.from_bytes(head, "little")
            if 8 + length > size:
                raise CorruptWeights(f"{path} is truncated: {size:,} bytes, shorter than its {length:,}-byte "
                                     f"safetensors header; {fix}")
            header = json.loads(f.read(length))
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise CorruptWeights(f"{path} is corrupt: its safetensors header does not parse ({e}); {fix}") from e
    if 8 + length + end > size:
        raise CorruptWeights(f"{path} is truncated: {size:,} bytes where its tensors end at byte "
                             f"{8 + length + end:,}; {fix}")
