"""Convert a GGUF file (llama.cpp's format) into a Hugging Face model folder.

The folder holds ``config.json`` and ``generation_config.json`` built from the GGUF
metadata, the tokenizer files and chat template (through transformers' GGUF tokenizer
support: :mod:`engine.loader.gguf_tokenizer`), and dequantized weights in safetensors under Hugging Face tensor names, so the
rest of the engine loads one format only.

Weights are stored in float32 by default. Dequantized values (``scale * q + min`` with
float16 scales) are exact in float32 and are not in float16/bfloat16, and float32 is
what transformers' own GGUF loader produces, so our logits can be compared with its
tightly. The default model is 135M parameters (540 MB); pass ``dtype`` for large models.
The metadata's reading is :mod:`engine.loader.gguf_config`, the tensors' renaming and
dequantizing :mod:`engine.loader.gguf_hf_tensors`; this module writes the folder.

The conversion writes into a temporary folder next to the destination and renames it
at the end, so an interrupted conversion never leaves a half-written model behind.

The weights can be left out (``weights=False``, what :func:`engine.loader.resolve.resolve_model`
does): the folder then holds the metadata and a record of the GGUF file
(``gguf_source.json``), and :func:`ensure_gguf_weights` writes the float tensors the first
time a load reads them. A load that keeps the GGUF's blocks, or only needs the config
(``headroom plan``), never writes them: they are 4-7 times the size of a K-quant file.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from engine.common.load_errors import ModelLoadError, ModelNotFound, cache_not_writable
from engine.loader.default_model import read_gguf_source, record_gguf_source, remove_stale_partials
from engine.loader.gguf_config import ROPE_FREQS, field, read_checked, sampling_fields
from engine.loader.gguf_hf_tensors import converted_tensors
from engine.loader.gguf_tokenizer import build_tokenizer
from engine.loader.weights import INDEX_FILE, SINGLE_FILE

log = logging.getLogger(__name__)

SHARD_BYTES = 2 * 1024**3  # bounds peak host memory while converting large models


def convert_gguf(
    gguf_path: str | Path, out_dir: str | Path, *, dtype: torch.dtype = torch.float32, weights: bool = True
) -> Path:
    """Convert ``gguf_path`` into the Hugging Face folder ``out_dir``: ``config.json``,
    ``generation_config.json``, the tokenizer files, ``gguf_source.json`` (which file it
    came from) and, with ``weights``, the dequantized tensors in safetensors.

    Args:
        gguf_path: a GGUF file of a llama (Mixtral when it has experts), qwen2, qwen3,
            qwen2moe, qwen3moe, qwen35, qwen35moe or gpt-oss model; stacked expert tensors
            (``ffn_*_exps``) are dequantized and written one tensor per expert
            (:mod:`engine.loader.gguf_qwen35` for Qwen3.5's layout).
        out_dir: destination folder; must not exist yet (an existing complete folder,
            e.g. from a concurrent conversion, is kept and returned).
        dtype: dtype of the stored weights (now, or later by :func:`ensure_gguf_weights`).
        weights: write the tensors now; False leaves them to :func:`ensure_gguf_weights`.

    Returns:
        ``out_dir``.

    Raises:
        CorruptWeights: the file is not a readable GGUF.
        UnsupportedArchitecture: the GGUF architecture is not one of
            :data:`engine.loader.gguf_config.GGUF_ARCHITECTURES`.
        UnsupportedGGUFType: a tensor is stored in a type gguf-py cannot dequantize
            (checked for all tensors before anything is written).
        UnsupportedConfig: RoPE factors that are not Llama 3's.
        ModelLoadError: a tensor without a Hugging Face counterpart, no tokenizer keys, a
            special-token id outside the vocabulary, the tokenizer cannot be built, or the cache folder
            cannot be written.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader, gguf_arch, hf_config = read_checked(gguf_path)

    tmp = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}"
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_partials(out_dir)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as e:
        raise cache_not_writable(gguf_path.name, out_dir.parent, e) from e
    try:
        if weights:
            _write_weights(reader, gguf_path, gguf_arch, hf_config, tmp, dtype)
        _write_config(hf_config, tmp)
        _write_tokenizer(gguf_path, tmp, gguf_arch)
        _write_generation_config(reader, tmp)
        record_gguf_source(tmp, gguf_path, str(dtype).removeprefix("torch."))
        _publish(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def has_weights(model_dir: str | Path) -> bool:
    """Whether ``model_dir`` holds its safetensors weights (``model.safetensors`` or an
    index; :func:`engine.loader.weights.weight_files` checks the shards it lists)."""
    model_dir = Path(model_dir)
    return (model_dir / INDEX_FILE).is_file() or (model_dir / SINGLE_FILE).is_file()


def ensure_gguf_weights(model_dir: str | Path) -> bool:
    """Write the dequantized weights into a folder :func:`convert_gguf` made without them,
    from the GGUF file its ``gguf_source.json`` names, once.

    The tensors go into a temp folder inside ``model_dir`` and are renamed into place,
    the index (or the single ``model.safetensors``) last, so an interrupted write never
    leaves files that pass for complete; a lock file serializes concurrent processes
    (tensor-parallel ranks, two servers), and the one that waited finds the weights
    written. A folder that holds weights already (a conversion made before they were
    written lazily included), or that is no GGUF conversion, is left as it is.

    Returns:
        True when this call wrote the weights, False when there was nothing to do.

    Raises:
        ModelNotFound: the GGUF file the folder was made from is gone.
        ModelLoadError: the GGUF file changed since the folder was made from it, or the
            folder cannot be written.
        Any error of :func:`convert_gguf` reading the file.
    """
    model_dir = Path(model_dir)
    if has_weights(model_dir):
        return False
    source = read_gguf_source(model_dir)
    if source is None:
        return False
    gguf_path = Path(source["gguf"])
    if not gguf_path.is_file():
        raise ModelNotFound(
            f"{model_dir} was converted from {gguf_path}, which is gone; pass the GGUF file to --model "
            "again (the converted folder is found by its content)"
        )
    stat = gguf_path.stat()
    if (stat.st_size, stat.st_mtime_ns) != (source.get("size"), source.get("mtime_ns")):
        raise ModelLoadError(
            f"{gguf_path} changed since {model_dir} was converted from it; pass it to --model again"
        )
    dtype = getattr(torch, str(source.get("dtype", "float32")), None)
    if not isinstance(dtype, torch.dtype):
        dtype = torch.float32
    try:
        with _weights_lock(model_dir):
            if has_weights(model_dir):  # a concurrent process wrote them while we waited
                return False
            _write_weights_into(gguf_path, model_dir, dtype)
    except OSError as e:
        raise ModelLoadError(f"cannot write the weights of {gguf_path} into {model_dir} ({e})") from e
    return True


@contextlib.contextmanager
def _weights_lock(model_dir: Path) -> Iterator[None]:
    """An exclusive lock on ``model_dir/.weights.lock`` (POSIX ``flock``, released by the
    kernel when the process dies); none elsewhere, where a concurrent writer only costs
    the same files written twice, each rename atomic."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with (model_dir / ".weights.lock").open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


_WEIGHTS_PARTIAL = ".weights.partial-"


def _write_weights_into(gguf_path: Path, model_dir: Path, dtype: torch.dtype) -> None:
    """Dequantize ``gguf_path`` into ``model_dir`` (the caller holds the lock)."""
    for stale in model_dir.glob(f"{_WEIGHTS_PARTIAL}*"):  # a writer that died held the lock
        shutil.rmtree(stale, ignore_errors=True)
    log.info("writing the float weights of %s into %s (once)", gguf_path, model_dir)
    reader, gguf_arch, hf_config = read_checked(gguf_path)
    tmp = model_dir / f"{_WEIGHTS_PARTIAL}{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        _write_weights(reader, gguf_path, gguf_arch, hf_config, tmp, dtype)
        names = sorted(p.name for p in tmp.iterdir())
        last = INDEX_FILE if INDEX_FILE in names else SINGLE_FILE
        for name in [n for n in names if n != last] + [last]:
            os.replace(tmp / name, model_dir / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _converted(
    reader: Any, gguf_path: Path, gguf_arch: str, config: dict[str, Any], dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    tensors = tqdm(reader.tensors, desc=f"converting {gguf_path.name}", unit="tensor", disable=None)
    yield from converted_tensors((t for t in tensors if t.name != ROPE_FREQS), gguf_path, gguf_arch, config, dtype)


def _write_weights(
    reader: Any,
    gguf_path: Path,
    gguf_arch: str,
    config: dict[str, Any],
    out: Path,
    dtype: torch.dtype,
) -> None:
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = 0
    shard_names: list[list[str]] = []
    total_bytes = 0
    for name, w in _converted(reader, gguf_path, gguf_arch, config, dtype):
        if shard and shard_bytes + w.nbytes > SHARD_BYTES:
            _save_shard(shard, out, shard_names)
            shard, shard_bytes = {}, 0
        shard[name] = w
        shard_bytes += w.nbytes
        total_bytes += w.nbytes
    _save_shard(shard, out, shard_names)
    count = len(shard_names)
    if count == 1:
        (out / "shard-0.safetensors").rename(out / "model.safetensors")
        return
    # Several shards: named and indexed as save_pretrained writes them.
    weight_map: dict[str, str] = {}
    for i, names in enumerate(shard_names):
        final = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
        (out / f"shard-{i}.safetensors").rename(out / final)
        weight_map.update(dict.fromkeys(names, final))
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _save_shard(tensors: dict[str, torch.Tensor], out: Path, shard_names: list[list[str]]) -> None:
    save_file(
        tensors, str(out / f"shard-{len(shard_names)}.safetensors"), metadata={"format": "pt"}
    )
    shard_names.append(list(tensors))


def _write_config(config: dict[str, Any], out: Path) -> None:
    from transformers import AutoConfig

    # transformers writes the config in its own current format (rope_parameters in v5).
    AutoConfig.for_model(**config).save_pretrained(str(out))


def _write_tokenizer(gguf_path: Path, out: Path, gguf_arch: str) -> None:
    build_tokenizer(gguf_path, gguf_arch).save_pretrained(str(out))


def _write_generation_config(reader: Any, out: Path) -> None:
    # Instruct models end a turn with EOT (Llama 3's <|eot_id|>), not only with EOS.
    eos = [field(reader, f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")]
    eos_ids = list(dict.fromkeys(int(i) for i in eos if i is not None))
    generation: dict[str, Any] = {"eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids}
    bos = field(reader, "tokenizer.ggml.bos_token_id")
    if bos is not None:
        generation["bos_token_id"] = int(bos)
    generation.update(sampling_fields(reader))
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def _publish(tmp: Path, out_dir: Path) -> None:
    try:
        os.replace(tmp, out_dir)
    except OSError:
        if not (out_dir / "config.json").is_file():
            raise
        # A concurrent conversion finished first; its result is as good as ours.
        log.info("%s appeared during conversion; keeping it", out_dir)
        shutil.rmtree(tmp, ignore_errors=True)
