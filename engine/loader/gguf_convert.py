"""Convert a GGUF file (llama.cpp's format) into a Hugging Face model folder.

The folder holds ``config.json`` and ``generation_config.json`` built from the GGUF
metadata, the tokenizer files and chat template (through transformers' GGUF tokenizer
support), and dequantized weights in safetensors under Hugging Face tensor names, so the
rest of the engine loads one format only.

Weights are stored in float32 by default. Dequantized values (``scale * q + min`` with
float16 scales) are exact in float32 and are not in float16/bfloat16, and float32 is
what transformers' own GGUF loader produces, so our logits can be compared with its
tightly. The default model is 135M parameters (540 MB); pass ``dtype`` for large models.

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

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

from engine.loader.default_model import read_gguf_source, record_gguf_source
from engine.common.load_errors import (
    CorruptWeights,
    ModelLoadError,
    ModelNotFound,
    UnsupportedArchitecture,
    UnsupportedConfig,
    UnsupportedGGUFType,
)
from engine.loader.gguf_tensors import open_tensors
from engine.loader.weights import INDEX_FILE, SINGLE_FILE

log = logging.getLogger(__name__)

# GGUF ``general.architecture`` -> (Hugging Face architecture, model_type).
GGUF_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
}
# llama.cpp files Mixtral under "llama", with experts (``llama.expert_count``).
_LLAMA_WITH_EXPERTS = ("MixtralForCausalLM", "mixtral")

# llama.cpp tensor names (gguf-py ``tensor_mapping``) -> Hugging Face names.
_TOP_LEVEL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_PER_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # Mixtures of experts (gguf-py's MODEL_TENSOR.FFN_*_EXP / *_SHEXP names).
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# A layer's experts stacked in one GGUF tensor ``[E, rows, cols]`` -> one Hugging Face
# tensor per expert, ``mlp.experts.E.<proj>`` (Mixtral: ``block_sparse_moe.experts.E.w1``).
_STACKED_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_MIXTRAL_EXPERT_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_ROPE_FREQS = "rope_freqs.weight"  # llama3 RoPE factors; folded into config.json

SHARD_BYTES = 2 * 1024**3  # bounds peak host memory while converting large models


def convert_gguf(
    gguf_path: str | Path, out_dir: str | Path, *, dtype: torch.dtype = torch.float32, weights: bool = True
) -> Path:
    """Convert ``gguf_path`` into the Hugging Face folder ``out_dir``: ``config.json``,
    ``generation_config.json``, the tokenizer files, ``gguf_source.json`` (which file it
    came from) and, with ``weights``, the dequantized tensors in safetensors.

    Args:
        gguf_path: a GGUF file of a llama (Mixtral when it has experts), qwen2, qwen3,
            qwen2moe or qwen3moe model; stacked expert tensors (``ffn_*_exps``) are
            dequantized and written one tensor per expert.
        out_dir: destination folder; must not exist yet (an existing complete folder,
            e.g. from a concurrent conversion, is kept and returned).
        dtype: dtype of the stored weights (now, or later by :func:`ensure_gguf_weights`).
        weights: write the tensors now; False leaves them to :func:`ensure_gguf_weights`.

    Returns:
        ``out_dir``.

    Raises:
        CorruptWeights: the file is not a readable GGUF.
        UnsupportedArchitecture: the GGUF architecture is not one of
            :data:`GGUF_ARCHITECTURES`.
        UnsupportedGGUFType: a tensor is stored in a type gguf-py cannot dequantize
            (checked for all tensors before anything is written).
        UnsupportedConfig: RoPE factors that are not Llama 3's.
        ModelLoadError: a tensor without a Hugging Face counterpart, the tokenizer
            cannot be built, or the cache folder cannot be written.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader, gguf_arch, hf_config = _read_checked(gguf_path)

    tmp = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}"
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_partials(out_dir)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as e:
        raise ModelLoadError(f"cannot write the conversion of {gguf_path.name} under {out_dir.parent} ({e}); "
                             "point HEADROOM_CACHE_DIR at a writable folder") from e
    try:
        if weights:
            _write_weights(reader, gguf_path, gguf_arch, hf_config, tmp, dtype)
        _write_config(hf_config, tmp)
        _write_tokenizer(gguf_path, tmp)
        _write_generation_config(reader, tmp)
        record_gguf_source(tmp, gguf_path, str(dtype).removeprefix("torch."))
        _publish(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _read_checked(gguf_path: Path) -> tuple[Any, str, dict]:
    """``(reader, GGUF architecture, Hugging Face config)`` of ``gguf_path``, with every
    refusal of :func:`convert_gguf` made before anything is written."""
    reader = _open(gguf_path)
    gguf_arch = _field(reader, "general.architecture")
    if gguf_arch not in GGUF_ARCHITECTURES:
        raise UnsupportedArchitecture(
            f"{gguf_path}: GGUF architecture {gguf_arch!r} is not supported; headroom "
            f"converts {', '.join(GGUF_ARCHITECTURES)}"
        )
    _check_types(reader, gguf_path)
    return reader, gguf_arch, _hf_config(reader, gguf_path, gguf_arch)


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
    reader, gguf_arch, hf_config = _read_checked(gguf_path)
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


def _open(gguf_path: Path) -> Any:
    from gguf import GGUFReader

    if not gguf_path.is_file():
        raise ModelLoadError(f"{gguf_path} is not a file")
    try:
        return GGUFReader(gguf_path)
    except (ValueError, OSError, IndexError, KeyError, TypeError) as e:
        # gguf's reader fails on a numpy reshape where the file is truncated: the tensor
        # table's own check names that (open_tensors raises CorruptWeights saying so).
        open_tensors(gguf_path).release()
        raise CorruptWeights(
            f"{gguf_path} is not a readable GGUF file ({e}); download it again"
        ) from e


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _check_types(reader: Any, gguf_path: Path) -> None:
    from gguf import dequantize

    for t in reader.tensors:
        try:
            dequantize(t.data[:1], t.tensor_type)  # one row: cheap, and hits the same dispatch
        except NotImplementedError:
            raise UnsupportedGGUFType(
                f"{gguf_path}: tensor {t.name} is stored as {t.tensor_type.name}, which "
                "headroom cannot dequantize; use a GGUF with F32/F16/BF16, Q4_0..Q8_0, "
                "K-quants or IQ-quants, or the original Hugging Face checkpoint"
            ) from None


def _hf_config(reader: Any, gguf_path: Path, gguf_arch: str) -> dict[str, Any]:
    """config.json fields, following transformers' ``integrations/ggml.py`` mapping."""
    architecture, model_type = GGUF_ARCHITECTURES[gguf_arch]
    experts = int(_field(reader, f"{gguf_arch}.expert_count", 0) or 0)
    if gguf_arch == "llama" and experts:
        architecture, model_type = _LLAMA_WITH_EXPERTS

    def get(key: str, default: Any = None) -> Any:
        value = _field(reader, f"{gguf_arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{gguf_path} lacks the metadata key {gguf_arch}.{key}")
        return value

    names = {t.name for t in reader.tensors}
    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    vocab = _field(reader, f"{gguf_arch}.vocab_size")
    if vocab is None:  # older files: the vocabulary length is the truth
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    head_dim = _field(reader, f"{gguf_arch}.attention.key_length") or (hidden // heads)
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(head_dim),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(get("context_length")),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }
    if gguf_arch == "qwen2moe":
        config["qkv_bias"] = "blk.0.attn_q.bias" in names
    elif gguf_arch != "qwen2":  # Qwen2's q/k/v bias is implied by its architecture
        config["attention_bias"] = "blk.0.attn_q.bias" in names
    if experts:
        config.update(_moe_config(reader, gguf_arch, experts, names, config["num_hidden_layers"], get))
    scaling = _rope_scaling(reader, gguf_path, gguf_arch, config)
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config


def _moe_config(reader: Any, gguf_arch: str, experts: int, names: set[str], layers: int, get) -> dict[str, Any]:
    """The mixture-of-experts fields of config.json. GGUF has no ``mlp_only_layers``:
    a layer without a router (``ffn_gate_inp``) is dense. Whether the top-k weights are
    renormalized is ``expert_weights_norm`` where the file says, else the family's rule
    as llama.cpp builds it (Qwen3-MoE and Mixtral yes, Qwen2-MoE no)."""
    used = int(get("expert_used_count"))
    if gguf_arch == "llama":
        return {"num_local_experts": experts, "num_experts_per_tok": used}
    moe: dict[str, Any] = {
        "num_experts": experts,
        "num_experts_per_tok": used,
        "moe_intermediate_size": int(get("expert_feed_forward_length")),
        "norm_topk_prob": bool(_field(reader, f"{gguf_arch}.expert_weights_norm", gguf_arch == "qwen3moe")),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in names],
    }
    if gguf_arch == "qwen2moe":
        moe["shared_expert_intermediate_size"] = int(get("expert_shared_feed_forward_length"))
    return moe


def _rope_scaling(
    reader: Any, gguf_path: Path, gguf_arch: str, config: dict[str, Any]
) -> dict[str, Any] | None:
    scaling_type = _field(reader, f"{gguf_arch}.rope.scaling.type")
    if scaling_type in (None, "none"):
        pass
    elif scaling_type == "linear":
        return {
            "rope_type": "linear",
            "factor": float(_field(reader, f"{gguf_arch}.rope.scaling.factor")),
        }
    else:
        raise UnsupportedConfig(f"{gguf_path}: RoPE scaling {scaling_type!r} is not supported")
    rope_freqs = next((t for t in reader.tensors if t.name == _ROPE_FREQS), None)
    if rope_freqs is None:
        return None
    return _llama3_from_factors(np.asarray(rope_freqs.data, dtype=np.float32), gguf_path, config)


def _llama3_from_factors(
    factors: np.ndarray, gguf_path: Path, config: dict[str, Any]
) -> dict[str, Any]:
    """Recover Llama 3 RoPE parameters from llama.cpp's per-frequency divisors.

    llama.cpp's converter (``LlamaModel.generate_extra_tensors``) stores
    ``inv_freq / inv_freq_llama3`` instead of the parameters; Meta's Llama 3.1+ releases
    all use ``low_freq_factor=1, high_freq_factor=4, original_max_position_embeddings=8192``
    and the largest divisor is ``factor``. We rebuild the divisors from those values and
    accept them only if they match the file.
    """
    from engine.common.config import RopeConfig
    from engine.layers.rope import inv_freq

    rope = RopeConfig(
        theta=config["rope_theta"],
        rope_type="llama3",
        factor=float(factors.max()),
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )
    base = inv_freq(RopeConfig(theta=rope.theta), config["head_dim"])
    rebuilt = (base / inv_freq(rope, config["head_dim"])).numpy()
    if rebuilt.shape != factors.shape or not np.allclose(rebuilt, factors, rtol=1e-4):
        raise UnsupportedConfig(
            f"{gguf_path}: its rope_freqs tensor is not Llama 3 RoPE scaling; convert the "
            "original Hugging Face checkpoint instead"
        )
    return {
        "rope_type": "llama3",
        "factor": rope.factor,
        "low_freq_factor": rope.low_freq_factor,
        "high_freq_factor": rope.high_freq_factor,
        "original_max_position_embeddings": rope.original_max_position_embeddings,
    }


def _hf_name(gguf_name: str) -> str | None:
    stem, _, suffix = gguf_name.rpartition(".")  # suffix: weight | bias
    if stem in _TOP_LEVEL:
        return f"{_TOP_LEVEL[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _PER_LAYER:
        return f"model.layers.{parts[1]}.{_PER_LAYER[parts[2]]}.{suffix}"
    return None


def reverse_llama_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (``LlamaModel.permute`` in
    ``convert_hf_to_gguf.py``), which turns transformers' "rotate_half" RoPE layout into
    GGML's interleaved one; this is transformers' ``_reverse_permute_weights``.

    Args:
        w: ``[n_head * head_dim, ...]`` q or k weight (or bias) as stored in the GGUF.
        n_head: query heads for q, key/value heads for k.

    Returns:
        The tensor in Hugging Face row order, same shape.
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _dequantize(tensor: Any) -> np.ndarray:
    """``[rows, cols]`` (or ``[n]``) float32 values of a GGUF tensor in Hugging Face order."""
    from gguf import dequantize

    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first
    return dequantize(tensor.data, tensor.tensor_type).reshape(shape)


def _converted(
    reader: Any, gguf_path: Path, gguf_arch: str, config: dict[str, Any], dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    for t in tqdm(reader.tensors, desc=f"converting {gguf_path.name}", unit="tensor", disable=None):
        if t.name == _ROPE_FREQS:
            continue
        yield from hf_tensors(t, gguf_path, gguf_arch, config, dtype)


def hf_tensors(
    t: Any, gguf_path: Path, gguf_arch: str, config: dict[str, Any], dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """One GGUF tensor, dequantized, as the Hugging Face tensors it stands for (one per
    expert for a stacked expert tensor), under their names.

    Args:
        config: config.json's fields (``architectures``, ``num_attention_heads``,
            ``num_key_value_heads`` are read).

    Raises:
        ModelLoadError: the tensor has no Hugging Face counterpart.
    """
    stem, _, _ = t.name.rpartition(".")
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _STACKED_EXPERTS:
        yield from _expert_tensors(t, parts[1], _STACKED_EXPERTS[parts[2]], config, dtype)
        return
    name = _hf_name(t.name)
    if name is None:
        raise ModelLoadError(
            f"{gguf_path}: tensor {t.name} has no Hugging Face counterpart for a "
            f"{gguf_arch} model; the file is not a plain {gguf_arch} checkpoint"
        )
    w = torch.from_numpy(np.array(_dequantize(t), dtype=np.float32))
    if name.endswith("shared_expert_gate.weight"):  # llama.cpp may store it as [H]
        w = w.reshape(1, -1)
    if config["architectures"] == [_LLAMA_WITH_EXPERTS[0]] and ".mlp.gate." in name:
        name = name.replace(".mlp.gate.", ".block_sparse_moe.gate.")
    if gguf_arch == "llama" and (".q_proj." in name or ".k_proj." in name):
        heads = config["num_attention_heads" if ".q_proj." in name else "num_key_value_heads"]
        w = reverse_llama_permute(w, heads)
    yield name, w.to(dtype).contiguous()


def _expert_tensors(
    tensor: Any, layer: str, proj: str, config: dict[str, Any], dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """One stacked ``[E, rows, cols]`` GGUF expert tensor, dequantized, as one Hugging
    Face tensor per expert."""
    w = torch.from_numpy(np.array(_dequantize(tensor), dtype=np.float32)).to(dtype)
    if config["architectures"] == [_LLAMA_WITH_EXPERTS[0]]:
        prefix, proj = f"model.layers.{layer}.block_sparse_moe.experts", _MIXTRAL_EXPERT_NAMES[proj]
        names = [f"{prefix}.{e}.{proj}.weight" for e in range(w.shape[0])]
    else:
        names = [f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight" for e in range(w.shape[0])]
    for name, expert in zip(names, w, strict=True):
        yield name, expert.contiguous()


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


def _write_tokenizer(gguf_path: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
        )
    except Exception as e:  # transformers raises many types here; all mean the same to the user
        raise ModelLoadError(
            f"{gguf_path}: cannot build its tokenizer ({type(e).__name__}: {e})"
        ) from e
    tokenizer.save_pretrained(str(out))


def _write_generation_config(reader: Any, out: Path) -> None:
    # Instruct models end a turn with EOT (Llama 3's <|eot_id|>), not only with EOS.
    eos = [_field(reader, f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")]
    eos_ids = list(dict.fromkeys(int(i) for i in eos if i is not None))
    generation: dict[str, Any] = {"eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids}
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    if bos is not None:
        generation["bos_token_id"] = int(bos)
    generation.update(_sampling_fields(reader))
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


# llama.cpp's recommended-sampling metadata (gguf-py ``Keys.General.SAMPLING_*``) ->
# generation_config.json fields; the service takes them as the defaults of unset
# request fields (service.api.sampling_defaults).
_GGUF_SAMPLING = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


def _sampling_fields(reader: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for key, name in _GGUF_SAMPLING.items():
        value = _field(reader, key)
        if value is not None:
            # GGUF stores float32: 0.2 reads back as 0.20000000298...
            fields[name] = int(value) if name == "top_k" else round(float(value), 6)
    if fields:
        fields["do_sample"] = True  # transformers' GenerationConfig wants it with them
    return fields


def _publish(tmp: Path, out_dir: Path) -> None:
    try:
        os.replace(tmp, out_dir)
    except OSError:
        if not (out_dir / "config.json").is_file():
            raise
        # A concurrent conversion finished first; its result is as good as ours.
        log.info("%s appeared during conversion; keeping it", out_dir)
        shutil.rmtree(tmp, ignore_errors=True)


def _remove_stale_partials(out_dir: Path) -> None:
    """Delete temp folders left by conversions whose process died (POSIX only: on
    Windows ``os.kill(pid, 0)`` would terminate the process instead of probing it)."""
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
