"""Turn what the user passed as ``--model`` into a Hugging Face model folder."""

from __future__ import annotations

import logging
from pathlib import Path

from engine.loader.default_model import add_default_sampling, converted_dir, default_gguf_path
from engine.loader.errors import ModelNotFound

log = logging.getLogger(__name__)

_WHAT_TO_PASS = (
    "pass a Hugging Face model folder (config.json + *.safetensors), a .gguf file, or "
    "nothing for the default model; headroom does not download models"
)


def resolve_model(path: str | Path | None) -> Path:
    """The Hugging Face folder to load for ``path``.

    - ``None``: the embedded default model, converted into the cache on first use
      (with its model card's sampling in ``generation_config.json``).
    - a ``.gguf`` file (or a folder holding exactly one and no ``config.json``):
      converted into the cache once, reused afterwards.
    - a folder with ``config.json``: itself.

    Raises:
        ModelNotFound: the path does not exist or holds no model, or the default model's
            package is missing (the message names the path or the install command).
        Any :class:`~engine.loader.errors.ModelLoadError` of the GGUF conversion.
    """
    if path is None:
        model_dir = _converted(default_gguf_path())
        add_default_sampling(model_dir)
        return model_dir
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelNotFound(f"{p} does not exist; {_WHAT_TO_PASS}")
    if p.is_file():
        if p.suffix.lower() == ".gguf":
            return _converted(p)
        raise ModelNotFound(f"{p} is a file but not a .gguf; {_WHAT_TO_PASS}")
    if (p / "config.json").is_file():
        return p.resolve()
    ggufs = sorted(p.glob("*.gguf"))
    if len(ggufs) == 1:
        return _converted(ggufs[0])
    if ggufs:
        names = ", ".join(g.name for g in ggufs)
        raise ModelNotFound(f"{p} holds several GGUF files ({names}); pass one of them")
    raise ModelNotFound(f"{p} holds no config.json and no .gguf file; {_WHAT_TO_PASS}")


def _converted(gguf_path: Path) -> Path:
    out = converted_dir(gguf_path)
    if (out / "config.json").is_file():
        return out
    from engine.loader.gguf_convert import convert_gguf  # imports torch/gguf: only when needed

    log.info("converting %s into %s (once)", gguf_path, out)
    return convert_gguf(gguf_path, out)
