"""Turn what the user passed as ``--model`` into a Hugging Face model folder."""

from __future__ import annotations

import logging
from pathlib import Path

from engine.common.load_errors import ModelNotFound
from engine.loader.default_model import (
    add_default_sampling,
    converted_dir,
    default_gguf_path,
    is_default_gguf,
    names_default_model,
    read_gguf_source,
    record_gguf_source,
    remove_stale_partials,
)

log = logging.getLogger(__name__)

_WHAT_TO_PASS = (
    "pass a Hugging Face model folder (config.json + *.safetensors), a .gguf file, a "
    "name from the store (`headroom models`; `headroom pull REPO[:FILE]` fetches one), "
    "or nothing for the default model"
)


def resolve_model(path: str | Path | None) -> Path:
    """The Hugging Face folder to load for ``path``.

    - ``None``: the embedded default model, converted into the cache on first use
      (with its model card's sampling in ``generation_config.json``; so is its file
      passed by path, a copy or a link, known by content: :func:`is_default_gguf`).
    - a ``.gguf`` file (or a folder holding exactly one and no ``config.json``):
      converted into the cache once, reused afterwards. The conversion holds the
      config, tokenizer and generation config; the float weights are written into it
      only when a load reads them (:func:`engine.loader.gguf_convert.ensure_gguf_weights`,
      which :func:`engine.loader.load.load_model` calls).
    - a folder with ``config.json``: itself.
    - a name of the local store (:mod:`engine.loader.store`, ``headroom pull``) that is
      not a path: its folder, or its GGUF file converted as above.

    Raises:
        ModelNotFound: the path does not exist or holds no model, or the default model's
            package is missing (the message names the path or the install command).
        Any :class:`~engine.common.load_errors.ModelLoadError` of the GGUF conversion.
    """
    found = default_gguf_path() if path is None else locate_model(path)
    if not found.is_file():
        return found
    model_dir = _converted(found)
    if path is None or is_default_gguf(found):  # by content: a copy or link of it too
        add_default_sampling(model_dir)
    return model_dir


def locate_model(path: str | Path) -> Path:
    """What ``--model`` names on disk, torch-free and without converting anything: a
    folder with ``config.json`` (resolved), or a ``.gguf`` file (given itself, or as the
    one such file of a folder without ``config.json``, or a store name's).

    Raises:
        ModelNotFound: empty, missing and no store name, a file that is not a .gguf, a
            folder without a model; the message names the path and what to pass.
    """
    if not str(path).strip():
        raise ModelNotFound(f"the path is empty; {_WHAT_TO_PASS}")
    p = Path(path).expanduser()
    if not p.exists():
        from engine.loader.store import find_model

        stored = find_model(str(path))
        if stored is None and names_default_model(str(path)):
            stored = default_gguf_path()  # `default`, or the name `headroom models` lists it by
        if stored is None:
            raise ModelNotFound(f"{p} does not exist and is no name in the store; {_WHAT_TO_PASS}")
        p = stored
    if p.is_file():
        if p.suffix.lower() == ".gguf":
            return p
        raise ModelNotFound(f"{p} is a file but not a .gguf; {_WHAT_TO_PASS}")
    if (p / "config.json").is_file():
        return p.resolve()
    ggufs = sorted(p.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    if ggufs:
        names = ", ".join(g.name for g in ggufs)
        raise ModelNotFound(f"{p} holds several GGUF files ({names}); pass one of them")
    raise ModelNotFound(f"{p} holds no config.json and no .gguf file; {_WHAT_TO_PASS}")


def gguf_file(path: str | Path | None) -> Path | None:
    """The GGUF file behind ``--model`` (the default model's for ``None``; a store name's
    file as :func:`resolve_model` finds it), or None when it names a Hugging Face folder
    or nothing that exists (:func:`resolve_model` says why)."""
    if path is None:
        return default_gguf_path()
    try:
        found = locate_model(path)
    except ModelNotFound:
        return None
    return found if found.is_file() else None


def _converted(gguf_path: Path) -> Path:
    out = converted_dir(gguf_path)
    if (out / "config.json").is_file():
        source = read_gguf_source(out)
        if source is not None:
            # The folder is named by content: this path holds the same file, maybe moved.
            record_gguf_source(out, gguf_path, source.get("dtype", "float32"))
        remove_stale_partials(out)  # a conversion killed beside this finished one
        return out
    from engine.loader.gguf_convert import convert_gguf  # imports torch/gguf: only when needed

    log.info("converting the metadata of %s into %s (once)", gguf_path, out)
    return convert_gguf(gguf_path, out, weights=False)
