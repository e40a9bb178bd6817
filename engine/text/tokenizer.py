"""Load a model's tokenizer from a local folder, never from the network.

One loader for ``headroom generate`` (in-process engine) and ``headroom serve`` (the
service's text side), so both tokenize a prompt identically. Torch-free: the fast
tokenizer (``tokenizer.json``, the Rust ``tokenizers`` library) is loaded through
``PreTrainedTokenizerFast``; ``AutoTokenizer`` would import torch through transformers'
config classes, and the service never imports torch.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast


def check_tokenizer_files(model_dir: str) -> None:
    """Refuse, without loading anything, a ``model_dir`` :func:`load_tokenizer` cannot
    load: the check every command that loads a model runs before it loads the weights.

    Raises:
        FileNotFoundError: ``model_dir`` is not a folder, or it has no ``tokenizer.json``
            (the message names the file and where to get it).
    """
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"model folder {model_dir!r} does not exist")
    if not os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
        raise FileNotFoundError(
            f"no loadable tokenizer in {model_dir!r}: tokenizer.json is missing (copy it "
            f"from the model's Hugging Face repository)"
        )


def load_tokenizer(model_dir: str) -> PreTrainedTokenizerFast:
    """Load the fast tokenizer saved in ``model_dir`` (``tokenizer.json``, with
    ``tokenizer_config.json`` / ``special_tokens_map.json`` when present, as Hugging Face
    writes them).

    transformers is imported here, not at module import, so the rest of ``engine.text``
    stays importable without it.

    Raises:
        FileNotFoundError: ``model_dir`` is not a folder, or it has no ``tokenizer.json``.
        OSError: the folder's tokenizer files cannot be loaded.
    """
    check_tokenizer_files(model_dir)
    from transformers import PreTrainedTokenizerFast

    try:
        return PreTrainedTokenizerFast.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise OSError(
            f"no loadable tokenizer in {model_dir!r} (expected tokenizer.json and "
            f"tokenizer_config.json from the model's Hugging Face repository): {exc}"
        ) from exc
