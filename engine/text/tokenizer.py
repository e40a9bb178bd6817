"""Load a model's tokenizer from a local folder, never from the network."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def load_tokenizer(model_dir: str) -> PreTrainedTokenizerBase:
    """Load the tokenizer saved in ``model_dir`` (``tokenizer.json`` /
    ``tokenizer_config.json``, as Hugging Face writes them).

    transformers is imported here, not at module import: ``AutoTokenizer`` pulls in
    torch (through its config classes), and the rest of ``engine.text`` must stay
    importable without it.

    Raises:
        FileNotFoundError: ``model_dir`` is not a folder.
        OSError: the folder holds no tokenizer transformers can load.
    """
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"model folder {model_dir!r} does not exist")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise OSError(
            f"no loadable tokenizer in {model_dir!r} (expected tokenizer.json or "
            f"tokenizer_config.json from the model's Hugging Face repository): {exc}"
        ) from exc
