"""What a GGUF file says about itself, read from its header (no tensor data, no torch).

Used to list the model store: the architecture, the quantization and the context.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path


def read_summary(path: str | Path) -> tuple[str, str, int]:
    """``(architecture, quantization, context tokens)`` of a GGUF file.

    ``architecture`` is ``general.architecture`` (``llama``, ``qwen2``...);
    ``quantization`` the name of ``general.file_type`` as llama.cpp writes it
    (``Q4_K_M``, ``Q8_0``, ``F16``...), else the tensor type holding the most bytes;
    the context is ``<architecture>.context_length`` (0 when absent).

    Raises:
        ValueError, OSError: not a readable GGUF file.
    """
    from gguf import GGUFReader, LlamaFileType

    reader = GGUFReader(Path(path))

    def field(key: str):
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    arch = str(field("general.architecture") or "?")
    file_type = field("general.file_type")
    quantization = ""
    if file_type is not None:
        try:
            quantization = LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_")
        except ValueError:
            quantization = ""
    if not quantization and reader.tensors:
        by_type: Counter[str] = Counter()
        for t in reader.tensors:
            by_type[t.tensor_type.name] += int(t.n_bytes)
        quantization = by_type.most_common(1)[0][0]
    context = field(f"{arch}.context_length")
    return arch, quantization or "?", int(context or 0)
