"""Whether a model's weights are on disk, checked before anything loads: the loader's
own refusal, from the files' tables alone (no tensor data is read).

Torch-free: ``headroom serve`` runs it before its worker starts; ``plan``, ``generate``
and ``bench engine`` before they plan or load.
"""

from __future__ import annotations

from pathlib import Path

from engine.common.config import ModelConfig
from engine.loader.default_model import read_gguf_source
from engine.loader.gguf_names import check_gguf_tensors
from engine.loader.gguf_tensors import open_tensors
from engine.loader.weights import check_safetensors_length, weight_files


def check_weights_on_disk(model_dir: str | Path, config: ModelConfig, gguf_path: str | Path | None) -> None:
    """Refuse a model whose load would fail for weights that are not there.

    Args:
        model_dir: the Hugging Face folder the model loads from (a GGUF's conversion too).
        config: its :class:`~engine.common.config.ModelConfig`.
        gguf_path: the GGUF file behind it, or None (then the file a conversion names in
            its ``gguf_source.json``, if any).

    A Hugging Face folder must hold its safetensors files (one ``model.safetensors`` or
    every shard its index lists), each at least as long as its header says
    (:func:`~engine.loader.weights.check_safetensors_length`); a GGUF's tensor table must list every tensor of
    :func:`~engine.loader.gguf_names.check_gguf_tensors` (a vocab-only GGUF lists none).
    A GGUF that is no longer where a conversion says is left to the loader, which names it.

    Raises:
        ModelNotFound: a folder without ``model.safetensors`` or an index.
        CorruptWeights: an unreadable index, a shard it lists missing, a safetensors file
            shorter than its header says or whose header does not parse, a GGUF that does
            not parse or is shorter than its last tensor's end.
        WeightMismatch: a GGUF without a tensor the model needs (the message names it).
    """
    if gguf_path is None:
        source = read_gguf_source(model_dir)
        gguf_path = source["gguf"] if source is not None else None
    if gguf_path is None:
        for path in weight_files(model_dir):
            check_safetensors_length(path)
        return
    if Path(gguf_path).is_file():
        check_gguf_tensors(config, gguf_path, {t.name for t in open_tensors(Path(gguf_path)).tensors})
