"""A GGUF's tokenizer built by transformers, whatever architecture the file names.

transformers converts a GGUF's tokenizer (its ``tokenizer.ggml.*`` keys) by the file's
architecture, and releases that do not list an architecture refuse its tokenizer
outright: transformers 5.17 answers a ``qwen35moe`` file with "GGUF model with
architecture qwen35moe is not supported yet", though the tokenizer is the byte-level
BPE it reads for ``qwen3``. For such architectures (:data:`STAND_INS`) the tokenizer is
read from a tokenizer-only copy of the file's keys under a stand-in architecture that
every supported transformers converts the same way.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import gguf

from engine.common.load_errors import ModelLoadError
from engine.loader.gguf_gpt_oss import ARCHITECTURES as GPT_OSS_ARCHITECTURES

# llama.cpp architectures whose tokenizer older transformers refuse, and the one whose
# tokenizer conversion is the same (Qwen3.5/3.6's is Qwen3's byte-level BPE).
STAND_INS = {"qwen35": "qwen3", "qwen35moe": "qwen3moe"}


def copy_tokenizer_fields(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> None:
    """Every ``tokenizer.*`` key of ``reader``'s file into ``writer``, types kept."""
    for key, value in reader.fields.items():
        if key.startswith("tokenizer."):
            sub = value.types[-1] if value.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, value.contents(), value.types[0], sub)


def build_tokenizer(gguf_path: Path, gguf_arch: str) -> Any:
    """The fast tokenizer of ``gguf_path`` (module docstring); ``gguf_arch`` is the file's
    ``general.architecture``.

    Raises:
        ModelLoadError: transformers cannot build it (its reason, in words).
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        if gguf_arch in STAND_INS:
            with tempfile.TemporaryDirectory() as tmp:
                copy = Path(tmp) / "tokenizer.gguf"
                writer = gguf.GGUFWriter(str(copy), STAND_INS[gguf_arch])
                copy_tokenizer_fields(gguf.GGUFReader(str(gguf_path)), writer)
                writer.write_header_to_file()
                writer.write_kv_data_to_file()
                writer.write_tensors_to_file()
                writer.close()
                return PreTrainedTokenizerFast.from_pretrained(tmp, gguf_file=copy.name, local_files_only=True)
        # AutoTokenizer reads the file's config first, and transformers' reading of a
        # gpt-oss file's rope.scaling keys fails; the tokenizer itself needs none of it.
        tokenizer_class = PreTrainedTokenizerFast if gguf_arch in GPT_OSS_ARCHITECTURES else AutoTokenizer
        return tokenizer_class.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                               local_files_only=True)
    except Exception as e:  # transformers raises many types here; all mean the same to the user
        raise ModelLoadError(f"{gguf_path}: cannot build its tokenizer ({type(e).__name__}: {e})") from e
