"""A GGUF's tokenizer built by transformers, whatever architecture the file names.

transformers converts a GGUF's tokenizer (its ``tokenizer.ggml.*`` keys) by the file's
architecture, and reads the file's config on the way. Some releases the pin allows
fail there for files whose tokenizer they could build: transformers 5.17 refuses a
``qwen35moe`` file outright ("GGUF model with architecture qwen35moe is not supported
yet"), though its tokenizer is the byte-level BPE it reads for ``qwen3``, and every
release so far fails on a gpt-oss file's ``rope.scaling`` keys. For such architectures
(:data:`STAND_INS`) the tokenizer is read from a tokenizer-only copy of the file's keys
under an architecture that every supported transformers converts the same way.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import gguf

from engine.common.load_errors import ModelLoadError

# llama.cpp architectures whose tokenizer transformers may fail to read from the file
# itself, and the architecture its tokenizer-only copy names (Qwen3.5/3.6's tokenizer is
# Qwen3's byte-level BPE; gpt-oss's copy fails no more once its rope keys are left out).
STAND_INS = {"qwen35": "qwen3", "qwen35moe": "qwen3moe", "gpt-oss": "gpt-oss"}
# The transformers release whose GGUF tokenizer reader takes the pre-tokenizer from the
# file (tokenizer.ggml.pre) rather than from a table of architectures.
MIN_GGUF_READER = (5, 18)
# The special-token ids a conversion reads (generation's stop ids, the prompt's BOS, the
# tokenizer's unknown and padding tokens), by their key's middle name.
SPECIAL_IDS = ("bos", "eos", "eot", "eom", "unknown", "padding")


def copy_tokenizer_fields(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> None:
    """Every ``tokenizer.*`` key of ``reader``'s file into ``writer``, types kept."""
    for key, value in reader.fields.items():
        if key.startswith("tokenizer."):
            sub = value.types[-1] if value.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, value.contents(), value.types[0], sub)


def check_tokenizer_keys(reader: gguf.GGUFReader, gguf_path: Path) -> None:
    """The file holds a tokenizer, and every ``tokenizer.ggml.*_token_id`` of
    :data:`SPECIAL_IDS` it holds names a token of its vocabulary.

    Then its chat templates parse (:func:`check_chat_templates`).

    Raises:
        ModelLoadError: the file has no ``tokenizer.ggml.model`` or ``tokenizer.ggml.tokens``
            key (transformers says "Cannot build a tokenizer from a GGUF file stating
            tokenizer None"); a special-token id is negative or past the vocabulary
            (transformers fails on one with an IndexError, or takes a negative one as a
            token counted from the end), naming the key and the command that sets it; a
            chat template that does not parse.
    """
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None or reader.fields.get("tokenizer.ggml.model") is None:
        raise ModelLoadError(
            f"{gguf_path} holds no tokenizer (no tokenizer.ggml.model or tokenizer.ggml.tokens key), and "
            "headroom reads a GGUF's tokenizer from the file itself; download the model's GGUF again, "
            "one written with its vocabulary")
    vocab = len(tokens.data)
    for name in SPECIAL_IDS:
        key = f"tokenizer.ggml.{name}_token_id"
        value = reader.fields.get(key)
        if value is not None and not 0 <= int(value.contents()) < vocab:
            raise ModelLoadError(
                f"{gguf_path}: {key} is {int(value.contents())}, outside its {vocab}-token vocabulary "
                f"(0-{vocab - 1}); the file is damaged or mislabelled: download it again, or set the id "
                f"with gguf-set-metadata {gguf_path} {key} ID")
    check_chat_templates(reader, gguf_path)


def check_chat_templates(reader: gguf.GGUFReader, gguf_path: Path) -> None:
    """Every chat template the file holds (``tokenizer.chat_template``, and named ones as
    ``tokenizer.chat_template.NAME``) parses as transformers compiles it, so a file whose
    template was cut short is refused here, not answered 400 on every chat request.

    Raises:
        ModelLoadError: a template does not parse, naming the key, the line and Jinja's
            reason, and how to replace it.
    """
    from jinja2 import TemplateError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    for key, value in reader.fields.items():
        if not key.startswith("tokenizer.chat_template") or key == "tokenizer.chat_templates":
            continue
        try:
            _compile_jinja_template(str(value.contents()))
        except TemplateError as e:
            line = getattr(e, "lineno", None)
            where = f"line {line}: " if line else ""
            raise ModelLoadError(
                f"{gguf_path}: its chat template ({key}) does not parse ({where}{e}); the file is damaged: "
                f"download it again, or write the model's template in with gguf-new-metadata "
                f"--chat-template-file chat_template.jinja {gguf_path} NEW.gguf") from e


def special_tokens(reader: gguf.GGUFReader) -> dict[str, str]:
    """The file's special tokens by their ids (``tokenizer.ggml.bos_token_id`` ...), as
    ``from_pretrained`` keywords: a transformers release that converts by architecture
    otherwise adds its own ``<s>``/``</s>`` past the vocabulary (5.17 does, for
    ``qwen3moe``) where the file names others."""
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    named = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding"}
    out = {}
    for kwarg, key in named.items():
        value = reader.fields.get(f"tokenizer.ggml.{key}_token_id")
        if value is not None and 0 <= int(value.contents()) < len(tokens):
            out[kwarg] = tokens[int(value.contents())]
    return out


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
                reader = gguf.GGUFReader(str(gguf_path))
                writer = gguf.GGUFWriter(str(copy), STAND_INS[gguf_arch])
                copy_tokenizer_fields(reader, writer)
                writer.write_header_to_file()
                writer.write_kv_data_to_file()
                writer.write_tensors_to_file()
                writer.close()
                return PreTrainedTokenizerFast.from_pretrained(tmp, gguf_file=copy.name, local_files_only=True,
                                                               **special_tokens(reader))
        return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                             local_files_only=True)
    except Exception as e:  # transformers raises many types here; all mean the same to the user
        raise ModelLoadError(f"{gguf_path}: cannot build its tokenizer ({type(e).__name__}: {e}){_upgrade_hint()}") from e


def _upgrade_hint() -> str:
    """What to do where transformers predates the GGUF tokenizer reader that reads a
    file's pre-tokenizer by its ``tokenizer.ggml.pre`` (5.18): before it, a tokenizer is
    converted by a table of architectures that lacks gpt-oss's and Qwen3.5's."""
    import transformers

    major_minor = tuple(int(p) for p in transformers.__version__.split(".")[:2] if p.isdigit())
    if major_minor >= MIN_GGUF_READER:
        return ""
    return (f"; transformers {transformers.__version__} predates the GGUF tokenizer reader of "
            f"{'.'.join(map(str, MIN_GGUF_READER))}: pip install 'transformers>=5.18,<5.25'")
